"""The Numba MoE kernels under the CUDA simulator (tiny sizes) against the float32 torch twin.

The simulator must be chosen before numba.cuda is first imported, so the checks run in a child process with
NUMBA_ENABLE_CUDASIM=1 and the rest of the test session keeps the real CUDA target.
"""
from __future__ import annotations

import textwrap

import pytest

from helpers import run_child_json

CHILD = textwrap.dedent(r"""
    import json, sys
    import torch
    torch.set_num_threads(1)
    from pagedweight.cuda.moe_kernels import moe_forward
    from pagedweight.cuda.reference import block_weight, moe_forward_reference
    from pagedweight.cuda.synthetic import build_synthetic_moe

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    results = {}
    # E=5 experts, D=80 (3 words, last one padded), F=40 (2 words): partial words and rows past N are covered.
    moe = build_synthetic_moe(E=5, D=80, F=40, P=6, seed_bits=3, seed=1)
    g = torch.Generator().manual_seed(2)
    # T=65 takes the prefill path (dequantize kernel + matmul); the others the fused decode kernels
    for case, (T, k, dtype) in enumerate([(1, 2, torch.float16), (3, 2, torch.bfloat16), (6, 3, torch.float16),
                                          (65, 2, torch.bfloat16)]):
        q = torch.randint(3, 7, (moe.E, 2), generator=g)  # random mixed widths, gate_up and down differ
        qd, po, lo = moe.tables(q)
        hidden = torch.randn(T, moe.D, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(moe.E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
        w = torch.rand(T, k, generator=g)
        w = w / w.sum(1, keepdim=True)
        args = (hidden, ids, w, moe.pool_words, moe.pool_halves, qd, po, lo, moe.D, moe.F, moe.P)
        out = moe_forward(*args)
        ref = moe_forward_reference(*args)
        # independent float32 check of the twin itself: dense weights, plain loops over (token, slot)
        dense = torch.zeros(T, moe.D)
        for t in range(T):
            for j in range(k):
                e = int(ids[t, j])
                wg = block_weight(moe.pool_words, moe.pool_halves, int(q[e, 0]), po[e, 0], int(lo[e, 0]), 2 * moe.F, moe.D)
                wd = block_weight(moe.pool_words, moe.pool_halves, int(q[e, 1]), po[e, 1], int(lo[e, 1]), moe.D, moe.F)
                hh = wg @ hidden[t].float()
                dense[t] += w[t, j] * (wd @ (torch.nn.functional.silu(hh[:moe.F]) * hh[moe.F:]))
        results[f"case{case}"] = dict(T=T, k=k, dtype=str(dtype), dtype_ok=out.dtype == dtype,
                                      shape_ok=tuple(out.shape) == (T, moe.D), finite=bool(torch.isfinite(out).all()),
                                      rel_kernel=rel(out, dense), rel_twin=rel(ref, dense))
    json.dump(results, sys.stdout)
""")


@pytest.fixture(scope="module")
def sim_results() -> dict:
    return run_child_json(CHILD, timeout=1200, NUMBA_ENABLE_CUDASIM="1")


@pytest.mark.parametrize("case", ["case0", "case1", "case2", "case3"])
def test_moe_forward_matches_float32_reference(sim_results: dict, case: str) -> None:
    r = sim_results[case]
    assert r["dtype_ok"] and r["shape_ok"] and r["finite"], r
    assert r["rel_twin"] <= 1e-2, r
    assert r["rel_kernel"] <= 1e-2, r
