"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeded per request.

A seeded request owns its own `torch.Generator`, so batch composition never shifts its random stream; unseeded
requests share the device's global RNG. Its draws are the same alone or batched except where logits tie at a top-k or
top-p cut: which tied tokens a cut keeps depends on the path its step takes (top-k keeps k columns; the nucleus cut
kernel, taken from 4 rows, keeps every tie), so with bf16 logits, whose ties are common, a seeded request can draw
differently beside other requests than alone.
"""
from __future__ import annotations

import math
from collections.abc import Collection
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np
import torch

from pagedweight.host_copy import HostCopy


OUTPUT_KINDS = ("cumulative", "delta", "final_only")
# vLLM's temperature rules: below 1e-5 greedy, else at least 0.01 (smaller ones overflow the tempered logits to inf,
# and the pick becomes the first token with a positive logit)
GREEDY_BELOW, MIN_TEMPERATURE = 1e-5, 1e-2
MAX_LOGPROBS = 20  # the OpenAI API's top_logprobs bound
MAX_PENALTY = 2.0  # the OpenAI API's presence_penalty / frequency_penalty bound
MAX_REPETITION_PENALTY = 10.0  # far beyond use (1.0-1.5 is usual); bounds what a request can ask
MAX_LOGIT_BIAS, MAX_BIASED_TOKENS = 100.0, 300  # the OpenAI API's logit_bias bounds


@dataclass
class SamplingParams:
    """How one request picks its tokens and when it stops."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    # vLLM's min_p: keep the tokens whose probability (after temperature) is at least min_p x the largest one's;
    # applied before top-k and top-p, as vLLM orders them. 0 = off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    # vLLM's stop_token_ids: the request ends ("stop") once it generates one of these, kept in its tokens as EOS is
    stop_token_ids: list[int] = field(default_factory=list)
    # vLLM's min_tokens: before this many are generated, EOS (unless ignore_eos) and stop_token_ids are never sampled
    # and no stop condition but max_tokens ends the request
    min_tokens: int = 0
    ignore_eos: bool = False
    # what each RequestOutput of the request carries (vLLM's RequestOutputKind): "cumulative" every token so far,
    # "delta" only the tokens new since its previous output, "final_only" one output when it finishes. Building a
    # cumulative output copies the request's generated tokens: O(generated) host work per request every step,
    # between a step's token read and the next launch; delta makes it O(new tokens), final_only skips it
    output_kind: str = "cumulative"
    # log-probabilities each generated token reports (vLLM's SamplingParams.logprobs): its own and those of the
    # `logprobs` most likely tokens, under the model's distribution (log_softmax of the raw logits, before
    # temperature and filters); None: none
    logprobs: int | None = None
    # the same for every prompt token after the first (vLLM's prompt_logprobs; what OpenAI's `echo` with `logprobs`
    # and lm-evaluation-harness's loglikelihood read): RequestOutput.prompt_logprobs, None for the first token
    prompt_logprobs: int | None = None
    # the OpenAI API's penalties on the tokens generated so far: each token's logit less frequency_penalty x its count
    # and presence_penalty if it occurs (vLLM's reading: the prompt's tokens do not count), in [-2, 2]
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's and transformers' repetition_penalty over the prompt's and the generated tokens: a positive logit is
    # divided by it, a negative one multiplied (after the logit bias, before the two penalties above, vLLM's order);
    # 1 = off
    repetition_penalty: float = 1.0
    # token id -> added to its logit before sampling (or the greedy pick), in [-100, 100], at most 300 tokens
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    def clone(self, **changes) -> "SamplingParams":
        """A copy with its own lists and dict (a request's: what the caller does to its object later, a stop string
        or a logit_bias entry added for the next request, reaches neither this request nor its cached arrays)."""
        own = {name: type(v)(v) for name in ("stop", "stop_token_ids", "logit_bias")
               if isinstance(v := getattr(self, name), (list, dict))}
        return replace(self, **{**own, **changes})

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def reads_history(self) -> bool:
        """The sampler reads the ids it generated so far (presence / frequency penalties, min_tokens' count)."""
        return self.penalized or self.min_tokens > 0

    @property
    def adjusts(self) -> bool:
        """Its logits change before the pick (penalties, a logit bias, stop tokens masked until min_tokens): the
        sampler takes its row apart."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty or self.min_tokens
                    or self.repetition_penalty != 1.0)

    @cached_property
    def bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """logit_bias as (int64 token ids, float32 biases), built once: the sampler reads them every step (a dict of
        100 tokens in 256 rows took 21 ms a step as Python tuples, sampler_bench-…-s36-penalties.json)."""
        bias = self.logit_bias or {}
        return np.fromiter(bias.keys(), np.int64, len(bias)), np.fromiter(bias.values(), np.float32, len(bias))

    def validate(self) -> "SamplingParams":
        """Raise ValueError with a one-line reason when a field is out of range; returns self."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or \
                not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 0 (0 or -1 = off), got {self.top_k!r}")
        if self.top_k == -1:  # vLLM's spelling of off
            self.top_k = 0
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or \
                not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if not isinstance(self.stop_token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (integers >= 0), got {self.stop_token_ids!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**64):  # torch.Generator.manual_seed's range
            raise ValueError(f"seed must be None or an integer in [0, 2**64), got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {self.output_kind!r}")
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 < r <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], got {r!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {v!r}")
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict) or len(bias) > MAX_BIASED_TOKENS:
                raise ValueError(f"logit_bias must be a dict of at most {MAX_BIASED_TOKENS} token ids, got {bias!r}")
            for t, v in bias.items():
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {t!r}")
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v)
                                                                                  and abs(v) <= MAX_LOGIT_BIAS):
                    raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {v!r}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {n!r}")
        return self


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A seeded request's private random stream on the device; None for an unseeded request, which draws from the
    device's global RNG with the rest of its step (one launch for all such rows, reproducible under
    torch.manual_seed)."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


# The sampler's [rows, V] temporaries stay within SAMPLE_CHUNK_BYTES: it takes the rows in chunks, priced per logit at
# what the H200 measured (peak allocated beyond the logits, sampler_bench-nvidia-h200-20261203-s35-ab2.json at 13 rows
# of 151,936): 49.2 bytes with a top-k or top-p filter (the sort's values and int64 indices and its own buffers,
# probabilities and their sum, scores back in vocabulary order), 8.1 without (the scores and the noise; top-p through
# the nucleus cut kernel adds its mask, priced at 1: 51.0 MiB in 44-row chunks, …-20261205-s40-nucleus3.json), and
# about 4 more where a step mixes greedy and sampled rows (their logits gathered: 11.9 bytes, 85.2 MiB at 49 rows,
# …-s35-chunks.json). Rows whose logits are adjusted (penalties, logit bias) add their token counts, 4 bytes a logit,
# priced at 5: greedy rows with penalties allocated 64.4 MiB in 55-row chunks priced at 4 (the ids and their
# offsets beside the counts, sampler_bench-nvidia-h200-20261203-s36-penalties.json). The engine's start-up profile
# samples its widest decode step through the sort (top-k and top-p), so the activation reserve holds a chunk's worth.
SAMPLE_CHUNK_BYTES = 64 << 20
FILTERED_BYTES_PER_ENTRY, PLAIN_BYTES_PER_ENTRY, GATHERED_BYTES_PER_ENTRY = 50, 9, 4
ADJUSTED_BYTES_PER_ENTRY = 5
MASK_BYTES_PER_ENTRY = 1  # min-p's or the nucleus cut's boolean mask (computed, not measured)
# sampled rows of a step from which top-p takes the nucleus cut kernel rather than the sort. On the H200 one call at
# temperature 0.8, top-p 0.9 took with the kernel 0.38 / 0.37 / 0.48 / 0.39 / 0.38 / 2.13 ms at 1 / 4 / 8 / 16 / 32 /
# 256 rows, with the sort 0.29 / 0.47 / 0.54 / 1.02 / 1.96 / 15.2 (sampler_bench-nvidia-h200-20261205-s40-nucleus3.json)
NUCLEUS_KERNEL_MIN_ROWS = 4
# the widest top-k that rows taking the nucleus cut kernel apply as a threshold (the k-th largest logit, from
# torch.topk: its values and int64 indices and a padded copy of the values, priced at 16 bytes a column, computed);
# a wider one sorts
THRESHOLD_TOP_K_MAX, THRESHOLD_BYTES_PER_K = 1024, 16


def _per_row(values: list, dev: torch.device) -> torch.Tensor | float:
    """A column [R, 1] of per-row values on the device, or the one value they all share (no copy, no kernel). The copy
    does not wait for the device: the sampler's work queues behind the forward that makes the logits."""
    if all(v == values[0] for v in values):
        return values[0]
    return torch.tensor(values, dtype=torch.float32).to(dev, non_blocking=True)[:, None]


def nucleus_drop(kept: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p on logits sorted in descending order [R, W]: True where a token goes, because the mass before it already
    reaches the row's top_p [R, 1], i.e. the mass from it to the end is at most 1 - top_p (vLLM's form: a float32
    running sum from the top reaches 1.0 before the tail and then dropped tail tokens even at top_p 1; a sum from
    the tail keeps their small masses). The most likely token always stays."""
    tail = torch.softmax(kept, dim=-1).flip(-1).cumsum_(dim=-1).flip(-1)
    drop = tail <= 1.0 - top_p
    drop[:, 0] = False
    return drop


def sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None], nucleus_kernel: bool = False) -> torch.Tensor:
    """One token per row of logits [R, V] from softmax(logits / T) restricted by min-p, top-k, then top-p (over the
    top-k's renormalised probabilities, vLLM's order): the Gumbel-max draw argmax(logits / T - log E), E ~ Exp(1)
    per token, over the kept tokens. Batched over the rows with no host read; returns [R] int64 on logits' device.
    Min-p needs no sort: p >= min_p x p_max is x >= max(x) + log(min_p) on the tempered logits x.

    E is drawn over the whole vocabulary in its order, from the row's generator (None: the global RNG, one launch for
    all such rows), so a seeded row's tokens do not depend on the rest of its batch. With a filter the rows are
    sorted once (torch.topk when every row has a top-k, else a full sort) to find the kept tokens; with
    `nucleus_kernel` (a GPU), rows with top-p of which some have no top-k take the nucleus cut kernel instead
    (cuda/sampling_kernels.py: no sort, the same kept tokens except that ties at the cut all stay), after any top-k
    as a threshold (ties at the k-th logit all stay, as in vLLM's top-k alone; `_cuts_nucleus`)."""
    rows, vocab = logits.shape
    dev = logits.device
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    x = logits.float() / _per_row([max(p.temperature, MIN_TEMPERATURE) for p in params], dev)
    if any(p.min_p > 0.0 for p in params):
        floor = _per_row([math.log(p.min_p) if p.min_p > 0.0 else float("-inf") for p in params], dev)
        x.masked_fill_(x < x.max(dim=-1, keepdim=True).values + floor, float("-inf"))
    nucleus = any(p.top_p < 1.0 for p in params)
    if nucleus_kernel and _cuts_nucleus(top_k, nucleus):
        from pagedweight.cuda.sampling_kernels import top_p_cut
        if any(top_k):  # top-k as a threshold: the k-th largest logit (vLLM's order: top-k, then top-p over it)
            width = max(top_k)
            top = torch.nn.functional.pad(torch.topk(x, width, dim=-1).values, (0, 1), value=float("-inf"))
            kth = torch.tensor([k - 1 if k else width for k in top_k]).to(dev, non_blocking=True)
            x.masked_fill_(x < top.gather(1, kth[:, None]), float("-inf"))
            del top
        cut = top_p_cut(x, torch.tensor([p.top_p for p in params], dtype=torch.float32).to(dev, non_blocking=True))
        x.masked_fill_(x < cut[:, None], float("-inf"))
    elif any(top_k) or nucleus:
        width = max(top_k) if all(top_k) else vocab
        kept, order = torch.topk(x, width, dim=-1) if width < vocab else torch.sort(x, dim=-1, descending=True)
        if any(k != width for k in top_k):
            k = _per_row([k or vocab for k in top_k], dev)
            kept.masked_fill_(torch.arange(width, device=dev) >= k, float("-inf"))
        if nucleus:
            kept.masked_fill_(nucleus_drop(kept, _per_row([p.top_p for p in params], dev)), float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter_(1, order, kept)  # back in vocabulary order
        del kept, order
    noise = torch.empty_like(x)
    if all(g is None for g in generators):
        noise.exponential_()
    else:
        for row, gen in zip(noise, generators):
            row.exponential_(generator=gen)
    return x.sub_(noise.clamp_(min=torch.finfo(noise.dtype).tiny).log_()).argmax(dim=-1)


def adjust_logits(x: torch.Tensor, params: list[SamplingParams], history: list[np.ndarray | None],
                  eos_token_ids: Collection[int] = (), seen: list[np.ndarray | None] | None = None) -> None:
    """In place on float32 rows x [R, V]: each row's logit_bias added, its repetition_penalty applied to the tokens
    it has seen (`seen[i]`: its prompt's and generated ids), then frequency_penalty x count and presence_penalty x
    (count > 0) subtracted for the tokens of its history (the ids it generated so far; None: none yet): vLLM's
    order. The counts of a chunk are one [R, V] float32 tensor filled by a single index_add_ of every history's
    ids (whole numbers: exact in any order), from one host-to-device copy. A row short of its min_tokens gets -inf on
    its stop tokens (its stop_token_ids, and `eos_token_ids` unless it ignores EOS), as vLLM's min-tokens processor."""
    rows, vocab = x.shape
    dev = x.device
    banned = [i * vocab + t for i, (p, h) in enumerate(zip(params, history))
              if p.min_tokens > (0 if h is None else len(h))
              for t in (*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)) if t < vocab]
    if banned:
        x.view(-1).index_fill_(0, torch.tensor(banned).to(dev, non_blocking=True), float("-inf"))
    biased = [(i, p.bias_arrays) for i, p in enumerate(params) if p.logit_bias]
    if biased:
        flat = torch.from_numpy(np.concatenate([ids + i * vocab for i, (ids, _) in biased]))
        values = torch.from_numpy(np.concatenate([v for _, (_, v) in biased]))
        x.view(-1).index_add_(0, flat.to(dev, non_blocking=True), values.to(dev, non_blocking=True))
    repeated = [(i, np.unique(seen[i]), p.repetition_penalty) for i, p in enumerate(params)
                if p.repetition_penalty != 1.0 and seen is not None and seen[i] is not None]
    if repeated:
        flat = torch.from_numpy(np.concatenate([u + i * vocab for i, u, _ in repeated])).to(dev, non_blocking=True)
        factor = torch.from_numpy(np.concatenate([np.full(len(u), r, np.float32) for _, u, r in repeated]))
        factor = factor.to(dev, non_blocking=True)
        picked = x.view(-1)[flat]
        x.view(-1)[flat] = torch.where(picked > 0, picked / factor, picked * factor)
    ids = [h + i * vocab for i, (p, h) in enumerate(zip(params, history)) if p.penalized and h is not None and len(h)]
    if not ids:
        return
    flat = torch.from_numpy(np.concatenate(ids)).to(dev, non_blocking=True)
    counts = torch.zeros_like(x)
    counts.view(-1).index_add_(0, flat, torch.ones(len(flat), dtype=x.dtype, device=dev))
    _subtract_scaled(x, counts, [p.frequency_penalty for p in params])
    _subtract_scaled(x, counts.clamp_(max=1.0), [p.presence_penalty for p in params])  # occurs or not


def _subtract_scaled(x: torch.Tensor, counts: torch.Tensor, per_row: list[float]) -> None:
    """x -= per_row[i] x counts[i], in place (nothing when every value is 0)."""
    if any(per_row):
        scale = _per_row(per_row, x.device)
        if isinstance(scale, torch.Tensor):
            x.addcmul_(counts, scale, value=-1.0)
        else:
            x.add_(counts, alpha=-scale)


class Sampler:
    """Picks one next token per row of last-position logits: every row of a step in a few batched ops and one host
    read (a per-row loop cost a dozen launches and a host read per sampled row). `nucleus_min_rows`: sampled rows
    of a step from which top-p may take the nucleus cut kernel on a GPU (sampler_bench's arms set it)."""

    def __init__(self, nucleus_min_rows: int = NUCLEUS_KERNEL_MIN_ROWS) -> None:
        self.nucleus_min_rows = nucleus_min_rows

    def __call__(self, *args, **kwargs) -> list[int]:
        """`pick`, read at once: the B token ids."""
        return self.pick(*args, **kwargs).tolist()

    def pick(self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
             history: SequenceOf[np.ndarray | None] | None = None,
             eos_token_ids: Collection[int] = (), seen: SequenceOf[np.ndarray] | None = None) -> HostCopy:
        """logits [B, V] (any float dtype); returns B token ids on their way to the host (`HostCopy.tolist()`): the
        engine reads them after queueing an observed step's routing fold and copy, which the read does not wait for.
        generators: each row's (None: the global RNG). history[i]: row i's generated token ids, for its penalties and
        min_tokens (`adjust_logits`; None: none yet), read only for adjusted rows; `eos_token_ids`: what min_tokens
        keeps a row from sampling besides its stop_token_ids; seen[i]: row i's prompt and generated ids, read only
        for a repetition penalty. Rows whose logits are adjusted are gathered and adjusted apart (greedy ones and
        sampled ones), so `logits` stay the model's own: log-probabilities are read from them afterwards. The rows
        are classed in one pass over params: at 256 rows each further pass cost the step ~0.1 ms of host time
        (sampler_bench-cpu-2c-20261203-s36-host.json)."""
        sampled, adjusted = [], []
        for i, p in enumerate(params):
            if p.adjusts:
                adjusted.append(i)
            elif not p.greedy:
                sampled.append(i)
        if not sampled and not adjusted:
            return HostCopy.start(logits.argmax(dim=-1))
        if len(sampled) == len(params):  # no gather
            kernel = logits.is_cuda and len(params) >= self.nucleus_min_rows
            chunk = _chunk_rows(logits.shape[1], params, gathered=False, adjusted=False, nucleus_kernel=kernel)
            picks = [sample_rows(logits[i:i + chunk], params[i:i + chunk], generators[i:i + chunk], kernel)
                     for i in range(0, len(params), chunk)]
            return HostCopy.start(torch.cat(picks) if len(picks) > 1 else picks[0])
        tokens = logits.argmax(dim=-1)
        groups = (sampled, [i for i in adjusted if params[i].greedy], [i for i in adjusted if not params[i].greedy])
        for rows, adjust in zip(groups, (False, True, True)):
            if not rows:
                continue
            ps = [params[r] for r in rows]
            kernel = logits.is_cuda and len(rows) >= self.nucleus_min_rows
            chunk = _chunk_rows(logits.shape[1], ps, gathered=True, adjusted=adjust, nucleus_kernel=kernel)
            for c in range(0, len(rows), chunk):
                index = torch.tensor(rows[c:c + chunk]).to(logits.device, non_blocking=True)
                x = logits.index_select(0, index).float()
                if adjust:
                    part = rows[c:c + chunk]
                    adjust_logits(x, ps[c:c + chunk], [None if history is None else history[r] for r in part],
                                  eos_token_ids, [None if seen is None or params[r].repetition_penalty == 1.0
                                                  else seen[r] for r in part])
                tokens[index] = x.argmax(dim=-1) if ps[0].greedy else \
                    sample_rows(x, ps[c:c + chunk], [generators[r] for r in rows[c:c + chunk]], kernel)
        return HostCopy.start(tokens)

    @staticmethod
    def logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int], counts: list[int]) -> list[dict[int, float]]:
        """For each of `rows` of logits [B, V]: {token id: log-probability} of its sampled token and of its counts[i]
        most likely tokens (the raw logits' log-softmax). Batched in chunks of the sampler's bound (the rows' logits
        gathered and `_pick`'s temporary: 8 bytes a logit); two host reads in all."""
        dev, k, picked = logits.device, max(counts), []
        chunk = max(1, SAMPLE_CHUNK_BYTES // (PLAIN_BYTES_PER_ENTRY * logits.shape[1]))
        for c in range(0, len(rows), chunk):
            index = torch.tensor(rows[c:c + chunk]).to(dev, non_blocking=True)
            picked.append(_pick(logits.index_select(0, index), tokens[c:c + chunk], k))
        return _entries(picked, tokens, counts)

    @staticmethod
    @torch.inference_mode()
    def prompt_logprobs(hidden: torch.Tensor, head: torch.nn.Module, tokens: list[int],
                        counts: list[int]) -> list[dict[int, float]]:
        """The same for prompt positions, from their final hidden states [R, H]: row i's entry scores tokens[i] (the
        prompt's next token) and its counts[i] most likely tokens. The LM head runs on a chunk of rows at a time:
        a prefill chunk of any length keeps at most SAMPLE_CHUNK_BYTES of [rows, V] temporaries (the chunk's logits
        in the model's dtype and `_pick`'s temporary of the same size), never the [T, V] logits of the whole chunk.
        Two host reads."""
        k, picked = max(counts), []
        chunk = max(1, SAMPLE_CHUNK_BYTES // ((2 * hidden.element_size() + 1) * head.weight.shape[0]))
        for c in range(0, len(tokens), chunk):
            picked.append(_pick(head(hidden[c:c + chunk]), tokens[c:c + chunk], k))
        return _entries(picked, tokens, counts)


def _cuts_nucleus(top_k: list[int], nucleus: bool) -> bool:
    """Whether sampled rows that may take the nucleus cut kernel do, from each row's top-k (0: none) and whether some
    row has top-p: some row has no top-k (when every row has one there is no full sort to spare: torch.topk of the
    widest k columns stands for it), and every top-k is at most THRESHOLD_TOP_K_MAX (it becomes a threshold, the
    k-th largest logit, from torch.topk)."""
    return nucleus and not all(top_k) and max(top_k, default=0) <= THRESHOLD_TOP_K_MAX


def _chunk_rows(vocab: int, params: list[SamplingParams], gathered: bool, adjusted: bool, nucleus_kernel: bool) -> int:
    """Rows a chunk of the sampler takes within SAMPLE_CHUNK_BYTES (greedy rows: only gathered and adjusted);
    `nucleus_kernel`: whether the step may take the nucleus cut kernel (no sort: a mask, as min-p's, after any top-k
    threshold's torch.topk columns)."""
    sampled = [p for p in params if not p.greedy]
    top_k, top_p = [p.top_k if 0 < p.top_k < vocab else 0 for p in sampled], any(p.top_p < 1.0 for p in sampled)
    cut = nucleus_kernel and _cuts_nucleus(top_k, top_p)
    per_entry = (FILTERED_BYTES_PER_ENTRY if (any(top_k) or top_p) and not cut else
                 PLAIN_BYTES_PER_ENTRY if sampled else 0) + \
        (MASK_BYTES_PER_ENTRY if any(p.min_p > 0.0 for p in sampled) or cut else 0) + \
        (GATHERED_BYTES_PER_ENTRY if gathered else 0) + (ADJUSTED_BYTES_PER_ENTRY if adjusted else 0)
    per_row = per_entry * vocab + (THRESHOLD_BYTES_PER_K * max(top_k) if cut and any(top_k) else 0)
    return max(1, SAMPLE_CHUNK_BYTES // max(per_row, 1))


def _pick(logits: torch.Tensor, tokens: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of logits [r, V] -> ([r, 1 + k] float32 log-probabilities: tokens[i]'s, then the k largest; [r, k] their
    ids), on the device. The log-softmax is taken only where it is read: the picked logits minus each row's
    logsumexp, whose exponentials ([r, V] in the logits' dtype, the one temporary) are summed in float32; with fp16
    logits its error (~1e-4 nats) is far below their own rounding (up to 0.008 at a logit of 16). k = 1 is the
    row's maximum, found with the logsumexp's."""
    best, best_id = logits.max(dim=-1, keepdim=True)
    lse = (logits - best).exp_().sum(dim=-1, keepdim=True, dtype=torch.float32).log_().add_(best.float())
    chosen = logits.gather(1, torch.tensor(tokens).to(logits.device, non_blocking=True)[:, None])
    if k == 1:
        top_values, top_ids = best, best_id
    else:
        top_values, top_ids = logits.topk(k, dim=-1)
    return torch.cat([chosen, top_values], dim=1).float().sub_(lse), top_ids


def _entries(picked: list[tuple[torch.Tensor, torch.Tensor]], tokens: list[int],
             counts: list[int]) -> list[dict[int, float]]:
    """`_pick`'s chunks -> per row {token id: log-probability} of tokens[i] and of its counts[i] most likely ids (two
    host reads)."""
    values = torch.cat([v for v, _ in picked]).tolist()
    ids = torch.cat([i for _, i in picked]).tolist()
    out = []
    for tok, n, vals, top_ids in zip(tokens, counts, values, ids):
        entry = dict(zip(top_ids[:n], vals[1:n + 1]))
        entry[tok] = vals[0]
        out.append(entry)
    return out
