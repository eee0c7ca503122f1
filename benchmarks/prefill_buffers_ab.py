"""`_prefill` with PrefillBuffers (this tree) against an older moe_kernels.py's (--old FILE, e.g. `git show
92c46cd:cuda/moe_kernels.py`), one Qwen1.5-MoE layer call at 4 bits, the arms alternating in one process: GPU time
(CUDA events over 5 back-to-back calls) and host time of one call, medians; and how far apart the outputs are,
beside how far apart two calls of the old arm are (the combine's index_add_ adds with atomics on CUDA: no fixed
order, so exact equality is not expected of either).

    python -m benchmarks.prefill_buffers_ab --old /tmp/old_moe_kernels.py [--tokens 512,128,2048]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import pagedweight.cuda.moe_kernels as mk
from benchmarks.common import old_functions, write_result
from benchmarks.moe_kernel_bench import SHAPES, routing
from pagedweight.cuda.synthetic import build_synthetic_moe
from pagedweight.runner import lut_width as lut_class


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True, metavar="FILE", help="a moe_kernels.py whose _prefill is the old arm")
    p.add_argument("--tokens", default="512,128,2048")
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--label", default=None)
    args = p.parse_args(argv)
    old, buffers = old_functions(args.old, ["_prefill"], vars(mk))["_prefill"], mk.PrefillBuffers()
    arms = {"old": old, "new": lambda *a: mk._prefill(*a, buffers=buffers)}
    E, D, F, k = SHAPES["qwen1.5-moe-a2.7b"]
    moe = build_synthetic_moe(E, D, F, 8, 3, device="cuda", seed=21, shuffle=False)
    q, po, lo = moe.tables(torch.full((E, 2), 4))
    gen = torch.Generator(device="cuda").manual_seed(9)
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        ids, w = routing(T, E, k, gen)
        h = torch.randn(T, D, generator=gen, device="cuda").half()
        call = (h, ids, w, moe.pool_words, moe.pool_halves, q, po, lo, D, F, lut_class(4))  # as the runner passes
        base = old(*call)
        diffs = dict(rel_old_vs_old=rel(old(*call), base), rel_new_vs_old=rel(arms["new"](*call), base))
        s = {a: {"gpu": [], "host": []} for a in arms}
        for rep in range(-1, args.reps):  # rep -1 warms both arms up
            for arm in (list(arms) if rep % 2 == 0 else list(arms)[::-1]):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                for _ in range(5):
                    arms[arm](*call)
                end.record()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                arms[arm](*call)
                host = (time.perf_counter() - t0) * 1e6
                torch.cuda.synchronize()
                if rep >= 0:
                    s[arm]["gpu"].append(start.elapsed_time(end) * 1e3 / 5)
                    s[arm]["host"].append(host)
        row = dict(T=T, **diffs, buffers_mib=buffers.data.numel() / 2**20,
                   **{f"{a}_{m}_us_median": statistics.median(v) for a in arms for m, v in s[a].items()})
        print({key: round(v, 6) if isinstance(v, float) else v for key, v in row.items()}, flush=True)
        rows.append(row)
    write_result("prefill_buffers_ab", rows, extra={"shape": "qwen1.5-moe-a2.7b", "bits": 4, "old": args.old},
                 label=args.label)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
