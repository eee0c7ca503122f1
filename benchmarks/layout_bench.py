"""Host time of the prefill's expert layout (`models.layers.expert_rows`), which runs once per MoE layer of every
prefill step: Qwen1.5-MoE's (60 experts, top-4) and Qwen3-30B-A3B's (128, top-8) routing under a skewed popularity,
padded groups as the AP prefill plans them (`cuda/prefill.prefill_forward`: its group size, slack and buckets), at
several token counts. Per case the best of --rounds timings of --calls calls (us per call, measured on this host).

    python -m benchmarks.layout_bench --label s52
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.common import write_result
from pagedweight.cuda.prefill import GROUPED_MAX, PAD_SLACK, prefill_group
from pagedweight.models.layers import expert_rows

SHAPES = {"qwen1.5-moe": (60, 4, 2048, 1408), "qwen3-30b-a3b": (128, 8, 2048, 768)}  # E, k, D, F


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="64,504,2048", help="tokens per layer call, comma-separated")
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out-dir", default=None)
    p.add_argument("--label", default=None)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    t0 = time.perf_counter()
    expert_rows(np.zeros((1, 1), dtype=np.int64), 1, 1, True, True, 0.0, True)  # a compiled layout compiles here
    first_call_s = time.perf_counter() - t0
    for shape, (e, k, d, f) in SHAPES.items():
        group = min(prefill_group(d, f), GROUPED_MAX, e)
        popularity = 1 / np.arange(1, e + 1) ** 0.8
        for t in (int(x) for x in args.tokens.split(",")):
            ids = np.stack([rng.choice(e, k, replace=False, p=popularity / popularity.sum()) for _ in range(t)])
            call = lambda: expert_rows(ids, e, group, pad=True, routed_only=True, slack=PAD_SLACK, bucket=True)  # noqa: E731
            for _ in range(50):
                call()
            times = []
            for _ in range(args.rounds):
                t1 = time.perf_counter()
                for _ in range(args.calls):
                    call()
                times.append((time.perf_counter() - t1) / args.calls * 1e6)
            rows.append({"shape": shape, "tokens": t, "experts": e, "top_k": k, "group": group,
                         "us_per_call_best": round(min(times), 2), "us_per_call_median": round(float(np.median(times)), 2)})
            print(rows[-1])
    print(write_result("layout_bench", rows, out_dir=args.out_dir, label=args.label,
                       extra={"first_call_s": round(first_call_s, 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
