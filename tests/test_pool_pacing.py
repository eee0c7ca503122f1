"""Reload pacing: a reload's bytes trickle at most `cap` per engine step; offloads and first loads are not paced;
every paced reload completes; the engine option reaches the mover."""
from __future__ import annotations

import pytest
import torch

from benchmarks.budget_exchange import drive, make_rig
from pagedweight.mover import CpuBackend, ReloadPace
from pagedweight.sampling import SamplingParams

torch.set_num_threads(1)
SHAPE = dict(layers=1, experts=2, hidden=256, inter=128, parent_bits=4, seed_bits=2)  # planes of 8 KiB and 4 KiB


class CountingBackend(CpuBackend):
    """Counts the bytes each copy call issues, per step (the test closes a step where the mover's end_step is)."""

    def __init__(self) -> None:
        self.steps: list[int] = [0]

    def copy(self, pairs):
        self.steps[-1] += sum(dst.numel() for dst, _ in pairs)
        return super().copy(pairs)


def _step(mover, backend) -> None:
    mover.boundary()
    mover.end_step()
    backend.steps.append(0)


def test_reload_pace_cap_is_derived_from_link_and_step_time():
    pace = ReloadPace()
    assert pace.cap() == int(55e9 * pace.duty * 1e-3)
    pace.observe(0.1)  # a long gap counts at most 4x the estimate
    assert pace.step_s == pytest.approx(0.8e-3 + 0.2 * 4e-3)
    pace.observe(pace.step_s)
    assert pace.cap() == int(55e9 * pace.duty * pace.step_s)
    assert ReloadPace(step_s=1e-6).cap() == 1 << 20  # never below min_bytes
    assert ReloadPace(bytes_per_step=4096).cap() == 4096
    for bad in (dict(bytes_per_step=0), dict(duty=0.0), dict(duty=1.5), dict(link_bytes_per_s=0)):
        with pytest.raises(ValueError):
            ReloadPace(**bad)


@pytest.mark.parametrize("cap", [3000, 8192, 20000])
def test_paced_reload_never_exceeds_the_cap_and_completes(cap):
    rig = make_rig("cpu", 1 << 20, 1024, **SHAPE, pace=ReloadPace(bytes_per_step=cap))
    try:
        pool, table, mover = rig.pool, rig.table, rig.mover
        backend = mover.backend = CountingBackend()
        n = len(table.rows)
        for i in range(n):  # first load: unpaced, everything in this one step
            assert mover.request(i, 2)
        assert backend.steps[-1] == sum(2 * r.spec.plane_bytes + r.spec.lut_bytes[2] for r in table.rows) > cap
        _step(mover, backend)
        assert all(r.q == 2 for r in table.rows)
        backend.steps = [0]
        copied = mover.stats.bytes_copied
        for i in range(n):
            assert mover.request(i, 4)
        total = sum(2 * r.spec.plane_bytes + r.spec.lut_bytes[4] for r in table.rows)
        steps = 0
        while not (mover.idle() and all(r.q == 4 for r in table.rows)):
            assert max(backend.steps) <= cap
            _step(mover, backend)
            steps += 1
            assert steps < 10 * total // cap, "a paced reload starves"
        assert max(backend.steps) <= cap and sum(backend.steps) == total == mover.stats.bytes_copied - copied
        assert steps >= -(-total // cap)  # it really trickled
        for i, row in enumerate(table.rows):  # complete and exact, though planes were split across steps
            for p in range(4):
                got = pool.page_view(row.planes[p].page, row.spec.plane_bytes)
                assert torch.equal(got, rig.store.tensor(i, "plane", p))
        table.check()
    finally:
        rig.close()


def test_offloads_are_not_paced_and_cancel_frees_a_half_issued_reload():
    rig = make_rig("cpu", 1 << 20, 1024, **SHAPE, pace=ReloadPace(bytes_per_step=2048))
    try:
        pool, table, mover = rig.pool, rig.table, rig.mover
        drive(mover, {0: 4, 1: 2, 2: 2, 3: 4})
        backend = mover.backend = CountingBackend()
        weight = pool.weight_pages
        assert mover.request(1, 4)  # a reload: 2048 bytes issued, the step's cap is used up
        assert backend.steps[-1] == 2048
        assert mover.request(0, 2)  # an offload still issues its LUT copy now
        assert backend.steps[-1] == 2048 + table.rows[0].spec.lut_bytes[2]
        _step(mover, backend)
        assert table.rows[0].q == 2 and table.rows[1].q == 2 and mover.pending(1)
        mover.cancel(1)  # half issued: pages come back, q stays
        _step(mover, backend)
        _step(mover, backend)
        assert not mover.pending(1) and table.rows[1].q == table.rows[1].d == 2
        assert pool.weight_pages == weight - (table.memory(0, 4) - table.memory(0, 2)) // pool.page_bytes
        table.check()
    finally:
        rig.close()


def test_paced_reloads_finish_oldest_first_when_requested_before_the_boundary():
    """The engine requests a boundary's moves before `boundary()` issues the paced bytes: a new reload must not take
    the step's cap ahead of the reloads already under way (it did: the first of four reloads, started one a step,
    committed three steps late, each later request having taken a whole step's cap first)."""
    cap = 4096
    rig = make_rig("cpu", 1 << 20, 1024, **SHAPE, pace=ReloadPace(bytes_per_step=cap))
    try:
        table, mover = rig.table, rig.mover
        n = len(table.rows)
        drive(mover, {i: 2 for i in range(n)})
        sizes = [2 * r.spec.plane_bytes + r.spec.lut_bytes[4] for r in table.rows]
        assert all(s > cap for s in sizes)
        done: dict[int, int] = {}
        for step in range(10 * sum(sizes) // cap):
            if step < n:
                assert mover.request(step, 4)  # one new reload a step, requested before the boundary
            mover.boundary()
            done.update({i: step for i, r in enumerate(table.rows) if r.q == 4 and i not in done})
            mover.end_step()
            if len(done) == n:
                break
        # a cap a step in age order (two in step 0: its boundary is an idle one after drive's, a new budget)
        want = {i: -(-sum(sizes[:i + 1]) // cap) - 2 for i in range(n)}
        assert done == want
        table.check()
    finally:
        rig.close()


def test_engine_option_reaches_the_mover_and_paced_widths_return(ap_dir):
    from pagedweight.engine import LLM

    store = str(ap_dir / "store")
    unpaced = LLM(ap_dir, device="cpu", block_size=16, page_store_dir=store, reload_bytes_per_step=0)
    assert unpaced.mover.pace is None
    auto = LLM(ap_dir, device="cpu", block_size=16, page_store_dir=store)
    assert auto.mover.pace.bytes_per_step is None and auto.mover.pace_cap() >= 1 << 20
    budget = (auto.weights_outside_bytes + auto.stats()["resident_weight_bytes"]
              + auto.pool.bytes_of(auto.pool.reserve_pages) + 8 * auto.kv.block_bytes)
    llm = LLM(ap_dir, budget, "cpu", block_size=16, max_num_batched_tokens=16, page_store_dir=store,
              reload_bytes_per_step=16 << 10)
    assert llm.mover.pace_cap() == 16 << 10
    prompts = ["def fibonacci(n):", "class Stack:", "for i in range(10):", "import os\n"]
    llm.generate(prompts, SamplingParams(max_tokens=64, ignore_eos=True), use_tqdm=False)
    st = llm.stats()
    assert st["offload_triggers"] > 0
    for _ in range(200):  # pressure gone: the widths come back, 16 KiB a step
        if (llm.committed_widths() == 8).all() and llm.mover.idle():
            break
        llm.step()
    assert (llm.committed_widths() == 8).all() and llm.stats()["bytes_reloaded"] > 0
    llm.table.check()


@pytest.fixture(scope="module")
def ap_dir(tmp_path_factory):
    from pathlib import Path

    from pagedweight.convert import convert
    from pagedweight.corpus import DATA_DIR

    out = tmp_path_factory.mktemp("ap")
    convert(Path(__file__).resolve().parents[1] / "models" / "pw-tiny-moe", out, DATA_DIR / "calib.txt",
            seed_bits=3, parent_bits=8, sensitivity="activation", num_seqs=4, seq_len=64, device="cpu")
    return out
