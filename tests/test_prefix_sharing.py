"""Prefix sharing in the paged KV cache (PagedKVCache.share_prefix / publish) under the scheduler, without a model:
each computed token's K/V is stood in for by a hash of the tokens up to it (as K/V depend on every earlier token),
written where the engine's step would write it, so a request that read a block of another history would read the
wrong values."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedweight.kv_cache import PagedKVCache
from pagedweight.models import ModelConfig
from pagedweight.models.layers import causal_mask
from pagedweight.pool import PAGE_ALIGN, PagePool, PoolExhausted
from pagedweight.sampling import SamplingParams
from pagedweight.scheduler import Scheduler
from pagedweight.sequence import Sequence

BS, LAYERS, BLOCKS = 4, 2, 14
CFG = ModelConfig(family="olmoe", vocab_size=64, hidden_size=16, moe_intermediate_size=8, num_hidden_layers=LAYERS,
                  num_experts=2, top_k=1, norm_topk_prob=False, num_attention_heads=1, num_key_value_heads=1,
                  head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=64)
# common prefixes; the third repeats the first's second block at the start, where its history differs
FAMILIES = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [5, 6, 7, 8, 20, 21, 22, 23], [9, 10, 11, 12, 30, 31, 32]]


def make(budget: int, seats: int, retention_s: float = 0.0, clock=None) -> tuple[PagedKVCache, Scheduler]:
    pool = PagePool(BLOCKS * LAYERS * PAGE_ALIGN, PAGE_ALIGN)
    kv = PagedKVCache(CFG, pool, torch.float32, block_size=BS, decode_kernel=False, retention_s=retention_s,
                      **({"clock": clock} if clock else {}))
    return kv, Scheduler(kv, max_num_seqs=seats, max_num_batched_tokens=budget)


def stand_in(ids: list[int], pos: int) -> float:
    """The K/V of position pos: a function of ids[:pos + 1], exact in float32."""
    h = 0
    for t in ids[:pos + 1]:
        h = (h * 31 + t) % 1_000_003
    return float(h)


def pages(kv: PagedKVCache, seq: Sequence, pos: int) -> list[int]:
    return kv.block_pages[seq.block_table[pos // BS]]


def run_step(kv: PagedKVCache, sched: Scheduler, fold: bool = True) -> None:
    """One engine step: write each scheduled token's stand-in K/V, publish, sample (a function of the history, so
    equal prompts continue alike), end requests at max_tokens, and fold the copies found (with `fold` False at the
    start of the next step instead: the state between a publish and its fold is checked too)."""
    kv.fold_copies(sched.running)  # those a step before left
    batch = sched.schedule()
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        kv.block_tables(seq)  # as the runner reads them (cached per request)
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            assert seq.block_table[pos // BS] not in kv._key  # a published block is never written again
            kv.view[pages(kv, seq, pos), 0, pos % BS, 0, 0] = stand_in(seq.token_ids, pos)
            if seq.params.prompt_logprobs is not None:  # where it wrote: the pages its scores must read
                seq.__dict__.setdefault("wrote", {})[pos] = pages(kv, seq, pos)
        seq.num_computed_tokens += n
    kv.publish(batch.seqs)
    for seq in batch.seqs:
        if seq.num_uncomputed_tokens == 0:
            seq.append_token(sum(seq.token_ids[-3:]) * 7 % 50 + 3, 0.0)
            if seq.num_completion_tokens >= seq.params.max_tokens:
                sched.finish(seq, "length")
    if fold:
        kv.fold_copies(sched.running)  # the step is done (the engine's order)


def history(kv: PagedKVCache, lid: int) -> list[int]:
    """The tokens a published block's key chain spells, from the first token to its end."""
    parent, tokens = kv._key[lid]
    return (history(kv, parent) if parent != -1 else []) + list(tokens)


def check(kv: PagedKVCache, sched: Scheduler) -> None:
    for seq in sched.running:  # every computed position holds this request's own history
        for pos in range(seq.num_computed_tokens):
            assert kv.view[pages(kv, seq, pos), 0, pos % BS, 0, 0].tolist() == [stand_in(seq.token_ids, pos)] * LAYERS
    assert all(not seq.block_table for seq in sched.waiting)
    for seq in sched.running:  # a request scoring its prompt reads the K/V it computed, not another request's
        if seq.params.prompt_logprobs is not None:
            assert all(pages(kv, seq, pos) == seq.wrote[pos] for pos in range(seq.num_computed_tokens))
    for seq in sched.running:  # a cached block table is the one its blocks give now (folds and relocations drop it)
        if seq.request_id in kv._tables:
            assert kv._tables[seq.request_id].tolist() == [list(col) for col in zip(*(kv.block_pages[b]
                                                                                     for b in seq.block_table))]
    held = Counter(b for seq in sched.running for b in seq.block_table)
    held.update(b for pins in kv._pins.values() for b in pins.values())  # the blocks copies of the last step copy
    assert set(kv._pins) <= {seq.request_id for seq in sched.running}
    kept = set(kv._cached) | set(kv._retained)
    assert not set(kv._cached) & set(kv._retained) and kv.num_cached_blocks == len(kept)
    assert kv._refs == dict(held) and not set(held) & kept
    assert set(kv.block_pages) == set(held) | kept  # a block lives while held, or kept if published
    assert {lid: key for key, lid in kv._shared.items()} == kv._key and kept <= set(kv._key)
    # weight runs reach only the aged kept blocks; retained ones were released in release order, within retention
    assert kv.pool.reclaimable_pages == len(kv._cached) * LAYERS
    times = list(kv._retained.values())
    assert times == sorted(times) and (kv.retention_s > 0 or not times)
    assert all(t > kv._clock() - kv.retention_s for t in times), "a kept block outlived its retention"
    for lid in kv._key:  # every published block is found from the first token (no continuation outlives its parent)
        ids = history(kv, lid)  # and holds that history's K/V
        for pos in range(len(ids) - BS, len(ids)):
            assert kv.view[kv.block_pages[lid], 0, pos % BS, 0, 0].tolist() == [stand_in(ids, pos)] * LAYERS
    assert kv.num_free_blocks + kv.num_used_blocks == BLOCKS
    assert kv.num_free_blocks == kv.pool.kv_capacity() // LAYERS + kv.num_cached_blocks  # no reserve here


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.just("add"), st.integers(0, 2), st.lists(st.integers(3, 60), max_size=6),
                                    st.integers(1, 8)),
                          st.tuples(st.just("step"), st.booleans()), st.tuples(st.just("step"), st.booleans()),
                          st.tuples(st.just("repeat"), st.integers(0, 20), st.integers(1, 8), st.booleans()),
                          st.tuples(st.just("abort"), st.integers(0, 20)),
                          st.tuples(st.just("weights"), st.integers(1, 3 * LAYERS))), max_size=40),
       st.integers(3, 12), st.integers(1, 4), st.sampled_from([0.0, 3.0]))
def test_shared_blocks_hold_each_request_s_own_tokens(ops, budget, seats, retention):
    """Random arrivals of prompts with common prefixes (and earlier prompts again, some scoring their prompt: copies of
    published blocks, pins), steps, aborts and weight runs in a cache short enough to preempt: every request reads
    only its own tokens (a scoring one its own K/V), blocks live while held or kept, kept blocks are
    evicted when KV needs them, weight runs reclaim only those past their retention (one step a second), and all
    come back."""
    now = [0.0]
    kv, sched = make(budget, seats, retention, lambda: now[0])
    added = []
    for op in ops:
        now[0] += 1.0
        kv.age()
        if op[0] == "weights":  # a reload's run: the free pages, then aged kept blocks, never retained ones
            free, aged, retained = kv.pool.free_pages, len(kv._cached), dict(kv._retained)
            try:
                start = kv.pool.alloc_run(op[1])
            except PoolExhausted as e:
                assert op[1] > free + aged * LAYERS or "fragmented" in str(e), e
            else:
                assert op[1] <= free + aged * LAYERS
                assert len(kv._cached) == aged - max(0, -(-(op[1] - free) // LAYERS))
                kv.pool.free_run(start)
            assert kv._retained == retained
        elif op[0] == "add":
            prompt = FAMILIES[op[1]] + op[2]
            seq = Sequence(str(len(added)), prompt, SamplingParams(max_tokens=op[3]))
            added.append(seq)
            sched.add(seq)
        elif op[0] == "repeat" and added:  # an earlier prompt again, answered further (copies, pins), or scored
            earlier = added[op[1] % len(added)]
            seq = Sequence(str(len(added)), earlier.prompt_token_ids,
                           SamplingParams(max_tokens=earlier.params.max_tokens + BS + op[2],
                                          prompt_logprobs=0 if op[3] else None))
            added.append(seq)
            sched.add(seq)
        elif op[0] == "abort" and op[1] < len(added):
            sched.abort(added[op[1]].request_id)
        else:
            run_step(kv, sched, fold=op[1])
        check(kv, sched)
    for _ in range(400):
        if not sched.has_unfinished():
            break
        run_step(kv, sched)
        check(kv, sched)
    kept = set(kv._cached) | set(kv._retained)
    assert not sched.has_unfinished() and kv.num_used_blocks == 0 and set(kv._shared.values()) == kept
    kv.evict(BLOCKS)
    assert kv.pool.kv_capacity() == BLOCKS * LAYERS and not kv._shared and not kv.block_pages


def test_a_later_request_starts_after_the_shared_blocks():
    """Two requests of one prompt and a third with its first two blocks: the later ones take the computed blocks
    (each keeps its last prompt token to compute), hold them beside the first, and the blocks outlive the first."""
    kv, sched = make(budget=16, seats=4)
    prompt = FAMILIES[0] + [40, 41]  # 12 tokens: 3 full blocks
    first = Sequence("a", prompt, SamplingParams(max_tokens=6))
    sched.add(first)
    run_step(kv, sched)
    assert first.num_computed_tokens == 12 and len(kv._shared) == 3
    again, cousin = Sequence("b", prompt, SamplingParams(max_tokens=6)), Sequence("c", FAMILIES[0][:8] + [1, 2],
                                                                                  SamplingParams(max_tokens=2))
    sched.add(again)
    sched.add(cousin)
    # the planner's demand leaves out what the waiting ones will share: first 5 - 3 held, again 5 - 2, cousin 3 - 2
    assert kv.shared_blocks(again) == kv.shared_blocks(cousin) == 2 and sched.blocks_demand() == 2 + 3 + 1
    run_step(kv, sched)
    assert again.num_cached_tokens == 8 and again.block_table[:2] == first.block_table[:2]  # not the 3rd: 11 at most
    assert cousin.num_cached_tokens == 8 and cousin.block_table[:2] == first.block_table[:2]
    assert sched.prefix_hit_tokens == 16 and sched.prefix_query_tokens == 12 + 12 + 10
    assert kv.num_used_blocks < sum(len(s.block_table) for s in sched.running)
    sched.abort("a")
    assert kv._refs[again.block_table[0]] == 3 - 1 and len(kv._shared) >= 2
    check(kv, sched)
    logprobs = Sequence("d", prompt, SamplingParams(max_tokens=3, prompt_logprobs=0))
    sched.add(logprobs)
    run_step(kv, sched)
    assert logprobs.num_cached_tokens == 0  # every prompt position's logits are needed
    own = list(logprobs.block_table)
    assert set(kv._pins["d"].values()) <= set(again.block_table)  # its blocks are copies: pinned, not folded
    run_step(kv, sched)
    assert logprobs.block_table[:len(own)] == own and "d" in kv._pins  # it reads its own K/V to its end
    check(kv, sched)


def test_a_repeated_prompt_of_whole_blocks_publishes_its_answer():
    """A prompt of whole blocks sent again recomputes its last block (its logits are needed), a copy of a published
    one: the request pins the original for the step, then its table has the original in the copy's place (the copy
    back in the pool), its answer's blocks continue the original, and a next turn finds the whole history
    (before, the chain stopped at the copy and a next turn found the prompt only)."""
    kv, sched = make(budget=16, seats=4)
    prompt = FAMILIES[0] + [40, 41]  # 12 tokens: 3 full blocks
    first = Sequence("a", prompt, SamplingParams(max_tokens=1))
    sched.add(first)
    while sched.has_unfinished():
        run_step(kv, sched)
    original = list(kv._cached)[0]  # released last block first: its third block
    again = Sequence("b", prompt, SamplingParams(max_tokens=6))
    sched.add(again)
    run_step(kv, sched, fold=False)
    copy = again.block_table[2]
    assert again.num_cached_tokens == 8 and copy != original and copy not in kv._key
    assert kv._pins == {"b": {2: original}} and kv._refs[original] == 1 and original not in kv._cached
    check(kv, sched)
    kv.fold_copies(sched.running)  # the step is done
    assert again.block_table[2] == original and copy not in kv.block_pages and not kv._pins
    check(kv, sched)
    while again.num_computed_tokens < 16:
        run_step(kv, sched)
        check(kv, sched)
    fourth = again.block_table[3]
    assert kv._key[fourth][0] == original
    while sched.has_unfinished():
        run_step(kv, sched)
    check(kv, sched)
    kept = list(kv._cached)
    assert kept.index(fourth) < kept.index(original)  # it leaves before the block it continues
    turn = Sequence("c", again.token_ids + [44, 45], SamplingParams(max_tokens=2))
    sched.add(turn)
    run_step(kv, sched)
    assert turn.num_cached_tokens == 16 and turn.block_table[2:4] == [original, fourth]
    check(kv, sched)


def test_kept_blocks_serve_a_later_turn_and_give_way_to_kv_and_weights():
    """A finished request's published blocks are kept but counted free: the next turn of its conversation (its
    prompt, its answer and a new message) starts after them; a KV allocation evicts them, least recently released
    first, and so does a weight run short of free pages (the pool's reclaimer), never beyond what is kept."""
    kv, sched = make(budget=16, seats=4)
    first = Sequence("a", FAMILIES[0] + [40, 41], SamplingParams(max_tokens=3))  # 12 + 3 tokens: 3 published
    sched.add(first)
    while sched.has_unfinished():
        run_step(kv, sched)
    assert kv.num_used_blocks == 0 and kv.num_cached_blocks == 3 and kv.num_free_blocks == BLOCKS
    turn = Sequence("b", first.token_ids + [44, 45, 46], SamplingParams(max_tokens=2))
    sched.add(turn)
    assert kv.shared_blocks(turn) == 0 and sched.blocks_demand() == 5  # kept blocks are free: its demand has them
    held, held_sched = make(budget=16, seats=4, retention_s=30.0, clock=lambda: 0.0)
    again = Sequence("a", first.prompt_token_ids, SamplingParams(max_tokens=3))
    held_sched.add(again)
    while held_sched.has_unfinished():
        run_step(held, held_sched)
    held_sched.add(Sequence("b", again.token_ids + [44, 45, 46], SamplingParams(max_tokens=2)))
    # retained, its history is the planner's already (num_retained_blocks): the turn's demand leaves it out
    assert held.num_retained_blocks == 3 and held.shared_blocks(held_sched.waiting[0]) == 3
    assert held_sched.blocks_demand() == 2
    released = list(kv._cached)
    run_step(kv, sched)
    assert turn.num_cached_tokens == 12 and turn.block_table[:3] == released[::-1] and kv.num_cached_blocks == 0
    check(kv, sched)
    while sched.has_unfinished():
        run_step(kv, sched)
    kept = list(kv._cached)
    assert kv.num_cached_blocks == 4 and kv.num_free_blocks == BLOCKS
    # the turn's last published block was released first (a block leaves before the one it continues)
    assert kv._key[kept[0]][0] == kept[1]
    other = Sequence("c", list(range(3, 3 + 4 * (BLOCKS - 2))), SamplingParams(max_tokens=2))
    sched.add(other)
    while other.num_computed_tokens < other.num_prompt_tokens:
        run_step(kv, sched)  # its prompt needs BLOCKS - 2 blocks, 10 are free: the two least recently released go
    assert kv.evicted_blocks == 2 and list(kv._cached) == kept[2:]
    check(kv, sched)
    sched.abort("c")
    pool, free = kv.pool, kv.pool.free_pages
    with pytest.raises(PoolExhausted):
        pool.alloc_run(free + pool.reclaimable_pages + 1)
    assert kv.num_cached_blocks == 2 + 12  # c's published blocks are kept too
    start = pool.alloc_run(free + 1)  # one page short: one kept block (LAYERS pages) is reclaimed
    assert kv.evicted_blocks == 3 and kv.reclaimed_blocks == 1 and kv.num_cached_blocks == 13
    assert pool.free_pages == LAYERS - 1
    pool.free_run(start)
    check(kv, sched)


def test_free_blocks_are_what_an_allocation_gets_when_an_offload_borrowed_the_reserve():
    """An offload may borrow the pool's reserve; pages freed later refill it first. Kept blocks are then worth
    less than their pages: the free count says so, and an allocation of that many blocks succeeds."""
    kv, sched = make(budget=16, seats=4)
    first = Sequence("a", FAMILIES[0] + [40, 41], SamplingParams(max_tokens=3))
    sched.add(first)
    while sched.has_unfinished():
        run_step(kv, sched)
    pool = kv.pool
    pool.set_reserve(2 * LAYERS)
    assert kv.num_cached_blocks == 3 and kv.num_free_blocks == BLOCKS - 2
    run = pool.alloc_run(pool.free_pages - LAYERS, use_reserve=True)  # the reserve short by one block's pages
    assert pool.free_pages == LAYERS and kv.num_free_blocks == 3 - 1
    seq = Sequence("b", list(range(3, 3 + 4 * 2)), SamplingParams(max_tokens=1))
    assert kv.tokens_fit(seq) == 2 * BS
    kv.allocate(seq, 2 * BS)
    assert len(seq.block_table) == 2 and kv.num_cached_blocks == 0 and pool.free_pages == pool.reserve_pages
    kv.free(seq)
    pool.free_run(run)
    pool.check()
    # borrowed past what kept blocks cover: no free block, and the shortfall is what freed pages first refill
    assert kv.reserve_borrowed_bytes == 0
    deep = pool.alloc_run(pool.free_pages - 1, use_reserve=True)
    assert kv.num_free_blocks == 0 and kv.reserve_borrowed_bytes == (2 * LAYERS - 1) * pool.page_bytes
    pool.free_run(deep)
    assert kv.reserve_borrowed_bytes == 0 and pool.free_pages - pool.reserve_pages == kv.num_free_blocks * LAYERS


def _kept(kv, sched, prompt: list[int]) -> set[int]:
    """Run a request of `prompt` to its end; the blocks it left kept."""
    sched.add(Sequence("a", prompt, SamplingParams(max_tokens=1)))
    while sched.has_unfinished():
        run_step(kv, sched)
    return set(kv._cached)


def test_a_request_scoring_a_kept_prompt_holds_its_own_blocks_only():
    """A request scoring its prompt (prompt_logprobs) computes every block itself, also those an earlier request left
    kept: its copies. It keeps reading its own K/V, and once no block table names an original, the original takes
    the copy's pages (its own go back). Before, it held every original beside its copy to its end: a prompt of 9
    blocks, kept, did not fit in 14 ("error") though it does in a cold cache."""
    kv, sched = make(budget=16, seats=4)
    prompt = list(range(3, 3 + 9 * BS))
    kept = _kept(kv, sched, prompt)
    assert len(kept) == 9 and kv.num_free_blocks == BLOCKS
    scoring = Sequence("s", prompt, SamplingParams(max_tokens=2, prompt_logprobs=0))
    sched.add(scoring)
    while scoring.num_computed_tokens < len(prompt):
        run_step(kv, sched)
        check(kv, sched)  # its positions are in the pages it wrote
        assert kv.num_used_blocks == len(scoring.block_table) and not kv._pins
    assert set(scoring.block_table) <= kept  # the originals, holding its own K/V
    while sched.has_unfinished():
        run_step(kv, sched)
    assert scoring.finish_reason == "length" and kv.num_free_blocks == BLOCKS
    check(kv, sched)


def test_a_scoring_request_s_pin_waits_while_another_request_holds_the_original():
    """Two requests of one prompt at once, the second scoring it: its copies are pinned while the first holds the
    originals (the first reads their pages); once the pins are their only holders, the originals take the copies'
    pages."""
    kv, sched = make(budget=32, seats=4)
    prompt = list(range(3, 3 + 3 * BS))
    plain, scoring = (Sequence("a", prompt, SamplingParams(max_tokens=3)),
                      Sequence("s", prompt, SamplingParams(max_tokens=8, prompt_logprobs=0)))
    sched.add(plain)
    sched.add(scoring)
    run_step(kv, sched)
    own, originals = scoring.block_table[:3], plain.block_table[:3]
    own_pages = [kv.block_pages[b] for b in own]
    assert kv._pins["s"] == dict(enumerate(originals)) and not set(own) & set(originals)
    run_step(kv, sched)  # the pins wait: the first still holds the originals
    assert scoring.block_table[:3] == own and kv._pins["s"] == dict(enumerate(originals))
    check(kv, sched)
    while not plain.is_finished:
        run_step(kv, sched)
    check(kv, sched)
    assert "s" not in kv._pins and scoring.block_table[:3] == originals
    assert [kv.block_pages[b] for b in originals] == own_pages and kv.num_used_blocks == len(scoring.block_table)
    while sched.has_unfinished():
        run_step(kv, sched)
    assert kv.num_used_blocks == 0 and set(originals) <= set(kv._cached)


def test_two_requests_scoring_a_kept_prompt_at_once_hold_their_own_blocks_and_no_third_set():
    """Two requests score a prompt an earlier request left kept, in one step: both pin the kept originals, which
    no block table names, so the first's copies become the originals and the second's pins wait while the first
    reads them: their own blocks and nothing more are held (three sets before: the originals stayed pinned)."""
    kv, sched = make(budget=32, seats=4)
    prompt = list(range(3, 3 + 3 * BS))
    kept = _kept(kv, sched, prompt)
    one, two = (Sequence(r, prompt, SamplingParams(max_tokens=m, prompt_logprobs=0)) for r, m in (("s", 3), ("t", 6)))
    sched.add(one)
    sched.add(two)
    run_step(kv, sched)
    check(kv, sched)  # each reads the pages it wrote
    assert set(one.block_table[:3]) == kept and kv._pins == {"t": dict(enumerate(one.block_table[:3]))}
    assert kv.num_used_blocks == len(one.block_table) + len(two.block_table)
    while not one.is_finished:
        run_step(kv, sched)
    check(kv, sched)
    assert not kv._pins and set(two.block_table[:3]) == kept  # the originals, now holding its own K/V
    assert kv.num_used_blocks == len(two.block_table)

def test_prefix_counts_take_each_request_once_as_it_first_starts():
    """The prefix counts are prompt tokens of the requests that started after a lookup and, of those, the tokens
    found (their num_cached_tokens): a recompute after preemption that finds its own kept blocks is not a second
    query, nor are its generated tokens (before, two prompts with no common block reported 24 tokens hit and 69 of
    44 prompt tokens queried)."""
    kv, sched = make(budget=64, seats=4)
    a = Sequence("a", list(range(3, 3 + 4 * 6)), SamplingParams(max_tokens=6))
    b = Sequence("b", list(range(100, 100 + 4 * 5)), SamplingParams(max_tokens=30))
    sched.add(a)
    sched.add(b)
    found = []
    share = kv.share_prefix
    kv.share_prefix = lambda seq: found.append((seq.request_id, share(seq))) or found[-1][1]
    while sched.has_unfinished():
        run_step(kv, sched)
    assert b.num_preemptions == 1 and ("b", 24) in found  # its recompute found its own kept blocks
    assert a.num_cached_tokens == b.num_cached_tokens == 0
    assert sched.prefix_query_tokens == a.num_prompt_tokens + b.num_prompt_tokens and sched.prefix_hit_tokens == 0


def test_a_request_that_looked_its_prefix_up_but_never_started_reports_none_cached():
    """A waiting request finds a kept prefix but no room for its own tokens: it gives the blocks back and waits;
    aborted there, it used nothing it found (before, its output reported the found tokens as cached)."""
    kv, sched = make(budget=64, seats=4)
    first = Sequence("a", FAMILIES[0] + [40, 41], SamplingParams(max_tokens=1))
    sched.add(first)
    while sched.has_unfinished():
        run_step(kv, sched)
    hog = Sequence("hog", list(range(3, 3 + 4 * (BLOCKS - 3))), SamplingParams(max_tokens=20))
    sched.add(hog)
    run_step(kv, sched)
    late = Sequence("c", FAMILIES[0] + [40, 41, 50, 51, 52, 53, 54], SamplingParams(max_tokens=2))
    sched.add(late)
    run_step(kv, sched)
    assert late in sched.waiting and not late.block_table and kv.shared_blocks(late) == 0
    assert late.num_cached_tokens == 0 and sched.prefix_query_tokens == first.num_prompt_tokens + hog.num_prompt_tokens
    sched.abort("c")
    assert late.num_cached_tokens == 0 and late.finish_reason == "abort"
    check(kv, sched)


def test_a_packed_step_writes_and_reads_each_token_s_k_and_v_in_its_block_slot():
    """`attend` of packed steps (a prompt in two chunks, then a second prompt's chunk beside the first's decode row)
    writes each new token's K and V to view[its block's page, k|v, its slot] through the flat `rows`, and every query
    attends over its own request's K/V so far: the outputs equal SDPA over the K/V kept here, layer by layer."""
    kv, sched = make(budget=5, seats=4)
    gen = torch.Generator().manual_seed(0)
    kept: dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (request, layer, pos) -> K, V
    steps = []
    sched.add(Sequence("a", list(range(3, 10)), SamplingParams(max_tokens=4)))
    for step in range(3):
        if step == 2:
            sched.add(Sequence("b", list(range(20, 24)), SamplingParams(max_tokens=2)))
        batch = sched.schedule()
        steps.append([(seq.request_id, n) for seq, n in zip(batch.seqs, batch.num_new_tokens)])
        kv.prepare(batch.seqs, batch.num_new_tokens)
        t = sum(batch.num_new_tokens)
        for layer in range(LAYERS):
            q, k, v = (torch.randn(1, 1, t, CFG.head_dim, generator=gen) for _ in range(3))
            out = kv.attend(layer, q, k, v, CFG.head_dim ** -0.5)
            row = 0
            for seq, n in zip(batch.seqs, batch.num_new_tokens):
                start = seq.num_computed_tokens
                for i in range(n):
                    kept[seq.request_id, layer, start + i] = k[0, :, row + i], v[0, :, row + i]
                    page, slot = pages(kv, seq, start + i)[layer], (start + i) % BS
                    assert torch.equal(kv.view[page, 0, slot], k[0, :, row + i])
                    assert torch.equal(kv.view[page, 1, slot], v[0, :, row + i])
                ks, vs = (torch.stack([kept[seq.request_id, layer, p][j] for p in range(start + n)], dim=1)[None]
                          for j in (0, 1))
                want = torch.nn.functional.scaled_dot_product_attention(
                    q[:, :, row:row + n], ks, vs, attn_mask=causal_mask(n, start + n, q.device),
                    scale=CFG.head_dim ** -0.5)
                assert torch.allclose(out[:, :, row:row + n], want, atol=1e-6), (step, seq.request_id, layer)
                row += n
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            if seq.num_uncomputed_tokens == 0:
                seq.append_token(50 + step, 0.0)
        kv.layout = None
    assert steps == [[("a", 5)], [("a", 2)], [("a", 1), ("b", 4)]]


def test_kv_store_names_the_rows_attend_writes():
    """A kernel that writes the new K/V itself (layer_kernels.rope given `kv_store`'s (rows, dst, src)) leaves the
    pool as attend(q, k, v) does, and attend(q, None, None) then attends alike: token i's K at rows[dst[0, i]], its V
    at rows[dst[1, i]], from token src[i] where given. In a packed step (a prompt's chunk) and in a static decode
    step (decode_layout), whose second row is a padding row that rewrites row 0's K/V."""
    kv, sched = make(budget=8, seats=4)
    gen = torch.Generator().manual_seed(1)
    kv.rows.copy_(torch.randn(kv.rows.shape, generator=gen))  # finite bytes everywhere (the pool is uninitialised)
    sched.add(Sequence("a", list(range(3, 10)), SamplingParams(max_tokens=4)))

    def both_ways(t: int, b: int, src: torch.Tensor | None) -> None:
        for layer in range(LAYERS):
            q = torch.randn(b, 1, t, CFG.head_dim, generator=gen)
            k, v = (torch.randn(b, 1, t, CFG.head_dim, generator=gen) for _ in range(2))
            before = kv.rows.clone()
            want = kv.attend(layer, q, k, v, CFG.head_dim ** -0.5)
            written = kv.rows.clone()
            kv.rows.copy_(before)
            rows, dst, got_src = kv.kv_store(layer)
            assert rows is kv.rows and tuple(dst.shape) == (2, b * t)
            assert (got_src is None) == (src is None) and (src is None or torch.equal(got_src, src))
            k_tok, v_tok = (z.transpose(1, 2).reshape(b * t, *z.shape[1:2], z.shape[3]) for z in (k, v))
            i = torch.arange(b * t) if src is None else src
            rows[dst[0]], rows[dst[1]] = k_tok[i], v_tok[i]
            assert torch.equal(kv.rows, written), layer
            assert torch.equal(kv.attend(layer, q, None, None, CFG.head_dim ** -0.5), want), layer

    batch = sched.schedule()
    assert [n for n in batch.num_new_tokens] == [7]
    kv.prepare(batch.seqs, batch.num_new_tokens)
    both_ways(7, 1, None)
    seq = batch.seqs[0]
    seq.num_computed_tokens += 7
    seq.append_token(50, 0.0)
    batch = sched.schedule()  # the decode row's block
    assert batch.num_new_tokens == [1]
    table = torch.from_numpy(kv.block_tables(seq))[None]  # [1, L, blocks]
    src = torch.tensor([0, 0])  # row 1: padding, row 0's position, table and K/V
    kv.layout = kv.decode_layout(torch.tensor([7, 7]), src, table.expand(2, -1, -1).contiguous())
    both_ways(1, 2, src)
    kv.layout = None


def test_a_page_of_part_of_a_token_s_k_is_refused():
    """The flat rows need pages of whole tokens' K or V: 256 B pages for 24 B ones (6 fp32 of one head) are refused
    with a clear error, not misread."""
    cfg = ModelConfig(**{**vars(CFG), "head_dim": 6})
    with pytest.raises(ValueError, match="whole number of a token's K or V"):
        PagedKVCache(cfg, PagePool(BLOCKS * LAYERS * PAGE_ALIGN, PAGE_ALIGN), torch.float32, block_size=BS)
