"""A decoder layer's small fused kernels (Numba CUDA): RMSNorm (with the residual add), RoPE on q and k, the router's
softmax + top-k (with the router's own GEMV where no fused input projection computes its logits), and the shared
expert's SwiGLU and output; one launch each where torch takes 2 to 10. Also the routing statistics' fold of an
observed step (signals.RouterStats), one launch where torch takes ~15.

Why: a batch-1 decode step of a Qwen1.5-MoE on the H200 ran ~1,280 kernels, 53 per layer, and ~1,000 of them were
1-5 us elementwise, copy, cat, norm and top-k kernels: ~1.9 ms of the step's 5.3 ms of kernel time, before the gaps
between launches (benchmarks/results/decode_profile-nvidia-h200-20261129-s6-attn2.txt). Per layer torch runs RMSNorm
as 4 kernels (cast, norm, cast, scale) twice, the residual adds as 2, RoPE as 5 per tensor (q and k: two products,
a negation, a cat and a sum, on transposed views), the router as 3 (softmax, top-k's gather and sort) and the shared
expert's tail as 5 (SiLU, product, sigmoid, product, sum). Here those are 6 launches (two norms), 5 with a gated
shared expert, whose output is added in the next layer's input norm (`moe_out_norm`, models.layers.MoEOut); with a
paged cache RoPE's launch also writes the step's K/V (`rope`'s store, kv_cache.PagedKVCache.kv_store).

Rounding: every kernel rounds where the torch ops it replaces round (an fp16 op's result is rounded to fp16 before
the next op reads it; `_rnd`), so the results equal torch's bit for bit except where a float32 reduction runs in
another order (the norm's sum of squares, the softmax's sum): a float32 ulp there, rarely an fp16 ulp in the output.
In fp32 the GPU also contracts a * b + c into one FMA (one rounding where torch has two).
Reductions go through shared memory, not warp shuffles, so the CUDA simulator runs these kernels in the CPU tests
(tests/test_layer_kernels.py, against the model's own torch ops). fp16 and fp32 only: Numba has no bf16 arrays.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn.functional as tf

from ._compat import SIMULATOR, cuda
from .attention_kernels import THREADS, _block_reduce
from .launcher import launch

MAX_EXPERTS = 1024  # router logits per token held in shared memory
ROUTER_ELEMS = 16  # x and router weights per thread and pass: rows of up to 2048 in one round of loads
ROUTER_MAX_TOKENS = 4096  # tokens of one fused router launch (its counters); more go through the GEMM and the top-k
NORM_THREADS = 512  # a norm row's threads: 16 warps of one SM hide its loads' latency (one row per block)
NORM_ELEMS = 8  # a norm row's elements per thread (in registers)
MAX_NORM_DIM = NORM_ELEMS * NORM_THREADS  # 4096
ROPE_THREADS = 64  # a head's threads: hd = 128 gives each one pair of dims
DTYPES = (torch.float16, torch.float32)

float32, float16 = np.float32, np.float16


def takes(t: torch.Tensor) -> bool:
    """Whether the kernels run on tensors like t: fp16/fp32 on a GPU (or on the CPU under the CUDA simulator)."""
    return t.dtype in DTYPES and (t.is_cuda or SIMULATOR)


@cuda.jit(device=True, inline=True)
def _rnd(v, half):
    """v rounded as a result of the model's dtype (fp16: to nearest even), back in float32."""
    return float32(float16(v)) if half else v


@cuda.jit(cache=True)
def _rms_norm_kernel(x, res, h, y, w, eps, add, half):
    """Row n: v = x[n] (+ res[n], stored to h[n], when add); y[n] = w * (v * rsqrt(mean(v^2) + eps)), the product
    rounded first as torch's .to(dtype) does. x, res, h, y [N, D] (any strides), w [D], D <= MAX_NORM_DIM.

    A block of NORM_THREADS threads per row, each holding its NORM_ELEMS elements and their weights in registers:
    the constant trip count unrolls the loop, and every load is issued before any is used (indices past D load
    element D - 1 and count 0, so no load sits under a branch). On the H200 (decode_profile-nvidia-h200-20261130-
    s9-kernels.txt, -s9-norm.txt, -s9-final.txt; torch's norm alone takes 2 us): 128 threads walking a row of 2048
    one load at a time took 11 us; 32 elements per thread with x's loads hoisted but w's left under `if i < D` in
    the store loop, each waiting for the one before, 13 us; everything hoisted, 9 us (118 registers: the loads go
    out in batches); then 512 threads of 8 elements, 3.5 us (decode_profile-nvidia-h200-20261130-s10.txt)."""
    n = cuda.blockIdx.x
    t = cuda.threadIdx.x
    D = x.shape[1]
    red = cuda.shared.array(NORM_THREADS, np.float32)
    vals = cuda.local.array(NORM_ELEMS, np.float32)
    ws = cuda.local.array(NORM_ELEMS, np.float32)
    for u in range(NORM_ELEMS):
        i = min(t + u * NORM_THREADS, D - 1)
        vals[u] = float32(x[n, i]) + float32(res[n, i]) if add else float32(x[n, i])
        ws[u] = float32(w[i])
    _norm_row(red, vals, ws, n, t, h, y, eps, add, half)


@cuda.jit(device=True, inline=True)
def _norm_row(red, vals, ws, n, t, h, y, eps, add, half):
    """A norm row's second half, its elements and weights loaded (`_rms_norm_kernel`): v = vals (rounded as a stored
    sum when add, then stored to h[n]), y[n] = ws * (v * rsqrt(mean(v^2) + eps)), the product rounded first."""
    D = y.shape[1]
    ss = float32(0.0)
    for u in range(NORM_ELEMS):
        v = _rnd(vals[u], half) if add else vals[u]
        vals[u] = v if t + u * NORM_THREADS < D else float32(0.0)
        ss += vals[u] * vals[u]
    total = _block_reduce(red, ss, t, False)
    r = float32(1.0) / math.sqrt(total / float32(D) + eps)
    for u in range(NORM_ELEMS):
        i = t + u * NORM_THREADS
        if i < D:
            if add:
                h[n, i] = vals[u]
            y[n, i] = ws[u] * _rnd(vals[u] * r, half)


@cuda.jit(cache=True)
def _moe_out_norm_kernel(res, routed, gate, shared, h, y, w, eps, half):
    """Row n: v = res[n] + (routed[n] + sigmoid(gate[n]) * shared[n]) as `_shared_out_kernel` computes it, stored to
    h[n], and y[n] = its norm as `_rms_norm_kernel` computes it: an MoE block's output with a gated shared expert and
    the next layer's input norm in one launch where they took two. res, routed, shared, h, y [N, D] (any strides),
    gate [N, 1], w [D], D <= MAX_NORM_DIM; NORM_THREADS threads a row."""
    n = cuda.blockIdx.x
    t = cuda.threadIdx.x
    D = res.shape[1]
    red = cuda.shared.array(NORM_THREADS, np.float32)
    vals = cuda.local.array(NORM_ELEMS, np.float32)
    ws = cuda.local.array(NORM_ELEMS, np.float32)
    sg = _sigmoid(float32(gate[n, 0]), half)
    for u in range(NORM_ELEMS):
        i = min(t + u * NORM_THREADS, D - 1)
        vals[u] = _moe_sum(res[n, i], routed[n, i], sg, shared[n, i], half)
        ws[u] = float32(w[i])
    _norm_row(red, vals, ws, n, t, h, y, eps, True, half)


@cuda.jit(cache=True)
def _rope_kernel(qkv, cos, sin, q, k, n_heads, n_kv, qw, kw, eps, norm, half, kv, dst, src, store):
    """Block (b * T + t, j): head j of token (b, t) in qkv [B, T, (H + 2 Hkv) * hd] (q heads, k heads, v heads),
    rotated with cos/sin [B, T, hd] (rotate-half: dim i < hd/2 pairs with i + hd/2) into q [B, H, T, hd] (j < H) or
    k [B, Hkv, T, hd]. With `norm` the head is first RMS-normed over its hd dims and scaled by qw or kw [hd] (Qwen3's
    per-head q/k norm, models.layers.RMSNorm's rounding). With `store` (1, or 2 where token i's K/V are token src[i]'s:
    a decode step's padding row writes its source row's) the k heads go to row dst[0, b * T + t] of the KV pool's rows
    kv [R, Hkv, hd] instead of k, and blocks j of H + Hkv and up copy the v heads to row dst[1, b * T + t]: the
    step's K/V write in this launch. ROPE_THREADS threads; thread i takes dims i and i + hd/2 (and i + ROPE_THREADS
    ..., when hd/2 is larger)."""
    T = qkv.shape[1]
    hd = cos.shape[2]
    half_dim = hd // 2
    bt = cuda.blockIdx.x
    j = cuda.blockIdx.y
    t = cuda.threadIdx.x
    red = cuda.shared.array(ROPE_THREADS, np.float32)
    s = src[bt] if store == 2 and j >= n_heads else bt
    b = s // T
    tok = s - b * T
    base = j * hd
    if j >= n_heads + n_kv:  # a v head (launched only with `store`): copied to its row, whole blocks return here
        row = dst[1, bt]
        for i in range(t, hd, ROPE_THREADS):
            kv[row, j - n_heads - n_kv, i] = qkv[b, tok, base + i]
        return
    r = float32(1.0)
    if norm:  # the whole block takes part in the reduction (no early exit above but whole blocks')
        ss = float32(0.0)
        for i in range(t, hd, ROPE_THREADS):
            v = float32(qkv[b, tok, base + i])
            ss += v * v
        r = float32(1.0) / math.sqrt(_block_reduce(red, ss, t, False) / float32(hd) + eps)
    for i in range(t, half_dim, ROPE_THREADS):
        x1 = float32(qkv[b, tok, base + i])
        x2 = float32(qkv[b, tok, base + i + half_dim])
        if norm:  # w * (x * r rounded to the dtype), rounded: what the head's RMSNorm would store
            w = qw if j < n_heads else kw
            x1 = _rnd(float32(w[i]) * _rnd(x1 * r, half), half)
            x2 = _rnd(float32(w[i + half_dim]) * _rnd(x2 * r, half), half)
        lo = _rnd(_rnd(x1 * float32(cos[b, tok, i]), half) - _rnd(x2 * float32(sin[b, tok, i]), half), half)
        hi = _rnd(x2 * float32(cos[b, tok, i + half_dim]), half) + _rnd(x1 * float32(sin[b, tok, i + half_dim]), half)
        if j < n_heads:
            q[b, j, tok, i] = lo
            q[b, j, tok, i + half_dim] = hi
        elif store:
            row = dst[0, bt]
            kv[row, j - n_heads, i] = lo
            kv[row, j - n_heads, i + half_dim] = hi
        else:
            k[b, j - n_heads, tok, i] = lo
            k[b, j - n_heads, tok, i + half_dim] = hi


@cuda.jit(device=True, inline=True)
def _topk_row(logits, n, E, top_k, renorm, ids, weights, t):
    """Token n: softmax (float32) over logits[n, :E], then the top_k largest (descending; of equal ones the lower
    expert first) to ids/weights [N, k], renormalised to sum 1 when renorm (the whole block of THREADS calls it).

    Each expert's rank is counted directly (how many experts beat it), one pass over the E probabilities in shared
    memory per expert, and an expert of rank < top_k writes itself: two barriers after the softmax where picking the
    largest top_k times, each an arg-max tree over the block, took ~10 barriers a pick (6.0 us per call at E = 60,
    top 4: decode_profile-nvidia-h200-20261130-s12.txt). O(E^2 / THREADS) comparisons: 1 K at E = 60, 128 K at 1024."""
    probs = cuda.shared.array(MAX_EXPERTS, np.float32)
    top = cuda.shared.array(MAX_EXPERTS, np.float32)  # the picked weights by rank, for the renormalisation
    red = cuda.shared.array(THREADS, np.float32)
    m = float32(-math.inf)
    for e in range(t, E, THREADS):
        m = max(m, float32(logits[n, e]))
    m = _block_reduce(red, m, t, True)
    s = float32(0.0)
    for e in range(t, E, THREADS):
        p = float32(math.exp(float32(logits[n, e]) - m))
        if p != p:  # a NaN logit ranks last, weight 0: every row still gets top_k distinct experts < E (left
            p = float32(-1.0)  # unwritten, its ids were whatever memory held: the MoE kernels index by them)
        probs[e] = p
        s += max(p, float32(0.0))
    for r in range(t, top_k, THREADS):
        top[r] = float32(0.0)
    s = _block_reduce(red, s, t, False)  # its barriers also publish probs and top
    for e in range(t, E, THREADS):
        p = probs[e]
        rank = 0
        for j in range(E):
            q = probs[j]
            if q > p or (q == p and j < e):
                rank += 1
        if rank < top_k:
            w = max(p, float32(0.0)) / s
            ids[n, rank] = e
            weights[n, rank] = w
            top[rank] = w
    if renorm:
        cuda.syncthreads()
        if t == 0:
            picked = float32(0.0)
            for r in range(top_k):
                picked += top[r]
            for r in range(top_k):
                weights[n, r] = weights[n, r] / picked


@cuda.jit(cache=True)
def _topk_kernel(logits, top_k, renorm, ids, weights):
    """Block n: `_topk_row` of token n's router logits [N, E]."""
    _topk_row(logits, cuda.blockIdx.x, logits.shape[1], top_k, renorm, ids, weights, cuda.threadIdx.x)


@cuda.jit(cache=True)
def _router_kernel(x, w, logits, done, top_k, renorm, ids, weights, half):
    """Block (e, n): logit e of token n, x[n] . w[e] summed in float32 and rounded as F.linear's result in x's dtype,
    into logits [N, >= E] (float32); the block that finishes token n's last logit (done [>= N], a counter per token
    that it resets for the next launch) runs `_topk_row` on them. One launch where the router's GEMM and the top-k
    took two: on the H200, Qwen3's 2048 x 128 router at batch 1 in 9.0 us where cuBLAS took 5.1 and the top-k 5.7
    (decode_profile-nvidia-h200-20261202-s28-qwen3-router.txt against -gemm.txt: 5.05 -> 4.96 ms of kernels per
    step; steady decode moved by less than its run-to-run spread). Each thread loads ROUTER_ELEMS of x and w before
    using any (indices past D load element D - 1 and count 0). The last block reads logits that other blocks wrote:
    each writer fences before its count, and a token's row starts on its own 128-byte line (`router_topk` pads it),
    so no line this block reads was cached by the same SM before its last write."""
    e = cuda.blockIdx.x
    n = cuda.blockIdx.y
    t = cuda.threadIdx.x
    D = x.shape[1]
    xs = cuda.local.array(ROUTER_ELEMS, np.float32)
    ws = cuda.local.array(ROUTER_ELEMS, np.float32)
    acc = float32(0.0)
    for c0 in range(0, D, ROUTER_ELEMS * THREADS):
        for u in range(ROUTER_ELEMS):
            i = min(c0 + t + u * THREADS, D - 1)
            xs[u] = float32(x[n, i])
            ws[u] = float32(w[e, i])
        for u in range(ROUTER_ELEMS):
            if c0 + t + u * THREADS < D:
                acc += xs[u] * ws[u]
    red = cuda.shared.array(THREADS, np.float32)
    last = cuda.shared.array(1, np.int32)
    total = _block_reduce(red, acc, t, False)
    if t == 0:
        logits[n, e] = _rnd(total, half)
        cuda.threadfence()
        last[0] = 1 if cuda.atomic.add(done, n, 1) == cuda.gridDim.x - 1 else 0
    cuda.syncthreads()
    if last[0] == 1:  # uniform over the block
        if t == 0:
            done[n] = 0
        _topk_row(logits, n, cuda.gridDim.x, top_k, renorm, ids, weights, t)


@cuda.jit(cache=True)
def _swiglu_kernel(gate_up, out, half):
    """out [N, F] = silu(gate) * up, gate_up [N, 2F] (gate first; any strides); SiLU's result rounded first."""
    n = cuda.blockIdx.y
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    F = out.shape[1]
    if i < F:
        g = float32(gate_up[n, i])
        out[n, i] = _rnd(g / (float32(1.0) + float32(math.exp(-g))), half) * float32(gate_up[n, F + i])


@cuda.jit(device=True, inline=True)
def _sigmoid(g, half):
    """sigmoid(g), rounded as a result of the model's dtype."""
    return _rnd(float32(1.0) / (float32(1.0) + float32(math.exp(-g))), half)


@cuda.jit(device=True, inline=True)
def _moe_sum(x, routed, sg, shared, half):
    """x + (routed + sg * shared) in float32, each op's result but the last rounded as torch rounds it (sg: the
    shared expert's `_sigmoid` gate)."""
    return float32(x) + _rnd(float32(routed) + _rnd(sg * float32(shared), half), half)


@cuda.jit(cache=True)
def _shared_out_kernel(x, routed, gate, shared, out, half):
    """out [N, D] = x + (routed + sigmoid(gate) * shared), each op's result rounded as torch rounds it; gate [N, 1]."""
    n = cuda.blockIdx.y
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < out.shape[1]:
        out[n, i] = _moe_sum(x[n, i], routed[n, i], _sigmoid(float32(gate[n, 0]), half), shared[n, i], half)


@cuda.jit(cache=True)
def _route_stats_kernel(x, ids, weights, offsets, token_weights, weighted, acc, token_rows, tracked, req):
    """Block (l, t): |x[l, t]| (float32, a block reduction over D), then for each routing slot j the weight
    r = weights[l, t, j] (times token_weights[l, t] when `weighted`; a [1, n] token_weights serves every l) adds r, r|x| and r|x|^2 to acc[0:3, row] and raises
    acc[3, row] to |x|, row = offsets[l] + ids[l, t, j]; when `tracked`, the same with r unweighted into req at
    token_rows[t] * acc.shape[1] + row. x [L', n, D], ids and weights [L', n, k], offsets [L'] (a layer's first row,
    layer * E), acc [4, L * E] float32, req [4, rows * L * E]. Atomics: the sums' order is free, as index_add_'s is."""
    l = cuda.blockIdx.x
    n = cuda.blockIdx.y
    t = cuda.threadIdx.x
    red = cuda.shared.array(THREADS, np.float32)
    ss = float32(0.0)
    for i in range(t, x.shape[2], THREADS):
        v = float32(x[l, n, i])
        ss += v * v
    norm = float32(math.sqrt(_block_reduce(red, ss, t, False)))
    if t < ids.shape[2]:
        row = offsets[l] + ids[l, n, t]
        r0 = float32(weights[l, n, t])
        r = r0
        if weighted:
            r = r0 * float32(token_weights[l % token_weights.shape[0], n])
        rn = r * norm
        cuda.atomic.add(acc, (0, row), r)
        cuda.atomic.add(acc, (1, row), rn)
        cuda.atomic.add(acc, (2, row), rn * norm)
        cuda.atomic.max(acc, (3, row), norm)
        if tracked:
            at = token_rows[n] * acc.shape[1] + row
            rn = r0 * norm
            cuda.atomic.add(req, (0, at), r0)
            cuda.atomic.add(req, (1, at), rn)
            cuda.atomic.add(req, (2, at), rn * norm)
            cuda.atomic.max(req, (3, at), norm)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[N, D] view of [..., D] (a copy only when the leading dims cannot be merged)."""
    return t.reshape(-1, t.shape[-1])


def _check(*ts: torch.Tensor) -> None:
    dtype = ts[0].dtype
    if dtype not in DTYPES or any(t.dtype != dtype for t in ts):
        raise ValueError(f"layer kernels take fp16 or fp32 tensors of one dtype, got {[t.dtype for t in ts]}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [..., D] as models.layers.RMSNorm computes it; with `residual`, of h = x + residual, returning
    (h, norm(h)) from one launch."""
    _check(x, weight, *(() if residual is None else (residual,)))
    if x.shape[-1] > MAX_NORM_DIM:
        raise ValueError(f"rms_norm takes rows of up to {MAX_NORM_DIM} elements, got {x.shape[-1]}")
    x2 = _rows(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = y if residual is None else torch.empty_like(y)
    res = x2 if residual is None else _rows(residual)
    launch(_rms_norm_kernel, x2.shape[0], NORM_THREADS, (x2, res, _rows(h), _rows(y), weight, float32(eps),
                                                         residual is not None, x.dtype == torch.float16))
    return y if residual is None else (h, y)


def moe_out_norm(residual: torch.Tensor, routed: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor,
                 weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, RMSNorm(h)) for h = residual + (routed + sigmoid(gate) * shared): `shared_expert_out` and the next layer's
    `rms_norm` in one launch (the same values). residual, routed, shared [N, D], gate [N, 1]."""
    _check(residual, routed, gate, shared, weight)
    if residual.shape[-1] > MAX_NORM_DIM:
        raise ValueError(f"moe_out_norm takes rows of up to {MAX_NORM_DIM} elements, got {residual.shape[-1]}")
    h, y = torch.empty_like(residual), torch.empty_like(residual)
    launch(_moe_out_norm_kernel, residual.shape[0], NORM_THREADS,
           (residual, routed, gate, shared, h, y, weight, float32(eps), residual.dtype == torch.float16))
    return h, y


def rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv: int,
         head_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
         store: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [B, H, T, hd] and k [B, Hkv, T, hd] (contiguous) with RoPE applied, from a fused projection's qkv [B, T,
    (H + 2 Hkv) * hd] and cos/sin [B, 1, T, hd] (models.layers.rope_cos_sin); models.layers.apply_rope's result.
    head_norm = (q_weight [hd], k_weight [hd], eps): each head RMS-normed first, as models.layers.Attention does with
    qk_norm "head" (Qwen3): one launch where the step ran two norm kernels and ~11 of torch's for RoPE.
    store = (kv [R, Hkv, hd], dst [2, B * T], src [B * T] or None), a paged cache's `kv_store`: token i's k and v
    (token src[i]'s where given) written to rows dst[0, i] and dst[1, i] of kv in the same launch, k not returned
    (None): the K/V write's launch (decode) or torch calls (prefill) saved."""
    _check(qkv, cos, sin, *(() if head_norm is None else head_norm[:2]))
    b, t, _ = qkv.shape
    hd = cos.shape[-1]
    q = torch.empty(b, n_heads, t, hd, dtype=qkv.dtype, device=qkv.device)
    qw, kw, eps = head_norm if head_norm is not None else (cos[0, 0, 0], cos[0, 0, 0], 0.0)  # unread stand-ins
    unread_k, unread_kv, unread_dst = _stand_ins(qkv.device, qkv.dtype)
    if store is None:
        k = torch.empty(b, n_kv, t, hd, dtype=qkv.dtype, device=qkv.device)
        kv, dst, src, mode, heads = unread_kv, unread_dst, unread_dst[0], 0, n_heads + n_kv
    else:
        kv, dst, src = store
        if (kv.dtype != qkv.dtype or kv.dim() != 3 or tuple(kv.shape[1:]) != (n_kv, hd)
                or tuple(dst.shape) != (2, b * t) or (src is not None and tuple(src.shape) != (b * t,))):
            raise ValueError(f"rope's store takes kv [R, {n_kv}, {hd}] of qkv's dtype, dst [2, {b * t}] and src "
                             f"[{b * t}]; got kv {tuple(kv.shape)} {kv.dtype}, dst {tuple(dst.shape)}, src "
                             f"{None if src is None else tuple(src.shape)}")
        k, heads, mode = unread_k, n_heads + 2 * n_kv, 1 if src is None else 2
        src = dst[0] if src is None else src  # unread in mode 1
    launch(_rope_kernel, (b * t, heads), ROPE_THREADS, (
        qkv, cos[:, 0], sin[:, 0], q, k, n_heads, n_kv, qw, kw, float32(eps), head_norm is not None,
        qkv.dtype == torch.float16, kv, dst, src, mode))
    return q, (k if store is None else None)


@functools.lru_cache(maxsize=16)
def _stand_ins(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rope's unread arguments of the path not taken: k where it stores, kv and dst (and src, dst[0]) where it does
    not (tensors of their own, one element or two, kept per device: the simulator copies each array argument back
    after a launch, so q cannot stand in for k)."""
    return (torch.zeros(1, 1, 1, 1, dtype=dtype, device=device), torch.zeros(1, 1, 1, dtype=dtype, device=device),
            torch.zeros(2, 1, dtype=torch.int64, device=device))


def _route_outputs(n: int, e: int, top_k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The router kernels' ids [n, k] (int64) and weights [n, k] (float32), after checking E and k."""
    if e > MAX_EXPERTS or not 1 <= top_k <= e:
        raise ValueError(f"the router kernels take up to {MAX_EXPERTS} experts and 1 <= top_k <= E, got E={e}, "
                         f"k={top_k}")
    return (torch.empty(n, top_k, dtype=torch.int64, device=device),
            torch.empty(n, top_k, dtype=torch.float32, device=device))


def route_topk(logits: torch.Tensor, top_k: int, renorm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> ids [N, k] (int64), weights [N, k] (float32): models.layers.MoEBlock.route's result."""
    _check(logits)
    n, e = logits.shape
    ids, weights = _route_outputs(n, e, top_k, logits.device)
    launch(_topk_kernel, n, THREADS, (logits, top_k, renorm, ids, weights))
    return ids, weights


_ROUTER_DONE: dict[torch.device, torch.Tensor] = {}  # per device: the router kernel's counters, all 0 between launches


def router_topk(x: torch.Tensor, weight: torch.Tensor, top_k: int, renorm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] and the router's weight [E, D] -> `route_topk(F.linear(x, weight), top_k, renorm)` in one launch
    (the logits' float32 sum in another order: a logit may differ by an ulp of x's dtype). The counters are made on
    the first call outside a CUDA graph capture; until then, and above ROUTER_MAX_TOKENS tokens, the two launches.
    They (16 KiB of int32) stay for the life of the process, outside the pool: activation memory, which the engine's
    activation_reserve="auto" measures with the rest."""
    _check(x, weight)
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"router_topk takes x [N, D] and weight [E, D], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    n, e = x.shape[0], weight.shape[0]
    done = _ROUTER_DONE.get(x.device)
    if done is None and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        done = _ROUTER_DONE[x.device] = torch.zeros(ROUTER_MAX_TOKENS, dtype=torch.int32, device=x.device)
    if done is None or n > ROUTER_MAX_TOKENS:
        return route_topk(tf.linear(x, weight), top_k, renorm)
    ids, weights = _route_outputs(n, e, top_k, x.device)
    logits = torch.empty(n, -(-e // 32) * 32, dtype=torch.float32, device=x.device)  # rows of whole 128-byte lines
    launch(_router_kernel, (e, n), THREADS, (x, weight, logits, done, top_k, renorm, ids, weights,
                                             x.dtype == torch.float16))
    return ids, weights


def route_stats(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
                token_weights: torch.Tensor | None, acc: torch.Tensor, token_rows: torch.Tensor | None = None,
                req: torch.Tensor | None = None) -> None:
    """Add one step's routing statistics to acc [4, L * E] (float32) in one launch: signals.RouterStats' fold of
    x [L', n, D] (fp16/fp32), ids [L', n, k] (int64), weights [L', n, k] (fp16/fp32, times token_weights if given:
    [n], or [L', n] a weight per layer and token) and offsets [L'] (int64, layer * E), where torch takes ~15 small kernels. With token_rows [n] (int64)
    and req [4, rows * L * E] (float32), each token's unweighted statistics also go to its request's row of req
    (RouterStats.track_requests)."""
    if x.dtype not in DTYPES or weights.dtype not in DTYPES or ids.dtype != torch.int64:
        raise ValueError(f"route_stats takes fp16/fp32 x and weights and int64 ids, got {x.dtype}, {weights.dtype}, "
                         f"{ids.dtype}")
    if acc.dtype != torch.float32 or acc.shape[0] != 4 or ids.shape[2] > THREADS:
        raise ValueError(f"route_stats adds into a float32 [4, rows] accumulator with top-k <= {THREADS}")
    tracked = token_rows is not None
    if tracked and (req is None or req.dtype != torch.float32 or req.shape[0] != 4 or token_rows.dtype != torch.int64
                    or req.shape[1] % acc.shape[1]):
        raise ValueError("route_stats' per-request sums take int64 token_rows and a float32 [4, rows * L * E] req")
    weighted = token_weights is not None
    tw = token_weights.float().reshape(-1, x.shape[1]) if weighted else acc[:1, :1]  # unread stand-in: unweighted
    if tw.shape[0] not in (1, x.shape[0]):
        raise ValueError(f"route_stats' token weights are [n] or [L', n], got {tuple(token_weights.shape)}")
    if not tracked:  # unread stand-ins of their own (the simulator copies each array back: not acc a second time)
        token_rows, req = _untracked(acc.device)
    launch(_route_stats_kernel, (x.shape[0], x.shape[1]), THREADS, (x, ids, weights, offsets, tw, weighted, acc,
                                                                     token_rows, tracked, req))


@functools.lru_cache(maxsize=None)
def _untracked(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(1, dtype=torch.int64, device=device), torch.zeros(4, 1, device=device)


def _grid(n: int, d: int) -> tuple[int, int]:
    return -(-d // THREADS), n


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2F] (gate first), [..., F]: models.layers.MLP.down's input."""
    _check(gate_up)
    rows = _rows(gate_up)
    f = rows.shape[1] // 2
    out = torch.empty(*gate_up.shape[:-1], f, dtype=gate_up.dtype, device=gate_up.device)
    launch(_swiglu_kernel, _grid(rows.shape[0], f), THREADS, (rows, _rows(out), gate_up.dtype == torch.float16))
    return out


def shared_expert_out(x: torch.Tensor, routed: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor
                      ) -> torch.Tensor:
    """x + (routed + sigmoid(gate) * shared): an MoE block's output with a gated shared expert, added to the residual
    stream x [N, D]; gate [N, 1]."""
    _check(x, routed, gate, shared)
    out = torch.empty_like(x)
    launch(_shared_out_kernel, _grid(*x.shape), THREADS, (x, routed, gate, shared, out, x.dtype == torch.float16))
    return out
