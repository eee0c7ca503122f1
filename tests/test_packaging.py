"""The folder layout maps into one `pagedweight` package, in editable and in regular installs.

`cuda/` and `actors/` are top-level folders imported as `pagedweight.cuda` / `pagedweight.actors`; no importable
top-level `cuda` may appear (it would shadow NVIDIA's cuda-python that numba-cuda imports).
"""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ["pagedweight", "pagedweight.models", "pagedweight.cuda", "pagedweight.actors", "pagedweight.actors.jobs"]
CHECK = (
    "import importlib, importlib.util, sys\n"
    f"for name in {SUBPACKAGES!r}:\n"
    "    m = importlib.import_module(name)\n"
    "    print(name, m.__file__)\n"
    "spec = importlib.util.find_spec('cuda')\n"
    "print('top-level cuda:', spec.origin if spec and spec.origin else spec and list(spec.submodule_search_locations))\n"
)


def _run(args: list[str], env: dict | None = None) -> str:
    out = subprocess.run(args, capture_output=True, text=True, env=env, cwd="/")
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _assert_layout(stdout: str, cuda_dir: Path, actors_dir: Path, models_dir: Path) -> None:
    files = dict(line.split(" ", 1) for line in stdout.splitlines() if line.startswith("pagedweight"))
    assert set(files) == set(SUBPACKAGES)
    assert Path(files["pagedweight.cuda"]).parent == cuda_dir
    assert Path(files["pagedweight.actors"]).parent == actors_dir
    assert Path(files["pagedweight.models"]).parent == models_dir
    # A `cuda` found must be NVIDIA's (site-packages), never our folder.
    top = [line for line in stdout.splitlines() if line.startswith("top-level cuda:")][0]
    assert str(ROOT / "cuda") not in top


def test_editable_install_maps_folders():
    """The dev/CI venv installs the project editable (Makefile): imports resolve into the source folders."""
    _assert_layout(_run([sys.executable, "-c", CHECK]), ROOT / "cuda", ROOT / "actors", ROOT / "pagedweight" / "models")


def test_regular_wheel_maps_folders(tmp_path):
    """A built wheel holds pagedweight/cuda and pagedweight/actors and nothing top-level but pagedweight."""
    wheel_dir = tmp_path / "wheel"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheel_dir), str(ROOT)])
    (wheel,) = wheel_dir.glob("pagedweight-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"pagedweight"}, tops
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # -S: no site-packages .pth files, so the editable finder cannot answer; deps come from PYTHONPATH.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), sysconfig.get_paths()["purelib"],
                                                      sysconfig.get_paths()["platlib"]]))
    pkg = site / "pagedweight"
    _assert_layout(_run([sys.executable, "-S", "-c", CHECK], env=env), pkg / "cuda", pkg / "actors", pkg / "models")
    # the calibration and evaluation text travel with it (conversion and the evaluation job read them)
    data = _run([sys.executable, "-S", "-c", "from pagedweight.corpus import DATA_DIR; "
                 "from pagedweight.actors.jobs.evaluate import DEFAULT_DATA; print(DATA_DIR); print(DEFAULT_DATA)"],
                env=env).split()
    assert data == [str(pkg / "data"), str(pkg / "data" / "eval.txt")]
    assert (pkg / "data" / "calib.txt").read_bytes() == (ROOT / "data" / "calib.txt").read_bytes()


@pytest.mark.parametrize("folder", ["cuda", "actors"])
def test_no_top_level_package_named_like_folder(folder):
    out = _run([sys.executable, "-c", f"import importlib.util as u; s = u.find_spec({folder!r}); "
                "print(s.origin if s and s.origin else (list(s.submodule_search_locations) if s else None))"])
    assert str(ROOT / folder) not in out
