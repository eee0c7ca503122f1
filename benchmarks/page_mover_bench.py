"""Issue 6 item 6: the page mover on the real path (pinned shared store -> pool, through PageMover).

Rows: (1) reload bandwidth from the pinned page store vs the pinned host->device copy ceiling measured in the
same run (target >= 45 GB/s), unpaced; (2) slowdown of a memory-bound decode-like loop (fp16 GEMVs over rotating
weights larger than L2) while reloads run beside it (target <= 5%), once unpaced (every copy issued at once) and
once paced (the mover's ReloadPace: at most link x duty x measured step time per step), each with the reload GB/s
it achieved; (3) time from KV pressure to the KV blocks being allocatable, for an offload of >= 1 GiB, with decode
steps running.

    python -m benchmarks.page_mover_bench                      # H200 defaults
    python -m benchmarks.page_mover_bench --tiny --device cpu  # smoke run on CPU
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.budget_exchange import GIB, Rig, drive, make_rig
from benchmarks.common import write_result
from pagedweight.mover import ReloadPace


class Timer:
    """Wall time of GPU work on the current stream (CUDA events), or of CPU work."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __enter__(self) -> "Timer":
        if self.cuda:
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.t = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.b.record()
            self.b.synchronize()
            self.ms = self.a.elapsed_time(self.b)
        else:
            self.ms = (time.perf_counter() - self.t) * 1e3


def copy_ceiling_gb_per_s(device: torch.device, nbytes: int, reps: int = 5) -> float:
    """Pinned host -> device copy bandwidth (the link the reloads use), median of `reps`."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(reps + 1):
        with Timer(device) as t:
            dst.copy_(src, non_blocking=True)
        times.append(t.ms)
    return nbytes / statistics.median(times[1:]) / 1e6


def reload_all(rig: Rig, width: int) -> tuple[int, float, float]:
    """Request every block at `width`, wait for the copies; (bytes, wall ms, copy-stream ms)."""
    mover, n = rig.mover, len(rig.table.rows)
    cuda = rig.pool.device.type == "cuda"
    b0 = mover.stats.bytes_copied
    if cuda:
        torch.cuda.synchronize()
        stream = mover.backend.copy_stream
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record(stream)
    t = time.perf_counter()
    for i in range(n):
        assert mover.request(i, width), f"block {i} refused"
    if cuda:
        ev1.record(stream)
        ev1.synchronize()
    wall = (time.perf_counter() - t) * 1e3
    gpu = ev0.elapsed_time(ev1) if cuda else wall
    drive(mover, {i: width for i in range(n)})
    return mover.stats.bytes_copied - b0, wall, gpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--offload-gib", type=float, default=1.0)
    ap.add_argument("--pace-duty", type=float, default=ReloadPace.duty,
                    help="paced rows: share of a step time the link may spend on reloads")
    ap.add_argument("--pace-bytes", type=int, default=None,
                    help="paced rows: a fixed cap of reload bytes per step instead of the derived one")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.tiny:
        shape = dict(layers=1, experts=4, hidden=256, inter=128, parent_bits=4, seed_bits=2)
        budget, page, gemv, n_w, offload = 4 << 20, 4096, (256, 256), 2, 64 << 10
    else:  # Mixtral-8x7B expert shapes, 2 layers: 2.9 GB of planes at 8 bits
        shape = dict(layers=2, experts=8, hidden=4096, inter=14336, parent_bits=8, seed_bits=3)
        budget, page, gemv, n_w, offload = 8 * GIB, 64 << 10, (14336, 4096), 8, int(args.offload_gib * GIB)
    P, S = shape["parent_bits"], shape["seed_bits"]
    n_blocks = shape["layers"] * shape["experts"] * 2
    # reserve pages for every block's seed LUT: all offloads of a pressure event can start in the same step
    rig = make_rig(args.device, budget, page, **shape, reserve_seed_luts=True)
    pool, table, mover = rig.pool, rig.table, rig.mover
    ceilings = {"pinned_h2d_gb_per_s": copy_ceiling_gb_per_s(device, 1 * GIB if not args.tiny else 1 << 20),
                "store_pinned": rig.store.pinned}
    rows: list[dict] = []
    extra = {"shape": shape, "budget_bytes": budget, "page_bytes": page}

    def save(complete: bool = False) -> None:
        """Rewrite the JSON with every row so far: a run cut short still leaves its measurements."""
        path = write_result("page_mover", rows, ceilings=ceilings, extra={**extra, "complete": complete})
        if complete:
            print(path)

    def add(row: dict) -> None:
        rows.append(row)
        print(row, flush=True)
        save()

    save()
    try:
        drive(mover, {i: S for i in range(n_blocks)})  # engine start: everything at the seed width
        # (1) reload bandwidth S -> P from the pinned store
        for trial in range(args.trials):
            nbytes, wall, gpu = reload_all(rig, P)
            add({"test": "reload_bandwidth", "trial": trial, "bytes": nbytes, "wall_ms": wall, "copy_ms": gpu,
                 "gb_per_s": nbytes / gpu / 1e6, "wall_gb_per_s": nbytes / wall / 1e6,
                 "frac_of_copy_ceiling": nbytes / gpu / 1e6 / ceilings["pinned_h2d_gb_per_s"]})
            drive(mover, {i: S for i in range(n_blocks)})

        # (2) decode-like loop alone vs with reloads beside it
        ws = [torch.randn(*gemv, device=device, dtype=torch.float16 if device.type == "cuda" else torch.float32)
              for _ in range(n_w)]
        x = torch.randn(gemv[1], device=device, dtype=ws[0].dtype)

        def step() -> None:
            for w in ws:
                torch.mv(w, x)

        def decode_step() -> None:
            """A step plus the host sync that sampling the next token imposes."""
            step()
            if device.type == "cuda":
                torch.cuda.current_stream().synchronize()

        def timed_steps(n: int) -> list[float]:
            out = []
            for _ in range(n):
                mover.boundary()
                with Timer(device) as t:
                    step()
                mover.end_step()
                out.append(t.ms)
            return out

        step_bytes = sum(w.numel() * w.element_size() for w in ws)
        fixed = args.pace_bytes if args.pace_bytes or not args.tiny else 16 << 10  # toy planes: still several steps
        pace = ReloadPace(bytes_per_step=fixed, duty=args.pace_duty)
        mover.pace = pace  # the alone steps teach the pace the step time (end_step measures it)
        timed_steps(10)
        alone = statistics.median(timed_steps(50))
        mover.pace = None
        copy_ms = statistics.median(r["copy_ms"] for r in rows)
        unpaced_gb_per_s = statistics.median(r["gb_per_s"] for r in rows)
        n_overlap = max(5, int(0.5 * copy_ms / alone))  # steps that fit well inside one unpaced reload
        for trial in range(args.trials):
            if device.type == "cuda":
                torch.cuda.synchronize()
            for i in range(n_blocks):
                assert mover.request(i, P)
            with_copy = statistics.median(timed_steps(n_overlap))
            overlapped = any(mover.pending(i) for i in range(n_blocks))  # copies outlasted the timed steps
            drive(mover, {i: P for i in range(n_blocks)})
            add({"test": "decode_slowdown", "paced": False, "trial": trial, "steps": n_overlap,
                 "step_alone_us": alone * 1e3, "step_with_reload_us": with_copy * 1e3,
                 "slowdown_frac": with_copy / alone - 1, "copies_outlasted_steps": overlapped,
                 "reload_gb_per_s": unpaced_gb_per_s, "weight_bytes_per_step": step_bytes,
                 "step_tb_per_s": step_bytes / (alone * 1e-3) / 1e12})
            drive(mover, {i: S for i in range(n_blocks)})
        for trial in range(args.trials):  # paced: every step of the reload runs beside a slice of it
            mover.pace = pace
            if device.type == "cuda":
                torch.cuda.synchronize()
            b0, caps, times = mover.stats.bytes_copied, [], []
            t = time.perf_counter()
            for i in range(n_blocks):
                assert mover.request(i, P)
            while not (mover.idle() and all(r.q == P for r in table.rows)):
                caps.append(pace.cap())
                times += timed_steps(1)
            wall_s = time.perf_counter() - t
            nbytes = mover.stats.bytes_copied - b0
            with_copy = statistics.median(times)
            add({"test": "decode_slowdown", "paced": True, "trial": trial, "steps": len(times),
                 "step_alone_us": alone * 1e3, "step_with_reload_us": with_copy * 1e3,
                 "slowdown_frac": with_copy / alone - 1, "pace_duty": pace.duty,
                 "pace_fixed_bytes_per_step": pace.bytes_per_step,
                 "pace_bytes_per_step_median": statistics.median(caps), "pace_step_us": pace.step_s * 1e6,
                 "reload_bytes": nbytes, "reload_ms": wall_s * 1e3, "reload_gb_per_s": nbytes / wall_s / 1e9,
                 "unpaced_reload_gb_per_s": unpaced_gb_per_s, "weight_bytes_per_step": step_bytes})
            mover.pace = None
            drive(mover, {i: S for i in range(n_blocks)})

        # (3) pressure -> KV blocks available, for an offload of >= `offload` bytes, decode steps running
        drive(mover, {i: P for i in range(n_blocks)})
        kv = pool.alloc_kv_blocks(pool.kv_capacity())
        targets, freed = {}, 0
        for i in range(n_blocks):
            if freed >= offload:
                break
            targets[i] = S
            freed += table.memory(i, P) - table.memory(i, S)
        need = offload // pool.kv_block_bytes
        for trial in range(args.trials):
            t = time.perf_counter()
            steps = drive(mover, targets, step=decode_step, until=lambda: pool.kv_capacity() >= need)
            new = pool.alloc_kv_blocks(need)
            ms = (time.perf_counter() - t) * 1e3
            add({"test": "pressure_to_kv", "trial": trial, "offload_bytes": freed, "kv_blocks": need,
                 "kv_block_bytes": pool.kv_block_bytes, "blocks_offloaded": len(targets), "steps": steps,
                 "step_alone_us": alone * 1e3, "ms": ms})
            pool.free_kv_blocks(new)
            drive(mover, {i: P for i in targets})
        pool.free_kv_blocks(kv)
    finally:
        rig.close()
    save(complete=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
