"""Shared fixtures: ONE local Ray cluster and ONE Serve app per test session.

Starting Ray costs ~3 s and the Serve app ~5 s on a 2-core box, so every Ray test file shares these
session-scoped fixtures instead of starting its own. The cluster runs without the dashboard; the
per-node metrics agent still starts and exports Prometheus text on `metrics_port`.
"""
from __future__ import annotations

import os
import random
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = Path(os.environ.get("PAGEDWEIGHT_TEST_MODEL", ROOT / "models" / "pw-tiny-moe"))
API_KEY = "pw-test-key"
# A CPU engine takes half a CPU so the serve replica, an engine actor and a job's engine fit on 2 CPUs.
ENGINE_CPUS = 0.5
ENGINE_OPTIONS = {"kv_cache_bytes": 16 << 20, "max_num_seqs": 32}


def free_port() -> int:
    """A port free on every interface, below the kernel's ephemeral range (32768-60999 on Linux): a port from bind(0)
    is free again once returned and the next bind(0) of any process, e.g. one of Ray's own, may take it before the
    metrics agent binds it. The agent then exits, the raylet with it, and every Ray test of the session errors."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


@dataclass
class RayCluster:
    address: str
    metrics_port: int


@dataclass
class ServeApp:
    base_url: str  # http://127.0.0.1:PORT
    model: str  # the served model name
    api_key: str


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the child runs (helpers.child_fixture) that the selected tests use, in the order of those tests, one
    run at a time on a background thread: they use the core that single-threaded tests leave idle."""
    from helpers import AHEAD

    runs = []
    for item in session.items:
        for name in getattr(item, "fixturenames", ()):
            run = AHEAD.get((getattr(getattr(item, "module", None), "__name__", ""), name))
            if run is not None and run not in runs:
                runs.append(run)

    def start_in_turn() -> None:
        for run in runs:
            run.start()
            run.wait()

    if runs:
        threading.Thread(target=start_in_turn, name="child-runs", daemon=True).start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    from helpers import AHEAD

    for run in AHEAD.values():  # runs whose tests failed before waiting for them, or were interrupted
        run.kill()


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The bundled HF model directory."""
    if not (MODEL_DIR / "config.json").is_file():
        pytest.fail(f"bundled model missing: {MODEL_DIR} (set PAGEDWEIGHT_TEST_MODEL to another model dir)")
    return MODEL_DIR


@pytest.fixture(scope="session")
def ap_model_dir(model_dir, tmp_path_factory) -> Path:
    """The bundled model converted once per session to an any-precision checkpoint (short calibration),
    so the Ray tests serve the paged runtime: page store, page table, planner. Same directory name as
    the HF model, so it is served under the same model name."""
    import torch

    from pagedweight.convert import convert
    from pagedweight.corpus import DATA_DIR

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("ap") / model_dir.name
    convert(model_dir, out, DATA_DIR / "calib.txt", device="cpu", num_seqs=8, seq_len=128)
    return out


@pytest.fixture(scope="module")
def ap_dir(tmp_path_factory) -> Path:
    """The bundled model converted to an AP checkpoint for the engine tests (s=3, P=8; activation sensitivity keeps
    it quick). Module scope: a module's tests may write page stores and caches beside it."""
    from pagedweight.convert import convert
    from pagedweight.corpus import DATA_DIR

    out = tmp_path_factory.mktemp("ap")
    convert(ROOT / "models" / "pw-tiny-moe", out, DATA_DIR / "calib.txt", seed_bits=3, parent_bits=8,
            sensitivity="activation", num_seqs=4, seq_len=64, device="cpu")
    return out


@pytest.fixture(scope="session")
def ray_cluster():
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by every worker process
    import ray

    port = free_port()
    ctx = ray.init(address="local", num_cpus=2, include_dashboard=False, _metrics_export_port=port,
                   logging_level="WARNING", log_to_driver=False)
    yield RayCluster(ctx.address_info["gcs_address"], port)
    from ray import serve

    from pagedweight.actors.page_store_actor import NAMESPACE, page_store_name

    serve.shutdown()
    try:  # remove the /dev/shm stores the session wrote
        store = ray.get_actor(page_store_name(ray.get_runtime_context().get_node_id()), namespace=NAMESPACE)
        ray.get(store.destroy.remote())
    except ValueError:  # no engine asked for a page store
        pass
    ray.shutdown()


@pytest.fixture(scope="session")
def serve_app(ray_cluster, ap_model_dir) -> ServeApp:
    from ray import serve

    from pagedweight.actors.openai_app import AppArgs, build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = AppArgs(model_dir=str(ap_model_dir), num_replicas=1, api_key=API_KEY, engine_num_cpus=ENGINE_CPUS,
                   engine_options=ENGINE_OPTIONS)
    serve.run(build_app(args), name="pagedweight", route_prefix="/")
    return ServeApp(f"http://127.0.0.1:{port}", ap_model_dir.name, API_KEY)


@pytest.fixture
def bars(monkeypatch) -> list:
    """Every progress bar made (pagedweight.progress), recorded by a stand-in for tqdm: total, keyword arguments,
    updates, closed."""
    from pagedweight import progress

    made = []

    class Bar:
        def __init__(self, **kw):
            self.kw, self.total, self.updates, self.disable, self.closed = kw, kw["total"], [], False, False
            made.append(self)

        def update(self, n: int = 1) -> None:
            self.updates.append(n)

        def close(self) -> None:
            self.closed = True

    monkeypatch.setattr(progress, "tqdm", Bar)
    return made


@pytest.fixture
def messages():
    """The loguru messages logged while the test runs."""
    from loguru import logger

    got: list[str] = []
    sink = logger.add(lambda m: got.append(m.record["message"]), level="INFO", format="{message}")
    yield got
    logger.remove(sink)
