"""Torch reference twins of the Numba kernels (MoE, paged decode attention, the nucleus cut): same signatures, any
device, float32 (expert weights via bitplanes.dequantize)."""
from __future__ import annotations

import torch
import torch.nn.functional as tf

from pagedweight.bitplanes import dequantize, num_words


def block_weight(pool_words: torch.Tensor, pool_halves: torch.Tensor, b: int, poff: torch.Tensor, lo: int,
                 N: int, K: int) -> torch.Tensor:
    """float32 [N, K] of one block at width b, read from the pool at the table's offsets."""
    W = num_words(K)
    words = pool_words.view(torch.int32)
    planes = torch.stack([words[int(o):int(o) + W * N].view(W, N) for o in poff[:b].tolist()]).view(torch.uint32)
    lut = pool_halves[lo:lo + (1 << b) * N].view(1 << b, N)
    return dequantize(planes, lut, b, K)


def moe_forward_reference(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                          pool_words: torch.Tensor, pool_halves: torch.Tensor, q: torch.Tensor, plane_off: torch.Tensor,
                          lut_off: torch.Tensor, D: int, F: int, P: int, lut_width: int | None = None) -> torch.Tensor:
    """Twin of `moe_forward`: out[t] = sum_k w[t,k] * down_e @ (silu(gate_e @ x) * up_e @ x), e = ids[t,k].
    Checks what the kernel assumes (and cannot check without a host read): every width is at most lut_width."""
    if lut_width is not None and int(q.max()) > lut_width:
        raise ValueError(f"a committed width {int(q.max())} exceeds lut_width {lut_width}")
    T, k = topk_ids.shape
    x = hidden.float()
    out = torch.zeros(T, D, dtype=torch.float32, device=hidden.device)
    q_h, lut_h = q.cpu(), lut_off.cpu()
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        w_gu = block_weight(pool_words, pool_halves, int(q_h[e, 0]), plane_off[e, 0].cpu(), int(lut_h[e, 0]), 2 * F, D)
        w_d = block_weight(pool_words, pool_halves, int(q_h[e, 1]), plane_off[e, 1].cpu(), int(lut_h[e, 1]), D, F)
        h = x[tok] @ w_gu.to(x.device).t()
        y = (tf.silu(h[:, :F]) * h[:, F:]) @ w_d.to(x.device).t()
        out.index_add_(0, tok, y * topk_weights[tok, slot].float().unsqueeze(1))
    return out.to(hidden.dtype)


def paged_decode_attention_reference(q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
                                     scale: float) -> torch.Tensor:
    """Twin of `paged_decode_attention`: gather each row's pages whole, then a float32 softmax over its first
    lengths[b] keys (GQA: query head h reads KV head h // (H / Hkv))."""
    B, H, hd = q.shape
    hkv = kv.shape[3]
    pages = kv[tables].float()  # [B, M, 2, bs, Hkv, hd]
    k, v = (pages[:, :, j].reshape(B, -1, hkv, hd).repeat_interleave(H // hkv, dim=2) for j in (0, 1))
    scores = torch.einsum("bhd,bshd->bhs", q.float(), k) * scale
    visible = torch.arange(k.shape[1], device=q.device)[None, :] < lengths[:, None]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    v = torch.where(visible[:, :, None, None], v, 0.0)  # as the kernel, never read past a row's length (0 x NaN)
    return torch.einsum("bhs,bshd->bhd", scores.softmax(-1), v).to(q.dtype)


def top_p_cut_reference(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """sampling_kernels.top_p_cut by a sort: each row's fixed-point token masses in descending logit order, summed;
    the cut is the logit where the running mass first reaches ceil(top_p * total)."""
    from .sampling_kernels import FRACTION_BITS, LOG_RANGE

    top = x.amax(dim=-1, keepdim=True)
    d = top - x
    mass = torch.where(d < float(LOG_RANGE), torch.exp(-d).double() * 2.0 ** FRACTION_BITS, 0.0).floor().long()
    values, order = x.sort(dim=-1, descending=True)
    running = mass.gather(1, order).cumsum(dim=-1)
    total = running[:, -1].double()
    target = torch.ceil(top_p.double() * total).minimum(total).clamp(min=1.0).long()
    cut = values.gather(1, (running >= target[:, None]).int().argmax(dim=-1, keepdim=True)).squeeze(1)
    keep_all = (top_p >= 1.0) | ~torch.isfinite(top.squeeze(1))
    return torch.where(keep_all, float("-inf"), cut)
