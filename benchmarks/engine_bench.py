"""Engine throughput and memory (issue 8 item 5): FP16 dense vs uniform AP 3/4/5/6 bits vs PagedWeight.

A Qwen1.5-MoE-A2.7B-shaped model with random weights: the non-expert weights are random fp16 tensors, the
experts are random bit-planes and LUTs put in a pinned CPU page store directly (no quantizer, no checkpoint
on disk); the same engine serves all configurations. Each configuration gets a budget: FP16 = its weights +
the KV cache of the batch; uniform AP b = non-expert weights + experts at b bits + the mover's reserve + the
same KV; PagedWeight = the uniform-b budget with paging on (home = parent width, or `--paged-home`), so it
chooses its widths within the same memory. Rows: tokens/s (decode and end to end) and torch.cuda.max_memory_reserved.

    python -m benchmarks.engine_bench                   # H200: full shape, seq len 2048, batch 1 and 4
    python -m benchmarks.engine_bench --tiny --device cpu   # CPU check at toy sizes
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import io
import json
import pstats
import re
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from benchmarks.common import failed_row, write_result
from pagedweight.bitplanes import lut_bytes
from pagedweight.engine import LLM, PagingStats, param_bytes, round_up
from pagedweight.knobs import PlannerKnobs
from pagedweight.kv_cache import kv_layer_block_bytes
from pagedweight.models import ModelConfig, MoEForCausalLM
from pagedweight.page_table import BlockSpec, expert_block_specs
from pagedweight.pool import PAGE_ALIGN
from pagedweight.runner import APWeights, DecodeStats, lut_width
from pagedweight.sampling import SamplingParams
from pagedweight.signals import N_FEATURES, ResidualHeads

QWEN15_MOE = dict(family="qwen2_moe", vocab_size=151936, hidden_size=2048, moe_intermediate_size=1408,
                  num_hidden_layers=24, num_experts=60, top_k=4, norm_topk_prob=False, num_attention_heads=16,
                  num_key_value_heads=16, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
                  max_position_embeddings=8192, shared_expert_intermediate_size=5632, qkv_bias=True)
# Toy shapes whose bytes stand to each other as the full shape's do at seq len 2048, batch 4: KV of the batch about
# half of the experts at 4 bits, and the 4 -> 6-bit planes about 2.5x that KV (full shape 0.24 and 2.3), so the
# paging loop meets the same pressure on a CPU.
TINY = dict(QWEN15_MOE, vocab_size=512, hidden_size=128, moe_intermediate_size=256, num_hidden_layers=2,
            num_experts=32, top_k=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
            shared_expert_intermediate_size=64, max_position_embeddings=4096)


class RandomPlaneStore:
    """Stand-in page store: every plane reads one pinned buffer of random words, every LUT one of small normal
    fp16 values (valid numbers, so activations stay finite). Reload copies move real bytes at real speed."""

    def __init__(self, specs: list[BlockSpec], seed: int = 0) -> None:
        self.specs = specs
        gen = torch.Generator().manual_seed(seed)
        max_plane = max(s.plane_bytes for s in specs)
        max_lut = max(n for s in specs for n in s.lut_bytes.values())
        self.planes = torch.randint(0, 256, (max_plane,), dtype=torch.uint8, generator=gen)
        self.luts = (torch.randn(max_lut // 2, generator=gen) * 0.02).half().view(torch.uint8)
        if torch.cuda.is_available():
            self.planes, self.luts = self.planes.pin_memory(), self.luts.pin_memory()

    def tensor(self, block: int, what: str, idx: int) -> torch.Tensor:
        spec = self.specs[block]
        return self.planes[:spec.plane_bytes] if what == "plane" else self.luts[:spec.lut_bytes[idx]]


# Qwen1.5's block count (24 x 60 x 2) at CPU-sized dims, with one 16-wide KV head so that pages are small and a
# plane spans 16 of them: the pool fragments the way the full shape's does on the H200 (planes of 3-6 pages), which
# the toy shapes (one page per plane) cannot show. For host-time measurements of the paging loop on CPU.
SCALED_PAGES = dict(QWEN15_MOE, vocab_size=2048, hidden_size=512, moe_intermediate_size=256, num_attention_heads=4,
              num_key_value_heads=1, head_dim=16, shared_expert_intermediate_size=512, max_position_embeddings=4096)


# Qwen3-30B-A3B's shape: grouped-query attention (32 query heads over 4 KV heads), so decode rows take the gather
# path (kv_cache.py), and 128 experts of which 8 are routed; no shared expert.
QWEN3_MOE = dict(family="qwen3_moe", vocab_size=151936, hidden_size=2048, moe_intermediate_size=768,
                 num_hidden_layers=48, num_experts=128, top_k=8, norm_topk_prob=True, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=8192,
                 qk_norm="head")
SHAPES = {"qwen1.5-moe": ("Qwen1.5-MoE-A2.7B", QWEN15_MOE), "qwen3-moe": ("Qwen3-30B-A3B", QWEN3_MOE)}


def model_config(tiny: bool, scaled: bool = False, shape: str = "qwen1.5-moe") -> ModelConfig:
    return ModelConfig(**(TINY if tiny else SCALED_PAGES if scaled else SHAPES[shape][1]))


def outside_bytes(cfg: ModelConfig, dtype: torch.dtype, device: str = "cpu") -> int:
    """Bytes of the weights outside the pool as the engine holds them on `device`: the serving layout
    (`fuse_projections`, whose fused input projection has alignment rows) of the model without its routed experts,
    packed in one allocation on CUDA (`pack_weights`: each weight 256-byte aligned)."""
    model = random_model(cfg, False, dtype, "meta")
    model.fuse_projections()
    return model.packed_bytes(device) if torch.device(device).type == "cuda" else param_bytes(model)


def random_model(cfg: ModelConfig, dense_experts: bool, dtype: torch.dtype, device: str, seed: int = 0
                 ) -> MoEForCausalLM:
    """Random weights allocated directly in `dtype` on `device` (no float32 detour: the FP16 experts are 25 GB)."""
    with torch.device("meta"):
        model = MoEForCausalLM(cfg)
    if not dense_experts:
        for layer in range(cfg.num_hidden_layers):
            model.set_experts(layer, nn.Identity())
    model = model.to(dtype=dtype)
    if device == "meta":
        return model
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.tie_weights()
    return model.eval()


def ap_weights(cfg: ModelConfig, parent_bits: int, seed_bits: int = 3, seed: int = 0, heads: bool = True
               ) -> APWeights:
    """Random planes and tables. `heads`: random prompt residual heads, because `pagedweight convert` fits heads by
    default and a checkpoint with heads pays more per observed step (block features, eta rows, damage rows) than
    one without; being random, the blocks they make a plan pick mean nothing here, only the work does."""
    specs = expert_block_specs(cfg.num_hidden_layers, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                               parent_bits, seed_bits)
    rng = np.random.default_rng(seed)
    n = len(specs)
    sens = np.zeros((n, parent_bits + 1))
    scale = rng.lognormal(0.0, 1.0, n)
    for b in range(seed_bits, parent_bits + 1):
        sens[:, b] = scale * 4.0 ** (parent_bits - b)  # quantization error falls ~4x per bit
    mass = rng.dirichlet(np.ones(cfg.num_experts), cfg.num_hidden_layers)
    w = parent_bits + 1
    residual = ResidualHeads(rng.normal(0.0, 0.3, (2, w, w, N_FEATURES)), rng.normal(0.0, 0.1, (2, w, w)),
                             np.ones((2, w, w)), rng.normal(0.0, 1.0, (n, N_FEATURES)),
                             np.ones(N_FEATURES)) if heads else None
    return APWeights(specs, seed_bits, parent_bits, RandomPlaneStore(specs, seed), sens, mass, PlannerKnobs(),
                     residual)


def page_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return round_up(kv_layer_block_bytes(cfg, block_size, dtype), PAGE_ALIGN)


def expert_pool_bytes(weights: APWeights, b: int, page: int) -> int:
    """Experts at uniform width b as allocated, plus the mover's reserve (its largest LUT)."""
    total = sum(b * round_up(s.plane_bytes, page) + round_up(s.lut_bytes[b], page) for s in weights.specs)
    return total + max(round_up(n, page) for s in weights.specs for n in s.lut_bytes.values())


def weight_bytes_per_token(cfg: ModelConfig, outside: int, element: int, weights: APWeights | None,
                           b: int | None) -> int:
    """Computed (not measured): weight bytes one decode token must read at batch 1 — every non-expert weight but
    the embedding table (one row of it), plus top_k routed experts per layer, dense or at width b. The bound on
    any speedup from quantizing experts alone, since the attention, shared-expert and LM-head bytes stay."""
    rest = outside - cfg.vocab_size * cfg.hidden_size * element + (cfg.hidden_size * element)
    per_layer = len(weights.specs) // cfg.num_hidden_layers // cfg.num_experts if weights else 0
    if weights is None or b is None:
        expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * element
    else:
        first = weights.specs[:per_layer]  # one expert's blocks (gate_up, down): every expert has the same shapes
        expert = sum(b * s.plane_bytes + s.lut_bytes[b] for s in first)
    return rest + cfg.num_hidden_layers * cfg.top_k * expert


def routed_expert_bytes(weights: APWeights, widths: np.ndarray, mass: np.ndarray, top_k: int) -> float:
    """Computed (not measured): routed-expert bytes (planes and LUTs) one decode token reads at these block widths,
    taking each expert's chance of being routed as its share of the planner's routing mass [L, E] (routing weights,
    not counts): what tells bytes read apart from kernel speed when PagedWeight and uniform widths hold the same
    memory but the planner keeps the experts that tokens reach wider."""
    per_block = np.array([int(w) * s.plane_bytes + s.lut_bytes[int(w)] for s, w in zip(weights.specs, widths)])
    per_expert = per_block.reshape(*mass.shape, -1).sum(axis=-1)
    share = mass / np.maximum(mass.sum(axis=1, keepdims=True), 1e-30)
    return float(top_k * (share * per_expert).sum())


def routed_share_by_width(widths: np.ndarray, mass: np.ndarray) -> dict[int, float]:
    """Computed: the share of a routed token's blocks at each width, each block weighted by its expert's share of its
    layer's routing mass [L, E]. At batch 1 a mixed layer runs at its widest routed block's pace, so this says which
    widths the kernels meet, where the blocks' plain count says what memory holds."""
    share = mass / np.maximum(mass.sum(axis=1, keepdims=True), 1e-30)
    per_block = widths.reshape(*mass.shape, -1)
    block_share = np.broadcast_to((share / (per_block.shape[-1] * mass.shape[0]))[..., None], per_block.shape)
    return {int(w): float(block_share[per_block == w].sum()) for w in np.unique(widths)}


def kv_bytes(cfg: ModelConfig, batch: int, seq_len: int, block_size: int, page: int, chunk: int) -> int:
    """KV blocks for `batch` sequences of `seq_len` tokens plus one step's slack."""
    blocks = batch * -(-seq_len // block_size) + -(-chunk // block_size) + 1
    return blocks * page * cfg.num_hidden_layers


def serve(llm: LLM, batch: int, prompt_len: int, gen: int, vocab: int, seed: int, trace: list | None = None,
          on_decode: Callable[[], None] | None = None, sampling: dict | None = None) -> dict:
    """One timed batch: prefill (chunked) then decode; returns timings and counters. `trace` collects one row per
    step (`trace_row`); `on_decode` is called once, when every request has its first token (decode steps follow).
    `sampling`: SamplingParams fields of every request beside max_tokens (greedy when empty).

    Requests that finish their prompt first decode while the rest prefill, so they also finish first and the decode
    phase ends with a draining batch. `decode_tokens_per_s` is the tokens made after the last request's first token
    over that time (before 2026-12-05 it also counted the tokens made before it: 24 % too many at batch 4, seq
    2048, gen 32); `decode_step_ms_median` and `steady_decode_tokens_per_s` are of the steps that the whole batch
    ran (they counted the draining steps too)."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=gen, ignore_eos=True, **(sampling or {}))
    ids = [llm.add_request(rng.integers(0, vocab, prompt_len).tolist(), params) for _ in range(batch)]
    decode_ms: list[float] = []  # wall ms of each step that began with every request running and decoding
    sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
    phases = StepPhases(llm) if trace is not None else None
    sync()
    t0 = time.perf_counter()
    first: dict[str, float] = {}
    done: dict[str, int] = {}
    made: dict[str, int] = {}  # completion tokens of each request so far
    window_tokens = 0  # of those, made by steps that began after every request had its first token
    while llm.has_unfinished():
        t_step, paging, compactions = time.perf_counter(), dataclasses.replace(llm.paging), llm.pool.relocations
        decoding = len(first) == batch
        whole = decoding and len(llm.scheduler.running) == batch
        outs = llm.step()
        t_end = time.perf_counter()  # one clock read for both: the median and the trace's step_ms agree
        if whole:
            decode_ms.append((t_end - t_step) * 1e3)
        if trace is not None:
            trace.append(trace_row(llm, paging, t_step, compactions, phases, t_end))
        for out in outs:
            if decoding:
                window_tokens += out.completion_tokens - made.get(out.request_id, 0)
            made[out.request_id] = out.completion_tokens
            if out.token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter()
                if on_decode is not None and len(first) == batch:
                    on_decode()
            if out.finished:
                done[out.request_id] = out.completion_tokens
                if out.finish_reason != "length":
                    raise RuntimeError(f"request {out.request_id} ended with {out.finish_reason}: {out.error}")
    sync()
    t1 = time.perf_counter()
    t_first = max(first[r] for r in ids)
    step_ms = float(np.median(decode_ms)) if decode_ms else None
    return {"prefill_ms": (t_first - t0) * 1e3, "decode_tokens_per_s": window_tokens / max(t1 - t_first, 1e-9),
            "decode_step_ms_median": step_ms, "steady_decode_tokens_per_s": step_ms and batch / step_ms * 1e3,
            "tokens_per_s": sum(done.values()) / (t1 - t0), "generated_tokens": sum(done.values())}


TRACE_COLUMNS = ["step_ms", "boundary_ms", "planner_ms", "requests_ms", "observe_ms", "running", "waiting",
                 "pages_in_flight", "move_requests", "move_refusals", "offload_refusals", "compactions", "overlapped",
                 "pre_ms", "forward_ms", "between_ms", "sample_ms", "post_ms", "tokens"]


class StepPhases:
    """Host clock marks inside llm.step(), for traces: wraps the runner's `run` and the sampler's `pick` of one
    engine (in the benchmark; the engine has no hooks). A step then splits into before the forward (a boundary that
    did not overlap, scheduling), the forward's host part (inputs, launch or graph replay), between it and the
    token read (the sampling's launch, an observed step's routing copy, an overlapped boundary, the routing read),
    the token read (`sample_ms`: it waits for the device, the GPU's remaining time when the host is ahead) and
    after (outputs); and the tokens its forward ran (prefill chunks and decode rows: the step's size). A step that
    ran no forward gets None."""

    def __init__(self, llm: LLM) -> None:
        self.marks: dict[str, float] = {}
        self.tokens: int | None = None
        run, pick = llm.runner.run, llm.sampler.pick

        def counted(batch):
            self.tokens = sum(batch.num_new_tokens)
            return run(batch)

        def timed(name: str, fn: Callable) -> Callable:
            def wrapper(*args, **kwargs):
                self.marks[name + "0"] = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.marks[name + "1"] = time.perf_counter()
            return wrapper

        def picked(*args, **kwargs):
            pending = pick(*args, **kwargs)
            pending.tolist = timed("sample", pending.tolist)
            return pending

        llm.runner.run, llm.sampler.pick = timed("run", counted), picked

    def split(self, t_step: float, t_end: float) -> list[float | int | None]:
        """[pre, forward, between, sample, post] ms and the forward's tokens of the step that ran from t_step to
        t_end; clears the marks."""
        m, self.marks = self.marks, {}
        tokens, self.tokens = self.tokens, None
        if len(m) < 4:
            return [None] * 6
        edges = [t_step, m["run0"], m["run1"], m["sample0"], m["sample1"], t_end]
        return [round((b - a) * 1e3, 3) for a, b in zip(edges, edges[1:])] + [tokens]


def trace_row(llm: LLM, before: PagingStats, t_step: float, compactions_before: int,
              phases: StepPhases | None = None, t_end: float | None = None) -> list:
    """One step of a trace (TRACE_COLUMNS): wall ms of llm.step() since `t_step`, of which the boundary's host ms
    (the planner's and the move requests' within it) and the routing read's; requests running and waiting after
    it; whether pages were in flight after the boundary (a move whose copy finished within it has committed and
    does not count); move requests and refusals; pool compactions since `compactions_before` (the pool's
    `relocations`); whether the boundary ran beside the forward (overlapped); the step's host phases and its
    forward's tokens (StepPhases, None without). `before`: a copy of llm.paging taken before; `t_end`: when the
    step returned (now if None)."""
    now, ms, t_end = llm.paging, lambda a, b: round((a - b) * 1e3, 3), t_end or time.perf_counter()
    split = phases.split(t_step, t_end) if phases is not None else [None] * 6
    return [ms(t_end, t_step), ms(now.boundary_host_s, before.boundary_host_s),
            ms(now.planner_host_s, before.planner_host_s), ms(now.requests_host_s, before.requests_host_s),
            ms(now.observe_host_s, before.observe_host_s), len(llm.scheduler.running), len(llm.scheduler.waiting),
            now.steps_in_flight > before.steps_in_flight, now.move_requests - before.move_requests,
            now.move_refusals - before.move_refusals, now.offload_refusals - before.offload_refusals,
            llm.pool.relocations - compactions_before,
            now.overlapped_boundaries > before.overlapped_boundaries, *split]


def sampling_of(args: argparse.Namespace) -> dict:
    """The requests' sampling (`--temperature`, `--top-p`, `--top-k`), each request seeded by the engine's global
    RNG, and their prompt log-probabilities (`--prompt-logprobs`)."""
    out = {} if args.temperature == 0 else {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    if args.prompt_logprobs is not None:
        out["prompt_logprobs"] = args.prompt_logprobs
    return out


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """The options `sampling_of` reads."""
    p.add_argument("--temperature", type=float, default=0.0, help="every request samples at this temperature (0: "
                   "greedy, as in every earlier run)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: every request's top-p")
    p.add_argument("--top-k", type=int, default=0, help="with --temperature: every request's top-k (0: off)")
    p.add_argument("--prompt-logprobs", type=int, default=None, metavar="N",
                   help="every request scores its prompt's tokens with N alternatives (SamplingParams.prompt_logprobs)")


def warm_engine(name: str, cfg: ModelConfig, weights: APWeights | None, budget: int, batch: int, seq_len: int,
                gen: int, args: argparse.Namespace, **options) -> tuple[nn.Module, LLM]:
    """A fresh random model and its engine, after a warm-up as long as the timed batch: every decode graph it
    replays (each padded batch, once all rows decode together) is captured here; a 4-token warm-up left 2 eager
    steps and 2 captures, 40-90 ms each, inside the timed batch-4 decode (engine_bench-…-s7-final.json)."""
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    model = random_model(cfg, weights is None, dtype, args.device)
    llm = LLM.from_parts(model, weights, None, budget, args.device, model_name=name, detokenize=False,
                         block_size=args.block_size, max_num_seqs=max(batch, 1),
                         decode_attention_kernel=args.decode_attention == "kernel", layer_kernels=args.layer_kernels,
                         max_num_batched_tokens=args.chunk, max_model_len=seq_len + 16, **options)
    serve(llm, batch, seq_len - gen, gen, cfg.vocab_size, seed=1, sampling=sampling_of(args))
    return model, llm


def decode_stats(llm: LLM) -> DecodeStats | None:
    """The runner's decode-graph counters (None where it runs no decode graphs)."""
    return llm.runner.decode.stats if llm.runner.decode is not None else None


def decode_graph_counts(llm: LLM) -> tuple[int, int]:
    """(decode graphs captured, decode steps run eagerly) so far."""
    stats = decode_stats(llm)
    return (stats.captured, stats.eager) if stats is not None else (0, 0)


def paired_decode(cfg: ModelConfig, weights: APWeights, budget: int, batch: int, b: int, home: int,
                  args: argparse.Namespace) -> dict:
    """Uniform b bits and PagedWeight (home width `home`) at the same memory, both resident in this process and
    stepped in alternating chunks of `--paired-chunk` decode steps (U P, P U, U P, ...), so that the device's and
    the host's drift lands on both alike. The table runs each configuration alone, one after the other, and there
    the same configuration's median step moved by up to 8 % between rounds (engine_bench-…-20261130-s8.json: FP16
    batch 1, 5.34 and 5.77 ms), more than the 2 % under test. Each chunk pair gives a ratio of median steps; the
    result is the ratio of the two engines' median decode steps over all chunks, and the pairs' spread. With
    `--trace`, each engine's median of every step-trace column (TRACE_COLUMNS) and its median step by the step's
    place in the routing-observation cycle (`phase_step_ms`: entry j = steps with num_steps % observe_every == j,
    j = 0 the observed ones), and every step's row (`step_traces`), to say where PagedWeight's extra time per step
    goes. Always: the routed-expert bytes a token reads under each engine's widths at the end (`routed_expert_bytes`,
    computed), PagedWeight's mean width and its layers by LUT class: bytes read against kernel speed; and per chunk
    of each engine the decode graphs it captured and the decode steps it ran eagerly (`chunk_graphs`: a chunk pair
    whose ratio falls may hold a recapture, as a width change across LUT classes makes)."""
    engines = {kind: warm_engine(config_name(kind, b, home, args.parent_bits), cfg, weights, budget, batch,
                                 args.seq_len, args.gen, args, **engine_options(kind, b, home, args))[1]
               for kind in ("uniform", "paged")}
    # Requests that finish their prompt first decode while the others still prefill: each gets `head` tokens more
    # than the `gen` steps measured (its prompt that much shorter: the same KV at the end), so every request of the
    # batch decodes through every measured step. Before, they ran to `gen` tokens from their own first: at batch 32
    # (seq 512) half had finished when the last began, and the run measured a draining batch whose freed KV the
    # planner kept reloading weights into (engine_bench-nvidia-h100-80gb-hbm3-20261205-s43-paired-refusals.json).
    room = engines["paged"].options.max_num_batched_tokens - batch
    head = -(-batch * (args.seq_len - args.gen) // max(room, 1)) + 4
    if args.seq_len - args.gen - head < 1:
        raise ValueError(f"--seq-len {args.seq_len}: no prompt left for batch {batch} after --gen {args.gen} and "
                         f"{head} tokens decoded while the batch prefills")
    params = SamplingParams(max_tokens=args.gen + head, ignore_eos=True, **sampling_of(args))
    ids = {}
    for kind, llm in engines.items():  # the same prompts; prefill until every request has its first token
        rng = np.random.default_rng(2)
        ids[kind] = [llm.add_request(rng.integers(0, cfg.vocab_size, args.seq_len - args.gen - head).tolist(), params)
                     for _ in range(batch)]
        first: set[str] = set()
        while len(first) < batch:
            first.update(out.request_id for out in llm.step() if out.token_ids)
        if len(llm.scheduler.running) != batch:
            raise RuntimeError(f"{kind}: {len(llm.scheduler.running)} of {batch} requests running after the prefill")
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    steps: dict[str, list[float]] = {kind: [] for kind in engines}
    phases = {kind: StepPhases(llm) for kind, llm in engines.items()} if args.trace else None
    every = engines["paged"].options.observe_every
    traces: dict[str, list[tuple[int, list]]] = {kind: [] for kind in engines}  # (num_steps % every, trace row)
    pair_ratios: list[float] = []
    chunk_graphs: dict[str, list[list[int]]] = {kind: [] for kind in engines}  # [captured, eager] per chunk
    order = list(engines)
    while any(len(v) < args.gen for v in steps.values()):
        chunk = {}
        for kind in order:
            llm, ms = engines[kind], []
            graphs0 = decode_graph_counts(llm)
            sync()
            for _ in range(min(args.paired_chunk, args.gen - len(steps[kind]))):
                if phases is not None:  # the trace's "before" marks, taken only when tracing
                    cycle, compactions, paging = llm.num_steps % every, llm.pool.relocations, dataclasses.replace(
                        llm.paging)
                t = time.perf_counter()
                llm.step()
                ms.append((time.perf_counter() - t) * 1e3)
                if phases is not None:
                    traces[kind].append((cycle, trace_row(llm, paging, t, compactions, phases[kind])))
            chunk[kind] = ms
            steps[kind] += ms
            chunk_graphs[kind].append([n - n0 for n, n0 in zip(decode_graph_counts(llm), graphs0)])
        if all(chunk.values()):
            pair_ratios.append(float(np.median(chunk["uniform"]) / np.median(chunk["paged"])))
        order.reverse()
    for kind, llm in engines.items():  # the rest of the requests' tokens are not measured
        for rid in ids[kind]:
            llm.abort(rid)
    med = {kind: float(np.median(v)) for kind, v in steps.items()}
    out = {"bits": b, "home": home, "batch": batch, "chunk_steps": args.paired_chunk, "prefill_head_tokens": head,
           "uniform_step_ms_median": med["uniform"], "paged_step_ms_median": med["paged"],
           "ratio_paged_over_uniform": med["uniform"] / med["paged"],
           "pair_ratios": pair_ratios, "pair_ratio_min": min(pair_ratios), "pair_ratio_max": max(pair_ratios),
           "steps_per_engine": len(steps["paged"]), "chunk_graphs": chunk_graphs}
    paged = engines["paged"]
    mass, widths = paged.routing_mass(), paged.committed_widths()
    routed = {kind: routed_expert_bytes(weights, w, mass, cfg.top_k)
              for kind, w in (("uniform", np.full_like(widths, b)), ("paged", widths))}
    classes = [lut_width(int(w)) for w in widths.reshape(cfg.num_hidden_layers, -1).max(axis=1)]
    out.update(routed_expert_bytes_per_token_computed=routed,
               routed_bytes_ratio_paged_over_uniform=routed["paged"] / routed["uniform"],
               paged_mean_width=float(widths.mean()),
               paged_layers_by_lut_class={c: classes.count(c) for c in sorted(set(classes))},
               paged_blocks_by_width={int(w): int((widths == w).sum()) for w in np.unique(widths)},
               paged_routed_share_by_width=routed_share_by_width(widths, mass))
    if phases is not None:
        out["observe_every"] = every
        out["trace_medians"] = {kind: {col: _median([row[i] for _, row in rows])
                                       for i, col in enumerate(TRACE_COLUMNS)} for kind, rows in traces.items()}
        out["phase_step_ms"] = {kind: [_median([row[0] for c, row in rows if c == j])
                                       for j in range(min(every, max(c for c, _ in rows) + 1))]
                                for kind, rows in traces.items()}  # up to the last place seen (a long cycle)
        out["step_traces"] = {kind: {"columns": ["cycle", *TRACE_COLUMNS], "rows": [[c, *row] for c, row in rows]}
                              for kind, rows in traces.items()}
    return out


def run_config(name: str, cfg: ModelConfig, weights: APWeights | None, budget: int, batch: int, seq_len: int,
               gen: int, args: argparse.Namespace, **options) -> dict:
    t0 = time.perf_counter()
    gc.collect()
    reserved_before = None
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        # what an earlier configuration left reserved (nothing, unless one leaked): the peak below includes it
        reserved_before = torch.cuda.memory_reserved() / 2**30
    model, llm = warm_engine(name, cfg, weights, budget, batch, seq_len, gen, args, **options)
    def counters() -> dict:
        graphs = decode_stats(llm)
        return dict(llm.stats(), sync_waits=llm.paging.syncs, steps=llm.num_steps, decode_graph_replays=graphs and graphs.replayed,
                    decode_graph_captures=graphs and graphs.captured, decode_eager_steps=graphs and graphs.eager)

    st0 = counters()  # the counters in the row are the timed batch's alone
    start_hist = st0["committed_width_hist"]
    trace = [] if args.trace else None
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    if args.torch_profile:  # one phase only: the prefill would swamp the decode steps' table
        activities = [torch.profiler.ProfilerActivity.CPU]
        if args.device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        tprof = torch.profiler.profile(activities=activities)
        if args.torch_profile_phase == "prefill":  # from the first step until every request has its first token
            steps0, prefill_steps = llm.num_steps, []

            def prefilled() -> None:
                tprof.stop()
                prefill_steps.append(llm.num_steps - steps0)

            tprof.start()
            res = serve(llm, batch, seq_len - gen, gen, cfg.vocab_size, seed=2, on_decode=prefilled,
                        sampling=sampling_of(args))
            title, steps = f"{prefill_steps[0]} prefill steps ({batch} x {seq_len - gen} tokens)", prefill_steps[0]
        else:
            res = serve(llm, batch, seq_len - gen, gen, cfg.vocab_size, seed=2, on_decode=tprof.start,
                        sampling=sampling_of(args))
            tprof.stop()
            title, steps = f"{gen - 1} decode steps", gen - 1
        _append_torch_profile(args.torch_profile, f"{name} batch {batch}: {title}", tprof, steps)
    else:
        res = serve(llm, batch, seq_len - gen, gen, cfg.vocab_size, seed=2, trace=trace, sampling=sampling_of(args))
    if prof:
        prof.disable()
        append_profile(args.profile, f"{name} batch {batch}", prof)
    st = counters()
    timed = {k: (st[k] or 0) - (st0[k] or 0) for k in ("offload_triggers", "reload_triggers", "bytes_offloaded",
                                                     "bytes_reloaded", "preemptions", "sync_waits", "kv_relocations",
                                                     "weight_relocations", "decode_graph_replays",
                                                     "decode_graph_captures", "decode_eager_steps",
                                                     "boundary_host_s", "observe_host_s", "steps")}
    row = {"config": name, "batch": batch, "seq_len": seq_len, "prompt_tokens": seq_len - gen, "gen_tokens": gen,
           **res, "budget_gib": budget / 2**30,
           "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if args.device == "cuda" else None,
           "reserved_before_gib": reserved_before,
           "weights_outside_pool_gib": param_bytes(llm.model) / 2**30,
           "resident_expert_gib": st["resident_weight_bytes"] / 2**30,
           "mean_width_start": _mean(start_hist), "mean_width_end": _mean(st["committed_width_hist"]),
           **timed, "config_s": time.perf_counter() - t0}
    if trace is not None:
        row["step_trace"] = {"columns": TRACE_COLUMNS, "rows": trace}
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, file=sys.stderr)
    del llm, model
    return row


def append_profile(path: str, title: str, prof: cProfile.Profile) -> None:
    """Host-time profile of one timed batch (where a host-bound step spends its time), appended as text."""
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)
    with open(path, "a") as f:
        f.write(f"===== {title}\n{buf.getvalue()}\n")


def _append_torch_profile(path: str, title: str, prof, steps: int) -> None:
    """Device-time breakdown of one timed batch's decode or prefill steps (which kernels a step spends its GPU time
    in; kernels replayed from CUDA graphs included) and their host time per op, appended as text, with the device
    time per step."""
    avg = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in avg if e.device_type == torch.autograd.DeviceType.CUDA)
    with open(path, "a") as f:
        f.write(f"===== {title}: kernels {device_us / 1e3 / max(steps, 1):.3f} ms of device time per step\n")
        for key in ("self_cuda_time_total", "cpu_time_total"):
            try:
                f.write(avg.table(sort_by=key, row_limit=40, max_name_column_width=60) + "\n")
            except (KeyError, AttributeError, RuntimeError) as exc:
                f.write(f"(no table sorted by {key}: {exc})\n")


def _median(values: list) -> float | None:
    """Median of the numbers among `values` (None where a step had none: the phases of a step without a forward)."""
    v = [float(x) for x in values if x is not None]
    return float(np.median(v)) if v else None


def _mean(hist: list) -> float | None:
    if not hist:
        return None
    counts = np.asarray(hist).sum(axis=0)
    return float((counts * np.arange(len(counts))).sum() / counts.sum())


def decode_ratios(rows: list[dict], metric: str = "decode_tokens_per_s") -> dict:
    """Decode tokens/s (`metric`) of PagedWeight over uniform at the same width, batch and round (configurations of
    a round run back to back, in the other order every other round, so slow drift of the host cancels), and the
    median over rounds per width and batch."""
    speed = {(r["config"], r["batch"], r["round"]): r[metric] for r in rows if r.get(metric)}
    out: dict[str, dict] = {}
    for (config, batch, rnd), v in sorted(speed.items()):
        m = re.fullmatch(r"pagedweight(-home\d+)?@ap(\d+)-memory", config)
        base = m and speed.get((f"ap{m.group(2)}-uniform", batch, rnd))
        if base:
            key = f"ap{m.group(2)}/b{batch}{(m.group(1) or '').replace('-', '/')}"
            out.setdefault(key, {"per_round": []})["per_round"].append(v / base)
    for entry in out.values():
        entry["median"] = float(np.median(entry["per_round"]))
    return out


def home_widths(args: argparse.Namespace, b: int) -> list[int]:
    """PagedWeight's home widths (`--paged-home`) at the memory of uniform b bits."""
    return [args.parent_bits if h == "parent" else b if h == "match" else int(h) for h in args.paged_home.split(",")]


def plan(args: argparse.Namespace, paged_first: bool = False) -> list[tuple[int, str, int | None, int | None]]:
    """(batch, kind, bits, home width) in priority order: a round per width of `--bits` (FP16 joins the first), each
    round over every batch, so a time budget that cuts the run keeps the most important comparisons. `paged_first`
    runs PagedWeight before uniform (odd rounds: the host's drift between the two then cancels over two rounds; the
    H200's steps slow by several % from one configuration to the next, engine_bench-…-s7-fused.json)."""
    batches = [int(b) for b in args.batches.split(",")]
    configs = []
    for n, b in enumerate(int(x) for x in args.bits.split(",")):
        homes = home_widths(args, b)
        for batch in batches:
            if n == 0 and not args.skip_fp16:
                configs.append((batch, "fp16", None, None))
            pair = [(batch, "uniform", b, None)], [(batch, "paged", b, h) for h in dict.fromkeys(homes)]
            configs += pair[1] + pair[0] if paged_first else pair[0] + pair[1]
    return configs


def engine_options(kind: str, b: int, home: int | None, args: argparse.Namespace) -> dict:
    """The LLM options of uniform b bits, or of PagedWeight (paging, home width `home`) in its memory."""
    if kind == "uniform":
        return dict(bits=b, paging=False)
    options = dict(bits=home, paging=True)
    if args.compact_every is not None:
        options["compact_every_steps"] = args.compact_every
    if args.observe_every is not None:
        options["observe_every"] = args.observe_every
    if args.planner_knobs:
        options["planner_knobs"] = json.loads(args.planner_knobs)
    return options


def config_name(kind: str, b: int | None, home: int | None, parent: int) -> str:
    if kind == "paged":
        return f"pagedweight@ap{b}-memory" if home == parent else f"pagedweight-home{home}@ap{b}-memory"
    return "fp16-dense" if kind == "fp16" else f"ap{b}-uniform"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="toy shapes (CPU check)")
    p.add_argument("--shape", choices=list(SHAPES), default="qwen1.5-moe", help="the full-size model shape")
    p.add_argument("--observe-every", type=int, default=None, metavar="N",
                   help="PagedWeight reads routing statistics every N-th step (default: the engine's); a large N "
                        "separates the observed steps' cost from the rest of PagedWeight's per-step cost")
    p.add_argument("--no-heads", dest="heads", action="store_false",
                   help="no prompt residual heads in the random checkpoint (default: random heads, as convert fits)")
    p.add_argument("--scaled", action="store_true", help="Qwen1.5 block count at CPU-sized dims, multi-page planes")
    p.add_argument("--compact-every", type=int, default=None,
                   help="PagedWeight's compact_every_steps (default: the engine's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--gen", type=int, default=32, help="generated tokens per request (inside seq-len)")
    p.add_argument("--batches", default="1,4")
    add_sampling_args(p)
    p.add_argument("--bits", default="4,3,6,5", help="uniform AP widths, most important first")
    p.add_argument("--parent-bits", type=int, default=6)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=512, help="token budget per step (prefill chunk)")
    p.add_argument("--skip-fp16", action="store_true")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="start no new configuration once this many seconds have passed (default: no limit)")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--label", default=None, help="suffix of the result file name (a second run the same day)")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="append a cProfile summary of each timed batch to FILE (host-time breakdown)")
    p.add_argument("--planner-knobs", default=None, metavar="JSON",
                   help='PagedWeight planner knob overrides, e.g. \'{"release_min_share": 0.5}\' (pagedweight/knobs.py)')
    p.add_argument("--paged-home", default="parent",
                   help="home widths of the PagedWeight configurations, comma-separated ('parent', 'match': the "
                        "uniform width whose memory it gets, or bits): the width blocks return to when memory allows "
                        "(below the parent: never above it)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every configuration this many times, round by round (the ratios get a median)")
    p.add_argument("--paired-chunk", type=int, default=0, metavar="STEPS",
                   help="after the table, measure each width and batch again with uniform and PagedWeight resident "
                        "together, stepped in alternating chunks of STEPS decode steps (0: off; --rounds 0 skips "
                        "the table)")
    p.add_argument("--trace", action="store_true",
                   help="add each timed step's wall and paging-loop host ms to the row (where a gap comes from); "
                        "paired measurements get each engine's median per trace column and per observation-cycle step")
    p.add_argument("--decode-attention", choices=("kernel", "sdpa"), default="kernel",
                   help="CUDA decode steps: the paged decode attention kernel, or gather + SDPA (the path before it)")
    p.add_argument("--no-layer-kernels", dest="layer_kernels", action="store_false",
                   help="CUDA decode steps: torch's ops for norms, RoPE, routing and the shared expert's elementwise "
                        "work instead of the fused layer kernels (the path before them)")
    p.add_argument("--torch-profile", default=None, metavar="FILE",
                   help="append torch.profiler tables of each timed batch's decode steps to FILE (device time per kernel)")
    p.add_argument("--torch-profile-phase", choices=("decode", "prefill"), default="decode",
                   help="which steps --torch-profile records: the decode steps, or the prefill steps (host and device "
                        "time of the chunked prefill, which is host-bound)")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    cfg = model_config(args.tiny, args.scaled, args.shape)
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    page = page_bytes(cfg, args.block_size, dtype)
    weights = ap_weights(cfg, args.parent_bits, heads=args.heads)
    outside = outside_bytes(cfg, dtype, args.device)
    element = torch.empty((), dtype=dtype).element_size()
    expert_dense = cfg.num_hidden_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size * element
    rows: list[dict] = []
    skipped: list[str] = []
    per_token = {"fp16": weight_bytes_per_token(cfg, outside, element, None, None)}
    per_token.update({f"ap{b}": weight_bytes_per_token(cfg, outside, element, weights, b)
                      for b in range(weights.seed_bits, weights.parent_bits + 1)})
    shape = "tiny" if args.tiny else "Qwen1.5-MoE block count, scaled dims (SCALED_PAGES)" if args.scaled else \
        f"{SHAPES[args.shape][0]} shape"
    extra = {"model": f"{shape}, random planes", "page_bytes": page,
             "weight_bytes_per_token_computed": per_token,
             "max_speedup_vs_fp16_by_bytes_computed": {k: per_token["fp16"] / v for k, v in per_token.items()},
             "lut_bytes_parent_gate_up": lut_bytes(2 * cfg.moe_intermediate_size, args.parent_bits),
             "residual_heads": "random" if args.heads else None, "time_budget_s": args.time_budget_s,
             "sampling": sampling_of(args) or "greedy",
             "planner_knobs": json.loads(args.planner_knobs) if args.planner_knobs else None}

    def ap_budget(b: int, batch: int) -> int:
        """The memory of uniform b bits: weights outside the pool, the experts at b bits, the batch's KV cache."""
        return outside + expert_pool_bytes(weights, b, page) + kv_bytes(cfg, batch, args.seq_len, args.block_size,
                                                                         page, args.chunk)

    def save(complete: bool = False) -> Path:
        """Rewrite the JSON with every row so far: a run cut short still leaves a valid partial result. `complete`:
        the run reached its end with nothing skipped for the time budget (`skipped_configs` lists what was)."""
        return write_result("engine_bench", rows, out_dir=args.out_dir, label=args.label,
                            extra={**extra, "complete": complete, "skipped_configs": skipped})

    save()
    for rnd, (batch, kind, b, home) in ((r, c) for r in range(args.rounds) for c in plan(args, r % 2 == 1)):
        name = config_name(kind, b, home, args.parent_bits)
        if args.time_budget_s is not None and time.perf_counter() - t_start > args.time_budget_s:
            skipped.append(f"{name}/b{batch}")
            continue
        try:
            if kind == "fp16":
                kv = kv_bytes(cfg, batch, args.seq_len, args.block_size, page, args.chunk)
                row = run_config(name, cfg, None, outside + expert_dense + kv, batch, args.seq_len, args.gen, args)
            else:
                row = run_config(name, cfg, weights, ap_budget(b, batch), batch, args.seq_len, args.gen, args,
                                 **engine_options(kind, b, home, args))
        except Exception as exc:  # noqa: BLE001 - one failing configuration must not cost the others
            row = failed_row(exc, config=name, batch=batch)
        row["round"] = rnd
        rows.append(row)
        extra["decode_ratio_paged_over_uniform"] = decode_ratios(rows)
        # the same over each configuration's median decode step: robust to a few slow steps (a capture, a GC)
        extra["steady_decode_ratio_paged_over_uniform"] = decode_ratios(rows, "steady_decode_tokens_per_s")
        save()
    if args.paired_chunk > 0:
        extra["paired_decode"] = paired = {}
        for b in (int(x) for x in args.bits.split(",")):
            for batch in (int(x) for x in args.batches.split(",")):
                for home in dict.fromkeys(home_widths(args, b)):
                    key = f"ap{b}/b{batch}/home{home}"
                    if args.time_budget_s is not None and time.perf_counter() - t_start > args.time_budget_s:
                        skipped.append(f"paired {key}")
                        continue
                    try:
                        paired[key] = paired_decode(cfg, weights, ap_budget(b, batch), batch, b, home, args)
                    except Exception as exc:  # noqa: BLE001 - one failing pair must not cost the others
                        paired[key] = failed_row(exc, bits=b, batch=batch, home=home)
                    print(key, {k: v for k, v in paired[key].items() if k != "step_traces"}, file=sys.stderr)
                    gc.collect()
                    if args.device == "cuda":
                        torch.cuda.empty_cache()
                    save()
    print(save(complete=not skipped))
    return 0


if __name__ == "__main__":
    sys.exit(main())
