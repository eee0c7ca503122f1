"""benchmarks/multi_engine.py on the session's CPU Ray cluster: two engines, one page store, planner, eval job,
and the Serve app with 2 and 1 engine replicas under concurrent HTTP load."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedweight.apformat import load_ap
from pagedweight.bitplanes import lut_bytes

from conftest import free_port

CYCLES, COPIES, SERVE_TOKENS = 1, 2, 6


def test_multi_engine_benchmark_on_cpu(ray_cluster, ap_model_dir, tmp_path):
    from benchmarks.multi_engine import main

    path = main(["--device", "cpu", "--model", str(ap_model_dir), "--engines", "2", "--engine-cpus", "0.25",
                 "--kv-cache-mib", "16", "--probe-copies", str(COPIES), "--probe-cycles", str(CYCLES),
                 "--reload-seconds", "0.05", "--barrier-s", "0.5", "--traffic-prompts", "2", "--traffic-tokens", "8",
                 "--eval-ctx", "64", "--eval-windows", "4", "--eval-prompts", "4", "--eval-tokens", "6",
                 "--eval-shard", "1", "--serve-clients", "4", "--serve-seconds", "1", "--serve-warmup-s", "0.3",
                 "--serve-tokens", str(SERVE_TOKENS), "--serve-prompts", "8", "--serve-port", str(free_port()),
                 "--out-dir", str(tmp_path)])
    result = json.loads(path.read_text())
    rows = result["rows"]
    by = lambda phase, **kv: [r for r in rows if r["phase"] == phase and all(r.get(k) == v for k, v in kv.items())]

    # (a) one store file on the node, mapped by both engines; its pages counted once across them
    node = by("store", engine="node")[0]
    engines = [r for r in by("store") if r["engine"] != "node"]
    assert len(engines) == 2 and len({r["pid"] for r in engines}) == 2
    assert node["same_file_and_inode"] and all(r["mapped_inode"] == r["file_inode"] for r in engines)
    size = node["store_file_bytes"]
    assert all(r["mapping_rss_bytes"] >= 0.9 * size for r in engines)  # each engine touched every page
    assert node["sum_mapping_pss_bytes"] <= 1.1 * size < node["bytes_if_one_copy_per_engine"]

    # (b) reload bytes follow from the checkpoint: planes seed..P-1 plus LUT_P of every block, per cycle
    ap = load_ap(ap_model_dir, verify=False)
    P, s = ap.parent_bits, ap.seed_bits
    per_cycle = sum((P - s) * b.plane_bytes + lut_bytes(b.n, P) for b in ap.blocks)
    for r in by("reload", mode="solo", path="mover"):
        assert r["bytes"] == (2 * CYCLES if r["engine"] == "all" else CYCLES) * per_cycle and r["gb_per_s"] > 0
    for r in by("reload", mode="solo", path="store_copy"):
        assert r["bytes"] == (2 if r["engine"] == "all" else 1) * COPIES * size
    for r in by("reload", mode="concurrent"):
        assert r["bytes"] > 0 and r["gb_per_s"] > 0
    both = by("reload", mode="concurrent", path="store_copy", engine="all")[0]
    assert 0 <= both["overlap_frac"] <= 1

    # (c) the planner merged both engines' different traffic, and both engines now cut the merged buckets
    merged = by("planner", engine="planner")[0]
    assert merged["merge_max_abs_err_vs_recomputed"] < 1e-6 and merged["buckets_equal_recomputed"]
    per_engine = [r for r in by("planner") if r["engine"] != "planner"]
    assert {r["traffic"] for r in per_engine} == {"code", "prose"}
    assert set(r["engine"] for r in per_engine) <= set(merged["engines_merged"])
    for r in per_engine:
        assert r["pushed_equals_local"] and r["pushed_tokens"] > 0 and r["engine_buckets_equal_merged"]
        assert r["local_vs_merged_l1"] > 1e-4  # each engine's own view differed from the cluster's

    # (d) the evaluation job over 1 and 2 engines: same perplexity and samples, both engines used
    one, two = by("eval", engines=1)[0], by("eval", engines=2)[0]
    assert 1 < one["ppl"] < 100 and two["identical_ppl"] and two["identical_samples"]
    assert min(two["ppl_windows_per_engine"]) >= 1 and min(two["gen_prompts_per_engine"]) >= 1
    assert one["ppl_tokens"] == two["ppl_tokens"] == 4 * 64

    # (e) Serve: 1 and 2 replicas running behind the ingress, every HTTP request answered in full, same greedy text
    serve = by("serve")
    assert [(r["replicas"], r["stream"]) for r in serve] == [(1, False), (1, True), (2, False), (2, True)]
    for r in serve:
        assert r["replicas_running"] == r["replicas"] and r["clients"] == 4
        assert r["errors"] == r["warmup_errors"] == r["text_check_errors"] == 0, r["error_examples"]
        assert r["requests"] >= 1 and r["completion_tokens"] == r["requests"] * SERVE_TOKENS
        assert r["tokens_per_s"] > 0 and 0 < r["latency_p50_ms"] <= r["latency_p99_ms"] <= r["latency_max_ms"]
        assert r["identical_text_vs_1"] and r["tokens_per_s_vs_1"] > 0
        if r["stream"]:  # the first token comes before the last one
            assert 0 < r["ttft_p50_ms"] <= r["latency_p50_ms"] and r["ttft_p99_ms"] <= r["latency_max_ms"]
        else:
            assert r["ttft_p50_ms"] is None


# ---------------------------------------------------------------- the evaluation job's sharding, without Ray
class _Ref:
    """A stand-in object ref: the call runs when it is got."""

    def __init__(self, call):
        self.call = call


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return _Ref(lambda: self.fn(*args))


class _Engine:
    """What the job calls of an EngineActor. `fail_on`: an item whose shard raises (its engine died); `error_on`: a
    prompt whose request ends with finish_reason "error" (its engine's step loop failed)."""

    def __init__(self, name: str, calls: list, fail_on=None, error_on=None, shutdown_fails=False):
        from types import SimpleNamespace

        def score(windows):
            calls.append((name, "score", [w[0] for w in windows]))
            if fail_on in [w[0] for w in windows]:
                raise RuntimeError(f"{name} died")
            return float(sum(w[0] for w in windows)), sum(len(w) - 1 for w in windows)

        def generate_batch(requests):
            calls.append((name, "generate", [p for p, _ in requests]))
            return [SimpleNamespace(text=f"<{p}>", completion_tokens=1, finish_reason="error" if p == error_on
                                    else "length", error="step loop failed" if p == error_on else None)
                    for p, _ in requests]

        def shutdown():
            if shutdown_fails:
                raise RuntimeError("actor died")

        self.score, self.generate_batch = _Method(score), _Method(generate_batch)
        self.shutdown, self.stats = _Method(shutdown), _Method(lambda: {"engine_id": name})
        self.info = _Method(lambda: {"engine_id": name, "node_id": "n", "device": "cpu", "gpu_ids": []})


@pytest.fixture
def fake_ray(monkeypatch):
    """Ray as the job uses it; calls complete newest first (out of the order they were made)."""
    import ray

    import pagedweight.actors.jobs.evaluate as job

    def get(refs, timeout=None):
        return [r.call() for r in refs] if isinstance(refs, list) else refs.call()

    monkeypatch.setattr(job.ray, "get", get)
    monkeypatch.setattr(job.ray, "wait", lambda refs, num_returns=1: ([refs[-1]], refs[:-1]))
    monkeypatch.setattr(job.ray, "init", lambda **kw: None)
    monkeypatch.setattr(job.ray, "kill", lambda actor, no_restart=True: None)
    return ray


def test_sharding_scores_every_item_once_and_merges_in_order(fake_ray):
    from pagedweight.actors.jobs.evaluate import run_sharded

    calls = []
    engines = [_Engine(f"e{i}", calls) for i in range(3)]
    windows = [[i, 0, 0] for i in range(10)]
    parts, handled = run_sharded(engines, "score", windows, 3, "perplexity")
    scored = sorted(i for _, _, items in calls for i in items)
    assert scored == list(range(10)) and sum(handled) == 10 and min(handled) >= 1
    assert [p[0] for p in parts] == [0 + 1 + 2, 3 + 4 + 5, 6 + 7 + 8, 9]  # shard order, not completion order
    outs, _ = run_sharded(engines, "generate_batch", [(f"p{i}", None) for i in range(7)], 2, "generate")
    assert [o.text for part in outs for o in part] == [f"<p{i}>" for i in range(7)]


def test_a_failed_engine_is_named_and_fails_the_job(fake_ray, model_dir, tmp_path, monkeypatch, capsys):
    """A shard that fails names its engine and items, and the job exits 1 with no results file; an engine whose
    shutdown then fails does not hide that error (it did: the shutdown's error was the one raised). Requests that
    ended with an error (a step loop that failed mid-shard) are reported and fail the job, whose results say which
    (the job reported success)."""
    import pagedweight.actors.jobs.evaluate as job

    calls = []
    monkeypatch.setattr(job, "start_engines", lambda cfg, num_engines, **kw: engines)
    monkeypatch.setattr(job, "token_windows", lambda model_dir, text, ctx, n: [[i, 0, 0] for i in range(n)])
    out = tmp_path / "eval.json"
    args = [str(model_dir), "--windows", "6", "--shard", "2", "--num-prompts", "4", "--out", str(out)]
    engines = [_Engine("job1-cpu0", calls), _Engine("job1-cpu1", calls, fail_on=1, shutdown_fails=True)]
    assert job.main(args) == 1
    err = capsys.readouterr().err
    assert "error: engine job1-cpu1 failed on perplexity items 0-1 (of 6): job1-cpu1 died" in err
    assert "engine shutdown: RuntimeError: actor died" in err and not out.exists()

    calls.clear()
    prompts = job.prompts_from(Path(job.DEFAULT_DATA).read_text(), 4, 200)
    engines = [_Engine("job2-cpu0", calls, error_on=prompts[2]), _Engine("job2-cpu1", calls)]
    assert job.main([*args, "--mode", "generate"]) == 1
    assert "generation of prompt 2 failed: step loop failed" in capsys.readouterr().err
    gen = json.loads(out.read_text())["generation"]
    assert gen["errors"] == [{"prompt": 2, "error": "step loop failed"}] and gen["finish_reasons"]["error"] == 1
    assert [s["prompt"] for s in gen["samples"]] == prompts

    calls.clear()
    engines = [_Engine("job3-cpu0", calls), _Engine("job3-cpu1", calls)]
    assert job.main(args) == 0
    shown = capsys.readouterr().out  # progress while engines start and warm up (minutes on a large model)
    assert "engines starting: 100%" in shown and "warm-up: 100%" in shown and "perplexity: 100%" in shown
    result = json.loads(out.read_text())
    assert result["perplexity"]["windows"] == 6 and sum(result["perplexity"]["windows_per_engine"]) == 6
    assert result["perplexity"]["nll"] == sum(range(6)) and result["generation"]["errors"] == []
    assert sorted(i for _, kind, items in calls[4:] if kind == "score" for i in items) == list(range(6))


def test_evaluation_job_refuses_an_unwritable_out_before_starting(model_dir, tmp_path, capsys):
    """--out in a directory that does not exist (or a directory itself) is refused before Ray starts: it failed
    only when the results were written, after the whole evaluation."""
    from pagedweight.actors.jobs.evaluate import main

    for out, reason in [(tmp_path / "none" / "eval.json", "no such directory"), (tmp_path, "is a directory")]:
        with pytest.raises(SystemExit) as exit_info:
            main([str(model_dir), "--out", str(out)])
        assert exit_info.value.code == 2 and f"--out {out}: {reason}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path / "no-model"), "--out", str(tmp_path / "eval.json")])
    assert "no such model directory" in capsys.readouterr().err


def test_evaluation_job_without_a_cluster_says_how_to_get_one(model_dir, tmp_path, monkeypatch, capsys):
    """No Ray cluster to join: one line saying how to start or name one, exit 2 (it was ray.init's traceback)."""
    import pagedweight.actors.jobs.evaluate as job

    def no_cluster(**kw):
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(job.ray, "init", no_cluster)
    with pytest.raises(SystemExit) as exit_info:
        job.main([str(model_dir), "--out", str(tmp_path / "eval.json")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "no Ray cluster to join: Could not find any running Ray instance." in err
    assert "ray start --head" in err and not (tmp_path / "eval.json").exists()
