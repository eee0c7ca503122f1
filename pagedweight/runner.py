"""Runs the model for one scheduled step, and installs the experts it runs with.

A step's sequences are packed into one row of tokens (the paged KV cache keeps them apart with its mask);
only the rows that end a sequence's pending tokens are sampled, so the LM head runs on those rows alone.
A decode-only step can instead run at static shapes and, on CUDA, replay from a CUDA graph of the whole step
(`DecodeGraphs`): launched op by op, a decode step is bound by host time (27 ms for 24 layers on the H200 at
batch 1, engine_bench 2026-11-29), while a replay costs ~1 us per kernel. Prefill and mixed steps, batches above
the largest bucket, and the CPU stay eager.
Experts are either the checkpoint's dense weights (the FP16/FP32 path) or `APExperts`, which read the page
pool at the widths the page table has committed: through the fused CUDA kernel on a GPU and through its torch
twin elsewhere. Both see the same pool bytes and the same device tables.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol, TypeVar

import numpy as np
import torch
from loguru import logger
from torch import nn

from pagedweight.apformat import REPLACED, APCheckpoint, APFormatError
from pagedweight.bitplanes import lut_bytes
from pagedweight.knobs import PlannerKnobs
from pagedweight.kv_cache import PagedKVCache
from pagedweight.models.model import MoEForCausalLM
from pagedweight.page_store import PageStore, Record
from pagedweight.page_table import BlockSpec, WeightPageTable
from pagedweight.pool import PagePool
from pagedweight.scheduler import ScheduledBatch
from pagedweight.signals import ResidualHeads, RouterStats
from pagedweight.sampling import SamplingParams
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
    try:
        store = PageStore.create(store_dir, ap.planes_file, records, identity=planes_id(ap))
    except FileNotFoundError as exc:  # opened by name: a later conversion into the directory removed it
        if ap.planes_file.exists():
            raise
        raise APFormatError(ap.planes_file, f"missing ({REPLACED})") from exc
    knobs = PlannerKnobs.from_dict(ap.planner_knobs) if ap.planner_knobs else PlannerKnobs()
    return APWeights(specs, ap.seed_bits, ap.parent_bits, store, ap.sensitivity, ap.routing_mass, knobs,
                     ap.residual_heads)


def default_store_dir(ap: APCheckpoint, root: str | Path = "/dev/shm") -> Path:
    """The node page store of `ap` under `root`, named by the planes' content id: an engine given no directory maps
    the one in /dev/shm (tmpfs, shared by the node's processes)."""
    return Path(root) / f"pagedweight-{planes_id(ap)}"


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


def moe_function(device: torch.device, reference: bool = False, max_tokens: int = 0) -> Callable[..., torch.Tensor]:
    """The fused kernel on CUDA, its torch reference twin anywhere else (or when asked for). The kernel's prefill path
    gets buffers of its own (`PrefillBuffers`, sized for calls of up to `max_tokens` tokens), which every layer shares
    and which go with the layers' experts."""
    if device.type == "cuda" and not reference:
        from pagedweight.cuda.moe_kernels import moe_forward
        from pagedweight.cuda.prefill import PrefillBuffers
        return functools.partial(moe_forward, buffers=PrefillBuffers(max_tokens))
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
CAPTURE_ATTEMPTS = 2  # failed captures of one step shape before its steps stay eager (a failed capture costs a step)
T = TypeVar("T")


NARROW_WIDTH = 4  # the kernels' narrow LUT class: every block of the layer at 4 bits or less


def lut_width(max_width: int) -> int:
    """LUT class of a layer whose widest committed block has `max_width` bits: the kernel's `lut_width`, which sizes
    its LUT shared memory and picks its split-K sizing (`moe_kernels.SPLIT_SIZING`; at 4 or less the narrow one:
    a Qwen1.5 layer at T=1 and 4 bits takes 41.4 us with it, 48.1 us with the wide class's, moe_kernel_bench-nvidia-
    h200-20261130-s11-main.json). Widths 5 to 7 all fit the shared memory of width 7 (16 KiB per block, which still
    lets the register-bound 8 blocks per SM in): three classes, and a graph is recaptured only when a layer crosses
    4 <-> 5 or 7 <-> 8, not at every change of its widest block."""
    return NARROW_WIDTH if max_width <= NARROW_WIDTH else 7 if max_width <= 7 else 8


class APExperts(nn.Module):
    """Layer `layer`'s routed experts, read from the pool at the committed widths `table.q[layer]`.

    The layer's table rows are views taken once: commits update the device tables in place, so a forward is the
    kernel call alone (no per-layer indexing, casts or host reads; the kernel converts ids and weights itself).
    On a GPU, a call of T <= GRAPH_MAX_TOKENS tokens replays a CUDA graph of the kernel launches, captured the
    second time a (T, dtype, LUT width) is seen: a Numba launch costs ~0.2 ms of host time (three per layer),
    a replay ~10 us. The graph reads the device tables when it replays, so commits need no recapture. In a whole
    decode step (`DecodeGraphs`, `in_step_graph`) the launches go straight into that step's graph, or run eagerly
    on its first sight: no per-layer graph of that step's shape is ever replayed.
    """

    def __init__(self, layer: int, table: WeightPageTable, pool: PagePool, hidden: int, inter: int,
                 fn: Callable[..., torch.Tensor], graph_pool: GraphPool | None = None) -> None:
        super().__init__()
        self.layer, self.table, self.pool, self.hidden, self.inter, self.fn = layer, table, pool, hidden, inter, fn
        self._rows = (table.q[layer], table.plane_off[layer], table.lut_off[layer])
        self._host_q = table.host_q[layer].numpy()  # a view of the staged widths: numpy reads need no torch op
        self.graph_pool = graph_pool  # None: eager; else the memory pool every layer's graphs share
        self.in_step_graph = False  # set by DecodeGraphs while it runs (or captures) a whole decode step
        self._graphs: dict[tuple, _MoEGraph] = {}
        self._gate = CaptureGate()

    def _call(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, lut_width: int
              ) -> torch.Tensor:
        return self.fn(x, topk_ids, topk_weights, self.pool.words, self.pool.halves, *self._rows, self.hidden,
                       self.inter, self.table.parent_bits, lut_width)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        # the widest committed block of the layer sizes the kernel's LUT staging (host copy, no device read)
        width = lut_width(int(self._host_q.max()))
        if self.graph_pool is None or self.in_step_graph or x.shape[0] > GRAPH_MAX_TOKENS:
            return self._call(x, topk_ids, topk_weights, width)
        key = (x.shape[0], topk_ids.shape[1], x.dtype, topk_ids.dtype, topk_weights.dtype, width)
        g = self._graphs.get(key)
        if g is None:
            if not self._gate.allows(key):
                return self._call(x, topk_ids, topk_weights, width)
            g = self._capture(x, topk_ids, topk_weights, width)
            if g is None:  # the capture failed (logged): this call runs eagerly
                self._gate.failed(key)
                return self._call(x, topk_ids, topk_weights, width)
            self._graphs[key] = g
        g.x.copy_(x)
        g.ids.copy_(topk_ids)
        g.weights.copy_(topk_weights)
        g.graph.replay()
        return g.out

    def _capture(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, lut_width: int
                 ) -> _MoEGraph | None:
        sx, sids, sw = x.clone(), topk_ids.clone(), topk_weights.clone()
        graph = torch.cuda.CUDAGraph()
        # one pool for all layers: replays run one at a time on one stream, and each output stays referenced
        out = capture(graph, self.graph_pool, lambda: self._call(sx, sids, sw, lut_width), f"layer {self.layer} MoE")
        return None if out is None else _MoEGraph(graph, sx, sids, sw, out)


@dataclass
class CaptureGate:
    """Whether a graph of a shape may be captured now: not on the shape's first sight (that call runs eagerly, which
    compiles the kernels outside any capture) unless a shape of its `family` ran before (calls that launch the same
    compiled kernels: one batch size's decode steps with one set of LUT classes, whatever their tables' length),
    and not after CAPTURE_ATTEMPTS failed captures of it (each failure costs its call the graph: the shape then stays
    eager)."""

    seen: set = field(default_factory=set)
    families: set = field(default_factory=set)  # families a call of which ran eagerly (its kernels compiled)
    failures: dict = field(default_factory=dict)  # failed captures per shape

    def allows(self, key, family=None) -> bool:
        if key not in self.seen:
            self.seen.add(key)
            if family is None or family not in self.families:  # the caller runs this call eagerly
                if family is not None:
                    self.ran(family)
                return False
        return self.failures.get(key, 0) < CAPTURE_ATTEMPTS

    def ran(self, family) -> None:
        """A call of `family` ran eagerly (its kernels compiled): its shapes may be captured at first sight."""
        self.families.add(family)

    def failed(self, key) -> None:
        self.failures[key] = self.failures.get(key, 0) + 1


@dataclass
class GraphPool:
    """The memory pool a family of CUDA graphs shares, replaced after a failed capture: torch 2.13 refuses every later
    capture into a pool whose capture failed ("beginAllocateToPool: already recording to mempool_id", also after
    the allocator's recording into it is ended), while a fresh pool captures (capture_probe.log in
    h200-nvidia-h200-20261130-s18-capture.log)."""

    handle: tuple = field(default_factory=lambda: torch.cuda.graph_pool_handle())


def capture(graph: torch.cuda.CUDAGraph, pool: GraphPool | None, fn: Callable[[], T], what: str) -> T | None:
    """fn()'s result, its device work captured into graph (thread-local capture mode, in `pool`, else the graph's
    own pool); None, logged, if the capture fails. Nothing a capture records runs, so the caller runs that step
    eagerly instead, and an error of fn's own raises again there. A failed capture used to fail the step's requests
    (once on the H200, not reproduced: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED in a decode step's capture,
    prefill_probes-nvidia-h200-20261130-s17.log)."""
    stream = torch.cuda.current_stream()
    handle = None if pool is None else pool.handle
    try:
        with torch.cuda.graph(graph, pool=handle, capture_error_mode="thread_local"):
            return fn()
    except Exception as e:  # noqa: BLE001 (the driver's errors come as RuntimeError or cuda.core's CUDAError)
        logger.opt(exception=e).warning("CUDA graph capture of {} failed; the step runs eagerly", what)
        # torch's capture_end raises before it restores the caller's stream (this and every later step would run on
        # torch's side capture stream) and before it ends the caching allocator's recording into the pool
        torch.cuda.set_stream(stream)
        with contextlib.suppress(RuntimeError):  # recording already ended
            torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), graph.pool() if handle is None else handle)
        if pool is not None:
            pool.handle = torch.cuda.graph_pool_handle()
        return None


def install_ap_experts(model: MoEForCausalLM, table: WeightPageTable, pool: PagePool, graphs: bool | None = None,
                       reference: bool = False, max_tokens: int = 0) -> None:
    """Swap every layer's dense experts for pool readers (the dense expert weights are dropped), through the fused
    kernel on CUDA unless `reference` (the torch twin). `graphs` (default: on for CUDA) replays decode steps' MoE
    launches from CUDA graphs. `max_tokens`: the most tokens of one step (sizes the prefill's buffers)."""
    cfg, fn = model.config, moe_function(pool.device, reference, max_tokens)
    graphs = pool.device.type == "cuda" if graphs is None else graphs
    graph_pool = GraphPool() if graphs else None
    for layer in range(cfg.num_hidden_layers):
        model.set_experts(layer, APExperts(layer, table, pool, cfg.hidden_size, cfg.moe_intermediate_size, fn,
                                           graph_pool))


@torch.inference_mode()
def warm_prefill_gemms(model: MoEForCausalLM, dtype: torch.dtype) -> int:
    """The fused kernel's prefill GEMM shapes run once each (`cuda.prefill.warm_prefill_gemms`, through the buffers the
    layers share), so that a request's prefill step does not pay cuBLAS's choice of kernel; returns the shapes run
    (0 where the layers have no such buffers: the torch reference, dense experts, no token bound)."""
    experts = model.layers[0].mlp.experts
    buffers = getattr(getattr(experts, "fn", None), "keywords", {}).get("buffers")
    if buffers is None:
        return 0
    from pagedweight.cuda.prefill import warm_prefill_gemms as warm

    cfg = model.config
    return warm(buffers, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k, dtype,
                experts.pool.device)


def decode_batch_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes of static decode steps: the powers of two below max_num_seqs, then max_num_seqs."""
    return [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs] + [max_num_seqs]


@dataclass
class DecodeStats:
    eager: int = 0  # static steps run eagerly (the CPU; on CUDA a batch size's first sight with a set of classes)
    warmed: int = 0  # eager steps of `DecodeGraphs.warm_up` (no request's)
    captured: int = 0
    replayed: int = 0
    capture_failures: int = 0  # captures that failed; their steps ran eagerly


@dataclass
class _Slot:
    """A request's row of the device block tables: the host tables it was last written from (the kv cache's array,
    whose identity changes whenever that request's blocks do) and the last step that used it."""

    index: int
    tables: np.ndarray  # [L, w]; the device row holds these, then the first block's pages up to max_blocks
    used: int


ROW_FIELDS = 5  # per decode row: token, position, source row, table slot, last block's column (then its L pages)


@dataclass
class _StepGraph:
    """One captured decode step: replay after copying the inputs in; `logits` and `records` are its outputs."""

    graph: torch.cuda.CUDAGraph
    luts: tuple[int, ...]  # LUT class of every layer at capture (baked into the kernels' launch configuration)
    logits: torch.Tensor
    records: list[tuple]  # (layer, x, ids, weights) of every MoE layer: its router inputs, B rows each


class DecodeGraphs:
    """Decode steps at static shapes, captured whole in CUDA graphs on CUDA and run eagerly elsewhere.

    A step of n sequences runs as B rows of one token (B: the smallest of `batch_sizes` >= n) with block tables of
    nb blocks (nb: the next power of two >= the longest table, at most `max_blocks`); a graph is keyed by (B, nb), so
    it does not depend on the context length within a bucket. Buckets of blocks, not one fixed max_model_len:
    attention reads every block of the table, and a fixed 8k-token table would read 25 GB of KV per step at 32
    sequences of a Qwen1.5-MoE.

    Block tables stay on the device between steps: each request holds a slot, a row [L, max_blocks] of
    `_kv_tables` (its blocks, then its first block repeated: padding of finite bytes), written whole only when the
    request takes the slot or its blocks changed otherwise than by one appended block (prefill chunks, preemption,
    relocation: `_place`). The per-step inputs are one int64 buffer [B, 5 + L] copied in before the forward: per
    row the token, its position, the row whose K/V it writes (padding rows repeat row 0 and rewrite its exact
    values), its slot, and its last block's column and pages, which the step writes into the slot (so a block
    appended by decoding costs nothing more) before gathering the rows' tables [B, L, nb] on the device (graph
    memory: B * L * nb * 8 bytes, 12.6 MB at 256 rows of 4k tokens and 24 layers, beside a slot table of the size the
    old input buffer had). Copying every row's tables in from the host instead took 0.82 ms of host time before the
    launch at 32 sequences of 4k tokens and 8.76 ms at 256 on the H200's host, now 0.13 and 0.89 ms
    (benchmarks/results/decode_inputs-nvidia-h200-20261130-s14-before.json, -after.json).

    What a graph bakes in and why it stays valid: the input buffer, the pool (one allocation: KV pages and weight
    runs move inside it between steps, and where they are is device data, namely the slot table of block tables
    and the page table's q / plane_off / lut_off, republished in place), the dense weights and the graph's own
    memory. Not device data: each layer's LUT class (the kernel's shared-memory size), so a graph remembers the
    classes it was captured with and is recaptured when one changes. A batch size is captured the second time it is
    seen with a set of classes (the first step runs eagerly: kernels compile outside any capture); a longer block
    bucket of it, or those classes in other layers, at first sight (the same kernels). Router observers see the real
    rows of the step after it ran (a graph records each layer's expert inputs), once `observe` hands them over.
    """

    def __init__(self, model: MoEForCausalLM, kv: PagedKVCache, batch_sizes: list[int], max_blocks: int,
                 capture: bool, layer_kernels: bool = False) -> None:
        """`layer_kernels`: the steps turn the model's fused layer kernels (`use_layer_kernels`) on where the device
        takes them, and off after; the packed steps run torch's ops unless the runner keeps the kernels on for every
        step (`ModelRunner`'s packed_layer_kernels: then this is False)."""
        self.model, self.kv, self.max_blocks, self.capture = model, kv, max_blocks, capture
        self.layer_kernels = layer_kernels
        self.num_layers = model.config.num_hidden_layers
        self._mlps = [layer.mlp for layer in model.layers]  # where each step looks up the observers (no Module lookups)
        experts = [layer.mlp.experts for layer in model.layers]
        self._ap = [e for e in experts if isinstance(e, APExperts)]
        slots = max(batch_sizes, default=0)  # a table row for every request that may run (max_num_seqs)
        if capture:  # a graph holds no host read: dense experts must take their gathered formulation
            limit = min(GRAPH_MAX_TOKENS if isinstance(e, APExperts) else e.gather_limit(kv.view.device)
                        // model.config.top_k for e in experts)
            batch_sizes = [b for b in batch_sizes if b <= limit]
        self.batch_sizes = sorted(batch_sizes)
        rows, device = (self.batch_sizes[-1] if self.batch_sizes else 0), kv.view.device
        slots = slots if rows else 0
        self._inputs = torch.zeros((rows, ROW_FIELDS + self.num_layers), dtype=torch.long, device=device)
        self._kv_tables = torch.zeros((slots, self.num_layers, max_blocks), dtype=torch.long, device=device)
        self._layers = torch.arange(self.num_layers, device=device)
        self._slots: dict[str, _Slot] = {}
        self._free_slots = list(range(slots))[::-1]
        self._steps = 0
        self._unobserved: tuple[list[tuple], int] | None = None  # the last step's router records and rows, for observe
        self._table = self._ap[0].table if self._ap else None
        self._luts: tuple[int, tuple[int, ...]] = (-1, ())  # (table.commits, LUT classes) derived at that commit
        self._graphs: dict[tuple[int, int], _StepGraph] = {}
        self._gate = CaptureGate()  # keyed by (key, LUT classes)
        self._pool = GraphPool() if capture else None
        self.stats = DecodeStats()

    def fits(self, seqs: list[Sequence]) -> bool:
        return (bool(self.batch_sizes) and len(seqs) <= self.batch_sizes[-1]
                and max(len(s.block_table) for s in seqs) <= self.max_blocks)

    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """Logits [n, V] (float32) of the next token of every sequence, whose one new token each is its last.
        A view of the graph's output when replayed: valid until the next step. The step's router records wait for
        `observe`."""
        self.observe()  # an earlier step's records not handed over yet: before this step's replay overwrites them
        n = len(seqs)
        self._steps += 1
        inputs, blocks = self._step_inputs(seqs, next(b for b in self.batch_sizes if b >= n))
        graph = self._graph(inputs, blocks) if self.capture else None
        if graph is None:
            self.stats.eager += 1
            logits, records = self._forward(inputs, blocks)
        else:
            self.stats.replayed += 1
            graph.graph.replay()
            logits, records = graph.logits, graph.records
        self._unobserved = records, n
        return logits[:n]

    def observe(self) -> None:
        """Hand the last step's router records to the observers, once. The engine calls it after queuing the step's
        sampling: a RouterStats' fold (the stacks, the window's reset, the route_stats kernel) then runs on the device
        behind the tokens' copy to the host, not before the token read (before it, the observed step ended 0.04-0.06
        ms later than uniform's, launch_marks-…-s61-marks2-parent-n-*.json). A graph's records stay valid until its
        next replay, which `run` precedes with this call."""
        if self._unobserved is not None:
            records, n = self._unobserved
            self._unobserved = None
            self._observe(records, n)

    @torch.inference_mode()
    def warm_up(self) -> int:
        """One eager step of every batch size, for a stand-in request of one token in a KV block of its own (freed
        after; none without a free block), so that each size's first real decode step is captured at once
        (`CaptureGate` families) instead of running eagerly first: at engine start, under its starting LUT classes.
        No router observer sees these steps. Returns the steps run."""
        if not self.batch_sizes or self.kv.num_free_blocks < 1:
            return 0
        seq = Sequence("decode-warm-up", [0], SamplingParams(max_tokens=1))
        self.kv.allocate(seq, 1)
        luts = frozenset(self._lut_classes())
        try:
            for rows in self.batch_sizes:
                self._forward(*self._step_inputs([seq], rows))
                self._gate.ran((rows, luts))
                self.stats.warmed += 1
        finally:
            self._free_slots.append(self._slots.pop(seq.request_id).index)
            self.kv.free(seq)
        return len(self.batch_sizes)

    def _step_inputs(self, seqs: list[Sequence], rows: int) -> tuple[torch.Tensor, int]:
        """The step's input rows [rows, 5 + L] on the device (padding rows repeat the first) and its block bucket."""
        n = len(seqs)
        host = np.empty((rows, ROW_FIELDS + self.num_layers), dtype=np.int64)
        rewrite: list[tuple[int, np.ndarray]] = []
        longest = 0
        for i, seq in enumerate(seqs):
            pos, tables = seq.num_computed_tokens, self.kv.block_tables(seq)
            width = tables.shape[1]
            longest = max(longest, width)
            host[i, :ROW_FIELDS] = seq.token_ids[pos], pos, i, self._place(seq.request_id, tables, rewrite), width - 1
            host[i, ROW_FIELDS:] = tables[:, -1]
        host[n:] = host[0]
        if rewrite:
            self._write_slots(rewrite)
        inputs = self._inputs[:rows]
        # a plain copy: a pinned staging buffer, a non-blocking copy and an event to guard the buffer put 0.06-0.12
        # ms more host time before the launch at batch 1 on the H200 (launch_marks-nvidia-h200-20261130-s13-prep.json
        # against -s13-prep-base.json), and again 0.05-0.07 ms on this code (launch_marks-…-20261203-s34-qwen15-
        # pinned-b.json against -main-b.json)
        inputs.copy_(torch.from_numpy(host))
        return inputs, min(1 << (longest - 1).bit_length(), self.max_blocks)

    def _place(self, request_id: str, tables: np.ndarray, rewrite: list[tuple[int, np.ndarray]]) -> int:
        """The slot of a request of this step; appends (slot, tables) to `rewrite` unless the slot's row holds
        `tables` but perhaps their last block (which the step itself writes). A new request takes a free slot, else
        the least recently used one: fewer than all slots are this step's so far (a step has at most max_num_seqs
        requests), so that one is not."""
        slot = self._slots.get(request_id)
        if slot is None:
            if self._free_slots:
                index = self._free_slots.pop()
            else:
                index = self._slots.pop(min(self._slots, key=lambda r: self._slots[r].used)).index
            self._slots[request_id] = slot = _Slot(index, tables, self._steps)
            rewrite.append((index, tables))
        elif slot.tables is not tables:
            held = slot.tables.shape[1]
            if not (held <= tables.shape[1] <= held + 1 and np.array_equal(tables[:, :held], slot.tables)):
                rewrite.append((slot.index, tables))
            slot.tables = tables
        slot.used = self._steps
        return slot.index

    def _write_slots(self, rewrite: list[tuple[int, np.ndarray]]) -> None:
        """Write whole slot rows: the tables, then the first block's pages up to max_blocks (that fill on the device:
        the host builds only the widest table's columns, not max_model_len's)."""
        width = max(tables.shape[1] for _, tables in rewrite)
        rows = np.empty((len(rewrite), self.num_layers, width), dtype=np.int64)
        for row, (_, tables) in zip(rows, rewrite):
            row[:, :tables.shape[1]] = tables
            row[:, tables.shape[1]:] = tables[:, :1]
        device = self._kv_tables.device
        index, dev = torch.tensor([i for i, _ in rewrite], device=device), torch.from_numpy(rows).to(device)
        self._kv_tables[index, :, :width] = dev
        self._kv_tables[index, :, width:] = dev[:, :, :1]

    def _observe(self, records: list[tuple], n: int) -> None:
        """Router observers get the step's real rows: a RouterStats observing every layer gets all layers in one
        call (stacked here, on its active steps only), any other observer each layer, as tensors of its own."""
        observers = [self._mlps[layer].observer for layer, *_ in records]
        if all(o is None for o in observers):
            return
        first = observers[0]
        if isinstance(first, RouterStats) and all(o is first for o in observers):
            if not first.active:
                return
            layers, x, ids, weights = zip(*records)
            first.observe_layers(list(layers), torch.stack(x)[:, :n], torch.stack(ids)[:, :n],
                                 torch.stack(weights)[:, :n])
            return
        for (layer, x, ids, weights), observer in zip(records, observers):
            if observer is not None:
                observer(layer, x[:n].clone(), ids[:n].clone(), weights[:n].clone())

    def _graph(self, inputs: torch.Tensor, blocks: int) -> _StepGraph | None:
        """The graph of this step's shape and LUT classes; None (run it eagerly) on the first sight of its batch size
        under these classes and when its capture failed (`CAPTURE_ATTEMPTS` failures: that shape stays eager)."""
        key = inputs.shape[0], blocks
        luts = self._lut_classes()
        graph = self._graphs.get(key)
        if graph is not None and graph.luts == luts:
            return graph
        # a batch size that ran with this set of classes launches compiled kernels only (which kernel a layer gets
        # depends on its class and the rows, not on the layer): a new block bucket or another layout captures at once
        if not self._gate.allows((key, luts), family=(key[0], frozenset(luts))):
            return None
        g = torch.cuda.CUDAGraph()
        # one memory pool for every graph: replays run one at a time on one stream, each output stays referenced
        out = capture(g, self._pool, lambda: self._forward(inputs, blocks), f"a decode step of {inputs.shape[0]} rows")
        if out is None:
            self._gate.failed((key, luts))
            self.stats.capture_failures += 1
            return None
        self._graphs[key] = graph = _StepGraph(g, luts, *out)  # replaces a graph of other classes
        self.stats.captured += 1
        return graph

    def _lut_classes(self) -> tuple[int, ...]:
        """Every layer's LUT class under the committed widths, derived again only after a commit."""
        if self._table is None:
            return ()
        if self._luts[0] != self._table.commits:
            widest = self._table.host_q.numpy().reshape(self.num_layers, -1).max(axis=1)
            self._luts = (self._table.commits, tuple(lut_width(int(w)) for w in widest))
        return self._luts[1]

    def _step_tables(self, inputs: torch.Tensor, blocks: int) -> torch.Tensor:
        """The step's block tables [B, L, blocks] (device work, in the graph): each row's last block written into its
        slot, then the rows' slots gathered."""
        slots, last = inputs[:, 3], inputs[:, 4]
        self._kv_tables[slots[:, None], self._layers, last[:, None]] = inputs[:, ROW_FIELDS:]
        return self._kv_tables[:, :, :blocks].index_select(0, slots)

    def _forward(self, inputs: torch.Tensor, blocks: int) -> tuple[torch.Tensor, list[tuple]]:
        """The step a graph captures: inputs [B, 5 + L] -> logits [B, V] and every layer's router inputs, reading
        `blocks` blocks of each row's slot after writing its last block there."""
        tokens, positions = inputs[:, 0:1], inputs[:, 1:2]
        tables = self._step_tables(inputs, blocks)
        records: list[tuple] = []
        observers = [layer.mlp.observer for layer in self.model.layers]
        self.model.set_router_observer(lambda *args: records.append(args))
        self.kv.layout = self.kv.decode_layout(positions[:, 0], inputs[:, 2], tables)
        for experts in self._ap:
            experts.in_step_graph = True
        if self.layer_kernels:
            self.model.use_layer_kernels()
        try:
            logits = self.model(tokens, positions, cache=self.kv)[:, 0]
        finally:
            if self.layer_kernels:
                self.model.use_layer_kernels(False)
            self.kv.layout = None
            for layer, fn in zip(self.model.layers, observers):
                layer.mlp.observer = fn
            for experts in self._ap:
                experts.in_step_graph = False
        return logits, records


@dataclass
class PromptRows:
    """Prompt positions of a step whose log-probabilities were asked for (SamplingParams.prompt_logprobs): `hidden`
    [R, H] holds their final-norm outputs, in the order of `spans`, each (sequence, first position, end position)."""

    spans: list[tuple[Sequence, int, int]]
    hidden: torch.Tensor


class ModelRunner:
    def __init__(self, model: MoEForCausalLM, kv: PagedKVCache, device: torch.device, max_num_seqs: int = 0,
                 max_model_len: int | None = None, capture: bool | None = None, layer_kernels: bool = False,
                 packed_layer_kernels: bool = False) -> None:
        """`max_num_seqs` > 0 runs decode-only steps of up to that many sequences at static shapes (`DecodeGraphs`),
        captured in CUDA graphs when `capture` (default: on CUDA), eagerly otherwise (slower than the packed step:
        for tests of the code a graph captures); with the fused layer kernels when `layer_kernels`, and in the packed
        steps (prefill, mixed) as well when `packed_layer_kernels`: then they are turned on once here, for every
        forward, as turning them on and off walks the model's modules (~0.5 ms of host time each way)."""
        self.model, self.kv, self.device = model, kv, device
        self._kernels_kept = layer_kernels and packed_layer_kernels and model.use_layer_kernels()
        self._rows: torch.Tensor | None = None
        self._score: torch.Tensor | None = None  # rows whose final hidden states `_keep_sampled_rows` keeps
        self._scored: torch.Tensor | None = None
        if device.type == "cuda":
            # cuDNN attention builds an execution plan for every new (tokens, context) shape, and a serving step
            # brings a new context length each time: 6.5 ms of host time per layer call on the H200
            # (torch.profiler, 2026-11-29). The flash and memory-efficient kernels take any shape as it comes.
            torch.backends.cuda.enable_cudnn_sdp(False)
        self._hook = model.norm.register_forward_hook(self._keep_sampled_rows)
        self.decode: DecodeGraphs | None = None
        if max_num_seqs > 0:
            max_len = max_model_len or model.config.max_position_embeddings
            self.decode = DecodeGraphs(model, kv, decode_batch_sizes(max_num_seqs), -(-max_len // kv.block_size),
                                       device.type == "cuda" if capture is None else capture,
                                       layer_kernels and not self._kernels_kept)

    def close(self) -> None:
        """Unhook the model and turn its kernels off (an engine that rebuilds its runner over the same model:
        `LLM._release`)."""
        self._hook.remove()
        if self._kernels_kept:
            self.model.use_layer_kernels(False)
        self.decode = None

    def _keep_sampled_rows(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        """Final-norm hook: the LM head then sees only the rows that get sampled; rows whose prompt log-probabilities
        were asked for are kept aside (their head runs in bounded chunks: `Sampler.prompt_logprobs`)."""
        if self._score is not None:
            self._scored = output[0, self._score]
        return output if self._rows is None else output[:, self._rows]

    @torch.inference_mode()
    def observe(self) -> None:
        """The last decode step's router records to the observers (`DecodeGraphs.observe`); a packed step's
        observers saw its layers during the forward."""
        if self.decode is not None:
            self.decode.observe()

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor, PromptRows | None]:
        """Compute the batch's new tokens; returns the sequences to sample, their logits [n, V] (float32) and the
        prompt rows to score (None when no request of the batch asks for prompt log-probabilities)."""
        decode = all(n == 1 and s.num_computed_tokens + 1 == s.num_tokens
                     for s, n in zip(batch.seqs, batch.num_new_tokens))
        if decode and self.decode is not None and self.decode.fits(batch.seqs):
            logits = self.decode.run(batch.seqs)
            for seq in batch.seqs:
                seq.num_computed_tokens += 1
            return list(batch.seqs), logits, None
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        to_sample: list[Sequence] = []
        score: list[int] = []
        spans: list[tuple[Sequence, int, int]] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            if seq.params.prompt_logprobs is not None:  # positions before the prompt's last, not scored before
                lo, hi = max(start, len(seq.prompt_logprobs)), min(start + n, seq.num_prompt_tokens - 1)
                if hi > lo:
                    score.extend(range(len(ids) + lo - start, len(ids) + hi - start))
                    spans.append((seq, lo, hi))
            ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            if start + n == seq.num_tokens:
                rows.append(len(ids) - 1)
                to_sample.append(seq)
        self.kv.prepare(batch.seqs, batch.num_new_tokens)
        t = len(ids)
        every_row = len(rows) == t  # all decodes: the LM head needs every row, no selection
        sampled = [] if every_row else rows
        packed = torch.tensor(ids + positions + sampled + score, dtype=torch.long).to(self.device)
        self._rows = None if every_row else packed[2 * t:2 * t + len(sampled)]
        self._score = packed[2 * t + len(sampled):] if score else None
        try:
            logits = self.model(packed[None, :t], packed[None, t:2 * t], cache=self.kv)[0]
            prompt = PromptRows(spans, self._scored) if score else None
        finally:
            self._rows = self._score = self._scored = None
            self.kv.layout = None
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
        return to_sample, logits, prompt
