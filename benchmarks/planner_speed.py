"""Planner speed on one CPU core (issue 7, item 5): PLANSTEP over 10,000 and 100,000 blocks x 5 width transitions.

Tables are synthetic at Qwen1.5-MoE expert shapes (gate_up [2816, 2048], down [2048, 1408]), parent 8 bits, seed 3
(so 8->7->6->5->4->3: 5 transitions per block), M page-rounded at 64 KiB pages with LUT_b priced, and
s_i^b = scale_i * 4^-b * lognormal noise (sigma 0.1): the shape a k-means quantizer gives. One adversarial row uses
s drawn at random per width, so most chains need the convex-hull path. Times are per call, median and p90 of
process CPU time (the box is shared, so wall time is reported beside it), pinned to one core. `signals` and
`refresh` are timed twice: with changed inputs (recomputed, what every step paid before the lazy refresh) and with
nothing changed (the cached signals and standing plan come back), beside one `step` (decide + refresh) of that
steady state. Sizes: 24 x 60 (Qwen1.5-MoE-A2.7B, 2,880 blocks), 50 x 100 (10,000) and 100 x 500 (100,000).

    python benchmarks/planner_speed.py [--reps 200] [--skip-100k] [--label NAME]
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import write_result  # noqa: E402
from pagedweight.knobs import PlannerKnobs  # noqa: E402
from pagedweight.planner import BlockTables, KVState, Planner, damage_rows, plan_release, plan_reload  # noqa: E402
from pagedweight.runner import NARROW_WIDTH  # noqa: E402
from pagedweight.signals import ResidualHeads  # noqa: E402

P, SEED_BITS, PAGE = 8, 3, 65536
KV_BLOCK_BYTES = 16 * 24 * 2 * 16 * 128 * 2  # 16 tokens, 24 layers, K+V, 16 heads x 128, fp16: 3 MiB


def synthetic_tables(num_layers: int, num_experts: int, adversarial: bool, seed: int = 0) -> BlockTables:
    rng = np.random.default_rng(seed)
    n = num_layers * num_experts * 2
    sup = np.zeros((n, P + 1), dtype=bool)
    sup[:, SEED_BITS:] = True
    gate_up = np.arange(n) % 2 == 0
    rows, cols = np.where(gate_up, 2816, 2048), np.where(gate_up, 2048, 1408)
    plane = np.ceil(4 * np.ceil(cols / 32) * rows / PAGE) * PAGE
    mem = np.zeros((n, P + 1))
    for b in range(1, P + 1):
        mem[:, b] = b * plane + np.ceil(2 * 2**b * rows / PAGE) * PAGE
    if adversarial:
        sens = rng.exponential(1.0, (n, P + 1))
    else:
        sens = rng.lognormal(0, 1, n)[:, None] * 4.0 ** -np.arange(P + 1)[None, :] * np.exp(
            rng.normal(0, 0.1, (n, P + 1)))
    return BlockTables(sup, mem, sens, num_layers, num_experts)


def timed(fn, reps: int) -> dict:
    fn()  # warm the allocator and caches
    cpu, wall = [], []
    for _ in range(reps):
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        fn()
        cpu.append(time.thread_time_ns() - c0)
        wall.append(time.perf_counter_ns() - w0)
    cpu_ms, wall_ms = np.array(cpu) / 1e6, np.array(wall) / 1e6
    return {"cpu_median_ms": round(float(np.median(cpu_ms)), 4), "cpu_p90_ms": round(float(np.quantile(cpu_ms, 0.9)), 4),
            "wall_median_ms": round(float(np.median(wall_ms)), 4), "reps": reps}


def bench_size(num_layers: int, num_experts: int, reps: int) -> list[dict]:
    rows = []
    for adversarial in (False, True):
        t = synthetic_tables(num_layers, num_experts, adversarial)
        n = t.n_blocks
        top = np.full(n, P)
        floors = np.full(n, SEED_BITS)
        stages = PlannerKnobs().stage_floors
        dhat = damage_rows(t, np.ones(n), 1e-12)
        max_release = float((t.mem[:, P] - t.mem[:, SEED_BITS]).sum())
        base = {"blocks": n, "transitions_per_block": P - SEED_BITS, "sens": "adversarial" if adversarial else "k-means-like"}
        demands = [("1 kv block", KV_BLOCK_BYTES), ("64 kv blocks", 64 * KV_BLOCK_BYTES),
                   ("1% of max release", 0.01 * max_release), ("10% of max release", 0.10 * max_release),
                   ("above max release", 2 * max_release)]
        for label, demand in demands:
            plan = plan_release(t, top, demand, dhat, floors, stages)
            rows.append({**base, "op": "plan_release", "demand": label, "demand_bytes": float(demand),
                         "stage": plan.stage, "met": plan.met, "steps_taken": int((plan.widths != top).sum()),
                         **timed(lambda: plan_release(t, top, demand, dhat, floors, stages), reps)})
        half = plan_release(t, top, 0.3 * max_release, dhat, floors, stages).widths
        rows.append({**base, "op": "plan_reload", "demand": "budget 64 kv blocks", "demand_bytes": 64.0 * KV_BLOCK_BYTES,
                     **timed(lambda: plan_reload(t, half, 64.0 * KV_BLOCK_BYTES, dhat, top), reps)})
        # the narrow-class rule's worst case: every layer in the class, a budget that spreads over all of them
        narrow = np.full(n, NARROW_WIDTH)
        rows.append({**base, "op": "plan_reload narrow rule", "demand": "budget 64 kv blocks",
                     "demand_bytes": 64.0 * KV_BLOCK_BYTES,
                     **timed(lambda: plan_reload(t, narrow, 64.0 * KV_BLOCK_BYTES, dhat, top, NARROW_WIDTH,
                                                 PlannerKnobs().narrow_min_share), reps)})
        if adversarial:
            continue
        rng = np.random.default_rng(1)
        heads = ResidualHeads.zeros(P)
        for arr in (heads.weight, heads.bias):
            arr[:] = rng.normal(0, 0.3, arr.shape)
        heads.confidence[:] = 0.5
        kv = KVState(free_blocks=40, target_free_blocks=8, block_bytes=KV_BLOCK_BYTES)
        mass = rng.dirichlet(np.ones(num_experts), num_layers)
        for with_heads in (False, True):
            planner = Planner(t, PlannerKnobs(), top, heads=heads if with_heads else None)
            planner.observe(mass, rng.lognormal(0, 0.3, (n, 4)) if with_heads else None)
            tag = {**base, "heads": with_heads}

            def changed(fn, planner=planner):  # new signal inputs: the cached d_hat and standing plan are stale
                planner._signals = None
                return fn()

            rows.append({**tag, "op": "planner.signals, inputs changed (buckets, mu, eta, d_hat)", "demand": "-",
                         **timed(lambda: changed(planner.signals), reps)})
            rows.append({**tag, "op": "planner.signals, nothing changed", "demand": "-",
                         **timed(planner.signals, reps)})
            rows.append({**tag, "op": "planner.refresh, inputs changed (signals + standing plan)",
                         "demand": "lookahead 8 kv blocks", **timed(lambda: changed(lambda: planner.refresh(kv, top)),
                                                                    reps)})
            rows.append({**tag, "op": "planner.refresh, nothing changed", "demand": "lookahead 8 kv blocks",
                         **timed(lambda: planner.refresh(kv, top), reps)})
            rows.append({**tag, "op": "decide + refresh, nothing changed (what a quiet step skips)", "demand": "-",
                         **timed(lambda: (planner.decide(kv, top), planner.refresh(kv, top)), reps)})
            rows.append({**tag, "op": "planner.step, quiet (same inputs as the step before)", "demand": "-",
                         **timed(lambda: planner.step(kv, top), reps)})
            tight = KVState(free_blocks=5, target_free_blocks=8, block_bytes=KV_BLOCK_BYTES)

            def trigger(planner=planner, tight=tight):
                planner.refresh(kv, top)
                t0 = time.thread_time_ns()
                planner.decide(tight, top)
                planner.desired = top.copy()
                planner.version += 1
                return time.thread_time_ns() - t0

            trigger()
            cut = np.array([trigger() for _ in range(reps)]) / 1e6
            rows.append({**tag, "op": "planner.decide on trigger (newest queued plan cut to demand)",
                         "demand": "6 kv blocks", "cpu_median_ms": round(float(np.median(cut)), 4),
                         "cpu_p90_ms": round(float(np.quantile(cut, 0.9)), 4), "wall_median_ms": None, "reps": reps,
                         "queue_hits": planner.counters["queue_hit"], "queue_misses": planner.counters["queue_miss"]})
    return rows


def ceilings(reps: int) -> dict:
    """What a naive planner would pay: one argsort of every step's key (50,000 floats), measured here."""
    x = np.random.default_rng(2).random(50_000)
    return {"argsort_50k_float64_cpu_median_ms": timed(lambda: np.argsort(x), reps)["cpu_median_ms"],
            "sum_50k_float64_cpu_median_ms": timed(lambda: x.sum(), reps)["cpu_median_ms"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--core", type=int, default=None, help="pin to this core (default: the last one)")
    ap.add_argument("--skip-100k", action="store_true", help="only the 2,880- and 10,000-block tables")
    ap.add_argument("--label", default=None, help="suffix of the JSON file name (keeps another run's file)")
    args = ap.parse_args()
    core = args.core if args.core is not None else max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    rows = bench_size(24, 60, args.reps) + bench_size(50, 100, args.reps)
    if not args.skip_100k:
        rows += bench_size(100, 500, max(args.reps // 10, 10))
    for r in rows:
        print(f"{r['blocks']:>7} {r['sens']:>12} {r['op'][:44]:44s} {r['demand']:>22s} "
              f"cpu {r['cpu_median_ms']:.3f} ms (p90 {r['cpu_p90_ms']:.3f})")
    path = write_result("planner-speed", rows, ceilings=ceilings(args.reps), label=args.label,
                        extra={"pinned_core": core, "load_avg_1m": os.getloadavg()[0]})
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
