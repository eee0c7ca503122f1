"""Shared plumbing for benchmark scripts: one JSON result file per run (DESIGN.md §9)."""
from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine_name() -> str:
    """GPU name when a CUDA device is visible, else `cpu-<cores>c`."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return f"cpu-{os.cpu_count()}c"


@functools.cache
def _run_digest() -> str:
    """This checkout's source_digest, read once (at the first result written), like git_rev."""
    return source_digest()


@functools.cache
def git_rev() -> str:
    """Revision of the tree that ran, read once (at the first result written, before this run's own files could
    make it look changed; a commit made during a long run does not rename the code that ran), "-dirty" when files
    outside benchmarks/results/ differ from it. The GPU box gets a copy without .git, so GIT_REV may be passed in."""
    if os.environ.get("GIT_REV"):
        return os.environ["GIT_REV"]
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=here,
                             check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", ":/", ":(exclude,top)benchmarks/results"],
                               capture_output=True, text=True, cwd=here).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


SOURCE_DIRS = ("pagedweight", "cuda", "actors", "benchmarks")  # the code a benchmark runs (tests/ and scripts do not)


def source_digest(root: str | os.PathLike | None = None) -> str:
    """First 16 hex digits of the sha256 of every `*.py` under SOURCE_DIRS, by path relative to `root` (default:
    this checkout), symlinked folders not followed (the GPU box links cuda/ and actors/ into pagedweight/). Names the
    code that ran from its content: GIT_REV is passed in by hand and can be wrong (session 66's A/B files read one
    revision for both arms). `python -m benchmarks.common digest [REV]` gives a commit's, to check a file against."""
    root = Path(root) if root is not None else Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    files = []
    for top in SOURCE_DIRS:
        for folder, dirs, names in os.walk(root / top):  # followlinks=False
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            files += [Path(folder, n) for n in names if n.endswith(".py")]
    for f in sorted(files, key=lambda f: f.relative_to(root).as_posix()):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def rev_digest(rev: str, repo: str | os.PathLike = ".") -> str:
    """source_digest of commit `rev` of the git checkout `repo` (its tree exported with `git archive`)."""
    with tempfile.TemporaryDirectory() as tmp:
        tar = subprocess.run(["git", "archive", "--format=tar", rev, "--", *SOURCE_DIRS], cwd=repo,
                             capture_output=True, check=True).stdout
        tarfile.open(fileobj=io.BytesIO(tar)).extractall(tmp, filter="data")
        return source_digest(tmp)


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def package_versions() -> dict[str, str | None]:
    """Python's and the installed distributions' versions that a measurement depends on (None: not installed),
    read from package metadata: nothing is imported."""
    from importlib import metadata

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {"python": sys.version.split()[0],
            **{name: version(name) for name in ("torch", "numba", "numba-cuda", "numpy", "ray")}}


def host_loop_ms() -> float:
    """Wall ms of a fixed pure-Python loop (measured): an index of the host's speed when a result is written. Why: on
    one H100 machine, processes of the same code ran their host-bound steps at two speeds (eager decode steps ~25 ms
    in some, 39-44 in others; h100-nvidia-h100-80gb-hbm3-20261206-s54-calls.log), so arms compare only at like
    speed. Best of three, ~5-15 ms."""
    best = float("inf")
    for _ in range(3):
        t0, acc = time.perf_counter(), 0
        for i in range(100_000):
            acc += i & 7
        best = min(best, time.perf_counter() - t0)
    return round(best * 1e3, 3)


# the same index when this module was imported (the benchmark process's start): with the one at the write it shows
# whether the host's speed moved during the run (session 56, call 1: processes of one machine wrote 3.6-8.2 ms)
HOST_LOOP_MS_AT_START = host_loop_ms()


def write_result(benchmark: str, rows: list[dict], command: str | None = None, ceilings: dict | None = None,
                 out_dir: str | os.PathLike | None = None, extra: dict | None = None, label: str | None = None) -> Path:
    """Write `<benchmark>-<machine>-<YYYYMMDD>[-<label>].json` with the fields DESIGN.md §9 asks for; returns its
    path. `label` tells apart variants of one benchmark measured the same day (e.g. a compile option).

    `out_dir` defaults to $OUT when set (the GPU box returns only that folder), else benchmarks/results/.
    """
    machine = machine_name()
    now = _dt.datetime.now(_dt.timezone.utc)
    record = {
        "benchmark": benchmark,
        "machine": machine,
        "git_rev": git_rev(),
        "source_digest": _run_digest(),
        "date": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": command or " ".join([Path(sys.executable).name] + sys.argv),
        "versions": package_versions(),
        "host_loop_ms": host_loop_ms(),
        "host_loop_ms_at_start": HOST_LOOP_MS_AT_START,
        "ceilings": ceilings or {},
        "rows": rows,
    }
    if extra:
        record.update(extra)
    target = Path(out_dir or os.environ.get("OUT") or RESULTS_DIR)
    target.mkdir(parents=True, exist_ok=True)
    path = target / f"{benchmark}-{_slug(machine)}-{now:%Y%m%d}{'-' + _slug(label) if label else ''}.json"
    tmp = path.with_suffix(".json.tmp")  # a run killed mid-write leaves the previous complete file
    tmp.write_text(result_json(record) + "\n")
    os.replace(tmp, path)
    return path


COMPACT_OVER = 100_000  # characters of the indented form past which a result is written without any whitespace


def result_json(record) -> str:
    """`record` as JSON indented one space a level, except that a list of numbers, strings or nulls stays on one
    line: a step trace's row is one line, not one per value (a traced kv_pressure result 0.6 MB instead of 1.4; what
    a GPU call carries is limited). Past COMPACT_OVER characters, one line without spaces (about half the size:
    every tracked file travels to the GPU machine, 64 MiB in all; `python -m json.tool FILE` indents it again).
    Keys become strings as json.dumps makes them."""
    def fmt(obj, level: int) -> str:
        if isinstance(obj, list) and not any(isinstance(x, (list, dict)) for x in obj):
            return json.dumps(obj)
        pad = " " * (level + 1)
        if isinstance(obj, dict) and obj:
            body = ",\n".join(f"{pad}{json.dumps(k)}: {fmt(v, level + 1)}" for k, v in obj.items())
            return "{\n" + body + "\n" + " " * level + "}"
        if isinstance(obj, list):
            return "[\n" + ",\n".join(pad + fmt(v, level + 1) for v in obj) + "\n" + " " * level + "]"
        return json.dumps(obj)

    compact = json.dumps(record, separators=(",", ":"))
    if len(compact) > COMPACT_OVER:  # the indented form is longer still: not built (a traced run saves every row)
        return compact
    text = fmt(json.loads(compact), 0)
    return text if len(text) <= COMPACT_OVER else compact


@contextlib.contextmanager
def local_serve(port: int) -> Iterator[str]:
    """A local Ray cluster with Serve's HTTP proxy on 127.0.0.1:`port` for the CPU benchmarks that serve the bundled
    model over HTTP; yields its URL. On exit Serve, the node's page store (its /dev/shm planes) and Ray go."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    from pagedweight.actors.page_store_actor import page_store_for_node

    ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, logging_level="WARNING",
             log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.get(page_store_for_node().destroy.remote())
        ray.shutdown()


def old_functions(path: str, names: list[str], namespace: dict) -> dict:
    """`namespace` with the top-level functions or classes `names` of an older copy of a module (an A/B benchmark's
    old arm, e.g. `git show REV:path > FILE`) defined over it, and the old file's other functions that the new module
    no longer has (helpers they call) and its constants (upper-case names assigned at the top): they see the new
    module's other names. Raises SystemExit when the file lacks one of `names`."""
    import ast

    ns, found = dict(namespace), set()
    for node in ast.parse(Path(path).read_text()).body:
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id.isupper() for t in node.targets):
            exec(compile(ast.Module([node], []), path, "exec"), ns)
        elif isinstance(node, ast.FunctionDef) and node.name not in namespace or \
                isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names:
            exec(compile(ast.Module([node], []), path, "exec"), ns)
            found.add(node.name)
    if missing := set(names) - found:
        raise SystemExit(f"{path} defines no {sorted(missing)}")
    return ns


def failed_row(exc: BaseException, **keys) -> dict:
    """Row for a configuration that raised: logged with its traceback, then the traceback's frames are cleared,
    since they hold that configuration's engine (its whole memory pool) and would inflate the next one's peak."""
    from loguru import logger

    logger.opt(exception=exc).error("{} failed", keys)
    traceback.clear_frames(exc.__traceback__)
    return {**keys, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.common digest [REV]`: the source_digest of REV (default: the working tree), the value a
    result file's `source_digest` has when that code ran."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m benchmarks.common")
    p.add_argument("command", choices=["digest"])
    p.add_argument("rev", nargs="?", default=None, help="a commit of this checkout (default: the working tree)")
    args = p.parse_args(argv)
    root = Path(__file__).resolve().parent.parent
    print(rev_digest(args.rev, root) if args.rev else source_digest(root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
