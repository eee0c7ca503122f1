"""The engine: `LLM` (an API shaped as vLLM's: generate, chat, stream, step) and the per-step loop that ties the
pieces together.

One step = (1) the paging loop at the step boundary: the planner sees KV pressure (free blocks, counting the
pages that moves in flight give back, against every block the admitted requests will still need, so it frees
room once when work arrives rather than one prefill chunk at a time), routing statistics and prompt features,
and the mover commits whatever is ready (lower widths free pool pages for KV; higher widths come back when
pressure falls); (2) the scheduler packs running and waiting requests into a token budget, preempting the
newest when even the largest safe release leaves the KV cache short; (3) the runner computes the batch;
(4) sampling, detokenization and stop checks. Every request ends with a finish reason: stop, length, abort or
error; none is dropped.

Memory: `gpu_memory_budget` covers model weights and the KV cache. Weights that are not paged (attention,
embeddings, norms, router, shared experts; all weights on the dense path) are taken off the top; the rest is
the page pool, shared by expert bit-planes/LUTs and KV blocks. On CUDA the weights outside the pool are packed into
one allocation first (`MoEForCausalLM.pack_weights`), so they reserve what the budget counts for them. Activations,
CUDA-graph pools and the prefill's scratch come on top of the budget, unless `activation_reserve` keeps a share of it
for them, given in bytes or measured at start-up ("auto": `_profile_reserve`); stats() reports the bytes the budget
covers, computed, and the device's reserved bytes, measured.
"""
from __future__ import annotations

import gc
import itertools
import math
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from loguru import logger
from tqdm import tqdm

from pagedweight import gc_watch
from pagedweight.apformat import MANIFEST, load_ap
from pagedweight.knobs import PlannerKnobs
from pagedweight.kv_cache import PagedKVCache, kv_layer_block_bytes
from pagedweight.models import MoEForCausalLM, load_model, parse_dtype
from pagedweight.models.layers import expert_rows
from pagedweight.mover import PageMover, ReloadPace
from pagedweight.page_table import WeightPageTable
from pagedweight.planner import BlockTables, KVState, Planner
from pagedweight.pool import (PAGE_ALIGN, SEGMENT_OWN_MIN, SEGMENT_ROUND, PagePool, PoolExhausted, release_cached,
                              resolve_budget)
from pagedweight.runner import (NARROW_WIDTH, APWeights, ModelRunner, PromptRows, ap_weights, build_ap_model,
                                default_store_dir, install_ap_experts, planes_id, warm_prefill_gemms)
from pagedweight.sampling import MAX_LOGPROBS, Sampler, SamplingParams, make_generator
from pagedweight.scheduler import Scheduler
from pagedweight.sequence import Sequence
from pagedweight.signals import RouterStats, RoutingTracker, normalize_mass
from pagedweight.tokenizer import TextTokenizer


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]  # one list shared by every output of the request (copy it before changing it)
    token_ids: list[int]  # every generated token so far; with output_kind "delta" those new since the last output
    # every generated character so far, cut at a stop string; until the request ends, less a tail that begins a stop
    # string (a later token may complete it, and the text is then cut there: as vLLM holds text back)
    text: str
    delta_text: str  # new since this request's previous output
    finished: bool
    finish_reason: str | None = None  # None | "stop" | "length" | "abort" | "error"
    error: str | None = None
    completion_tokens: int = 0  # generated so far, whatever token_ids holds
    # with SamplingParams.logprobs: per token of token_ids, {token id: log-probability} of it and the most likely ones
    logprobs: list[dict[int, float]] | None = None
    # with SamplingParams.prompt_logprobs: per prompt token the same, None for the first (nothing precedes it); in
    # every output, but with output_kind "delta" only in the request's first
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens whose K/V were found computed when it started (prefix sharing)
    # measured: seconds from its arrival (add_request) to the step the scheduler first gave it (vLLM's time in queue;
    # None while it waits). Time to first token less this is its prefill's share, this its wait for a slot or KV
    queued_s: float | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class EngineOptions:
    """Everything `LLM(**engine_options)` accepts besides the model, budget and device."""

    dtype: str | None = None  # default: float16 on CUDA, float32 on CPU
    # the name requests address (the HTTP API's "model"); default: the model directory's name. The serving entry
    # points pass the name they were given (a Hub repository id, or the HF directory before its AP conversion)
    served_model_name: str | None = None
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512  # token budget of one step (prefill chunks + decodes)
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    kv_cache_bytes: int = 64 << 20  # KV pool size when no gpu_memory_budget is given
    # bytes of gpu_memory_budget kept out of the pool for what runs beside it (activations, CUDA-graph pools, the
    # prefill's dequantize scratch), so that the budget bounds the process's whole footprint: "auto" measures them at
    # start-up (`LLM._profile_reserve`), or give the gap device_peak_reserved_bytes - budget_bytes (stats()) of a run
    # of the same shapes. 0: the budget covers the weights and the pool only
    activation_reserve: int | str = 0
    detokenize: bool = True
    # requests share the computed KV blocks of a common prefix (a system prompt, the samples of one prompt, a chat's
    # earlier turns, a recompute after preemption): PagedKVCache's prefix sharing. Blocks nobody holds are kept while
    # counted free: a KV allocation evicts them and a weight reload reclaims them
    prefix_caching: bool = True
    # with paging: seconds a kept prefix block is retained after its release, held by the planner as a request's
    # blocks are (reloads leave it; a new request's room comes from lower widths, not from evicting it), so a chat's
    # next turn finds its history; 0: reloads and allocations take kept blocks at once
    prefix_retention_s: float = 0.0
    # any-precision checkpoints only
    bits: int | None = None  # paging: the width weights return to (default: parent width); static: the width
    paging: bool = True  # False = static uniform `bits` (no planner, no mover traffic)
    page_store_dir: str | None = None  # default: /dev/shm/pagedweight-<checkpoint id> (shared by the node)
    verify_checkpoint: bool = False  # blake2b of every checkpoint file at load (slow for large models)
    planner_knobs: dict | None = None  # overrides of the checkpoint's PlannerKnobs
    observe_every: int = 4  # routing statistics from every n-th step (one device-to-host read per observed step)
    cuda_graphs: bool = True  # on CUDA: decode steps replay whole-step graphs (runner.DecodeGraphs), the MoE
    # launches of small mixed steps per-layer ones (runner.APExperts)
    # on CUDA: those decode steps attend with the paged decode attention kernel (fp16/fp32, grouped query heads too;
    # False or otherwise: gather + SDPA)
    decode_attention_kernel: bool = True
    # "auto": AP experts through the fused Numba kernel on CUDA, its torch twin elsewhere; "reference": the twin
    # everywhere (no kernel compile: for runs about plumbing, where the first compile would dominate). The twin reads
    # the routing on the host, which no CUDA graph can hold, so "reference" turns cuda_graphs off
    expert_impl: str = "auto"
    # on CUDA (fp16/fp32): the whole-step decode graphs run each layer's norms, RoPE, routing and shared-expert
    # elementwise work as fused kernels (MoEForCausalLM.use_layer_kernels; False: torch's ops)
    layer_kernels: bool = True
    # with layer_kernels: the packed steps (prefill, mixed) run the fused layer kernels as well (kept on in the model
    # for every forward). On an H100 at like host speed: a 453-token prefill step's median alike (39.2-39.8 ms against
    # 39.1-40.7), a fresh engine's first one 201-226 against 265-322, an eager decode step 0.2-1.6 ms less
    # (step_host-nvidia-h100-80gb-hbm3-20261206-s56-{n,p}-{3..7}.json); conversations alike (s56 kv_pressure)
    packed_layer_kernels: bool = True
    # on CUDA, at start: the fused kernel's prefill GEMM shapes run once each (runner.warm_prefill_gemms), so that
    # cuBLAS's choice of kernel for a new shape (up to ms of host time) falls there, not in a request's prefill step
    prefill_warm_up: bool = True
    # reload bytes issued per step: None = derived (ReloadPace: link speed x duty x measured step time),
    # 0 = unpaced, > 0 = that fixed cap
    reload_bytes_per_step: int | None = None
    # reloads started per step while requests run (0: no cap). Each start allocates its runs and issues its copies
    # on the host (~0.2-0.5 ms on the H200 box, engine_profile-nvidia-h200-20261129-paged.txt): the cap bounds that
    # host time beside decode steps; with nothing running the cap is off, so widths come back at full speed.
    reload_starts_per_step: int = 4
    # while requests run, a reload may compact the pool (move KV pages and weight runs out of a window) at most
    # once per this many steps (0: every step). A compaction scans the whole pool on the host (~0.9 ms per
    # compaction on the CPU replica of benchmarks/engine_bench.py --scaled); with nothing running it is not rationed.
    compact_every_steps: int = 8


@dataclass
class PagingStats:
    """Counters of the paging loop (engine side; the mover keeps its own byte counters)."""

    offload_triggers: int = 0  # plans written because free KV blocks fell to the threshold
    reload_triggers: int = 0  # plans written because free KV blocks stayed above it (+ hysteresis)
    planner_step_ms: float = 0.0  # the last step's planner time
    plan_step: int = 0  # step at which the current desired widths were written
    steps_in_flight: int = 0  # steps that ran while moves were pending or pages awaited release
    time_in_flight_s: float = 0.0
    syncs: int = 0  # times a short KV cache waited for in-flight work to release pages
    boundary_host_s: float = 0.0  # measured: host time of step boundaries (planner, move requests, mover, waits)
    planner_host_s: float = 0.0  # measured, part of boundary_host_s: planner.step
    requests_host_s: float = 0.0  # measured, part of boundary_host_s: move requests (_request_moves)
    move_requests: int = 0  # mover.request calls (offloads and reloads)
    move_refusals: int = 0  # of which refused (busy, out of pages, or would take KV the admitted requests need)
    offload_refusals: int = 0  # of the refusals, offloads' (the rest: reloads')
    observe_host_s: float = 0.0  # measured: host time reading routing statistics into the planner
    overlapped_boundaries: int = 0  # boundaries that ran beside their step's forward instead of before it


# activation_reserve="auto" keeps the profile's measured gap and this share more: a run's gap moves from run to run
# (tens of MiB) and the profile runs fewer step shapes than a long run does. On the H200 the profile measured 406 MiB
# where engine_bench's batch 4 grew 410 MiB beyond the engine (memory_gap-nvidia-h200-20261201-memgap-4-auto5.json);
# with this margin every measured workload stayed 35-212 MiB under its budget (…-auto4.json, …-auto5.json)
AUTO_RESERVE_MARGIN = 0.25
# a server's step_idle call holds the engine about this long at most (the next call goes on): a request arriving
# while widths come back waits for one slice, not the whole reload (with nothing running one boundary may start every
# reload and compaction a plan needs: idle plans of 0.2-0.7 GB, h100-...-20261206-s48-calls.log)
IDLE_SLICE_S = 0.01
RESERVE_HINT = (" The reserve was measured at start-up (activation_reserve='auto'): raise the budget, or give "
                "activation_reserve=0 for a budget of the weights and the pool only.")


@dataclass
class _History:
    """The sampler's history[i]: row i's generated token ids, looked up only for rows it adjusts (no pass over the
    step's rows)."""

    seqs: list[Sequence]

    def __getitem__(self, i: int) -> np.ndarray | None:
        return self.seqs[i].generated_ids()


@dataclass
class _Seen(_History):
    """The sampler's seen[i]: row i's prompt and generated ids (a repetition penalty's tokens)."""

    def __getitem__(self, i: int) -> np.ndarray:
        return np.asarray(self.seqs[i].token_ids, dtype=np.int64)


def check_device(device: str | torch.device) -> torch.device:
    """torch.device(device), refused with a ValueError (a clear CLI error, not a traceback) when it names no device
    kind torch knows, CUDA where there is none, or a CUDA device other than the current one."""
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device}: CUDA is not available on this machine")
    if dev.type == "cuda" and dev.index is not None and dev.index != torch.cuda.current_device():
        # the mover's and the runner's streams and the Numba kernels' launches are the current device's
        raise ValueError(f"device {device}: the engine runs on the process's current CUDA device "
                         f"(cuda:{torch.cuda.current_device()}); for GPU {dev.index} give CUDA_VISIBLE_DEVICES="
                         f"{dev.index} and device 'cuda'")
    return dev


def serving_reserve(gpu_memory_budget: int | float | None, device: str) -> int | str:
    """The activation reserve of the serving entry points (`pagedweight run`, the engine actor) when none is given:
    "auto" on CUDA under a budget, so that the budget bounds the process's whole footprint (peaks 35-212 MiB under
    it in memory_gap-nvidia-h200-20261201-memgap-*-auto4.json, 389-790 MiB over it with 0); 0 elsewhere (no budget
    to take it from; nothing to measure off CUDA). `LLM` itself defaults to 0: its budget then covers the weights
    and the pool, which is what the benchmarks' equal-memory comparisons size."""
    return "auto" if gpu_memory_budget is not None and torch.device(device).type == "cuda" else 0


def _stop_start_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that a stop string begins with (shorter than that stop string)."""
    return max((n for s in stops for n in range(min(len(s) - 1, len(text)), 0, -1) if s.startswith(text[-n:])),
               default=0)


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def param_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (`parameters()` yields a tied tensor once)."""
    return sum(t.numel() * t.element_size() for t in itertools.chain(module.parameters(), module.buffers()))


class LLM:
    """Offline and online serving of one MoE model within a memory budget (one engine, one device)."""

    def __init__(self, model_dir: str | Path, gpu_memory_budget: int | float | None = None, device: str = "cpu",
                 **engine_options) -> None:
        self._init_options(engine_options, device)
        self.model_dir = Path(model_dir)
        self.model_name = self.options.served_model_name or self.model_dir.name
        self.tokenizer = TextTokenizer.from_dir(self.model_dir)
        weights = None
        self.page_store_dir: Path | None = None  # the node page store this engine maps (AP checkpoints)
        self.planes_id: str | None = None  # which planes (runner.planes_id): engines of one model share a planner
        self._ap_weights: APWeights | None = None  # opened here (its page store): `close` drops them
        if (self.model_dir / MANIFEST).is_file():
            ap = load_ap(self.model_dir, verify=self.options.verify_checkpoint)
            model = build_ap_model(ap, self.dtype, self.device)
            self.planes_id = planes_id(ap)
            self.page_store_dir = Path(self.options.page_store_dir) if self.options.page_store_dir \
                else default_store_dir(ap)
            weights = self._ap_weights = ap_weights(ap, self.page_store_dir)
        else:
            model = load_model(self.model_dir, dtype=self.dtype, device=self.device)
        try:
            self._setup(model, gpu_memory_budget, weights)
        except BaseException:  # e.g. a budget too small: the store's mapping would stay for the process
            self.close()
            raise

    @classmethod
    def from_parts(cls, model: MoEForCausalLM, weights: APWeights | None, tokenizer: TextTokenizer | None = None,
                   gpu_memory_budget: int | float | None = None, device: str = "cpu", model_name: str = "model",
                   **engine_options) -> "LLM":
        """An engine over an already built model (benchmarks: random planes, no checkpoint on disk).

        With `weights`, the model's experts are replaced by pool readers; without a tokenizer, prompts must be
        token ids and `detokenize` must be False.
        """
        self = cls.__new__(cls)
        self._init_options(engine_options, device)
        self.model_dir, self.model_name, self.tokenizer = None, model_name, tokenizer
        if tokenizer is None and self.options.detokenize:
            raise ValueError("without a tokenizer pass detokenize=False (and token-id prompts)")
        self._setup(model, gpu_memory_budget, weights)
        return self

    def _init_options(self, engine_options: dict, device: str) -> None:
        known = {f.name for f in fields(EngineOptions)}
        unknown = sorted(set(engine_options) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        self.options = EngineOptions(**engine_options)
        if self.options.observe_every < 1 or self.options.block_size < 1 or self.options.max_num_seqs < 1:
            raise ValueError("observe_every, block_size and max_num_seqs must be >= 1")
        if self.options.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.options.reload_starts_per_step < 0:
            raise ValueError("reload_starts_per_step must be >= 0 (0: no cap)")
        if self.options.compact_every_steps < 0:
            raise ValueError("compact_every_steps must be >= 0 (0: no ration)")
        if not self.options.prefix_retention_s >= 0.0:  # NaN too
            raise ValueError(f"prefix_retention_s must be >= 0 seconds, got {self.options.prefix_retention_s!r}")
        if self.options.expert_impl not in ("auto", "reference"):
            raise ValueError(f"expert_impl {self.options.expert_impl!r}: use 'auto' or 'reference'")
        if self.options.expert_impl == "reference":
            self.options = replace(self.options, cuda_graphs=False)
        reserve = self.options.activation_reserve
        if reserve != "auto" and (not isinstance(reserve, int) or isinstance(reserve, bool) or reserve < 0):
            raise ValueError(f"activation_reserve must be an int of bytes >= 0 or 'auto', got {reserve!r}")
        self.device = check_device(device)
        self.dtype = parse_dtype(self.options.dtype or ("float16" if self.device.type == "cuda" else "float32"))

    def _setup(self, model: MoEForCausalLM, gpu_memory_budget: int | float | None,
               weights: APWeights | None) -> None:
        """Size the pool (the budget less the weights outside it and the activation reserve, measured first when
        "auto"), then build the engine around the loaded model."""
        opts, cfg = self.options, model.config
        self._reserve_measured = False  # activation_reserve="auto" (errors then say how to get out of it)
        model.fuse_projections()  # serving layout: fewer GEMM launches per decode step, the same weight bytes
        # the weights outside the pool (AP: experts are not parameters, so this is the non-paged rest); on CUDA in
        # one allocation, whose bytes are what the budget counts for them and what they reserve
        budget = None if gpu_memory_budget is None else resolve_budget(gpu_memory_budget, self.device)
        outside = model.pack_weights(budget) if self.device.type == "cuda" else param_bytes(model)
        self.model, self.config = model, cfg
        self.max_model_len = min(opts.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        layer_bytes = kv_layer_block_bytes(cfg, opts.block_size, self.dtype)
        # whole PAGE_ALIGN units and whole rows of one token's K or V (the KV cache's `rows`): layer_bytes itself
        # wherever a token's K is a multiple of 8 bytes at block_size 16
        self.page_bytes = round_up(layer_bytes, math.lcm(PAGE_ALIGN, layer_bytes // (2 * opts.block_size)))
        self.weights_outside_bytes = outside
        kv_block = self.page_bytes * cfg.num_hidden_layers
        if budget is None:
            if opts.activation_reserve:
                raise ValueError("activation_reserve is a share of gpu_memory_budget: give a budget too")
            pool_bytes = opts.kv_cache_bytes + self._expert_pool_bytes(weights)
        else:
            def pool_after(reserve: int) -> int:
                if budget - outside - reserve < kv_block:
                    raise ValueError(f"gpu_memory_budget leaves {budget - outside - reserve} B after {outside} B of "
                                     f"weights and an activation_reserve of {reserve} B: not even one KV block "
                                     f"({kv_block} B).{RESERVE_HINT if self._reserve_measured and reserve else ''}")
                pool = budget - outside - reserve
                if reserve and self.device.type == "cuda" and pool >= SEGMENT_OWN_MIN:
                    # the budget bounds the whole footprint: the pool's segment, which the allocator rounds up to
                    # whole SEGMENT_ROUNDs, stays within it (without a reserve its rounding falls outside the budget
                    # with the activations, and the pool keeps every page the budget pays for)
                    pool -= pool % SEGMENT_ROUND
                return pool

            if opts.activation_reserve == "auto":
                self.options = opts = replace(opts, activation_reserve=self._profile_reserve(pool_after(0), weights))
                self._reserve_measured = True
            pool_bytes = pool_after(opts.activation_reserve)
        self._build(pool_bytes, weights)

    def _build(self, pool_bytes: int, weights: APWeights | None) -> None:
        """Pool, weights, KV cache, scheduler and runner around the sized model."""
        model, cfg, opts = self.model, self.config, self.options
        self.pool = PagePool(pool_bytes, self.page_bytes, device=self.device)
        self.table = self.mover = self.planner = self.router_stats = None
        if weights is not None:
            self._setup_weights(model, weights)
        self.kv = PagedKVCache(cfg, self.pool, self.dtype, opts.block_size, opts.decode_attention_kernel,
                               opts.prefix_caching, opts.prefix_retention_s if self.planner is not None else 0.0,
                               max_model_len=self.max_model_len)
        self.scheduler = Scheduler(self.kv, opts.max_num_seqs, opts.max_num_batched_tokens, self.max_model_len)
        graphs = opts.cuda_graphs and self.device.type == "cuda"  # the CPU keeps the packed step (faster there)
        self.runner = ModelRunner(model, self.kv, self.device, max_num_seqs=opts.max_num_seqs if graphs else 0,
                                  max_model_len=self.max_model_len, layer_kernels=opts.layer_kernels,
                                  packed_layer_kernels=opts.packed_layer_kernels)
        # the prefill's compiled layout (models.layers._plan_rows) loaded or compiled here, not in a request's step
        t0 = time.perf_counter()
        expert_rows(np.zeros((1, 1), dtype=np.int64), 1, 1, True, True, 0.0, True)
        logger.info("prefill layout ready in {:.2f} s (measured)", time.perf_counter() - t0)
        if opts.prefill_warm_up and self.device.type == "cuda":  # cuBLAS's kernel choices, not in a request's step
            t0 = time.perf_counter()
            n = warm_prefill_gemms(model, self.dtype)
            if n:
                logger.info("prefill GEMMs: {} shapes warmed up in {:.2f} s (measured)", n, time.perf_counter() - t0)
        if graphs:  # each batch size's first decode step runs eagerly here, not in a request's step
            t0 = time.perf_counter()
            n = self.runner.decode.warm_up()
            logger.info("decode graphs: {} batch sizes warmed up in {:.2f} s (measured)", n, time.perf_counter() - t0)
        self.sampler = Sampler()
        tok_eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else ()
        self.eos_token_ids = set(tok_eos or cfg.eos_token_ids)
        self._requests: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []  # outputs decided outside a step (abort, rejected)
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_tokens_computed = 0  # tokens every step computed (prefill and decode): what routing statistics saw
        self.paging = PagingStats()
        self.gc_pauses = gc_watch.watch()  # the process's collector pauses, reported by stats()
        self._requested: dict[int, int] = {}  # block -> width of the moves this engine started
        self._committed, self._committed_at = None, -1  # committed_widths() and the table.commits it was built at
        self._routing_unread = False  # an observed step's statistics wait for the next step (_read_routing)
        self._in_flight = False  # the last boundary left pages in flight
        self._settled = False  # the last boundary was settled: the next may overlap its step (step())
        self._climbing = False  # the last boundary wanted no offload: widths only climb (or stay), see step()
        self._stalled = False  # the last boundary's reloads were refused with no move under way (step_idle)
        self._compact_step = -self.options.compact_every_steps  # step of the last compaction for a reload
        logger.info("engine: {} pool pages of {} B ({} KV blocks free), weights outside the pool {} B",
                    self.pool.capacity_pages, self.page_bytes, self.kv.num_free_blocks, self.weights_outside_bytes)

    def _expert_pool_bytes(self, weights: APWeights | None) -> int:
        """Pool bytes of every expert block at the parent width plus the mover's reserve (0 without AP weights)."""
        if weights is None:
            return 0
        return sum(round_up(s.plane_bytes, self.page_bytes) * weights.parent_bits
                   + 2 * round_up(s.lut_bytes[weights.parent_bits], self.page_bytes) for s in weights.specs)

    def _profile_reserve(self, room: int, weights: APWeights | None) -> int:
        """activation_reserve="auto": the bytes the device's caching allocator reserves beyond the weights and the
        pool while the engine runs its largest steps, plus AUTO_RESERVE_MARGIN of them (measured on CUDA; nothing
        to measure elsewhere: 0). The profile builds the engine with the pool its steps need (`_profile_pool_bytes`:
        the experts and KV for its longest prompt and widest decode, whose shapes max_model_len and max_num_seqs
        bound, not the pool's size), or half the pool's `room` when that is less (15/16 of it, or all, when the
        experts at the widths they start at and one step of KV need more), so that the profile itself stays within
        the budget while the gap is at most what it left out, runs `_profile_steps`, and releases it. (Half the room
        alone was too little on the bundled model: its 230 MiB gap beside 160 MiB of profile pool peaked 74 MiB above
        a 330 MiB budget at start-up, session 22.) What it cannot see: the graphs of the other decode shapes a long
        run captures into the same pool (their outputs and tables) and the allocator's fragmentation over a long run
        (benchmarks/memory_gap.py measures both against the reserve)."""
        sizes = (min(room // 2, self._profile_pool_bytes(weights)), room // 2, room - room // 16, room)
        for pool_bytes in dict.fromkeys(sizes):
            try:
                self._build(pool_bytes, weights)
                break
            except ValueError:  # "gpu_memory_budget too small": the experts need a larger share
                self._release(weights)
                if pool_bytes == room:
                    raise
        if pool_bytes == room:
            logger.warning("activation reserve: the profile needs the whole pool, so at start-up it exceeds the "
                           "budget by what it measures")
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            release_cached(self.device)  # what was cached would hide the growth measured below
            base = torch.cuda.memory_reserved(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        if cuda:  # the first kernel launches compile (Numba caches them on disk): minutes with nothing else to show
            logger.info("activation reserve: profiling the largest steps (on a machine's first start this includes "
                        "compiling the CUDA kernels, a few minutes; later starts load them from Numba's cache)")
        self._profile_steps()
        gap = 0
        if cuda:
            torch.cuda.synchronize(self.device)
            gap = torch.cuda.max_memory_reserved(self.device) - base
            if gap > room - self.pool.bytes_of(self.pool.capacity_pages):
                logger.warning("activation reserve: the profile peaked {:.1f} MiB above the budget at start-up "
                               "(measured)", (gap - room + self.pool.bytes_of(self.pool.capacity_pages)) / 2**20)
        self._release(weights)
        reserve = round_up(int(gap * (1 + AUTO_RESERVE_MARGIN)), 2 << 20)
        logger.info("activation reserve: {:.1f} MiB measured in {:.2f} s of profile steps{}, {:.1f} MiB kept",
                    gap / 2**20, time.perf_counter() - t0, "" if cuda else f" (nothing to measure on {self.device})",
                    reserve / 2**20)
        return reserve

    def _profile_steps(self) -> None:
        """The largest steps the engine schedules. First one prompt as long as the KV cache and max_model_len allow,
        alone: its chunks of max_num_batched_tokens at the longest context, each chunk's tokens scored with the most
        alternatives (prompt_logprobs: the LM head's chunks beside the chunk's hidden states). Then the widest decode
        at the longest block table, its tokens sampled through a top-k and top-p filter (the sampler's sort, its
        largest temporaries): such a prompt again beside as many one-token prompts as a step can decode with it,
        which keep decoding until it decodes too. A decode graph gathers every row padded to the longest table
        (runner.DecodeGraphs keys (B, blocks)), so this is its largest gather and graph; seen more than once, it is
        captured where the engine captures graphs. (Decoding one-token prompts alone, as before, missed it: on the
        H200 the bundled model then served 8 prompts of ~127 tokens with a graph pool 22 MiB larger, session 21.)"""
        opts, vocab, bs = self.options, self.config.vocab_size, self.options.block_size

        def long_prompt(room_blocks: int, gen: int) -> list[int]:
            n = max(1, min(self.max_model_len - gen, room_blocks * bs))
            return [(7 * i + 3) % vocab for i in range(n)]

        self.generate([long_prompt(self.kv.num_free_blocks - 1, 3)],
                      SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=MAX_LOGPROBS), use_tqdm=False)
        self.reset_prefix_cache()  # the next long prompt computes its whole prefill, as in serving
        # as many one-token prompts as fit in half the KV cache
        free = self.kv.num_free_blocks
        shorts = min(opts.max_num_seqs, opts.max_num_batched_tokens) - 1
        while shorts and shorts * self._short_blocks(shorts) > free // 2:
            shorts -= 1
        # sampled with a top-k filter of all but one token and top-p: the sampler's sort is its largest temporary
        # (sampling.py; on a GPU top-p alone takes the nucleus cut kernel, which sorts nothing)
        sampled = dict(temperature=1.0, top_k=vocab - 1, top_p=0.9, seed=0, ignore_eos=True)
        long_params = SamplingParams(max_tokens=6, **sampled)  # >= 2 steps of the widest decode
        room = free - shorts * self._short_blocks(shorts) - 2
        prompts = [long_prompt(room, long_params.max_tokens)] + [[(11 * i + 5) % vocab] for i in range(shorts)]
        short_params = SamplingParams(max_tokens=self._decode_steps(len(prompts[0]), shorts), **sampled)
        self.generate(prompts, [long_params] + [short_params] * shorts, use_tqdm=False)
        self.reset_prefix_cache()

    def _decode_steps(self, n: int, rows: int) -> int:
        """Steps the profile's one-token prompts decode beside a long prompt of n tokens: until its chunks (what the
        `rows` decodes leave of each step's tokens) are done, and a few more."""
        return min(self.max_model_len - 1, -(-n // (self.options.max_num_batched_tokens - rows)) + 8)

    def _short_blocks(self, rows: int) -> int:
        """KV blocks of one of the profile's one-token prompts beside a max_model_len prompt."""
        return -(-(1 + self._decode_steps(self.max_model_len, rows)) // self.options.block_size)

    def _profile_pool_bytes(self, weights: APWeights | None) -> int:
        """The pool `_profile_steps` needs to reach its largest shapes: the experts at the parent width, and KV for
        a max_model_len prompt beside every one-token prompt it decodes with (which it keeps within half the KV)."""
        opts, bs = self.options, self.options.block_size
        shorts = min(opts.max_num_seqs, opts.max_num_batched_tokens) - 1
        blocks = max(2 * shorts * self._short_blocks(shorts) + -(-self.max_model_len // bs) + 3,
                     -(-opts.max_num_batched_tokens // bs) + 1)  # _setup_weights keeps one step of KV free
        return blocks * self.page_bytes * self.config.num_hidden_layers + self._expert_pool_bytes(weights)

    def close(self) -> None:
        """Free the engine and its hold on the node page store: the process unpins and unmaps the store with its last
        engine. Without it a store destroyed and re-created (a new LLM on the same directory) stayed mapped, its
        tmpfs pages allocated, for the life of the process. The store itself stays (`PageStore.destroy`); weights
        handed to `from_parts` are the caller's to close. The LLM is unusable after."""
        weights, self._ap_weights = getattr(self, "_ap_weights", None), None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no copy still reads the pinned pages
        if getattr(self, "model", None) is not None:
            self._release(weights)  # the mover (its copies' sources are views of the mapping), experts, pool
        if weights is not None:
            weights.store.close()

    def _release(self, weights: APWeights | None) -> None:
        """Drop everything that holds the pool (the profile's engine), so that its memory is free for the next
        build: the runner's hook and graphs, the KV cache, table, mover and planner, and the experts that read the
        pool (their weights are the pool's: the next build installs new readers)."""
        if getattr(self, "runner", None) is not None:
            self.runner.close()
        self.model.set_router_observer(None)
        if weights is not None:
            for layer in range(self.config.num_hidden_layers):
                self.model.set_experts(layer, torch.nn.Identity())
        self.runner = self.kv = self.scheduler = self.table = self.mover = self.planner = None
        self.router_stats = self.pool = None
        gc.collect()  # graphs and modules in reference cycles
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _setup_weights(self, model: MoEForCausalLM, weights: APWeights) -> None:
        """Page table and mover over the pool; load every block at the widest uniform width that leaves the KV
        cache room for one full step; the planner (when paging) moves widths from there."""
        cfg, opts, P = model.config, self.options, weights.parent_bits
        home = opts.bits or P
        if not weights.seed_bits <= home <= P:
            raise ValueError(f"bits={home} outside the checkpoint's widths [{weights.seed_bits}, {P}]")
        if self.device.type == "cuda" and opts.expert_impl != "reference":
            from pagedweight.cuda.moe_kernels import MIN_WIDTH
            if weights.seed_bits < MIN_WIDTH:  # the kernel has no body for them: such blocks would add nothing
                raise ValueError(f"the fused MoE kernel reads widths {MIN_WIDTH} and up, this checkpoint's seed width "
                                 f"is {weights.seed_bits}: convert with --seed-bits {MIN_WIDTH}, or give "
                                 "expert_impl='reference'")
        self.table = WeightPageTable(weights.specs, cfg.num_hidden_layers, cfg.num_experts, P, self.pool)
        self.seed_width = weights.seed_bits  # no block goes below it (stats: the width histogram's first real entry)
        if self.device.type == "cuda" and hasattr(weights.store, "pin"):
            weights.store.pin()  # reloads copy from page-locked memory, without a second host copy
        pace = opts.reload_bytes_per_step
        try:
            self.mover = PageMover(self.table, weights.store,
                                   pace=None if pace == 0 else ReloadPace(bytes_per_step=pace))
        except PoolExhausted as e:  # its reserve (the largest LUT) does not fit
            raise self._too_small(f"the page mover's reserve of LUT pages does not fit in the pool of "
                                  f"{self.pool.bytes_of(self.pool.capacity_pages)} B") from e
        n = len(weights.specs)
        mem = np.zeros((n, P + 1))
        supported = np.zeros((n, P + 1), dtype=bool)
        for i, spec in enumerate(weights.specs):
            for b in spec.widths:
                mem[i, b], supported[i, b] = self.table.memory(i, b), True
        min_kv = (-(-opts.max_num_batched_tokens // opts.block_size) + 1) * self.page_bytes * cfg.num_hidden_layers
        room = self.pool.bytes_of(self.pool.free_pages - self.pool.reserve_pages) - min_kv
        fits = [b for b in range(weights.seed_bits, home + 1) if mem[:, b].sum() <= room]
        if not fits or (not opts.paging and fits[-1] != home):
            low = weights.seed_bits if opts.paging else home
            raise self._too_small(f"experts at {low} bits and one step of KV need {int(mem[:, low].sum() + min_kv)} "
                                  f"B of pool, {self.pool.bytes_of(self.pool.free_pages)} B available")
        start = fits[-1]
        for i in range(n):
            if not self.mover.request(i, start):
                raise RuntimeError(f"initial load of block {i} at {start} bits failed")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # every copy fence done: the first boundary commits them all
        self.mover.boundary()
        self._initial_bytes = self.mover.stats.bytes_copied
        install_ap_experts(model, self.table, self.pool, graphs=opts.cuda_graphs and self.device.type == "cuda",
                           reference=opts.expert_impl == "reference", max_tokens=opts.max_num_batched_tokens)
        logger.info("experts: {} blocks at {} bits ({} B resident), home width {}, paging {}", n, start,
                    self.table.resident_weight_bytes(), home, "on" if opts.paging else "off")
        if not opts.paging:
            return
        knobs = weights.knobs
        if opts.planner_knobs:
            knobs = PlannerKnobs.from_dict({**knobs.to_dict(), **opts.planner_knobs})
        tables = BlockTables(supported, mem, weights.sensitivity, cfg.num_hidden_layers, cfg.num_experts)
        self.planner = Planner(tables, knobs, np.full(n, start), heads=weights.heads,
                               routing_prior=weights.routing_mass,
                               home_widths=np.full(n, home), narrow_width=NARROW_WIDTH)
        self.router_stats = RouterStats(cfg.num_hidden_layers, cfg.num_experts)
        self.router_stats.active = False  # installed as every layer's observer, folding only on observed steps
        if weights.heads is not None:  # the heads' features describe each request's tokens so far, as in training
            self.router_stats.track_requests(opts.max_num_seqs, self._running)
        self._first_mlp = self.model.layers[0]._modules["mlp"]  # its observer says what every layer's is

    def _too_small(self, what: str) -> ValueError:
        """The error of a budget whose pool cannot hold the engine; under a measured reserve, with the ways out."""
        reserve = self.options.activation_reserve
        measured = self._reserve_measured and reserve
        hint = f" beside an activation_reserve of {reserve} B.{RESERVE_HINT}" if measured else ""
        return ValueError(f"gpu_memory_budget too small: {what}{hint}")

    # ---- requests ----
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = (params or SamplingParams()).clone().validate()  # its own copy (lists and dict too): later edits
        # of the caller's (a logit_bias entry added for the next request) neither reach this request nor its arrays
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: pass token ids")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty (zero tokens)")
        if params.stop and not self.options.detokenize:
            raise ValueError("stop strings need detokenize=True (they are matched in the text): give stop_token_ids")
        if min(ids) < 0 or max(ids) >= self.config.vocab_size:
            raise ValueError(f"prompt token ids must lie in [0, {self.config.vocab_size})")
        if params.logit_bias and max(params.logit_bias) >= self.config.vocab_size:
            raise ValueError(f"logit_bias token ids must lie in [0, {self.config.vocab_size})")
        gen = None if params.greedy else make_generator(params.seed, self.device)
        seq = Sequence(request_id, ids, params, generator=gen)
        self._requests[request_id] = seq
        if len(ids) >= self.max_model_len:
            seq.finish("error", f"prompt of {len(ids)} tokens leaves no room under max_model_len "
                                f"{self.max_model_len}")
            self._pending.append(self._output(seq))
        else:
            self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its KV blocks are free when this returns. False if it is unknown or already done."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        self._pending.append(self._output(seq))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # ---- one step ----
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the outputs of requests that advanced or finished.

        The paging boundary (planner, move requests, commits) runs before the step is scheduled, so that what it
        releases can be admitted at once. When no request waits for admission and the last boundary was settled
        (no plan, no move under way or wanted, most decode steps), or wanted no offload while the KV cache has
        the blocks this step allocates plus the trigger margin free (widths climbing back after pressure: no
        release to hurry), it runs instead once the step's forward is queued on the device, before its tokens are
        read: its host time then overlaps the step instead of leaving the GPU idle between steps. What it changes
        there reaches the device stream-ordered after this step's reads (table updates, relocation copies) or
        behind this step's fence (copies into pages this step may still read), and a release it starts commits at
        the next step's boundary."""
        t0 = time.perf_counter()
        outputs, self._pending = self._pending, []
        overlap = not self.scheduler.waiting and (self._settled or (self._climbing and self._kv_spare()))
        if not overlap:
            self._boundary()
        batch = self.scheduler.schedule()
        outputs += [self._output(seq) for seq in batch.failed]
        if not batch.seqs:
            if overlap:
                self._boundary()
            self._end_step(t0)
            return outputs
        # Before the launch only flags change: host time here leaves the GPU idle (on the H200 the observers'
        # per-step writes, reset and token weights put 0.05-0.15 ms before an observed step's launch and the
        # next's, launch_marks-nvidia-h200-20261130-s12.json; with only flags, within 0.05 ms of uniform's launch,
        # launch_marks-nvidia-h200-20261130-s13.json)
        observe = self.router_stats is not None and self.num_steps % self.options.observe_every == 0
        if self.router_stats is not None:
            if getattr(self._first_mlp, "observer", None) is not self.router_stats:  # a direct forward reset it
                self.model.set_router_observer(self.router_stats)
            if observe:
                self._read_routing()  # an unread earlier window (observe_every == 1) before the next one starts
                self.router_stats.arm(batch.num_new_tokens, [len(s.block_table) for s in batch.seqs], batch.seqs)
        to_sample, tokens, failure = [], [], None
        try:
            to_sample, logits, prompt_rows = self.runner.run(batch)
        except Exception as exc:  # a failed forward must not take the other requests down with it
            failure = exc
        finally:
            if self.mover is not None:
                self.mover.end_step()  # fences this step's reads of the pages it used
        picked = None
        if failure is None:
            self.num_tokens_computed += batch.num_tokens
            self.kv.publish(batch.seqs)  # blocks this step filled: later requests with the same prefix read them
            try:  # the sampling and its tokens' copy to the host, queued right behind the forward
                picked = self.sampler.pick(logits, [s.params for s in to_sample], [s.generator for s in to_sample],
                                           _History(to_sample), self.eos_token_ids, _Seen(to_sample))
            except Exception as exc:  # noqa: BLE001 - same as a failed forward
                failure = exc
        # behind the token copy (the token read does not wait for them): a decode step's routing fold (its router
        # records, handed over even when the sampling failed: they belong to this step's window), then an observed
        # step's statistics copy, which the next step reads
        try:
            self.runner.observe()
            if observe:
                self.router_stats.prefetch()
        except Exception as exc:  # noqa: BLE001 - same as a failed forward
            failure = failure or exc
        if observe:
            self.router_stats.active = False
        if overlap:
            self._boundary()
            self.paging.overlapped_boundaries += 1
        if failure is None:
            try:
                self._read_routing()  # the last observed step's statistics: host work while this step runs
                tokens = picked.tolist()
                self._logprobs(logits, to_sample, tokens)
                if prompt_rows is not None:
                    self._prompt_logprobs(prompt_rows)
            except Exception as exc:  # noqa: BLE001 - same as a failed forward
                failure = exc
        if failure is not None:
            logger.opt(exception=failure).error("step {} failed; its {} requests end with an error", self.num_steps,
                                                len(batch))
            for seq in batch.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, "error", f"{type(failure).__name__}: {failure}")
                    outputs.append(self._output(seq))
            to_sample, tokens = [], []
        self._routing_unread = self._routing_unread or observe  # set after this step's own read of the last window
        now = time.perf_counter()
        for seq, tok in zip(to_sample, tokens):
            self._append(seq, tok, now)
            if seq.is_finished or seq.params.output_kind != "final_only":
                outputs.append(self._output(seq))
        self.kv.fold_copies(self.scheduler.running)  # the step is done: the next boundary sees the copies freed
        self._end_step(t0)
        return outputs

    def step_idle(self, max_boundaries: int = 64, max_s: float | None = None) -> bool:
        """With no request in the engine, run paging boundaries (no forward) until the paging loop settles or
        `max_boundaries` ran; True if paging work remains. A server calls it while idle: no request, so no KV need
        can come back before the next one, and the planner's reload window is cleared (`Planner.forget_need`). The
        weights then regain their widths at once, not only after `reload_dwell_steps` steps that an idle engine
        never takes. On CUDA each boundary that leaves copies in flight waits for them (nothing else runs).
        With `max_s` (a server: `IDLE_SLICE_S`), reloads stop starting once that many seconds have passed (at least
        one starts) and the call returns: a request that arrives meanwhile is not held behind the whole reload.
        False also when the reloads wanted were refused with no move under way: the next boundary would only be
        refused again until memory changes (a request, or a kept block's retention ending), so the caller waits
        for that rather than spinning."""
        if self.planner is None or self.has_unfinished():  # no planner (static widths): nothing to reload
            return False
        self.planner.forget_need()
        deadline = None if max_s is None else time.perf_counter() + max_s
        for _ in range(max_boundaries):
            self._boundary(deadline)
            if self._settled or (self._stalled and not self._in_flight):
                return False
            if self._in_flight and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if deadline is not None and time.perf_counter() >= deadline:
                break
        return True

    def _running(self) -> list[Sequence]:
        """The running requests (RouterStats reuses the rows of all others)."""
        return self.scheduler.running

    def _kv_spare(self) -> bool:
        """The KV cache has the blocks the next step allocates and the planner's trigger margin free, retained kept
        blocks aside (the planner keeps them): the step needs nothing from this boundary."""
        return self.kv.num_unretained_free_blocks > self.scheduler.blocks_wanted() + self.planner.knobs.trigger_blocks

    def _boundary(self, deadline: float | None = None) -> None:
        t0 = time.perf_counter()
        self._in_flight = self._paging_boundary(deadline)
        self.paging.boundary_host_s += time.perf_counter() - t0

    def _end_step(self, t0: float) -> None:
        self.num_steps += 1
        if self._in_flight:  # pages were in flight while this step ran
            self.paging.steps_in_flight += 1
            self.paging.time_in_flight_s += time.perf_counter() - t0

    # ---- the paging loop ----
    def _read_routing(self) -> None:
        """Fold the routing statistics of the last observed step into the planner, if not done yet.

        Called once the next step's work is queued: its copy to the host was queued right behind the observed
        step's forward and token copy (`RouterStats.prefetch`), so this is host work beside the running step, not
        after it (the H200 traces put 0.23-0.29 ms on each observed step at batch 1 when it came after the step; the
        prefetch itself, queued after the token read, cost 0.2-0.3 ms of host time there at batch 4:
        engine_bench-…-s7-v3.json; queued after the token copy, it is host time before that read). The planner sees
        each window one step later than it was observed."""
        if not self._routing_unread:
            return
        t0 = time.perf_counter()
        # features feed only the residual heads: without heads, no [n, 4] host computation per read
        features = self.router_stats.features() if self.planner.heads is not None else None
        self.planner.observe(self.router_stats.mass, features)
        self._routing_unread = False
        self.paging.observe_host_s += time.perf_counter() - t0

    def routing_mass(self) -> np.ndarray:
        """The planner's decayed routing mass [L, E] (rows sum to 1), a copy: what a cluster planner merges."""
        routing = self._routing()
        self._read_routing()
        return routing.mass.copy()

    def set_routing_mass(self, mass: np.ndarray) -> None:
        """Adopt a routing mass [L, E] (e.g. merged across engines); rows are normalised, a zero row is uniform."""
        routing = self._routing()
        self._read_routing()  # a local window still unread would otherwise land on top of the adopted mass
        mass = np.asarray(mass, dtype=np.float64)
        if mass.shape != routing.mass.shape:
            raise ValueError(f"routing mass of shape {mass.shape}, this model wants {routing.mass.shape}")
        routing.mass = normalize_mass(mass)

    def _routing(self) -> RoutingTracker:
        if self.planner is None:
            raise RuntimeError("this engine has no planner (dense or static weights): no routing mass")
        return self.planner.routing

    def committed_widths(self) -> np.ndarray:
        """q_i of every block in flat order (the staged table: what the next step reads), read-only.

        Rebuilt only after a commit (every step boundary asks; most see no commit)."""
        if self._committed_at != self.table.commits:
            widths = self.table.host_q.numpy().reshape(-1).astype(np.int64)
            widths.flags.writeable = False
            self._committed, self._committed_at = widths, self.table.commits
        return self._committed

    def _paging_boundary(self, deadline: float | None = None) -> bool:
        """Feed the planner, start the moves it wants (reloads until `deadline`, a perf_counter time, if given),
        commit what is ready. True if pages are in flight.
        Sets `_settled`: no plan written, no move under way or wanted, nothing in flight; and `_climbing`: no
        offload wanted or under way."""
        if self.mover is None:
            return False
        wanted = self.scheduler.blocks_wanted()
        settled, plan = self.planner is None, None  # static widths (no planner): nothing to plan or move
        if self.planner is not None:
            t0 = time.perf_counter()
            committed = self.committed_widths()
            demand = self.scheduler.blocks_demand()
            self.kv.age()
            transit = max(0, self.mover.transit_bytes() - self.kv.reserve_borrowed_bytes)  # exact KV room (kv_cache)
            kv = KVState(self.kv.num_free_blocks, demand, self.kv.block_bytes, transit, self.kv.num_used_blocks,
                         self.kv.num_retained_blocks)
            t1 = time.perf_counter()
            plan = self.planner.step(kv, committed)
            self.paging.planner_host_s += time.perf_counter() - t1
            if plan is not None:
                self.paging.plan_step = self.num_steps
                logger.info("step {}: {} plan of {:.1f} MB (KV: {} blocks free, {} wanted by admitted requests, "
                            "{:.1f} MB in transit)", self.num_steps, plan.kind, plan.delta_bytes / 1e6,
                            kv.free_blocks, demand, kv.transit_bytes / 1e6)
                if plan.kind == "release":
                    self.paging.offload_triggers += 1
                elif plan.kind == "reload":
                    self.paging.reload_triggers += 1
            t2 = time.perf_counter()
            settled = self._request_moves(committed, (demand + 1 + self.planner.knobs.trigger_blocks)
                                          * self.kv.block_bytes, deadline)
            t3 = time.perf_counter()
            self.paging.requests_host_s += t3 - t2
            self.paging.planner_step_ms = (t3 - t0) * 1e3
        self.mover.boundary()
        if self.kv.num_unretained_free_blocks < wanted and not self.mover.idle() and self.device.type == "cuda":
            # short of KV now (retained kept blocks aside: an allocation would evict them while a release for them is
            # under way): wait for the copies and the last step so retired pages can be freed this boundary
            torch.cuda.synchronize(self.device)
            self.mover.boundary()
            self.paging.syncs += 1
        idle = self.mover.idle()
        self._settled = settled and plan is None and idle
        return not idle

    def _request_moves(self, committed: np.ndarray, keep_free_bytes: int, deadline: float | None = None) -> bool:
        """Bring the mover in line with the planner's desired widths (retargeting moves it changed its mind on).

        Offloads first: their new LUTs need pages. A reload starts only if it leaves `keep_free_bytes` free (the KV
        blocks the admitted requests still need, plus the trigger margin): it takes its pages when it starts and
        holds the old LUT until its commit, briefly more than the planner priced, and must not take blocks a
        running request is about to write. After the first reload refused, the rest wait for a later boundary
        (they would mostly be refused too, and thousands of refusals per step cost host time). While requests run or
        wait, at most `reload_starts_per_step` reloads start per boundary; after `deadline` (idle slices) none but
        the first.
        """
        want = self.planner.desired
        self._stalled = False
        if not self._requested and np.array_equal(want, committed):
            self._climbing = True
            return True  # settled (most decode steps): no move under way and none wanted
        diff = want != committed
        self._climbing = not (want < committed).any()  # an offload wanted or under way lowers a width
        for i, b in list(self._requested.items()):  # the moves started earlier: keep, retarget or forget
            if self.mover.pending(i):
                if want[i] == b:
                    diff[i] = False  # under way to what the planner still wants
                    continue
                self.mover.cancel(i)
            del self._requested[i]
        for i in np.flatnonzero(diff & (want < committed)).tolist():  # offloads, every one
            self.paging.move_requests += 1
            if self.mover.request(i, int(want[i])):
                self._requested[i] = int(want[i])
            else:
                self.paging.move_refusals += 1
                self.paging.offload_refusals += 1
        # a waiting request counts: its first step may follow an idle slice cut short with reloads still wanted
        busy = bool(self.scheduler.running or self.scheduler.waiting)
        cap = self.options.reload_starts_per_step if busy else 0
        keep, started = self.pool.pages_for(keep_free_bytes), 0
        for i in np.flatnonzero(diff & (want > committed)).tolist():  # reloads, in block order, until refused/capped
            self.paging.move_requests += 1
            relocate = not busy or self.num_steps >= self._compact_step + self.options.compact_every_steps
            compactions = self.pool.relocations
            ok = self.mover.request(i, int(want[i]), keep_free_pages=keep, relocate=relocate)
            if self.pool.relocations != compactions:
                self._compact_step = self.num_steps
            if not ok:
                self.paging.move_refusals += 1
                self._stalled = not self._requested
                break
            self._requested[i] = int(want[i])
            started += 1
            if started == cap or (deadline is not None and time.perf_counter() >= deadline):
                break
        return False

    def _logprobs(self, logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> None:
        """Each sequence that asks for log-probabilities gets its new token's (no work when none asks)."""
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if rows:
            entries = Sampler.logprobs(logits, rows, [tokens[i] for i in rows], [seqs[i].params.logprobs for i in rows])
            for i, entry in zip(rows, entries):
                seqs[i].logprobs.append(entry)

    def _prompt_logprobs(self, rows: PromptRows) -> None:
        """The scored prompt positions' entries, each sequence's appended in position order."""
        targets = [t for seq, lo, hi in rows.spans for t in seq.prompt_token_ids[lo + 1:hi + 1]]
        counts = [seq.params.prompt_logprobs for seq, lo, hi in rows.spans for _ in range(lo, hi)]
        entries = Sampler.prompt_logprobs(rows.hidden, self.model.lm_head, targets, counts)
        i = 0
        for seq, lo, hi in rows.spans:
            seq.prompt_logprobs += entries[i:i + hi - lo]
            i += hi - lo

    def _append(self, seq: Sequence, token: int, now: float) -> None:
        """Add a sampled token, extend the text, and finish the request when a stop condition holds."""
        seq.append_token(token, now)
        p = seq.params
        reason = None
        stops = seq.num_completion_tokens >= p.min_tokens  # before min_tokens only max_tokens ends it (vLLM's rule)
        checked = len(seq.text)  # stop strings are looked for in the text this token adds
        if self.options.detokenize and self._extend_text(seq) and p.stop and stops:
            reason = self._cut_at_stop(seq, checked)
        cut = reason is not None
        if reason is None and stops and (token in p.stop_token_ids or token in self.eos_token_ids
                                         and not p.ignore_eos):
            reason = "stop"
        if reason is None and (seq.num_completion_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            if self.options.detokenize and not cut and seq.read_offset < seq.num_completion_tokens:
                self._extend_text(seq, final=True)  # flush text held back for an unfinished character
                if p.stop and stops:  # whose whole characters no stop string was looked for in yet
                    reason = self._cut_at_stop(seq, checked) or reason
            self.scheduler.finish(seq, reason)

    def _extend_text(self, seq: Sequence, final: bool = False) -> bool:
        """Incremental detokenization; holds back text while the last tokens end inside a UTF-8 character."""
        ids, base = seq.token_ids, seq.num_prompt_tokens  # slices of the tail only: no copy of every token
        before = self.tokenizer.decode(ids[base + seq.prefix_offset:base + seq.read_offset])
        after = self.tokenizer.decode(ids[base + seq.prefix_offset:])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return False
        seq.text += after[len(before):]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids) - base
        return True

    def _cut_at_stop(self, seq: Sequence, new_from: int) -> str | None:
        """Cut the text before the first stop string that the text from `new_from` on completes."""
        hits = [i for s in seq.params.stop
                if (i := seq.text.find(s, max(0, new_from - len(s) + 1))) >= 0]
        if not hits:
            return None
        seq.text = seq.text[:min(hits)]
        return "stop"

    def _output(self, seq: Sequence) -> RequestOutput:
        text = seq.text
        if seq.params.stop and not seq.is_finished:  # a later token may complete a stop string there and cut it
            text = text[:len(text) - _stop_start_len(text, seq.params.stop)]
        delta = text[seq.sent_text_len:]
        seq.sent_text_len = len(text)
        by_delta = seq.params.output_kind == "delta"
        start = seq.num_prompt_tokens + (seq.sent_tokens if by_delta else 0)
        prompt_logprobs = None
        if seq.params.prompt_logprobs is not None and not (by_delta and seq.sent_tokens):
            prompt_logprobs = [None, *seq.prompt_logprobs]
        seq.sent_tokens = seq.num_completion_tokens
        if seq.is_finished:
            self._requests.pop(seq.request_id, None)
        logprobs = seq.logprobs[start - seq.num_prompt_tokens:] if seq.params.logprobs is not None else None
        queued = None if seq.first_scheduled_time is None else seq.first_scheduled_time - seq.arrival_time
        return RequestOutput(seq.request_id, seq.prompt_token_ids, seq.token_ids[start:], text, delta,
                             seq.is_finished, seq.finish_reason, seq.error, seq.num_completion_tokens, logprobs,
                             prompt_logprobs, seq.num_cached_tokens, queued)

    # ---- blocking and streaming front ends ----
    def reset_prefix_cache(self) -> int:
        """Give every kept prefix block back to the pool (as vLLM's LLM.reset_prefix_cache: a benchmark's runs start
        alike); blocks that requests hold stay. Returns the blocks given back."""
        n = self.kv.num_cached_blocks
        self.kv.evict(n)
        return n

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """The assistant's reply to one conversation (a list of {"role", "content"} messages) or to each of a list
        of them, each rendered by the checkpoint's chat template (pagedweight.chat); outputs in order."""
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: chat needs one")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, **(chat_template_kwargs or {})) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Serve every prompt to completion (continuous batching); outputs in prompt order. One prompt (a string,
        or a list of token ids) is served as a list of one. Outputs of other requests (added with add_request, or
        another stream's) that the steps here produce are kept for the next `step()`."""
        if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
            params = sampling_params
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        for p in params:
            p.validate()
        # only finished outputs are kept: the others are not built (each would copy the tokens generated so far)
        params = [p.clone(output_kind="final_only") for p in params]
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.add_request(prompt, p))
        except BaseException:  # a bad prompt: the ones added before it would run on with nobody to read them
            for rid in ids:
                self.abort(rid)
            self._pending = [o for o in self._pending if o.request_id not in ids]  # nor surface in a later step
            raise
        wanted, done, others = set(ids), {}, []
        try:
            with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
                while len(done) < len(ids) and self.has_unfinished():
                    for out in self.step():
                        if out.request_id not in wanted:
                            others.append(out)
                        elif out.finished:
                            done[out.request_id] = out
                            bar.update(1)
        finally:
            self._pending[:0] = others  # the next step() returns them, before its own
        return [done[r] for r in ids]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield this request's outputs as they come; closing the iterator early aborts the request. Outputs of
        other requests (another stream's, interleaved with this one) go back for the next `step()`."""
        request_id = self.add_request(prompt, params)
        finished = False
        try:
            while not finished and self.has_unfinished():
                outs = self.step()
                self._pending[:0] = [o for o in outs if o.request_id != request_id]
                for out in outs:
                    if out.request_id == request_id:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.abort(request_id)

    # ---- observability ----
    def stats(self) -> dict:
        free = self.kv.num_free_blocks
        out = {
            "kv_free_blocks": free,
            "kv_total_blocks": free + self.kv.num_used_blocks,
            "resident_weight_bytes": 0,
            "committed_width_hist": [],
            "bytes_offloaded": 0,
            "bytes_reloaded": 0,
            "pages_in_flight": 0,
            "planner_step_ms": self.paging.planner_step_ms,
            "boundary_host_s": self.paging.boundary_host_s,
            "planner_host_s": self.paging.planner_host_s,
            "requests_host_s": self.paging.requests_host_s,
            "move_requests": self.paging.move_requests,
            "move_refusals": self.paging.move_refusals,
            "offload_refusals": self.paging.offload_refusals,
            "observe_host_s": self.paging.observe_host_s,
            "plan_staleness_steps": 0,
            "offload_triggers": self.paging.offload_triggers,
            "reload_triggers": self.paging.reload_triggers,
            # copy/compute overlap: steps (and their wall time) that ran while weight pages were in flight
            "engine_steps": self.num_steps,
            "steps_in_flight": self.paging.steps_in_flight,
            "time_in_flight_s": self.paging.time_in_flight_s,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "preemptions": self.scheduler.num_preemptions,
            # prefix sharing: prompt tokens of the requests that looked their prefix up, and those found computed
            "prefix_query_tokens": self.scheduler.prefix_query_tokens,
            "prefix_hit_tokens": self.scheduler.prefix_hit_tokens,
            "kv_cached_blocks": self.kv.num_cached_blocks,  # kept prefix blocks, within kv_free_blocks
            "kv_retained_blocks": self.kv.num_retained_blocks,  # of those, within prefix_retention_s of release
            "kv_evicted_blocks": self.kv.evicted_blocks,  # kept blocks given back for KV or weights
            "kv_reclaimed_blocks": self.kv.reclaimed_blocks,  # of those, taken by weight reloads
            # pool compactions for weight reloads: KV pages and weight runs moved, and their bytes
            "kv_relocations": self.pool.relocations,
            "kv_relocated_bytes": self.pool.bytes_of(self.pool.relocated_pages),
            "weight_relocations": self.pool.relocated_weight_runs,
            "weight_relocated_bytes": self.pool.bytes_of(self.pool.relocated_weight_pages),
            # computed: what gpu_memory_budget covers (weights outside the pool, the pool's whole pages and the
            # activation reserve)
            "budget_bytes": (self.weights_outside_bytes + self.pool.bytes_of(self.pool.capacity_pages)
                             + self.options.activation_reserve),
            # measured on CUDA (None elsewhere): what torch's caching allocator holds on the device for this
            # process, now and at its peak (since the process started, or since an "auto" reserve's profile began:
            # it resets the peak); the gap to budget_bytes is activations, CUDA-graph pools and scratch
            "device_reserved_bytes": None,
            "device_peak_reserved_bytes": None,
            **self.gc_pauses.stats(),  # measured: the process's garbage collections and their pauses
        }
        if self.device.type == "cuda":
            out["device_reserved_bytes"] = torch.cuda.memory_reserved(self.device)
            out["device_peak_reserved_bytes"] = torch.cuda.max_memory_reserved(self.device)
        if self.table is not None:
            q = self.table.host_q.numpy()
            widths = self.table.parent_bits + 1
            out.update(
                resident_weight_bytes=self.table.resident_weight_bytes(),
                committed_width_hist=[np.bincount(q[l].ravel(), minlength=widths).tolist() for l in range(len(q))],
                seed_width=self.seed_width,
                bytes_offloaded=self.mover.stats.bytes_freed,
                bytes_reloaded=self.mover.stats.bytes_copied - self._initial_bytes,
                pages_in_flight=self.mover.in_flight_pages(),
                plan_staleness_steps=(self.num_steps - self.paging.plan_step) if self._requested else 0)
        return out
