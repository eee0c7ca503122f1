"""Qwen3-MoE: softmax router, top-k renormalised (norm_topk_prob), no shared expert, RMSNorm on q and k
per head (before RoPE)."""
from __future__ import annotations

from typing import Any

from pagedweight.models.config import Family, ModelConfig, common_from_hf, common_to_hf, reject, require

NAME, ARCH = "qwen3_moe", "Qwen3MoeForCausalLM"


def from_hf(raw: dict[str, Any]) -> ModelConfig:
    reject(raw, "use_sliding_window=true", bool(raw.get("use_sliding_window", False)))
    reject(raw, "mlp_only_layers (every layer must be MoE)", bool(raw.get("mlp_only_layers")))
    reject(raw, "decoder_sparse_step != 1 (every layer must be MoE)", raw.get("decoder_sparse_step", 1) != 1)
    # transformers 5 writes num_local_experts, the published configs num_experts
    experts = raw.get("num_experts", raw.get("num_local_experts"))
    bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        family=NAME, **common_from_hf(raw, kv_heads_default=4),
        moe_intermediate_size=int(require(raw, "moe_intermediate_size")),
        num_experts=int(require({"num_experts": experts}, "num_experts")),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        qkv_bias=bias, o_bias=bias, qk_norm="head",
    )


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    out = common_to_hf(cfg, NAME, ARCH)
    out.pop("num_local_experts", None)
    out.update(moe_intermediate_size=cfg.moe_intermediate_size, num_experts=cfg.num_experts,
               norm_topk_prob=cfg.norm_topk_prob, attention_bias=cfg.qkv_bias, decoder_sparse_step=1,
               mlp_only_layers=[], use_sliding_window=False)
    return out


FAMILY = Family(NAME, ARCH, from_hf, to_hf)
