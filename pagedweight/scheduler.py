"""Continuous batching: which sequences compute how many tokens this step.

One loop serves prefill and decode: each step has a token budget; running sequences go first (a decode
costs one token, an unfinished prompt continues in chunks), then waiting sequences start with what is
left (chunked prefill). When the KV cache cannot hold a running sequence's next tokens, the newest
running sequence is preempted: its blocks go back at once and it re-enters the front of the waiting
queue to be recomputed later. The engine asks the weight planner for room before this happens: its demand
(`blocks_demand`) is how many blocks beyond those held the KV cache will hold at its fullest while the running
requests, and the waiting ones that have a seat, run to their longest (`peak_kv_blocks` steps them as `schedule`
does). Weights make room once, when the work arrives, not one prefill chunk at a time, and no more than the work
holds at once: requests that end at different times (scoring windows, short generations) do not count as if all
held their last token together. A running request still prefilling that finds no block while others progress this
step waits a step with its KV kept instead of preempting anyone: a preemption costs a recompute, and the blocks
come back as others finish or the weights give them up.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from loguru import logger

from pagedweight.sequence import Sequence, SequenceStatus


class BlockSpace(Protocol):
    """What the scheduler needs of the KV cache (pagedweight.kv_cache.PagedKVCache)."""

    block_size: int

    @property
    def num_free_blocks(self) -> int: ...

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int: ...

    def tokens_fit(self, seq: Sequence) -> int: ...

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None: ...

    def free(self, seq: Sequence) -> None: ...


@dataclass
class ScheduledBatch:
    """One step's work: `seqs[i]` computes `num_new_tokens[i]` tokens from its `num_computed_tokens`."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)  # can never fit: finished with "error"

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, kv: BlockSpace, max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 max_model_len: int | None = None) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first; preemption takes from the end
        self.num_preemptions = 0
        # bumped whenever the steps leave the path `blocks_demand` last stepped through: a request added, ended,
        # preempted, or given fewer tokens than its chunk for want of blocks
        self._changes = 0
        self._peak: tuple[int, int] | None = None  # (_changes, peak_kv_blocks) of the last blocks_demand

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._changes += 1

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a request wherever it is and free its KV blocks now; returns it (finished "abort")."""
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self.kv.free(seq)
                    seq.finish("abort")
                    self._changes += 1
                    return seq
        return None

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """A running sequence is done: its blocks return to the cache immediately."""
        self.running.remove(seq)
        self.kv.free(seq)
        seq.finish(reason, error)
        self._changes += 1

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._changes += 1
        self.waiting.appendleft(seq)
        logger.debug("preempted {} ({} tokens to recompute)", seq.request_id, seq.num_tokens)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        return min(seq.num_uncomputed_tokens, budget)

    def _fit(self, seq: Sequence, n: int) -> int:
        """Allocate for as many of seq's next n tokens as the free blocks hold (a prefill chunk shrinks)."""
        fit = self.kv.tokens_fit(seq)
        if fit < n:
            n, self._changes = fit, self._changes + 1
        if n > 0:
            self.kv.allocate(seq, n)
        return max(n, 0)

    def _fail(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Alone and still short: this context cannot fit in the KV cache at all."""
        self.kv.free(seq)
        seq.finish("error", f"context of {seq.num_tokens} tokens does not fit in the KV cache")
        self._changes += 1
        batch.failed.append(seq)
        logger.warning("request {} failed: {}", seq.request_id, seq.error)

    def blocks_wanted(self) -> int:
        """KV blocks the next step would allocate if nothing were short (the planner's demand signal)."""
        budget, wanted = self.max_num_batched_tokens, 0
        for seq in self.running:
            n = self._chunk(seq, budget)
            if n <= 0:
                break
            wanted += self.kv.blocks_needed(seq, n)
            budget -= n
        slots = self.max_num_seqs - len(self.running)
        for seq in self.waiting:
            n = self._chunk(seq, budget)
            if n <= 0 or slots <= 0:
                break
            wanted += self.kv.blocks_needed(seq, n)
            budget -= n
            slots -= 1
        return wanted

    def final_kv_tokens(self, seq: Sequence) -> int:
        """Tokens whose K/V seq will hold at its longest: it ends at max_tokens or max_model_len, and its last
        sampled token is never computed."""
        last = seq.num_prompt_tokens + seq.params.max_tokens
        if self.max_model_len is not None:
            last = min(last, self.max_model_len)
        return max(last - 1, seq.num_tokens)

    def blocks_demand(self) -> int:
        """KV blocks beyond those held now that the running requests, and the waiting ones a seat is free for, will
        hold at the fullest if each runs to its longest (`final_kv_tokens`): the planner's target. An upper bound
        while the steps go as `schedule` plans them with blocks to spare, since a request may stop early.

        The peak is stepped through again only after a change (`_changes`): while the steps follow its path it
        stays the same, and most decode steps ask for nothing else than blocks held minus it."""
        if self._peak is None or self._peak[0] != self._changes:
            seats = max(self.max_num_seqs - len(self.running), 0)
            seqs = self.running + list(itertools.islice(self.waiting, seats))
            peak = peak_kv_blocks([s.num_computed_tokens for s in seqs], [s.num_uncomputed_tokens for s in seqs],
                                  [self.final_kv_tokens(s) for s in seqs], self.max_num_batched_tokens,
                                  self.kv.block_size)
            self._peak = (self._changes, peak)
        return max(self._peak[1] - sum(len(s.block_table) for s in self.running), 0)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._fit(seq, self._chunk(seq, budget))
            if n == 0 and batch.seqs and seq.num_uncomputed_tokens > 1:
                i += 1  # a prompt chunk short of blocks that this step's earlier requests took: wait, keep its KV
                continue
            while n == 0:
                victim = self.running[-1]
                if victim is seq and i == 0:
                    self.running.remove(seq)
                    self._fail(seq, batch)
                    break
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
                n = self._fit(seq, self._chunk(seq, budget))
            if n == 0:
                continue  # seq left `running` (it was last), so the loop ends
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
            i += 1
        if batch.preempted:
            return batch  # memory is short: admit nobody new this step
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = self._fit(seq, self._chunk(seq, budget))
            if n == 0:
                if self.running:
                    break
                self.waiting.popleft()
                self._fail(seq, batch)
                continue
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch


def peak_kv_blocks(held: list[int], pending: list[int], final: list[int], budget: int, block_size: int) -> int:
    """Most KV blocks the sequences hold at once from now until the last ends, stepped as `Scheduler.schedule`
    steps them with blocks to spare: each step, in list order, a sequence computes min(pending, what is left of
    `budget`) tokens; one whose pending tokens are all computed samples a token (pending 1) or, with `final` tokens
    of K/V computed, ends and frees its blocks.

    held: computed tokens (K/V in blocks); pending: uncomputed tokens (0: its step ran, its token is not sampled
    yet). Steps whose pattern repeats (decodes, a prefill chunk of the same size) are taken together, and once
    every sequence decodes in every step the rest is closed-form (`_decode_peak`), so a call costs a few numpy
    passes per prefill still to run and per sequence ending during one."""
    h, p, f = (np.asarray(x, dtype=np.int64) for x in (held, pending, final))
    if not h.size:
        return 0
    peak = int(_blocks(h, block_size).sum())
    ends = (p == 0) & (h >= f)
    h, p, f = h[~ends], np.maximum(p[~ends], 1), f[~ends]
    while h.size:
        if h.size <= budget and (p == 1).all():
            return max(peak, _decode_peak(h, f - h, block_size))
        n = np.clip(budget - (np.cumsum(p) - p), 0, p)  # tokens each computes in the next step
        decode = (p == 1) & (n == 1)
        steps = np.where(decode, f - h, np.where(n == p, 1, p // np.maximum(n, 1)))  # steps this pattern holds
        k = int(steps[n > 0].min())
        h = h + n * k
        p = np.where(decode, 0, p - n * k)  # a decoding sequence samples after each of its k steps
        peak = max(peak, int(_blocks(h, block_size).sum()))
        live = (p > 0) | (h < f)
        h, p, f = h[live], np.maximum(p[live], 1), f[live]
    return peak


def _blocks(tokens: np.ndarray, block_size: int) -> np.ndarray:
    return -(-tokens // block_size)


def _decode_peak(held: np.ndarray, left: np.ndarray, block_size: int) -> int:
    """Most blocks held when every sequence computes one token a step and ends after `left` steps: the count just
    before some sequence ends, sum over the sequences with left_i >= T of ceil((held_i + T) / block_size) at T = a
    value of `left`, in O(n log n + n * block_size) through prefix counts (no [T, n] matrix for large batches)."""
    order = np.argsort(-left, kind="stable")
    held, left = held[order], left[order]
    q, r = np.divmod(held, block_size)
    last = np.flatnonzero(np.r_[left[1:] != left[:-1], True])  # each T's alive set is the prefix through `last`
    t = left[last]
    a, b = np.divmod(t, block_size)
    # ceil((held + T) / bs) = q + a + [r + b >= 1] + [r + b >= bs + 1], since 0 <= r + b <= 2 bs - 2
    at_least = np.cumsum(np.arange(block_size + 1)[None, :] <= r[:, None], axis=0)[last]  # [T, x]: #{r >= x}
    rows = np.arange(len(last))
    over1 = at_least[rows, np.clip(1 - b, 0, block_size)]
    over2 = at_least[rows, np.clip(block_size + 1 - b, 0, block_size)]
    return int((np.cumsum(q)[last] + (last + 1) * a + over1 + over2).max())
