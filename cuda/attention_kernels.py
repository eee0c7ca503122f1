"""Paged decode attention (Numba CUDA): each row's one new query against its keys, read from the pool's KV pages
through the row's block table, the context split across blocks (split-K, then a combine).

Why: PyTorch's memory-efficient SDPA kernel, the one that takes a mask, runs one block per (row, head) when a row
has one query. A batch-1 decode step of a Qwen1.5-MoE (16 heads, 2048 keys) gets 16 blocks on 132 SMs: 82 us per
layer for 16 MB of K/V (0.2 TB/s), 29 % of the whole step's device time, plus two gathers that copy K and V out of
the pages first (benchmarks/results/decode_profile-nvidia-h200-20261129-s6.txt). Here a block takes CHUNK keys of one
(row, head), so the same step runs 16 x 32 blocks, and keys are read once, in place.

Two launches, both capturable in a CUDA graph (no host read; the grid depends only on the padded table width):
1. `_split_kernel`, grid (B * H, splits): SUB threads share a key row, so a warp's load reads SUB consecutive dims
   of 32 / SUB keys; a thread takes KEYS keys and loads one dim of all of them before using any (KEYS independent
   loads in flight, no branch: keys past the row's length repeat a valid key with weight 0); the key partials meet
   in shared memory; block reductions give the chunk's max m and sum l of
   exp(score - m); the same thread layout sums exp(score - m) * v, un-normalised. Reductions go through shared
   memory, not warp shuffles, so that the CUDA simulator (which has no shuffles) runs this very kernel in the CPU
   tests. Per call at batch 1, 2048 keys, 16 heads of 128 (benchmarks/results/attention_bench-nvidia-h200-20261129-
   v2.json, -v3.json): v1 gave each thread a whole key row, 55 us; v2 had a thread walk its keys one after another,
   each key's dims loaded under a branch, 33 us; this layout 21 us (gather + SDPA on the same exact-length table: 23),
   16 us with running unsigned indices, 14.5 us with 56 registers (see `_split_kernel`).
   Grouped-query heads each read their KV head again: with 4 query heads per KV head at batch 16 and 8,192 keys this
   kernel took 976 us against gather + SDPA's 423 (attention_bench-nvidia-h200-20261130-s15-attn-old.json; that
   SDPA was cuDNN's, which the engine no longer runs: against the engine's own it is used for them too, see
   kv_cache.PagedKVCache). A block of 4 query heads reading its KV head once (branch s15-grouped-attention) took 624 us,
   1.01-2.63x the time of gather + SDPA across shapes (-s15-attn-new.json): 128 registers (offline), 4 blocks per SM.
   fp16 K/V of head dims 64 and 128 (the bundled model's and the usual MoE checkpoints') go through
   `_split_wide1_kernel` / `_split_wide2_kernel` instead (`split_for`): the same layout and reductions, K and V read
   as 8-byte words (four fp16), all of a thread's words of a chunk loaded before any is used: 25-43 % less time per
   call than `_split_kernel` at 4-16 rows on an H100, 11 % at one row of 2,048 keys (see `_split_wide`).
2. `_combine_kernel`, grid (B * H): rescales each split to the row's global max and normalises.
Splits past a row's length do nothing and the combine never reads them. `_store_kernel` writes the step's new K/V
into the pool's rows before them (one launch where torch stacks, gathers and scatters), where RoPE's kernel does not
(layer_kernels.rope with a store). K/V may be fp16 or fp32 (q the same dtype); bf16 stays on the torch path (Numba
has no bf16 arrays).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ._compat import SIMULATOR, cuda, jit_variant
from .launcher import launch

CHUNK = 64  # keys per split
THREADS = 128
SUB = 16  # threads per key row: thread (g, sub) reads dims sub, sub + SUB, ... of keys g, g + GROUPS, ...
GROUPS = THREADS // SUB
KEYS = CHUNK // GROUPS  # keys per thread
MAX_HEAD_DIM = 256  # q of one head in shared memory; head_dim a multiple of SUB
PART = GROUPS * MAX_HEAD_DIM  # shared floats of a block's partials (a shared array's size must be one constant)
COMBINE_SPLITS = 2048  # splits the combine can weigh
# splits' partials a combine thread loads before summing any: 1-6 % less time per call than one load a step, at 1-16
# rows of 512-8,192 keys (attention_bench-nvidia-h200-20261202-s28-shape.json, arm cu8 against base)
CU = 8
MAX_KEYS = CHUNK * COMBINE_SPLITS  # 131072
DTYPES = (torch.float16, torch.float32)
WORD = 4  # fp16 elements in one of the 8-byte words `_split_wide*_kernel` loads
WIDE_WORDS = (1, 2)  # a thread's words per key in the wide kernels: head dims WORD * SUB * (1, 2) = 64 and 128

float32 = np.float32


@cuda.jit(device=True, inline=True)
def _block_reduce(red, v, t, take_max):
    """Max or sum of v over the block's threads, as many as `red` (shared memory) has entries, a power of 2; every
    thread gets it."""
    red[t] = v
    cuda.syncthreads()
    stride = red.shape[0] // 2
    while stride > 0:
        if t < stride:
            red[t] = max(red[t], red[t + stride]) if take_max else red[t] + red[t + stride]
        cuda.syncthreads()
        stride >>= 1
    out = red[0]
    cuda.syncthreads()  # every thread has read red[0] before red is reused
    return out


@cuda.jit(device=True, inline=True)
def _key_bases(base, flat_row_len, tables, b, start, count, block_size, hkv, hd, kvh, t):
    """base[j] <- element of the flat pool where key start + j's row of KV head kvh starts (threads t < CHUNK); keys
    past the row's length repeat the chunk's last key, so every load of the caller is valid, unguarded."""
    if t < CHUNK:
        pos = start + min(t, count - 1)
        blk = pos // block_size
        base[t] = (np.uint64(tables[b, blk]) * np.uint64(flat_row_len)
                   + np.uint64((pos - blk * block_size) * hkv * hd + kvh * hd))


@cuda.jit(device=True, inline=True)
def _block_chunk(H, lengths):
    """(row b, head h, split s, its first key, its key count) of this block of a (B * H, splits) grid."""
    b = cuda.blockIdx.x // H
    s = cuda.blockIdx.y
    return b, cuda.blockIdx.x - b * H, s, s * CHUNK, min(CHUNK, lengths[b] - s * CHUNK)


@cuda.jit(device=True, inline=True)
def _chunk_softmax(part, red, probs, t, count):
    """The chunk's max score m and sum of exp(score - m) from the key partials part[key * (SUB + 1) + sub] (written
    before a barrier); probs[key] <- exp(score - m), 0 past count. Its last barriers publish probs and retire the
    key partials."""
    score = float32(-math.inf)
    if t < count:
        score = float32(0.0)
        for k in range(SUB):
            score += part[t * (SUB + 1) + k]
    m = _block_reduce(red, score, t, True)
    p = float32(math.exp(score - m)) if t < count else float32(0.0)
    if t < CHUNK:
        probs[t] = p  # 0 for the repeated keys past the length
    return m, _block_reduce(red, p, t, False)


@cuda.jit(device=True, inline=True)
def _store_split(part, part_m, part_l, part_acc, b, h, s, hd, t, m, total):
    """The split's partials: the GROUPS V partials part[g * hd + d] (written before this barrier) summed, m, total."""
    cuda.syncthreads()
    for d in range(t, hd, THREADS):
        v = float32(0.0)
        for k in range(GROUPS):
            v += part[k * hd + d]
        part_acc[b, h, s, d] = v
    if t == 0:
        part_m[b, h, s] = m
        part_l[b, h, s] = total


@cuda.jit(cache=True)
def _split_kernel(q, flat, row_len, tables, lengths, scale, block_size, hkv, group, part_m, part_l, part_acc):
    """q [B, H, hd]; flat: the pool's KV blocks as one C-ordered vector, block p's [2 (k|v), bs, Hkv, hd] at element
    p * row_len (a key's dims are consecutive, so the loads of a thread differ by constant offsets); tables [B, M];
    lengths [B]; part_m, part_l [B, H, S]; part_acc [B, H, S, hd]. Block (b * H + h, s) reduces keys
    [s * CHUNK, min((s + 1) * CHUNK, lengths[b])).

    Each thread keeps one unsigned running element index per key, advanced by SUB per dim. A signed index costs
    Numba's negative-index wraparound per load and a 2-D index a 64-bit multiply by the row stride: 10 PTX
    instructions per loaded element and 104 registers (offline; 96 on the H200) before, 6 and 64 (offline), and
    16-37 % less time per call (benchmarks/results/attention_bench-nvidia-h200-20261130-s14-var-v4.json against
    -var-old.json). Indexing the flat vector as base + SUB * i instead, with the same instruction count, was 8-36 %
    slower than before (-var-flat): ptxas then kept fewer of a dim's KEYS loads in flight (ncu: 17.8 against 3.7
    cycles of long-scoreboard stall per issued instruction, ncu_stalls-nvidia-h200-20261130-s14-attn-*.txt).
    With the key bases computed in `_key_bases` (the same arithmetic) ptxas allocates 56 registers instead of 64
    (offline): 9 blocks of 128 threads fit an SM's registers instead of 8. In one call against the inline form run
    before and after it, 9-19 % less time per call on Qwen1.5 shapes (batch 16, 8,192 keys: 640 -> 536 us, 2.0 TB/s;
    attention_bench-nvidia-h200-20261130-s15-attn-new.json against -attn-old.json and -attn-old2.json); that the
    register count is the cause is inferred, not measured."""
    H, hd = q.shape[1], q.shape[2]
    b, h, s, start, count = _block_chunk(H, lengths)
    if count <= 0:  # uniform over the block: no thread reaches a barrier
        return
    dims = hd // SUB
    t = cuda.threadIdx.x
    sub = t % SUB
    g = t // SUB
    qs = cuda.shared.array(MAX_HEAD_DIM, np.float32)
    base = cuda.shared.array(CHUNK, np.uint64)  # element of flat where key j's row (its KV head's part) starts
    probs = cuda.shared.array(CHUNK, np.float32)
    red = cuda.shared.array(THREADS, np.float32)
    part = cuda.shared.array(PART, np.float32)  # key partials [CHUNK][SUB + 1], then V partials [GROUPS][hd]
    for d in range(t, hd, THREADS):
        qs[d] = float32(q[b, h, d]) * scale
    _key_bases(base, row_len, tables, b, start, count, block_size, hkv, hd, h // group, t)
    cuda.syncthreads()
    # thread (g, sub) takes keys g, g + GROUPS, ... (KEYS of them, in registers: constant indices once unrolled) and
    # for each dim sub + SUB * i loads all of them before using any: KEYS independent loads in flight per dim
    idx = cuda.local.array(KEYS, np.uint64)
    dot = cuda.local.array(KEYS, np.float32)
    for u in range(KEYS):
        idx[u] = base[g + GROUPS * u] + np.uint64(sub)
        dot[u] = float32(0.0)
    for i in range(dims):
        qv = qs[sub + SUB * i]
        for u in range(KEYS):
            dot[u] += qv * float32(flat[idx[u]])
            idx[u] += np.uint64(SUB)
    for u in range(KEYS):
        part[(g + GROUPS * u) * (SUB + 1) + sub] = dot[u]  # padded rows: the summing threads hit distinct banks
    cuda.syncthreads()
    m, total = _chunk_softmax(part, red, probs, t, count)
    v_off = np.uint64(block_size * hkv * hd - hd)  # V follows K in a block (idx went hd past each key's start)
    for u in range(KEYS):
        dot[u] = probs[g + GROUPS * u]
        idx[u] += v_off
    for i in range(dims):
        acc = float32(0.0)
        for u in range(KEYS):
            acc += dot[u] * float32(flat[idx[u]])
            idx[u] += np.uint64(SUB)
        part[g * hd + sub + SUB * i] = acc
    _store_split(part, part_m, part_l, part_acc, b, h, s, hd, t, m, total)


if SIMULATOR:
    def _as_half(bits):
        return np.uint16(bits & 0xFFFF).view(np.float16)
else:
    from llvmlite import ir
    from numba import types as nbtypes
    from numba.cuda.extending import intrinsic

    @intrinsic
    def _as_half(typingctx, bits):
        """The fp16 whose bits are the low 16 of an integer: numba-cuda keeps fp16 as i16, so a truncation."""
        def codegen(context, builder, sig, args):
            return builder.trunc(args[0], ir.IntType(16))
        return nbtypes.float16(bits), codegen


@cuda.jit(device=True, inline=True)
def _half(w, j):
    """Element j of an 8-byte word of four fp16, as float32."""
    return float32(_as_half(w >> np.uint64(16 * j)))


def _split_wide(q, words, row_words, tables, lengths, scale, block_size, hkv, group, part_m, part_l, part_acc):
    """`_split_kernel` for fp16 K/V read as 8-byte words (`WORD` elements each): `words` is the flat pool viewed as
    int64, row_words its row length in words. Thread (g, sub) takes words sub, sub + SUB, ... (DW of them, a compile-
    time constant of each variant: head dim WORD * SUB * DW) of keys g, g + GROUPS, ... and loads all KEYS * DW of
    them before using any, so that one round of load latency brings its share of the chunk's K (then of its V).

    Why: `_split_kernel` loads 2 bytes at a time, KEYS loads a round, and walks a key's dims in a runtime loop, so a
    chunk's K costs hd / SUB rounds of load latency (8 at hd 128) and its V as many. On an H100 this form took 33.7
    against 44.7 us per call at 4 rows of 2,048 keys (Qwen1.5, 16 heads of 128), 396.9 against 623.6 at 16 rows of
    8,192, 12.2 against 13.7 at one row of 2,048, and 400.8 against 697.9 with 8 query heads per KV head at 16 rows of
    8,192; a form that kept the runtime loop with 8-byte loads (KEYS a round, 80 registers) gave about half the gain
    (benchmarks/results/attention_bench-nvidia-h100-80gb-hbm3-20261207-s58-wide.json, arms wide and wide2). ptxas
    (offline, sm_90): 56 registers, as `_split_kernel`."""
    H, hd = q.shape[1], q.shape[2]
    b, h, s, start, count = _block_chunk(H, lengths)
    if count <= 0:  # uniform over the block: no thread reaches a barrier
        return
    t = cuda.threadIdx.x
    sub = t % SUB
    g = t // SUB
    hw = hd // WORD
    base = cuda.shared.array(CHUNK, np.uint64)  # word of `words` where key j's row (its KV head's part) starts
    probs = cuda.shared.array(CHUNK, np.float32)
    red = cuda.shared.array(THREADS, np.float32)
    part = cuda.shared.array(PART, np.float32)  # key partials [CHUNK][SUB + 1], then V partials [GROUPS][hd]
    _key_bases(base, row_words, tables, b, start, count, block_size, hkv, hw, h // group, t)
    qv = cuda.local.array(QW, np.float32)  # this thread's dims of q, scaled
    for i in range(DW):
        for j in range(WORD):
            qv[i * WORD + j] = float32(q[b, h, WORD * (sub + SUB * i) + j]) * scale
    cuda.syncthreads()
    wv = cuda.local.array(KW, np.uint64)
    for i in range(DW):
        for u in range(KEYS):
            wv[i * KEYS + u] = words[base[g + GROUPS * u] + np.uint64(sub + SUB * i)]
    for u in range(KEYS):
        dot = float32(0.0)
        for i in range(DW):
            for j in range(WORD):
                dot += qv[i * WORD + j] * _half(wv[i * KEYS + u], j)
        part[(g + GROUPS * u) * (SUB + 1) + sub] = dot  # padded rows: the summing threads hit distinct banks
    cuda.syncthreads()
    m, total = _chunk_softmax(part, red, probs, t, count)
    v_off = np.uint64(block_size * hkv * hw)  # V follows K in a block
    for i in range(DW):
        for u in range(KEYS):
            wv[i * KEYS + u] = words[base[g + GROUPS * u] + v_off + np.uint64(sub + SUB * i)]
    acc = cuda.local.array(QW, np.float32)
    for c in range(QW):
        acc[c] = float32(0.0)
    for u in range(KEYS):
        pu = probs[g + GROUPS * u]
        for i in range(DW):
            for j in range(WORD):
                acc[i * WORD + j] += pu * _half(wv[i * KEYS + u], j)
    for i in range(DW):
        for j in range(WORD):
            part[g * hd + WORD * (sub + SUB * i) + j] = acc[i * WORD + j]
    _store_split(part, part_m, part_l, part_acc, b, h, s, hd, t, m, total)


# `_split_wide` compiled per DW (its local arrays' sizes and unrolled loops need constants)
_split_wide1_kernel, _split_wide2_kernel = (
    jit_variant(_split_wide, f"_split_wide{dw}_kernel", {"DW": dw, "QW": WORD * dw, "KW": KEYS * dw})
    for dw in WIDE_WORDS)


@cuda.jit(cache=True)
def _combine_kernel(lengths, part_m, part_l, part_acc, out):
    """out [B, H, hd] (q's dtype) = the splits of (b, h) rescaled to their common max and normalised. Thread s loads
    split s's max and sum (a loop of them beyond THREADS splits); every thread then reads only shared weights."""
    H, hd = out.shape[1], out.shape[2]
    b = cuda.blockIdx.x // H
    h = cuda.blockIdx.x - b * H
    t = cuda.threadIdx.x
    splits = (lengths[b] + CHUNK - 1) // CHUNK
    red = cuda.shared.array(THREADS, np.float32)
    weight = cuda.shared.array(COMBINE_SPLITS, np.float32)
    m = float32(-math.inf)
    for s in range(t, splits, THREADS):
        m = max(m, part_m[b, h, s])
    m = _block_reduce(red, m, t, True)
    total = float32(0.0)
    for s in range(t, splits, THREADS):
        w = float32(math.exp(part_m[b, h, s] - m))
        weight[s] = w
        total += w * part_l[b, h, s]
    total = _block_reduce(red, total, t, False)  # its barriers publish the weights
    vals = cuda.local.array(CU, np.float32)
    for d in range(t, hd, THREADS):
        v = float32(0.0)
        for s0 in range(0, splits, CU):  # CU loads in flight, then their sum in split order (as one load a step)
            for j in range(CU):
                vals[j] = part_acc[b, h, min(s0 + j, splits - 1), d]
            for j in range(CU):
                if s0 + j < splits:
                    v += weight[s0 + j] * vals[j]
        out[b, h, d] = v / total


@cuda.jit(cache=True)
def _store_kernel(k, v, rows, dst, src):
    """Block (b, h): the new key and value of row src[b] (a padding row rewrites its source row's) for KV head h into
    rows dst[0, b] and dst[1, b] of the pool's token rows [R, Hkv, hd] (kv_cache.PagedKVCache.rows). k, v [B, Hkv,
    1, hd] (any strides)."""
    b = cuda.blockIdx.x
    h = cuda.blockIdx.y
    s = src[b]
    rk = dst[0, b]
    rv = dst[1, b]
    for d in range(cuda.threadIdx.x, k.shape[3], cuda.blockDim.x):
        rows[rk, h, d] = k[s, h, 0, d]
        rows[rv, h, d] = v[s, h, 0, d]


def supports(dtype: torch.dtype, head_dim: int, max_keys: int) -> bool:
    """Whether the kernel takes this dtype, head size and rows of up to max_keys keys (their padded tables)."""
    return dtype in DTYPES and head_dim <= MAX_HEAD_DIM and head_dim % SUB == 0 and max_keys <= MAX_KEYS


def block_rows(kv: torch.Tensor) -> torch.Tensor:
    """[blocks, row] over the blocks of a [blocks, 2, bs, Hkv, hd] view whose blocks are C-ordered but may sit
    further apart (the pool's pages): contiguous, so the kernel's loads of one key differ by constant offsets."""
    inner = kv[0].numel()
    if kv.stride()[1:] != kv[0].contiguous().stride() or kv.stride(0) < inner:
        raise ValueError(f"KV blocks must each be C-ordered, strides {kv.stride()}")
    return kv.as_strided((kv.shape[0], kv.stride(0)), (kv.stride(0), 1))


def flat_rows(kv: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The blocks of `block_rows(kv)` as one vector (up to the last block's end) and the row length in elements."""
    rows = block_rows(kv)
    return kv.as_strided(((rows.shape[0] - 1) * rows.shape[1] + kv[0].numel(),), (1,)), rows.shape[1]


def split_for(dtype: torch.dtype, head_dim: int, flat: torch.Tensor, row_len: int):
    """(split kernel, its pool argument, row length in that argument's elements): `_split_wide*_kernel` over the pool
    as 8-byte words for fp16 K/V of head dims WORD * SUB * WIDE_WORDS whose rows and start are whole words, else
    `_split_kernel` over the fp16/fp32 elements."""
    dw, rem = divmod(head_dim, WORD * SUB)
    if dtype != torch.float16 or rem or dw not in WIDE_WORDS or row_len % WORD or flat.storage_offset() % WORD:
        return _split_kernel, flat, row_len
    kernel = {1: _split_wide1_kernel, 2: _split_wide2_kernel}[dw]  # looked up per call: tests record launches
    return kernel, flat.view(torch.int64), row_len // WORD


def store_kv(k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor
             ) -> None:
    """A decode step's new keys and values into the pool, one launch (torch: a stack, a gather and a scatter):
    k, v [B, Hkv, 1, hd] of row src_rows[b] go to rows dst[0, b] (K) and dst[1, b] (V) of the pool's token rows
    [R, Hkv, hd] (kv_cache.PagedKVCache.rows), of k's dtype."""
    b, hkv, t, hd = k.shape
    if t != 1 or rows.dtype != k.dtype or v.dtype != k.dtype or tuple(rows.shape[1:]) != (hkv, hd) \
            or tuple(dst.shape) != (2, b):
        raise ValueError(f"store_kv takes one token per row, rows of its dtype and heads and dst [2, B]: k "
                         f"{tuple(k.shape)} {k.dtype}, v {v.dtype}, rows {tuple(rows.shape)} {rows.dtype}, dst "
                         f"{tuple(dst.shape)}")
    launch(_store_kernel, (b, hkv), min(THREADS, hd), (k, v, rows, dst, src_rows))


def paged_decode_attention(q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Attention of one new query per row over that row's first lengths[b] keys, read in place from the pool.

    q [B, H, hd] (fp16 or fp32); kv [blocks, 2 (k|v), block_size, Hkv, hd] of q's dtype (any strides); tables [B, M]
    int64, the pool block of each of the row's M (padded) logical blocks; lengths [B] int64, 1 <= lengths <= M *
    block_size (the row's own key included, already written). Returns [B, H, hd] in q's dtype. No host sync."""
    B, H, hd = q.shape
    _, two, block_size, hkv, kv_hd = kv.shape
    keys = tables.shape[1] * block_size
    if not supports(q.dtype, hd, keys) or kv.dtype != q.dtype or two != 2 or kv_hd != hd or H % hkv:
        raise ValueError(f"paged_decode_attention takes fp16/fp32 q and kv of one dtype, head_dim <= "
                         f"{MAX_HEAD_DIM} and a multiple of {SUB}, H a multiple of Hkv, tables of at most "
                         f"{MAX_KEYS} keys; got q {tuple(q.shape)} {q.dtype}, kv {tuple(kv.shape)} "
                         f"{kv.dtype}, tables {tuple(tables.shape)}")
    splits = -(-keys // CHUNK)
    dev = q.device
    ml = torch.empty(2, B, H, splits, dtype=torch.float32, device=dev)  # each split's max and sum
    acc = torch.empty(B, H, splits, hd, dtype=torch.float32, device=dev)
    out = torch.empty(B, H, hd, dtype=q.dtype, device=dev)  # the combine rounds into q's dtype: no cast launch
    kernel, flat, row_len = split_for(q.dtype, hd, *flat_rows(kv))
    qc = q.contiguous()  # held to the launch: a view keeps no tensor alive, so a temporary copy could be reused
    launch(kernel, (B * H, splits), THREADS, (qc, flat, row_len, tables, lengths, float32(scale), block_size, hkv,
                                              H // hkv, ml[0], ml[1], acc))
    launch(_combine_kernel, B * H, THREADS, (lengths, ml[0], ml[1], acc, out))
    return out
