"""Python's cyclic garbage collector in a serving engine: what a full collection costs once the engine is built, and
how often the automatic collections of each generation run while it serves.

A full (generation 2) collection walks every tracked object of the process: the model's modules, torch's and
numba's import-time objects, the tokenizer. Serving runtimes that saw decode stalls from it freeze those objects
after start (`gc.freeze()`, vLLM and LightLLM). Whether the engine loop triggers one at all depends on how many
objects it allocates and keeps; this measures that on the bundled model (CPU by default): waves of requests through
`LLM.generate`, every collection timed by a `gc.callbacks` hook. Rows: per arm (`--freeze`: `gc.collect()` and
`gc.freeze()` after the build), the tracked objects, the median of five full collections before the workload
(measured, the process's CPU), and per generation the automatic collections, their median and longest ms.

    python -m benchmarks.gc_pauses --waves 20 --label s59
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import numpy as np

from benchmarks.common import write_result
from pagedweight.engine import LLM
from pagedweight.sampling import SamplingParams


def full_collection_ms(repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def serve_waves(llm: LLM, waves: int, requests: int, tokens: int, seed: int = 0) -> tuple[list[tuple[int, float]], int]:
    """(generation, ms) of every automatic collection while `waves` batches of `requests` random prompts generate
    `tokens` tokens each; and the engine steps they took."""
    events: list[tuple[int, float]] = []
    started = [0.0]

    def hook(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            events.append((info["generation"], (time.perf_counter() - started[0]) * 1e3))

    rng = np.random.default_rng(seed)
    steps = llm.num_steps
    gc.callbacks.append(hook)
    try:
        for _ in range(waves):
            prompts = [rng.integers(10, 500, int(rng.integers(8, 64))).tolist() for _ in range(requests)]
            llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    finally:
        gc.callbacks.remove(hook)
    return events, llm.num_steps - steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/pw-tiny-moe")
    p.add_argument("--device", default="cpu")
    p.add_argument("--waves", type=int, default=20)
    p.add_argument("--requests", type=int, default=32, help="requests a wave")
    p.add_argument("--tokens", type=int, default=32, help="tokens a request generates")
    p.add_argument("--freeze", action="store_true", help="gc.collect() and gc.freeze() after the build")
    p.add_argument("--out-dir")
    p.add_argument("--label")
    args = p.parse_args(argv)
    llm = LLM(args.model, device=args.device, max_num_seqs=16)
    gc.collect()
    if args.freeze:
        gc.freeze()
    row = {"arm": "freeze" if args.freeze else "plain", "tracked_objects": len(gc.get_objects()),
           "frozen_objects": gc.get_freeze_count(), "full_collection_ms_median": full_collection_ms(),
           "gc_thresholds": list(gc.get_threshold())}
    t = time.perf_counter()
    events, steps = serve_waves(llm, args.waves, args.requests, args.tokens)
    row.update(requests=args.waves * args.requests, steps=steps, seconds=time.perf_counter() - t)
    for g in range(3):
        ms = [m for gen, m in events if gen == g]
        row[f"gen{g}"] = {"collections": len(ms), "median_ms": statistics.median(ms) if ms else None,
                          "max_ms": max(ms) if ms else None}
    print(row)
    print(write_result("gc_pauses", [row], out_dir=args.out_dir, label=args.label))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
