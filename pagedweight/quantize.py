"""Any-precision quantizer of expert blocks (DESIGN.md §2, Any-Precision LLM's seed + incremental upscaling).

Per output row: a sensitivity-weighted 1-D k-means seed with 2^s centroids, then each cluster is split in two
(children 2c, 2c+1) level by level up to the parent width P, so the b-bit index is always idx_P >> (P - b).

Everything runs on sorted rows. In 1-D, weighted k-means clusters are intervals of the sorted values, so a
clustering is a set of boundaries and the weighted sum / square sum of any cluster comes from prefix sums in O(1):
Lloyd steps are a searchsorted, and the split of every cluster into its two children is the exact optimum over
all split points (one vectorised pass over the row per level). All rows are independent, so blocks with the same
K are stacked into one row batch and processed by plain tensor ops on whatever device the weights are on.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedweight.bitplanes import pack_planes

# Floor added to every sensitivity, relative to the row mean: keeps weights with zero measured sensitivity
# (columns no calibration token touched) from being ignored entirely by the centroids.
SENSITIVITY_FLOOR = 1e-3


@dataclass
class QuantizedRows:
    """Result for a batch of rows: parent indices, one LUT per width, sensitivity-weighted error per width."""

    idx: torch.Tensor  # uint8 [N, K] parent indices
    luts: dict[int, torch.Tensor]  # b -> float16 [2^b, N] (transposed, SPEC layout)
    err: torch.Tensor  # float64 [N, P+1]: sum_k h (W - W_b)^2 with the true sensitivity; columns < seed are 0


@dataclass
class QuantizedBlock:
    """One expert linear block in checkpoint form."""

    planes: torch.Tensor  # uint32 [P, W, N]
    luts: dict[int, torch.Tensor]  # b -> float16 [2^b, N]
    sensitivity: torch.Tensor  # float64 [P+1]: s^b of the block (index b; entries < seed are 0)


def _centroids(s0: torch.Tensor, s1: torch.Tensor, bnd: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Weighted means of the clusters [bnd_j, bnd_{j+1}) from the prefix sums; empty clusters take `fallback`."""
    p0, p1 = s0.gather(1, bnd), s1.gather(1, bnd)
    m0, m1 = p0[:, 1:] - p0[:, :-1], p1[:, 1:] - p1[:, :-1]
    return torch.where(m0 > 0, m1 / m0.clamp_min(torch.finfo(m0.dtype).tiny), fallback)


def _cluster_of(bnd: torch.Tensor, k: int) -> torch.Tensor:
    """Cluster id of every sorted position t in [0, K): the j with bnd_j <= t < bnd_{j+1} (empty ones skipped)."""
    marks = torch.zeros(bnd.shape[0], k + 1, dtype=torch.int64, device=bnd.device)
    marks.scatter_add_(1, bnd[:, 1:-1], torch.ones_like(bnd[:, 1:-1]))
    return marks.cumsum(1)[:, :k]


def _seed(v: torch.Tensor, s0: torch.Tensor, s1: torch.Tensor, clusters: int,
          iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted Lloyd k-means on sorted rows, initialised at equal-sensitivity-mass quantiles.

    Returns boundaries [N, C+1] and centroids [N, C].
    """
    n, k = v.shape
    frac = torch.arange(1, clusters, device=v.device, dtype=v.dtype) / clusters
    inner = torch.searchsorted(s0.contiguous(), (s0[:, -1:] * frac).contiguous()).clamp(0, k)
    ends = torch.tensor([0, k], device=v.device).expand(n, 2)
    bnd = torch.cat([ends[:, :1], inner, ends[:, 1:]], 1)
    cent = _centroids(s0, s1, bnd, v.gather(1, bnd[:, :-1].clamp(max=k - 1)))
    for _ in range(iters):
        mids = (cent[:, :-1] + cent[:, 1:]) / 2
        new = torch.cat([ends[:, :1], torch.searchsorted(v, mids.contiguous()), ends[:, 1:]], 1)
        cent = _centroids(s0, s1, new, cent)
        if torch.equal(new, bnd):
            break
        bnd = new
    return bnd, cent


def _split_all(stats: torch.Tensor, bnd: torch.Tensor, k: int) -> torch.Tensor:
    """Split every cluster in two at the split point of least weighted SSE; returns boundaries [N, 2C+1].

    `stats [N, K+1, 3]` are the prefix sums of (h, h*v, h*v^2) along the sorted row.
    """
    n, c = bnd.shape[0], bnd.shape[1] - 1
    cid = _cluster_of(bnd, k)
    at_bnd = stats.gather(1, bnd.unsqueeze(-1).expand(-1, -1, 3))  # [N, C+1, 3], small
    start = at_bnd.gather(1, cid.unsqueeze(-1).expand(-1, -1, 3))  # prefix sums at each position's cluster start
    end = at_bnd.gather(1, (cid + 1).unsqueeze(-1).expand(-1, -1, 3))
    here = stats[:, :k]
    tiny = torch.finfo(stats.dtype).tiny

    def sse(m: torch.Tensor) -> torch.Tensor:  # an empty interval has m = 0 exactly, so its SSE is 0
        return m[..., 2] - m[..., 1] * m[..., 1] / m[..., 0].clamp_min(tiny)

    cost = sse(here - start) + sse(end - here)  # split at t: children [a, t) and [t, e); t = a keeps it whole
    del start, end
    best = torch.full((n, c), float("inf"), dtype=cost.dtype, device=cost.device)
    best = best.scatter_reduce(1, cid, cost, "amin")
    t = torch.arange(k, device=bnd.device).expand(n, k)
    cand = torch.where(cost <= best.gather(1, cid), t, k)
    split = torch.full((n, c), k, dtype=torch.int64, device=bnd.device).scatter_reduce(1, cid, cand, "amin")
    split = torch.minimum(split, bnd[:, 1:])  # an empty cluster (no candidate) splits into two empty children
    out = torch.empty(n, 2 * c + 1, dtype=torch.int64, device=bnd.device)
    out[:, 0::2], out[:, 1::2] = bnd, split
    return out


def quantize_rows(w: torch.Tensor, h: torch.Tensor | None = None, seed_bits: int = 3, parent_bits: int = 8,
                  lloyd_iters: int = 50) -> QuantizedRows:
    """Quantize every row of `w [N, K]` with sensitivities `h` ([N, K], [K] shared by rows, or None = uniform)."""
    if not 1 <= seed_bits <= parent_bits <= 8:
        raise ValueError(f"need 1 <= seed_bits <= parent_bits <= 8, got {seed_bits}, {parent_bits}")
    n, k = w.shape
    if not torch.isfinite(w).all():  # else the k-means runs on NaN and the fp16 check below blames the range
        bad = int((~torch.isfinite(w)).sum())
        raise ValueError(f"{bad} of the {w.numel()} weights are NaN or infinite: a damaged checkpoint")
    w64 = w.to(torch.float64)
    h64 = torch.ones_like(w64) if h is None else h.to(device=w.device, dtype=torch.float64).expand(n, k)
    mean_h = h64.mean(1, keepdim=True)
    h_eff = torch.where(mean_h > 0, h64 + SENSITIVITY_FLOOR * mean_h, torch.ones_like(h64))

    v, order = torch.sort(w64, dim=1)
    hs = h_eff.gather(1, order)
    center = (hs * v).sum(1, keepdim=True) / hs.sum(1, keepdim=True)
    v = v - center  # centred values keep the prefix-sum differences well conditioned
    stats = torch.zeros(n, k + 1, 3, dtype=torch.float64, device=w.device)
    stats[:, 1:, 0] = hs.cumsum(1)
    stats[:, 1:, 1] = (hs * v).cumsum(1)
    stats[:, 1:, 2] = (hs * v * v).cumsum(1)
    del hs
    s0, s1 = stats[..., 0], stats[..., 1]

    bnd, cent = _seed(v, s0, s1, 1 << seed_bits, lloyd_iters)
    levels = {seed_bits: bnd}
    for b in range(seed_bits, parent_bits):
        bnd = _split_all(stats, bnd, k)
        levels[b + 1] = bnd

    luts: dict[int, torch.Tensor] = {}
    err = torch.zeros(n, parent_bits + 1, dtype=torch.float64, device=w.device)
    idx = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    idx.scatter_(1, order, _cluster_of(levels[parent_bits], k).to(torch.uint8))
    parent_idx = idx.to(torch.int64)
    cent_b = cent
    for b in range(seed_bits, parent_bits + 1):
        # an empty cluster keeps its parent's centroid (the seed's Lloyd centroid at the seed width)
        fallback = cent_b if b == seed_bits else cent_b.repeat_interleave(2, dim=1)
        cent_b = _centroids(s0, s1, levels[b], fallback)
        lut = (cent_b + center).to(torch.float16)
        if not torch.isfinite(lut).all():  # else inf entries, and inf / NaN outputs from the served model
            raise ValueError(f"a {b}-bit centroid is beyond float16's range (weights up to {w.abs().max().item():.4g} "
                             "in magnitude): LUTs are float16")
        luts[b] = lut.t().contiguous()
        w_b = torch.gather(lut.to(torch.float64), 1, parent_idx >> (parent_bits - b))
        err[:, b] = (h64 * (w64 - w_b) ** 2).sum(1)
    return QuantizedRows(idx=idx, luts=luts, err=err)


def quantize_blocks(weights: list[torch.Tensor], sens: list[torch.Tensor | None], seed_bits: int = 3,
                    parent_bits: int = 8, device: str | torch.device | None = None) -> list[QuantizedBlock]:
    """Quantize blocks of equal K as one row batch on `device`; returns them packed, on the CPU."""
    device = torch.device(device) if device is not None else weights[0].device
    rows = torch.cat([w.to(device) for w in weights])
    if all(h is None for h in sens):
        h = None
    else:
        h = torch.cat([torch.ones(w.shape, device=device) if s is None
                       else s.to(device=device, dtype=torch.float32).expand(w.shape) for w, s in zip(weights, sens)])
    q = quantize_rows(rows, h, seed_bits, parent_bits)
    out, start = [], 0
    for w in weights:
        stop = start + w.shape[0]
        out.append(QuantizedBlock(
            planes=pack_planes(q.idx[start:stop], parent_bits).cpu(),
            luts={b: lut[:, start:stop].cpu().contiguous() for b, lut in q.luts.items()},
            sensitivity=q.err[start:stop].sum(0).cpu()))
        start = stop
    return out
