"""Host cost of a release burst (issue 8): one step boundary that starts hundreds of offloads at once.

When KV demand jumps (a batch arrives), the planner lowers many blocks in one plan and the engine requests every
offload in the same boundary; that boundary delays the next step (time to first token, inter-token P99). This
script measures it on CPU at the block count of the Qwen1.5-MoE shape (24 layers x 60 experts x 2 blocks; the
compute is scaled down, the page-table and pool work per block is not): an engine at the memory of uniform 4 bits
serves one batch (reloads and KV leave the pool fragmented), then the planner's desired widths drop by one bit on
every block and one `_request_moves` call starts all those offloads. Rows: ms per offload request and the share of
it spent in the pool's allocator (cProfile, a second run of the same burst).

    python -m benchmarks.release_burst --label before   # on the old tree
    python -m benchmarks.release_burst --label after
    python -m benchmarks.release_burst --device cuda --label cuda   # the CUDA copy backend (H200)
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import write_result
from benchmarks.decode_overhead import SCALED
from benchmarks.engine_bench import (ap_weights, expert_pool_bytes, kv_bytes, outside_bytes, page_bytes, random_model,
                                     serve)
from pagedweight.engine import LLM
from pagedweight.models import ModelConfig


def fragmented_engine(batch: int, seq_len: int, device: str = "cpu") -> LLM:
    cfg = ModelConfig(**SCALED)
    weights = ap_weights(cfg, parent_bits=6)
    dtype = torch.float16 if device == "cuda" else torch.float32
    page = page_bytes(cfg, 16, dtype)
    model = random_model(cfg, False, dtype, device)
    budget = (outside_bytes(cfg, dtype, device) + expert_pool_bytes(weights, 4, page)
              + kv_bytes(cfg, batch, seq_len, 16, page, 512))
    llm = LLM.from_parts(model, weights, None, budget, device, model_name="release-burst", detokenize=False,
                         block_size=16, max_num_seqs=batch, max_num_batched_tokens=512, max_model_len=seq_len + 16,
                         bits=6, paging=True)
    serve(llm, batch, seq_len - 16, 16, cfg.vocab_size, seed=1)
    return llm


def burst(llm: LLM, profile: cProfile.Profile | None) -> tuple[int, float]:
    """Every block one bit lower, all offloads requested in one boundary; returns (requests, seconds)."""
    committed = llm.committed_widths()
    llm.planner.desired = np.maximum(committed - 1, llm.planner.tables.low)
    n = int((llm.planner.desired < committed).sum())
    t0 = time.perf_counter()
    if profile:
        profile.enable()
    llm._request_moves(committed, 0)
    if profile:
        profile.disable()
    return n, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: the same burst through the CUDA copy backend (its per-copy stream/event calls)")
    p.add_argument("--label", default=None)
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for prof in (None, cProfile.Profile()):
        llm = fragmented_engine(args.batch, args.seq_len, args.device)
        holes = len(llm.pool._free_starts)
        n, secs = burst(llm, prof)
        row = {"profiled": prof is not None, "offload_requests": n, "free_extents_before": holes,
               "burst_ms": secs * 1e3, "ms_per_request": secs * 1e3 / max(n, 1)}
        if prof:
            stats = pstats.Stats(prof)
            total = sum(v[2] for v in stats.stats.values())  # tottime of every function
            alloc = sum(v[3] for k, v in stats.stats.items() if k[2] == "alloc_run")  # cumtime of alloc_run
            row["alloc_share"] = alloc / total if total else None
            top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:12]  # by tottime: where the host time goes
            row["top_tottime"] = [[f"{Path(k[0]).name}:{k[1]}({k[2]})", v[1], v[2] * 1e3] for k, v in top]
        rows.append(row)
        print(row, file=sys.stderr)
        llm.table.check()
    print(write_result("release_burst", rows, out_dir=args.out_dir, label=args.label,
                       extra={"model": "Qwen1.5-MoE block count (24 x 60 x 2), scaled compute",
                              "device": args.device}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
