"""Paged decode attention (Numba CUDA): each row's one new query against its keys, read from the pool's KV pages
through the row's block table, the context split across blocks (split-K, then a combine).

Why: PyTorch's memory-efficient SDPA kernel, the one that takes a mask, runs one block per (row, head) when a row
has one query. A batch-1 decode step of a Qwen1.5-MoE (16 heads, 2048 keys) gets 16 blocks on 132 SMs: 82 us per
layer for 16 MB of K/V (0.2 TB/s), 29 % of the whole step's device time, plus two gathers that copy K and V out of
the pages first (benchmarks/results/decode_profile-nvidia-h200-20261129-s6.txt). Here a block takes CHUNK keys of one
(row, head), so the same step runs 16 x 16 blocks, and keys are read once, in place.

Two launches, both capturable in a CUDA graph (no host read; the grid depends only on the padded table width):
1. `_split_kernel`, grid (B * H, splits): thread t scores key t of the chunk against q in shared memory; block
   reductions give the chunk's max m and sum l of exp(score - m); then its un-normalised sum of exp(score - m) * v,
   one thread per head dim. Reductions go through shared memory, not warp shuffles, so that the CUDA simulator
   (which has no shuffles) runs this very kernel in the CPU tests.
2. `_combine_kernel`, grid (B * H): rescales each split to the row's global max and normalises.
Splits past a row's length do nothing and the combine never reads them. K/V may be fp16 or fp32 (q the same dtype);
bf16 stays on the torch path (Numba has no bf16 arrays).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ._compat import cuda
from .moe_kernels import _dev, _stream

CHUNK = 128  # keys per split: one per thread
THREADS = 128
MAX_HEAD_DIM = 256  # q of one head in shared memory
DTYPES = (torch.float16, torch.float32)

float32 = np.float32


@cuda.jit(device=True, inline=True)
def _block_reduce(red, v, t, take_max):
    """Max or sum of v over the block's THREADS threads, through shared memory (every thread gets it)."""
    red[t] = v
    cuda.syncthreads()
    stride = THREADS // 2
    while stride > 0:
        if t < stride:
            red[t] = max(red[t], red[t + stride]) if take_max else red[t] + red[t + stride]
        cuda.syncthreads()
        stride >>= 1
    out = red[0]
    cuda.syncthreads()  # every thread has read red[0] before red is reused
    return out


@cuda.jit(cache=True)
def _split_kernel(q, kv, tables, lengths, scale, block_size, group, part_m, part_l, part_acc):
    """q [B, H, hd]; kv [blocks, 2, bs, Hkv, hd]; tables [B, M]; lengths [B]; part_m, part_l [B, H, S];
    part_acc [B, H, S, hd]. Block (b * H + h, s) reduces keys [s * CHUNK, min((s + 1) * CHUNK, lengths[b]))."""
    H, hd = q.shape[1], q.shape[2]
    b = cuda.blockIdx.x // H
    h = cuda.blockIdx.x - b * H
    s = cuda.blockIdx.y
    start = s * CHUNK
    count = min(CHUNK, lengths[b] - start)
    if count <= 0:  # uniform over the block: no thread reaches a barrier
        return
    hk = h // group
    t = cuda.threadIdx.x
    qs = cuda.shared.array(MAX_HEAD_DIM, np.float32)
    probs = cuda.shared.array(CHUNK, np.float32)
    pages = cuda.shared.array(CHUNK, np.int64)
    slots = cuda.shared.array(CHUNK, np.int32)
    red = cuda.shared.array(THREADS, np.float32)
    for d in range(t, hd, THREADS):
        qs[d] = float32(q[b, h, d]) * scale
    score = float32(-math.inf)
    page, slot = 0, 0
    if t < count:  # thread t scores key t: its K row is contiguous (one 32-byte sector per 16 fp16 dims)
        pos = start + t
        blk = pos // block_size
        page = tables[b, blk]
        slot = pos - blk * block_size
        pages[t] = page
        slots[t] = slot
    cuda.syncthreads()
    if t < count:
        score = float32(0.0)
        for d in range(hd):
            score += qs[d] * float32(kv[page, 0, slot, hk, d])
    m = _block_reduce(red, score, t, True)
    p = float32(math.exp(score - m)) if t < count else float32(0.0)
    probs[t] = p
    total = _block_reduce(red, p, t, False)  # its barriers also publish probs
    if t == 0:
        part_m[b, h, s] = m
        part_l[b, h, s] = total
    if hd >= THREADS:  # thread t owns dims t, t + THREADS, ...: a warp reads 64 contiguous bytes of a V row
        for d in range(t, hd, THREADS):
            acc = float32(0.0)
            for j in range(count):
                acc += probs[j] * float32(kv[pages[j], 1, slots[j], hk, d])
            part_acc[b, h, s, d] = acc
        return
    groups = THREADS // hd  # smaller heads: `groups` threads share a dim, each over every groups-th key
    g = t // hd
    d = t - g * hd
    acc = float32(0.0)
    if g < groups:
        for j in range(g, count, groups):
            acc += probs[j] * float32(kv[pages[j], 1, slots[j], hk, d])
    red[t] = acc
    cuda.syncthreads()
    if t < hd:
        for g in range(1, groups):
            acc += red[g * hd + t]
        part_acc[b, h, s, t] = acc


@cuda.jit(cache=True)
def _combine_kernel(lengths, part_m, part_l, part_acc, out):
    """out [B, H, hd] (float32) = the splits of (b, h) rescaled to their common max and normalised."""
    H, hd = out.shape[1], out.shape[2]
    b = cuda.blockIdx.x // H
    h = cuda.blockIdx.x - b * H
    splits = (lengths[b] + CHUNK - 1) // CHUNK
    m = float32(-math.inf)
    for s in range(splits):
        m = max(m, part_m[b, h, s])
    total = float32(0.0)
    for s in range(splits):
        total += float32(math.exp(part_m[b, h, s] - m)) * part_l[b, h, s]
    for d in range(cuda.threadIdx.x, hd, THREADS):
        acc = float32(0.0)
        for s in range(splits):
            acc += float32(math.exp(part_m[b, h, s] - m)) * part_acc[b, h, s, d]
        out[b, h, d] = acc / total


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    return dtype in DTYPES and head_dim <= MAX_HEAD_DIM


def paged_decode_attention(q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Attention of one new query per row over that row's first lengths[b] keys, read in place from the pool.

    q [B, H, hd] (fp16 or fp32); kv [blocks, 2 (k|v), block_size, Hkv, hd] of q's dtype (any strides); tables [B, M]
    int64, the pool block of each of the row's M (padded) logical blocks; lengths [B] int64, 1 <= lengths <= M *
    block_size (the row's own key included, already written). Returns [B, H, hd] in q's dtype. No host sync."""
    B, H, hd = q.shape
    _, two, block_size, hkv, kv_hd = kv.shape
    if not supports(q.dtype, hd) or kv.dtype != q.dtype or two != 2 or kv_hd != hd or H % hkv:
        raise ValueError(f"paged_decode_attention takes fp16/fp32 q and kv of one dtype, head_dim <= "
                         f"{MAX_HEAD_DIM}, H a multiple of Hkv; got q {tuple(q.shape)} {q.dtype}, "
                         f"kv {tuple(kv.shape)} {kv.dtype}")
    splits = -(-tables.shape[1] * block_size // CHUNK)
    dev = q.device
    ml = torch.empty(2, B, H, splits, dtype=torch.float32, device=dev)  # each split's max and sum
    acc = torch.empty(B, H, splits, hd, dtype=torch.float32, device=dev)
    out = torch.empty(B, H, hd, dtype=torch.float32, device=dev)
    a = [_dev(t) for t in (q.contiguous(), kv, tables, lengths, ml[0], ml[1], acc, out)]
    q_, kv_, tables_, lengths_, m_, l_, acc_, out_ = a
    stream = _stream()
    _split_kernel[(B * H, splits), THREADS, stream](q_, kv_, tables_, lengths_, float32(scale), block_size,
                                                    H // hkv, m_, l_, acc_)
    _combine_kernel[B * H, THREADS, stream](lengths_, m_, l_, acc_, out_)
    return out.to(q.dtype)
