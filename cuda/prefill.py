"""The fused MoE's prefill path (`moe_kernels.moe_forward` for T > DECODE_MAX_T): the routing read once and laid out
on the host, per group of routed experts one dequantize launch into a bounded scratch and two grouped GEMMs, one
weighted scatter back; the buffers the layers share; the GEMM shapes' warm-up at engine start.

Apart from the kernels (moe_kernels.py) because this is host code that changes far more often: Numba's cache of a
module's compiled kernels is keyed by its source file (size and time), and a change to the kernels' module costs the
next GPU call ~110 s of compiling them all again.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as tf

from pagedweight.bitplanes import num_words
from pagedweight.models.layers import expert_rows, row_bucket

from .launcher import _PreparedLaunch
from .moe_kernels import DQ_WORDS, ROWS, _dequant_kernel, dequant_shared_bytes

PREFILL_SCRATCH_BYTES = 128 << 20  # dequantized blocks in flight during prefill (outside the pool's budget)
GROUPED_MAX = 1023  # torch._grouped_mm takes fewer than 1024 groups
# a call's padded rows, and so the prefill's buffers, are bounded by (1 + PAD_SLACK) * T * k: where groups of up to G
# slots would pad more, `expert_rows` splits them; alone they bound the rows by T * (k + G). 1.0: 8T rows where 11T on
# Qwen1.5 (buffers at 512 tokens 255 -> 219 MiB), 16T where 21T on Qwen3. A split saves padded rows but adds a group
# to a host-bound loop: on routing as uneven as the engine's (`prefill_bench --skew 2.5`) a layer call at 512 tokens
# took 1,325 us at 0.5, 1,231 at 1.0 and 1,350 unbounded, at 2,048 tokens 2,138 / 2,261 / 2,514 us
# (prefill_bench-nvidia-h200-20261201-s25-skew-half.json, ...-s25-skew.json); on uniform routing within 1.3 %
PAD_SLACK = 1.0


def _slot_elems(D: int, F: int) -> tuple[int, int]:
    """Elements of one expert's W_gate_up^T [D_pad, 2F] and W_down^T [F_pad, D] (K padded to whole words)."""
    return num_words(D) * 32 * 2 * F, num_words(F) * 32 * D


def prefill_group(D: int, F: int) -> int:
    """Experts dequantized per launch: as many as PREFILL_SCRATCH_BYTES holds (K padded to whole words), at least 1."""
    return max(1, PREFILL_SCRATCH_BYTES // (2 * sum(_slot_elems(D, F))))


def prefill_scratch(n: int, D: int, F: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Flat 16-bit scratch for n experts: every W_gate_up^T, then every W_down^T (`scratch_views`)."""
    return torch.empty(n * sum(_slot_elems(D, F)), dtype=dtype, device=device)


def scratch_views(scratch: torch.Tensor, D: int, F: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_gu [n, D_pad, 2F], w_d [n, F_pad, D]) inside a `prefill_scratch`."""
    gu, d = _slot_elems(D, F)
    n = scratch.numel() // (gu + d)
    return scratch[:n * gu].view(n, -1, 2 * F), scratch[n * gu:n * (gu + d)].view(n, -1, D)


def _dequantizer(pool_words, pool_halves, q, plane_off, lut_off, slot_expert: torch.Tensor, D: int, F: int,
                 lut_width: int, scratch: torch.Tensor) -> Callable[[int, int], None]:
    """launch(s0, n): slot j of `scratch_views(scratch)` <- W_gate_up^T and W_down^T of expert slot_expert[s0 + j],
    j < n, at the committed widths (at most lut_width: it sizes each block's LUT in shared memory); fp16 or bf16 (the
    scratch's dtype, rounded from the fp16 LUT entries), K padded to whole words. Marshalled once per prefill call
    (`_PreparedLaunch`): each group's launch changes only s0."""
    gu, d = _slot_elems(D, F)
    words = max(num_words(D), num_words(F))
    gx, gy = -(-max(2 * F, D) // ROWS), -(-words // DQ_WORDS)
    launch = _PreparedLaunch(_dequant_kernel, ROWS, dequant_shared_bytes(lut_width), (
        pool_words, pool_halves.view(torch.uint16), q, plane_off, lut_off, slot_expert, 0, D, F,
        scratch.dtype == torch.bfloat16, scratch.view(torch.uint16), scratch.numel() // (gu + d) * gu), var=6)
    return lambda s0, n: launch((gx, gy, 2 * n), s0)


@functools.lru_cache(maxsize=16)
def _has_grouped_kernel(device: torch.device) -> bool:
    """torch._grouped_mm has a CUTLASS kernel (no host sync) only for bf16 on sm90/sm100 (GroupedBlas.cpp); other
    dtypes and devices take its fallback, which reads the offsets back to the host and loops over mm."""
    return (device.type == "cuda" and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(device)[0] in (9, 10))


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None, out: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Expert j's rows of `a` times b[j] ([n, K, N]), in a's dtype. Given device end offsets `offs`, `a` is [rows, K]
    in consecutive runs: torch's grouped GEMM (CUTLASS for bf16 on sm90/sm100; it takes no `out`). Else `a` is
    [n, maxc, K], each expert's rows zero-padded to the group's largest: one bmm (into `out` when given), exact in
    fp16, where torch's grouped GEMM would sync and loop mm per expert (fp16 has no grouped kernel; ~120 launches per
    Qwen1.5 layer were host-bound). The scratch is fp16 under fp32 activations, hence the cast."""
    if offs is not None:
        return torch._grouped_mm(a, b, offs=offs)
    return torch.bmm(a, b if b.dtype == a.dtype else b.to(a.dtype), out=out)


class PrefillBuffers:
    """One device allocation that `prefill_forward`'s per-call tensors are views of, the dequantize scratch included,
    each in a region sized by the bound of a call of T tokens (`_padded_bound`: min((1 + PAD_SLACK) * T * k, E * T)
    padded rows, whatever the routing). Why: those tensors' sizes follow each call's routing, and the caching allocator,
    given a size that no cached free block fits, maps a new segment; under kv_pressure's arrivals on the H200 the
    segments first mapped at the prefill's combine held 452-478 MiB beyond the engine's budget
    (memory_gap-nvidia-h200-20261201-memgap-pressure-s22.json). An engine's layers share one (they run one after another
    on one stream), bounded for at least `tokens` (the engine's max_num_batched_tokens), so its first prefill allocates
    it for good; grown from a smaller first call instead, the auto reserve ran 56 MiB over under kv_pressure
    (…-s23-buffers-kv.json). Measured on the Qwen1.5 shape (…-s23-buffers-tok.json against …-s23-kv.json): peak above
    the budget with no reserve 389 -> 371 MiB (batch 1), 413 -> 391 (batch 4), 812 -> 620 (kv_pressure); the auto
    reserve 508 / 508 / 958 -> 460 / 464 / 750 MiB, each run within its budget; a layer call as fast
    (prefill_buffers_ab-nvidia-h200-20261201-s23-prefillab.json)."""

    def __init__(self, tokens: int = 0) -> None:
        self.tokens = tokens
        self.data: torch.Tensor | None = None

    def take(self, device: torch.device, parts: list[tuple[tuple[int, ...], int, torch.dtype]]) -> list[torch.Tensor]:
        """A tensor of each (shape, bound elements, dtype), at the start of its own 256-byte aligned region of `bound`
        elements."""
        offsets, total = [], 0
        for _, bound, dtype in parts:
            offsets.append(total)
            total += -(-bound * dtype.itemsize // 256) * 256
        if self.data is None or self.data.numel() < total or self.data.device != device:
            self.data = None  # back to the caching allocator before the larger one is asked for
            self.data = torch.empty(total, dtype=torch.uint8, device=device)
        return [self.data[o:o + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                for o, (shape, _, dtype) in zip(offsets, parts)]


def _padded_bound(T: int, k: int, E: int) -> int:
    """Padded rows of a call of T tokens at most: (1 + PAD_SLACK) * T * k, and E * T (no expert has more than T)."""
    return min(int((1 + PAD_SLACK) * T * k), T * E)


def _layer_setup(dtype: torch.dtype, device: torch.device, D: int, F: int, E: int
                 ) -> tuple[bool, int, torch.dtype]:
    """(grouped, G, scratch dtype) of a layer's prefill: torch's grouped GEMM where it has a CUTLASS kernel (bf16 on
    sm90/sm100, K and N multiples of 8 for TMA), else padded bmm; G experts a group (never more than the layer's);
    a bf16 scratch under bf16 activations, else fp16."""
    grouped = dtype == torch.bfloat16 and _has_grouped_kernel(device) and D % 8 == 0 and F % 8 == 0
    wdt = torch.bfloat16 if dtype == torch.bfloat16 else torch.float16
    return grouped, min(prefill_group(D, F), GROUPED_MAX, E), wdt


def _call_tensors(buffers: PrefillBuffers, dev: torch.device, T: int, rows: int, slots: int, D: int, F: int, k: int,
                  E: int, G: int, ht: torch.dtype, wdt: torch.dtype, grouped: bool) -> list[torch.Tensor]:
    """A prefill call's tensors in `buffers` (xp, x, gu, act, y, yw, out, scratch), each bounded whatever the routing:
    the rows (padded: at most (1 + PAD_SLACK) * T*k, groups split where they would pad more, and at most E*T, no
    expert having more than T rows) through the gather, gate_up, activation, down and the fp32 weighting; the scratch
    of `slots` experts (at most G)."""
    tb = max(T, buffers.tokens)  # the token count the regions are bounded for
    bound = tb * k if grouped else _padded_bound(tb, k, E)
    pad_rows, pad_bound = (0, 0) if grouped else (rows, bound)  # the grouped GEMM allocates its own outputs
    slot_elems, f32 = sum(_slot_elems(D, F)), torch.float32
    return buffers.take(dev, [
        ((T + 1, D), (tb + 1) * D, ht), ((rows, D), bound * D, ht), ((pad_rows, 2 * F), pad_bound * 2 * F, ht),
        ((pad_rows, F), pad_bound * F, ht), ((rows, D), bound * D, ht), ((rows, D), bound * D, f32),
        ((T + 1, D), (tb + 1) * D, f32), ((slots * slot_elems,), G * slot_elems, wdt)])


def warm_prefill_gemms(buffers: PrefillBuffers, D: int, F: int, E: int, k: int, dtype: torch.dtype,
                       device: torch.device) -> int:
    """Run once each padded group GEMM shape (n experts of `width` rows, both projections) that a prefill call of up
    to buffers.tokens tokens can take with bucketed widths (`layers.row_bucket`); returns the shapes run. Why: cuBLAS
    chooses a kernel on a shape's first sight, ~0.1 ms of host time and up to 2 ms against ~0.01 ms again (H100,
    step_host's bmm_us), and a fresh engine's prefill steps met dozens each (probe_phase, s53 calls log: a 453-token
    step's GEMMs 31-55 ms of host time in its first steps, 6-15 later). The tensors are the call's own regions of
    `buffers`, given back after (the first real call allocates them again, where the activation reserve's profile
    measures them). Nothing to do without a token bound, or where the grouped GEMM runs instead (bf16 on sm90)."""
    grouped, G, wdt = _layer_setup(dtype, device, D, F, E)
    if grouped or buffers.tokens < 1:
        return 0
    T = buffers.tokens
    bound = _padded_bound(T, k, E)
    _, x, gu, act, y, _, _, scratch = _call_tensors(buffers, device, T, bound, G, D, F, k, E, G, dtype, wdt, False)
    w_gu, w_d = scratch_views(scratch, D, F)
    w_gu, w_d = w_gu[:, :D], w_d[:, :F]
    widths = np.unique(row_bucket(np.arange(1, T + 1))).tolist()
    shapes = 0
    for n in range(1, G + 1):
        for width in widths:
            rows = n * width
            if rows > bound:
                break
            _grouped_mm(x[:rows].view(n, width, D), w_gu[:n], None, gu[:rows].view(n, width, 2 * F))
            _grouped_mm(act[:rows].view(n, width, F), w_d[:n], None, y[:rows].view(n, width, D))
            shapes += 1
    buffers.data = None
    return shapes


def prefill_forward(hidden, topk_ids, topk_weights, pool_words, pool_halves, q, plane_off, lut_off, D, F, lut_width,
                    buffers: PrefillBuffers | None = None):
    """Large T: the routing read once and laid out on the host (`expert_rows`: routed experts, most pairs first, in
    groups that fill PREFILL_SCRATCH_BYTES), uploaded once; the pairs' rows gathered once; per group one dequantize
    launch (both kinds) and two grouped GEMMs; one weighted scatter back to the tokens at the end. Without the
    CUTLASS grouped GEMM (fp16) each slot of a group is zero-padded to the group's largest count and the group is
    one bmm per projection (a zero row stays zero through silu(gate) * up); slots sorted by count keep the padding
    small. ~5 launches per group, where the layout built on the device (repeat_interleave, per-group scatter, pad and
    gather) took ~15 (prefill_bench-nvidia-h200-20261130-s16-prefill-ab.json: a batch of four 2,016-token prompts
    at 4 bits, 1,662 -> 1,331 ms to the first tokens). One kind per launch, every gate_up before any down (11 and 22
    blocks in the scratch, one activation over all rows) cut a layer call by 7-12 % but not the time to first token,
    and peak reserved memory was 0.17-0.47 GiB higher (whole-call buffers, more padding in groups of 11): not kept
    (cuda/KERNEL_NOTES.md, session 19)."""
    T, k = topk_ids.shape
    dev = hidden.device
    grouped, G, wdt = _layer_setup(hidden.dtype, dev, D, F, q.shape[0])
    plan = expert_rows(topk_ids.cpu().numpy(), q.shape[0], G, pad=not grouped, routed_only=True, slack=PAD_SLACK,
                       bucket=True)  # padded widths of few shapes: cuBLAS picks a kernel per new shape
    slots, token, pair, ends = plan.to(dev)
    if grouped:
        ends = ends.to(torch.int32)
    sizes = [r1 - r0 for _, _, r0, r1, _ in plan.groups]
    buffers = buffers or PrefillBuffers()
    xp, x, gu, act, y, yw, out, scratch = _call_tensors(buffers, dev, T, len(plan.token), min(G, len(plan.slots)),
                                                        D, F, k, q.shape[0], G, hidden.dtype, wdt, grouped)
    xp[:T].copy_(hidden)
    xp[T].zero_()
    torch.index_select(xp, 0, token, out=x)  # padding rows read the zero row T
    w_gu, w_d = scratch_views(scratch, D, F)
    w_gu, w_d = w_gu[:, :D], w_d[:, :F]  # a group's are its first n slots: all of them but in the last group
    dequantize = _dequantizer(pool_words, pool_halves, q, plane_off, lut_off, slots, D, F, lut_width, scratch)
    # the host bounds this loop (~2 ms per Qwen1.5 layer call from T = 64 to 2,048, moe_kernel_bench-nvidia-h200-
    # 20261130-s18-lut.json; ~10 torch calls per group: prefill_host_profile-nvidia-h200-20261130-s18-prepared.txt),
    # so the per-group views come from one split each, not a slice per group (the groups' rows and slots are
    # consecutive), through torch's C++ methods (split_with_sizes, chunk; Tensor.split and len() are Python wrappers)
    xs, ys = x.split_with_sizes(sizes), y.split_with_sizes(sizes)
    if grouped:
        offs = ends.split_with_sizes([n for _, n, *_ in plan.groups])
        gus = acts = [None] * len(xs)
    else:
        offs, gus, acts = [None] * len(xs), gu.split_with_sizes(sizes), act.split_with_sizes(sizes)
    full = w_gu.shape[0]
    for (s0, n, _, _, width), a, off, gr, ar, yr in zip(plan.groups, xs, offs, gus, acts, ys):
        dequantize(s0, n)
        wg, wd = (w_gu, w_d) if n == full else (w_gu[:n], w_d[:n])
        if grouped:
            gate, up = _grouped_mm(a, wg, off).chunk(2, dim=-1)
            yr.copy_(_grouped_mm(tf.silu(gate) * up, wd, off))
        else:  # n experts of `width` rows each, every product in its rows of the buffers
            gate, up = _grouped_mm(a.view(n, width, D), wg, None, gr.view(n, width, 2 * F)).chunk(2, dim=-1)
            h = torch.mul(tf.silu(gate, inplace=True), up, out=ar.view(n, width, F))
            _grouped_mm(h, wd, None, yr.view(n, width, D))
    w = topk_weights.reshape(-1).float().index_select(0, pair).unsqueeze(1)
    out.zero_().index_add_(0, token, torch.mul(y, w, out=yw))  # y * w: in fp32
    return out[:T].to(hidden.dtype, copy=True)  # a copy: the buffers serve the next call
