"""KV relocation (compaction): a weight run refused only by fragmentation is placed by moving KV pages.

Covers the window choice and exact accounting on the bare pool, the H200 livelock (a reload refused although free
pages suffice) reproduced and resolved through the real mover and page store, and the paged KV cache following
relocated pages inside a running engine (same tokens as an engine whose KV never moved).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.budget_exchange import KVPages, drive, make_rig
from pagedweight.engine import LLM
from pagedweight.pool import PagePool, PoolExhausted
from pagedweight.sampling import SamplingParams

torch.set_num_threads(1)
PAGE = 256
BUNDLED = Path(__file__).resolve().parents[1] / "models" / "pw-tiny-moe"


def _fill(pool: PagePool, blocks: list[int]) -> dict[int, torch.Tensor]:
    """A distinct pattern in each KV page; returns page -> its bytes."""
    out = {}
    for b in blocks:
        pat = ((torch.arange(PAGE) * 3 + b * 11 + 1) % 253).to(torch.uint8)
        pool.kv_block_view(b).copy_(pat)
        out[b] = pat
    return out


def test_compaction_moves_the_fewest_kv_pages_and_keeps_accounting():
    pool = PagePool(32 * PAGE, PAGE)
    assert pool.alloc_run(4) == 0  # weights 0..3
    kv = pool.alloc_kv_blocks(28)  # KV 4..31
    free = [5, 9, 10, 14, 20, 21, 22, 27]
    pool.free_kv_blocks(free)
    held = _fill(pool, [b for b in kv if b not in free])
    used, free_pages = pool.used_pages, pool.free_pages
    with pytest.raises(PoolExhausted, match="fragmented"):
        pool.alloc_run(4)  # 8 free pages, no run of 4
    with pytest.raises(PoolExhausted, match="fragmented"):
        pool.alloc_run(4, relocate=True)  # nobody listens: the pool must not move KV
    seen: list[dict[int, int]] = []
    pool.add_kv_listener(seen.append)
    start = pool.alloc_run(4, relocate=True)
    # windows without weight pages and with one KV page: 19..22 (lowest) and 20..23; KV page 19 goes to the
    # highest free page outside the window
    assert start == 19 and seen == [{19: 27}]
    assert pool.used_pages == used + 4 and pool.free_pages == free_pages - 4  # the move itself is free
    assert pool.kv_pages == 28 - 8 and pool.relocations == 1 and pool.relocated_pages == 1
    held[27] = held.pop(19)
    for b, pat in held.items():
        assert torch.equal(pool.kv_block_view(b), pat), f"KV page {b} lost its bytes"
    assert sorted(pool.allocations("kv")) == sorted(held)
    pool.check()


def test_compaction_refuses_when_weights_themselves_fragment():
    pool = PagePool(16 * PAGE, PAGE)
    pool.add_kv_listener(lambda moves: None)
    runs = [pool.alloc_run(1) for _ in range(16)]
    for r in runs[::2]:
        pool.free_run(r)  # free pages between weight pages: no window without weight pages
    with pytest.raises(PoolExhausted, match="weight pages"):
        pool.alloc_run(2, relocate=True)
    pool.check()


def _fragmented_rig(with_listener: bool):
    """The H200 livelock at toy size: all blocks at P, KV fills the pool, half the blocks offload to S, KV fills
    the holes, then as many KV pages as the reload needs are freed, spread out as single pages."""
    rig = make_rig("cpu", 1 << 20, 1024, layers=2, experts=4, hidden=256, inter=128, parent_bits=4, seed_bits=2,
                   reserve_seed_luts=True)
    pool, mover, n = rig.pool, rig.mover, len(rig.table.rows)
    drive(mover, {i: 4 for i in range(n)})
    kv = KVPages(pool) if with_listener else None
    first = pool.alloc_kv_blocks(pool.kv_capacity())
    chosen = list(range(0, n, 2))
    w0 = pool.weight_pages
    drive(mover, {i: 2 for i in chosen})
    reserve = pool.reserve_pages
    pool.set_reserve(0)  # KV takes every page, the reserve's too, so no free run is left ...
    holes = pool.alloc_kv_blocks(pool.kv_capacity())
    assert pool.free_pages == 0
    gone = sorted(first + holes)[::2][:w0 - pool.weight_pages + reserve]  # ... then scattered single pages
    if kv is not None:
        kv.write(first, 1)
        kv.write(holes, 2)
        kv.free(gone)
    else:
        pool.free_kv_blocks(gone)
    pool.set_reserve(reserve)  # as many free pages as the reload plus the mover's reserve need
    return rig, chosen, kv


def test_reload_livelock_reproduced_without_relocation():
    rig, chosen, _ = _fragmented_rig(with_listener=False)
    try:
        pool, table, mover = rig.pool, rig.table, rig.mover
        i = chosen[0]
        grow = table.memory(i, 4) // pool.page_bytes - table.memory(i, 2) // pool.page_bytes
        assert pool.free_pages - pool.reserve_pages >= grow  # enough free pages ...
        assert pool.largest_free_run() < table.slot_pages(i, "plane", 3)  # ... but no run long enough
        assert not mover.request(i, 4)
        with pytest.raises(RuntimeError, match="fragmented"):
            drive(mover, {i: 4 for i in chosen})  # the livelock, detected
    finally:
        rig.close()


def test_reload_without_relocation_is_refused_then_relocates():
    """relocate=False (the engine's ration while requests run): a run that fits no free extent refuses the reload
    and moves nothing; the same request with relocation compacts and starts."""
    rig, chosen, kv = _fragmented_rig(with_listener=True)
    try:
        pool, mover = rig.pool, rig.mover
        i = chosen[0]
        assert not mover.request(i, 4, relocate=False)
        assert pool.relocations == 0 and not mover.pending(i)
        assert mover.request(i, 4) and pool.relocations > 0
        kv.check()
    finally:
        rig.close()


def test_reload_succeeds_through_relocation_and_kv_survives():
    rig, chosen, kv = _fragmented_rig(with_listener=True)
    try:
        pool, table, mover = rig.pool, rig.table, rig.mover
        assert pool.largest_free_run() < table.slot_pages(chosen[0], "plane", 3)
        kv_pages = pool.kv_pages
        drive(mover, {i: 4 for i in chosen})
        assert all(table.rows[i].q == 4 for i in chosen)
        assert pool.relocations > 0 and pool.kv_pages == kv_pages and pool.free_pages == pool.reserve_pages
        kv.check()
        table.check()
        for i in chosen:  # reloaded planes equal the store's
            for p in range(4):
                s = table.rows[i].planes[p]
                assert torch.equal(pool.page_view(s.page, table.rows[i].spec.plane_bytes),
                                   rig.store.tensor(i, "plane", p))
    finally:
        rig.close()


def test_paged_kv_cache_follows_relocation_in_a_running_engine():
    """Between two steps, force a relocation that moves a live KV page: generation goes on with exactly the tokens
    of an engine whose KV never moved, and logical block ids stay put."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = ["def fibonacci(n):", "class Stack:", "import os\nimport sys\n"]
    ref = LLM(BUNDLED, device="cpu", kv_cache_bytes=2 << 20, block_size=4)
    want = [o.token_ids for o in ref.generate(prompts, params, use_tqdm=False)]

    llm = LLM(BUNDLED, device="cpu", kv_cache_bytes=2 << 20, block_size=4)
    pool, cache = llm.pool, llm.kv
    ids = [llm.add_request(p, params) for p in prompts]
    for _ in range(6):
        llm.step()
    tables_before = {r: list(llm._requests[r].block_table) for r in ids}
    live_before = {lid: list(pages) for lid, pages in cache.block_pages.items()}
    rows = pool.kv_blocks_view()
    bytes_before = {lid: rows[pages].clone() for lid, pages in live_before.items()}
    top = min(pool.allocations("kv"))  # nothing finished yet: the live KV pages are [top, capacity)
    assert pool.kv_pages == pool.capacity_pages - top
    # every other page becomes a 1-page weight run; two single pages below the live KV are freed again, so the
    # only window of 2 pages without weight pages is (top - 1, top): the lowest live KV page must move
    dummies = [pool.alloc_run(1) for _ in range(pool.free_pages)]
    for page in (top - 1, top - 3):
        pool.free_run(page)
    assert pool.alloc_run(2, relocate=True) == top - 1
    moved = {lid: pages for lid, pages in cache.block_pages.items() if pages != live_before[lid]}
    assert len(moved) == 1 and top - 3 in next(iter(moved.values())) and pool.relocations == 1
    for lid, pages in cache.block_pages.items():  # every live block's K/V bytes, found through the new map
        assert torch.equal(rows[pages], bytes_before[lid]), f"logical block {lid} lost its K/V"
    for page in [top - 1] + [d for d in dummies if d not in (top - 1, top - 3)]:
        pool.free_run(page)
    assert {r: llm._requests[r].block_table for r in ids} == tables_before  # logical ids never change
    done = {}
    while llm.has_unfinished():
        done.update({o.request_id: o for o in llm.step() if o.finished})
    assert [done[r].token_ids for r in ids] == want
    assert llm.stats()["kv_relocations"] == 1 and llm.stats()["kv_relocated_bytes"] > 0
    pool.check()


def test_kept_prefix_blocks_follow_relocation():
    """A kept prefix block whose page a compaction moves is found at its new place: the next request with the same
    prompt starts after it and generates what an engine whose kept blocks never moved generates."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)"
    ref = LLM(BUNDLED, device="cpu", kv_cache_bytes=2 << 20, block_size=4)
    ref.generate([prompt], params, use_tqdm=False)
    want = ref.generate([prompt], params, use_tqdm=False)[0]
    assert want.num_cached_tokens > 0

    llm = LLM(BUNDLED, device="cpu", kv_cache_bytes=2 << 20, block_size=4)
    pool, cache = llm.pool, llm.kv
    llm.generate([prompt], params, use_tqdm=False)
    kept = {lid: list(cache.block_pages[lid]) for lid in cache._cached}
    assert kept and cache.num_used_blocks == 0
    rows = pool.kv_blocks_view()
    bytes_before = {lid: rows[pages].clone() for lid, pages in kept.items()}
    top = min(pool.allocations("kv"))  # the lowest kept page; free pages below it become 1-page weight runs
    dummies = [pool.alloc_run(1) for _ in range(pool.free_pages)]
    for page in (top - 1, top - 3):
        pool.free_run(page)
    assert pool.alloc_run(2, relocate=True) == top - 1  # the window (top - 1, top): the kept page at top moves
    assert cache.evicted_blocks == 0 and pool.relocations == 1
    assert any(top - 3 in pages for pages in cache.block_pages.values())
    for lid, pages in cache.block_pages.items():
        assert torch.equal(rows[pages], bytes_before[lid]), f"kept block {lid} lost its K/V"
    for page in [top - 1] + [d for d in dummies if d not in (top - 1, top - 3)]:
        pool.free_run(page)
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == want.num_cached_tokens and again.token_ids == want.token_ids
    pool.check()


def test_relocation_while_a_step_layout_is_live_is_refused():
    llm = LLM(BUNDLED, device="cpu", kv_cache_bytes=1 << 20, block_size=4)
    llm.add_request("def f(x):", SamplingParams(max_tokens=2, ignore_eos=True))
    llm.step()
    seq = next(iter(llm._requests.values()))
    llm.kv.prepare([seq], [1])  # a step's indices are built ...
    page = llm.kv.block_pages[seq.block_table[0]][0]
    with pytest.raises(RuntimeError, match="layout is live"):
        llm.kv._relocated({page: page + 1})  # ... so a move now would misdirect its writes


def test_weight_runs_move_out_of_the_window_when_weights_fragment():
    """Weight runs of several sizes leave only short holes: the window for a long run holds weight runs, which move
    whole (bytes and owner) only when the guard vouches for them; KV pages in the window move too."""
    pool = PagePool(24 * PAGE, PAGE)
    sizes = [2, 1, 3, 1, 2, 1, 2, 1, 3, 1, 2]  # runs tiling pages 0..18
    runs = [pool.alloc_run(n) for n in sizes]
    assert runs == [0, 2, 3, 6, 7, 9, 10, 12, 13, 16, 17] and pool.free_pages == 5
    kv = pool.alloc_kv_blocks(2)  # pages 22, 23
    kv_bytes = _fill(pool, kv)
    w_bytes = {}
    for r, n in zip(runs, sizes):
        w_bytes[r] = ((torch.arange(n * PAGE) * 5 + r * 7 + 3) % 249).to(torch.uint8)
        pool.page_view(r, n * PAGE).copy_(w_bytes[r])
    for r in (2, 6, 10, 16):  # holes between weight runs: 2, 6, 10..11, 16
        pool.free_run(r)
    assert pool.largest_free_run() == 3  # pages 19..21
    kv_seen, w_seen = [], []
    pool.add_kv_listener(kv_seen.append)
    with pytest.raises(PoolExhausted, match="weight pages"):
        pool.alloc_run(6, relocate=True)  # no guard: weight runs never move
    pool.add_weight_listener(w_seen.append)
    pool.set_weight_guard(lambda: set())
    with pytest.raises(PoolExhausted, match="weight pages"):
        pool.alloc_run(6, relocate=True)  # nothing movable
    pool.check()
    pinned = {13}  # e.g. a run a copy still writes, or one retiring
    pool.set_weight_guard(lambda: {s for s in pool.allocations("weight") if s not in pinned})
    used, free, wp = pool.used_pages, pool.free_pages, pool.weight_pages
    start = pool.alloc_run(6, relocate=True)
    # no weight-free window of 6; the one with the fewest used pages and no pinned page (13..15) is 16..21: it
    # holds only the 2-page run 17, which goes to the best-fitting free extent outside (10..11)
    assert start == 16
    assert w_seen == [{17: 10}] and kv_seen == []
    assert pool.relocated_weight_runs == 1 and pool.relocated_weight_pages == 2 and pool.relocations == 1
    assert pool.used_pages == used + 6 and pool.free_pages == free - 6 and pool.weight_pages == wp + 6
    w_bytes[10] = w_bytes.pop(17)
    for r, want in w_bytes.items():
        if r in (2, 6, 16):
            continue
        assert torch.equal(pool.page_view(r, len(want)), want), f"weight run {r} lost its bytes"
    for b, want in kv_bytes.items():
        assert torch.equal(pool.kv_block_view(b), want)
    assert pool.allocations("weight")[10].npages == 2
    pool.check()


def test_weight_runs_refused_when_no_hole_outside_fits_them_then_a_run_moves_whole():
    pool = PagePool(8 * PAGE, PAGE)
    pool.add_kv_listener(lambda moves: None)
    moved = []
    pool.add_weight_listener(moved.append)
    pool.set_weight_guard(lambda: set(pool.allocations("weight")))
    for n in (2, 1, 2, 1, 2):
        pool.alloc_run(n)  # 0-1, 2, 3-4, 5, 6-7
    pool.free_run(2)
    pool.free_run(5)
    with pytest.raises(PoolExhausted, match="do not fit"):
        pool.alloc_run(2, relocate=True)  # every 2-page window holds a 2-page run, and no 2-page hole is left
    assert moved == [] and pool.relocations == 0
    pool.check()

    pool = PagePool(12 * PAGE, PAGE)
    pool.add_kv_listener(lambda moves: None)
    pool.add_weight_listener(moved.append)
    pool.set_weight_guard(lambda: set(pool.allocations("weight")))
    sizes = {pool.alloc_run(n): n for n in (2, 1, 2, 1, 2, 1)}  # 0-1, 2, 3-4, 5, 6-7, 8
    kv_bytes = _fill(pool, pool.alloc_kv_blocks(3))  # 9..11
    run_bytes = {s: ((torch.arange(n * PAGE) * 9 + s) % 247).to(torch.uint8) for s, n in sizes.items()}
    for s, want in run_bytes.items():
        pool.page_view(s, len(want)).copy_(want)
    pool.free_run(0)
    pool.free_run(5)
    pool.free_kv_blocks([10])
    del kv_bytes[10]  # free: 0-1, 5, 10; no 4-page window without weight pages
    start = pool.alloc_run(4, relocate=True)
    # window 0..3 (2 used pages) is refused: run 3-4 lies partly in it and must move whole, to a 2-page hole; the
    # next cheapest windows hold 3 used pages and 2..5 is the lowest: run 3 (largest first) -> 0-1, run 2 -> 10
    assert start == 2 and moved == [{3: 0, 2: 10}]
    assert torch.equal(pool.page_view(0, 2 * PAGE), run_bytes[3])
    assert torch.equal(pool.page_view(10, PAGE), run_bytes[2])
    for s in (6, 8):
        assert torch.equal(pool.page_view(s, len(run_bytes[s])), run_bytes[s])
    for blk, want in kv_bytes.items():
        assert torch.equal(pool.kv_block_view(blk), want)
    assert pool.relocated_weight_runs == 2 and pool.relocated_weight_pages == 3 and pool.relocated_pages == 0
    assert pool.weight_pages == 1 + 2 + 2 + 1 + 4 and pool.kv_pages == 2  # runs 2, 3, 6, 8 and the new one
    pool.check()
