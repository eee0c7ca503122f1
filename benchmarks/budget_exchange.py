"""Issue 6 item 2: one budget for weights and KV, in real bytes.

After an offload that frees D bytes the KV cache can allocate exactly floor(D / B_KV) more blocks, and
`torch.cuda.max_memory_reserved` does not grow; after a reload the reverse. The reload runs on a fragmented pool:
KV filled the holes the offload left and the pages given back for the reload are scattered single pages, so every
plane run needs KV relocation (compaction); the row reports the relocations, and every KV page's bytes are checked
after them. Synthetic expert blocks (DESIGN.md §2 byte formulas), a real page store in /dev/shm, the real
pool/table/mover. Runs on CUDA when present, else on CPU.

    python -m benchmarks.budget_exchange                      # H200 defaults
    python -m benchmarks.budget_exchange --tiny --device cpu  # seconds, on CPU
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from benchmarks.common import write_result
from pagedweight.mover import PageMover, ReloadPace
from pagedweight.page_store import PageStore, write_planes_file
from pagedweight.page_table import WeightPageTable, expert_block_specs
from pagedweight.pool import PagePool

GIB = 1 << 30


@dataclass
class Rig:
    """A pool + page table + mover over a synthetic page store (shared by both page benchmarks)."""

    pool: PagePool
    table: WeightPageTable
    mover: PageMover
    store: PageStore
    tmp: Path

    def close(self) -> None:
        self.store.close()
        PageStore.destroy(self.tmp / "store")
        shutil.rmtree(self.tmp, ignore_errors=True)


def _store_dir(specs, parent_bits: int) -> str | None:
    """/dev/shm when it has room for the source file and the store (containers often give it 64 MiB)."""
    need = 2.2 * sum(parent_bits * s.plane_bytes + sum(s.lut_bytes.values()) for s in specs)
    if os.access("/dev/shm", os.W_OK):
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize > need:
            return "/dev/shm"
    return None


def make_rig(device: str, budget: int, page_bytes: int, layers: int, experts: int, hidden: int, inter: int,
             parent_bits: int, seed_bits: int, reserve_seed_luts: bool = False, pace: ReloadPace | None = None) -> Rig:
    """`reserve_seed_luts`: the pool's reserve holds every block's seed LUT, so every offload can start at once and
    the offloads' LUT copies all land in the reserve instead of in the holes the released planes leave (the
    reload then finds those holes whole; with the mover's default reserve, best-fit puts seed LUTs inside the
    holes and a reload of the same bytes can stall on fragments, as it did at the 8 GiB default).
    `pace`: the mover's reload pace (None: unpaced, what the byte-exchange and bandwidth rows want)."""
    specs = expert_block_specs(layers, experts, hidden, inter, parent_bits, seed_bits)
    lut_reserve_pages = sum(-(-s.lut_bytes[seed_bits] // page_bytes) for s in specs) if reserve_seed_luts else None
    tmp = Path(tempfile.mkdtemp(prefix=f"pw-bench-{uuid.uuid4().hex[:6]}-", dir=_store_dir(specs, parent_bits)))
    records = write_planes_file(tmp / "planes.bin", [(s.plane_bytes, s.lut_bytes) for s in specs], parent_bits)
    store = PageStore.create(tmp / "store", tmp / "planes.bin", records)
    (tmp / "planes.bin").unlink()  # the source is not needed once the store holds every plane
    try:
        store.pin()
    except RuntimeError as e:  # reported as store_pinned=False; reloads then run at pageable speed
        print(f"page store not pinned: {e}")
    pool = PagePool(budget, page_bytes, device=device)
    table = WeightPageTable(specs, layers, experts, parent_bits, pool)
    mover = PageMover(table, store, lut_reserve_pages=lut_reserve_pages, pace=pace)
    return Rig(pool, table, mover, store, tmp)


def drive(mover: PageMover, targets: dict[int, int], step: Callable[[], None] | None = None,
          until: Callable[[], bool] | None = None, timeout_s: float = 120.0) -> int:
    """Run steps (boundary, optional work, end_step), re-requesting moves the pool refused, until every target is
    committed and every retired page freed (or `until()` holds). Returns the number of steps.

    Raises at once when no move is pending or retiring and the pool still refuses the rest: nothing can change
    any more (the free pages are too fragmented for the runs the remaining moves need)."""
    rows = mover.table.rows
    deadline, n = time.perf_counter() + timeout_s, 0
    while time.perf_counter() < deadline:
        for i, b in targets.items():
            if rows[i].q != b and not mover.pending(i):
                mover.request(i, b)
        if mover.idle() and any(rows[i].q != b for i, b in targets.items()):
            left = sum(rows[i].q != b for i, b in targets.items())
            raise RuntimeError(f"{left} moves refused with nothing in flight ({mover.pool.free_pages} free pages, "
                               f"reserve {mover.pool.reserve_pages}): pool too small or too fragmented")
        mover.boundary()
        if until() if until is not None else (mover.idle() and all(rows[i].q == b for i, b in targets.items())):
            return n
        if step is not None:
            step()
        mover.end_step()
        n += 1
    raise RuntimeError(f"moves did not finish in {timeout_s} s")


class KVPages:
    """Raw pool KV blocks with a known byte value each, following relocations (the pool's KV listener)."""

    def __init__(self, pool: PagePool) -> None:
        self.pool, self.value = pool, {}
        pool.add_kv_listener(self.moved)

    def moved(self, moves: dict[int, int]) -> None:
        vals = {new: self.value.pop(old) for old, new in moves.items()}
        self.value.update(vals)

    def write(self, blocks: list[int], value: int) -> None:
        self.pool.kv_blocks_view().index_fill_(0, torch.tensor(blocks, dtype=torch.long, device=self.pool.device),
                                               value)
        self.value.update(dict.fromkeys(blocks, value))

    def free(self, blocks: list[int]) -> None:
        self.pool.free_kv_blocks(blocks)
        for b in blocks:
            del self.value[b]

    def check(self) -> None:
        """First and last byte of every page still hold its value (a relocation copies whole pages)."""
        pages = torch.tensor(sorted(self.value), dtype=torch.long, device=self.pool.device)
        want = torch.tensor([self.value[b] for b in sorted(self.value)], dtype=torch.uint8, device=self.pool.device)
        rows = self.pool.kv_blocks_view()
        for col in (0, -1):
            assert torch.equal(rows[:, col][pages], want), "a KV page lost its bytes"


def _reserved() -> int:
    return torch.cuda.max_memory_reserved() if torch.cuda.is_available() else 0


def run_exchange(device: str, budget: int, page_bytes: int, layers: int, experts: int, hidden: int, inter: int,
                 parent_bits: int, seed_bits: int, offload_frac: float = 0.5,
                 on_row: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Load all blocks at P, fill KV, offload a fraction to the seed width, refill KV, reload: one row per phase.

    `on_row(rows)` runs after each row is added (before its checks), so a caller can save partial results.
    """
    t0 = time.perf_counter()
    rig = make_rig(device, budget, page_bytes, layers, experts, hidden, inter, parent_bits, seed_bits,
                   reserve_seed_luts=True)
    setup_ms = (time.perf_counter() - t0) * 1e3
    pool, table, mover = rig.pool, rig.table, rig.mover
    n = len(table.rows)
    rows: list[dict] = []

    def add(r: dict) -> dict:
        rows.append(r)
        if on_row is not None:
            on_row(rows)
        return r

    try:
        t = time.perf_counter()
        drive(mover, {i: parent_bits for i in range(n)})
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        load_ms = (time.perf_counter() - t) * 1e3
        kv = KVPages(pool)
        kv.write(pool.alloc_kv_blocks(pool.kv_capacity()), 1)  # KV writes: the blocks are real memory
        reserved0 = _reserved()

        def row(phase: str, freed: int, expected: int, got: int, ms: float) -> dict:
            return {"phase": phase, "weight_bytes": pool.bytes_of(pool.weight_pages), "kv_blocks": len(kv.value),
                    "kv_block_bytes": pool.kv_block_bytes, "freed_bytes": freed, "expected_new_kv_blocks": expected,
                    "new_kv_blocks": got, "max_reserved_gib": _reserved() / GIB,
                    "reserved_growth_bytes": _reserved() - reserved0, "reserve_pages": pool.reserve_pages, "ms": ms}

        add(dict(row("loaded", 0, 0, 0, load_ms), setup_ms=setup_ms))
        chosen = sorted(random.Random(0).sample(range(n), max(1, int(n * offload_frac))))  # gate_up and down
        w0 = pool.weight_pages
        t = time.perf_counter()
        drive(mover, {i: seed_bits for i in chosen})
        ms = (time.perf_counter() - t) * 1e3
        freed = pool.bytes_of(w0 - pool.weight_pages)
        want = sum(table.memory(i, parent_bits) - table.memory(i, seed_bits) for i in chosen)
        assert freed == want, f"freed {freed} B, M_i^b predicts {want} B"
        expected = freed // pool.kv_block_bytes
        got = pool.kv_capacity()
        new = pool.alloc_kv_blocks(got)  # KV fills the holes the released planes left
        kv.write(new, 2)
        add(row("offload", freed, expected, got, ms))
        assert got == expected and _reserved() == reserved0, rows[-1]

        # give back as many KV blocks as the offload made, spread evenly over all KV pages: enough free pages for
        # the reload, but single pages, so no plane run fits without relocating KV
        every = sorted(kv.value)
        stride = len(every) // len(new)
        assert stride >= 2, "too few KV pages to fragment the pool (raise the budget)"
        kv.free(every[::stride][:len(new)])
        runs = {table.slot_pages(i, "plane", 0) for i in chosen}
        largest_hole = pool.largest_free_run()  # the mover's reserve stays free somewhere
        w1, r0, rp0 = pool.weight_pages, pool.relocations, pool.relocated_pages
        t = time.perf_counter()
        drive(mover, {i: parent_bits for i in chosen})
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t) * 1e3
        taken = pool.bytes_of(pool.weight_pages - w1)
        add(dict(row("reload", -taken, -(taken // pool.kv_block_bytes), -len(new), ms),
                 largest_free_run_pages=largest_hole, plane_run_pages=sorted(runs),
                 relocations=pool.relocations - r0, relocated_bytes=pool.bytes_of(pool.relocated_pages - rp0)))
        assert taken == freed and pool.kv_capacity() == 0 and _reserved() == reserved0, rows[-1]
        assert pool.relocations > r0, "the reload never needed relocation: the pool was not fragmented"
        kv.check()
        table.check()
        for i in chosen[:8]:  # reloaded bytes equal the store's
            for p in range(parent_bits):
                s = table.rows[i].planes[p]
                got_bytes = pool.page_view(s.page, table.rows[i].spec.plane_bytes).cpu()
                assert torch.equal(got_bytes, rig.store.tensor(i, "plane", p)), f"block {i} plane {p} differs"
    finally:
        rig.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="toy sizes (CPU smoke run)")
    ap.add_argument("--budget-gib", type=float, default=8.0)
    ap.add_argument("--page-kib", type=int, default=64, help="page = one KV block")
    ap.add_argument("--layers", type=int, default=4, help="Qwen1.5-MoE layers of experts (0.5 GiB of planes each)")
    args = ap.parse_args(argv)
    if args.tiny:
        shape = dict(layers=2, experts=4, hidden=256, inter=128, parent_bits=4, seed_bits=2)  # planes of 4-8 pages
        budget, page = 1 << 20, 1024
    else:  # Qwen1.5-MoE-A2.7B expert shapes, 4 layers by default (2.0 GiB of planes at 8 bits)
        shape = dict(layers=args.layers, experts=60, hidden=2048, inter=1408, parent_bits=8, seed_bits=3)
        budget, page = int(args.budget_gib * GIB), args.page_kib * 1024
    extra = {"shape": shape, "budget_bytes": budget, "page_bytes": page}

    def save(rows: list[dict], complete: bool = False) -> None:
        """Rewrite the JSON with every row so far: a run cut short still leaves a valid partial result."""
        if rows and not complete:
            print(rows[-1], flush=True)
        path = write_result("budget_exchange", rows, ceilings={}, extra={**extra, "complete": complete})
        if complete:
            print(path)

    save([])
    save(run_exchange(args.device, budget, page, **shape, on_row=save), complete=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
