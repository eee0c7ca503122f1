"""Request state: one `Sequence` per request, from arrival to its finish reason.

A sequence is the unit the scheduler moves between the waiting and running queues. Its KV blocks are
listed in `block_table`; `num_computed_tokens` counts the tokens whose K/V are in those blocks, so a
preempted sequence simply drops its blocks, resets that count, and is recomputed later (prompt and the
tokens generated so far) without changing what it generates.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedweight.sampling import SamplingParams


DETOKENIZE_CONTEXT = 5  # prompt tokens the first generated token's text is decoded after (vLLM's)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None  # a seeded request's random stream (sampling.make_generator)
    arrival_time: float = field(default_factory=time.perf_counter)
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V sit in block_table's blocks
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # None | "stop" | "length" | "abort" | "error"
    error: str | None = None
    text: str = ""  # detokenized completion, cut at a stop string
    sent_text_len: int = 0  # how much of `text` earlier outputs already carried
    sent_tokens: int = 0  # how many generated tokens earlier outputs already carried
    # incremental detokenization: completion tokens [prefix, read) are already text; prefix starts DETOKENIZE_CONTEXT
    # prompt tokens back, so the first token's text is what it adds to the prompt's (a SentencePiece decoder strips
    # the leading space of a text that starts with it: " the" came out "the" after "The capital is"; vLLM's offsets)
    prefix_offset: int = 0
    read_offset: int = 0
    # when the scheduler first gave it a step: its time in the queue ends there (a preempted request keeps the first)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one wall time per generated token
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per generated token, if params.logprobs is set
    # per prompt token after the first, if params.prompt_logprobs is set: entry i scores prompt token i + 1 (from
    # position i's logits); a recompute after preemption scores only the positions not yet here
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose K/V it found computed when it started (prefix sharing)
    # generated token ids as an array (grown by doubling), kept for requests whose sampler reads them
    # (SamplingParams.reads_history): it counts them every step, and a list would be converted anew each time
    history_ids: np.ndarray | None = None
    # counted once: every RequestOutput of the request carries prompt_token_ids itself (a copy per step was O(prompt)
    # host work per running request between two launches), so what a caller does to that list changes nothing here
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.prefix_offset = -min(DETOKENIZE_CONTEXT, self.num_prompt_tokens)
        if self.params.reads_history:
            self.history_ids = np.empty(16, dtype=np.int64)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def generated_ids(self) -> np.ndarray | None:
        """The generated token ids (a view), if the sampler reads them (SamplingParams.reads_history)."""
        return None if self.history_ids is None else self.history_ids[:self.num_completion_tokens]

    def append_token(self, token_id: int, now: float) -> None:
        self.token_ids.append(token_id)
        if self.history_ids is not None:
            n = self.num_completion_tokens
            if n > len(self.history_ids):
                self.history_ids = np.concatenate([self.history_ids, np.empty_like(self.history_ids)])
            self.history_ids[n - 1] = token_id
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_times.append(now)

    def finish(self, reason: str, error: str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.error = error
