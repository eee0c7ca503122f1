"""benchmarks/multi_engine.py on the session's CPU Ray cluster: two engines, one page store, planner, eval job,
and the Serve app with 2 and 1 engine replicas under concurrent HTTP load."""
from __future__ import annotations

import json

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
