"""`MoEForCausalLM`: one decoder for all four families (they differ only in what ModelConfig says).

Parameter names are the Hugging Face names without the leading "model." (checkpoint.py maps the
expert tensors, which are the only ones stored differently).
"""
from __future__ import annotations

import itertools
from typing import Iterator

import torch
from torch import nn

from pagedweight.models.config import ModelConfig
from pagedweight.models.layers import (MLP, Attention, DecoderLayer, DenseExperts, KVCache, MoEBlock, MoEOut, RMSNorm,
                                       RouterObserver, rope_cos_sin)
from pagedweight.pool import own_segment_bytes

BlockKey = tuple[int, int, str]  # (layer, expert, "gate_up" | "down")
BLOCK_KINDS = ("gate_up", "down")
WEIGHT_ALIGN = 256  # bytes: each packed weight starts 256-byte aligned, as the caching allocator's blocks do


class MoEForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the output head when the config says so (call again after assign-loading)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """input_ids [B, T] -> float32 logits [B, T, V].

        positions default to arange(T) after the tokens already in `cache` (its `length` attribute).
        """
        b, t = input_ids.shape
        if positions is None:
            start = getattr(cache, "length", 0) if cache is not None else 0
            positions = torch.arange(start, start + t, device=input_ids.device).expand(b, t)
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, cache)
        if isinstance(x, MoEOut):  # added here: the final norm's hooks (the runner's) see a tensor
            x = x.added()
        return self.lm_head(self.norm(x)).float()

    def fuse_projections(self) -> None:
        """Serving layout: every attention's q/k/v become one GEMM, and so do a shared expert's gate and up with the
        router and the shared expert's gate (`MoEBlock.fuse_inputs`): five fewer launches per layer in a decode step
        with a shared expert, two without, the same weight bytes (plus up to 7 zero rows that align the fused input
        projection's outputs). Parameter names change, so fuse
        after loading, and never before saving a checkpoint. On CUDA each layer's unfused weights go back to the
        device before the next layer is fused, so the allocator's cache never holds more than one layer's worth."""
        for layer in self.layers:
            if layer.self_attn.qkv_proj is None:
                layer.self_attn.fuse_qkv()
            layer.mlp.fuse_inputs()
            if self.lm_head.weight.is_cuda:
                torch.cuda.empty_cache()

    def pack_weights(self, limit: int | None = None) -> int:
        """Move every parameter and buffer into one allocation on its device, each a view of it (256-byte aligned);
        returns that allocation's bytes. Why: building the model and fusing its projections leave the caching
        allocator's segments with holes where unfused weights were, reserved but only reusable by allocations that
        fit them (on the H200, 337 MiB beyond the weights' bytes for the Qwen1.5-MoE shape:
        benchmarks/results/memory_gap-nvidia-h200-20261130-memgap2-4.json); after this the weights reserve their own
        bytes (on CUDA the allocation is `own_segment_bytes`: a segment of its own, which a model under 10 MiB
        would otherwise share with whatever came next, reserved beyond what the budget counts). The copies go device
        to device when a second copy fits in `limit` bytes (the engine's budget: start-up reserves no more than that)
        and in the device's free memory, else through host memory (~1 s per GiB on the H200 box: the 26.7 GiB FP16
        Qwen1.5-MoE shape built in 29 s against 3 s device to device, engine_bench-nvidia-h200-20261130-s20-packed-
        host.json and -s20-packed.json). Tied weights stay tied (one tensor object, moved once)."""
        tensors, offsets = self._packed_layout()
        if not tensors:
            return 0
        device = tensors[0].device
        sizes = [t.numel() * t.element_size() for t in tensors]
        total = offsets[-1]
        via_host = device.type == "cuda" and ((limit is not None and 2 * total > limit)
                                              or torch.cuda.mem_get_info(device)[0] < total + (256 << 20))
        with torch.no_grad():
            if via_host:
                for t in tensors:
                    t.data = t.data.cpu()
                torch.cuda.empty_cache()
            arena = torch.empty(self.packed_bytes(device), dtype=torch.uint8, device=device)
            for t, off, n in zip(tensors, offsets, sizes):
                view = arena[off:off + n].view(t.dtype).view(t.shape)
                view.copy_(t.data)
                t.data = view
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the old segments now hold nothing
        return arena.numel()

    def packed_bytes(self, device: torch.device | str = "cpu") -> int:
        """Bytes of the allocation `pack_weights` makes on `device` (on CUDA what the engine counts for these
        weights)."""
        total = self._packed_layout()[1][-1]
        return own_segment_bytes(total) if torch.device(device).type == "cuda" else total

    def _packed_layout(self) -> tuple[list[torch.Tensor], list[int]]:
        """Every distinct parameter and buffer, and where each starts in the packed allocation (the last offset is
        its size)."""
        tensors = list({id(t): t for t in itertools.chain(self.parameters(), self.buffers())}.values())
        offsets = [0]
        for t in tensors:
            offsets.append(offsets[-1] + -(-t.numel() * t.element_size() // WEIGHT_ALIGN) * WEIGHT_ALIGN)
        return tensors, offsets

    def use_layer_kernels(self, on: bool = True) -> bool:
        """Turn the fused layer kernels (cuda/layer_kernels.py) on or off: each layer's norms (the residual add fused
        in), RoPE, routing and the shared expert's elementwise work, one launch each. Only where the device takes
        them (CUDA, fp16/fp32): returns whether they are on. RoPE's kernel needs q/k/v fused (`fuse_projections`) and
        not clipped; it folds in a per-head q/k norm (Qwen3), not one over the whole projection (OLMoE). The serving
        engine keeps them on for every step (EngineOptions.packed_layer_kernels, the default), or else turns them on
        for its static decode steps only (what its CUDA graphs capture: runner.DecodeGraphs)."""
        kernels = None
        if on:
            from pagedweight.cuda import layer_kernels
            kernels = layer_kernels if layer_kernels.takes(self.lm_head.weight) else None
        for m in self.modules():
            if kernels is None:
                if "kernels" in vars(m):
                    del m.kernels
            elif (isinstance(m, MLP) or (isinstance(m, RMSNorm) and m.weight.numel() <= kernels.MAX_NORM_DIM)
                  or (isinstance(m, MoEBlock) and m.num_experts <= kernels.MAX_EXPERTS)
                  or (isinstance(m, Attention) and m.qkv_proj is not None and m.qk_norm in ("none", "head")
                      and m.clip_qkv is None)):
                m.kernels = kernels
        return kernels is not None

    def set_experts(self, layer: int, module: nn.Module) -> None:
        """Replace layer `layer`'s routed experts by anything with DenseExperts' forward signature."""
        self.layers[layer].mlp.experts = module

    def set_router_observer(self, fn: RouterObserver | None) -> None:
        """fn(layer, x [N,D], topk_ids [N,k], topk_weights [N,k]) is called by every MoE layer after routing."""
        for layer in self.layers:
            # plain Python state, never a parameter, buffer or module: past Module.__getattr__/__setattr__, which
            # took 54 us for 24 layers against 4 (CPU), on the host path between two decode steps
            object.__setattr__(layer._modules["mlp"], "observer", fn)


def block_index(key: BlockKey, num_experts: int) -> int:
    """Flat block index i = (layer*E + expert)*2 + (0 gate_up | 1 down)."""
    layer, expert, kind = key
    return (layer * num_experts + expert) * 2 + BLOCK_KINDS.index(kind)


def iter_expert_blocks(model: MoEForCausalLM) -> Iterator[tuple[BlockKey, torch.Tensor]]:
    """Every routed-expert linear block in flat-index order, with its weight view [N, K] (y = W @ x)."""
    for l, layer in enumerate(model.layers):
        experts = layer.mlp.experts
        if not isinstance(experts, DenseExperts):
            raise TypeError(f"layer {l} experts are {type(experts).__name__}, not DenseExperts")
        for e in range(experts.gate_up.shape[0]):
            yield (l, e, "gate_up"), experts.gate_up[e]
            yield (l, e, "down"), experts.down[e]


def build_model(config: ModelConfig, seed: int | None = None, std: float = 0.02) -> MoEForCausalLM:
    """A randomly initialised float32 model (for training): weights N(0, std), norms 1, biases 0."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    model = MoEForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=gen)
    return model
