"""Helpers shared by test files (tests/ is on sys.path under pytest's default import mode)."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest

ROOT = Path(__file__).resolve().parents[1]


# Niceness of child interpreters: started ahead of the tests that need them (conftest), they take the core the
# single-threaded tests leave idle and yield it back to them
CHILD_NICE = 19


@dataclass(eq=False)  # a run is itself: conftest collects the runs the tests use by identity
class ChildRun:
    """Single-threaded child interpreters (so env such as NUMBA_ENABLE_CUDASIM cannot leak into this process) whose
    JSON objects, printed on their last lines, a test merges (keys must not clash).

    The simulator and compile children are most of the suite's time and CI has two cores: conftest starts the runs
    of the fixtures (`child_fixture`) that the selected tests use in the background, one run at a time, while earlier
    tests run. Output goes to files, not pipes, so a child that nobody reads yet never blocks on a full pipe."""

    codes: list[str]
    timeout: float  # seconds each child may take once a test waits for it
    env: dict[str, str]  # the children's whole environment, taken when the run is made (not when a thread starts it)
    procs: list[tuple[subprocess.Popen, IO[str], IO[str]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    ended: bool = False  # killed or read: never started again

    def start(self) -> None:
        with self.lock:
            if self.procs or self.ended:
                return
            for code in self.codes:
                out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
                proc = subprocess.Popen([sys.executable, "-c", f"import os\nos.nice({CHILD_NICE})\n{code}"], cwd=ROOT,
                                        env=self.env, stdout=out, stderr=err, text=True)
                self.procs.append((proc, out, err))

    def wait(self) -> None:
        """Until every child has exited (conftest's background runner: one run at a time)."""
        for proc, _, _ in self.procs:
            proc.wait()

    def result(self) -> dict:
        """The children's merged JSON objects; starts them first if they are not running yet."""
        self.start()
        merged: dict = {}
        try:
            for proc, out, err in self.procs:
                proc.wait(timeout=self.timeout)  # each waits in turn: the later ones ran meanwhile
                out.seek(0), err.seek(0)
                assert proc.returncode == 0, err.read()[-4000:]
                part = json.loads(out.read().strip().splitlines()[-1])
                assert not set(part) & set(merged), sorted(set(part) & set(merged))
                merged.update(part)
        finally:
            self.kill()
        return merged

    def kill(self) -> None:
        with self.lock:
            self.ended = True
            for proc, out, err in self.procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                out.close(), err.close()


def child_env(**env: str) -> dict[str, str]:
    """This process's environment with `env` and one thread per child (CI has two cores)."""
    return dict(os.environ, OMP_NUM_THREADS="1", **env)


# (test module, fixture name) -> the run that fixture returns; conftest starts those the selected tests use
AHEAD: dict[tuple[str, str], ChildRun] = {}


def child_fixture(module: str, name: str, codes: list[str], timeout: float, **env: str):
    """Module-scoped fixture `name` of test module `module`: the merged JSON of `codes` run as children, registered
    so that conftest starts them in the background before the first selected test that uses the fixture."""
    run = AHEAD[(module, name)] = ChildRun(codes, timeout, child_env(**env))

    def fixture() -> dict:
        return run.result()

    return pytest.fixture(scope="module", name=name)(fixture)


def run_child_json(code: str, timeout: float, **env: str) -> dict:
    """Run `code` in a fresh interpreter now and return the JSON object it prints on its last line."""
    return ChildRun([code], timeout, child_env(**env)).result()


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
