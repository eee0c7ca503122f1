"""One GPU memory budget: a preallocated byte pool cut in fixed pages, shared by weight pages and KV blocks.

Why one pool (DESIGN.md §4): a byte freed from weights must be a byte the KV cache can use for real. The pool
is allocated once, so `torch.cuda.max_memory_reserved` cannot grow when weights and KV trade pages, and kernels
address weights by offsets into the pool (device tables), which keeps captured CUDA graphs valid.

Layout: weight runs (planes, LUTs) are taken best-fit (lowest first) from the low end, KV blocks from the high end,
so the two kinds meet in the middle and small LUT runs do not split the large holes a reload needs. Accounting is
in whole pages: bytes = pages x page_bytes.

Fragmentation: after offloads, KV blocks land in the holes the planes left, so a later reload may find enough free
pages but no run long enough. Then `alloc_run(..., relocate=True)` compacts: it picks the window of the run's
length that holds no weight page and the fewest KV pages, copies those KV pages to free pages outside it and tells
the KV holders their new places (`add_kv_listener`). Kernels are untouched: weights stay contiguous runs.
When weight runs themselves fragment the free pages (planes and LUTs are runs of many sizes), no window is free of
weight pages; then the window may also hold weight runs that their owner vouches are movable (`set_weight_guard`):
each moves whole to a free extent outside the window and the owner follows it (`add_weight_listener`).
"""
from __future__ import annotations

import bisect
import os
import re
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

PAGE_ALIGN = 256  # page sizes are multiples of this, so every page starts word- and half-aligned
FREE, WEIGHT, KV = 0, 1, 2  # what a page holds (PagePool._kind)
RELOCATION_TRIES = 64  # windows with weight runs tried per compaction (fewest used pages first): bounds host time


# torch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp): a request of at least SEGMENT_OWN_MIN bytes
# gets a segment of its own, rounded up to SEGMENT_ROUND; smaller ones share 2 MiB or 20 MiB segments
SEGMENT_ROUND = 2 << 20
SEGMENT_OWN_MIN = 10 << 20


def own_segment_bytes(n: int) -> int:
    """The request for n bytes (or a little more) that reserves exactly what it asks for on CUDA: a segment of its
    own, no shared remainder that the budget would not count (the bundled model's 4.7 MiB of packed weights sat in a
    20 MiB segment, 15 MiB reserved and counted nowhere)."""
    return -(-max(n, SEGMENT_OWN_MIN) // SEGMENT_ROUND) * SEGMENT_ROUND


class PoolExhausted(RuntimeError):
    """No room for the requested pages within the budget (or no contiguous run long enough)."""


@dataclass
class Allocation:
    start: int  # first page (-1 for KV blocks: they share one Allocation and their key in _allocs is their start)
    npages: int
    tag: str  # "weight" | "kv"


def release_cached(device: torch.device) -> None:
    """Give the caching allocator's free segments back to the device, and cuBLAS's workspaces first: torch keeps one
    (32 MiB on the H200) per handle and stream for the life of the process, allocated through the caching allocator
    by the first GEMM on that stream (a decode graph's capture stream allocates its own in the graph's pool). Without
    this, whatever ran GEMMs earlier in the process (an engine built before, a warm-up) hides them from a profile
    that measures the allocator's growth, and the engine built after it runs over its budget by them: in
    memory_gap-nvidia-h200-20261201-memgap-*-auto3.json the second engine of each process started with 68 MiB
    reserved that no allocation of its own made (four cuBLAS workspace blocks of the first engine's GEMMs, two on
    the default stream and two in its graph pool). Caveat: a CUDA graph captured earlier keeps its workspace's
    address, and the freed block goes back to that graph's pool, where a later capture into the same pool may place
    a tensor on it; so build an "auto" engine before, not beside, a live engine that has captured graphs in the same
    process (the serving entry points build one engine per process)."""
    torch._C._cuda_clearCublasWorkspaces()  # torch's own use: cudagraph_trees.clear_cublass_cache
    torch.cuda.empty_cache()


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_budget(text: str, flag: str = "--gpu-memory-budget", allow_zero: bool = False) -> int | float:
    """'2GiB', '512MB', '1000000' -> bytes; '0.5' -> fraction of the device's memory. Refused here, before any
    conversion or cluster start-up: 0 bytes (unless `allow_zero`, as a reserve may be) and fractions outside (0, 1]."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{flag} {text!r}: use bytes with an optional unit (512MiB, 2GB) "
                         "or a fraction in (0, 1]")
    value, unit = float(m.group(1)), m.group(2).lower()
    if not unit and "." in m.group(1):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"{flag} {text!r}: a fraction of the device's memory must be in (0, 1]")
        return value
    if int(value * _UNITS[unit]) <= 0 and not allow_zero:
        raise ValueError(f"{flag} {text!r}: must be positive")
    return int(value * _UNITS[unit])


def resolve_budget(gpu_memory_budget: int | float, device: torch.device | str) -> int:
    """Budget in bytes: an int is bytes; a float in (0, 1] is a fraction of the device's total memory."""
    if isinstance(gpu_memory_budget, float):
        if not 0.0 < gpu_memory_budget <= 1.0:
            raise ValueError(f"fractional budget must be in (0, 1], got {gpu_memory_budget}")
        device = torch.device(device)
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
        else:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return int(total * gpu_memory_budget)
    if gpu_memory_budget <= 0:
        raise ValueError("budget must be positive")
    return int(gpu_memory_budget)


@dataclass
class PagePool:
    """Fixed-page byte pool; `capacity_pages` are allocated once, `budget_pages` of them may be in use."""

    gpu_memory_budget: int | float
    page_bytes: int
    kv_block_bytes: int | None = None  # default: one page per KV block
    device: torch.device | str = "cpu"
    data: torch.Tensor = field(init=False, repr=False)
    _free_starts: list[int] = field(init=False, repr=False)  # sorted starts of free extents
    _free_len: dict[int, int] = field(init=False, repr=False)  # start -> length of free extent
    # the same extents by length, for best fit in O(log n): offloads and reloads allocate one run each, and a scan of
    # every extent (2,129 holes after a batch) took ~0.17 ms per allocation on CPU (release_burst-cpu-2c-*.json)
    _by_len: dict[int, list[int]] = field(init=False, repr=False)  # length -> sorted starts of extents that long
    _lengths: list[int] = field(init=False, repr=False)  # sorted keys of _by_len
    _allocs: dict[int, Allocation] = field(init=False, repr=False)
    _kind: np.ndarray = field(init=False, repr=False)  # int8 [capacity_pages]: FREE | WEIGHT | KV
    _kv_listeners: list[Callable[[dict[int, int]], None]] = field(init=False, repr=False)
    _weight_listeners: list[Callable[[dict[int, int]], None]] = field(init=False, repr=False)
    _weight_guard: Callable[[], set[int]] | None = field(init=False, repr=False)
    _reclaimer: tuple[Callable[[], int], Callable[[int], None]] | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.page_bytes <= 0 or self.page_bytes % PAGE_ALIGN:
            raise ValueError(f"page_bytes must be a positive multiple of {PAGE_ALIGN}")
        self.device = torch.device(self.device)
        budget = resolve_budget(self.gpu_memory_budget, self.device)
        self.capacity_pages = budget // self.page_bytes
        if self.capacity_pages == 0:
            raise ValueError("budget smaller than one page")
        self.budget_pages = self.capacity_pages
        self.kv_block_bytes = self.kv_block_bytes or self.page_bytes
        self.pages_per_kv = -(-self.kv_block_bytes // self.page_bytes)
        # every KV block's entry: one object per page cost ~0.14 us, 0.44 ms of a 2,048-token request's allocation
        self._kv_alloc = Allocation(-1, self.pages_per_kv, "kv")
        self.reserve_pages = 0  # held back from KV and ordinary weight runs (see alloc_run)
        self.data = torch.empty(self.capacity_pages * self.page_bytes, dtype=torch.uint8, device=self.device)
        self._free_starts = [0]
        self._free_len = {0: self.capacity_pages}
        self._by_len, self._lengths = {self.capacity_pages: [0]}, [self.capacity_pages]
        self._allocs = {}
        self._kind = np.zeros(self.capacity_pages, dtype=np.int8)
        self._kv_listeners = []
        self._weight_listeners = []
        self._weight_guard = None
        self._reclaimer = None
        self.weight_pages = 0
        self.kv_pages = 0
        self.relocations = 0  # compactions done (one per weight run that needed one)
        self.relocated_pages = 0  # KV pages copied by them
        self.relocated_weight_runs = 0  # weight runs moved by them
        self.relocated_weight_pages = 0  # pages of those runs

    # ---- views the kernels and the KV cache read ----
    @property
    def words(self) -> torch.Tensor:
        """The pool as uint32 words (plane_off is in these units)."""
        return self.data.view(torch.uint32)

    @property
    def halves(self) -> torch.Tensor:
        """The pool as float16 halves (lut_off is in these units)."""
        return self.data.view(torch.float16)

    def page_view(self, start: int, nbytes: int) -> torch.Tensor:
        """uint8 view of `nbytes` from page `start`."""
        off = start * self.page_bytes
        return self.data[off:off + nbytes]

    def kv_block_view(self, block: int) -> torch.Tensor:
        """uint8 view of KV block `block` (a pool KV block id is its first page; relocation changes it)."""
        a = self._allocs.get(block)
        if a is None or a.tag != "kv":
            raise KeyError(f"page {block} is not a KV block")
        return self.page_view(block, self.kv_block_bytes)

    def kv_blocks_view(self) -> torch.Tensor:
        """The whole pool as [capacity_pages, page_bytes]; with one page per KV block, row id = KV block id."""
        return self.data.view(self.capacity_pages, self.page_bytes)

    # ---- accounting ----
    @property
    def used_pages(self) -> int:
        return self.weight_pages + self.kv_pages

    @property
    def free_pages(self) -> int:
        """Pages that may still be allocated within the budget (reserve included)."""
        return self.budget_pages - self.used_pages

    @property
    def reclaimable_pages(self) -> int:
        """KV pages that hold no request's tokens (kept prefix blocks) and go back on demand (`set_kv_reclaimer`)."""
        return self._reclaimer[0]() if self._reclaimer is not None else 0

    def set_kv_reclaimer(self, pages: Callable[[], int], reclaim: Callable[[int], None]) -> None:
        """`pages()` -> KV pages its owner frees on demand; `reclaim(n)` frees at least n of them (fewer if it has
        fewer). A weight run short of free pages has them reclaimed first: such pages count as free for weights."""
        self._reclaimer = (pages, reclaim)

    def reclaim(self, npages: int) -> None:
        """Have the KV owner free at least `npages` reclaimable pages (fewer if it holds fewer; none without one)."""
        if npages > 0 and self._reclaimer is not None and self._reclaimer[0]() > 0:
            self._reclaimer[1](min(npages, self._reclaimer[0]()))

    def bytes_of(self, npages: int) -> int:
        return npages * self.page_bytes

    def pages_for(self, nbytes: int) -> int:
        return -(-nbytes // self.page_bytes)

    def set_budget(self, nbytes: int) -> None:
        """Change the budget at runtime; it can never drop below what is in use nor exceed the allocation."""
        pages = nbytes // self.page_bytes
        if pages > self.capacity_pages:
            raise ValueError(f"budget {nbytes} B exceeds the preallocated pool ({self.bytes_of(self.capacity_pages)} B)")
        if pages < self.used_pages + self.reserve_pages:
            raise PoolExhausted(f"budget {nbytes} B is below the bytes in use; offload first")
        self.budget_pages = pages

    def set_reserve(self, pages: int) -> None:
        """Pages kept back for the small LUT copies an offload needs, so pressure can never deadlock the pool."""
        if self.used_pages + pages > self.budget_pages:
            raise PoolExhausted("reserve does not fit in the free pages")
        self.reserve_pages = pages

    def largest_free_run(self) -> int:
        """Pages of the longest free extent (a weight run longer than this needs relocation)."""
        return max(self._free_len.values(), default=0)

    def kv_capacity(self, reclaimed_pages: int = 0) -> int:
        """How many more KV blocks `alloc_kv_blocks` can return now, or once `reclaimed_pages` more are freed (an
        offload may have borrowed the reserve: freed pages refill it first)."""
        room = (self.free_pages + reclaimed_pages - self.reserve_pages) // self.pages_per_kv
        if room <= 0:
            return 0
        if self.pages_per_kv == 1:
            return room
        fit = sum(self._free_len[s] // self.pages_per_kv for s in self._free_starts)
        return min(room, fit)

    # ---- allocation ----
    def alloc_run(self, npages: int, use_reserve: bool = False, relocate: bool = False) -> int:
        """Contiguous weight run of `npages`: the smallest free extent that fits, lowest first; returns its first page.

        Reclaimable KV pages (`set_kv_reclaimer`) are reclaimed first if the free ones are too few. With `relocate`
        and no free extent long enough, KV pages (and weight runs the guard lets move) are moved out of the way
        (`_compact`); the caller vouches that it runs at a step boundary (see `_compact` for why that is enough).
        """
        limit = self.free_pages - (0 if use_reserve else self.reserve_pages)
        if npages > limit and npages <= limit + self.reclaimable_pages:
            self._reclaimer[1](npages - limit)
            limit = self.free_pages - (0 if use_reserve else self.reserve_pages)
        if npages <= 0 or npages > limit:
            raise PoolExhausted(f"{npages} weight pages requested, {max(limit, 0)} available")
        fit = bisect.bisect_left(self._lengths, npages)
        if fit < len(self._lengths):
            s = self._by_len[self._lengths[fit]][0]  # best fit (lowest first among equals) keeps large holes
        elif relocate and self.can_relocate():
            s = self._compact(npages)
        else:
            raise PoolExhausted(f"no contiguous run of {npages} pages (fragmented)")
        self._take(s, npages)
        self._allocs[s] = Allocation(s, npages, "weight")
        self._kind[s:s + npages] = WEIGHT
        self.weight_pages += npages
        return s

    def alloc_kv_blocks(self, n: int) -> list[int]:
        """`n` KV blocks from the high end, all or none; a block id is its first page."""
        if n > self.kv_capacity():
            raise PoolExhausted(f"{n} KV blocks requested, {self.kv_capacity()} available")
        ppk = self.pages_per_kv
        out: list[int] = []
        while len(out) < n:
            for s in reversed(self._free_starts):
                ln = self._free_len[s]
                if ln >= ppk:
                    take = min(ln // ppk, n - len(out)) * ppk
                    first = s + ln - take
                    self._take(first, take)
                    taken = range(first + take - ppk, first - 1, -ppk)
                    self._allocs.update(dict.fromkeys(taken, self._kv_alloc))
                    out += taken
                    self._kind[first:first + take] = KV
                    break
        self.kv_pages += n * ppk
        return out

    def free_kv_blocks(self, blocks: list[int]) -> None:
        """Return KV blocks, all or none. Adjacent blocks go back as one extent: a request's blocks were taken in
        runs, and freeing them a page at a time (24 pages a logical block on Qwen1.5) cost ~27 us of host time per
        logical block in free-list upkeep, 3.6 ms at the end of a 2,048-token request; 5 us and 0.64 ms since
        (prefix_cost-cpu-2c-20261204-s38-{before,after}.json)."""
        for b in blocks:
            a = self._allocs.get(b)
            if a is None or a.tag != "kv":
                raise KeyError(f"page {b} is not a KV block")
        if len(set(blocks)) != len(blocks):
            raise KeyError("a KV block is freed twice in one call")
        ppk = self.pages_per_kv
        for b in blocks:
            del self._allocs[b]
        self.kv_pages -= len(blocks) * ppk
        runs: list[list[int]] = []  # [start, end) of adjacent blocks
        for b in sorted(blocks):
            if runs and runs[-1][1] == b:
                runs[-1][1] = b + ppk
            else:
                runs.append([b, b + ppk])
        for start, end in runs:
            self._kind[start:end] = FREE
            self._give(start, end - start)

    def free_run(self, start: int) -> int:
        """Free the weight run starting at `start`; returns the pages freed."""
        a = self._allocs.get(start)
        if a is None or a.tag != "weight":
            raise KeyError(f"page {start} is not a weight run")
        del self._allocs[start]
        self.weight_pages -= a.npages
        self._kind[a.start:a.start + a.npages] = FREE
        self._give(a.start, a.npages)
        return a.npages

    def allocations(self, tag: str | None = None) -> dict[int, Allocation]:
        return {s: a for s, a in self._allocs.items() if tag is None or a.tag == tag}

    def check(self) -> None:
        """Allocations and free extents tile the pool exactly once; counters match; budget holds."""
        spans = sorted([(s, a.npages) for s, a in self._allocs.items()]
                       + [(s, self._free_len[s]) for s in self._free_starts])
        pos = 0
        for s, n in spans:
            assert s == pos and n > 0, f"pool tiling broken at page {pos} (next span {s}+{n})"
            pos = s + n
        assert pos == self.capacity_pages, "pool tiling does not cover the pool"
        for a, b in zip(self._free_starts, self._free_starts[1:]):
            assert a + self._free_len[a] < b, "adjacent free extents not merged"
        by_len: dict[int, list[int]] = {}
        for a in self._free_starts:
            by_len.setdefault(self._free_len[a], []).append(a)
        assert self._by_len == by_len and self._lengths == sorted(by_len), "length index out of date"
        assert self.weight_pages == sum(a.npages for a in self._allocs.values() if a.tag == "weight")
        assert self.kv_pages == sum(a.npages for a in self._allocs.values() if a.tag == "kv")
        assert self.used_pages <= self.budget_pages <= self.capacity_pages
        kind = np.zeros(self.capacity_pages, dtype=np.int8)
        for s, a in self._allocs.items():
            assert a.start == s or a is self._kv_alloc, f"allocation at page {s} says it starts at {a.start}"
            kind[s:s + a.npages] = WEIGHT if a.tag == "weight" else KV
        assert np.array_equal(kind, self._kind), "page kind map differs from the allocations"

    # ---- relocation (compaction of KV pages and movable weight runs) ----
    def add_kv_listener(self, fn: Callable[[dict[int, int]], None]) -> None:
        """`fn({old KV block id: new id})` runs after every relocation; whoever keeps pool KV block ids registers
        one. Without any listener the pool never relocates KV (nobody could follow the moves)."""
        self._kv_listeners.append(fn)

    def add_weight_listener(self, fn: Callable[[dict[int, int]], None]) -> None:
        """`fn({old weight run start: new start})` runs after weight runs moved (bytes already copied); whoever keeps
        run starts (the page table) registers one."""
        self._weight_listeners.append(fn)

    def set_weight_guard(self, fn: Callable[[], set[int]] | None) -> None:
        """`fn()` -> starts of the weight runs that may move now (the page mover: resident, no copy or step uses
        them). Without a guard (or a weight listener) weight runs never move."""
        self._weight_guard = fn

    def can_relocate(self) -> bool:
        weights = self._weight_guard is not None and bool(self._weight_listeners)
        return self.pages_per_kv == 1 and (bool(self._kv_listeners) or weights)

    def _compact(self, npages: int) -> int:
        """Empty a window of `npages` pages for a weight run by moving what it holds; returns the window's start.

        First choice: the window with no weight page and the fewest KV pages (lowest start on ties, so weights stay
        low). When every window holds weight pages (weight runs of many sizes fragment the free pages), windows
        whose weight runs are all movable (`set_weight_guard`) are tried, fewest used pages first: each such run
        moves whole to the best-fitting free extent outside the window, lowest first. KV pages go to the highest
        free pages outside the window (KV lives high). Every copy is a plain device copy on the current (compute)
        stream; then the listeners learn the new places. Used/free counts do not change.

        Why this is safe at a step boundary (the only place the mover allocates): (1) ordering on the device: the
        copies go on the compute stream, so they run after every step already enqueued has finished reading and
        writing those pages, and before the next step, whose KV indices are built after this returns (the KV cache
        refuses a move while a step's layout is live) and whose weight offsets come from the device tables that the
        page table republishes on the compute stream from its listener, after the copies; the reload copy into the
        emptied window waits for the compute stream before it starts (CudaBackend.copy), so it cannot overwrite the
        pages before they are copied out. (2) the destination pages are free: no weight copy targets them (a
        copy's pages stay allocated until its fence is done) and a step that still reads a freed page is ahead of
        this copy on the same stream. (3) a weight run moves only when the guard vouches for it: complete in the
        pool (no copy writes it), not retiring, no move pending on its block, and (the mover's rule) no launched
        step still in flight, so no kernel can read its old pages even before the stream order is counted.
        """
        if self.pages_per_kv != 1:
            raise PoolExhausted("relocation needs one page per KV block")
        cap = self.capacity_pages
        if npages > cap:
            raise PoolExhausted(f"no window of {npages} pages in a pool of {cap}")
        big = np.iinfo(np.int64).max

        def per_window(mask: np.ndarray) -> np.ndarray:
            c = np.concatenate(([0], np.cumsum(mask, dtype=np.int64)))
            return c[npages:] - c[:-npages]

        w_in, kv_in = per_window(self._kind == WEIGHT), per_window(self._kind == KV)
        if self._kv_listeners:
            start = int(np.argmin(np.where(w_in == 0, kv_in, big)))  # first minimum = lowest start
            if w_in[start] == 0 and self._relocate_window(start, npages, {}, []):
                return start
        guard = self._weight_guard if self._weight_listeners else None
        movable = guard() if guard is not None else set()
        every = self.allocations("weight")
        runs, starts = {s: every[s] for s in movable}, sorted(every)
        if runs:
            pinned = self._kind == WEIGHT
            for s, a in runs.items():
                pinned[s:s + a.npages] = False
            if not self._kv_listeners:
                pinned |= self._kind == KV
            cost = np.where(per_window(pinned) == 0, w_in + kv_in, big)
            for start in np.argsort(cost, kind="stable")[:RELOCATION_TRIES].tolist():
                if cost[start] == big:
                    break
                if self._relocate_window(start, npages, runs, starts):
                    return start
        raise PoolExhausted(f"no window of {npages} pages can be emptied: every one holds weight pages that cannot "
                            f"move now, or the free pages outside it do not fit what it holds")

    def _free_pieces(self, start: int, end: int, descending: bool = False):
        """Free extents outside [start, end), clipped to it, as [first page, length], by ascending (or descending)
        first page; lazy, so a caller that needs only the top few pages does not visit every extent."""
        for s in (reversed(self._free_starts) if descending else self._free_starts):
            e = s + self._free_len[s]
            low, high = (s, min(e, start)), (max(s, end), e)
            for a, b in ((high, low) if descending else (low, high)):
                if b > a:
                    yield [a, b - a]

    def _relocate_window(self, start: int, npages: int, runs: dict[int, Allocation], starts: list[int]) -> bool:
        """Move every weight run meeting [start, start+npages) and every KV page in it to free pages outside; False,
        with nothing changed, if a run is not movable (not in `runs`; `starts`: every weight run's start, sorted) or
        they do not fit outside."""
        end = start + npages
        window = self._kind[start:end]
        owners = {starts[bisect.bisect_right(starts, start + int(p)) - 1] for p in np.flatnonzero(window == WEIGHT)}
        if any(s not in runs for s in owners):
            return False
        weight_moves: dict[int, int] = {}
        if owners:  # weight runs need best-fit extents: every free extent outside the window is a candidate
            pieces = list(self._free_pieces(start, end))
            for s in sorted(owners, key=lambda s: -runs[s].npages):
                n = runs[s].npages
                fit = [p for p in pieces if p[1] >= n]
                if not fit:
                    return False
                piece = min(fit, key=lambda p: (p[1], p[0]))
                weight_moves[s] = piece[0]
                piece[0] += n
                piece[1] -= n
            kv_room = iter(sorted(pieces, reverse=True))
        else:  # KV only (the common case): walk down from the top, only as far as the KV pages need
            kv_room = self._free_pieces(start, end, descending=True)
        src = start + np.flatnonzero(window == KV)
        dst: list[np.ndarray] = []  # the highest free pages left, for KV
        need = len(src)
        for a, n in kv_room:
            if need == 0:
                break
            take = min(n, need)
            dst.append(np.arange(a + n - take, a + n))
            need -= take
        if need:
            return False
        self._move_weight_runs(weight_moves)
        if len(src):
            self._move_kv_pages(src, np.sort(np.concatenate(dst)))
        self.relocations += 1
        return True

    def _move_weight_runs(self, moves: dict[int, int]) -> None:
        """Copy weight runs old start -> new start (free pages, disjoint from every source) and update the maps and
        the weight listeners."""
        if not moves:
            return
        pb = self.page_bytes
        for old, new in moves.items():
            n = self._allocs[old].npages
            self._take(new, n)
            self.data[new * pb:(new + n) * pb].copy_(self.data[old * pb:(old + n) * pb])
            del self._allocs[old]
            self._allocs[new] = Allocation(new, n, "weight")
            self._kind[old:old + n] = FREE
            self._kind[new:new + n] = WEIGHT
            self._give(old, n)
            self.relocated_weight_runs += 1
            self.relocated_weight_pages += n
        for fn in self._weight_listeners:
            fn(dict(moves))

    def _move_kv_pages(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy KV pages src[j] -> dst[j] (disjoint sets, both ascending) and update every map and listener."""
        rows = self.kv_blocks_view()
        # one copy per stretch where both sides are consecutive: no temporary buffer (peak memory stays put)
        breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
        for s_run, d_run in zip(np.split(src, breaks), np.split(dst, breaks)):
            s0, d0, n = int(s_run[0]), int(d_run[0]), len(s_run)
            rows[d0:d0 + n].copy_(rows[s0:s0 + n])
        for run in np.split(dst, np.flatnonzero(np.diff(dst) != 1) + 1):
            self._take(int(run[0]), len(run))
        for old, new in zip(src.tolist(), dst.tolist()):
            del self._allocs[old]
            self._allocs[new] = self._kv_alloc
        for run in np.split(src, np.flatnonzero(np.diff(src) != 1) + 1):  # moved-from pages: one extent a stretch
            self._give(int(run[0]), len(run))
        self._kind[dst] = KV
        self._kind[src] = FREE
        self.relocated_pages += len(src)
        moves = dict(zip(src.tolist(), dst.tolist()))
        for fn in self._kv_listeners:
            fn(moves)

    # ---- free-extent list ----
    def _take(self, start: int, npages: int) -> None:
        """Remove [start, start+npages) from the free extent that contains it."""
        i = bisect.bisect_right(self._free_starts, start) - 1
        s = self._free_starts[i]
        ln = self._free_len.pop(s)
        assert s <= start and start + npages <= s + ln, "taking pages that are not free"
        del self._free_starts[i]
        self._unindex(s, ln)
        if start > s:
            self._insert(s, start - s)
        end, ext_end = start + npages, s + ln
        if ext_end > end:
            self._insert(end, ext_end - end)

    def _give(self, start: int, npages: int) -> None:
        """Return pages to the free list, merging with neighbours."""
        i = bisect.bisect_left(self._free_starts, start)
        if i < len(self._free_starts):
            nxt = self._free_starts[i]
            assert start + npages <= nxt, "double free"
            if start + npages == nxt:
                ln = self._free_len.pop(nxt)
                self._unindex(nxt, ln)
                npages += ln
                del self._free_starts[i]
        if i > 0:
            prv = self._free_starts[i - 1]
            assert prv + self._free_len[prv] <= start, "double free"
            if prv + self._free_len[prv] == start:
                self._unindex(prv, self._free_len[prv])
                self._free_len[prv] += npages
                self._index(prv, self._free_len[prv])
                return
        self._insert(start, npages)

    def _insert(self, start: int, npages: int) -> None:
        bisect.insort(self._free_starts, start)
        self._free_len[start] = npages
        self._index(start, npages)

    def _index(self, start: int, npages: int) -> None:
        starts = self._by_len.get(npages)
        if starts is None:
            self._by_len[npages] = [start]
            bisect.insort(self._lengths, npages)
        else:
            bisect.insort(starts, start)

    def _unindex(self, start: int, npages: int) -> None:
        starts = self._by_len[npages]
        del starts[bisect.bisect_left(starts, start)]
        if not starts:
            del self._by_len[npages]
            del self._lengths[bisect.bisect_left(self._lengths, npages)]
