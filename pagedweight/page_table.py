"""Weight Page Table: per expert linear block, its widths, committed/desired width, plane and LUT residency.

The host table is the truth; the device tables the kernels read (`q`, `plane_off`, `lut_off`) are a
derived copy written only at commit points: `commit` edits a host staging buffer, `publish` (at a step boundary)
moves it to the device in one copy on the compute stream, so the tables keep their addresses (CUDA graphs stay
valid) and no kernel sees a half-written row. The one other writer is weight-run relocation (pool compaction at a
step boundary): the table follows the moved slots and republishes at once (`_relocated`). Rules: DESIGN.md §3.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from pagedweight.pool import PagePool


class PageState(enum.Enum):
    CPU = 0  # only the page store holds it
    IN_TRANSFER = 1  # pool pages allocated, copy in flight: never readable
    GPU = 2  # complete in the pool


@dataclass
class BlockSpec:
    """Raw byte sizes of one block (what the checkpoint stores): one plane, and the LUT of each supported width."""

    plane_bytes: int
    lut_bytes: dict[int, int]  # width b -> bytes of LUT_b; its keys are the supported widths B_i

    @property
    def widths(self) -> list[int]:
        return sorted(self.lut_bytes)


def expert_block_specs(num_layers: int, num_experts: int, hidden: int, inter: int, parent_bits: int,
                       seed_bits: int) -> list[BlockSpec]:
    """Specs of every routed-expert block in flat order i = (l*E + e)*2 + u, from DESIGN.md §2's byte formulas."""
    specs = []
    for _ in range(num_layers * num_experts):
        for n, k in ((2 * inter, hidden), (hidden, inter)):  # gate_up [2F, D], down [D, F]
            plane = 4 * (-(-k // 32)) * n
            specs.append(BlockSpec(plane, {b: 2 * (1 << b) * n for b in range(seed_bits, parent_bits + 1)}))
    return specs


@dataclass
class Slot:
    """One plane or one LUT of a block in the pool."""

    state: PageState = PageState.CPU
    page: int = -1  # first pool page when allocated (IN_TRANSFER or GPU)


@dataclass
class BlockRow:
    spec: BlockSpec
    q: int = 0  # committed width (0: not loaded; kernels must not run before every block has q >= min width)
    d: int = 0  # desired width (planner intent); d != q is the pending plan
    planes: list[Slot] = field(default_factory=list)
    luts: dict[int, Slot] = field(default_factory=dict)


@dataclass
class WeightPageTable:
    specs: list[BlockSpec]
    num_layers: int
    num_experts: int
    parent_bits: int
    pool: PagePool
    rows: list[BlockRow] = field(init=False)

    def __post_init__(self) -> None:
        L, E, P = self.num_layers, self.num_experts, self.parent_bits
        if len(self.specs) != L * E * 2:
            raise ValueError(f"{len(self.specs)} specs for {L} layers x {E} experts x 2 kinds")
        for s in self.specs:
            if not s.widths or s.widths[-1] > P or s.widths[0] < 1:
                raise ValueError(f"widths {s.widths} outside 1..{P}")
        self.rows = [BlockRow(s, planes=[Slot() for _ in range(P)], luts={b: Slot() for b in s.widths})
                     for s in self.specs]
        # One byte buffer holds the three tables back to back (8-byte aligned), so publishing is one copy.
        n = L * E * 2
        self._q_bytes = -(-n * 4 // 8) * 8
        self._plane_bytes = n * P * 8
        total = self._q_bytes + self._plane_bytes + n * 8
        dev = self.pool.device
        pin = dev.type == "cuda"
        self._staging = torch.zeros(total, dtype=torch.uint8, pin_memory=pin)
        self._device_buf = torch.zeros(total, dtype=torch.uint8, device=dev)
        self.host_q, self.host_plane_off, self.host_lut_off = self._views(self._staging)
        self.q, self.plane_off, self.lut_off = self._views(self._device_buf)
        self.host_plane_off.fill_(-1)
        self.host_lut_off.fill_(-1)
        self._dirty = True
        self._publish_event = None
        self.commits = 0  # commit() calls so far: readers cache what they derive from the committed widths
        self.publish()
        self.pool.add_weight_listener(self._relocated)

    def _views(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        L, E, P = self.num_layers, self.num_experts, self.parent_bits
        n = L * E * 2
        a, b = self._q_bytes, self._q_bytes + self._plane_bytes
        return (buf[:n * 4].view(torch.int32).view(L, E, 2),
                buf[a:b].view(torch.int64).view(L, E, 2, P),
                buf[b:].view(torch.int64).view(L, E, 2))

    # ---- sizes ----
    def slot_pages(self, i: int, what: str, idx: int) -> int:
        spec = self.rows[i].spec
        return self.pool.pages_for(spec.plane_bytes if what == "plane" else spec.lut_bytes[idx])

    def memory(self, i: int, b: int) -> int:
        """M_i^b as allocated: b page-rounded planes plus the page-rounded LUT_b."""
        return self.pool.bytes_of(b * self.slot_pages(i, "plane", 0) + self.slot_pages(i, "lut", b))

    def slot(self, i: int, what: str, idx: int) -> Slot:
        return self.rows[i].planes[idx] if what == "plane" else self.rows[i].luts[idx]

    def slots(self, i: int):
        """(what, idx, slot) of every plane and LUT of block i."""
        row = self.rows[i]
        yield from (("plane", p, s) for p, s in enumerate(row.planes))
        yield from (("lut", b, s) for b, s in row.luts.items())

    def resident_weight_bytes(self) -> int:
        """Bytes of pool pages held by planes and LUTs (GPU or IN_TRANSFER): the pool's weight pages, since every
        weight run is a slot's (the mover is `alloc_run`'s one caller). Not a walk over every slot: engines report
        it each second under their lock (17 ms for Qwen1.5-MoE's 2,880 blocks on one CPU core)."""
        return self.pool.bytes_of(self.pool.weight_pages)

    def block_index(self, layer: int, expert: int, kind: int) -> int:
        return (layer * self.num_experts + expert) * 2 + kind

    # ---- commit / publish ----
    def can_commit(self, i: int, b: int) -> bool:
        row = self.rows[i]
        return (b in row.luts and row.luts[b].state is PageState.GPU
                and all(s.state is PageState.GPU for s in row.planes[:b]))

    def commit(self, i: int, b: int) -> None:
        """Make width b the one kernels read for block i (host staging only; visible after `publish`)."""
        if not self.can_commit(i, b):
            raise RuntimeError(f"block {i}: width {b} is not resident and complete")
        self._wait_publish()
        self.rows[i].q = b
        self.commits += 1
        self._stage(i)

    def _stage(self, i: int) -> None:
        """Write block i's committed width and the offsets of the slots it reads into the staging tables."""
        row, b = self.rows[i], self.rows[i].q
        l, rem = divmod(i, 2 * self.num_experts)
        e, u = divmod(rem, 2)
        words_per_page = self.pool.page_bytes // 4
        self.host_q[l, e, u] = b
        self.host_plane_off[l, e, u] = torch.tensor(
            [s.page * words_per_page if p < b else -1 for p, s in enumerate(row.planes)], dtype=torch.int64)
        self.host_lut_off[l, e, u] = row.luts[b].page * (self.pool.page_bytes // 2)
        self._dirty = True

    def _relocated(self, moves: dict[int, int]) -> None:
        """The pool moved weight runs old start -> new start (bytes already copied on the compute stream): follow
        them, restage the rows of blocks whose committed width reads a moved slot, and publish at once, on the
        compute stream after those copies, so the device tables never point at the old pages when the next step
        runs (whoever calls the pool need not publish). Only slots complete in the pool may move (the mover's guard).
        """
        self._wait_publish()
        restage = set()
        for i, row in enumerate(self.rows):
            for what, idx, s in self.slots(i):
                if s.page in moves:
                    if s.state is not PageState.GPU:
                        raise RuntimeError(f"block {i} {what}{idx}: moved while {s.state.name}")
                    s.page = moves[s.page]
                    if row.q and (idx < row.q if what == "plane" else idx == row.q):
                        restage.add(i)
        for i in sorted(restage):
            self._stage(i)
        self.publish()

    def publish(self) -> bool:
        """Copy the staged tables to the device tables (one copy, on the current stream: the compute stream, so the
        next step reads the new tables); True if anything changed. The fence is recorded on that same stream (a
        stream argument once let a caller fence another stream than the one the copy ran on)."""
        if not self._dirty:
            return False
        if self._device_buf.is_cuda:
            self._device_buf.copy_(self._staging, non_blocking=True)
            self._publish_event = torch.cuda.Event()
            self._publish_event.record(torch.cuda.current_stream(self._device_buf.device))
        else:
            self._device_buf.copy_(self._staging)
        self._dirty = False
        return True

    def _wait_publish(self) -> None:
        """The async publish reads the pinned staging buffer: never edit it before that copy is done."""
        if self._publish_event is not None:
            self._publish_event.synchronize()
            self._publish_event = None

    # ---- checks (tests, debugging) ----
    def check(self, published: bool = True) -> None:
        """Table, staged/device tables and pool agree; every plane below q_i and LUT_{q_i} are GPU-resident."""
        pool_runs = {s: a.npages for s, a in self.pool.allocations("weight").items()}
        table_runs: dict[int, int] = {}
        wpp, hpp = self.pool.page_bytes // 4, self.pool.page_bytes // 2
        for i, row in enumerate(self.rows):
            assert row.q == 0 or row.q in row.luts, f"block {i}: committed width {row.q} unsupported"
            for what, idx, s in self.slots(i):
                assert (s.page >= 0) == (s.state is not PageState.CPU), f"block {i} {what}{idx}: state/page mismatch"
                if s.page >= 0:
                    assert s.page not in table_runs, f"page {s.page} owned twice"
                    table_runs[s.page] = self.slot_pages(i, what, idx)
            if row.q:
                assert self.can_commit(i, row.q), f"block {i}: planes below q={row.q} not all resident"
            l, rem = divmod(i, 2 * self.num_experts)
            e, u = divmod(rem, 2)
            want_planes = [s.page * wpp if p < row.q else -1 for p, s in enumerate(row.planes)]
            want_lut = row.luts[row.q].page * hpp if row.q else -1
            assert int(self.host_q[l, e, u]) == row.q, f"block {i}: staged q differs"
            assert self.host_plane_off[l, e, u].tolist() == want_planes, f"block {i}: staged plane_off differs"
            assert int(self.host_lut_off[l, e, u]) == want_lut, f"block {i}: staged lut_off differs"
        assert table_runs == pool_runs, "weight runs of the table and the pool differ"
        if published:
            assert not self._dirty and torch.equal(self._device_buf.cpu(), self._staging), "device tables stale"
        self.pool.check()

