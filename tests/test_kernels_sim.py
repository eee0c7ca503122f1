"""The Numba MoE kernels under the CUDA simulator (tiny sizes) against the float32 torch twin, decode and prefill
(mixed widths up to 8 bits, fp16 and bf16, skewed routing over several expert groups), and the prefill's fp16 -> bf16
rounding against torch's. On the CPU the prefill always takes the padded bmm (no CUTLASS grouped GEMM there).

The simulator must be chosen before numba.cuda is first imported, so the checks run in a child process with
NUMBA_ENABLE_CUDASIM=1 and the rest of the test session keeps the real CUDA target.
"""
from __future__ import annotations

import os
import textwrap

import pytest

from helpers import child_fixture, run_child_json

DEVICE = os.environ.get("PAGEDWEIGHT_TEST_DEVICE", "cpu")

CHILD = textwrap.dedent(r"""
    import json, sys
    import numpy as np
    import torch
    torch.set_num_threads(1)
    from pagedweight.bitplanes import num_words
    import pagedweight.cuda.moe_kernels as mk
    import pagedweight.cuda.prefill as pf
    from pagedweight.cuda.moe_kernels import _bf16_bits, moe_forward
    from pagedweight.cuda.prefill import _dequantizer, _grouped_mm, prefill_group, prefill_scratch, scratch_views
    from pagedweight.cuda.reference import block_weight, moe_forward_reference
    from pagedweight.cuda.synthetic import build_synthetic_moe
    from pagedweight.models.layers import expert_rows

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    def check(moe, q, hidden, ids, w, lut_width=None):  # moe_forward and its twin against dense float32 loops
        T, k = ids.shape
        qd, po, lo = moe.tables(q)
        args = (hidden, ids, w, moe.pool_words, moe.pool_halves, qd, po, lo, moe.D, moe.F, moe.P)
        out = moe_forward(*args, lut_width=lut_width)
        ref = moe_forward_reference(*args)
        dense = torch.zeros(T, moe.D)
        for t in range(T):
            for j in range(k):
                e = int(ids[t, j])
                wg = block_weight(moe.pool_words, moe.pool_halves, int(q[e, 0]), po[e, 0], int(lo[e, 0]), 2 * moe.F, moe.D)
                wd = block_weight(moe.pool_words, moe.pool_halves, int(q[e, 1]), po[e, 1], int(lo[e, 1]), moe.D, moe.F)
                hh = wg @ hidden[t].float()
                dense[t] += w[t, j] * (wd @ (torch.nn.functional.silu(hh[:moe.F]) * hh[moe.F:]))
        return dict(T=T, k=k, P=moe.P, dtype=str(hidden.dtype), dtype_ok=out.dtype == hidden.dtype,
                    shape_ok=tuple(out.shape) == (T, moe.D), finite=bool(torch.isfinite(out).all()),
                    rel_kernel=rel(out, dense), rel_twin=rel(ref, dense))

    results = {}
    # E=5 experts, D=80 (3 words, last one padded), F=40 (2 words): partial words and rows past N are covered.
    # P=6 with widths 3..6 (fp32 LUTs in the decode kernel), P=8 with widths 3..8 (fp16 LUTs above 6 bits).
    # D=320 (10 words): a gate_up block's K range of 10 words in the widest class (16 words a split at least), three
    # staged sub-chunks of x where D=80 has one (the one-token kernels stage their first in the prologue).
    moes = {(P, D): build_synthetic_moe(E=5, D=D, F=40, P=P, seed_bits=3, seed=1)
            for P, D in ((6, 80), (8, 80), (8, 320))}
    g = torch.Generator().manual_seed(2)
    # T=65 takes the prefill path (dequantize kernel + grouped matmuls); the others the fused decode kernels, whose
    # token tiles are 1, 4 and 16: T=12 and T=24 at top-4 of 5 experts give ~10 and ~19 tokens per expert (the
    # 16-token tile with 2..4 quads holding tokens, then a remainder tile). T=1 runs the one-token kernels: all
    # widths (P=6, and P=8 with its fp16 LUTs), and the narrow class's when the widest block has 4 bits (case 9);
    # T=4 at 4 bits the narrow class's kernel of 1- and 4-token bodies (case 10: top-3 of 5, so slots of 1..4)
    cases = [(1, 2, torch.float16, 6, 6, 80), (3, 2, torch.bfloat16, 6, 6, 80), (6, 3, torch.float16, 6, 6, 80),
             (65, 2, torch.bfloat16, 6, 6, 80), (65, 2, torch.float16, 8, 8, 80), (65, 3, torch.bfloat16, 8, 8, 80),
             (12, 4, torch.float16, 8, 8, 80), (24, 4, torch.bfloat16, 6, 6, 80), (1, 3, torch.bfloat16, 8, 8, 80),
             (1, 4, torch.float16, 8, 4, 80), (4, 3, torch.bfloat16, 8, 4, 80), (1, 2, torch.float16, 8, 8, 320),
             (3, 2, torch.bfloat16, 8, 8, 320)]
    for case, (T, k, dtype, P, widest, D) in enumerate(cases):
        moe = moes[P, D]
        q = torch.randint(3, widest + 1, (moe.E, 2), generator=g)  # random mixed widths, gate_up and down differ
        hidden = torch.randn(T, moe.D, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(moe.E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
        w = torch.rand(T, k, generator=g)
        if case % 2 == PART:  # every input drawn in both children (the same generator state), each checks half
            results[f"case{case}"] = check(moe, q, hidden, ids, w / w.sum(1, keepdim=True), widest)
    if PART == 0:  # the rest in the other child
        json.dump(results, sys.stdout)
        sys.exit(0)
    # Skewed prefill over several groups: scratch for 4 experts, 6 of 8 routed (2 and 6 never) with 70/3/50/10 | 1/26
    # pairs, so slots 0, 3, 7, 4, 1, 5 (most pairs first), in groups of 4 and 2, or under a PAD_SLACK of 0.5 (groups
    # of 4 and 2 pad 286 rows, past 1.5 * 160) split where that saves most (88 rows): 2 (width 70), 2 (26), 2 (3),
    # 198 rows. Tokens and each token's two choices shuffled, so the sorted order is not the token order. A pair
    # given the wrong slot uses another expert's weights (one such pair: rel_kernel 0.07 in bf16, 0.16 in fp16), two
    # pairs given one padded row overwrite each other, and a slot or row past the group's [n, maxc] raises (slots not
    # made group-local raise in the second group only). Rows permuted within their slot are harmless: scatter and gather agree.
    moe = build_synthetic_moe(E=8, D=80, F=40, P=6, seed_bits=3, seed=3)
    default_scratch = pf.PREFILL_SCRATCH_BYTES
    pf.PREFILL_SCRATCH_BYTES = 4 * 2 * (num_words(moe.D) * 32 * 2 * moe.F + num_words(moe.F) * 32 * moe.D)
    T = 80
    first = [0] * 70 + [4] * 10
    second = [3] * 50 + [1] * 3 + [5] + [7] * 26
    ids = torch.tensor([first, second], dtype=torch.int32).t()
    swap = torch.rand(T, generator=g) < 0.5
    ids = torch.where(swap[:, None], ids.flip(1), ids)[torch.randperm(T, generator=g)].contiguous()
    default_slack = pf.PAD_SLACK
    for slack in (default_slack, 0.5):
        pf.PAD_SLACK = slack
        for dtype in (torch.float16, torch.bfloat16):
            q = torch.randint(3, 7, (moe.E, 2), generator=g)
            w = torch.rand(T, 2, generator=g)
            results[f"skew_{str(dtype).split('.')[-1]}_{slack}"] = dict(
                check(moe, q, torch.randn(T, moe.D, generator=g).to(dtype), ids, w / w.sum(1, keepdim=True)),
                G=prefill_group(moe.D, moe.F), counts=torch.bincount(ids.reshape(-1).long(), minlength=moe.E).tolist(),
                groups=[n for _, n, *_ in expert_rows(ids.numpy(), moe.E, 4, True, True, slack).groups])
    pf.PAD_SLACK = default_slack
    # PrefillBuffers shared by calls, as an engine's layers share one: each output equals that of a call without
    # (its own buffers), and stays so after the next call reuses them; buffers sized for 80 tokens allocate that bound
    # at a first call of 72 and keep the allocation through a call of 80 (other routing)
    buffers, outs = pf.PrefillBuffers(tokens=80), []
    qd, po, lo = moe.tables(torch.randint(3, 7, (moe.E, 2), generator=g))
    for n in (72, 80):
        w = torch.rand(n, 2, generator=g)
        args = (torch.randn(n, moe.D, generator=g).to(torch.float16), ids[torch.randperm(T, generator=g)[:n]],
                w / w.sum(1, keepdim=True), moe.pool_words, moe.pool_halves, qd, po, lo, moe.D, moe.F, moe.P)
        outs.append((moe_forward(*args, buffers=buffers), moe_forward(*args)))
        if n == 72:
            first = buffers.data.data_ptr()
    results["buffers"] = dict(equal=all(torch.equal(a, b) for a, b in outs), kept=buffers.data.data_ptr() == first)
    # a layer of fewer experts than the scratch holds (as the bundled model's 16 small experts, where the default
    # scratch holds 1,023): its regions are bounded by (1 + PAD_SLACK) * T * k padded rows (at most E * T) and E
    # scratch slots, not T * (k + G) rows and G slots
    pf.PREFILL_SCRATCH_BYTES = default_scratch
    small = pf.PrefillBuffers(tokens=T)
    moe_forward(*args, buffers=small)
    E, D, F, rows = moe.E, moe.D, moe.F, min(int((1 + pf.PAD_SLACK) * T * 2), moe.E * T)
    parts = [(T + 1) * D * 2, rows * D * 2, rows * 2 * F * 2, rows * F * 2, rows * D * 2, rows * D * 4,
             (T + 1) * D * 4, E * sum(pf._slot_elems(D, F)) * 2]  # fp16 rows, fp32 weighting and output, scratch
    results["bounded"] = dict(bytes=small.data.numel(), want=sum(-(-n // 256) * 256 for n in parts))
    # the prefill's dequantize kernel alone, bit for bit: W^T of every block at random widths 3..8 equals the twin's
    # weights rounded to the scratch dtype (fp16: the LUT entries themselves; bf16: torch's rounding of them)
    moe = moes[8, 80]
    q = torch.randint(3, 9, (moe.E, 2), generator=g)
    qd, po, lo = moe.tables(q)
    D, F = moe.D, moe.F
    for dtype in (torch.float16, torch.bfloat16):
        scratch = prefill_scratch(moe.E, D, F, dtype, "cpu").fill_(float("nan"))
        w_gu, w_d = scratch_views(scratch, D, F)
        slots = torch.randperm(moe.E, generator=g)
        _dequantizer(moe.pool_words, moe.pool_halves, qd, po, lo, slots, D, F, moe.P, scratch)(1, moe.E - 1)
        exact, untouched = True, bool(torch.isnan(w_gu[moe.E - 1]).all() and torch.isnan(w_d[moe.E - 1]).all())
        for j in range(moe.E - 1):
            e = int(slots[1 + j])
            wg = block_weight(moe.pool_words, moe.pool_halves, int(q[e, 0]), po[e, 0], int(lo[e, 0]), 2 * F, D)
            wd = block_weight(moe.pool_words, moe.pool_halves, int(q[e, 1]), po[e, 1], int(lo[e, 1]), D, F)
            exact &= torch.equal(w_gu[j, :D], wg.t().to(dtype)) and torch.equal(w_d[j, :F], wd.t().to(dtype))
        results[f"dequant_{str(dtype).split('.')[-1]}"] = dict(exact=bool(exact), untouched=untouched)
    # torch._grouped_mm (the GPU's bf16 path; torch runs it on the CPU too) on that scratch layout, a K-padded slice
    # of [slots, K_pad, N], with end offsets, equals the padded bmm (runs zero-padded to the largest, here 5, rows
    # gathered back), an empty run included
    sizes = [3, 0, 5, 1]
    x = torch.randn(sum(sizes), D, generator=g).to(torch.bfloat16)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    pad = (torch.tensor([0, 0, 0, 2, 2, 2, 2, 2, 3]), torch.tensor([0, 1, 2, 0, 1, 2, 3, 4, 0]))
    xp = x.new_zeros(len(sizes), max(sizes), D)
    xp[pad] = x
    results["grouped_mm"] = dict(equal=torch.equal(_grouped_mm(x, w_gu[:4, :D], offs),
                                                   _grouped_mm(xp, w_gu[:4, :D], None)[pad]))
    # the prefill's bf16 scratch rounds fp16 LUT entries in the kernel: every finite fp16 value as torch rounds it
    h = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    want = h.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    got = np.array([_bf16_bits(np.uint16(i)) for i in range(1 << 16)], dtype=np.uint16)
    finite = torch.isfinite(h).numpy()
    results["bf16_bits"] = dict(mismatches=int((want != got)[finite].sum()), inf_ok=bool(
        got[0x7C00] == 0x7F80 and got[0xFC00] == 0xFF80), nan_ok=bool(((got[~finite] & 0x7FFF) >= 0x7F81).sum()
                                                                        == int((~finite).sum()) - 2))
    json.dump(results, sys.stdout)
""")


# two children side by side, each checking half the cases (CI has two cores)
sim_results = child_fixture(__name__, "sim_results", [f"PART = {part}\n" + CHILD for part in (0, 1)], timeout=1200,
                            NUMBA_ENABLE_CUDASIM="1")


@pytest.mark.parametrize("case", [f"case{i}" for i in range(13)])
def test_moe_forward_matches_float32_reference(sim_results: dict, case: str) -> None:
    r = sim_results[case]
    assert r["dtype_ok"] and r["shape_ok"] and r["finite"], r
    assert r["rel_twin"] <= 1e-2, r
    assert r["rel_kernel"] <= 1e-2, r


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("slack, groups", [(1.0, [4, 2]), (0.5, [2, 2, 2])])
def test_prefill_skewed_routing_over_groups(sim_results: dict, dtype: str, slack: float, groups: list[int]) -> None:
    r = sim_results[f"skew_{dtype}_{slack}"]
    assert r["G"] == 4 and r["counts"] == [70, 3, 0, 50, 10, 1, 0, 26] and r["groups"] == groups, r
    assert r["dtype_ok"] and r["shape_ok"] and r["finite"], r
    assert r["rel_twin"] <= 1e-2, r
    assert r["rel_kernel"] <= 1e-2, r


def test_prefill_buffers_shared_by_calls(sim_results: dict) -> None:
    assert sim_results["buffers"] == dict(equal=True, kept=True)


def test_prefill_buffers_bounded_by_the_layers_experts(sim_results: dict) -> None:
    r = sim_results["bounded"]
    assert r["bytes"] == r["want"], r


def test_bf16_rounding_matches_torch(sim_results: dict) -> None:
    r = sim_results["bf16_bits"]
    assert r["mismatches"] == 0 and r["inf_ok"] and r["nan_ok"], r


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_dequantize_kernel_is_exact(sim_results: dict, dtype: str) -> None:
    r = sim_results[f"dequant_{dtype}"]
    assert r["exact"] and r["untouched"], r  # slots s0.. s0+n-1 only, each block exactly its twin's weights


def test_grouped_mm_contract(sim_results: dict) -> None:
    assert sim_results["grouped_mm"]["equal"]


@pytest.mark.skipif(DEVICE != "cuda", reason="the kernel on the GPU: PAGEDWEIGHT_TEST_DEVICE=cuda (run on the H200)")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("widest", [8, 4])
def test_dequantize_groups_through_one_prepared_launch_on_gpu(dtype: str, widest: int) -> None:
    """The GPU's launch path (parameters marshalled once, s0 patched per group, cuLaunchKernel): every group of a
    call writes exactly its blocks' weights, bit for bit, and nothing past the group; with widths up to 4 the LUT in
    shared memory is sized for 4 bits (as the runner passes for such a layer)."""
    import torch

    import pagedweight.cuda.prefill as pf
    from pagedweight.cuda.reference import block_weight
    from pagedweight.cuda.synthetic import build_synthetic_moe

    E, D, F = 7, 80, 40
    moe = build_synthetic_moe(E=E, D=D, F=F, P=8, seed_bits=3, seed=4, device="cuda")
    g = torch.Generator().manual_seed(5)
    q = torch.randint(3, widest + 1, (E, 2), generator=g)
    qd, po, lo = moe.tables(q)
    dt = getattr(torch, dtype)
    scratch = pf.prefill_scratch(3, D, F, dt, "cuda")
    w_gu, w_d = pf.scratch_views(scratch, D, F)
    slots = torch.randperm(E, generator=g).cuda()
    dequantize = pf._dequantizer(moe.pool_words, moe.pool_halves, qd, po, lo, slots, D, F, widest, scratch)
    for s0, n in ((0, 3), (3, 3), (6, 1)):
        scratch.fill_(float("nan"))
        dequantize(s0, n)
        for j in range(n):
            e = int(slots[s0 + j])
            wg = block_weight(moe.pool_words, moe.pool_halves, int(q[e, 0]), po[e, 0], int(lo[e, 0]), 2 * F, D)
            wd = block_weight(moe.pool_words, moe.pool_halves, int(q[e, 1]), po[e, 1], int(lo[e, 1]), D, F)
            assert torch.equal(w_gu[j, :D], wg.t().to(dt)) and torch.equal(w_d[j, :F], wd.t().to(dt)), (s0, j)
        assert torch.isnan(w_gu[n:]).all() and torch.isnan(w_d[n:]).all(), (s0, n)


@pytest.mark.skipif(DEVICE != "cuda", reason="the kernels on the GPU: PAGEDWEIGHT_TEST_DEVICE=cuda (run on the H200)")
@pytest.mark.parametrize("T, k, P, widest, D", [(1, 2, 6, 6, 80), (1, 3, 8, 8, 80), (1, 4, 8, 4, 80),
                                                (1, 2, 8, 8, 320), (4, 2, 6, 6, 80), (4, 3, 8, 4, 80),
                                                (12, 4, 8, 8, 80)])
def test_moe_decode_matches_its_twin_on_gpu(T: int, k: int, P: int, widest: int, D: int) -> None:
    """The decode path's launches on the GPU (`launcher.launch`: the route kernel, then the gate_up and down GEMVs
    with the LUT in dynamic shared memory) give the torch twin's result: one-token kernels at fp32 and fp16 LUTs and
    the narrow class, and with a K range of three sub-chunks (D = 320), the tiled kernel at 4 and 12 tokens, the
    narrow class's at 4."""
    import torch

    from pagedweight.cuda.moe_kernels import moe_forward
    from pagedweight.cuda.reference import moe_forward_reference
    from pagedweight.cuda.synthetic import build_synthetic_moe

    moe = build_synthetic_moe(E=5, D=D, F=40, P=P, seed_bits=3, seed=1)
    g = torch.Generator().manual_seed(T * 10 + k)
    q = torch.randint(3, widest + 1, (moe.E, 2), generator=g)
    hidden = torch.randn(T, moe.D, generator=g).half()
    ids = torch.stack([torch.randperm(moe.E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    args = [t.cuda() for t in (hidden, ids, w / w.sum(1, keepdim=True), moe.pool_words, moe.pool_halves,
                               *moe.tables(q))] + [moe.D, moe.F, moe.P]
    out = moe_forward(*args, lut_width=widest)
    ref = moe_forward_reference(*args)
    assert out.shape == (T, moe.D) and out.dtype == torch.float16 and torch.isfinite(out).all()
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) <= 1e-2


@pytest.mark.skipif(DEVICE != "cuda", reason="Numba's marshalling on the GPU: PAGEDWEIGHT_TEST_DEVICE=cuda (the H200)")
def test_prepared_launch_params_are_numbas_on_gpu() -> None:
    """`kernel_params` flattens tensors and scalars exactly as Numba's own launch does (the array ABI it relies on):
    contiguous and strided arrays, 1-3 dimensions, 16-, 32- and 64-bit elements, ints, a bool, a numpy float32 and a
    Python float (float64)."""
    import ctypes

    import numpy as np
    import torch

    import pagedweight.cuda.launcher as lm
    from pagedweight.cuda._compat import cuda

    @cuda.jit
    def takes_all(a, b, c, d, i, flag, j, x, y):
        pass

    base = torch.arange(6 * 8 * 4, dtype=torch.int32, device="cuda").view(6, 8, 4)
    args = (base, base[:, 1:5, ::2], torch.zeros(5, dtype=torch.int64, device="cuda")[1:],
            torch.zeros(3, 7, dtype=torch.float16, device="cuda").t(), 12, True, -3, np.float32(-1.5e-6), 2.75)
    ours, slot = lm.kernel_params(args, var=4)
    views = tuple(lm._dev(a) if isinstance(a, torch.Tensor) else a for a in args)
    kernel = takes_all.compile(tuple(takes_all.typeof_pyval(a) for a in views))
    flat: list = []
    for ty, a in zip(kernel.argument_types, views):
        kernel._prepare_args(ty, a, cuda.external_stream(torch.cuda.current_stream().cuda_stream), [], flat)

    def bits(v) -> int:  # a float parameter as the bytes the driver copies
        if isinstance(v, (ctypes.c_float, ctypes.c_double)):
            return int.from_bytes(bytes(v), "little", signed=True)
        return v.value if isinstance(v, ctypes._SimpleCData) else int(v)

    numbas = [bits(v) for v in flat]
    assert ours == numbas
    assert ours[slot] == 12
    # the kernel `launch` looks up is compiled for each array's Numba layout (a transposed matrix is "F", not "A")
    assert [lm._layout(takes_all, a) for a in args[:4]] == ["C", "A", "C", "F"]
    # launch's one walk: the same parameters, and _cufunc's key
    assert lm._flatten(takes_all, args) == (ours, (takes_all, *(lm._arg_key(takes_all, a) for a in args)))


def test_launch_params_refill_one_block_per_thread_and_count() -> None:
    """`launch` refills one kernelParams block per thread and parameter count (the driver copies the values at the
    call), each address pointing at its own value; a `_PreparedLaunch`'s block (`_param_block`) is its own."""
    import ctypes
    import threading

    import pagedweight.cuda.launcher as lm

    def read(params: ctypes.Array, n: int) -> list[int]:
        return [ctypes.c_int64.from_address(params[i]).value for i in range(n)]

    prepared_vals, prepared = lm._param_block([1, 2, 3])  # both held, as _PreparedLaunch holds them
    first = lm._launch_params([1, -2, 3])
    assert read(first, 3) == [1, -2, 3]
    assert lm._launch_params([4, 5, 6]) is first and read(first, 3) == [4, 5, 6]
    two = lm._launch_params([7, 8])
    assert two is not first and read(two, 2) == [7, 8] and read(first, 3) == [4, 5, 6]
    other: list = []
    def in_thread() -> None:  # read there: a thread's blocks go with it
        params = lm._launch_params([9, 9, 9])
        other.append((params is first, read(params, 3)))

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join()
    assert other == [(False, [9, 9, 9])] and read(first, 3) == [4, 5, 6]
    assert read(prepared, 3) == [1, 2, 3]


def test_launch_walks_arguments_once_as_kernel_params_and_cufunc_do() -> None:
    """`launch`'s one walk over the arguments (`_flatten`) gives `kernel_params`' parameters and the key `_cufunc`
    files the kernel under, for tensors of several dtypes and ranks and each scalar type: a key that differed would
    compile a kernel per launch, parameters that differed would launch it on wrong memory. (Strided tensors, whose
    layout needs a device view: test_prepared_launch_params_are_numbas_on_gpu.)"""
    import numpy as np
    import torch

    import pagedweight.cuda.launcher as lm
    from pagedweight.cuda.moe_kernels import _route_kernel as kernel

    args = (torch.arange(24, dtype=torch.int32).view(2, 3, 4), torch.zeros(3, 7, dtype=torch.float16),
            torch.ones(5, dtype=torch.int64), 12, True, np.float32(-1.5), 2.75)
    ints, key = lm._flatten(kernel, args)
    assert ints == lm.kernel_params(args)[0]
    assert key == (kernel, *(lm._arg_key(kernel, a) for a in args))
    assert key[1:4] == ((torch.int32, 3, "C", None), (torch.float16, 2, "C", None), (torch.int64, 1, "C", None))
    assert key[4:] == (int, bool, np.float32, float)


ROUTE_CHILD = textwrap.dedent(r"""
    import json, sys
    import numpy as np
    import torch
    torch.set_num_threads(1)
    import pagedweight.cuda.moe_kernels as mk
    from pagedweight.cuda.launcher import _dev
    from pagedweight.cuda.moe_kernels import _route_kernel

    out = {}
    g = torch.Generator().manual_seed(5)
    for T, k, E in ((1, 8, 128), (3, 2, 5), (64, 8, 128), (16, 4, 1024), (40, 8, 300)):
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        if T > 8:
            ids[: T // 2, 0] = 7  # a popular expert, many pairs in one slot
        w = torch.rand(T, k, generator=g)
        D, F = 24, 8
        hidden = torch.randn(T, D, generator=g).half()
        xf, h, o = torch.full((T, D), 9.0), torch.full((T * k, 2 * F), 9.0), torch.full((T, D), 9.0)
        slots = min(E, T * k)
        se, ss, sc = (torch.full((slots,), -1, dtype=torch.int32) for _ in range(3))
        na, pt, pw = torch.zeros(1, dtype=torch.int32), torch.full((T * k,), -1, dtype=torch.int32), torch.zeros(T * k)
        _route_kernel[2, mk.ROUTE_THREADS](*map(_dev, (ids, w, hidden)), E, *map(_dev, (xf, h, o, se, ss, sc, na, pt, pw)))
        n = int(na[0])
        experts = sorted(set(ids.flatten().tolist()))
        pairs_ok = True
        for s in range(n):  # each slot's pairs: exactly the (token, weight) pairs routed to its expert
            e, a, c = int(se[s]), int(ss[s]), int(sc[s])
            want = sorted((t, float(w[t, j])) for t in range(T) for j in range(k) if int(ids[t, j]) == e)
            got = sorted((int(pt[i]), float(pw[i])) for i in range(a, a + c))
            pairs_ok &= got == want
        out[f"{T}/{k}/{E}"] = dict(
            n_active=n == len(experts), experts=se[:n].tolist() == experts,
            starts=ss[:n].tolist() == np.concatenate([[0], np.cumsum(sc[:n].numpy())[:-1]]).tolist(),
            pairs=bool(pairs_ok), setup=bool(torch.equal(xf, hidden.float()) and not h.any() and not o.any()))
    json.dump(out, sys.stdout)
""")


routed = child_fixture(__name__, "routed", [ROUTE_CHILD], timeout=1200, NUMBA_ENABLE_CUDASIM="1")


def test_route_kernel_groups_every_pair_by_expert(routed: dict):
    """The decode path's routing (block 0) under the simulator, from a single expert per token to 1,024 experts:
    one slot per routed expert in ascending order, each slot's rows start where the previous ends and hold exactly
    that expert's (token, weight) pairs; the other block casts x and zeroes the split-K accumulators."""
    res = routed
    assert len(res) == 5
    for case, r in res.items():
        assert all(r.values()), (case, r)


ARGS_CHILD = r"""
import json, torch
from pagedweight.cuda import moe_kernels as mk
q = torch.full((4, 2), 4, dtype=torch.int32)
out = {"empty": list(mk.moe_forward(torch.zeros(0, 8), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2), None,
                                    None, q, None, None, 8, 16, 4).shape)}
for lut_width in (2, 9):
    try:
        mk.moe_forward(torch.zeros(1, 8), torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2), None, None, q, None,
                       None, 8, 16, 4, lut_width=lut_width)
        out[f"lut{lut_width}"] = "accepted"
    except ValueError as e:
        out[f"lut{lut_width}"] = str(e)
print(json.dumps(out))
"""


def test_moe_forward_refuses_widths_it_has_no_body_for_and_takes_no_tokens():
    """lut_width outside 3..8 is a ValueError before any launch (9 failed inside the split sizing, one below the
    widest block read out of shared memory's bounds); zero tokens give zero rows (a ZeroDivisionError before)."""
    res = run_child_json(ARGS_CHILD, timeout=300, NUMBA_ENABLE_CUDASIM="1")
    assert res["empty"] == [0, 8]
    assert "lut_width" in res["lut2"] and "lut_width" in res["lut9"], res



SPLIT_CHILD = r"""
import json
from pagedweight.cuda import moe_kernels as mk
out = {}
for cls in sorted(mk.SPLIT_SIZING):
    for W in (1, 5, 44, 64, 448):  # plane words of K (Qwen1.5's down 44, gate_up 64; Mixtral's down 448)
        for T in (1, 4, 7, 8, 32):  # the same slots and row tiles (a Qwen1.5 gate_up of ~30 routed experts)
            wps = mk._words_per_split(W, 44, 30, cls, T)
            out[f"{cls}/{W}/{T}"] = [wps, -(-W // wps)]
print(json.dumps(out))
"""


def test_split_sizing_covers_k_and_widens_mixed_layers_from_eight_tokens():
    """Every K split is whole sub-chunks (WS words), the splits cover K and none is empty; at the same slots and row
    tiles, LUT class 7 (the mixed layers of a release) cuts K finer from SPLIT_MANY_TOKENS tokens on (s46: 3-10 %
    faster at T 8 / 32 on an H100), and the narrow and 8-bit classes do not depend on T."""
    res = run_child_json(SPLIT_CHILD, timeout=300, NUMBA_ENABLE_CUDASIM="1")
    for key, (wps, splits) in res.items():
        W = int(key.split("/")[1])
        assert wps % 4 == 0 and splits * wps >= W and (splits - 1) * wps < W, key
    assert res["7/64/8"][1] > res["7/64/7"][1] and res["7/448/32"][1] > res["7/448/4"][1]
    assert res["7/64/1"] == res["7/64/4"] == res["7/64/7"] and res["7/64/8"] == res["7/64/32"]
    for cls in (4, 8):
        for W in (1, 5, 44, 64, 448):
            assert len({tuple(res[f"{cls}/{W}/{T}"]) for T in (1, 4, 7, 8, 32)}) == 1, (cls, W)


def test_prefill_warm_up_runs_every_bucketed_group_shape() -> None:
    """`warm_prefill_gemms` runs both projections' GEMM at every (experts, bucketed width) a prefill call of up to
    the buffers' tokens can pad a group to (groups of 7 as on Qwen1.5's shape, 60 experts, top-4), through the
    buffers' regions, and gives the buffers back; every group of 30 random layouts with a bucketed width is one of
    them. Shapes only (the GEMMs are recorded, not run: the host-side plan is what is checked here)."""
    from unittest import mock

    import numpy as np
    import torch

    import pagedweight.cuda.moe_kernels as mk
    import pagedweight.cuda.prefill as pf
    from pagedweight.models.layers import expert_rows, row_bucket

    D, F, E, k, T = 64, 32, 60, 4, 1024
    seen: list[tuple[int, int, int, int]] = []

    def record(a, b, offs, out=None):
        assert out is not None and out.shape == (*a.shape[:2], b.shape[2]) and b.shape[:2] == (a.shape[0], a.shape[2])
        seen.append((*a.shape[:2], *b.shape[1:]))

    buffers = pf.PrefillBuffers(T)
    with mock.patch.object(pf, "_grouped_mm", record), \
            mock.patch.object(pf, "PREFILL_SCRATCH_BYTES", 7 * 2 * sum(pf._slot_elems(D, F))):
        assert pf.prefill_group(D, F) == 7
        shapes = pf.warm_prefill_gemms(buffers, D, F, E, k, torch.float32, torch.device("cpu"))
    assert buffers.data is None and len(seen) == 2 * shapes
    warmed = {(n, w) for n, w, K, N in seen if (K, N) == (D, 2 * F)}
    assert {(n, w) for n, w, K, N in seen if (K, N) == (F, D)} == warmed and len(warmed) == shapes
    buckets = np.unique(row_bucket(np.arange(1, T + 1)))
    assert shapes == sum(1 for n in range(1, 8) for w in buckets if n * w <= (1 + pf.PAD_SLACK) * T * k)
    rng = np.random.default_rng(1)
    for _ in range(30):
        t = int(rng.integers(mk.DECODE_MAX_T + 1, T + 1))
        popularity = rng.dirichlet(np.full(E, 0.3))
        ids = np.stack([rng.choice(E, k, replace=False, p=popularity) for _ in range(t)])
        plan = expert_rows(ids, E, 7, pad=True, routed_only=True, slack=pf.PAD_SLACK, bucket=True)
        for _, n, _, _, width in plan.groups:
            assert row_bucket(np.array([width]))[0] != width or (n, width) in warmed, (t, n, width)
