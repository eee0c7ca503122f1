"""Import `numba.cuda` safely; every kernel module imports it from here.

Three traps (GPU.md): numba-cuda 0.30.4 calls `np.row_stack`, gone in numpy 2.5, so alias it first; this
repository's `cuda/` folder (imported as `pagedweight.cuda`) shadows NVIDIA's `cuda` namespace package whenever
the repository root is on sys.path (`python -m pytest` from the root puts it there), and numba-cuda then refuses
to import. The root entry is hidden only while NVIDIA's package is imported; afterwards `sys.modules["cuda"]` is
NVIDIA's and later lookups never see the folder again. And that namespace package's `__file__` is None (Python
3.11), which breaks `inspect.getmodule` for the whole process (torch calls it: a CPU SDPA failed with TypeError after
this import), so the name is removed.
"""
from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path

import numpy as np

if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack  # numba-cuda#907

_REPO = Path(__file__).resolve().parent.parent


def _is_repo_root(entry: str) -> bool:
    try:
        return Path(entry or os.getcwd()).resolve() == _REPO
    except OSError:
        return False


def _import_nvidia_cuda() -> None:
    mod = sys.modules.get("cuda")
    if mod is not None and Path(getattr(mod, "__file__", None) or "/").resolve().parent != _REPO / "cuda":
        return
    sys.modules.pop("cuda", None)
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if not _is_repo_root(p)]
    try:
        importlib.import_module("cuda.bindings")
    finally:
        sys.path[:] = saved
    nvidia = sys.modules["cuda"]
    if getattr(nvidia, "__file__", 0) is None:  # a namespace package (Python 3.11): inspect.getmodule, which torch
        del nvidia.__file__  # calls, raises on such a module while it walks sys.modules; without the name it skips it


_import_nvidia_cuda()

from numba import cuda  # noqa: E402

SIMULATOR: bool = bool(int(os.environ.get("NUMBA_ENABLE_CUDASIM", "0") or 0))


def jit_variant(fn, name: str, constants: dict, **options):
    """`fn`'s code compiled as a kernel of its own `name` whose globals add `constants` (values the compiler must see
    as constants: local array sizes, unrolled bounds, the device function a dispatch calls): one source, kernels
    that differ in them. Numba names each one's cache files by `name` and stamps them with the file of `fn`'s code."""
    variant = types.FunctionType(fn.__code__, {**fn.__globals__, **constants}, name)
    variant.__qualname__ = name
    variant.__doc__ = fn.__doc__
    return cuda.jit(cache=True, **options)(variant)


__all__ = ["cuda", "SIMULATOR", "jit_variant"]
