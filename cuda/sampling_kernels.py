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

How, in three launches (tests/test_sampling_kernels.py runs them under the CUDA simulator: shared-memory reductions
and atomics only, no warp shuffles):
1. `_fine_hist_kernel`, grid (rows, slices of THREADS x LOADS x ROUNDS tokens): each block sums its slice's masses in
   FINE bins by m - x (0.0135 nats each) in shared memory, then adds them to the row's histogram in global memory.
2. `_gather_kernel`, same grid: each block scans the row's histogram (a block-wide prefix sum) to the bin where the
   running mass from the top reaches the target, and gathers its slice's tokens in that bin.
3. `_cut_kernel`, one block per row: the cut's float bits, 8 at a time from the top, by four histograms of the
   gathered tokens' masses over their keys (ordered as the floats are), in shared memory; a bin holding more than
   CAP tokens (many ties) is read in place from the row instead.
A single block per row reading the whole row five times (the first form, f322738) cost a batch-1 decode step 0.7 ms
on the H200 (benchmarks/results/engine_bench-nvidia-h200-20261205-s40-topp.json): one SM's loads.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ._compat import SIMULATOR, cuda
from .launcher import launch

THREADS = 512  # a block's threads (the simulator runs fewer: each is a Python thread there)
SIM_THREADS = 64
LOADS = 4  # elements a thread loads before using any
ROUNDS, SIM_ROUNDS = 4, 1  # rounds of LOADS a thread takes in the split passes: a block's slice of the row
FINE = 2048  # the first pass's bins over [0, LOG_RANGE): 0.0135 nats each
BINS = 256  # a key pass's bins; 32 chunks of 8 for its scan
CHUNKS = 32
PER_CHUNK = BINS // CHUNKS
CAP = 4096  # candidates (the cut's fine bin's tokens) the last launch holds in shared memory; more: read in place
FRACTION_BITS = 40  # a token's mass in units of 2^-40 of the top token's
LOG_RANGE = np.float32(FRACTION_BITS * math.log(2.0))  # tokens further below the top carry no mass
FINE_SCALE = np.float32(FINE / float(LOG_RANGE))
SCALE = np.float32(2.0 ** FRACTION_BITS)
SIGN = 1 << 31
NEG_INF_BITS = -8388608  # 0xFF800000 as int32

float32, float64, int64 = np.float32, np.float64, np.int64


@cuda.jit(device=True, inline=True)
def _key(bits):
    """A float's int32 bits -> an int64 key in [0, 2^32) ordered as the floats are (-0.0 just below +0.0)."""
    b = int64(bits)
    return b + SIGN if b >= 0 else int64(-1) - b


@cuda.jit(device=True, inline=True)
def _fine_bin(d):
    """The first pass's bin of a token d = m - x below the top (d < LOG_RANGE)."""
    return min(int64(d * FINE_SCALE), int64(FINE - 1))


@cuda.jit(device=True, inline=True)
def _mass(d):
    """The fixed-point mass of a token d below the top (0 past LOG_RANGE, and for NaN)."""
    if d < LOG_RANGE:
        return int64(float32(math.exp(-d)) * SCALE)
    return int64(0)


@cuda.jit(device=True, inline=True)
def _skip(top, p):
    """Whether a row keeps every token: top_p >= 1, or a top that is not finite (every logit masked, or NaN)."""
    return not (p < 1.0) or not (top > -math.inf) or not (top < math.inf)


@cuda.jit(cache=True)
def _fine_hist_kernel(x, top, top_p, counts, rounds):
    """Grid (R, slices): counts[r, :FINE] += the masses of row r's tokens in this block's slice, by fine bin (the
    block's histogram in shared memory, then one global atomic per bin it touched)."""
    r = cuda.blockIdx.x
    t = cuda.threadIdx.x
    T = cuda.blockDim.x
    V = x.shape[1]
    m = top[r]
    if _skip(m, top_p[r]):
        return
    local = cuda.shared.array(FINE, np.int64)
    for b in range(t, FINE, T):
        local[b] = 0
    cuda.syncthreads()
    vals = cuda.local.array(LOADS, np.float32)
    start = cuda.blockIdx.y * T * LOADS * rounds
    for rnd in range(rounds):
        base = start + rnd * T * LOADS
        for u in range(LOADS):  # every load issued before any is used (past V: element V - 1, not counted)
            vals[u] = x[r, min(base + u * T + t, V - 1)]
        for u in range(LOADS):
            d = m - vals[u]
            q = _mass(d)
            if q > 0 and base + u * T + t < V:
                cuda.atomic.add(local, _fine_bin(d), q)
    cuda.syncthreads()
    for b in range(t, FINE, T):
        if local[b] > 0:
            cuda.atomic.add(counts, (r, b), local[b])


@cuda.jit(device=True, inline=True)
def _find_fine(hist, r, p, part, found, t, T):
    """The block's view of row r's fine histogram: found[0] <- the bin where the running mass (from the top token
    down) reaches target = ceil(p * Z), found[1] <- the mass of the bins before it, found[2] <- target. Each thread
    sums FINE / T bins, an inclusive scan over the threads' sums (Hillis-Steele in shared memory), and the one thread
    whose span holds the target walks its bins."""
    per = FINE // T
    s = int64(0)
    for j in range(per):
        s += hist[r, t * per + j]
    part[t] = s
    cuda.syncthreads()
    step = 1
    while step < T:
        v = part[t - step] if t >= step else int64(0)
        cuda.syncthreads()
        part[t] += v
        cuda.syncthreads()
        step *= 2
    z = part[T - 1]
    target = int64(max(min(math.ceil(p * float64(z)), float64(z)), 1.0))
    above = part[t - 1] if t > 0 else int64(0)
    if above < target <= part[t]:
        b = t * per
        for j in range(per):
            b = t * per + j
            if above + hist[r, b] >= target:
                break
            above += hist[r, b]
        found[0] = b
        found[1] = above
        found[2] = target
    cuda.syncthreads()


@cuda.jit(cache=True)
def _gather_kernel(x, top, top_p, counts, cand, rounds, cap):
    """Grid (R, slices): the tokens of this block's slice that fall in the cut's fine bin go to cand[r] (up to cap;
    counts[r, FINE] counts them all); block (r, 0) writes the bin, the mass above it and the target to
    counts[r, FINE + 1:]."""
    r = cuda.blockIdx.x
    t = cuda.threadIdx.x
    T = cuda.blockDim.x
    V = x.shape[1]
    m = top[r]
    p = float64(top_p[r])
    if _skip(m, p):
        return
    part = cuda.shared.array(THREADS, np.int64)
    found = cuda.shared.array(3, np.int64)
    _find_fine(counts, r, p, part, found, t, T)
    if cuda.blockIdx.y == 0 and t < 3:
        counts[r, FINE + 1 + t] = found[t]
    cut_bin = found[0]
    vals = cuda.local.array(LOADS, np.float32)
    start = cuda.blockIdx.y * T * LOADS * rounds
    for rnd in range(rounds):
        base = start + rnd * T * LOADS
        for u in range(LOADS):
            vals[u] = x[r, min(base + u * T + t, V - 1)]
        for u in range(LOADS):
            d = m - vals[u]
            if d < LOG_RANGE and _fine_bin(d) == cut_bin and base + u * T + t < V:
                slot = cuda.atomic.add(counts, (r, FINE), 1)
                if slot < cap:
                    cand[r, slot] = vals[u]


@cuda.jit(device=True, inline=True)
def _scan_keys(hist, part, state, t, first):
    """Thread 0 walks a key pass's bins from the largest key down to the one where the running mass reaches the
    target: state[0] <- the key prefix extended by it (`first`: no prefix yet), state[1] += the mass walked past.
    Threads t < CHUNKS first sum a chunk of PER_CHUNK bins each."""
    if t < CHUNKS:
        s = int64(0)
        for j in range(PER_CHUNK):
            s += hist[t * PER_CHUNK + j]
        part[t] = s
    cuda.syncthreads()
    if t == 0:
        target = state[2]
        above = state[1]
        b = 0
        for i in range(CHUNKS):  # the last chunk and bin are taken if nothing crossed before (cannot happen)
            c = CHUNKS - 1 - i
            if above + part[c] >= target or i == CHUNKS - 1:
                for j in range(PER_CHUNK):
                    b = c * PER_CHUNK + PER_CHUNK - 1 - j
                    if above + hist[b] >= target or j == PER_CHUNK - 1:
                        break
                    above += hist[b]
                break
            above += part[c]
        state[1] = above
        state[0] = int64(b) if first else state[0] * BINS + int64(b)
    cuda.syncthreads()


@cuda.jit(cache=True)
def _cut_kernel(x, xi, top, top_p, counts, cand, cand_bits, cut_bits, cap):
    """Grid (R,): row r's cut into cut_bits[r] (float32 bits; -inf where the row keeps everything). The cut's key is
    selected 8 bits a pass among the fine bin's tokens: from shared memory when they fit in `cap`, else from the row
    in place (tokens of that bin only). cand_bits and xi are int32 views of cand and x."""
    r = cuda.blockIdx.x
    t = cuda.threadIdx.x
    T = cuda.blockDim.x
    V = x.shape[1]
    m = top[r]
    if _skip(m, top_p[r]):
        if t == 0:
            cut_bits[r] = NEG_INF_BITS
        return
    held = cuda.shared.array(CAP, np.float32)
    held_bits = cuda.shared.array(CAP, np.int32)
    hist = cuda.shared.array(BINS, np.int64)
    part = cuda.shared.array(CHUNKS, np.int64)
    sel = cuda.shared.array(3, np.int64)  # key prefix, mass above, target
    n = counts[r, FINE]
    inside = n <= cap
    if inside:
        for i in range(t, n, T):
            held[i] = cand[r, i]
            held_bits[i] = cand_bits[r, i]
    if t == 0:
        sel[0] = 0
        sel[1] = counts[r, FINE + 2]
        sel[2] = counts[r, FINE + 3]
    cut_bin = counts[r, FINE + 1]
    for level in range(4):  # the key's bytes from the top
        for b in range(t, BINS, T):
            hist[b] = 0
        cuda.syncthreads()
        shift = 24 - 8 * level
        prefix = sel[0]
        for i in range(t, n if inside else V, T):
            v = held[i] if inside else x[r, i]
            d = m - v
            if d < LOG_RANGE and (inside or _fine_bin(d) == cut_bin):
                k = _key(held_bits[i] if inside else xi[r, i])
                if level == 0 or (k >> (shift + 8)) == prefix:
                    cuda.atomic.add(hist, (k >> shift) & (BINS - 1), _mass(d))
        cuda.syncthreads()
        _scan_keys(hist, part, sel, t, level == 0)
    if t == 0:
        k = sel[0]
        cut_bits[r] = k - SIGN if k >= SIGN else int64(-1) - k  # the key back to the float's (signed) bits


def takes(x: torch.Tensor) -> bool:
    """Whether `top_p_cut` runs on x: float32 rows on a GPU (or on the CPU under the CUDA simulator)."""
    return x.dtype == torch.float32 and x.dim() == 2 and (x.is_cuda or SIMULATOR)


def top_p_cut(x: torch.Tensor, top_p: torch.Tensor, cap: int = CAP) -> torch.Tensor:
    """Each row's nucleus cut: x [R, V] float32 logits (after temperature and any mask, -inf: masked), top_p [R]
    float32 -> [R] float32, the smallest logit the row's nucleus keeps (-inf: the whole row). x >= cut[:, None] is
    the nucleus, ties at the cut included. Three launches (straight through the driver) and a reduction, no host
    read, R x 32 KiB of buffers.
    `cap` (at most CAP; tests lower it) bounds the candidates held in shared memory."""
    if not takes(x) or top_p.shape != x.shape[:1]:
        raise ValueError(f"top_p_cut takes float32 logits [R, V] on the GPU and top_p [R], got {tuple(x.shape)} "
                         f"{x.dtype} on {x.device} and {tuple(top_p.shape)}")
    x = x.contiguous()
    rows, vocab = x.shape
    threads, rounds = (SIM_THREADS, SIM_ROUNDS) if SIMULATOR else (THREADS, ROUNDS)
    slices = -(-vocab // (threads * LOADS * rounds))
    dev = x.device
    xi, top, p = x.view(torch.int32), x.amax(dim=-1), top_p.to(torch.float32).contiguous()
    counts = torch.zeros(rows, FINE + 4, dtype=torch.int64, device=dev)  # the fine histogram, count, state (3)
    cand = torch.empty(rows, CAP, dtype=torch.float32, device=dev)
    cut = torch.empty(rows, dtype=torch.int32, device=dev)
    cap = min(cap, CAP)
    launch(_fine_hist_kernel, (rows, slices), threads, (x, top, p, counts, rounds))
    launch(_gather_kernel, (rows, slices), threads, (x, top, p, counts, cand, rounds, cap))
    launch(_cut_kernel, (rows,), threads, (x, xi, top, p, counts, cand, cand.view(torch.int32), cut, cap))
    return cut.view(torch.float32)
