"""Runs the model for one scheduled step, and installs the experts it runs with.

A step's sequences are packed into one row of tokens (the paged KV cache keeps them apart with its mask);
only the rows that end a sequence's pending tokens are sampled, so the LM head runs on those rows alone.
Experts are either the checkpoint's dense weights (the FP16/FP32 path) or `APExperts`, which read the page
pool at the widths the page table has committed: through the fused CUDA kernel on a GPU and through its torch
twin elsewhere. Both see the same pool bytes and the same device tables.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
import torch
from torch import nn

from pagedweight.apformat import APCheckpoint
from pagedweight.bitplanes import lut_bytes
from pagedweight.knobs import PlannerKnobs
from pagedweight.kv_cache import PagedKVCache
from pagedweight.models.model import MoEForCausalLM
from pagedweight.page_store import PageStore, Record
from pagedweight.page_table import BlockSpec, WeightPageTable
from pagedweight.pool import PagePool
from pagedweight.scheduler import ScheduledBatch
from pagedweight.signals import ResidualHeads
from pagedweight.sequence import Sequence


class PlaneSource(Protocol):
    """Where reloads copy from (a `PageStore`; benchmarks may hand in any CPU source of the same bytes)."""

    def tensor(self, block: int, what: str, idx: int) -> torch.Tensor: ...


@dataclass
class APWeights:
    """What the engine needs of any-precision expert weights, wherever they come from."""

    specs: list[BlockSpec]  # flat block order i = (l*E + e)*2 + u
    seed_bits: int
    parent_bits: int
    store: PlaneSource
    sensitivity: np.ndarray  # [n_blocks, P+1] s_i^b
    routing_mass: np.ndarray  # [L, E] calibration prior
    knobs: PlannerKnobs
    heads: ResidualHeads | None = None  # trained prompt residual heads (None: the planner uses the global estimate)


def ap_weights(ap: APCheckpoint, store_dir: str | Path) -> APWeights:
    """Open (or create, once per node) the page store of an AP checkpoint and collect its tables."""
    records, specs = [], []
    for i, e in enumerate(ap.blocks):
        records += [Record(i, "plane", p, ap.plane_offset(i, p), e.plane_bytes) for p in range(ap.parent_bits)]
        luts = {b: lut_bytes(e.n, b) for b in range(ap.seed_bits, ap.parent_bits + 1)}
        records += [Record(i, "lut", b, ap.lut_offset(i, b), n) for b, n in luts.items()]
        specs.append(BlockSpec(e.plane_bytes, luts))
    store = PageStore.create(store_dir, ap.planes_file, records)
    knobs = PlannerKnobs.from_dict(ap.planner_knobs) if ap.planner_knobs else PlannerKnobs()
    return APWeights(specs, ap.seed_bits, ap.parent_bits, store, ap.sensitivity, ap.routing_mass, knobs,
                     ap.residual_heads)


def planes_id(ap: APCheckpoint) -> str:
    """Content id of the checkpoint's planes (its manifest checksum), naming the node's page store."""
    entry = next(f for f in ap.manifest["files"] if f["name"] == ap.planes_file.name)
    return entry["blake2b"][:16]


def build_ap_model(ap: APCheckpoint, dtype: torch.dtype, device: torch.device) -> MoEForCausalLM:
    """The model's dense (non-expert) weights from the checkpoint; experts are placeholders until
    `install_ap_experts` (they are never materialised densely)."""
    cfg = ap.config
    with torch.device("meta"):
        model = MoEForCausalLM(cfg)
    for layer in range(cfg.num_hidden_layers):
        model.set_experts(layer, nn.Identity())
    state = {k: v.to(device=device, dtype=dtype) for k, v in ap.dense_state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected or set(missing) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()):
        raise ValueError(f"{ap.dir}: dense weights do not fit the model (missing {sorted(missing)[:4]}, "
                         f"unexpected {sorted(unexpected)[:4]})")
    model.tie_weights()
    return model.eval()


def moe_function(device: torch.device) -> Callable[..., torch.Tensor]:
    """The fused kernel on CUDA, its torch reference twin anywhere else."""
    if device.type == "cuda":
        from pagedweight.cuda.moe_kernels import moe_forward
        return moe_forward
    from pagedweight.cuda.reference import moe_forward_reference
    return moe_forward_reference


@dataclass
class _MoEGraph:
    """One captured decode MoE call: static inputs copied in before each replay, the output read after."""

    graph: torch.cuda.CUDAGraph
    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    out: torch.Tensor


GRAPH_MAX_TOKENS = 64  # decode steps (the fused kernel's range); larger steps run eagerly (prefill path)


class APExperts(nn.Module):
    """Layer `layer`'s routed experts, read from the pool at the committed widths `table.q[layer]`.

    The layer's table rows are views taken once: commits update the device tables in place, so a forward is the
    kernel call alone (no per-layer indexing, casts or host reads; the kernel converts ids and weights itself).
    On a GPU, a decode call (T <= GRAPH_MAX_TOKENS) replays a CUDA graph of the kernel launches, captured the
    second time a (T, dtype, LUT width) is seen: a Numba launch costs ~0.2 ms of host time (three per layer),
    a replay ~10 us. The graph reads the device tables when it replays, so commits need no recapture.
    """

    def __init__(self, layer: int, table: WeightPageTable, pool: PagePool, hidden: int, inter: int,
                 fn: Callable[..., torch.Tensor], graph_pool: tuple | None = None) -> None:
        super().__init__()
        self.layer, self.table, self.pool, self.hidden, self.inter, self.fn = layer, table, pool, hidden, inter, fn
        self._rows = (table.q[layer], table.plane_off[layer], table.lut_off[layer])
        self._host_q = table.host_q[layer].numpy()  # a view of the staged widths: numpy reads need no torch op
        self.graph_pool = graph_pool  # None: eager; else the memory pool every layer's graphs share
        self._seen: set[tuple] = set()
        self._graphs: dict[tuple, _MoEGraph] = {}

    def _call(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, lut_width: int
              ) -> torch.Tensor:
        return self.fn(x, topk_ids, topk_weights, self.pool.words, self.pool.halves, *self._rows, self.hidden,
                       self.inter, self.table.parent_bits, lut_width)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        # The widest committed block of the layer sizes the kernel's LUT staging (host copy, no device read). Widths
        # up to 7 all fit the shared memory of width 7 (an fp32 LUT of 64 entries or an fp16 one of 128: 16 KiB per
        # block, which still lets the register-bound 8 blocks per SM in), so only 8 bits needs more: two classes,
        # and a layer's graph is recaptured only when it crosses 7 <-> 8, not at every change of its widest block.
        lut_width = 7 if int(self._host_q.max()) <= 7 else 8
        if self.graph_pool is None or x.shape[0] > GRAPH_MAX_TOKENS:
            return self._call(x, topk_ids, topk_weights, lut_width)
        key = (x.shape[0], topk_ids.shape[1], x.dtype, topk_ids.dtype, topk_weights.dtype, lut_width)
        g = self._graphs.get(key)
        if g is None:
            if key not in self._seen:  # first sight: eager (compiles the kernels outside any capture)
                self._seen.add(key)
                return self._call(x, topk_ids, topk_weights, lut_width)
            g = self._capture(x, topk_ids, topk_weights, lut_width)
            self._graphs[key] = g
        g.x.copy_(x)
        g.ids.copy_(topk_ids)
        g.weights.copy_(topk_weights)
        g.graph.replay()
        return g.out

    def _capture(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, lut_width: int
                 ) -> _MoEGraph:
        sx, sids, sw = x.clone(), topk_ids.clone(), topk_weights.clone()
        graph = torch.cuda.CUDAGraph()
        # one pool for all layers: replays run one at a time on one stream, and each output stays referenced
        with torch.cuda.graph(graph, pool=self.graph_pool, capture_error_mode="thread_local"):
            out = self._call(sx, sids, sw, lut_width)
        return _MoEGraph(graph, sx, sids, sw, out)


def install_ap_experts(model: MoEForCausalLM, table: WeightPageTable, pool: PagePool, graphs: bool | None = None
                       ) -> None:
    """Swap every layer's dense experts for pool readers (the dense expert weights are dropped).
    `graphs` (default: on for CUDA) replays decode steps' MoE launches from CUDA graphs."""
    cfg, fn = model.config, moe_function(pool.device)
    graphs = pool.device.type == "cuda" if graphs is None else graphs
    graph_pool = torch.cuda.graph_pool_handle() if graphs else None
    for layer in range(cfg.num_hidden_layers):
        model.set_experts(layer, APExperts(layer, table, pool, cfg.hidden_size, cfg.moe_intermediate_size, fn,
                                           graph_pool))


class ModelRunner:
    def __init__(self, model: MoEForCausalLM, kv: PagedKVCache, device: torch.device) -> None:
        self.model, self.kv, self.device = model, kv, device
        self._rows: torch.Tensor | None = None
        if device.type == "cuda":
            # cuDNN attention builds an execution plan for every new (tokens, context) shape, and a serving step
            # brings a new context length each time: 6.5 ms of host time per layer call on the H200
            # (torch.profiler, 2026-11-29). The flash and memory-efficient kernels take any shape as it comes.
            torch.backends.cuda.enable_cudnn_sdp(False)
        model.norm.register_forward_hook(self._keep_sampled_rows)

    def _keep_sampled_rows(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        """Final-norm hook: the LM head then sees only the rows that get sampled."""
        return output if self._rows is None else output[:, self._rows]

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor]:
        """Compute the batch's new tokens; returns the sequences to sample and their logits [n, V] (float32)."""
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        to_sample: list[Sequence] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            if start + n == seq.num_tokens:
                rows.append(len(ids) - 1)
                to_sample.append(seq)
        self.kv.prepare(batch.seqs, batch.num_new_tokens)
        t = len(ids)
        every_row = len(rows) == t  # all decodes: the LM head needs every row, no selection
        packed = torch.tensor(ids + positions + ([] if every_row else rows), dtype=torch.long).to(self.device)
        self._rows = None if every_row else packed[2 * t:]
        try:
            logits = self.model(packed[None, :t], packed[None, t:2 * t], cache=self.kv)[0]
        finally:
            self._rows = None
            self.kv.layout = None
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
        return to_sample, logits
