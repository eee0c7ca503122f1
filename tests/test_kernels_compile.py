"""The real Numba CUDA kernels type-check and compile to sm_90 PTX on a machine without a GPU (CI).

Signatures are not written by hand: a child process runs the host launcher `moe_forward` (a decode and a prefill
call) with the kernels replaced by recorders, so the argument types are exactly the ones the launcher builds.
Under `launcher.SIMULATOR = True` the launcher's `_dev` hands out numpy views instead of device arrays; `numba.typeof`
gives the same `Array(dtype, ndim, layout)` for both, and Python ints are int64 either way.
Needs NVRTC (the `nvidia-cuda-nvrtc` wheel of the `test` extra) and libnvvm (a CUDA toolkit or `nvidia-nvvm`).
The child keeps the launcher patch, the device patch and numba state out of this pytest process.
"""
from __future__ import annotations

import re
import textwrap

import pytest

from helpers import KERNEL_RECORDER, child_fixture

KERNELS = ("_route_kernel", "_gemv_kernel", "_gemv_t1_kernel", "_gemv_t1_narrow_kernel", "_gemv_t4_narrow_kernel",
           "_dequant_kernel")

CHILD = textwrap.dedent(r"""
    import json, re, sys, types
    from unittest import mock
    import numba, torch
    torch.set_num_threads(1)
    from pagedweight.cuda._compat import cuda  # hides the repo's cuda/ folder from NVIDIA's `cuda` package
    import numba.cuda.dispatcher as dispatcher
    from pagedweight.cuda import launcher as lm
    from pagedweight.cuda import moe_kernels as mk
    from pagedweight.cuda.synthetic import build_synthetic_moe

    KERNELS, COMPILE = %(kernels)r, %(compile)r
    sigs = {name: [] for name in KERNELS}

    %(recorder)s

    moe = build_synthetic_moe(E=5, D=80, F=40, P=6, seed_bits=3, seed=1)
    g = torch.Generator().manual_seed(0)
    with mock.patch.multiple(mk, **{name: Recorder(name) for name in KERNELS}), \
            mock.patch.object(lm, "SIMULATOR", True):  # `launch` and `_PreparedLaunch` through Numba
        # decode (T=3 at widths 3..6 and at the narrow class's 3..4, T=1 likewise), then prefill
        for T, dtype, widest in ((3, torch.float16, 6), (3, torch.float16, 4), (1, torch.float16, 6),
                                 (1, torch.float16, 4), (mk.DECODE_MAX_T + 1, torch.bfloat16, 6)):
            qd, po, lo = moe.tables(torch.randint(3, widest + 1, (moe.E, 2), generator=g))
            ids = torch.stack([torch.randperm(moe.E, generator=g)[:2] for _ in range(T)]).to(torch.int32)
            mk.moe_forward(torch.randn(T, moe.D, generator=g).to(dtype), ids, torch.rand(T, 2, generator=g),
                           moe.pool_words, moe.pool_halves, qd, po, lo, moe.D, moe.F, moe.P, widest)

    def compile_ptx(fn, sig):
        ptx, resty = cuda.compile_ptx(fn, sig, cc=(9, 0))
        return dict(target=re.findall(r"^\.target\s+(\S+)", ptx, re.M), resty=str(resty),
                    entries=re.findall(r"^\.visible \.entry\s+(\w+)\(", ptx, re.M))

    # Kernels that call device functions (_gemv_kernel -> _dispatch -> _work_*) compile those callees through
    # Dispatcher.compile_device, which asks the current device for its compute capability and so needs a driver
    # even under compile_ptx. On a GPU-less machine answer sm_90 there, the same target as compile_ptx's cc.
    sm90 = types.SimpleNamespace(compute_capability=(9, 0))
    results = {}
    with mock.patch.object(dispatcher, "get_current_device", lambda: sm90):
        for name in COMPILE:
            results[name] = [dict(sig=str(s), **compile_ptx(getattr(mk, name).py_func, s)) for s in sigs[name]]
        if "_route_kernel" in COMPILE:  # negative control: float topk ids cannot index the shared counters
            bad = list(sigs["_route_kernel"][0])
            bad[0] = numba.float32[:, ::1]
            try:
                compile_ptx(mk._route_kernel.py_func, tuple(bad))
                results["negative_control"] = "compiled"
            except numba.core.errors.TypingError as err:
                results["negative_control"] = "TypingError: " + str(err).splitlines()[0]
    json.dump(results, sys.stdout)
""")
# two children side by side (CI has two cores): the general GEMV, whose every width and token tile takes most of the
# compile time, and the rest
GROUPS = (("_gemv_kernel",), tuple(k for k in KERNELS if k != "_gemv_kernel"))


compiled = child_fixture(__name__, "compiled", [CHILD % {"kernels": KERNELS, "compile": group,
                                                          "recorder": KERNEL_RECORDER} for group in GROUPS],
                         timeout=600, NUMBA_ENABLE_CUDASIM="0")


@pytest.mark.parametrize("name", KERNELS)
def test_kernel_compiles_to_sm90_ptx(compiled: dict, name: str) -> None:
    runs = compiled[name]
    assert runs, f"{name}: moe_forward never launched it"
    for r in runs:  # one per distinct signature the launcher used
        assert r["target"] == ["sm_90"], r
        assert r["resty"] == "none", r  # a kernel returns nothing
        # exactly one kernel entry, the mangled name of this kernel of this module (Itanium: <len><name>)
        assert len(r["entries"]) == 1, r
        assert re.search(rf"11moe_kernels{len(name)}{name}B", r["entries"][0]), r


def test_wrong_signature_fails_to_compile(compiled: dict) -> None:
    assert compiled["negative_control"].startswith("TypingError"), compiled["negative_control"]
