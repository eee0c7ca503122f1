"""Engine metrics reach Prometheus: scrape the node's metrics export port of the session cluster.

The session cluster runs without the dashboard; the per-node metrics agent still starts (it ships
with ray[default]) and serves Prometheus text on `_metrics_export_port`, so no extra process is
needed. Two sources are checked: a probe actor feeding EngineMetrics known stats snapshots (exact
values, counters accumulating across snapshots and an engine restart), and the live Serve engine
replica (values equal to its own stats(), latency histogram counting the requests just served).
"""
from __future__ import annotations

import re
import time
import urllib.request

import pytest
import ray

from pagedweight.actors.metrics import EngineMetrics

SNAPSHOTS = [
    {"kv_free_blocks": 40, "kv_total_blocks": 64, "resident_weight_bytes": 123456, "pages_in_flight": 3,
     "planner_step_ms": 0.25, "plan_staleness_steps": 2, "num_running": 5, "num_waiting": 1,
     "bytes_offloaded": 1000, "bytes_reloaded": 0, "offload_triggers": 1, "reload_triggers": 0, "preemptions": 0,
     "committed_width_hist": [[0, 0, 0, 2, 0, 0, 0, 0, 14], [0, 0, 0, 0, 4, 0, 0, 0, 12]], "seed_width": 3,
     "budget_bytes": 9000000, "device_reserved_bytes": 9500000, "device_peak_reserved_bytes": 9600000},
    {"kv_free_blocks": 60, "kv_total_blocks": 70, "resident_weight_bytes": 100000, "pages_in_flight": 0,
     "planner_step_ms": 0.5, "plan_staleness_steps": 0, "num_running": 0, "num_waiting": 0,
     "bytes_offloaded": 5000, "bytes_reloaded": 700, "offload_triggers": 3, "reload_triggers": 1, "preemptions": 2,
     "prefix_query_tokens": 300, "prefix_hit_tokens": 128, "kv_cached_blocks": 9, "kv_retained_blocks": 5,
     "kv_evicted_blocks": 4,
     "engine_steps": 50, "steps_in_flight": 12, "time_in_flight_s": 0.75,
     "gc_collections": [9, 2, 1], "gc_pause_s": [0.0625, 0.03125, 0.125],
     "committed_width_hist": [[0, 0, 0, 0, 0, 0, 0, 0, 16], [0, 0, 0, 0, 4, 0, 0, 0, 12]], "seed_width": 3},
    # the engine was rebuilt: its totals restart from zero, the exported counters keep growing
    {"kv_free_blocks": 70, "kv_total_blocks": 70, "bytes_offloaded": 200, "bytes_reloaded": 0,
     "offload_triggers": 1, "reload_triggers": 0, "preemptions": 0, "committed_width_hist": []},
]


@ray.remote(num_cpus=0)
class MetricsProbe:
    def __init__(self):
        self.metrics = EngineMetrics("probe")

    def feed(self, snapshots: list[dict]) -> None:
        for s in snapshots:
            self.metrics.update(s)
        self.metrics.observe_request(0.3, 0.02, "length", queued_s=0.005)
        self.metrics.observe_request(2.0, None, "stop")
        self.metrics.observe_request(0.7, None, "length", "score")


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(ray_pagedweight_\w+)(?:\{(.*)\})? ([-+0-9.eE]+|NaN|\+Inf)$", line)
        if m:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def value(samples: dict, name: str, **labels) -> float | None:
    """The single sample of `name` whose labels include `labels` (None if absent)."""
    want = set(labels.items())
    hits = [v for (n, lab), v in samples.items() if n == name and want <= set(lab)]
    assert len(hits) <= 1, (name, labels, hits)
    return hits[0] if hits else None


def scrape_until(port: int, ready, timeout: float = 90.0) -> dict:
    """Metrics reach the agent every few seconds: poll until `ready(samples)` holds (a falsy answer may say why:
    the failure shows the last one). A loaded 2-core CI machine once took over 45 s (session 56)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(port)
        if ready(samples) is True:
            return samples
        if time.monotonic() > deadline:
            pytest.fail(f"metrics not exported within {timeout} s: {ready(samples)}; have "
                        f"{sorted({n for n, _ in samples})}")
        time.sleep(1.0)


def test_engine_metrics_exported_with_exact_values(ray_cluster, serve_app):
    from ray import serve

    from conftest import API_KEY

    probe = MetricsProbe.remote()
    ray.get(probe.feed.remote(SNAPSHOTS))
    import httpx

    with httpx.Client(base_url=serve_app.base_url, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        for _ in range(2):
            r = http.post("/v1/completions", json={"model": serve_app.model, "prompt": "x", "max_tokens": 3})
            assert r.status_code == 200
    live = serve.get_deployment_handle("EngineReplica", app_name="pagedweight").stats.remote().result()

    def ready(s):
        # the replica's own series: engines of earlier tests in this Ray session may have exported requests of
        # their own, which made a sum over every engine ready before this one's histogram arrived (CI, 36bc75c)
        served = value(s, "ray_pagedweight_request_latency_seconds_count", engine=live["engine_id"],
                       finish_reason="length", work="generate")
        preempted = value(s, "ray_pagedweight_preemptions_total", engine="probe")
        return preempted == 2 and (served or 0) >= 2 or {"probe preemptions": preempted, "replica served": served}

    s = scrape_until(ray_cluster.metrics_port, ready)
    probe_v = lambda name, **kw: value(s, f"ray_pagedweight_{name}", engine="probe", **kw)  # noqa: E731
    # gauges: the last snapshot that carried them
    assert probe_v("kv_free_blocks") == 70 and probe_v("kv_total_blocks") == 70
    assert probe_v("resident_weight_bytes") == 100000 and probe_v("pages_in_flight") == 0
    assert probe_v("planner_step_seconds") == 0.0005 and probe_v("plan_staleness_steps") == 0
    assert probe_v("budget_bytes") == 9000000 and probe_v("device_reserved_bytes") == 9500000
    assert probe_v("device_peak_reserved_bytes") == 9600000
    # counters: growth summed over snapshots; after the restart the new totals are added on top
    assert probe_v("offloaded_bytes_total") == 5000 + 200
    assert probe_v("reloaded_bytes_total") == 700
    assert probe_v("offload_triggers_total") == 3 + 1 and probe_v("reload_triggers_total") == 1
    assert probe_v("prefix_query_tokens_total") == 300 and probe_v("prefix_hit_tokens_total") == 128
    assert probe_v("kv_cached_blocks") == 9 and probe_v("kv_evicted_blocks_total") == 4
    assert probe_v("kv_retained_blocks") == 5
    assert probe_v("engine_steps_total") == 50 and probe_v("steps_with_pages_in_flight_total") == 12
    assert probe_v("time_with_pages_in_flight_seconds_total") == 0.75
    assert [probe_v("gc_collections_total", generation=str(g)) for g in range(3)] == [9, 2, 1]
    assert [probe_v("gc_pause_seconds_total", generation=str(g)) for g in range(3)] == [0.0625, 0.03125, 0.125]
    # committed-width histogram per layer (last non-empty snapshot)
    assert probe_v("committed_width_blocks", layer="0", width="8") == 16
    assert probe_v("committed_width_blocks", layer="0", width="3") == 0
    assert probe_v("committed_width_blocks", layer="1", width="4") == 4
    assert probe_v("committed_width_blocks", layer="0", width="2") is None  # below the seed width: not a series
    # request latency histogram
    assert probe_v("request_latency_seconds_count", finish_reason="length", work="generate") == 1
    assert probe_v("request_latency_seconds_count", finish_reason="length", work="score") == 1
    assert probe_v("request_latency_seconds_bucket", finish_reason="stop", le="2.5") == 1
    assert probe_v("request_latency_seconds_bucket", finish_reason="stop", le="1.0") == 0
    assert probe_v("time_to_first_token_seconds_count") == 1
    assert probe_v("request_queue_time_seconds_count") == 1 and probe_v("request_queue_time_seconds_sum") == 0.005

    # the live engine replica: same numbers as its own stats(), and the requests above were timed
    # (engines of earlier tests in this Ray session may still have series exported: pick the replica's own)
    engines = {dict(lab)["engine"] for (n, lab) in s if n == "ray_pagedweight_kv_total_blocks"} - {"probe"}
    engine = live["engine_id"]
    assert engine in engines
    assert value(s, "ray_pagedweight_kv_total_blocks", engine=engine) == live["kv_total_blocks"] > 0
    assert 0 <= value(s, "ray_pagedweight_kv_free_blocks", engine=engine) <= live["kv_total_blocks"]
    assert value(s, "ray_pagedweight_resident_weight_bytes", engine=engine) == live["resident_weight_bytes"] > 0
    assert value(s, "ray_pagedweight_budget_bytes", engine=engine) == live["budget_bytes"] > 0
    # the replica process's collector: it has collected since it started (the engine's build, the warm-up)
    assert live["gc_collections"][0] > 0
    assert value(s, "ray_pagedweight_gc_collections_total", engine=engine, generation="0") > 0
    # a CPU engine has no caching allocator to measure: those gauges are left out, not exported as zero
    assert live["device_reserved_bytes"] is None and value(s, "ray_pagedweight_device_reserved_bytes",
                                                           engine=engine) is None
    seed = live["seed_width"]
    for layer, counts in enumerate(live["committed_width_hist"]):  # every expert block of the layer, by width
        exported = [value(s, "ray_pagedweight_committed_width_blocks", engine=engine, layer=str(layer),
                          width=str(w)) for w in range(len(counts))]
        assert exported == [None] * seed + counts[seed:] and sum(counts[seed:]) == sum(counts) > 0
    assert value(s, "ray_pagedweight_request_latency_seconds_count", engine=engine, finish_reason="length",
                 work="generate") >= 2
    assert value(s, "ray_pagedweight_request_latency_seconds_sum", engine=engine, finish_reason="length",
                 work="generate") > 0


class FakeMetric:
    """Stands in for ray.util.metrics' Gauge, Counter and Histogram: the last value set per tag set."""

    def __init__(self, name: str, description: str = "", tag_keys: tuple = (), boundaries: list | None = None):
        self.values: dict[tuple, float] = {}

    def set_default_tags(self, tags: dict) -> None:
        pass

    def set(self, value: float, tags: dict | None = None) -> None:
        self.values[tuple(sorted((tags or {}).items()))] = value

    inc = observe = set


def test_committed_width_series_run_from_the_seed_width(monkeypatch):
    """committed_width_blocks has a series per layer for each width from the checkpoint's seed to the parent: none
    for the widths below the seed, which the snapshot's histogram counts (as 0) though no block can hold them; a
    width the blocks left keeps its series at 0."""
    import pagedweight.actors.metrics as metrics

    for name in ("Gauge", "Counter", "Histogram"):
        monkeypatch.setattr(metrics, name, FakeMetric)
    m = metrics.EngineMetrics("unit")

    def exported() -> dict[tuple[str, str], float]:
        return {(tags["layer"], tags["width"]): v for tags, v in ((dict(k), v) for k, v in m._width.values.items())}

    m.update({"committed_width_hist": []})  # no page table: nothing
    assert exported() == {}
    full = [[0, 0, 0, 0, 0, 0, 0, 0, 16], [0, 0, 0, 0, 0, 0, 0, 0, 16]]
    m.update({"committed_width_hist": full, "seed_width": 3})
    zeros = {(str(layer), str(w)): 0 for layer in (0, 1) for w in range(3, 9)}
    assert exported() == {**zeros, ("0", "8"): 16, ("1", "8"): 16}
    m.update({"committed_width_hist": [[0, 0, 0, 2, 0, 0, 0, 0, 14], [0, 0, 0, 0, 4, 0, 0, 0, 12]], "seed_width": 3})
    assert exported() == {**zeros, ("0", "3"): 2, ("0", "8"): 14, ("1", "4"): 4, ("1", "8"): 12}
    m.update({"committed_width_hist": full, "seed_width": 3})  # reloaded
    assert exported() == {**zeros, ("0", "8"): 16, ("1", "8"): 16}
