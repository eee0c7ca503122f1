"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeded per request.

Every request owns its own `torch.Generator`, so a seeded request draws the same tokens whether it
runs alone or batched with others (batch composition never shifts another request's random stream).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


OUTPUT_KINDS = ("cumulative", "delta", "final_only")


@dataclass
class SamplingParams:
    """How one request picks its tokens and when it stops (the engine contract of SPEC.md)."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # what each RequestOutput of the request carries (vLLM's RequestOutputKind): "cumulative" every token so far,
    # "delta" only the tokens new since its previous output, "final_only" one output when it finishes. Building a
    # cumulative output copies the request's generated tokens: O(generated) host work per request every step,
    # between a step's token read and the next launch; delta makes it O(new tokens), final_only skips it
    output_kind: str = "cumulative"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> "SamplingParams":
        """Raise ValueError with a one-line reason when a field is out of range; returns self."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be None or an integer >= 0, got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {self.output_kind!r}")
        return self


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A request's private random stream; unseeded requests draw their seed from torch's global RNG."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
    return gen


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Scale one row [V] by temperature and mask (to -inf) what top-k and top-p exclude."""
    logits = logits.float() / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (the top token always stays)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class Sampler:
    """Picks one next token per row of last-position logits."""

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator]) -> list[int]:
        """logits [B, V] (any float dtype); returns B token ids."""
        greedy = logits.argmax(dim=-1).tolist()
        out = []
        for row, (p, gen) in enumerate(zip(params, generators)):
            if p.greedy:
                out.append(greedy[row])
                continue
            probs = torch.softmax(filter_logits(logits[row], p.temperature, p.top_k, p.top_p), dim=-1)
            out.append(int(torch.multinomial(probs, 1, generator=gen).item()))
        return out
