"""MoE model families in plain PyTorch (the SPEC's model contract).

`load_model(dir)` reads a Hugging Face checkpoint directory; `build_model(config)` makes a random one.
"""
from __future__ import annotations

from pathlib import Path

import torch

from pagedweight.models import mixtral, olmoe, qwen2_moe, qwen3_moe
from pagedweight.models.config import Family, ModelConfig, parse_dtype
from pagedweight.models.layers import DenseExperts, DenseKVCache, MoEBlock
from pagedweight.models.model import BlockKey, MoEForCausalLM, block_index, build_model, iter_expert_blocks

FAMILIES: dict[str, Family] = {f.name: f for f in (qwen2_moe.FAMILY, mixtral.FAMILY, qwen3_moe.FAMILY, olmoe.FAMILY)}


def load_model(model_dir: str | Path, dtype: torch.dtype | str = torch.float32,
               device: torch.device | str = "cpu") -> MoEForCausalLM:
    """Load a local HF checkpoint directory (see pagedweight.checkpoint; errors are CheckpointError)."""
    from pagedweight.checkpoint import load_model as _load  # checkpoint imports this package

    return _load(model_dir, dtype=dtype, device=device)


__all__ = [
    "FAMILIES", "BlockKey", "DenseExperts", "DenseKVCache", "Family", "MoEBlock", "MoEForCausalLM", "ModelConfig",
    "block_index", "build_model", "iter_expert_blocks", "load_model", "parse_dtype",
]
