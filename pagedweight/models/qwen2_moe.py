"""Qwen2-MoE (Qwen1.5-MoE-A2.7B): softmax router, top-k without renormalisation by default, and a shared
expert whose output is scaled by sigmoid(shared_expert_gate(x)); bias on q/k/v only."""
from __future__ import annotations

from typing import Any

from pagedweight.models.config import Family, ModelConfig, common_from_hf, common_to_hf, reject, require

NAME, ARCH = "qwen2_moe", "Qwen2MoeForCausalLM"


def from_hf(raw: dict[str, Any]) -> ModelConfig:
    reject(raw, "use_sliding_window=true", bool(raw.get("use_sliding_window", False)))
    reject(raw, "mlp_only_layers (every layer must be MoE)", bool(raw.get("mlp_only_layers")))
    reject(raw, "decoder_sparse_step != 1 (every layer must be MoE)", raw.get("decoder_sparse_step", 1) != 1)
    return ModelConfig(
        family=NAME, **common_from_hf(raw, kv_heads_default=16),
        moe_intermediate_size=int(require(raw, "moe_intermediate_size")),
        num_experts=int(require(raw, "num_experts")),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(require(raw, "shared_expert_intermediate_size")),
        qkv_bias=bool(raw.get("qkv_bias", True)),  # configs written before the key existed had the bias
    )


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    out = common_to_hf(cfg, NAME, ARCH)
    out.update(moe_intermediate_size=cfg.moe_intermediate_size, num_experts=cfg.num_experts,
               norm_topk_prob=cfg.norm_topk_prob, shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
               qkv_bias=cfg.qkv_bias, decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False)
    out.setdefault("intermediate_size", cfg.shared_expert_intermediate_size)  # dense-MLP size, unused here
    return out


FAMILY = Family(NAME, ARCH, from_hf, to_hf)
