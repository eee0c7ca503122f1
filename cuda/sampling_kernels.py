"""Top-p (nucleus) without a sort (Numba CUDA): each row's cut, the smallest logit the nucleus keeps, found by a
radix select over the row's probability mass; the sampler then masks the logits below it.

Why: the sampler found the nucleus by sorting every row (values and int64 indices), a softmax and a cumsum over the
sorted rows, and a scatter back to vocabulary order: 1.71 ms a call at 32 rows of 151,936 logits and 12 % of a
batch-32 decode step on the H200, with 49 bytes of temporaries a logit (sampler_bench-nvidia-h200-20261203-s35-ab2.json,
engine_bench-…-s35-sampling2-t08p09.json). The nucleus needs only its boundary, not the order inside it.

What a row's cut is (the torch twin, `reference.top_p_cut_reference`, computes the same with a sort). With m the
row's largest logit, each token carries the fixed-point mass q = floor(exp(x - m) * 2^40) (exp in float32; tokens
more than 40 ln 2 below m carry 0: less than 2^-40 of the top token's probability each). Z is the row's total and
target = ceil(top_p * Z) (float64). The cut is the largest logit c whose tokens at or above it hold at least target:
exactly the tokens the sorted rule keeps (a token stays while the mass before it is below top_p), except that every
token tied with the last one kept is kept. Integer sums are exact in any order, so the atomics' order cannot move the
cut: the same logits give the same cut on every run.

How, one block per row: a pass bins the tokens by m - x (256 equal bins over [0, 40 ln 2)) and sums their masses; the
bin where the running mass crosses the target holds the cut. Four more passes over that bin's tokens only select the
cut's float bits 8 at a time (keys ordered as the floats are). Each pass reads the row from global memory (a row of
151,936 float32 logits is 594 KiB), LOADS elements per thread in flight; the histograms and their scans live in
shared memory, so the CUDA simulator runs this very kernel in the CPU tests (tests/test_sampling_kernels.py).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ._compat import SIMULATOR, cuda
from .moe_kernels import _dev, _stream

THREADS = 512  # one row's threads (the simulator runs fewer: each is a Python thread there)
SIM_THREADS = 64
LOADS = 4  # elements a thread loads before using any
BINS = 256  # a histogram's bins; 32 chunks of 8 for the scan
CHUNKS = 32
PER_CHUNK = BINS // CHUNKS
FRACTION_BITS = 40  # a token's mass in units of 2^-40 of the top token's
LOG_RANGE = np.float32(FRACTION_BITS * math.log(2.0))  # tokens further below the top carry no mass
BIN_SCALE = np.float32(BINS / float(LOG_RANGE))
SCALE = np.float32(2.0 ** FRACTION_BITS)
SIGN = 1 << 31
NEG_INF_BITS = -8388608  # 0xFF800000 as int32

float32, float64, int64, uint64 = np.float32, np.float64, np.int64, np.uint64


@cuda.jit(device=True, inline=True)
def _key(bits):
    """A float's int32 bits -> an int64 key in [0, 2^32) ordered as the floats are (-0.0 just below +0.0)."""
    b = int64(bits)
    return b + SIGN if b >= 0 else int64(-1) - b


@cuda.jit(device=True, inline=True)
def _bin(d):
    """The first pass's bin of a token m - x = d below the top (d < LOG_RANGE)."""
    return min(int64(d * BIN_SCALE), int64(BINS - 1))


@cuda.jit(device=True, inline=True)
def _mass(d):
    """The fixed-point mass of a token d below the top (0 past LOG_RANGE, and for NaN)."""
    if d < LOG_RANGE:
        return uint64(float32(math.exp(-d)) * SCALE)
    return uint64(0)


@cuda.jit(device=True, inline=True)
def _scan(hist, part, state, t, level, p):
    """Thread 0 finds the bin where the running mass crosses the target, walking the bins from the largest logits
    down (the first pass's bins ascending, the key passes' descending): state[1] <- that bin (level 0) or the key's
    prefix extended by it, state[2] += the mass of the bins walked past; at level 0 it first sets the target
    state[3] = ceil(p * Z) from the row's total Z. Threads t < CHUNKS first sum a chunk each."""
    if t < CHUNKS:
        s = uint64(0)
        for j in range(PER_CHUNK):
            s += hist[t * PER_CHUNK + j]
        part[t] = s
    cuda.syncthreads()
    if t == 0:
        if level == 0:
            z = uint64(0)
            for c in range(CHUNKS):
                z += part[c]
            state[3] = int64(max(min(math.ceil(p * float64(z)), float64(z)), 1.0))
        target = uint64(state[3])
        above = uint64(state[2])
        b = 0
        for i in range(CHUNKS):  # the last chunk and bin are taken if nothing crossed before (cannot happen)
            c = i if level == 0 else CHUNKS - 1 - i
            if above + part[c] >= target or i == CHUNKS - 1:
                for j in range(PER_CHUNK):
                    b = c * PER_CHUNK + (j if level == 0 else PER_CHUNK - 1 - j)
                    if above + hist[b] >= target or j == PER_CHUNK - 1:
                        break
                    above += hist[b]
                break
            above += part[c]
        state[2] = int64(above)
        state[1] = int64(b) if level == 0 else state[1] * BINS + int64(b)
    cuda.syncthreads()


@cuda.jit(cache=True)
def _top_p_cut_kernel(x, xi, top, top_p, cut_bits):
    """Row r's cut into cut_bits[r] (float32 bits; -inf where the row keeps everything: top_p >= 1, or a top that
    is not finite). x [R, V] float32 logits (-inf: masked), xi the same memory as int32, top [R] each row's largest
    logit, top_p [R] float32."""
    r = cuda.blockIdx.x
    t = cuda.threadIdx.x
    T = cuda.blockDim.x
    V = x.shape[1]
    hist = cuda.shared.array(BINS, np.uint64)
    part = cuda.shared.array(CHUNKS, np.uint64)
    state = cuda.shared.array(4, np.int64)  # the cut's first-pass bin, bin then key prefix, mass above, target
    vals = cuda.local.array(LOADS, np.float32)
    bits = cuda.local.array(LOADS, np.int32)
    m = top[r]
    p = float64(top_p[r])
    if not (p < 1.0) or not (m > -math.inf) or not (m < math.inf):
        if t == 0:
            cut_bits[r] = NEG_INF_BITS
        return
    if t == 0:
        state[1] = 0
        state[2] = 0
    for level in range(5):  # 0: bins by m - x; 1..4: the cut's key, 8 bits a pass from the top
        for b in range(t, BINS, T):
            hist[b] = 0
        cuda.syncthreads()
        shift = 32 - 8 * level
        cut_bin = state[0]
        prefix = state[1]
        for base in range(0, V, T * LOADS):
            for u in range(LOADS):  # every load issued before any is used (past V: element V - 1, not counted)
                i = min(base + u * T + t, V - 1)
                vals[u] = x[r, i]
                bits[u] = xi[r, i]
            for u in range(LOADS):
                d = m - vals[u]
                q = _mass(d)
                if q > 0 and base + u * T + t < V:
                    if level == 0:
                        cuda.atomic.add(hist, _bin(d), q)
                    elif _bin(d) == cut_bin:
                        k = _key(bits[u])
                        if level == 1 or (k >> (shift + 8)) == prefix:
                            cuda.atomic.add(hist, (k >> shift) & (BINS - 1), q)
        cuda.syncthreads()
        _scan(hist, part, state, t, level, p)
        if level == 0:
            if t == 0:
                state[0] = state[1]  # the bin that holds the cut; the key passes start from an empty prefix
                state[1] = 0
            cuda.syncthreads()
    if t == 0:
        k = state[1]
        cut_bits[r] = k - SIGN if k >= SIGN else int64(-1) - k  # the key back to the float's (signed) bits


def takes(x: torch.Tensor) -> bool:
    """Whether `top_p_cut` runs on x: float32 rows on a GPU (or on the CPU under the CUDA simulator)."""
    return x.dtype == torch.float32 and x.dim() == 2 and (x.is_cuda or SIMULATOR)


def top_p_cut(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Each row's nucleus cut: x [R, V] float32 logits (after temperature and any mask, -inf: masked), top_p [R]
    float32 -> [R] float32, the smallest logit the row's nucleus keeps (-inf: the whole row). x >= cut[:, None] is
    the nucleus, ties at the cut included. One launch and one reduction, no host read, no [R, V] temporary."""
    if not takes(x) or top_p.shape != x.shape[:1]:
        raise ValueError(f"top_p_cut takes float32 logits [R, V] on the GPU and top_p [R], got {tuple(x.shape)} "
                         f"{x.dtype} on {x.device} and {tuple(top_p.shape)}")
    x = x.contiguous()
    top = x.amax(dim=-1)
    cut = torch.empty(x.shape[0], dtype=torch.int32, device=x.device)
    _top_p_cut_kernel[x.shape[0], SIM_THREADS if SIMULATOR else THREADS, _stream()](
        _dev(x), _dev(x.view(torch.int32)), _dev(top), _dev(top_p.to(torch.float32)), _dev(cut))
    return cut.view(torch.float32)
