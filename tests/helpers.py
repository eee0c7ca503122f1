"""Helpers shared by test files (tests/ is on sys.path under pytest's default import mode)."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_child_json(code: str, timeout: float, **env: str) -> dict:
    """Run `code` in a fresh interpreter (so env such as NUMBA_ENABLE_CUDASIM cannot leak into this process) and
    return the JSON object it prints on its last line."""
    return run_children_json([code], timeout, **env)


def run_children_json(codes: list[str], timeout: float, **env: str) -> dict:
    """`run_child_json` for several single-threaded children at once, their JSON objects merged (keys must not
    clash). The simulator and compile children are most of the suite's time; CI has two cores, and pytest waits."""
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", **env),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for code in codes]
    merged: dict = {}
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)  # each waits in turn: the later ones ran meanwhile
            assert proc.returncode == 0, err[-4000:]
            part = json.loads(out.strip().splitlines()[-1])
            assert not set(part) & set(merged), sorted(set(part) & set(merged))
            merged.update(part)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return merged


# Pasted into a child's code (`%(recorder)s`): a stand-in for a Numba kernel that records, per kernel name, each
# distinct argument-type signature of `kernel[grid, block, stream, shmem](*args)` in the child's `sigs` and launches
# nothing. The compile tests then compile exactly the signatures the host launcher builds.
KERNEL_RECORDER = textwrap.dedent("""
    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, config):
            def launch(*args):
                sig = tuple(numba.typeof(a) for a in args)
                if sig not in sigs[self.name]:
                    sigs[self.name].append(sig)
            return launch
""")


# Pasted at the end of a child's code (`%(compile)s`) once `sigs` holds what KERNEL_RECORDER recorded for the kernels of
# module `kernels`: compiles each signature to sm_90 PTX (no GPU needed) and prints, per kernel, each compile's return
# type, target and entry names.
COMPILE_RECORDED = textwrap.dedent(r"""
    import json, re, sys, types
    from unittest import mock
    import numba.cuda.dispatcher as dispatcher
    from pagedweight.cuda._compat import cuda

    sm90 = types.SimpleNamespace(compute_capability=(9, 0))
    out = {}
    with mock.patch.object(dispatcher, "get_current_device", lambda: sm90):
        for name, found in sigs.items():
            out[name] = []
            for sig in found:
                ptx, resty = cuda.compile_ptx(getattr(kernels, name).py_func, sig, cc=(9, 0))
                out[name].append(dict(sig=str(sig), resty=str(resty),
                                      target=re.findall(r"^\.target\s+(\S+)", ptx, re.M),
                                      entries=re.findall(r"^\.visible \.entry\s+(\w+)\(", ptx, re.M)))
    json.dump(out, sys.stdout)
""")


class Terminal(io.StringIO):
    """A stderr that says it is a terminal: tqdm (disable=None) draws its bar there."""

    def isatty(self) -> bool:
        return True


def budget_with(probe, kv_blocks: int) -> int:
    """The budget of an engine's widths (`probe`, an LLM), the mover's reserve and `kv_blocks` KV blocks."""
    return (probe.weights_outside_bytes + probe.stats()["resident_weight_bytes"]
            + probe.pool.bytes_of(probe.pool.reserve_pages) + kv_blocks * probe.kv.block_bytes)
