"""Mixtral: softmax router, top-k always renormalised, no shared expert, no attention bias.
Checkpoints name the experts w1 (gate), w3 (up), w2 (down) under `block_sparse_moe`."""
from __future__ import annotations

from typing import Any

from pagedweight.models.config import Family, ModelConfig, common_from_hf, common_to_hf, reject, require

NAME, ARCH = "mixtral", "MixtralForCausalLM"


def from_hf(raw: dict[str, Any]) -> ModelConfig:
    reject(raw, "sliding_window attention", raw.get("sliding_window") is not None)
    return ModelConfig(
        family=NAME, **common_from_hf(raw, rope_theta_default=1e6, kv_heads_default=8),
        moe_intermediate_size=int(require(raw, "intermediate_size")),
        num_experts=int(require(raw, "num_local_experts")),
        norm_topk_prob=True,
    )


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    reject({"model_type": NAME}, "mixtral always renormalises top-k", not cfg.norm_topk_prob)
    out = common_to_hf(cfg, NAME, ARCH)
    out.update(intermediate_size=cfg.moe_intermediate_size, num_local_experts=cfg.num_experts, sliding_window=None)
    return out


FAMILY = Family(NAME, ARCH, from_hf, to_hf, moe_prefixes=("block_sparse_moe", "mlp"), expert_names=("w1", "w3", "w2"))
