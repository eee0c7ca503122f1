"""Asynchronous page mover: moves planes/LUTs between the node page store and the pool under DESIGN.md §3.

Offload b -> b' < b: make LUT_b' resident (a small copy), commit q = b' at a step boundary, then release planes
b'..b-1 and LUT_b once every step launched before that commit has finished (the steps that could still read
them). Reload b -> b' > b: allocate pages, copy the missing planes and LUT_b' on a dedicated copy stream (state
IN_TRANSFER), and commit q = b' at the first step boundary after the copy's fence has completed.

The engine drives it: `request`/`cancel` and `boundary()` at the step boundary, before launching a step
(`boundary` issues paced copies, polls copies, commits, publishes the device tables, frees retired pages),
`end_step()` after the step's kernels are enqueued (records that step's fence). One move per block at a time;
`cancel` it first to retarget. A failed or cancelled copy leaves q_i as it was and gives its pages back only after
the copy has stopped writing them.

Pacing (`ReloadPace`): a reload's pages are allocated at once, but its bytes are issued at most `cap()` per step,
so reloads trickle beside decode steps instead of saturating the link and HBM in one burst. Offloads are never
paced (they copy one small LUT and free the pages KV is waiting for), nor is a block's first load (q_i = 0: no
step can run before it). When a reload finds enough free pages but no run long enough (KV blocks in the holes,
or weight runs of other sizes), the pool relocates KV pages and the weight runs this mover vouches for
(`_movable_runs`) out of a window (`PagePool._compact`), which is why `request` must only be called at a step
boundary.
"""
from __future__ import annotations

import time
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


class CudaBackend:
    """Copies on a dedicated stream; fences are CUDA events."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.copy_stream = torch.cuda.Stream(device)

    def step_fence(self) -> Fence:
        return _EventFence(torch.cuda.current_stream())

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Fence:
        # Destination pages may have been freed (KV blocks) while the last launched step still reads them, or just
        # emptied by a KV relocation whose copies are on the compute stream: order the copy after all compute
        # work enqueued so far.
        self.copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.copy_stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            return _EventFence(self.copy_stream)


PINNED_LINK_BYTES_PER_S = 55e9  # pinned host -> device on the H200 (shared/GPU.md)


@dataclass
class ReloadPace:
    """Cap on the reload bytes the mover issues per engine step.

    Why: a reload at full link speed beside memory-bound decode steps slowed them by 6.7% on the H200. Issuing per
    step only what the link moves in `duty` of a step time spreads the same bytes over about 1/duty as many steps,
    with the copy engine busy (and competing for HBM) only that fraction of each step. The step time is measured:
    an exponential average of the wall time between `end_step` calls, so the cap follows the real step length and
    the reload rate stays near duty x link whatever the model.
    """

    bytes_per_step: int | None = None  # a fixed cap; None: link_bytes_per_s * duty * measured step time
    link_bytes_per_s: float = PINNED_LINK_BYTES_PER_S
    # share of a step time the link may spend on reloads. Measured on the H200 beside a memory-bound decode loop
    # (page_mover-nvidia-h200-20261129*.json): unpaced 5.3-7.6 % slowdown, duty 0.5 7.9-9.8 % (its per-step copies
    # still spanned the whole step), duty 0.2 2.4-2.8 % at 10.9 GB/s of reloads.
    duty: float = 0.2
    step_s: float = 1e-3  # step time estimate (starting value, then the measured average)
    min_bytes: int = 1 << 20  # derived caps never go below this (per-copy issue cost)

    def __post_init__(self) -> None:
        if self.bytes_per_step is not None and self.bytes_per_step <= 0:
            raise ValueError("bytes_per_step must be positive (None: derive it)")
        if not 0.0 < self.duty <= 1.0 or self.link_bytes_per_s <= 0 or self.step_s <= 0:
            raise ValueError("duty must be in (0, 1]; link_bytes_per_s and step_s positive")

    def cap(self) -> int:
        if self.bytes_per_step is not None:
            return self.bytes_per_step
        return max(self.min_bytes, int(self.link_bytes_per_s * self.duty * self.step_s))

    def observe(self, step_s: float) -> None:
        """One measured step; an idle gap (no request for a while) raises the estimate by at most 1.6x per step."""
        self.step_s = 0.8 * self.step_s + 0.2 * min(step_s, 4 * self.step_s)


@dataclass
class Move:
    target: int
    fresh: list[SlotKey]  # slots this move allocated and copies in
    reused: list[SlotKey]  # slots that were retiring and this move keeps
    todo: deque[list] = field(default_factory=deque)  # [slot key, bytes issued] of fresh slots not fully issued
    paced: bool = False  # a reload under the pace cap
    pages: int = 0  # pool pages of fresh + reused (what the move holds beyond the committed footprint)
    fences: list[Fence] = field(default_factory=list)  # copies issued and not yet seen finished
    copied: bool = False  # some copy was issued
    cancelled: bool = False
    failed: bool = False  # the copy could not be issued

    def copying(self) -> bool:
        """Some issued copy may still write the move's pages (every fence is checked: no stream order assumed)."""
        self.fences = [f for f in self.fences if not f.done()]
        return bool(self.fences)


@dataclass
class MoverStats:
    """`bytes_copied`: bytes of every copy issued (loads, reloads and offloads' LUTs, cancelled ones included).
    `bytes_freed`: pool bytes given back that a committed width held (what commits retired: planes and LUTs a drop
    gives up, the old LUT a raise replaces), not the pages of a cancelled or failed move."""

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
    pace: ReloadPace | None = field(default_factory=ReloadPace)  # None: reloads issue everything at once
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
        self.step_reload_bytes = 0  # paced reload bytes issued in this step (renewed by end_step or an idle boundary)
        self._backlog: dict[int, None] = {}  # blocks whose paced reload has pieces not yet issued (insertion order)
        self._last_end: float | None = None
        self._launched_at_boundary = 0  # `launched` at the previous boundary
        # Pages only offload LUT copies may use, so an offload can start even when KV filled the pool: at least
        # the largest LUT; more lets many offloads start in the same step (faster pressure relief).
        lut_pages = max(self.table.slot_pages(i, "lut", b) for i, r in enumerate(self.table.rows) for b in r.luts)
        reserve = max(lut_pages, self.lut_reserve_pages or 0)
        if self.pool.reserve_pages < reserve:
            self.pool.set_reserve(reserve)
        self.pool.set_weight_guard(self._movable_runs)

    # ---- planner side ----
    def pending(self, i: int) -> bool:
        return i in self._moves

    def idle(self) -> bool:
        return not self._moves and not self._retiring

    def transit_bytes(self) -> int:
        """Pool bytes held beyond every block's committed footprint M_i^{q_i}: the slots of moves under way (a
        reload's copies and the retired slots it keeps, an offload's new LUT), of cancelled or failed copies still
        running, and retired slots waiting for the steps that read them. Each either comes back to the pool or
        becomes part of the block's new footprint, so the planner counts them with the pending moves, not as
        taken (a reload's pages are allocated when it starts, before its commit)."""
        pages = sum(m.pages for m in self._moves.values()) + sum(self.table.slot_pages(*k) for k in self._retiring)
        return self.pool.bytes_of(pages)

    def in_flight_pages(self) -> int:
        """Pool pages whose copy is under way (IN_TRANSFER): only moves' fresh slots are, until the move ends."""
        return sum(self.table.slot_pages(i, *key) for i, move in self._moves.items() for key in move.fresh
                   if self.table.slot(i, *key).state is PageState.IN_TRANSFER)

    def request(self, i: int, b: int, keep_free_pages: int = 0, relocate: bool = True) -> bool:
        """Set d_i = b and start the move; False when busy or out of pages (q, d and weight pages unchanged).

        A reload takes its pages at once and holds the old LUT until its commit; with `keep_free_pages` > 0 it is
        refused unless that peak leaves this many pages free outside the reserve (the engine keeps the KV blocks
        that admitted requests still need). Call only at a step boundary: allocating a reload's runs may relocate
        KV pages (see PagePool._compact); with `relocate` False a run that fits no free extent as it lies refuses
        the move instead (a compaction scans the pool: the engine rations them while requests run).
        """
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
            peak = sum(self.table.slot_pages(i, *k) for k in fresh)
            grow = peak - (self.table.slot_pages(i, "lut", row.q) if row.q else 0)
            room = self.pool.free_pages + self.pool.reclaimable_pages - self.pool.reserve_pages
            if grow > room or (keep_free_pages > 0 and peak > room - keep_free_pages):
                return False
            # `room` counted the reclaimable KV pages: reclaim what the footprint after commit needs beyond the free
            # pages outside the reserve now. `alloc_run(use_reserve=True)` reclaims only once every free page, the
            # reserve's included, is taken, so the reload would keep reserve pages for good while kept KV blocks
            # (counted as its room) stayed: the reserve would not come back, and once requests hold those blocks
            # again no offload could copy its LUT.
            self.pool.reclaim(grow - (self.pool.free_pages - self.pool.reserve_pages))
        try:
            for n, key in enumerate(fresh):
                s = self.table.slot(i, *key)
                s.page = self.pool.alloc_run(self.table.slot_pages(i, *key), use_reserve=True, relocate=relocate)
                s.state = PageState.IN_TRANSFER
        except PoolExhausted:
            for key in fresh[:n]:
                self._free_slot(i, key, count=False)
            return False
        for key in reused:
            del self._retiring[(i, *key)]
        move = Move(b, fresh, reused, deque([k, 0] for k in fresh), paced=self.pace is not None and 0 < row.q < b,
                    pages=sum(self.table.slot_pages(i, *k) for k in fresh + reused))
        self._moves[i] = move
        row.d = b
        if move.paced and move.todo and self._backlog:  # older reloads have pieces to issue: `boundary` issues
            self._backlog[i] = None  # oldest first (the engine requests before its boundary: issued here, it took
            # their step's cap)
        else:
            self._issue(i, move)
        return True

    def cancel(self, i: int) -> None:
        """Drop the pending move of block i (d_i returns to q_i); pages come back once no copy writes them."""
        row = self.table.rows[i]
        row.d = row.q
        move = self._moves.get(i)
        if move is None or move.cancelled:
            return
        move.cancelled = True
        move.todo.clear()  # pieces never issued are never written
        self._backlog.pop(i, None)
        self.stats.cancelled += 1
        for key in move.reused:
            self._retire(i, key)
            move.pages -= self.table.slot_pages(i, *key)
        move.reused = []
        if not move.copying():
            self._drop_fresh(i, move)

    # ---- engine side ----
    def boundary(self) -> None:
        """Step boundary: issue this step's paced bytes, finish copies, commit ready moves, publish the device
        tables, free retired pages. The pace budget renews at `end_step`, or here when no step was launched since
        the previous boundary: an engine with nothing to run still steps its boundary, and reloads must go on. (The
        engine's second boundary after a wait for KV also renews it; the copies of the first were finished by that
        wait, so still at most one cap of reload bytes overlaps the next step.)"""
        if self.launched == self._launched_at_boundary:
            self.step_reload_bytes = 0  # no step since the last boundary (an idle engine step): a new step's budget
        self._launched_at_boundary = self.launched
        self._poll_steps()
        for i, move in list(self._moves.items()):  # oldest first: a started reload finishes before the next
            if move.todo:
                self._issue(i, move)
        for i, move in list(self._moves.items()):
            if move.todo or move.copying():
                continue
            if move.cancelled:
                self._drop_fresh(i, move)
                continue
            if move.failed or (move.copied and self.fault_hook is not None and self.fault_hook(i, move.target)):
                self._fail(i, move)
                continue
            for key in move.fresh:
                self.table.slot(i, *key).state = PageState.GPU
            self._commit(i, move)
        self.table.publish()
        for key, after in list(self._retiring.items()):
            if after <= self.completed:
                del self._retiring[key]
                self._free_slot(key[0], key[1:])

    def end_step(self) -> None:
        """Call after enqueuing a step's kernels: its fence guards every page it may read."""
        self._inflight.append((self.launched, self.backend.step_fence()))
        self.launched += 1
        now = time.perf_counter()
        if self.pace is not None and self.pace.bytes_per_step is None and self._last_end is not None:
            self.pace.observe(now - self._last_end)
        self._last_end = now
        self.step_reload_bytes = 0

    def pace_cap(self) -> int | None:
        """Reload bytes this mover may issue per step now (None: unpaced)."""
        return None if self.pace is None else self.pace.cap()

    # ---- internals ----
    def _poll_steps(self) -> int:
        """Advance `completed` past every launched step whose fence is done; returns how many are still running."""
        while self._inflight and self._inflight[0][1].done():
            self.completed = self._inflight.popleft()[0]
        return len(self._inflight)

    def _movable_runs(self) -> set[int]:
        """Starts of the weight runs the pool may relocate now (its guard; called only from `alloc_run` inside
        `request`, at a step boundary).

        A run may move when its slot is complete in the pool (GPU: no copy writes it), it is not retiring (a step
        launched before an offload's commit may still read it; it is about to be freed anyway), and its block has no
        move pending (a cancelled or failed move's pages, or slots a reload reuses, stay put until it resolves). On
        top, every launched step must have finished (its fence polled here): then no kernel reads a run's old pages
        at all, and the copy, the republished device tables (both on the compute stream) and every later write into
        the old pages (KV in later steps, reloads whose copy stream waits for the compute stream) follow in stream
        order. An engine steps its boundary after the previous step's tokens reached the host, so this rarely
        refuses; when it does, the reload is refused this step and requested again at the next.
        """
        if self._poll_steps():
            return set()
        gpu, retiring = PageState.GPU, self._retiring
        return {s.page for i in range(len(self.table.rows)) if i not in self._moves
                for what, idx, s in self.table.slots(i) if s.state is gpu and (i, what, idx) not in retiring}

    def _issue(self, i: int, move: Move) -> None:
        """Issue the move's remaining copies: all of them, or for a paced reload what the step's cap leaves (a
        plane may be split across steps). The move keeps every piece's fence and commits when all are done."""
        pairs, nbytes = [], 0
        while move.todo:
            key, done = move.todo[0]
            size = self._nbytes(i, key)
            n = size - done
            if move.paced:
                n = min(n, self.pace.cap() - self.step_reload_bytes)
                if n <= 0:
                    break
                self.step_reload_bytes += n
            dst = self.pool.page_view(self.table.slot(i, *key).page, size)
            pairs.append((dst[done:done + n], self.store.tensor(i, *key)[done:done + n]))
            nbytes += n
            if done + n == size:
                move.todo.popleft()
            else:
                move.todo[0][1] = done + n
        if move.paced:
            if move.todo:
                self._backlog[i] = None
            else:
                self._backlog.pop(i, None)
        if not pairs:
            return
        try:
            move.fences.append(self.backend.copy(pairs))
            move.copied = True
            self.stats.bytes_copied += nbytes
        except Exception:  # some copies may be enqueued: free only after the copy stream passes this point
            logger.exception("issuing the page copy for block {} failed", i)
            move.failed = True
            move.fences.append(self.backend.copy([]))
            move.todo.clear()
            self._backlog.pop(i, None)

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
        """Free the slots a cancelled/failed move copied: never committed, so no step can read them. Not counted in
        `bytes_freed`: they only undo the move's own allocation (as a refused request's rollback does); no committed
        width gave them up."""
        for key in move.fresh:
            self._free_slot(i, key, count=False)
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
