"""OLMoE: softmax router, top-k (renormalised only if norm_topk_prob), no shared expert, RMSNorm on q and k
over the whole projection (all heads together, before the head split), optional clip_qkv."""
from __future__ import annotations

from typing import Any

from pagedweight.models.config import Family, ModelConfig, common_from_hf, common_to_hf, reject, require

NAME, ARCH = "olmoe", "OlmoeForCausalLM"


def from_hf(raw: dict[str, Any]) -> ModelConfig:
    bias = bool(raw.get("attention_bias", False))
    clip = raw.get("clip_qkv")
    cfg = ModelConfig(
        family=NAME, **common_from_hf(raw),
        moe_intermediate_size=int(require(raw, "intermediate_size")),
        num_experts=int(require(raw, "num_experts")),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        qkv_bias=bias, o_bias=bias, qk_norm="full", clip_qkv=None if clip is None else float(clip),
    )
    reject(raw, "head_dim != hidden_size / num_attention_heads",
           cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size)
    return cfg


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    out = common_to_hf(cfg, NAME, ARCH)
    out.pop("head_dim", None)  # OLMoE derives it from hidden_size / heads
    out.update(intermediate_size=cfg.moe_intermediate_size, num_experts=cfg.num_experts,
               norm_topk_prob=cfg.norm_topk_prob, attention_bias=cfg.qkv_bias, clip_qkv=cfg.clip_qkv)
    return out


FAMILY = Family(NAME, ARCH, from_hf, to_hf)
