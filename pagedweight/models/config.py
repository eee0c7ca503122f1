"""`ModelConfig`: the one description of an MoE model that every module codes against.

Family files (qwen2_moe.py, mixtral.py, ...) translate a Hugging Face config.json into it and back;
nothing else reads config.json keys directly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}
DTYPE_NAMES: dict[torch.dtype, str] = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """'bf16' / 'bfloat16' / torch.bfloat16 -> torch.bfloat16; ValueError names the accepted spellings."""
    if isinstance(name, torch.dtype):
        if name not in DTYPE_NAMES:
            raise ValueError(f"unsupported dtype {name}; use one of float32, bfloat16, float16")
        return name
    try:
        return DTYPES[str(name).lower()]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; use one of {', '.join(DTYPES)}") from None


@dataclass
class ModelConfig:
    """Shapes and numerics of one decoder-only MoE model (every layer is an MoE layer)."""

    family: str  # "qwen2_moe" | "mixtral" | "qwen3_moe" | "olmoe"
    vocab_size: int
    hidden_size: int  # D
    moe_intermediate_size: int  # F, per routed expert
    num_hidden_layers: int  # L
    num_experts: int  # E
    top_k: int
    norm_topk_prob: bool  # renormalise the top-k softmax weights to sum to 1
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    shared_expert_intermediate_size: int = 0  # 0 = no shared expert; else sigmoid-gated (Qwen2-MoE)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32  # the checkpoint's storage dtype
    qkv_bias: bool = False  # bias on q/k/v projections
    o_bias: bool = False  # bias on the output projection
    qk_norm: str = "none"  # "none" | "head" (RMSNorm per head, Qwen3) | "full" (over the whole projection, OLMoE)
    clip_qkv: float | None = None  # OLMoE: clamp q/k/v projections to [-c, c]
    raw: dict[str, Any] = field(default_factory=dict)  # the config.json this came from ({} when built in code)

    def __post_init__(self) -> None:
        if self.qk_norm not in ("none", "head", "full"):
            raise ValueError(f"qk_norm must be none|head|full, got {self.qk_norm!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for rotary embeddings")
        self.eos_token_ids = tuple(self.eos_token_ids)


@dataclass(frozen=True)
class Family:
    """How one model family's config.json and expert tensor names map onto ModelConfig / our modules."""

    name: str  # config.json model_type
    architecture: str  # config.json architectures[0]
    from_hf: Callable[[dict[str, Any]], ModelConfig]
    to_hf: Callable[[ModelConfig], dict[str, Any]]
    moe_prefixes: tuple[str, ...] = ("mlp",)  # module name(s) of the MoE block; the first is written on save
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # per-expert gate, up, down


def require(raw: dict[str, Any], key: str) -> Any:
    """raw[key], or a ValueError that names the missing config.json key (never a bare KeyError)."""
    if key not in raw or raw[key] is None:
        raise ValueError(f"config.json has no '{key}'")
    return raw[key]


def reject(raw: dict[str, Any], why: str, condition: bool) -> None:
    if condition:
        raise ValueError(f"unsupported {raw.get('model_type')} config: {why}")


def _rope_theta(raw: dict[str, Any], default: float) -> float:
    # transformers 5 takes rope_scaling over rope_parameters (which it writes with the default type): a YaRN
    # rope_scaling added beside them, as model cards instruct, must not pass as plain RoPE
    for key in ("rope_scaling", "rope_parameters"):
        kind = (raw.get(key) or {}).get("rope_type", (raw.get(key) or {}).get("type", "default"))
        reject(raw, f"{key} rope_type {kind!r} (only default RoPE is implemented)", kind != "default")
    for source in (raw.get("rope_scaling") or {}, raw.get("rope_parameters") or {}, raw):
        if source.get("rope_theta") is not None:
            return float(source["rope_theta"])
    return default


def common_from_hf(raw: dict[str, Any], rope_theta_default: float = 10000.0,
                   kv_heads_default: int | None = None) -> dict[str, Any]:
    """ModelConfig fields that every family spells the same way in config.json. `kv_heads_default`: the family's
    transformers default for an absent num_key_value_heads (None: the attention heads, as a null one is too)."""
    reject(raw, f"hidden_act {raw.get('hidden_act')!r} (only silu)", raw.get("hidden_act", "silu") != "silu")
    quant = raw.get("quantization_config")
    reject(raw, f"quantization_config (quant_method {(quant or {}).get('quant_method')!r}): a quantized checkpoint; "
                "convert its bf16/fp16 original", bool(quant))
    d, heads = int(require(raw, "hidden_size")), int(require(raw, "num_attention_heads"))
    eos = raw.get("eos_token_id")
    dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    return dict(
        vocab_size=int(require(raw, "vocab_size")), hidden_size=d,
        num_hidden_layers=int(require(raw, "num_hidden_layers")),
        top_k=int(require(raw, "num_experts_per_tok")),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or
                                (kv_heads_default if "num_key_value_heads" not in raw else None) or heads),
        head_dim=int(raw.get("head_dim") or d // heads),
        rope_theta=_rope_theta(raw, rope_theta_default),
        rms_norm_eps=float(require(raw, "rms_norm_eps")),
        max_position_embeddings=int(require(raw, "max_position_embeddings")),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        dtype=parse_dtype(dtype_name), raw=dict(raw),
    )


def common_to_hf(cfg: ModelConfig, family: str, architecture: str) -> dict[str, Any]:
    """config.json keys every family shares; family to_hf adds its own (cfg.raw keys are kept underneath)."""
    eos = list(cfg.eos_token_ids)
    out = dict(cfg.raw)
    out.update(
        architectures=[architecture], model_type=family, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, hidden_act="silu",
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_word_embeddings, num_experts_per_tok=cfg.top_k,
        bos_token_id=cfg.bos_token_id, eos_token_id=eos[0] if len(eos) == 1 else (eos or None),
        dtype=DTYPE_NAMES[cfg.dtype],
    )
    out.pop("rope_theta", None)
    out.pop("rope_scaling", None)
    out.pop("torch_dtype", None)
    return out
