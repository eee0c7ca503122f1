"""Safety of the page mover (DESIGN.md §3) under random plan/offload/reload/step/cancel/fault/KV/budget sequences.

A deferred backend makes copies and steps asynchronous for real: a copy writes nothing (the destination holds
poison) until the test completes it, and a step stays in flight, holding the word/half offsets its device tables
pointed at, until the test completes it (in launch order, as one CUDA stream would). So a premature commit or a
premature release shows up as wrong bytes.

KV pages get a pattern of their own when allocated (a KV write) and are freed in scattered subsets, so KV lands
in the holes offloads leave and reloads need relocation (KV compaction); the pattern must follow every move.
`spread_weights` scatters weight runs over the whole pool (reloads placed in KV holes, then the KV freed), so the
holes left between weight runs of many sizes are too short for a long run and reloads need weight-run relocation:
the moved runs' old pages are poisoned at once (their worst case of reuse), so a run moved while a step that may
read it is in flight, or a device table left pointing at the old pages, shows up as wrong bytes.
Some KV blocks are kept (prefix blocks nobody holds): the pool reclaims them for reloads short of free pages, and
the rest keep their contents. Reloads run under a pace cap drawn per example (or unpaced): the bytes of paced
copies issued between two `end_step` calls never exceed it, and `settle` proves every paced reload still completes.
"""
from __future__ import annotations

import itertools
import os
import random
import uuid
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedweight.mover import PageMover, ReloadPace
from pagedweight.page_store import PageStore, write_planes_file
from pagedweight.page_table import BlockSpec, PageState, WeightPageTable
from pagedweight.pool import PagePool, PoolExhausted

torch.set_num_threads(1)
L, E, P, S = 2, 3, 4, 2
PAGE = 256
POISON = 0xA5
SPECS = [BlockSpec(plane_bytes=100 + 211 * (i % 5), lut_bytes={b: 2 * (1 << b) * (8 + 4 * (i % 3)) for b in range(S, P + 1)})
         for i in range(L * E * 2)]
RELOCATIONS = [0]  # over every example: fragmentation must actually have forced compactions
RECLAIMS = [0]  # ... and reloads must have reclaimed kept KV blocks
WEIGHT_RELOCATIONS = [0]  # ... and weight-run relocations


def kv_pattern(tag: int) -> torch.Tensor:
    """The bytes a KV write leaves in a page: distinct per tag, never all POISON."""
    return ((torch.arange(PAGE, dtype=torch.int64) * 7 + tag * 13 + 1) % 251).to(torch.uint8)


class PoisonPool(PagePool):
    """Freed pages get overwritten at once: the worst case of reuse, so any early release is seen."""

    def free_run(self, start: int) -> int:
        n = super().free_run(start)
        self.page_view(start, self.bytes_of(n)).fill_(POISON)
        return n

    def _move_weight_runs(self, moves: dict[int, int]) -> None:
        sizes = {old: self._allocs[old].npages for old in moves}
        super()._move_weight_runs(moves)
        for old, n in sizes.items():
            self.page_view(old, self.bytes_of(n)).fill_(POISON)


class ManualFence:
    def __init__(self) -> None:
        self.finished = False

    def done(self) -> bool:
        return self.finished


class DeferredBackend:
    """Copies run and steps finish only when the test says so."""

    def __init__(self, on_copy=None) -> None:
        self.copies: list[tuple[ManualFence, list]] = []
        self.steps: list[ManualFence] = []
        self.raise_next = False
        self.on_copy = on_copy  # sees every issued pair list (the test's own byte count)
        self.issued = 0  # bytes of the copies issued without an error (what the mover's bytes_copied counts)

    def copy(self, pairs):
        if pairs and self.on_copy is not None:
            self.on_copy(pairs)
        if pairs and self.raise_next:  # issuing fails after the first copy was enqueued
            self.raise_next = False
            pairs[0][0].fill_(POISON)
            raise RuntimeError("injected copy-issue failure")
        self.issued += sum(dst.numel() for dst, _ in pairs)
        fence = ManualFence()
        for dst, _ in pairs:
            dst.fill_(POISON)  # what an unfinished copy leaves
        self.copies.append((fence, pairs))
        return fence

    def finish_copy(self, k: int) -> None:
        fence, pairs = self.copies.pop(k)
        for dst, src in pairs:
            dst.copy_(src)
        fence.finished = True

    def step_fence(self):
        fence = ManualFence()
        self.steps.append(fence)
        return fence



@pytest.fixture(scope="module")
def store(tmp_path_factory):
    src = tmp_path_factory.mktemp("planes") / "planes.bin"
    records = write_planes_file(src, [(s.plane_bytes, s.lut_bytes) for s in SPECS], parent_bits=P, seed=3)
    path = Path("/dev/shm" if os.access("/dev/shm", os.W_OK) else src.parent) / f"pw-sm-{uuid.uuid4().hex[:8]}"
    s = PageStore.create(path, src, records)
    yield s
    s.close()
    PageStore.destroy(path)


class MoverMachine(RuleBasedStateMachine):
    store: PageStore

    # tight pools (every block at P takes 136 pages + a 2-page reserve) leave weight runs only short holes
    @initialize(budget_pages=st.one_of(st.integers(140, 170), st.integers(200, 320)),
                pace=st.sampled_from([None, 40, 150, 600]))
    def setup(self, budget_pages, pace):
        self.pool = PoisonPool(budget_pages * PAGE, PAGE)
        self.table = WeightPageTable(SPECS, L, E, P, self.pool)
        self.backend = DeferredBackend(on_copy=self._on_copy)
        self.to_fail: set[int] = set()
        self.failing: list[tuple[int, int]] = []  # (block, q) of copies the hook failed in this boundary
        self.cap = pace
        self.mover = PageMover(self.table, self.store, backend=self.backend, fault_hook=self._fault_hook,
                               pace=None if pace is None else ReloadPace(bytes_per_step=pace))
        self.kv: dict[int, int] = {}  # pool KV block -> tag of the pattern written there
        self.kept: dict[int, None] = {}  # of those, the ones nobody holds (kept prefix blocks), oldest first
        self.tags = itertools.count()
        self.pool.add_kv_listener(self._kv_moved)
        self.pool.set_kv_reclaimer(lambda: len(self.kept), self._reclaim)
        self.pool.add_weight_listener(self._weights_moved)
        self.paced_bytes = 0  # bytes of paced reload copies issued in this step (counted here)
        self.stepped = True  # a step was launched since the last boundary
        self.inflight: list[list[tuple[int, bytes]]] = []  # per in-flight step: (byte offset, bytes it may read)
        self.steps = 0
        # load every block at the seed width, the way an engine starts (first loads are never paced)
        for i in range(len(SPECS)):
            assert self.mover.request(i, S)
        assert self.paced_bytes == 0
        self._drain()
        assert all(r.q == S for r in self.table.rows)

    # ---- helpers ----
    def _fault_hook(self, i: int, b: int) -> bool:
        """The next copy of block i to complete fails (once)."""
        if i in self.to_fail:
            self.to_fail.discard(i)
            self.failing.append((i, self.table.rows[i].q))
            return True
        return False

    def _on_copy(self, pairs) -> None:
        """Count the bytes of reload copies (0 < q_i < d_i of the block whose pages they write) in this step."""
        base = self.pool.data.data_ptr()
        owner = {s.page: i for i, r in enumerate(self.table.rows) for _, _, s in self.table.slots(i) if s.page >= 0}
        for dst, _ in pairs:
            page = (dst.data_ptr() - base) // PAGE
            start = max(p for p in owner if p <= page)  # the run that holds this page
            row = self.table.rows[owner[start]]
            if 0 < row.q < row.d:
                self.paced_bytes += dst.numel()

    def _kv_moved(self, moves: dict[int, int]) -> None:
        assert set(moves) <= set(self.kv), "the pool moved a page that is not KV"
        assert not set(moves.values()) & set(self.kv), "a KV page moved onto another KV page"
        tags = {new: self.kv.pop(old) for old, new in moves.items()}
        self.kv.update(tags)
        self.kept = {moves.get(b, b): None for b in self.kept}
        RELOCATIONS[0] += 1

    def _reclaim(self, pages: int) -> None:
        """The KV cache's reclaimer: the oldest kept blocks go back to the pool (one page each here)."""
        assert 0 < pages <= len(self.kept), f"asked for {pages} pages with {len(self.kept)} kept"
        gone = list(self.kept)[:pages]
        self.pool.free_kv_blocks(gone)
        for b in gone:
            del self.kept[b], self.kv[b]
        RECLAIMS[0] += 1

    def _weights_moved(self, moves: dict[int, int]) -> None:
        """Runs after the table's listener: each moved run is a complete slot at its new start, not one a copy
        writes or an offload retires."""
        owner = {s.page: (i, w, x, s) for i in range(len(SPECS)) for w, x, s in self.table.slots(i) if s.page >= 0}
        for new in moves.values():
            i, what, idx, slot = owner[new]
            assert slot.state is PageState.GPU and not self.mover.pending(i)
            assert (i, what, idx) not in self.mover._retiring
        WEIGHT_RELOCATIONS[0] += len(moves)

    def _boundary(self) -> None:
        """A boundary with no step launched since the previous one is an idle engine step: a new pace budget."""
        if not self.stepped:
            self.paced_bytes = 0
        self.stepped = False
        self.mover.boundary()
        for i, q in self.failing:  # a failed copy leaves q_i where it was
            assert self.table.rows[i].q == q and not self.mover.pending(i), f"block {i}: a failed move committed"
        self.failing.clear()

    def _drain(self) -> None:
        """Finish every copy and step, running boundaries until nothing is pending (paced reloads need many)."""
        for _ in range(2000):
            while self.backend.copies:
                self.backend.finish_copy(0)
            while self.backend.steps:
                self._finish_step()
            self._boundary()
            if self.mover.idle() and not self.backend.copies:
                return
            self.launch_step()
        raise AssertionError("moves still pending after 2000 steps: a paced reload starves")

    def _reads(self) -> list[tuple[int, bytes]]:
        """Byte ranges the device tables point at now, with the bytes a kernel would read there."""
        q = self.table.q.cpu().numpy()
        po = self.table.plane_off.cpu().numpy()
        lo = self.table.lut_off.cpu().numpy()
        data = self.pool.data
        out = []
        for i, spec in enumerate(SPECS):
            l, rem = divmod(i, 2 * E)
            e, u = divmod(rem, 2)
            for p in range(int(q[l, e, u])):
                off = int(po[l, e, u, p]) * 4
                out.append((off, bytes(data[off:off + spec.plane_bytes].numpy())))
            off = int(lo[l, e, u]) * 2
            if q[l, e, u]:
                out.append((off, bytes(data[off:off + spec.lut_bytes[int(q[l, e, u])]].numpy())))
        return out

    def _finish_step(self) -> None:
        reads = self.inflight.pop(0)
        for off, want in reads:  # nothing the step read changed while it ran
            assert bytes(self.pool.data[off:off + len(want)].numpy()) == want, "page released under a running step"
        self.backend.steps.pop(0).finished = True

    # ---- rules ----
    @rule(i=st.integers(0, len(SPECS) - 1), b=st.integers(S, P), keep=st.sampled_from([0, 0, 3, 20]),
          relocate=st.sampled_from([True, True, False]))
    def plan(self, i, b, keep=0, relocate=True):
        """`keep` and `relocate` as the engine passes them while requests run (KV room to leave, compaction
        rationed)."""
        row = self.table.rows[i]
        before = (row.q, row.d, self.pool.weight_pages)
        compactions = self.pool.relocations
        reload = b > row.q and not self.mover.pending(i)
        ok = self.mover.request(i, b, keep_free_pages=keep, relocate=relocate)
        if not relocate:
            assert self.pool.relocations == compactions, "a request with relocate=False compacted the pool"
        if ok:
            assert row.d == b
            if reload and keep:  # its peak left the pages asked for (free or reclaimable, outside the reserve)
                pool = self.pool
                assert pool.free_pages + pool.reclaimable_pages - pool.reserve_pages >= keep
        else:
            assert (row.q, row.d, self.pool.weight_pages) == before

    @rule(moves=st.lists(st.tuples(st.integers(0, len(SPECS) - 1), st.integers(S, P)), min_size=2, max_size=6))
    def plan_many(self, moves):
        for i, b in moves:
            self.plan(i, b)

    @precondition(lambda self: self.mover._retiring)
    @rule(data=st.data())
    def plan_back(self, data):
        """Ask for a width that needs a page still waiting for its release (the mover must keep it, not free it)."""
        i, what, idx = data.draw(st.sampled_from(sorted(self.mover._retiring)))
        self.plan(i, idx if what == "lut" else data.draw(st.integers(max(idx + 1, S), P)))

    @rule(i=st.integers(0, len(SPECS) - 1), b=st.integers(S, P))
    def round_trip(self, i, b):
        """Move, commit while an older step still runs, then ask for the old width back at once: the pages just
        retired are still readable by that step and must be reused, not freed."""
        old = self.table.rows[i].q
        while len(self.inflight) > 2:
            self._finish_step()
        self.launch_step()
        if b == old or not self.mover.request(i, b):
            return
        while self.backend.copies:
            self.backend.finish_copy(0)
        self.launch_step()
        if self.table.rows[i].q == b:
            self.plan(i, old)

    @rule(i=st.integers(0, len(SPECS) - 1))
    def cancel(self, i):
        q = self.table.rows[i].q
        self.mover.cancel(i)
        assert self.table.rows[i].q == q == self.table.rows[i].d

    @rule(i=st.integers(0, len(SPECS) - 1))
    def fault(self, i):
        self.to_fail.add(i)

    @rule()
    def fault_at_issue(self):
        self.backend.raise_next = True

    @precondition(lambda self: len(self.inflight) < 4)
    @rule()
    def launch_step(self):
        self._boundary()
        self.inflight.append(self._reads())
        self.mover.end_step()
        self.paced_bytes = 0
        self.stepped = True
        self.steps += 1

    @precondition(lambda self: self.inflight)
    @rule()
    def finish_step(self):
        self._finish_step()

    @precondition(lambda self: self.backend.copies)
    @rule(data=st.data())
    def finish_copy(self, data):
        self.backend.finish_copy(data.draw(st.integers(0, len(self.backend.copies) - 1)))

    @rule(n=st.integers(1, 12))
    def kv_alloc(self, n):
        cap = self.pool.kv_capacity()
        if n > cap:
            with pytest.raises(PoolExhausted):
                self.pool.alloc_kv_blocks(n)
            return
        self._kv_write(self.pool.alloc_kv_blocks(n))
        assert self.pool.kv_capacity() == cap - n

    def _kv_write(self, blocks: list[int]) -> None:
        for blk in blocks:
            tag = next(self.tags)
            self.pool.kv_block_view(blk).copy_(kv_pattern(tag))
            self.kv[blk] = tag

    @precondition(lambda self: len(self.kv) > len(self.kept))
    @rule(data=st.data())
    def kv_free(self, data):
        """Free a scattered subset (sequences finish in any order): holes between KV pages."""
        held = sorted(set(self.kv) - set(self.kept))
        n = data.draw(st.integers(1, len(held)))
        gone = random.Random(data.draw(st.integers(0, 2**16))).sample(held, n)
        self.pool.free_kv_blocks(gone)
        for b in gone:
            del self.kv[b]

    @precondition(lambda self: len(self.kv) > len(self.kept))
    @rule(data=st.data())
    def kv_keep(self, data):
        """Sequences finish and their blocks are kept (prefix blocks nobody holds): still KV pages, with their
        contents, until a reload reclaims them."""
        held = sorted(set(self.kv) - set(self.kept))
        n = data.draw(st.integers(1, len(held)))
        for b in random.Random(data.draw(st.integers(0, 2**16))).sample(held, n):
            self.kept[b] = None

    @rule(keep_every=st.integers(2, 4))
    def kv_fill_holes(self, keep_every):
        """KV takes every free page (the holes offloads left included), then every `keep_every`-th one of them
        is freed again: many free pages, none of them in a run a plane needs."""
        got = self.pool.alloc_kv_blocks(self.pool.kv_capacity())
        self._kv_write(got)
        gone = sorted(got)[::keep_every]
        self.pool.free_kv_blocks(gone)
        for b in gone:
            del self.kv[b]

    @rule(frac=st.sampled_from([1, 2, 3]))
    def kv_fill_and_keep(self, frac):
        """KV takes every free page and the sequences end, keeping 1/frac of their blocks (prefix blocks nobody
        holds): a reload now finds fewer free pages than it needs outside the reserve, and the kept blocks it
        counts as room must be reclaimed, not the reserve taken."""
        got = self.pool.alloc_kv_blocks(self.pool.kv_capacity())
        self._kv_write(got)
        for b in sorted(got)[::frac]:
            self.kept[b] = None

    @rule(b=st.integers(S + 1, P))
    def reload_all(self, b):
        """Ask every block for width b (mostly reloads: the runs that fragmentation refuses without compaction)."""
        for i in range(len(SPECS)):
            if not self.mover.pending(i):
                self.plan(i, b)

    @rule(seed=st.integers(0, 2**16), rounds=st.integers(2, 6))
    def spread_weights(self, seed, rounds):
        """Pressure comes and goes, as in an engine: each round KV takes every free page, a random third of it is
        freed again, some blocks move to random widths (reloads land in the KV holes, through KV relocation) and a
        step commits what finished. Then the KV goes, every step finishes, and every block is asked for P (twice,
        all moves finished in between): weight runs of many sizes lie all over the pool with short holes between
        them."""
        rng = random.Random(seed)
        for _ in range(rounds):
            got = self.pool.alloc_kv_blocks(self.pool.kv_capacity())
            self._kv_write(got)
            held = sorted(set(self.kv) - set(self.kept))
            gone = rng.sample(held, min(len(held), len(self.kv) // 3))
            self.pool.free_kv_blocks(gone)
            for b in gone:
                del self.kv[b]
            for i in rng.sample(range(len(SPECS)), 4):
                self.plan(i, rng.randint(S, P))
            while self.backend.copies:
                self.backend.finish_copy(0)
            self.launch_step()
        self.pool.free_kv_blocks(list(self.kv))
        self.kv.clear()
        self.kept.clear()
        for _ in range(2):  # the first reloads take the holes; the ones left over need runs the holes lack
            self.quiet_reload_all(P)
            self._drain()

    @rule(b=st.integers(S + 1, P))
    def quiet_reload_all(self, b):
        """Every launched step finishes (an engine between decode steps), then every block is asked for width b:
        now weight runs may move out of a reload's way."""
        while self.inflight:
            self._finish_step()
        self.reload_all(b)

    @rule(pages=st.integers(100, 320))
    def budget(self, pages):
        if pages > self.pool.capacity_pages:
            with pytest.raises(ValueError):
                self.pool.set_budget(pages * PAGE)
        elif pages < self.pool.used_pages + self.pool.reserve_pages:
            with pytest.raises(PoolExhausted):
                self.pool.set_budget(pages * PAGE)
        else:
            self.pool.set_budget(pages * PAGE)
            assert self.pool.budget_pages == pages

    @rule()
    def settle(self):
        """Liveness: with every copy and step finished, every surviving plan (paced reloads included) commits and
        every retired page frees."""
        self._drain()
        assert self.mover.idle()
        for row in self.table.rows:
            assert row.q == row.d

    # ---- invariants, after every step ----
    @invariant()
    def safe(self):
        self.table.check(published=True)  # table == staged == device tables; pool tiling; every plane < q resident
        pool = self.pool
        assert pool.used_pages <= pool.budget_pages
        assert self.table.resident_weight_bytes() + pool.bytes_of(pool.kv_pages) <= pool.bytes_of(pool.budget_pages)
        table = self.table
        slots = [(i, w, x, s) for i in range(len(table.rows)) for w, x, s in table.slots(i)]
        held = sum(table.slot_pages(i, w, x) for i, w, x, s in slots if s.page >= 0)
        assert table.resident_weight_bytes() == pool.bytes_of(held) == pool.bytes_of(pool.weight_pages)
        assert self.mover.in_flight_pages() == sum(table.slot_pages(i, w, x) for i, w, x, s in slots
                                                   if s.state is PageState.IN_TRANSFER)
        # what the planner counts as coming back or becoming the new widths: exactly the weight pages held beyond
        # every block's committed footprint
        committed = sum(self.table.memory(i, r.q) for i, r in enumerate(self.table.rows) if r.q)
        assert self.table.resident_weight_bytes() == committed + self.mover.transit_bytes()
        assert pool.bytes_of(pool.kv_pages) == len(self.kv) * PAGE == pool.bytes_of(len(pool.allocations("kv")))
        assert set(pool.allocations("kv")) == set(self.kv) and set(self.kept) <= set(self.kv)
        assert pool.reclaimable_pages == len(self.kept)
        for blk, tag in self.kv.items():  # KV contents survive every relocation
            assert torch.equal(pool.kv_block_view(blk), kv_pattern(tag)), f"KV page {blk} lost its contents"
        for i, row in enumerate(self.table.rows):  # d_i is the pending move's target, else q_i
            move = self.mover._moves.get(i)
            assert row.d == (move.target if move is not None and not move.cancelled else row.q), f"block {i}: d"
        if self.mover.idle():  # every move settled: the offloads' reserve is back, whole
            assert pool.free_pages >= pool.reserve_pages, f"{pool.free_pages} free pages, reserve {pool.reserve_pages}"
        assert self.mover.stats.bytes_copied == self.backend.issued
        if self.cap is not None:
            assert self.paced_bytes <= self.cap, f"{self.paced_bytes} paced bytes in one step, cap {self.cap}"
        # the paced reloads with pieces to issue are exactly the backlog a new request waits behind
        assert set(self.mover._backlog) == {i for i, m in self.mover._moves.items() if m.paced and m.todo}
        for i, move in self.mover._moves.items():  # in-flight copies only ever target pages the move owns
            for key in move.fresh:
                assert self.table.slot(i, *key).state is PageState.IN_TRANSFER
        data = pool.data
        for i, row in enumerate(self.table.rows):  # what kernels read is complete: equal to the store
            for p in range(row.q):
                s = row.planes[p]
                got = bytes(pool.page_view(s.page, SPECS[i].plane_bytes).numpy())
                assert got == self.store.view(i, "plane", p).tobytes(), f"block {i} plane {p} incomplete"
            lut = row.luts[row.q]
            assert lut.state is PageState.GPU
            got = bytes(pool.page_view(lut.page, SPECS[i].lut_bytes[row.q]).numpy())
            assert got == self.store.view(i, "lut", row.q).tobytes()
        del data

    def teardown(self):
        if hasattr(self, "mover"):
            self._drain()
            assert self.mover.idle()
            self.pool.free_kv_blocks(list(self.kv))
            self.kv.clear()
            self.kept.clear()
            assert self.pool.used_pages == self.pool.weight_pages == sum(
                self.table.memory(i, r.q) for i, r in enumerate(self.table.rows)) // PAGE


def test_mover_state_machine(store):
    MoverMachine.store = store
    # derandomized: the same 100 programs every run, so the coverage checks below cannot flake (a random draw
    # of 70 missed a weight relocation about one run in twelve; the draw follows the machine's code, and after an
    # edit of its invariants its 70 programs had none)
    run = settings(max_examples=100, stateful_step_count=80, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    MoverMachine.TestCase.settings = run
    before, before_w, before_r = RELOCATIONS[0], WEIGHT_RELOCATIONS[0], RECLAIMS[0]
    MoverMachine.TestCase().runTest()
    assert RECLAIMS[0] > before_r, "no reload reclaimed a kept KV block"
    assert RELOCATIONS[0] > before, "no example fragmented the pool enough to need a relocation"
    assert WEIGHT_RELOCATIONS[0] > before_w, "no example fragmented the weights enough to need a weight relocation"


def test_page_mover_bench_cpu_smoke(tmp_path, monkeypatch):
    """The H200 benchmark's code path at toy sizes: it runs and writes one JSON with the three measurements."""
    import json

    from benchmarks import page_mover_bench

    monkeypatch.setenv("OUT", str(tmp_path))
    assert page_mover_bench.main(["--tiny", "--device", "cpu", "--trials", "1"]) == 0
    (result,) = tmp_path.glob("page_mover-*.json")
    rows = json.loads(result.read_text())["rows"]
    assert {r["test"] for r in rows} == {"reload_bandwidth", "decode_slowdown", "pressure_to_kv"}
    assert all(r["gb_per_s"] > 0 for r in rows if r["test"] == "reload_bandwidth")
    (row,) = [r for r in rows if r["test"] == "decode_slowdown" and r["paced"]]
    # the requests issue the first cap in the step before the timed ones; then at most one cap per step
    assert row["steps"] + 1 >= row["reload_bytes"] // row["pace_fixed_bytes_per_step"]
    assert row["reload_gb_per_s"] > 0 and any(r["test"] == "decode_slowdown" and not r["paced"] for r in rows)


def test_reload_keeps_the_free_pages_asked_for(store):
    """A reload holds its new planes and LUT and the old LUT at once: with keep_free_pages it starts only if that
    peak leaves those pages free (outside the reserve), and its pages count as in transit until it commits."""
    pool = PagePool(200 * PAGE, PAGE)
    table = WeightPageTable(SPECS, L, E, P, pool)
    mover = PageMover(table, store, pace=None)  # CPU backend: copies finish when issued
    assert all(mover.request(i, S) for i in range(len(SPECS)))
    mover.boundary()
    assert mover.transit_bytes() == 0 and all(r.q == S for r in table.rows)
    peak = sum(table.slot_pages(0, "plane", p) for p in range(S, P)) + table.slot_pages(0, "lut", P)
    room = pool.free_pages - pool.reserve_pages
    assert not mover.request(0, P, keep_free_pages=room - peak + 1)
    assert table.rows[0].d == table.rows[0].q == S and pool.free_pages - pool.reserve_pages == room
    assert mover.request(0, P, keep_free_pages=room - peak)
    assert pool.free_pages - pool.reserve_pages == room - peak and mover.transit_bytes() == pool.bytes_of(peak)
    mover.end_step()
    mover.boundary()  # commit; the old LUT retires and, the step being done, is freed
    assert table.rows[0].q == P and mover.idle() and mover.transit_bytes() == 0
    assert pool.free_pages - pool.reserve_pages == room - peak + table.slot_pages(0, "lut", S)


def test_reload_reclaims_kept_blocks_not_the_reserve(store):
    """A reload counts kept KV blocks as its room: it must reclaim them, not keep the offloads' reserve (it did:
    `alloc_run(use_reserve=True)` reclaims only once the reserve too is taken, and after the commit the pool had
    fewer free pages than the reserve, for good once requests hold those blocks again)."""
    pool = PagePool(200 * PAGE, PAGE)
    table = WeightPageTable(SPECS, L, E, P, pool)
    mover = PageMover(table, store, pace=None)
    assert all(mover.request(i, S) for i in range(len(SPECS)))
    mover.boundary()
    kept = dict.fromkeys(pool.alloc_kv_blocks(pool.kv_capacity()))  # KV filled the pool; its sequences ended

    def reclaim(n):
        gone = list(kept)[:n]
        pool.free_kv_blocks(gone)
        for b in gone:
            del kept[b]

    pool.set_kv_reclaimer(lambda: len(kept), reclaim)
    assert pool.free_pages == pool.reserve_pages > 0
    before = len(kept)
    grow = (table.memory(0, P) - table.memory(0, S)) // PAGE
    assert mover.request(0, P)
    mover.end_step()
    mover.boundary()
    assert table.rows[0].q == P and mover.idle()
    assert pool.free_pages == pool.reserve_pages  # the reserve is whole again ...
    assert before - len(kept) == grow  # ... and the kept blocks paid for the reload's growth, exactly
    table.check()


def test_bytes_freed_counts_only_what_committed_widths_gave_up(store):
    """A cancelled or failed reload hands its pages back, but no committed width gave them up: `bytes_freed` (the
    engine's bytes_offloaded) must not grow (it grew by every such move's pages); a drop's retired pages count."""
    pool = PagePool(200 * PAGE, PAGE)
    table = WeightPageTable(SPECS, L, E, P, pool)
    fail = set()
    mover = PageMover(table, store, pace=None, fault_hook=lambda i, b: i in fail)
    assert all(mover.request(i, S) for i in range(len(SPECS)))
    mover.boundary()
    weight = pool.weight_pages
    assert mover.request(0, P)
    mover.cancel(0)  # copies done (CPU): its pages go back at once
    fail.add(1)
    assert mover.request(1, P)
    mover.end_step()
    mover.boundary()  # block 1's copy fails: q stays, pages go back
    assert mover.idle() and pool.weight_pages == weight and [r.q for r in table.rows[:2]] == [S, S]
    assert mover.stats.cancelled == 1 and mover.stats.failed == 1
    assert mover.stats.bytes_freed == 0
    fail.clear()
    assert mover.request(2, P)
    mover.end_step()
    mover.boundary()  # the raise commits: the old LUT is retired and freed
    assert table.rows[2].q == P and mover.stats.bytes_freed == pool.bytes_of(table.slot_pages(2, "lut", S))
    mover.stats.bytes_freed = 0
    assert mover.request(2, S)
    mover.end_step()
    mover.boundary()  # a drop: planes S..P-1 and LUT_P given up
    assert table.rows[2].q == S and mover.idle()
    assert mover.stats.bytes_freed == table.memory(2, P) - table.memory(2, S) + pool.bytes_of(
        table.slot_pages(2, "lut", S))
    table.check()
