"""Where a serving process's memory above `gpu_memory_budget` goes, and whether `activation_reserve` closes it.

The budget covers the weights outside the pool and the pool (expert pages and KV blocks); activations, CUDA-graph
pools and the prefill's dequantize scratch come on top (pagedweight/engine.py). This benchmark runs a workload
with torch's allocator history on (segment events only, Python stacks) and attributes every segment the caching
allocator reserved after the engine was built to the code that asked for it: the innermost frame in this
repository and its pool (the default pool, or a CUDA-graph pool). Then, with `--reserve`, it builds the engine
again with budget + gap and activation_reserve = gap (the pool the same size; "measured"), or with budget + twice
the gap and "auto" (the engine's start-up profile decides), and replays the workload: is the peak reserved within
that budget? Every row starts as a fresh process would: no cached segments, no cuBLAS workspaces of an earlier row.

Measured: torch.cuda.max_memory_reserved, each segment's size and pool (torch.cuda.memory._snapshot), and
torch.cuda.mem_get_info's device-wide use (the CUDA context and non-torch allocations, which torch's reserved
bytes do not count). Computed: the budget (benchmarks/engine_bench.py's and kv_pressure.py's formulas).

    python -m benchmarks.memory_gap --workload bench --batch 4 --reserve measured,auto    # H200
    python -m benchmarks.memory_gap --workload pressure --reserve measured,auto
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.common import write_result
from benchmarks.engine_bench import (SHAPES, add_sampling_args, ap_weights, expert_pool_bytes, kv_bytes, model_config,
                                     outside_bytes, page_bytes, random_model, sampling_of, serve)
from benchmarks.kv_pressure import DEFAULTS, budget_and_options, drive, workload
from pagedweight.engine import LLM, round_up
from pagedweight.pool import release_cached

ROOT = Path(__file__).resolve().parent.parent
OURS = tuple(str(ROOT / d) for d in ("pagedweight", "cuda", "actors"))
MIB = 2**20
PRESSURE = DEFAULTS["h200"]  # kv_pressure's H200 workload


def our_frame(frames: list[dict]) -> str:
    """The innermost frame of this repository's code (not the benchmark's own): file:line function."""
    for f in frames:
        name = f.get("filename", "")
        if name.startswith(OURS) or "/pagedweight/" in name:
            return f"{Path(name).relative_to(ROOT) if name.startswith(str(ROOT)) else name}:{f['line']} {f['name']}"
    return "elsewhere" if not frames else f"{Path(frames[0]['filename']).name}:{frames[0]['line']} {frames[0]['name']}"


def attribute(snapshot: dict, start: int = 0, stop: int | None = None) -> tuple[list[dict], dict, int]:
    """Segments still reserved whose last `segment_alloc` event (over the whole recorded history: the allocator may
    free a segment and allocate one again at its address) is among trace entries [start, stop), grouped by (pool,
    allocating frame); and the `segment_free` events there (the allocator gives cached segments back when a
    cudaMalloc fails, on empty_cache, and with a released graph pool)."""
    live = {s["address"]: s for s in snapshot["segments"]}
    trace = snapshot["device_traces"][0]
    stop = len(trace) if stop is None else stop
    last: dict[int, tuple[int, dict]] = {}
    for i, e in enumerate(trace):
        if e["action"] == "segment_alloc":
            last[e["addr"]] = (i, e)
        elif e["action"] == "segment_free":
            last.pop(e["addr"], None)
    frees = sum(e["action"] == "segment_free" for e in trace[start:stop])
    last = {addr: e for addr, (i, e) in last.items() if start <= i < stop}
    groups: dict[tuple[str, str], dict] = defaultdict(lambda: {"segments": 0, "bytes": 0, "allocated_bytes": 0})
    for addr, e in last.items():
        seg = live.get(addr)
        if seg is None:
            continue
        pool = "default" if tuple(seg.get("segment_pool_id", (0, 0))) == (0, 0) else "graph pool"
        g = groups[(pool, our_frame(e.get("frames", [])))]
        g["segments"] += 1
        g["bytes"] += seg["total_size"]
        g["allocated_bytes"] += seg["allocated_size"]
    rows = [{"pool": pool, "source": src, **g, "mib": g["bytes"] / MIB} for (pool, src), g in groups.items()]
    rows.sort(key=lambda r: -r["bytes"])
    by_pool: dict[str, float] = defaultdict(float)
    for r in rows:
        by_pool[r["pool"]] += r["mib"]
    return rows, dict(by_pool), frees


def record_segments() -> None:
    """Allocator history of segment events with Python stacks (torch without `skip_actions`: every event, in a
    ring large enough for the workloads here)."""
    try:
        torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                 skip_actions=["alloc", "free_requested", "free_completed"])
    except TypeError:
        torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                 max_entries=2_000_000)


def run(args: argparse.Namespace, reserve: int | str = 0, more: int = 0) -> dict:
    """Build the engine (the workload's budget + `more`, activation_reserve = `reserve`), replay the workload twice
    (the first captures the graphs it needs), and report the memory."""
    cfg = model_config(False, shape=args.shape)
    dtype = torch.float16
    page = page_bytes(cfg, args.block_size, dtype)
    weights = ap_weights(cfg, args.parent_bits)
    outside = outside_bytes(cfg, dtype, "cuda")
    if args.workload == "bench":
        kv = kv_bytes(cfg, args.batch, args.seq_len, args.block_size, page, args.chunk)
        budget = outside + expert_pool_bytes(weights, args.bits, page) + kv
        options = dict(max_num_seqs=args.batch, max_num_batched_tokens=args.chunk, max_model_len=args.seq_len + 16,
                       bits=args.bits, paging=False)
    else:  # kv_pressure's H200 workload and budget, PagedWeight at the parent width
        budget, options = budget_and_options(cfg, weights, args.parent_bits, outside, page,
                                             PRESSURE["kv_room_blocks"], PRESSURE["chunk"],
                                             PRESSURE["prompt_len"][1] + PRESSURE["gen"])
        options.update(bits=args.parent_bits, paging=True)
    gc.collect()
    release_cached(torch.device("cuda"))  # each row starts as a fresh process would: no earlier row's cuBLAS workspaces
    torch.cuda.reset_peak_memory_stats()
    free0, _ = torch.cuda.mem_get_info()
    record_segments()
    model = random_model(cfg, False, dtype, "cuda")
    llm = LLM.from_parts(model, weights, None, budget + more, "cuda", model_name=args.workload, detokenize=False,
                         block_size=args.block_size, activation_reserve=reserve, **options)
    torch.cuda.synchronize()
    reserved_built, allocated_built = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    startup_peak = torch.cuda.max_memory_reserved()  # the build's peak ("auto": since its profile reset it)
    built = len(torch.cuda.memory._snapshot()["device_traces"][0])  # history entries of the build
    for replay in range(2):
        if args.workload == "bench":
            serve(llm, args.batch, args.seq_len - args.gen, args.gen, cfg.vocab_size, seed=replay,
                  sampling=sampling_of(args))
        else:
            drive(llm, workload(PRESSURE["num_requests"], PRESSURE["rate"], *PRESSURE["prompt_len"], cfg.vocab_size,
                                0), PRESSURE["gen"])
    torch.cuda.synchronize()
    st = llm.stats()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    setup_sources, setup_by_pool, _ = attribute(snap, 0, built)
    sources, by_pool, frees = attribute(snap, built)
    peak = torch.cuda.max_memory_reserved()
    free1, _ = torch.cuda.mem_get_info()
    graphs = llm.runner.decode.stats if llm.runner.decode is not None else None
    row = {"workload": args.workload, "batch": args.batch if args.workload == "bench" else None,
           "activation_reserve": reserve, "activation_reserve_mib": llm.options.activation_reserve / MIB,
           "budget_mib": st["budget_bytes"] / MIB,
           "reserved_after_setup_mib": reserved_built / MIB, "peak_reserved_mib": peak / MIB,
           "peak_over_budget_mib": (peak - st["budget_bytes"]) / MIB,
           "reserved_after_setup_over_budget_mib": (reserved_built - st["budget_bytes"]) / MIB,
           "startup_peak_over_budget_mib": (startup_peak - st["budget_bytes"]) / MIB,
           "allocated_after_setup_over_budget_mib": (allocated_built - st["budget_bytes"]) / MIB,
           "allocator_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
           "device_used_by_process_mib": (free0 - free1) / MIB,  # mem_get_info: includes memory torch does not see
           "device_used_not_torch_mib": (free0 - free1 - torch.cuda.memory_reserved()) / MIB,
           "live_segments_of_setup_by_pool_mib": setup_by_pool, "live_segments_of_workload_by_pool_mib": by_pool,
           "segments_freed_in_workload": frees,
           "decode_graphs_captured": graphs and graphs.captured, "preemptions": st["preemptions"],
           "sources": sources[:args.top], "setup_sources": setup_sources[:args.top]}
    print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items() if "sources" not in k},
          file=sys.stderr)
    for r in sources[:args.top] + [{"pool": "(setup)", "source": "", "mib": 0, "segments": 0, "allocated_bytes": 0}] \
            + setup_sources[:args.top]:
        print(f"  {r['pool']:>10} {r['mib']:9.1f} MiB in {r['segments']:4d} segments ({r['allocated_bytes'] / MIB:8.1f}"
              f" allocated at the end)  {r['source']}", file=sys.stderr)
    del llm, model
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=("bench", "pressure"), default="bench",
                   help="bench: engine_bench's batch at uniform --bits; pressure: kv_pressure's arrivals, paging on")
    p.add_argument("--shape", choices=list(SHAPES), default="qwen1.5-moe", help="the model shape (engine_bench.SHAPES)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--parent-bits", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    add_sampling_args(p)  # the bench workload's
    p.add_argument("--reserve", default="",
                   help="then run again at budget + the measured gap with activation_reserve = that gap (rounded up "
                        "to 2 MiB; 'measured') and/or at budget + twice the gap with 'auto' (the engine's start-up "
                        "profile), comma-separated")
    p.add_argument("--top", type=int, default=20, help="sources listed")
    p.add_argument("--label", default=None)
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs CUDA: it measures the device's caching allocator")
    rows = [run(args)]
    gap = round_up(max(0, round(rows[0]["peak_over_budget_mib"] * MIB)), 2 * MIB)
    for mode in filter(None, args.reserve.split(",")):
        if mode not in ("measured", "auto"):
            p.error(f"--reserve {mode!r}: measured or auto")
        # "auto" at twice the gap: its profile measures the widest decode at the longest table, more than this
        # workload reaches (406 MiB against 388 at batch 1, s21), so at budget + gap its pool could not hold the
        # workload's KV; the larger pool changes nothing the workload allocates beside it
        rows.append(run(args, gap, gap) if mode == "measured" else run(args, "auto", 2 * gap))
        rows[-1]["peak_within_budget"] = rows[-1]["peak_over_budget_mib"] <= 0
    print(write_result("memory_gap", rows, out_dir=args.out_dir, label=args.label or args.workload,
                       extra={"shape": args.shape}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
