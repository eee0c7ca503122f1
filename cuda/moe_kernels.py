"""Fused mixed-precision MoE kernels (Numba CUDA) reading expert blocks straight from bit-planes in the pool.

Decode path (T <= DECODE_MAX_T), four stream-ordered steps, all capturable in a torch.cuda.CUDAGraph:
1. `_route_kernel`: its first block groups the T*k routed (token, expert) pairs by expert into "slots"
   (slot j = the j-th distinct expert, its pairs contiguous at slot_start[j]); n_active on the device. Its other
   blocks copy x to fp32 and zero the accumulators of steps 2 and 3.
2. `_gemv_kernel` kind 0 (gate_up, W [2F, D]): h[pair, :] += W_q @ x[token] for every pair of the slot.
3. `_gemv_kernel` kind 1 (down, W [D, F]): out[token] += w_pair * W_q @ (silu(h_gate) * h_up).
   At T = 1 steps 2 and 3 run `_gemv_t1_kernel` (`_gemv_t1_narrow_kernel` when every block has 4 bits or
   less): the same source holding only the one-token bodies; at T = 2..4 in the narrow class
   `_gemv_t4_narrow_kernel` (its 1- and 4-token bodies).
4. torch casts the fp32 accumulator to the activation dtype.

Why this shape (GPU.md, H200 ~14 FLOP per HBM byte): one thread per output row so that plane words load
coalesced (plane p is [W, N] word-major); each block takes ROWS rows and a K range (split-K, fp32 atomics);
LUT_q of the block's rows in shared memory as [2^q][ROWS] (fp32 up to 6 bits, fp16 above) so each lane reads its
own bank; x of up to TT tokens in shared memory (broadcast 128-bit reads); plane words prefetched 2-4 words
ahead in registers. The decode of a 32-column word is generated per (width, token tile): plane word p shifted by g and masked
with 0x11111111 (widths <= 4) or 0x01010101 (widths 5..8) puts the bits of columns g, g+4, ... (g+8, ...) in
nibble (byte) lanes, so one shift + one 3-input LOP per plane builds 8 (4) indices at once. Each decoded
weight is used for every token of its expert (1..64 tokens, tiles of 1, 4 or 16), never dequantized to memory.
Compile time grows faster than linearly with the number of specialised bodies (21 bodies did not compile in
280 s on the GPU box; 12 took 67 s), which is why the lane loop is a runtime loop and there are three tiles.
Each block reads its committed width q and plane/LUT offsets from the device tables, so changing the tables
between graph replays changes what is read without recapture.

Prefill path (T > DECODE_MAX_T; its host code in prefill.py, apart so that an edit there leaves this module's Numba
cache valid): one host read (the routing, laid out on the host and uploaded once), then per group
of routed experts one `_dequant_kernel` launch writes both kinds of every block of the group at its committed width
into a bounded scratch (W^T, the same index decode as the GEMV, LUT in shared memory, 16-bit entries copied as they
are or rounded to bf16), and the group's rows go through two grouped GEMMs (torch._grouped_mm for bf16 on sm90,
otherwise one bmm over the group's rows zero-padded to its largest expert). The dequantize launch's arguments are
marshalled once per call (`launcher._PreparedLaunch`); each group's launch changes only its first slot; the other
kernels launch through the driver too (`launcher.launch`).
"""
from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedweight.runner import NARROW_WIDTH

from ._compat import SIMULATOR, cuda, jit_variant
from .launcher import launch

if TYPE_CHECKING:
    from .prefill import PrefillBuffers

ROWS = 64  # threads (= output rows) per block; the LUT of P=8, [256][ROWS] fp16, is 32 KiB of shared memory
LOG_ROWS = 6
WS = 4  # plane words per sub-chunk (at most): 128 columns of x staged per __syncthreads pair
TILES = (1, 4, 16)  # token tiles; the 16-token tile runs only the 4-token quads that hold tokens (5..16 tokens)
TT_MAX = TILES[-1]
X_SH = 1024  # floats of staged x (4 KiB: at 8 bits 6 blocks per SM either way, as with 2 KiB)
X_ALIGN = None if SIMULATOR else 16  # lets 4 consecutive x loads merge into one 128-bit LDS (cudasim rejects it)
MIN_WIDTH, MAX_WIDTH = 3, 8  # [seed..P]; the seed width is 3 (DESIGN.md §2)
# LUT entries a thread loads before storing any to shared memory; divides 2^b for every b >= 3. 16 (a 3-bit LUT's 8
# loaded twice) was no faster at 4 bits and 5 % slower at 8 (moe_kernel_bench-nvidia-h200-20261130-s10-lut16.json
# against -s10-lut.json)
LUT_BATCH = 8
LUT32_MAX_WIDTH = 6  # LUTs up to this width sit in shared memory as fp32 (no per-weight conversion)
WIDTHS = tuple(range(MIN_WIDTH, MAX_WIDTH + 1))  # one specialised body per width and token tile
DECODE_MAX_T = 64
ROUTE_THREADS = 256
ROUTE_MAX_BLOCKS = 264  # set-up blocks, two per SM on an H200: the largest decode step's (T = 64) in one wave
MAX_EXPERTS = 1024
NARROW_MAX_WIDTH = NARROW_WIDTH  # the narrow LUT class: every block of the layer at 4 bits or less
# Split-K sizing per LUT class (the widest width a launch may hold; the engine's classes are 4, 7 and 8,
# runner.lut_width): (fewest plane words per K split, rounded up to WS; blocks a launch aims for below
# SPLIT_MANY_TOKENS tokens; from SPLIT_MANY_TOKENS on).
# - 8 (widths up to 8): 2048 blocks (~8 2-warp blocks per SM on 132 SMs, two waves) of at least 16 words: staging a
#   7-8-bit LUT costs more than more warps gain (Qwen1.5 T=1 at 8 bits took 124 -> 146 us with 8 words,
#   moe_kernel_bench-nvidia-h200-20261130-s9-splits.json; Qwen3 81.7 against 95.3, …-20261202-s29-splits-t1.json).
# - 7 (widths 5-7, and the mixed layers of a PagedWeight plan: 3..6 bits around a mean of 4): at least 8 words. At
#   T=1 a launch is one wave, so a layer takes as long as its widest block's splits, not its mean width's: with 16
#   words a Qwen3 layer of widths 3..5 took 46.2 us where all-5 took 48.4 and all-4 (narrow class) 36.4
#   (…-20261202-s30-classes.json). 8 words at T=1: widths 3..5 -8.6 % (Qwen3) / -14.3 % (Qwen1.5), 3..6 -8.1 /
#   -6.1 %, all-6 -0.5 / -7.5 %, all-7 +6.8 / -1.2 %; at T=4 within +0.4 % on Qwen3 and -1.3..-3.5 % on Qwen1.5
#   (…-20261202-s30-splits-c7.json). From 8 tokens 4096 blocks: a step of 8-32 tokens spreads over 30-128 slots, and
#   on an H100 2048 blocks took 3.1-10.4 % longer than 4096 for widths 3..5 at T 8 / 32 on Qwen1.5 and Qwen3, 2.3-7.0
#   % for 3..6, 0.4-6.8 % for uniform 6 bits (Qwen1.5 T=32, widths 3..5: 450.6 -> 415.3 us; uniform 4 bits in the
#   narrow class 395.7; …-h100-80gb-hbm3-20261205-s46-splits-mixed.json, …-s46-splits-t-target.json). At T=4 4096
#   was 0.9-3.1 % faster for widths 3..5 but 2.5-4.6 % slower for uniform 6 bits (a paged engine at home width 6
#   without pressure) and 1.7 % for 3..6, so it stays at 2048 there. The released layers of an engine at batch 8 / 32 decode in this class: paired against uniform
#   4 bits (parent home) 0.922 / 0.891 with 2048, 0.950 / 0.958 with 4096 (engine_bench-…-s46-no-release-rule-b328,
#   …-s46-t-target-b328.json).
# - 4 (the narrow class, a 16-entry LUT): 8192 blocks of at least 2 words, which in three H200 runs
#   (…-s10-last.json, …-s11-main.json, …-s11-lut-in-body.json) beat 2048 blocks of 8 words at 4 bits by 1.3-2.3 %
#   on Qwen1.5 (T=1 and 4), 2.1 % on Mixtral T=1 and 13.5 % on Mixtral T=4.
SPLIT_SIZING = {NARROW_MAX_WIDTH: (2, 8192, 8192), 7: (8, 2048, 4096), 8: (16, 2048, 2048)}
SPLIT_MANY_TOKENS = 8

float32, float16, uint32, int32, uint16 = np.float32, np.float16, np.uint32, np.int32, np.uint16
# array dtypes (the simulator's too)
DT_F16, DT_F32, DT_U32, DT_I32, DT_U16 = (np.dtype(t) for t in (float16, float32, uint32, int32, uint16))


@cuda.jit(device=True, inline=True)
def _silu_mul(g, u):
    return g / (float32(1.0) + math.exp(-g)) * u


@cuda.jit(device=True, inline=True)
def _load_lut_batch(src, base, N, vals):
    """vals[u] <- src[base + u * N], u < LUT_BATCH: LUT entries c0.. of one row (a LUT is [2^b][N]), every load
    issued before any is used. The staging loops used to load an entry and store it before loading the next, so a
    block waited out 2^b load latencies in turn before its first weight: 256 at 8 bits, where a Qwen1.5 layer at T=1
    took 124 us for 35 MB (moe_kernel_bench-nvidia-h200-20261130-s9-splits.json)."""
    for u in range(LUT_BATCH):
        vals[u] = src[base + u * N]


@cuda.jit(device=True, inline=True)
def _stage_lut(pool_halves, lo, N, b, lut32, lut16, tid):
    """LUT_b of this thread's row (entries at lo + c * N) into the block's shared LUT, LUT_BATCH entries in flight at
    once: fp32 up to LUT32_MAX_WIDTH bits, fp16 above."""
    vals = cuda.local.array(LUT_BATCH, dtype=DT_F16)
    for c0 in range(0, 1 << b, LUT_BATCH):
        _load_lut_batch(pool_halves, lo + c0 * N, N, vals)
        for u in range(LUT_BATCH):
            if b <= LUT32_MAX_WIDTH:
                lut32[(c0 + u) * ROWS + tid] = float32(vals[u])
            else:
                lut16[(c0 + u) * ROWS + tid] = vals[u]


@cuda.jit(device=True, inline=True)
def _x_row(kind, src, row, K, F, col):
    """Input at column col of src's row `row` (gate_up: a token's hidden row; down: a pair's, silu(gate) * up); 0
    past K."""
    v = float32(0.0)
    if col < K:
        if kind == 0:
            v = src[row, col]
        else:
            v = _silu_mul(src[row, col], src[row, F + col])
    return v


@cuda.jit(device=True, inline=True)
def _x_value(kind, src, pair_tok, pair0, rem, K, F, t, col):
    """Input of pair pair0 + t at column col; 0 past K and past the slot's tokens. Callers pass t and col, not a flat
    index: the 64-bit signed division and remainder that split one cost ~20 instructions per staged value."""
    v = float32(0.0)
    if t < rem:
        if kind == 0:
            v = _x_row(kind, src, pair_tok[pair0 + t], K, F, col)
        else:
            v = _x_row(kind, src, pair0 + t, K, F, col)
    return v


def prefetch_words(b: int, tt: int = 1) -> int:
    """Words loaded ahead per thread: ~16 registers, ~2 KiB in flight per warp (enough at ~10 warps per SM). One word
    above 4 tokens: decoding a word for up to 16 tokens takes ~1000 instructions per thread, which hides a load, and
    the 16 accumulators need the registers."""
    if tt > 4:
        return 1
    return 4 if b <= 4 else (3 if b <= 6 else 2)


def sub_words(tt: int) -> int:
    """Plane words per staged sub-chunk of a tt-token tile: WS, fewer where tt tokens of WS words overflow X_SH."""
    return min(WS, X_SH // (32 * tt))


X_ONE = sub_words(1) * 32 // ROWS  # x values a thread stages per sub-chunk of the one-token kernels (2)


def _lanes(b: int) -> tuple[int, int, int]:
    """(lanes, bits per lane, groups) of the index registers of width b: 8 nibble lanes up to 4 bits, else 4 bytes."""
    lanes, lane_bits = (8, 4) if b <= 4 else (4, 8)
    return lanes, lane_bits, 32 // lanes


def _ring_lines(b: int, j: int, word: str, indent: str) -> list[str]:
    """Ring slot j <- the b plane words of word `word` of this thread's row (zeros past the block's last word).

    Words are loaded in order, so each plane's element index pb_p is unsigned and runs +N per word: a signed
    `pb + word * N` cost Numba's negative-index wraparound per load (shr, and, add) and a 64-bit multiply per word,
    ~7 PTX instructions around each plane word's load."""
    lines = [f"{indent}if {word} < w1:"]
    lines += [f"{indent}    r{j}_{p} = uint32(pool_words[pb{p}])" for p in range(b)]
    lines += [f"{indent}else:"] + [f"{indent}    r{j}_{p} = U0" for p in range(b)]
    return lines + [f"{indent}pb{p} += UN" for p in range(b)]


def _ring_lines_setup(b: int, pf: int, first: str) -> list[str]:
    """Row bases of the b planes and the ring's first pf words (loads issued pf words ahead of their decode); the
    first load is word `first`."""
    lines = ["    nn = n if n < N else 0", "    UN = np.uint64(N)", f"    lw = np.uint64({first}) * UN"]
    lines += [f"    pb{p} = np.uint64(poff[{p}] + nn) + lw" for p in range(b)]
    for j in range(pf):
        lines += _ring_lines(b, j, f"{first} + {j}", "    ")
    return lines


def _ring_advance(b: int, pf: int, ahead: str, indent: str) -> list[str]:
    """c_p <- the oldest ring slot; the ring shifts and its last slot loads word `ahead`."""
    lines = [f"{indent}c{p} = r0_{p}" for p in range(b)]
    lines += [f"{indent}r{j}_{p} = r{j + 1}_{p}" for j in range(pf - 1) for p in range(b)]
    return lines + _ring_lines(b, pf - 1, ahead, indent)


def _index_lines(b: int, es: int, indent: str) -> list[str]:
    """Index registers s_g of the 32 columns of word c_0..c_{b-1}: plane word p shifted by g and masked puts the
    bits of columns g, g+groups, ... in nibble (byte) lanes; widened and pre-scaled by ROWS << es so that one funnel
    shift + one LOP3 give lane m's LUT byte offset without the row."""
    lanes, lane_bits, groups = _lanes(b)
    lane_mask = 0x11111111 if b <= 4 else 0x01010101
    lines = []
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
        lines.append(f"{indent}s{g} = np.uint64(" + " | ".join(terms) + f") << np.uint64({LOG_ROWS + es})")
    return lines


def _lut_index(b: int, es: int, g: int) -> str:
    """LUT element index of lane `sh` of s_g for this thread's row (a byte offset with known-zero low bits, indexed
    by e >> es so that the compiler drops the scaling LEA)."""
    mask = f"np.uint64({((1 << b) - 1) << (LOG_ROWS + es)})"
    return f"((uint32((s{g} >> sh) & {mask}) | ubyte) >> uint32({es}))"


def _body_source(b: int, tt: int, one_token: bool = False) -> str:
    """Source of `_work_{b}_{tt}`: one block's K range for one token tile at width b.

    The 32 columns of a word are straight-line code; the token loop has a constant trip count (LLVM unrolls it
    and keeps `acc` in registers); plane words are loaded `prefetch_words(b, tt)` words ahead of their decode.
    Above 4 tokens the weights of a lane are decoded once into registers and used by each 4-token quad that holds
    tokens (a branch uniform over the block), so 5..16 tokens cost one decode, not one per 4-token tile.
    `one_token` (tt = 1, `_work_{b}_1_one`): the body of the one-token kernels, whose step has one token (row 0 of
    x and of the output) and whose prologue stages the first sub-chunk's x (`_gemv`).
    """
    assert tt == 1 or not one_token
    lanes, lane_bits, groups = _lanes(b)
    es = 2 if b <= LUT32_MAX_WIDTH else 1  # log2 of the LUT entry's bytes (fp32 / fp16)
    L = []
    a = L.append
    a(f"def _work_{b}_{tt}{'_one' if one_token else ''}({_WORK_ARGS}):")
    a(f"    acc = cuda.local.array({tt}, dtype=DT_F32)")
    a(f"    for t in range({tt}):")
    a("        acc[t] = float32(0.0)")
    a(f"    ubyte = utid << uint32({es})  # this row's byte offset inside a LUT line")
    pf = prefetch_words(b, tt)
    L += _ring_lines_setup(b, pf, "w0")
    if one_token:  # the LUT's loads go out after the ring's, not before them (`_gemv` stages it for the others)
        a(f"    _stage_lut(pool_halves, lo, N, {b}, lut32, lut16, tid)")
    ws = sub_words(tt)
    xs = 32 * ws  # columns of x per staged sub-chunk
    xargs = "kind, src, pair_tok, pair0, rem, K, F"
    # Prefetching the next sub-chunk's x into registers (tried) raised the multi-token kernel to 212 registers and lost
    # more to occupancy than it hid: there x is staged straight into shared memory between one barrier pair per
    # sub-chunk. A one-token body holds X_ONE values a thread, so it prefetches them (xn; 80 / 56 registers as without).
    if one_token:
        a("    " + " = ".join(f"xn{j}" for j in range(xs // ROWS)) + " = float32(0.0)")
    a("    w = w0")
    a("    while w < w1:")
    a("        cuda.syncthreads()  # the previous sub-chunk's reads of x_sh are done (the first time: LUT staged)")
    # x_sh[t * xs + c] = input of token t at column w * 32 + c; thread tid stages columns c = tid + j * ROWS (xs is
    # a multiple of ROWS)
    if one_token:  # the kernel's prologue staged the first sub-chunk; each later one was loaded into registers
        # (xn) before the sub-chunk ahead of it was decoded. The token's row is 0, the pair's pair0.
        a("        if w != w0:")
        for j in range(xs // ROWS):
            a(f"            x_sh[tid + {j * ROWS}] = xn{j}")
        a("            cuda.syncthreads()")
        a(f"        if w + {ws} < w1:  # the last sub-chunk has no next one in this split")
        for j in range(xs // ROWS):
            a(f"            xn{j} = _x_row(kind, src, pair0 if kind else 0, K, F, (w + {ws}) * 32 + tid + {j * ROWS})")
    elif tt <= 4:  # every thread stages tt * xs / ROWS values, zeros past the slot's tokens
        for j in range(tt * xs // ROWS):
            t, c = divmod(j * ROWS, xs)
            a(f"        x_sh[tid + {j * ROWS}] = _x_value({xargs}, {t}, w * 32 + tid + {c})")
    else:  # only the slot's tokens, a runtime trip count: 16 unrolled stagings hoist 16-32 loads and their 64-bit
        # addresses next to 16 accumulators (250 registers uncapped, spills at 128). Rows past rem stay stale: they
        # only feed accumulators that are never written out.
        a(f"        for t in range(min(rem, {tt})):")
        for j in range(xs // ROWS):
            a(f"            x_sh[t * {xs} + tid + {j * ROWS}] = _x_value({xargs}, t, w * 32 + tid + {j * ROWS})")
    if not one_token:
        a("        cuda.syncthreads()")
    a(f"        for i in range({ws}):")
    a("            wi = w + i")
    a("            if wi < w1:")
    L += _ring_advance(b, pf, f"wi + {pf}", "                ")
    a("                xb = i * 32")
    L += _index_lines(b, es, "                ")
    a(f"                for m in range({lanes}):  # runtime loop keeps the kernel small enough to compile fast")
    a(f"                    sh = np.uint64({lane_bits}) * np.uint64(m)")
    a(f"                    xm = uint32(xb + {groups} * m)")
    for g in range(groups):
        e = _lut_index(b, es, g)
        a(f"                    wv{g} = " + (f"lut32[{e}]" if b <= LUT32_MAX_WIDTH else f"float32(lut16[{e}])"))
        if tt <= 4:  # FFMAs right after each load, as before the 16-token tile existed
            a(f"                    for t in range({tt}):")
            a(f"                        acc[t] += wv{g} * x_sh[xm + uint32(t * {xs} + {g})]")
    if tt > 4:  # the lane's decoded weights go to every 4-token quad that holds tokens (quad 0 always does)
        for u in range(0, tt, 4):
            ind = "                    " + ("    " if u else "")
            if u:
                a(f"                    if rem > {u}:")
            a(f"{ind}for t in range({u}, {u + 4}):")
            for g in range(groups):
                a(f"{ind}    acc[t] += wv{g} * x_sh[xm + uint32(t * {xs} + {g})]")
    a(f"        w += {ws}")
    # constant trip count: a loop bounded by rem would index acc dynamically and push it to local memory
    a("    if n < N:")
    a(f"        for t in range({tt}):")
    a("            if t < rem:")
    a("                if kind == 0:")
    a("                    cuda.atomic.add(dst, (pair0 + t, n), acc[t])")
    a("                else:")
    a(f"                    cuda.atomic.add(dst, ({'0' if one_token else 'pair_tok[pair0 + t]'}, n), "
      "pair_w[pair0 + t] * acc[t])")
    return "\n".join(L) + "\n"


def _dequant_body_source(b: int) -> str:
    """Source of `_dq_{b}`: W^T of one block's row tile and K range at width b into the flat dst, from element o on.

    The same decode as the GEMV bodies (index registers, LUT [2^b][ROWS] in shared memory, plane words
    `prefetch_words(b)` words ahead); each decoded 16-bit entry is stored as it is: a warp's 32 rows are 64
    contiguous bytes of one output row. Columns are visited in order, so the store index only grows by N, and it is
    unsigned (Numba adds a negative-index wraparound to every signed index: 3 more instructions per store).
    dst's K is padded to whole words, so no column needs a bound check.
    """
    lanes, lane_bits, groups = _lanes(b)
    pf = prefetch_words(b)
    L = [f"def _dq_{b}(pool_words, poff, lut, dst, o, N, w0, w1, n, utid):",
         "    ubyte = utid << uint32(1)  # this row's byte offset inside a LUT line of 16-bit entries"]
    L += _ring_lines_setup(b, pf, "w0")
    L += ["    w = w0", "    while w < w1:"]
    L += _ring_advance(b, pf, f"w + {pf}", "        ")
    L += _index_lines(b, 1, "        ")
    L += ["        if n < N:",
          f"            for m in range({lanes}):",
          f"                sh = np.uint64({lane_bits}) * np.uint64(m)"]
    for g in range(groups):
        L += [f"                dst[o] = lut[{_lut_index(b, 1, g)}]", "                o += UN"]
    L += ["        w += 1"]
    return "\n".join(L) + "\n"


def _device_fn(source: str, name: str):
    """The inlined device function `name` defined by generated `source`."""
    scope = {"np": np, "cuda": cuda, "float32": float32, "uint32": uint32, "U0": uint32(0), "_x_value": _x_value,
             "_x_row": _x_row, "_stage_lut": _stage_lut, "DT_F32": DT_F32}
    exec(compile(source, f"<moe_kernels:{name}>", "exec"), scope)
    return cuda.jit(device=True, inline=True)(scope[name])


_WORK_ARGS = ("kind, src, pool_words, pool_halves, poff, lo, lut32, lut16, x_sh, dst, pair_tok, pair_w, pair0, rem, N, "
              "K, F, w0, w1, n, tid, utid")
_WORK = {(b, tt): _device_fn(_body_source(b, tt), f"_work_{b}_{tt}") for b in WIDTHS for tt in TILES}
_WORK_ONE = {(b, 1): _device_fn(_body_source(b, 1, one_token=True), f"_work_{b}_1_one") for b in WIDTHS}
_DQ = {(b,): _device_fn(_dequant_body_source(b), f"_dq_{b}") for b in WIDTHS}


def _dispatch_source(keys: tuple[str, ...], bodies: dict, args: str) -> str:
    """`_dispatch(<keys>, <args>)`: if-chain from runtime key values (width, tile) to the specialised bodies."""
    L = [f"def _dispatch({', '.join(keys)}, {args}):"]
    for i, key in enumerate(bodies):
        cond = " and ".join(f"{k} == {v}" for k, v in zip(keys, key))
        L.append(f"    {'if' if i == 0 else 'elif'} {cond}:")
        L.append(f"        _f{i}({args})")
    return "\n".join(L) + "\n"


def _make_dispatch(keys: tuple[str, ...], bodies: dict, args: str):
    scope = {f"_f{i}": fn for i, fn in enumerate(bodies.values())}
    exec(compile(_dispatch_source(keys, bodies, args), "<moe_kernels:_dispatch>", "exec"), scope)
    return cuda.jit(device=True)(scope["_dispatch"])


_dq_dispatch = _make_dispatch(("b",), _DQ, "pool_words, poff, lut, dst, o, N, w0, w1, n, utid")


# Register cap of the general decode kernel. Uncapped it took 161 registers in session 10 and 148 in session 30
# (ptxas offline, sm_90: 6 blocks of 2 warps per SM either way); at 128
# (8 blocks, a few spilled registers) Mixtral T=1 4-bit went from 261 to 215 us on the H200 (moe_kernel_bench-*-
# regdefault / -reg128.json); its 16-token bodies are what need them. PAGEDWEIGHT_MAX_REGISTERS overrides it (0 = no
# cap) for such comparisons; Numba's cache does not key on the cap, so each setting needs its own NUMBA_CACHE_DIR.
# The one-token kernels run uncapped: ptxas (sm_90, offline) gives the all-widths one 96 registers, no spills (105
# under a cap of 128), and the narrow class's 56 (18 blocks per SM); a cap only raised what ptxas chose (80 at 80).
MAX_REGISTERS = int(os.environ.get("PAGEDWEIGHT_MAX_REGISTERS", "128")) or None

def _gemv(kind, src, pool_words, pool_halves, q_tab, plane_off, lut_off, slot_expert, slot_start, slot_count,
          n_active, pair_tok, pair_w, dst, N, K, F, words_per_split):
    """The decode GEMV kernels' source: `_gemv_variant` compiles it with its own `_dispatch` (a global bound per
    kernel, not defined at module level) over the bodies that kernel holds, and its own `ONE_TOKEN`.

    grid (ceil(N/ROWS), k-splits, slots), block ROWS; dynamic shared memory lut_shared_bytes(P) (the LUT).
    Widths outside WIDTHS match no body and contribute nothing: tables must hold widths in [MIN_WIDTH, MAX_WIDTH].

    A block is short (at T = 1 two to eight plane words a thread), so its prologue's chain of dependent loads is much
    of its time: n_active and slot_expert load side by side, and with ONE_TOKEN (the one-token kernels: T = 1, so
    slot j holds pair j, token 0's j-th expert, a token's experts being distinct) the first sub-chunk's x, which then
    needs no table, loads before the tables into registers and is staged beside the LUT (one barrier for both), where
    the bodies staged it after the LUT's barrier through pair_tok, two more loads in a row."""
    slot = cuda.blockIdx.z
    W = (K + 31) // 32
    w0 = cuda.blockIdx.y * words_per_split
    if w0 >= W:
        return
    tid = cuda.threadIdx.x
    if ONE_TOKEN:
        xv = cuda.local.array(X_ONE, dtype=DT_F32)
        for j in range(X_ONE):
            xv[j] = _x_row(kind, src, slot if kind else 0, K, F, w0 * 32 + tid + j * ROWS)
    e = slot_expert[slot]  # slot < slots: in bounds, read before n_active says whether it is meant
    if slot >= n_active[0]:
        return
    w1 = min(W, w0 + words_per_split)
    b = q_tab[e, kind]
    n = cuda.blockIdx.x * ROWS + tid
    lut32 = cuda.shared.array(0, dtype=DT_F32)  # dynamic shared arrays alias: one LUT buffer, two views
    lut16 = cuda.shared.array(0, dtype=DT_F16)
    x_sh = cuda.shared.array(X_SH, dtype=DT_F32, alignment=X_ALIGN)
    lo = lut_off[e, kind] + (n if n < N else 0)  # this row's LUT; rows past N stage row 0's (sums never stored)
    if not ONE_TOKEN:  # the one-token bodies stage it after their first plane words' loads
        _stage_lut(pool_halves, lo, N, b, lut32, lut16, tid)
    # the first __syncthreads inside the body orders these stores before any LUT (and prologue x) read
    poff = plane_off[e, kind]
    if ONE_TOKEN:
        for j in range(X_ONE):
            x_sh[tid + j * ROWS] = xv[j]
        _dispatch(b, 1, kind, src, pool_words, pool_halves, poff, lo, lut32, lut16, x_sh, dst, pair_tok, pair_w, slot,
                  1, N, K, F, w0, w1, n, tid, uint32(tid))
        return
    pair0 = slot_start[slot]
    cnt = slot_count[slot]
    t0 = 0
    while t0 < cnt:
        rem = cnt - t0
        tt = 1 if rem <= 1 else (4 if rem <= 4 else TT_MAX)
        _dispatch(b, tt, kind, src, pool_words, pool_halves, poff, lo, lut32, lut16, x_sh, dst, pair_tok, pair_w,
                  pair0 + t0, rem, N, K, F, w0, w1, n, tid, uint32(tid))
        t0 += tt


def _gemv_variant(name: str, bodies: dict, max_registers: int | None, one_token: bool = False):
    """`_gemv`'s code compiled with a dispatch over `bodies` as its `_dispatch`: one source, kernels whose bodies
    differ; `one_token` for the kernels of T = 1 steps (their bodies the `_WORK_ONE` ones)."""
    cap = {"max_registers": max_registers} if max_registers and not SIMULATOR else {}  # the simulator has no cap
    return jit_variant(_gemv, name, {"_dispatch": _make_dispatch(("b", "tt"), bodies, _WORK_ARGS),
                                     "ONE_TOKEN": one_token}, **cap)


# Every width and token tile (~80 s of compile on the H200: cached). At T = 1 every slot holds one pair: kernels of
# the 1-token bodies alone, all widths or the narrow class's, take fewer registers (more warps per SM) and less code.
# At T <= 4 no slot holds more than 4 pairs (a token routes to an expert once): the narrow class's 1- and 4-token
# bodies alone take 72 registers uncapped, no spills (ptxas offline, sm_90, session 29: 14 blocks per SM where the
# general kernel's 128 allow 8); over all widths such a kernel took 130, no fewer than the general one's cap.
_gemv_kernel = _gemv_variant("_gemv_kernel", _WORK, MAX_REGISTERS)
_gemv_t1_kernel = _gemv_variant("_gemv_t1_kernel", _WORK_ONE, None, one_token=True)
_gemv_t1_narrow_kernel = _gemv_variant(
    "_gemv_t1_narrow_kernel", {key: f for key, f in _WORK_ONE.items() if key[0] <= NARROW_MAX_WIDTH}, None,
    one_token=True)
SMALL_T = TILES[1]  # the largest T of `_gemv_t4_narrow_kernel`
_gemv_t4_narrow_kernel = _gemv_variant(
    "_gemv_t4_narrow_kernel", {key: f for key, f in _WORK.items() if key[1] <= SMALL_T and key[0] <= NARROW_MAX_WIDTH},
    None)


def _decode_gemv(T: int, lut_width: int):
    """The decode GEMV kernel of a step of T tokens whose blocks are at most `lut_width` bits wide."""
    narrow = lut_width <= NARROW_MAX_WIDTH
    if T == 1:
        return _gemv_t1_narrow_kernel if narrow else _gemv_t1_kernel
    return _gemv_t4_narrow_kernel if narrow and T <= SMALL_T else _gemv_kernel


@cuda.jit(cache=True)  # reuse the compile across processes
def _route_kernel(topk_ids, topk_w, hidden, n_experts, xf, h, out, slot_expert, slot_start, slot_count, n_active,
                  pair_tok, pair_w):
    """Block 0 groups pairs by expert: slots follow ascending expert id, the pairs of a slot are contiguous. The
    other blocks (at least one) do the GEMVs' set-up, grid-stride: xf <- hidden as fp32, and the split-K
    accumulators h and out zeroed. Four torch ops (two casts, two fills) did that before: ~5 us of kernels and their
    launch gaps per layer at batch 1 (decode_profile-nvidia-h200-20261130-s9-final.txt). Block 0 takes no share: it
    is the kernel's critical path."""
    tid = cuda.threadIdx.x
    nthr = cuda.blockDim.x
    if cuda.blockIdx.x != 0:
        D = hidden.shape[1]
        F2 = h.shape[1]
        for i in range((cuda.blockIdx.x - 1) * nthr + tid, max(xf.size, h.size), nthr * (cuda.gridDim.x - 1)):
            if i < xf.size:
                xf[i // D, i % D] = float32(hidden[i // D, i % D])
                out[i // D, i % D] = float32(0.0)
            if i < h.size:
                h[i // F2, i % F2] = float32(0.0)
        return
    counts = cuda.shared.array(MAX_EXPERTS, dtype=DT_I32)
    fill = cuda.shared.array(MAX_EXPERTS, dtype=DT_I32)
    slot_of = cuda.shared.array(MAX_EXPERTS, dtype=DT_I32)
    scan_slots = cuda.shared.array(ROUTE_THREADS, dtype=DT_I32)
    scan_rows = cuda.shared.array(ROUTE_THREADS, dtype=DT_I32)
    k = topk_ids.shape[1]
    npairs = topk_ids.shape[0] * k
    for e in range(tid, n_experts, nthr):
        counts[e] = 0
        fill[e] = 0
    cuda.syncthreads()
    for i in range(tid, npairs, nthr):
        cuda.atomic.add(counts, topk_ids[i // k, i % k], 1)
    cuda.syncthreads()
    # slots in ascending expert order: thread t owns the experts [t * per, (t + 1) * per) and learns where its slots
    # and rows start from an inclusive scan of every thread's totals (log2(threads) steps). Before, one thread walked
    # all E experts: the kernel took 5.8 us per Qwen1.5 layer (60 experts, decode_profile-nvidia-h200-20261130-s10-
    # final.txt) and 8.2 per Qwen3 layer (128, -20261201-s26-qwen3-ropenorm.txt); with the scan 4.1
    # (-20261201-s27-qwen3-scan.txt)
    per = (n_experts + nthr - 1) // nthr
    e0 = min(tid * per, n_experts)
    e1 = min(e0 + per, n_experts)
    my_slots = 0
    my_rows = 0
    for e in range(e0, e1):
        if counts[e] > 0:
            my_slots += 1
            my_rows += counts[e]
    scan_slots[tid] = my_slots
    scan_rows[tid] = my_rows
    cuda.syncthreads()
    off = 1
    while off < nthr:
        add_s = scan_slots[tid - off] if tid >= off else 0
        add_r = scan_rows[tid - off] if tid >= off else 0
        cuda.syncthreads()
        scan_slots[tid] += add_s
        scan_rows[tid] += add_r
        cuda.syncthreads()
        off *= 2
    s = scan_slots[tid] - my_slots
    start = scan_rows[tid] - my_rows
    for e in range(e0, e1):
        c = counts[e]
        if c > 0:
            slot_of[e] = s
            slot_expert[s] = e
            slot_start[s] = start
            slot_count[s] = c
            s += 1
            start += c
    if tid == nthr - 1:
        n_active[0] = scan_slots[tid]
    cuda.syncthreads()
    for i in range(tid, npairs, nthr):
        t = i // k
        e = topk_ids[t, i % k]
        j = slot_start[slot_of[e]] + cuda.atomic.add(fill, e, 1)
        pair_tok[j] = t
        pair_w[j] = topk_w[t, i % k]


@cuda.jit(device=True, inline=True)
def _bf16_bits(h):
    """bf16 bit pattern of the fp16 value with bit pattern h (round to nearest even, as torch's .to(bfloat16)):
    integer-only, so the simulator runs it too. Subnormal fp16 values become normal bf16 values."""
    h = uint32(h)
    e = (h >> uint32(10)) & uint32(0x1F)
    m = h & uint32(0x3FF)
    if e == uint32(0x1F):  # inf stays inf, NaN becomes a quiet NaN
        r = uint32(0x7FC0) if m != uint32(0) else uint32(0x7F80)
    elif e == uint32(0) and m == uint32(0):
        r = uint32(0)
    else:
        ex = e + uint32(112)  # bf16 exponent (bias 127)
        if e == uint32(0):  # subnormal: normalise m until its implicit bit (bit 10) is set
            ex = uint32(113)
            while m < uint32(0x400):
                m = m << uint32(1)
                ex -= uint32(1)  # at least 103 after at most 10 shifts
            m = m & uint32(0x3FF)
        v = (ex << uint32(10)) | m  # exponent over the 10-bit mantissa
        r = (v + uint32(3) + ((v >> uint32(3)) & uint32(1))) >> uint32(3)  # RNE to 7 bits; a carry bumps the exponent
    return uint16(r | ((h >> uint32(15)) << uint32(15)))


DQ_WORDS = 32  # plane words (1024 columns) per dequantize block: LUT staging is <= 1/4 load per stored weight


@cuda.jit(cache=True)  # reuse the compile across processes
def _dequant_kernel(pool_words, pool_h16, q_tab, plane_off, lut_off, slot_expert, s0, D, F, to_bf16, out, d_base):
    """W_gate_up^T ([D_pad, 2F]) and W_down^T ([F_pad, D]) of expert slot_expert[s0 + j] at its committed widths, as
    16-bit patterns (the fp16 LUT entries, or their bf16 rounding when to_bf16) (prefill), into the flat scratch `out`:
    [slots, D_pad, 2F] from element 0, [slots, F_pad, D] from element d_base (`prefill_scratch`; K_pad: K rounded up
    to whole words). One output array: with the target chosen between two arrays the stores compiled to generic
    st.u16, which may alias shared memory, so each LUT load waited behind the previous store.

    Transposed so that a warp's rows store contiguously; both kinds of a group in one launch.
    grid (ceil(max(2F, D) / ROWS), ceil(max words / DQ_WORDS), 2 * slots), block ROWS, dynamic shared memory
    dequant_shared_bytes(P): the LUT of the block's rows, [2^b][ROWS], staged once for DQ_WORDS words."""
    kind = cuda.blockIdx.z & 1
    j = cuda.blockIdx.z >> 1
    N = 2 * F if kind == 0 else D
    W = ((D if kind == 0 else F) + 31) // 32
    w0 = cuda.blockIdx.y * DQ_WORDS
    row0 = cuda.blockIdx.x * ROWS
    if w0 >= W or row0 >= N:  # the other kind's grid is larger: whole blocks leave before any barrier
        return
    e = slot_expert[s0 + j]
    b = q_tab[e, kind]
    tid = cuda.threadIdx.x
    n = row0 + tid
    lut = cuda.shared.array(0, dtype=DT_U16)
    lo = lut_off[e, kind] + (n if n < N else 0)  # rows past N stage row 0's LUT and store nothing
    vals = cuda.local.array(LUT_BATCH, dtype=DT_U16)
    for c0 in range(0, 1 << b, LUT_BATCH):
        _load_lut_batch(pool_h16, lo + c0 * N, N, vals)
        for u in range(LUT_BATCH):  # u, not j: j is the block's slot
            lut[(c0 + u) * ROWS + tid] = _bf16_bits(vals[u]) if to_bf16 else vals[u]
    cuda.syncthreads()
    base = 0 if kind == 0 else d_base  # the kind's [slots, W * 32, N]; o: element (slot j, column w0 * 32, row n)
    o = np.uint64(base + (j * W * 32 + w0 * 32) * N + n)
    _dq_dispatch(b, pool_words, plane_off[e, kind], lut, out, o, N, w0, min(W, w0 + DQ_WORDS), n, uint32(tid))


def lut_shared_bytes(P: int) -> int:
    """Dynamic shared memory of one block for widths up to P: LUT_q of ROWS rows, fp32 up to LUT32_MAX_WIDTH,
    fp16 above."""
    return max((1 << min(P, LUT32_MAX_WIDTH)) * ROWS * 4, (1 << P) * ROWS * 2 if P > LUT32_MAX_WIDTH else 0)


def split_class(lut_width: int) -> int:
    """The SPLIT_SIZING key of a launch whose widths are at most `lut_width`."""
    return min(c for c in SPLIT_SIZING if c >= lut_width)


def _words_per_split(W: int, row_tiles: int, slots: int, lut_width: int, T: int) -> int:
    min_words, few, many = SPLIT_SIZING[split_class(lut_width)]
    target = many if T >= SPLIT_MANY_TOKENS else few
    want = max(1, -(-target // (row_tiles * slots)))
    splits = max(1, min(want, -(-W // min_words)))
    wps = -(-W // splits)
    return -(-wps // WS) * WS


def moe_forward(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, pool_words: torch.Tensor,
                pool_halves: torch.Tensor, q: torch.Tensor, plane_off: torch.Tensor, lut_off: torch.Tensor,
                D: int, F: int, P: int, lut_width: int | None = None, buffers: PrefillBuffers | None = None
                ) -> torch.Tensor:
    """Routed experts of one layer on T tokens (the decode and prefill paths of this module's docstring); returns
    [T, D] in hidden's dtype. Decode (T <= DECODE_MAX_T) issues no host synchronisation and is graph-capturable.

    `lut_width` (default P) bounds the widths in `q`: it sizes each block's LUT in shared memory (the decode kernel's
    and the prefill's dequantize kernel's), so a layer whose blocks all sit at 7 bits or less gets half the shared
    memory of an 8-bit one (more blocks per SM).
    A graph that must survive any width change is captured with the default."""
    T, k = topk_ids.shape
    lut_width = P if lut_width is None else lut_width
    if q.shape[0] > MAX_EXPERTS or not (MIN_WIDTH <= P <= MAX_WIDTH and MIN_WIDTH <= lut_width <= MAX_WIDTH):
        raise ValueError(f"moe_forward supports up to {MAX_EXPERTS} experts, P and lut_width in {MIN_WIDTH}.."
                         f"{MAX_WIDTH}, got {q.shape[0]} experts, P {P}, lut_width {lut_width}")
    if T == 0:
        return hidden.new_zeros(0, D)
    if T > DECODE_MAX_T:
        from .prefill import prefill_forward  # that module imports this one (here: ~1.4 us a call, CPU box)

        return prefill_forward(hidden, topk_ids, topk_weights, pool_words, pool_halves, q, plane_off, lut_off, D, F,
                               lut_width, buffers)
    E = q.shape[0]
    dev = hidden.device
    slots = min(E, T * k)
    # ids (int64 from torch.topk and route_topk) and fp16 hidden go in as they are: the route kernel makes the fp32
    # copy of x and zeroes h and out; bf16, which Numba has no type for, is cast here
    x_in = (hidden if hidden.dtype == torch.float16 else hidden.float()).contiguous()
    ids = topk_ids.long().contiguous()
    tw = topk_weights.float().contiguous()
    xf = torch.empty(T, D, dtype=torch.float32, device=dev)
    h = torch.empty(T * k, 2 * F, dtype=torch.float32, device=dev)
    out = torch.empty(T, D, dtype=torch.float32, device=dev)
    route = torch.empty(3 * slots + 1 + T * k, dtype=torch.int32, device=dev)
    slot_expert, slot_start, slot_count = route[:slots], route[slots:2 * slots], route[2 * slots:3 * slots]
    n_active, pair_tok = route[3 * slots:3 * slots + 1], route[3 * slots + 1:]
    pair_w = torch.empty(T * k, dtype=torch.float32, device=dev)
    shmem = lut_shared_bytes(lut_width)
    blocks = 1 + min(ROUTE_MAX_BLOCKS, -(-T * k * 2 * F // (ROUTE_THREADS * 4)))  # routing + ~4 zeros of h a thread
    launch(_route_kernel, blocks, ROUTE_THREADS, (ids, tw, x_in, E, xf, h, out, slot_expert, slot_start, slot_count,
                                                   n_active, pair_tok, pair_w))
    tables = (pool_words, pool_halves, q, plane_off, lut_off, slot_expert, slot_start, slot_count, n_active,
              pair_tok, pair_w)
    gemv = _decode_gemv(T, lut_width)
    for kind, src, dst, N, K in ((0, xf, h, 2 * F, D), (1, h, out, D, F)):
        W = (K + 31) // 32
        tiles = -(-N // ROWS)
        wps = _words_per_split(W, tiles, slots, lut_width, T)
        launch(gemv, (tiles, -(-W // wps), slots), ROWS, (kind, src, *tables, dst, N, K, F, wps), shmem)
    return out.to(hidden.dtype)


def dequant_shared_bytes(P: int) -> int:
    """Dynamic shared memory of one dequantize block: the 16-bit LUT of width up to P of ROWS rows."""
    return (1 << P) * ROWS * 2
