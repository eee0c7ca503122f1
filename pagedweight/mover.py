"""Asynchronous page mover: moves planes/LUTs between the node page store and the pool under DESIGN.md §3.

Offload b -> b' < b: make LUT_b' resident (a small copy), commit q = b' at a step boundary, then release planes
b'..b-1 and LUT_b once every step launched before that commit has finished (the steps that could still read
them). Reload b -> b' > b: allocate pages, copy the missing planes and LUT_b' on a dedicated copy stream (state
IN_TRANSFER), and commit q = b' at the first step boundary after the copy's fence has completed.

The engine drives it: `boundary()` before launching a step (polls copies, commits, publishes the device tables,
frees retired pages), `end_step()` after the step's kernels are enqueued (records that step's fence). One move per
block at a time; `cancel` it first to retarget. A failed or cancelled copy leaves q_i as it was and gives its
pages back only after the copy has stopped writing them.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
from loguru import logger

from pagedweight.page_store import PageStore
from pagedweight.page_table import PageState, Slot, WeightPageTable
from pagedweight.pool import PoolExhausted

SlotKey = tuple[str, int]  # ("plane", p) | ("lut", b)


class Fence(Protocol):
    def done(self) -> bool: ...


class _Done:
    def done(self) -> bool:
        return True


class _EventFence:
    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.event = torch.cuda.Event()
        self.event.record(stream)

    def done(self) -> bool:
        return self.event.query()


class CpuBackend:
    """Synchronous: copies finish when issued, steps when they return."""

    def step_fence(self) -> Fence:
        return _Done()

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Fence:
        for dst, src in pairs:
            dst.copy_(src)
        return _Done()

    def publish(self, table: WeightPageTable) -> None:
        table.publish()


class CudaBackend:
    """Copies on a dedicated stream; fences are CUDA events."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.copy_stream = torch.cuda.Stream(device)

    def step_fence(self) -> Fence:
        return _EventFence(torch.cuda.current_stream())

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Fence:
        # Destination pages may have been freed (KV blocks) while the last launched step still reads them:
        # order the copy after all compute work enqueued so far.
        self.copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.copy_stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            return _EventFence(self.copy_stream)

    def publish(self, table: WeightPageTable) -> None:
        table.publish(torch.cuda.current_stream())


@dataclass
class Move:
    target: int
    fresh: list[SlotKey]  # slots this move allocated and copies in
    reused: list[SlotKey]  # slots that were retiring and this move keeps
    fence: Fence | None  # copy fence; None when nothing was copied
    cancelled: bool = False
    failed: bool = False  # the copy could not be issued


@dataclass
class MoverStats:
    committed: int = 0
    failed: int = 0
    cancelled: int = 0
    bytes_copied: int = 0
    bytes_freed: int = 0


@dataclass
class PageMover:
    table: WeightPageTable
    store: PageStore
    backend: CpuBackend | CudaBackend | object = None
    fault_hook: Callable[[int, int], bool] | None = None  # (block, target) -> True: treat that copy as failed
    lut_reserve_pages: int | None = None
    stats: MoverStats = field(default_factory=MoverStats)

    def __post_init__(self) -> None:
        if self.backend is None:
            self.backend = CudaBackend(self.table.pool.device) if self.table.pool.device.type == "cuda" else CpuBackend()
        self.pool = self.table.pool
        self._moves: dict[int, Move] = {}
        self._retiring: dict[tuple[int, str, int], int] = {}  # slot -> step id that must finish before freeing
        self._inflight: deque[tuple[int, Fence]] = deque()
        self.launched = 0  # steps launched so far; step ids are 0..launched-1
        self.completed = -1  # every step with id <= completed has finished
        # Pages only offload LUT copies may use, so an offload can start even when KV filled the pool: at least
        # the largest LUT; more lets many offloads start in the same step (faster pressure relief).
        lut_pages = max(self.table.slot_pages(i, "lut", b) for i, r in enumerate(self.table.rows) for b in r.luts)
        reserve = max(lut_pages, self.lut_reserve_pages or 0)
        if self.pool.reserve_pages < reserve:
            self.pool.set_reserve(reserve)

    # ---- planner side ----
    def pending(self, i: int) -> bool:
        return i in self._moves

    def idle(self) -> bool:
        return not self._moves and not self._retiring

    def request(self, i: int, b: int) -> bool:
        """Set d_i = b and start the move; False (nothing changed) when busy or out of pages."""
        row = self.table.rows[i]
        if b not in row.luts:
            raise ValueError(f"block {i}: width {b} not in {sorted(row.luts)}")
        if i in self._moves:
            return self._moves[i].target == b and not self._moves[i].cancelled
        if b == row.q:
            row.d = b
            return True
        needed = [("plane", p) for p in range(b)] + [("lut", b)]
        fresh, reused = [], []
        for key in needed:
            s = self.table.slot(i, *key)
            if s.state is PageState.IN_TRANSFER:
                return False  # a cancelled copy still writes it
            if s.state is PageState.CPU:
                fresh.append(key)
            elif (i, *key) in self._retiring:
                reused.append(key)
        # The pool's reserve is for LUT overlap only: an offload may use it (it ends up freeing pages); a reload only
        # if its footprint after commit (old LUT freed) fits outside the reserve, so the reserve always comes back.
        if b > row.q:
            grow = sum(self.table.slot_pages(i, *k) for k in fresh) - (self.table.slot_pages(i, "lut", row.q)
                                                                       if row.q else 0)
            if grow > self.pool.free_pages - self.pool.reserve_pages:
                return False
        try:
            for n, key in enumerate(fresh):
                s = self.table.slot(i, *key)
                s.page = self.pool.alloc_run(self.table.slot_pages(i, *key), use_reserve=True)
                s.state = PageState.IN_TRANSFER
        except PoolExhausted:
            for key in fresh[:n]:
                self._free_slot(i, key, count=False)
            return False
        for key in reused:
            del self._retiring[(i, *key)]
        move = Move(b, fresh, reused, None)
        if fresh:
            pairs = [(self.pool.page_view(self.table.slot(i, *k).page, self._nbytes(i, k)), self.store.tensor(i, *k))
                     for k in fresh]
            try:
                move.fence = self.backend.copy(pairs)
                self.stats.bytes_copied += sum(self._nbytes(i, k) for k in fresh)
            except Exception:  # some copies may be enqueued: free only after the copy stream passes this point
                logger.exception("issuing the page copy for block {} failed", i)
                move.failed, move.fence = True, self.backend.copy([])
        self._moves[i] = move
        row.d = b
        return True

    def cancel(self, i: int) -> None:
        """Drop the pending move of block i (d_i returns to q_i); pages come back once no copy writes them."""
        row = self.table.rows[i]
        row.d = row.q
        move = self._moves.get(i)
        if move is None or move.cancelled:
            return
        move.cancelled = True
        self.stats.cancelled += 1
        for key in move.reused:
            self._retire(i, key)
        move.reused = []
        if move.fence is None or move.fence.done():
            self._drop_fresh(i, move)

    # ---- engine side ----
    def boundary(self) -> None:
        """Step boundary: finish copies, commit ready moves, publish the device tables, free retired pages."""
        while self._inflight and self._inflight[0][1].done():
            self.completed = self._inflight.popleft()[0]
        for i, move in list(self._moves.items()):
            if move.fence is not None and not move.fence.done():
                continue
            if move.cancelled:
                self._drop_fresh(i, move)
                continue
            if move.failed or (move.fence is not None and self.fault_hook is not None
                               and self.fault_hook(i, move.target)):
                self._fail(i, move)
                continue
            for key in move.fresh:
                self.table.slot(i, *key).state = PageState.GPU
            move.fence = None
            self._commit(i, move)
        self.backend.publish(self.table)
        for key, after in list(self._retiring.items()):
            if after <= self.completed:
                del self._retiring[key]
                self._free_slot(key[0], key[1:])

    def end_step(self) -> None:
        """Call after enqueuing a step's kernels: its fence guards every page it may read."""
        self._inflight.append((self.launched, self.backend.step_fence()))
        self.launched += 1

    # ---- internals ----
    def _nbytes(self, i: int, key: SlotKey) -> int:
        spec = self.table.rows[i].spec
        return spec.plane_bytes if key[0] == "plane" else spec.lut_bytes[key[1]]

    def _commit(self, i: int, move: Move) -> None:
        row = self.table.rows[i]
        old = row.q
        self.table.commit(i, move.target)
        del self._moves[i]
        self.stats.committed += 1
        if old:
            self._retire(i, ("lut", old))
        for p in range(move.target, old):
            self._retire(i, ("plane", p))

    def _retire(self, i: int, key: SlotKey) -> None:
        """Free after every step launched so far has finished: those are the steps that may read it."""
        self._retiring[(i, *key)] = self.launched - 1

    def _drop_fresh(self, i: int, move: Move) -> None:
        """Free the slots a cancelled/failed move copied: never committed, so no step can read them."""
        for key in move.fresh:
            self._free_slot(i, key)
        del self._moves[i]

    def _fail(self, i: int, move: Move) -> None:
        logger.warning("page copy for block {} -> {} bits failed; q stays {}", i, move.target, self.table.rows[i].q)
        self.stats.failed += 1
        row = self.table.rows[i]
        row.d = row.q
        for key in move.reused:
            self._retire(i, key)
        self._drop_fresh(i, move)

    def _free_slot(self, i: int, key: SlotKey, count: bool = True) -> None:
        s: Slot = self.table.slot(i, *key)
        pages = self.pool.free_run(s.page)
        if count:
            self.stats.bytes_freed += self.pool.bytes_of(pages)
        s.page, s.state = -1, PageState.CPU
