"""Continuous batching: which sequences compute how many tokens this step.

One loop serves prefill and decode: each step has a token budget; running sequences go first (a decode
costs one token, an unfinished prompt continues in chunks), then waiting sequences start with what is
left (chunked prefill), after the computed blocks of a prefix they share with running ones or that finished
ones left kept (`PagedKVCache.share_prefix`). When the KV cache cannot hold a running sequence's next tokens, the
newest running sequence is preempted: its blocks go back at once (its published ones kept, so its recompute may
find them) and it re-enters the front of the waiting queue to be recomputed later. The engine asks the weight
planner for room before this happens: its demand (`blocks_demand`) is every block the running requests and the
waiting ones that have a seat will still need until they finish, so weights make room once, when the work
arrives, not one prefill chunk at a time. A running request still prefilling that finds no block while others
progress this step waits a step with its KV kept instead of preempting anyone: a preemption costs a recompute, and
the blocks come back as others finish or the weights give them up.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from loguru import logger

from pagedweight.sequence import Sequence, SequenceStatus


class BlockSpace(Protocol):
    """What the scheduler needs of the KV cache (pagedweight.kv_cache.PagedKVCache)."""

    @property
    def num_free_blocks(self) -> int: ...

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int: ...

    def tokens_fit(self, seq: Sequence) -> int: ...

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None: ...

    def share_prefix(self, seq: Sequence) -> int | None: ...

    def shared_blocks(self, seq: Sequence) -> int: ...

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
        # prompt tokens of the requests that started after looking for a shared prefix, each counted once as it first
        # started (a recompute after preemption finding its own kept blocks counted its generated tokens and again)
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0  # of those, tokens found computed (the sum of their num_cached_tokens)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

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
                    return seq
        return None

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """A running sequence is done: its blocks return to the cache immediately."""
        self.running.remove(seq)
        self.kv.free(seq)
        seq.finish(reason, error)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        logger.debug("preempted {} ({} tokens to recompute)", seq.request_id, seq.num_tokens)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        return min(seq.num_uncomputed_tokens, budget)

    def _fit(self, seq: Sequence, n: int) -> int:
        """Allocate for as many of seq's next n tokens as the free blocks hold (a prefill chunk shrinks)."""
        n = min(n, self.kv.tokens_fit(seq))
        if n > 0:
            self.kv.allocate(seq, n)
        return max(n, 0)

    def _fail(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Alone and still short: this context cannot fit in the KV cache at all."""
        self.kv.free(seq)
        seq.finish("error", f"context of {seq.num_tokens} tokens does not fit in the KV cache")
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
        """KV blocks that the running requests, and the waiting ones a seat is free for, still need until they
        finish (remaining prompt and every token still to generate), a waiting one's prefix shared with running
        requests or retained kept blocks left out (`shared_blocks`): the planner's target. An upper bound, since a
        request may stop early."""
        seats = max(self.max_num_seqs - len(self.running), 0)
        need = sum(self.kv.blocks_needed(seq, self.final_kv_tokens(seq) - seq.num_computed_tokens)
                   for seq in self.running)
        # less the blocks it will share with running requests or retained ones (an aged kept block it will take is
        # counted free: it stays)
        for seq in itertools.islice(self.waiting, seats):
            need += self.kv.blocks_needed(seq, self.final_kv_tokens(seq)) - self.kv.shared_blocks(seq)
        return need

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
            # the computed blocks of a prefix it shares with running requests or kept ones
            found = self.kv.share_prefix(seq) if seq.num_computed_tokens == 0 else None
            n = self._fit(seq, self._chunk(seq, budget))
            if n == 0:
                if not seq.num_preemptions:
                    seq.num_cached_tokens = 0  # it did not start: it used nothing it found
                if self.running:
                    self.kv.free(seq)  # a waiting request holds no block
                    seq.num_computed_tokens = 0
                    break
                self.waiting.popleft()
                self._fail(seq, batch)
                continue
            self.waiting.popleft()
            if found is not None and not seq.num_preemptions:
                self.prefix_query_tokens += seq.num_prompt_tokens
                self.prefix_hit_tokens += seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.perf_counter()
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch
