"""Page pool and Weight Page Table: exact page accounting, M_i^b, device tables written only at commit points."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.budget_exchange import run_exchange
from pagedweight.page_table import BlockSpec, PageState, WeightPageTable, expert_block_specs
from pagedweight.pool import PagePool, PoolExhausted

torch.set_num_threads(1)
PAGE = 256


def test_pool_low_weights_high_kv_and_exact_accounting():
    pool = PagePool(64 * PAGE, PAGE)
    a = pool.alloc_run(3)
    b = pool.alloc_run(5)
    assert (a, b) == (0, 3)  # weights from the low end
    kv = pool.alloc_kv_blocks(4)
    assert kv == [63, 62, 61, 60]  # KV from the high end, a block id is its page
    assert pool.used_pages == 12 and pool.free_pages == 52 and pool.kv_capacity() == 52
    assert pool.free_run(a) == 3  # bytes freed = pages freed x page size
    assert pool.bytes_of(pool.weight_pages) == 5 * PAGE
    assert pool.alloc_run(2) == 0 and pool.alloc_run(2) == 8  # first fit in the hole, then past b
    pool.free_kv_blocks(kv[:2])
    with pytest.raises(KeyError):
        pool.free_kv_blocks([kv[0]])  # double free
    with pytest.raises(KeyError):
        pool.free_kv_blocks([kv[2], kv[2]])  # twice in one call: refused whole
    assert pool.kv_pages == 2
    pool.free_kv_blocks([kv[3], kv[2]])  # adjacent, in either order: one extent with the pages freed before
    assert pool.kv_pages == 0 and pool._free_len[pool._free_starts[-1]] == 64 - 10
    assert pool.alloc_kv_blocks(2) == [63, 62]
    with pytest.raises(KeyError):
        pool.free_run(62)  # not a weight run
    pool.check()
    assert pool.kv_capacity() == 64 - 9 - 2


def test_pool_budget_reserve_and_exhaustion():
    pool = PagePool(32 * PAGE, PAGE)
    pool.alloc_run(10)
    pool.set_reserve(2)
    assert pool.kv_capacity() == 20
    with pytest.raises(PoolExhausted):
        pool.alloc_kv_blocks(21)
    assert pool.used_pages == 10  # all or nothing
    pool.alloc_kv_blocks(20)
    with pytest.raises(PoolExhausted):
        pool.alloc_run(1)  # the reserve is not for ordinary runs ...
    assert pool.alloc_run(2, use_reserve=True) == 10  # ... only for LUT copies that must happen under pressure
    with pytest.raises(PoolExhausted):
        pool.set_budget(31 * PAGE)  # below what is in use
    with pytest.raises(ValueError):
        pool.set_budget(33 * PAGE)  # beyond the preallocated pool
    pool.check()


def test_pool_best_fit_against_a_scan():
    """Weight runs go to the smallest free extent that fits, lowest first among equals (the length index answers
    what a scan of every extent would), through random allocations and frees of runs and KV blocks."""
    rng = np.random.default_rng(5)
    pool = PagePool(400 * 4096, 4096)
    runs, blocks = [], []
    for _ in range(600):
        op = rng.random()
        if op < 0.45:
            n = int(rng.integers(1, 9))
            fits = [(ln, s) for s, ln in pool._free_len.items() if ln >= n]
            if not fits or n > pool.free_pages:
                continue
            start = pool.alloc_run(n)
            assert start == min(fits)[1]
            runs.append(start)
        elif op < 0.6 and pool.kv_capacity() >= 2:
            blocks += pool.alloc_kv_blocks(int(rng.integers(1, 3)))
        elif op < 0.85 and runs:
            pool.free_run(runs.pop(int(rng.integers(len(runs)))))
        elif blocks:  # a few at once, in any order: adjacent ones go back as one extent
            picked = rng.permutation(len(blocks))[:int(rng.integers(1, 5))]
            pool.free_kv_blocks([blocks[i] for i in picked])
            blocks = [b for i, b in enumerate(blocks) if i not in set(picked.tolist())]
        pool.check()
    assert len(pool._free_starts) > 5  # the walk left holes to choose between


def test_pool_budget_change_and_fraction():
    pool = PagePool(40 * PAGE, PAGE)
    pool.set_budget(16 * PAGE)
    assert pool.kv_capacity() == 16 and pool.capacity_pages == 40
    pool.alloc_kv_blocks(16)
    with pytest.raises(PoolExhausted):
        pool.alloc_run(1)
    small = PagePool(1e-6, 4096)  # a fraction of the device (here: of host RAM)
    assert small.capacity_pages >= 1 and small.data.numel() == small.capacity_pages * 4096


def test_pool_multi_page_kv_blocks_and_views():
    pool = PagePool(20 * PAGE, PAGE, kv_block_bytes=3 * PAGE)
    assert pool.pages_per_kv == 3 and pool.kv_capacity() == 6
    blocks = pool.alloc_kv_blocks(2)
    assert blocks == [17, 14]
    pool.kv_block_view(17).fill_(7)
    assert pool.data[17 * PAGE:20 * PAGE].eq(7).all() and pool.kv_block_view(14).numel() == 3 * PAGE
    run = pool.alloc_run(2)
    pool.page_view(run, 8).copy_(torch.tensor([1, 0, 0, 0, 0, 60, 0, 0], dtype=torch.uint8))
    assert pool.words[run * PAGE // 4].item() == 1
    assert pool.halves[run * PAGE // 2 + 2].item() == 1.0  # bytes 4,5 = 00 3C: little-endian 0x3C00 = 1.0
    pool.check()


def test_expert_block_specs_follow_spec_formulas():
    specs = expert_block_specs(2, 3, hidden=100, inter=40, parent_bits=5, seed_bits=3)
    assert len(specs) == 12
    gu, dn = specs[0], specs[1]
    assert gu.plane_bytes == 4 * 4 * 80 and dn.plane_bytes == 4 * 2 * 100  # 4 * ceil(K/32) * N
    assert gu.widths == [3, 4, 5] and gu.lut_bytes[4] == 2 * 16 * 80


def _table(budget_pages=200):
    specs = [BlockSpec(300 + 10 * i, {2: 40, 3: 300, 4: 600}) for i in range(2 * 2 * 2)]
    pool = PagePool(budget_pages * PAGE, PAGE)
    return WeightPageTable(specs, 2, 2, 4, pool), pool


def _load(table, i, b):
    """Place planes < b and LUT_b by hand (what the mover does), then commit."""
    for p in range(b):
        s = table.rows[i].planes[p]
        s.page, s.state = table.pool.alloc_run(table.slot_pages(i, "plane", p)), PageState.GPU
    s = table.rows[i].luts[b]
    s.page, s.state = table.pool.alloc_run(table.slot_pages(i, "lut", b)), PageState.GPU
    table.commit(i, b)


def test_memory_is_page_rounded():
    table, pool = _table()
    for i, row in enumerate(table.rows):
        for b in (2, 3, 4):
            want = b * -(-row.spec.plane_bytes // PAGE) * PAGE + -(-row.spec.lut_bytes[b] // PAGE) * PAGE
            assert table.memory(i, b) == want


def test_device_tables_change_only_at_publish():
    table, pool = _table()
    for i in range(len(table.rows)):
        _load(table, i, 2)
    before = table.plane_off.clone()
    assert torch.equal(table.q, torch.zeros_like(table.q))  # staged, not published
    with pytest.raises(AssertionError):
        table.check(published=True)
    assert table.publish() and not table.publish()  # one copy, then nothing to do
    table.check(published=True)
    assert not torch.equal(table.plane_off, before)
    # independent reference: block i = (l*E + e)*2 + u; offsets in words / halves
    i = table.block_index(1, 0, 1)
    row = table.rows[i]
    assert table.q[1, 0, 1] == 2
    assert table.plane_off[1, 0, 1].tolist() == [row.planes[0].page * PAGE // 4, row.planes[1].page * PAGE // 4, -1, -1]
    assert table.lut_off[1, 0, 1] == row.luts[2].page * PAGE // 2
    # kernels reading through the tables see the plane bytes
    words = pool.words
    off = int(table.plane_off[1, 0, 1, 1])
    pool.page_view(row.planes[1].page, 4).copy_(torch.tensor([9, 0, 0, 0], dtype=torch.uint8))
    assert words[off].item() == 9
    assert table.resident_weight_bytes() == sum(table.memory(i, 2) for i in range(8)) == pool.bytes_of(pool.weight_pages)


def test_commit_refuses_incomplete_width():
    table, pool = _table()
    _load(table, 0, 2)
    s = table.rows[0].planes[2]
    s.page, s.state = pool.alloc_run(table.slot_pages(0, "plane", 2)), PageState.IN_TRANSFER
    s3 = table.rows[0].luts[3]
    s3.page, s3.state = pool.alloc_run(table.slot_pages(0, "lut", 3)), PageState.GPU
    with pytest.raises(RuntimeError):
        table.commit(0, 3)  # plane 2 still in transfer
    s.state = PageState.GPU
    table.commit(0, 3)
    table.publish()
    assert table.q[0, 0, 0] == 3


def test_check_catches_disagreement():
    table, pool = _table()
    _load(table, 0, 2)
    table.publish()
    table.check()
    pool.alloc_run(1)  # a weight run the table does not know
    with pytest.raises(AssertionError):
        table.check()


def test_budget_exchange_cpu():
    """Issue item 2 on the CPU pool, through the same code as the H200 script; the reload meets a fragmented pool
    (KV in the holes, scattered free pages) and goes through KV relocation."""
    rows = run_exchange("cpu", 1 << 20, 1024, layers=2, experts=4, hidden=256, inter=128, parent_bits=4, seed_bits=2)
    loaded, off, rel = rows
    assert rel["relocations"] > 0 and rel["relocated_bytes"] > 0
    assert off["freed_bytes"] > 0 and off["new_kv_blocks"] == off["expected_new_kv_blocks"] == off["freed_bytes"] // 1024
    assert rel["weight_bytes"] == loaded["weight_bytes"] and rel["kv_blocks"] == loaded["kv_blocks"]
    assert np.isclose(off["weight_bytes"] + off["kv_blocks"] * 1024, loaded["weight_bytes"] + loaded["kv_blocks"] * 1024)
