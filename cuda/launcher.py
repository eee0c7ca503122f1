"""Kernel launches from torch tensors: straight through the driver (`launch`, `_PreparedLaunch`) on torch's current
stream, and Numba views of tensors (`_dev`) where Numba itself launches (the simulator, tests).

Apart from the kernels so that a change here leaves their modules, and so Numba's cache of their compiled code (keyed
by each source file's size and time), as they are: a GPU call that must compile them all spends minutes on it.
"""
from __future__ import annotations

import ctypes
import functools
import struct
import threading

import numpy as np
import torch

from ._compat import SIMULATOR, cuda

# Array-interface type of each tensor dtype the kernels take; uint32 travels as int32 (kernels reinterpret each word).
_TYPESTR = {torch.float32: "<f4", torch.float16: "<f2", torch.uint16: "<u2", torch.int32: "<i4",
            torch.uint32: "<i4", torch.int64: "<i8"}
VIEW_CACHE = 4096  # Numba views kept: the pool, 3 table rows per layer, and the per-call buffers the allocator reuses


def _dev(t: torch.Tensor):
    """Numba view of a tensor: zero-copy device array on the GPU, numpy view under the simulator.

    On the GPU the view is built from (address, shape, strides, dtype, device) alone and cached on exactly that key:
    cuda.as_cuda_array costs ~20-80 us per call (the array interface dict, a context lookup), a launch takes 7-16
    arrays, and most are the same pool and tables every call. A view holds no reference to the tensor, so a cached
    one can never keep freed memory alive, and a tensor reallocated elsewhere or reshaped gets another key."""
    if SIMULATOR:  # it copies each array in and back out whole, so only a contiguous one: a strided input goes as a
        # contiguous copy (outputs are always allocated contiguous: a strided one would lose its writes here)
        return (t.view(torch.int32) if t.dtype == torch.uint32 else t).detach().cpu().contiguous().numpy()
    return _device_view(t.data_ptr(), tuple(t.shape), None if t.is_contiguous() else t.stride(), _TYPESTR[t.dtype],
                        t.device.index)


@functools.lru_cache(maxsize=VIEW_CACHE)
def _device_view(ptr: int, shape: tuple, strides: tuple | None, typestr: str, device: int | None):
    """A view owning nothing: whatever tensor lives at `ptr` with this shape, strides and dtype, it describes it."""
    itemsize = int(typestr[2:])
    desc = dict(shape=shape, strides=None if strides is None else tuple(s * itemsize for s in strides),
                data=(ptr, False), typestr=typestr, version=3)
    return cuda.from_cuda_array_interface(desc, owner=None, sync=False)


class _PreparedLaunch:
    """One kernel's launch marshalled once and issued many times with one integer argument changed.

    Numba marshals every argument again on each launch: the dequantize kernel's 12 (7 arrays of ~8 parameters each)
    cost ~100 us of host time per launch, while a 7-expert launch runs ~63 us on the device (dq_ab-nvidia-h200-
    20261130-s17.json), so the prefill was bound by the host. Here the parameters are flattened once, straight from the
    tensors, into one int64 array (`kernel_params`: Numba's array ABI), and a launch sets the changed integer in place
    and calls cuLaunchKernel. The kernel is looked up once per argument signature (`_cufunc`). The simulator has no
    driver: it launches through Numba."""

    def __init__(self, dispatcher, block: int, shmem: int, args: tuple, var: int):
        self._dispatcher, self._block, self._shmem, self._var = dispatcher, block, shmem, var
        if SIMULATOR:
            self._args = [_dev(a) if isinstance(a, torch.Tensor) else a for a in args]
            return
        self._launch_kernel, self._ok = _driver()
        self._func = _cufunc(dispatcher, args)
        ints, self._slot = kernel_params(args, var)
        self._vals, self._params = _param_block(ints)
        self._stream = _current_stream()

    def __call__(self, grid: tuple[int, int, int], value: int) -> None:
        if SIMULATOR:
            self._args[self._var] = value
            self._dispatcher[grid, self._block, 0, self._shmem](*self._args)
            return
        self._vals[self._slot] = value
        err, = self._launch_kernel(self._func, *grid, self._block, 1, 1, self._shmem, self._stream,
                                   ctypes.addressof(self._params), 0)
        if err != self._ok:
            raise RuntimeError(f"cuLaunchKernel of {self._dispatcher.__name__}: {err}")


def launch(dispatcher, grid: int | tuple[int, ...], block: int, args: tuple, shmem: int = 0) -> None:
    """One launch of a kernel straight through the driver on torch's current stream (inside a CUDA graph capture as
    well): tensors and Python or numpy scalars as `kernel_params` flattens them, no Numba views and no marshalling.
    Numba's own launch (`kernel[grid, block, stream, shmem](...)`) costs ~0.1 ms of host time for a dozen arguments
    (`_PreparedLaunch`): ~290 launches made an eager decode step of the Qwen1.5 shape 40 ms of host work for 3.5 ms
    of kernels, and each CUDA graph capture as long (step_host-nvidia-h100-80gb-hbm3-20261206-s51-*.json).
    The arguments are walked once for both the parameters and the kernel's signature, and the stream is torch's raw
    handle: a prefill step makes ~145 of these launches besides the MoE's.
    The simulator launches through Numba (tensors must be contiguous there: `_dev` copies a strided one)."""
    grid = (grid,) if isinstance(grid, int) else grid
    if SIMULATOR:
        dispatcher[grid, block, 0, shmem](*[_dev(a) if isinstance(a, torch.Tensor) else a for a in args])
        return
    launch_kernel, ok = _driver()
    ints, key = _flatten(dispatcher, args)
    func = _CUFUNCS.get(key)
    if func is None:
        func = _cufunc(dispatcher, args)
    grid = (*grid, 1, 1)[:3]
    err, = launch_kernel(func, *grid, block, 1, 1, shmem, _current_stream(), ctypes.addressof(_launch_params(ints)), 0)
    if err != ok:
        raise RuntimeError(f"cuLaunchKernel of {dispatcher.__name__}: {err}")


def _current_stream() -> int:
    """Torch's current stream on the current device as a raw handle, without building a torch.cuda.Stream."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return torch.cuda.current_stream().cuda_stream if raw is None else raw(torch.cuda.current_device())


@functools.lru_cache(maxsize=1)
def _driver():
    """cuLaunchKernel and its success code from cuda.bindings.driver, as numba-cuda imports it (imported once: an
    import statement per launch costs host time)."""
    from numba.cuda.cudadrv.driver import binding

    return binding.cuLaunchKernel, binding.CUresult.CUDA_SUCCESS


def _param_block(ints: list[int]) -> tuple[ctypes.Array, ctypes.Array]:
    """The driver's kernelParams for flat int64 parameters: the values, and the array of their addresses (keep both
    alive until the launch returns). Every parameter is int64 here (arrays' fields, ints, a bool): the driver copies
    each parameter's own size from its address, little-endian, so a narrower one (the bool) reads the low bytes."""
    vals = (ctypes.c_int64 * len(ints))(*ints)
    base = ctypes.addressof(vals)
    return vals, (ctypes.c_void_p * len(ints))(*range(base, base + 8 * len(ints), 8))


_LAUNCH_PARAMS = threading.local()  # per thread: parameter count -> a `_param_block` that `launch` refills


def _launch_params(ints: list[int]) -> ctypes.Array:
    """kernelParams of `ints` for one launch, in a block kept per thread and parameter count: cuLaunchKernel copies
    the values when it is called (a captured launch too), so the next launch may overwrite them. Building a block
    took ~20 us of host time a launch, refilling one ~1.5 us (CPU, 40 parameters)."""
    blocks = _LAUNCH_PARAMS.__dict__.setdefault("blocks", {})
    block = blocks.get(len(ints))
    if block is None:
        block = blocks[len(ints)] = _param_block(ints)
    else:
        block[0][:] = ints
    return block[1]


def kernel_params(args: tuple, var: int = -1) -> tuple[list[int], int]:
    """The flat kernel parameters of `args` (tensors, Python ints, bools and floats, numpy float32s) as Numba passes
    them (numba-cuda 0.30.4, dispatcher._prepare_args; tests/test_kernels_sim.py compares the two on the GPU): an
    array is meminfo and parent (0, 0), size, itemsize, data address, shape, strides in bytes; a float its IEEE bits
    (float64 for a Python float, as Numba types it). Also the index of argument `var`."""
    ints: list[int] = []
    slot = -1
    for i, a in enumerate(args):
        if i == var:
            slot = len(ints)
        _flatten_one(a, ints)
    return ints, slot


def _flatten(dispatcher, args: tuple) -> tuple[list[int], tuple]:
    """`kernel_params(args)` and, from the same walk, the `_CUFUNCS` key of the kernel they call."""
    ints: list[int] = []
    key: list = [dispatcher]
    for a in args:
        _flatten_one(a, ints)
        key.append(_arg_key(dispatcher, a))
    return ints, tuple(key)


def _flatten_one(a, ints: list[int]) -> None:
    """Append one argument's parameters to `ints`."""
    if isinstance(a, torch.Tensor):
        size = a.element_size()
        ints += (0, 0, a.numel(), size, a.data_ptr(), *a.shape, *[s * size for s in a.stride()])
    elif isinstance(a, np.float32):
        ints.append(struct.unpack("<i", struct.pack("<f", a))[0])
    elif isinstance(a, float):
        ints.append(struct.unpack("<q", struct.pack("<d", a))[0])
    else:
        ints.append(int(a))


_CUFUNCS: dict[tuple, int] = {}  # (kernel, argument signature) -> CUfunction handle


def _cufunc(dispatcher, args: tuple) -> int:
    """The CUfunction of `dispatcher` specialised for args, compiled (or loaded from the cache) on first sight of the
    signature (`_arg_key` of each argument)."""
    key = (dispatcher, *(_arg_key(dispatcher, a) for a in args))
    func = _CUFUNCS.get(key)
    if func is None:
        sig = tuple(dispatcher.typeof_pyval(_dev(a) if isinstance(a, torch.Tensor) else a) for a in args)
        func = _CUFUNCS[key] = dispatcher.compile(sig)._codelibrary.get_cufunc().handle
    return func


def _arg_key(dispatcher, a) -> tuple | type:
    """What one argument decides of a kernel's specialisation: a tensor's dtype, rank, Numba layout and device, a
    scalar's type."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.dim(), "C" if a.is_contiguous() else _layout(dispatcher, a), a.device.index
    return type(a)


def _layout(dispatcher, t: torch.Tensor) -> str:
    """Numba's layout of a tensor's view: "C" when contiguous, else what Numba derives from the strides ("F" or "A"),
    which decides how the kernel computes addresses."""
    return "C" if t.is_contiguous() else dispatcher.typeof_pyval(_dev(t)).layout
