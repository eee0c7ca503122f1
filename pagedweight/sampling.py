"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeded per request.

Every request owns its own random stream (a host-side numpy Philox generator, one uniform per sampled token), so a
seeded request draws the same tokens whether it runs alone or batched with others (batch composition never shifts
another request's stream).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
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


def make_generator(seed: int | None) -> np.random.Generator:
    """A request's private random stream, on the host: the sampler takes one uniform of it per sampled token, so a
    batch's draws cost no device launch per row. Unseeded requests draw their seed from torch's global RNG."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    return np.random.Generator(np.random.Philox(seed))


# Bytes of [rows, V] temporaries the sampler allocates at once: a chunk of rows holds at most SAMPLE_BYTES_PER_ENTRY
# per logit (the sort's values and int64 indices, the probabilities, their float64 copy and CDF; counted from the
# code, not measured). The engine's start-up profile samples its widest decode step with a top-p filter, so the
# activation reserve holds a chunk's worth (engine.py). 64 MiB: 13 rows of a 152k vocabulary a chunk.
SAMPLE_CHUNK_BYTES = 64 << 20
SAMPLE_BYTES_PER_ENTRY = 32


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], uniforms: list[float]) -> torch.Tensor:
    """One token per row of logits [R, V] from softmax(logits / T) restricted by top-k, then top-p (over the
    top-k's renormalised probabilities, vLLM's order), drawn by inverting the row's CDF at its uniform: batched over
    the rows, no host read. Returns [R] int64 on logits' device.

    Rows without a filter use the vocabulary's order; with one, the rows are sorted once (torch.topk when every row
    has a top-k, else a full sort) and the kept tokens are a prefix. The CDF is summed in float64: a float32 sum of
    152k probabilities rounds each token's interval by up to 6e-8."""
    rows, vocab = logits.shape
    dev = logits.device
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    filtered = any(top_k) or any(p.top_p < 1.0 for p in params)
    host = torch.tensor([[p.temperature for p in params], [k or vocab for k in top_k], [p.top_p for p in params],
                         uniforms], dtype=torch.float64)
    temperature, k, top_p, u = host.to(dev).unbind(0)  # one copy to the device
    x = logits.float() / temperature.float()[:, None]
    order = None
    if filtered:
        width = max(top_k) if all(top_k) else vocab
        x, order = torch.topk(x, width, dim=-1) if width < vocab else torch.sort(x, dim=-1, descending=True)
        x = x.masked_fill(torch.arange(width, device=dev) >= k[:, None], float("-inf"))
    probs = torch.softmax(x, dim=-1)
    del x  # the CDF's float64 sum is the peak: 28 bytes a logit with the sort's indices live
    cdf = probs.double().cumsum(dim=-1)
    if filtered:  # keep a token while the mass strictly before it is below top_p (the top token always stays)
        kept = torch.searchsorted(cdf, top_p[:, None]).clamp_(max=cdf.shape[1] - 1) + 1
        total = cdf.gather(1, kept - 1)
    else:
        total = cdf[:, -1:]
    # the first token whose CDF exceeds u * total; the target stays below total, so the token has mass and is kept
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    idx = torch.searchsorted(cdf, target, right=True)
    return (idx if order is None else order.gather(1, idx))[:, 0]


class Sampler:
    """Picks one next token per row of last-position logits: every row of a step in a few batched ops and one host
    read (a per-row loop cost a dozen launches and a host read per sampled row)."""

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[np.random.Generator | None]) -> list[int]:
        """logits [B, V] (any float dtype); returns B token ids. Sampled rows take one uniform of their generator."""
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled:
            return logits.argmax(dim=-1).tolist()
        uniforms = [generators[i].random() for i in sampled]
        chunk = max(1, SAMPLE_CHUNK_BYTES // (SAMPLE_BYTES_PER_ENTRY * logits.shape[1]))
        if len(sampled) == len(params):
            picks = [sample_rows(logits[i:i + chunk], params[i:i + chunk], uniforms[i:i + chunk])
                     for i in range(0, len(params), chunk)]
            return torch.cat(picks).tolist()
        tokens = logits.argmax(dim=-1)
        for i in range(0, len(sampled), chunk):
            rows = torch.tensor(sampled[i:i + chunk], device=logits.device)
            tokens[rows] = sample_rows(logits.index_select(0, rows), [params[r] for r in sampled[i:i + chunk]],
                                       uniforms[i:i + chunk])
        return tokens.tolist()
