"""Fused mixed-precision MoE kernels (Numba CUDA) reading expert blocks straight from bit-planes in the pool.

Decode path (T <= DECODE_MAX_T), four stream-ordered steps, all capturable in a torch.cuda.CUDAGraph:
1. `_route_kernel` (one block): groups the T*k routed (token, expert) pairs by expert into "slots"
   (slot j = the j-th distinct expert, its pairs contiguous at slot_start[j]); n_active on the device.
2. `_gemv_kernel` kind 0 (gate_up, W [2F, D]): h[pair, :] += W_q @ x[token] for every pair of the slot.
3. `_gemv_kernel` kind 1 (down, W [D, F]): out[token] += w_pair * W_q @ (silu(h_gate) * h_up).
4. torch casts the fp32 accumulator to the activation dtype.

Why this shape (GPU.md, H200 ~14 FLOP per HBM byte): one thread per output row so that plane words load
coalesced (plane p is [W, N] word-major); each block takes ROWS rows and a K range (split-K, fp32 atomics);
LUT_q of the block's rows in shared memory as [2^q][ROWS] (fp32 up to 6 bits, fp16 above) so each lane reads its
own bank; x of up to TT tokens in shared memory (broadcast 128-bit reads); plane words prefetched 2-4 words
ahead in registers. The decode of a 32-column word is generated per (width, token tile): plane word p shifted by g and masked
with 0x11111111 (widths <= 4) or 0x01010101 (widths 5..8) puts the bits of columns g, g+4, ... (g+8, ...) in
nibble (byte) lanes, so one shift + one 3-input LOP per plane builds 8 (4) indices at once. Each decoded
weight is used for every token of its expert (1..64 tokens, tiles of 1 or 4), never dequantized to memory.
Compile time grows faster than linearly with the number of specialised bodies (21 bodies did not compile in
280 s on the GPU box; these 12 take 67 s), which is why the lane loop is a runtime loop and tiles are 1 and 4.
Each block reads its committed width q and plane/LUT offsets from the device tables, so changing the tables
between graph replays changes what is read without recapture.

Prefill path (T > DECODE_MAX_T): the routed blocks of a group of experts are dequantized at their committed widths
by one kernel launch per kind into a bounded scratch (written as W^T so that stores coalesce), and torch's
tensor-core matmuls do the rest, one per expert.
"""
from __future__ import annotations

import math
import os

import numpy as np
import torch

from ._compat import SIMULATOR, cuda

ROWS = 64  # threads (= output rows) per block; the LUT of P=8, [256][ROWS] fp16, is 32 KiB of shared memory
LOG_ROWS = 6
WS = 4  # plane words per sub-chunk: 128 columns of x staged per __syncthreads pair
XS = 32 * WS
TILES = (1, 4)  # token tiles; a slot with more tokens loops over tiles of 4
TT_MAX = TILES[-1]
X_SH = TT_MAX * XS  # floats of staged x
X_ALIGN = None if SIMULATOR else 16  # lets 4 consecutive x loads merge into one 128-bit LDS (cudasim rejects it)
MIN_WIDTH, MAX_WIDTH = 3, 8  # [seed..P]; the seed width is 3 in SPEC.md
LUT32_MAX_WIDTH = 6  # LUTs up to this width sit in shared memory as fp32 (no per-weight conversion)
WIDTHS = tuple(range(MIN_WIDTH, MAX_WIDTH + 1))  # one specialised body per width and token tile
DECODE_MAX_T = 64
ROUTE_THREADS = 256
MAX_EXPERTS = 1024
TARGET_BLOCKS = 2048  # enough 2-warp blocks for ~8 per SM on 132 SMs, two waves
MIN_SPLIT_WORDS = 16

float32, float16, uint32, int32 = np.float32, np.float16, np.uint32, np.int32
DT_F16, DT_F32, DT_U32, DT_I32 = (np.dtype(t) for t in (float16, float32, uint32, int32))  # array dtypes (simulator too)


@cuda.jit(device=True, inline=True)
def _silu_mul(g, u):
    return g / (float32(1.0) + math.exp(-g)) * u


@cuda.jit(device=True, inline=True)
def _x_value(kind, src, pair_tok, pair0, rem, K, F, col0, i):
    """Element i of a staged sub-chunk: input of pair (pair0 + i // XS) at column col0 + i % XS; 0 past K and
    past the slot's tokens. gate_up reads the token's hidden row, down reads silu(gate) * up of the pair."""
    t = i // XS
    col = col0 + (i - t * XS)
    v = float32(0.0)
    if t < rem and col < K:
        if kind == 0:
            v = src[pair_tok[pair0 + t], col]
        else:
            v = _silu_mul(src[pair0 + t, col], src[pair0 + t, F + col])
    return v


def prefetch_words(b: int) -> int:
    """Words loaded ahead per thread: ~16 registers, ~2 KiB in flight per warp (enough at ~10 warps per SM)."""
    return 4 if b <= 4 else (3 if b <= 6 else 2)


def _body_source(b: int, tt: int) -> str:
    """Source of `_work_{b}_{tt}`: one block's K range for one token tile at width b.

    The 32 columns of a word are straight-line code; the token loop has a constant trip count (LLVM unrolls it
    and keeps `acc` in registers); plane words are loaded `prefetch_words(b)` words ahead of their decode.
    """
    nib = b <= 4
    lanes, lane_bits = (8, 4) if nib else (4, 8)
    groups = 32 // lanes  # g: columns g, g+groups, g+2*groups, ... share one index register
    lane_mask = 0x11111111 if nib else 0x01010101
    es = 2 if b <= LUT32_MAX_WIDTH else 1  # log2 of the LUT entry's bytes (fp32 / fp16)
    L = []
    a = L.append
    a(f"def _work_{b}_{tt}(kind, src, pool_words, poff, lut32, lut16, x_sh, dst, pair_tok, pair_w, pair0, rem, "
      f"N, K, F, w0, w1, n, tid, utid):")
    a(f"    acc = cuda.local.array({tt}, dtype=DT_F32)")
    a(f"    for t in range({tt}):")
    a("        acc[t] = float32(0.0)")
    a(f"    ubyte = utid << uint32({es})  # this row's byte offset inside a LUT line")
    a("    nn = n if n < N else 0")
    a("    NN = np.int64(N)")
    pf = prefetch_words(b)
    for p in range(b):
        a(f"    pb{p} = poff[{p}] + nn")
    def load_ring(j: int, word: str, indent: str) -> None:
        """Ring slot j <- the b plane words of word `word` (zeros past the block's last word)."""
        a(f"{indent}if {word} < w1:")
        for p in range(b):
            a(f"{indent}    r{j}_{p} = uint32(pool_words[pb{p} + ({word}) * NN])")
        a(f"{indent}else:")
        for p in range(b):
            a(f"{indent}    r{j}_{p} = U0")

    for j in range(pf):  # ring of the next pf words' plane words, loads issued pf words ahead of use
        load_ring(j, f"w0 + {j}", "    ")
    nx = tt * XS // ROWS  # x values each thread stages per sub-chunk
    xargs = "kind, src, pair_tok, pair0, rem, K, F"
    # Prefetching the next sub-chunk's x into registers (tried) raised the kernel to 212 registers and lost more to
    # occupancy than it hid: x is staged straight into shared memory between one barrier pair per sub-chunk.
    a("    w = w0")
    a("    while w < w1:")
    a("        cuda.syncthreads()  # the previous sub-chunk's reads of x_sh are done (the first time: LUT staged)")
    for j in range(nx):
        a(f"        x_sh[tid + {j * ROWS}] = _x_value({xargs}, w * 32, tid + {j * ROWS})")
    a("        cuda.syncthreads()")
    a(f"        for i in range({WS}):")
    a("            wi = w + i")
    a("            if wi < w1:")
    for p in range(b):
        a(f"                c{p} = r0_{p}")
    for j in range(pf - 1):
        for p in range(b):
            a(f"                r{j}_{p} = r{j + 1}_{p}")
    load_ring(pf - 1, f"wi + {pf}", "                ")
    a("                xb = i * 32")
    for g in range(groups):
        terms = []
        for p in range(b):
            sh = (b - 1 - p) - g  # bit g of each lane moves to bit (b-1-p) of the lane
            mask = f"uint32({(lane_mask << (b - 1 - p)) & 0xFFFFFFFF})"
            if sh > 0:
                terms.append(f"((c{p} << uint32({sh})) & {mask})")
            elif sh < 0:
                terms.append(f"((c{p} >> uint32({-sh})) & {mask})")
            else:
                terms.append(f"(c{p} & {mask})")
        # widened and pre-scaled by ROWS: one funnel shift + one LOP3 give lane m's index * ROWS | row
        a(f"                s{g} = np.uint64(" + " | ".join(terms) + f") << np.uint64({LOG_ROWS + es})")
    a(f"                for m in range({lanes}):  # runtime loop keeps the kernel small enough to compile fast")
    a(f"                    sh = np.uint64({lane_bits}) * np.uint64(m)")
    a(f"                    xm = uint32(xb + {groups} * m)")
    mask = f"np.uint64({((1 << b) - 1) << (LOG_ROWS + es)})"
    for g in range(groups):
        # a byte offset (low bits known zero): indexing by e >> es lets the compiler drop the scaling LEA
        e = f"((uint32((s{g} >> sh) & {mask}) | ubyte) >> uint32({es}))"
        if b <= LUT32_MAX_WIDTH:
            a(f"                    wv = lut32[{e}]")
        else:
            a(f"                    wv = float32(lut16[{e}])")
        a(f"                    for t in range({tt}):")
        a(f"                        acc[t] += wv * x_sh[xm + uint32(t * {XS} + {g})]")
    a(f"        w += {WS}")
    # constant trip count: a loop bounded by rem would index acc dynamically and push it to local memory
    a("    if n < N:")
    a(f"        for t in range({tt}):")
    a("            if t < rem:")
    a("                if kind == 0:")
    a("                    cuda.atomic.add(dst, (pair0 + t, n), acc[t])")
    a("                else:")
    a("                    cuda.atomic.add(dst, (pair_tok[pair0 + t], n), pair_w[pair0 + t] * acc[t])")
    return "\n".join(L) + "\n"


def _make_work(b: int, tt: int):
    scope = {"np": np, "cuda": cuda, "float32": float32, "uint32": uint32, "U0": uint32(0), "_x_value": _x_value,
             "DT_F32": DT_F32}
    exec(compile(_body_source(b, tt), f"<moe_kernels:_work_{b}_{tt}>", "exec"), scope)
    return cuda.jit(device=True, inline=True)(scope[f"_work_{b}_{tt}"])


_WORK = {(b, tt): _make_work(b, tt) for b in WIDTHS for tt in TILES}


def _dispatch_source() -> str:
    """`_dispatch(b, tt, ...)`: if-chain from the runtime width and tile to the specialised bodies."""
    args = ("kind, src, pool_words, poff, lut32, lut16, x_sh, dst, pair_tok, pair_w, pair0, rem, N, K, F, w0, w1, n, tid, "
            "utid")
    L = [f"def _dispatch(b, tt, {args}):"]
    first = True
    for b in WIDTHS:
        for tt in TILES:
            kw = "if" if first else "elif"
            first = False
            L.append(f"    {kw} b == {b} and tt == {tt}:")
            L.append(f"        _w_{b}_{tt}({args})")
    return "\n".join(L) + "\n"


def _make_dispatch():
    scope = {f"_w_{b}_{tt}": fn for (b, tt), fn in _WORK.items()}
    exec(compile(_dispatch_source(), "<moe_kernels:_dispatch>", "exec"), scope)
    return cuda.jit(device=True)(scope["_dispatch"])


_dispatch = _make_dispatch()


# Register cap of the decode kernel. Uncapped it takes 161 registers (6 blocks of 2 warps per SM); at 128 (8 blocks,
# a few spilled registers) Mixtral T=1 4-bit went from 261 to 215 us on the H200 (moe_kernel_bench-*-regdefault /
# -reg128.json). PAGEDWEIGHT_MAX_REGISTERS overrides it (0 = no cap) for such comparisons.
MAX_REGISTERS = int(os.environ.get("PAGEDWEIGHT_MAX_REGISTERS", "128")) or None
_REG_CAP = {"max_registers": MAX_REGISTERS} if MAX_REGISTERS and not SIMULATOR else {}  # the simulator has no cap


@cuda.jit(cache=True, **_REG_CAP)  # 67 s of compile on the H200: reuse it across processes
def _gemv_kernel(kind, src, pool_words, pool_halves, q_tab, plane_off, lut_off, slot_expert, slot_start, slot_count,
                 n_active, pair_tok, pair_w, dst, N, K, F, words_per_split):
    """grid (ceil(N/ROWS), k-splits, slots), block ROWS; dynamic shared memory lut_shared_bytes(P) (the LUT).
    Widths outside WIDTHS match no body and contribute nothing: tables must hold widths in [MIN_WIDTH, MAX_WIDTH]."""
    slot = cuda.blockIdx.z
    if slot >= n_active[0]:
        return
    W = (K + 31) // 32
    w0 = cuda.blockIdx.y * words_per_split
    if w0 >= W:
        return
    w1 = min(W, w0 + words_per_split)
    e = slot_expert[slot]
    b = q_tab[e, kind]
    tid = cuda.threadIdx.x
    n = cuda.blockIdx.x * ROWS + tid
    lut32 = cuda.shared.array(0, dtype=DT_F32)  # dynamic shared arrays alias: one LUT buffer, two views
    lut16 = cuda.shared.array(0, dtype=DT_F16)
    x_sh = cuda.shared.array(X_SH, dtype=DT_F32, alignment=X_ALIGN)
    lo = lut_off[e, kind]
    for c in range(1 << b):
        v = pool_halves[lo + c * N + n] if n < N else float16(0.0)
        if b <= LUT32_MAX_WIDTH:
            lut32[c * ROWS + tid] = float32(v)
        else:
            lut16[c * ROWS + tid] = v
    # the first __syncthreads inside the body orders these stores before any LUT read
    poff = plane_off[e, kind]
    pair0 = slot_start[slot]
    cnt = slot_count[slot]
    t0 = 0
    while t0 < cnt:
        rem = cnt - t0
        tt = 1 if rem <= 1 else 4
        _dispatch(b, tt, kind, src, pool_words, poff, lut32, lut16, x_sh, dst, pair_tok, pair_w, pair0 + t0, rem,
                  N, K, F, w0, w1, n, tid, uint32(tid))
        t0 += tt


@cuda.jit(cache=True)  # 67 s of compile on the H200: reuse it across processes
def _route_kernel(topk_ids, topk_w, n_experts, slot_expert, slot_start, slot_count, n_active, pair_tok, pair_w):
    """One block: group pairs by expert. Slots follow ascending expert id; pairs of a slot are contiguous."""
    counts = cuda.shared.array(MAX_EXPERTS, dtype=DT_I32)
    fill = cuda.shared.array(MAX_EXPERTS, dtype=DT_I32)
    slot_of = cuda.shared.array(MAX_EXPERTS, dtype=DT_I32)
    tid = cuda.threadIdx.x
    nthr = cuda.blockDim.x
    k = topk_ids.shape[1]
    npairs = topk_ids.shape[0] * k
    for e in range(tid, n_experts, nthr):
        counts[e] = 0
        fill[e] = 0
    cuda.syncthreads()
    for i in range(tid, npairs, nthr):
        cuda.atomic.add(counts, topk_ids[i // k, i % k], 1)
    cuda.syncthreads()
    if tid == 0:
        s = 0
        start = 0
        for e in range(n_experts):
            c = counts[e]
            if c > 0:
                slot_of[e] = s
                slot_expert[s] = e
                slot_start[s] = start
                slot_count[s] = c
                s += 1
                start += c
        n_active[0] = s
    cuda.syncthreads()
    for i in range(tid, npairs, nthr):
        t = i // k
        e = topk_ids[t, i % k]
        j = slot_start[slot_of[e]] + cuda.atomic.add(fill, e, 1)
        pair_tok[j] = t
        pair_w[j] = topk_w[t, i % k]


@cuda.jit(cache=True)  # 67 s of compile on the H200: reuse it across processes
def _dequant_kernel(pool_words, pool_halves, q_tab, plane_off, lut_off, experts, kind, N, K, out):
    """out[j, k, n] = LUT_b[idx_b[n, k], n] of block (experts[j], kind) at its committed width b (prefill).

    Written transposed, [K, N] per block, so that the threads of a warp (consecutive rows n) store consecutive
    halves; the matmul then reads it as W^T. grid (ceil(N/ROWS), W, len(experts)), block ROWS."""
    n = cuda.blockIdx.x * ROWS + cuda.threadIdx.x
    w = cuda.blockIdx.y
    if n >= N:
        return
    e = experts[cuda.blockIdx.z]
    b = q_tab[e, kind]
    lo = lut_off[e, kind]
    words = cuda.local.array(MAX_WIDTH, dtype=DT_U32)
    for p in range(b):
        words[p] = uint32(pool_words[plane_off[e, kind, p] + np.int64(w) * N + n])
    for j in range(min(32, K - w * 32)):
        c = uint32(0)
        for p in range(b):
            c = (c << uint32(1)) | ((words[p] >> uint32(j)) & uint32(1))
        out[cuda.blockIdx.z, w * 32 + j, n] = pool_halves[lo + np.int64(c) * N + n]


# ----------------------------------------------------------------------------------------------- launcher

def _dev(t: torch.Tensor):
    """Numba view of a tensor: zero-copy device array on the GPU, numpy view under the simulator.
    uint32 travels as int32 (torch's array interface may not export uint32); kernels reinterpret each word."""
    t = t.detach()
    if t.dtype == torch.uint32:
        t = t.view(torch.int32)
    if SIMULATOR:
        return t.cpu().numpy()
    return cuda.as_cuda_array(t, sync=False)


def lut_shared_bytes(P: int) -> int:
    """Dynamic shared memory of one block for widths up to P: LUT_q of ROWS rows, fp32 up to LUT32_MAX_WIDTH,
    fp16 above."""
    return max((1 << min(P, LUT32_MAX_WIDTH)) * ROWS * 4, (1 << P) * ROWS * 2 if P > LUT32_MAX_WIDTH else 0)


def _words_per_split(W: int, row_tiles: int, slots: int) -> int:
    want = max(1, -(-TARGET_BLOCKS // (row_tiles * slots)))
    splits = max(1, min(want, -(-W // MIN_SPLIT_WORDS)))
    wps = -(-W // splits)
    return -(-wps // WS) * WS


def _stream():
    if SIMULATOR:
        return 0
    return cuda.external_stream(torch.cuda.current_stream().cuda_stream)


def moe_forward(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, pool_words: torch.Tensor,
                pool_halves: torch.Tensor, q: torch.Tensor, plane_off: torch.Tensor, lut_off: torch.Tensor,
                D: int, F: int, P: int, lut_width: int | None = None) -> torch.Tensor:
    """Routed experts of one layer on T tokens (SPEC.md "Fused MoE kernel contract"); returns [T, D] in
    hidden's dtype. Decode (T <= DECODE_MAX_T) issues no host synchronisation and is graph-capturable.

    `lut_width` (default P) bounds the widths in `q`: it sizes each block's LUT in shared memory, so a layer
    whose blocks all sit at 7 bits or less gets half the shared memory of an 8-bit one (more blocks per SM).
    A graph that must survive any width change is captured with the default."""
    T, k = topk_ids.shape
    if T > DECODE_MAX_T:
        return _prefill(hidden, topk_ids, topk_weights, pool_words, pool_halves, q, plane_off, lut_off, D, F, P)
    E = q.shape[0]
    if E > MAX_EXPERTS or not MIN_WIDTH <= P <= MAX_WIDTH:
        raise ValueError(f"moe_forward supports up to {MAX_EXPERTS} experts and widths {MIN_WIDTH}..{MAX_WIDTH}")
    dev = hidden.device
    slots = min(E, T * k)
    xf = hidden.float().contiguous()
    ids = topk_ids.to(torch.int32).contiguous()
    tw = topk_weights.float().contiguous()
    h = torch.zeros(T * k, 2 * F, dtype=torch.float32, device=dev)
    out = torch.zeros(T, D, dtype=torch.float32, device=dev)
    route = torch.empty(3 * slots + 1 + T * k, dtype=torch.int32, device=dev)
    slot_expert, slot_start, slot_count = route[:slots], route[slots:2 * slots], route[2 * slots:3 * slots]
    n_active, pair_tok = route[3 * slots:3 * slots + 1], route[3 * slots + 1:]
    pair_w = torch.empty(T * k, dtype=torch.float32, device=dev)
    a = {name: _dev(t) for name, t in dict(
        xf=xf, ids=ids, tw=tw, h=h, out=out, slot_expert=slot_expert, slot_start=slot_start, slot_count=slot_count,
        n_active=n_active, pair_tok=pair_tok, pair_w=pair_w, pool_words=pool_words, pool_halves=pool_halves,
        q=q, plane_off=plane_off, lut_off=lut_off).items()}
    stream = _stream()
    shmem = lut_shared_bytes(P if lut_width is None else lut_width)
    _route_kernel[1, ROUTE_THREADS, stream](a["ids"], a["tw"], E, a["slot_expert"], a["slot_start"],
                                            a["slot_count"], a["n_active"], a["pair_tok"], a["pair_w"])
    tables = (a["pool_words"], a["pool_halves"], a["q"], a["plane_off"], a["lut_off"], a["slot_expert"],
              a["slot_start"], a["slot_count"], a["n_active"], a["pair_tok"], a["pair_w"])
    for kind, src, dst, N, K in ((0, "xf", "h", 2 * F, D), (1, "h", "out", D, F)):
        W = (K + 31) // 32
        tiles = -(-N // ROWS)
        wps = _words_per_split(W, tiles, slots)
        grid = (tiles, -(-W // wps), slots)
        _gemv_kernel[grid, ROWS, stream, shmem](kind, a[src], *tables, a[dst], N, K, F, wps)
    return out.to(hidden.dtype)


PREFILL_SCRATCH_BYTES = 128 << 20  # dequantized blocks in flight during prefill (outside the pool's budget)


def _dequantize(pool_words, pool_halves, q, plane_off, lut_off, experts: torch.Tensor, kind: int, N: int, K: int,
                dtype: torch.dtype) -> torch.Tensor:
    """The blocks (experts[j], kind) at their committed widths as W^T, [len(experts), K, N] in `dtype`."""
    out = torch.empty(experts.numel(), K, N, dtype=torch.float16, device=pool_words.device)
    grid = (-(-N // ROWS), (K + 31) // 32, experts.numel())
    _dequant_kernel[grid, ROWS, _stream()](_dev(pool_words), _dev(pool_halves), _dev(q), _dev(plane_off),
                                           _dev(lut_off), _dev(experts), kind, N, K, _dev(out))
    return out if dtype == torch.float16 else out.to(dtype)


def _prefill(hidden, topk_ids, topk_weights, pool_words, pool_halves, q, plane_off, lut_off, D, F, P):
    """Large T: group tokens by expert (one host read), dequantize the routed blocks a group of experts at a time
    (one launch per kind and group, at most PREFILL_SCRATCH_BYTES of scratch), tensor-core GEMMs per expert."""
    T, k = topk_ids.shape
    out = torch.zeros(T, D, dtype=torch.float32, device=hidden.device)
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    counts_h = counts.tolist()
    ex32 = experts.to(torch.int32)
    group = max(1, PREFILL_SCRATCH_BYTES // (3 * F * D * 2))
    weights = topk_weights.reshape(-1)[order].float().unsqueeze(1)
    start = 0
    for g0 in range(0, len(counts_h), group):
        ids = ex32[g0:g0 + group]
        w_gu = _dequantize(pool_words, pool_halves, q, plane_off, lut_off, ids, 0, 2 * F, D, hidden.dtype)
        w_d = _dequantize(pool_words, pool_halves, q, plane_off, lut_off, ids, 1, D, F, hidden.dtype)
        for j, c in enumerate(counts_h[g0:g0 + group]):
            pairs = order[start:start + c]
            tok = pairs // k
            hg = (hidden[tok] @ w_gu[j]).float()
            act = (torch.nn.functional.silu(hg[:, :F]) * hg[:, F:]).to(hidden.dtype)
            out.index_add_(0, tok, (act @ w_d[j]).float() * weights[start:start + c])
            start += c
    return out.to(hidden.dtype)
