"""Python's cyclic garbage collector in a serving engine: what a full collection costs once the engine is built, and
how often the automatic collections of each generation run while it serves.

A full (generation 2) collection walks every tracked object of the process: the model's modules, torch's and
numba's import-time objects, the tokenizer. Serving runtimes that saw decode stalls from it freeze those objects
after start (`gc.freeze()`, vLLM and LightLLM). Whether the engine loop triggers one at all depends on how many
objects it allocates and keeps; this measures that on the bundled model (CPU by default): waves of requests through
`LLM.generate`, every collection timed by a `gc.callbacks` hook. Rows: per arm (`--freeze`: `gc.collect()` and
`gc.freeze()` after the build), the tracked objects, the median of five full collections before the workload
(measured, the process's CPU), and per generation the automatic collections, their median and longest ms.
`--http` asks the same of a Serve engine replica under HTTP load (streamed chat completions, `--clients` at a time):
per generation the collections its process's hook (pagedweight/gc_watch.py) counted during the load and their mean
ms, from its `stats()`.

    python -m benchmarks.gc_pauses --waves 20 --label s59
    python -m benchmarks.gc_pauses --http --waves 10 --label s60-http
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tqdm import tqdm

from benchmarks.common import local_serve, write_result
from pagedweight.engine import LLM
from pagedweight.gc_watch import GcPauses
from pagedweight.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def full_collection_ms(repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def serve_waves(llm: LLM, waves: int, requests: int, tokens: int, seed: int = 0) -> tuple[GcPauses, int]:
    """Every automatic collection while `waves` batches of `requests` random prompts generate `tokens` tokens each;
    and the engine steps they took."""
    pauses = GcPauses(record=True)
    rng = np.random.default_rng(seed)
    steps = llm.num_steps
    gc.callbacks.append(pauses)
    try:
        for _ in range(waves):
            prompts = [rng.integers(10, 500, int(rng.integers(8, 64))).tolist() for _ in range(requests)]
            llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    finally:
        gc.callbacks.remove(pauses)
    return pauses, llm.num_steps - steps


def serve_http(args) -> dict:
    """The same question in a Serve replica: `--requests` x `--waves` streamed chat completions through the OpenAI
    app, `--clients` at a time; the replica's collections and pauses (its process's hook, `LLM.stats()`) before and
    after. The ingress relays in a process of its own, not counted here."""
    from ray import serve

    from benchmarks.routing_affinity import chat_turn
    from pagedweight.actors.openai_app import AppArgs, build_app
    from pagedweight.convert import ap_checkpoint_for

    model_dir = ap_checkpoint_for(Path(args.model), Path.home() / ".cache" / "pagedweight", "cpu")
    name = Path(args.model).name
    with local_serve(args.port) as url:
        serve.run(build_app(AppArgs(model_dir=str(model_dir), engine_options={"served_model_name": name,
                                                                              "max_num_seqs": 16})),
                  name="gc", route_prefix="/")
        engine = serve.get_deployment_handle("EngineReplica", app_name="gc")
        chat_turn(url, name, [{"role": "user", "content": "warm up"}], 4)
        before = engine.stats.remote().result()
        rng = np.random.default_rng(0)
        words = (ROOT / "data" / "eval.txt").read_text().split()
        todo = [" ".join(words[i:i + int(rng.integers(8, 64))]) for i in rng.integers(0, len(words) - 64,
                                                                                       args.waves * args.requests)]
        t = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            list(tqdm(pool.map(lambda q: chat_turn(url, name, [{"role": "user", "content": q}], args.tokens), todo),
                      total=len(todo), desc="requests", unit="req"))
        seconds = time.perf_counter() - t
        after = engine.stats.remote().result()
    row = {"arm": "serve-http", "requests": len(todo), "clients": args.clients, "seconds": seconds,
           "steps": after["engine_steps"] - before["engine_steps"]}
    for g in range(3):
        n = after["gc_collections"][g] - before["gc_collections"][g]
        s = after["gc_pause_s"][g] - before["gc_pause_s"][g]
        row[f"gen{g}"] = {"collections": n, "mean_ms": s / n * 1e3 if n else None}
    return row


def engine_loop(args) -> dict:
    """The engine's own loop (`LLM.generate` in this process): tracked objects, a full collection's cost, and every
    automatic collection's pause while `--waves` waves of requests run."""
    llm = LLM(args.model, device=args.device, max_num_seqs=16)
    gc.collect()
    if args.freeze:
        gc.freeze()
    row = {"arm": "freeze" if args.freeze else "plain", "tracked_objects": len(gc.get_objects()),
           "frozen_objects": gc.get_freeze_count(), "full_collection_ms_median": full_collection_ms(),
           "gc_thresholds": list(gc.get_threshold())}
    t = time.perf_counter()
    pauses, steps = serve_waves(llm, args.waves, args.requests, args.tokens)
    row.update(requests=args.waves * args.requests, steps=steps, seconds=time.perf_counter() - t)
    for g in range(3):
        ms = [s * 1e3 for gen, s in pauses.pauses if gen == g]
        row[f"gen{g}"] = {"collections": len(ms), "median_ms": statistics.median(ms) if ms else None,
                          "max_ms": max(ms) if ms else None}
    return row


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
    p.add_argument("--http", action="store_true", help="through a Serve replica over HTTP instead (Ray, CPU)")
    p.add_argument("--clients", type=int, default=16, help="--http: requests in flight at once")
    p.add_argument("--port", type=int, default=8124)
    args = p.parse_args(argv)
    row = serve_http(args) if args.http else engine_loop(args)
    print(row)
    print(write_result("gc_pauses", [row], out_dir=args.out_dir, label=args.label))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
