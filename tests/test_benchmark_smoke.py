"""The H200 benchmark scripts at toy sizes on CPU: they run end to end, write their rows and the parts a GPU
session relies on (ratios, traces, the boundary profile), so a device call is not lost to a broken script."""
from __future__ import annotations

import json
import re
import textwrap

import numpy as np
import pytest
import torch


def test_engine_bench_tiny_writes_ratios_and_traces(tmp_path):
    from benchmarks import engine_bench

    assert engine_bench.main(["--tiny", "--device", "cpu", "--bits", "3", "--batches", "1", "--skip-fp16",
                              "--paged-home", "parent,match", "--gen", "4", "--trace", "--prompt-logprobs", "1",
                              "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("engine_bench-*.json")
    res = json.loads(path.read_text())
    assert res["versions"]["torch"] == torch.__version__ and res["versions"]["python"]  # what the figures ran on
    assert 0 < res["host_loop_ms"] < 1000  # the host's speed index, measured at the write
    assert 0 < res["host_loop_ms_at_start"] < 1000  # and at the process's start
    assert [r["config"] for r in res["rows"]] == ["ap3-uniform", "pagedweight@ap3-memory", "pagedweight-home3@ap3-memory"]
    assert set(res["decode_ratio_paged_over_uniform"]) == {"ap3/b1", "ap3/b1/home3"}
    assert all(r["step_trace"]["rows"] for r in res["rows"]) and res["complete"]
    col = res["rows"][0]["step_trace"]["columns"].index("tokens")
    tokens = {row[col] for row in res["rows"][0]["step_trace"]["rows"]}
    assert 1 in tokens and max(t or 0 for t in tokens) > 1  # decode steps of batch 1, and the prefill's


def test_engine_bench_paired_chunks_alternate_over_the_whole_decode(tmp_path, monkeypatch):
    """--rounds 0 --paired-chunk N: no table, one paired measurement per width, batch and home; each engine runs gen
    decode steps with every request of its batch decoding in each, and each chunk pair gives a ratio; each chunk's
    decode-graph counts are that chunk's own (the CPU runs no decode graphs: counters that grow with every step of
    an engine stand in for them)."""
    from benchmarks import engine_bench

    monkeypatch.setattr(engine_bench, "decode_graph_counts", lambda llm: (2 * llm.num_steps, llm.num_steps))
    assert engine_bench.main(["--tiny", "--device", "cpu", "--bits", "3", "--batches", "1,2", "--paged-home", "match",
                              "--gen", "9", "--rounds", "0", "--paired-chunk", "3", "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("engine_bench-*.json")
    res = json.loads(path.read_text())
    assert res["rows"] == [] and res["complete"] and set(res["paired_decode"]) == {"ap3/b1/home3", "ap3/b2/home3"}
    for pair in res["paired_decode"].values():
        assert pair["steps_per_engine"] == 9 and len(pair["pair_ratios"]) == 3  # chunks of 3 steps
        assert pair["chunk_graphs"] == {"uniform": [[6, 3]] * 3, "paged": [[6, 3]] * 3}
        assert pair["pair_ratio_min"] == min(pair["pair_ratios"]) and pair["pair_ratio_max"] == max(pair["pair_ratios"])
        assert pair["ratio_paged_over_uniform"] == pair["uniform_step_ms_median"] / pair["paged_step_ms_median"]
        assert "trace_medians" not in pair
        # home = bits = the seed width: nothing can go lower, so both read the same bytes, every layer narrow
        assert pair["routed_bytes_ratio_paged_over_uniform"] == 1.0 and pair["paged_mean_width"] == 3.0
        assert pair["paged_layers_by_lut_class"] == {"4": 2}
        assert pair["paged_blocks_by_width"] == {"3": pair["paged_blocks_by_width"]["3"]}
        assert pair["paged_routed_share_by_width"] == {"3": pytest.approx(1.0)}


def test_routed_expert_bytes_follow_the_routing_mass():
    """All of a layer's mass on one expert: a token reads top_k times that expert's blocks at their widths, and
    every block it meets has that expert's width."""
    from benchmarks import engine_bench

    cfg = engine_bench.model_config(tiny=True)
    weights = engine_bench.ap_weights(cfg, parent_bits=6)
    L, E = cfg.num_hidden_layers, cfg.num_experts
    widths = np.full(L * E * 2, 3)
    widths[[2 * (l * E + 1) + u for l in range(L) for u in (0, 1)]] = 6  # expert 1 of every layer at 6 bits
    mass = np.zeros((L, E))
    mass[:, 1] = 2.0
    assert engine_bench.routed_share_by_width(widths, mass) == {3: 0.0, 6: 1.0}
    gu, down = weights.specs[0], weights.specs[1]
    want = cfg.top_k * L * (6 * (gu.plane_bytes + down.plane_bytes) + gu.lut_bytes[6] + down.lut_bytes[6])
    assert engine_bench.routed_expert_bytes(weights, widths, mass, cfg.top_k) == want
    mass[:, 1], mass[:, 0] = 1.0, 1.0  # half on a 3-bit expert
    want3 = cfg.top_k * L * (3 * (gu.plane_bytes + down.plane_bytes) + gu.lut_bytes[3] + down.lut_bytes[3])
    assert engine_bench.routed_expert_bytes(weights, widths, mass, cfg.top_k) == pytest.approx((want + want3) / 2)
    assert engine_bench.routed_share_by_width(widths, mass) == {3: pytest.approx(0.5), 6: pytest.approx(0.5)}


def test_engine_bench_paired_trace_splits_each_engines_steps(tmp_path):
    """--trace in a paired run: each engine's median per trace column, and its median step per place in the
    routing-observation cycle; only PagedWeight's observed steps (place 0) read routing statistics."""
    from benchmarks import engine_bench

    assert engine_bench.main(["--tiny", "--device", "cpu", "--bits", "3", "--batches", "1", "--paged-home", "match",
                              "--gen", "13", "--rounds", "0", "--paired-chunk", "4", "--trace",
                              "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("engine_bench-*.json")
    pair = json.loads(path.read_text())["paired_decode"]["ap3/b1/home3"]
    assert pair["observe_every"] == 4 and set(pair["trace_medians"]) == set(pair["phase_step_ms"]) == {"uniform", "paged"}
    cols = pair["trace_medians"]["paged"]
    assert list(cols) == engine_bench.TRACE_COLUMNS and cols["forward_ms"] > 0 and cols["sample_ms"] > 0
    assert cols["tokens"] == 1  # decode steps of batch 1
    assert pair["trace_medians"]["uniform"]["observe_ms"] == 0
    assert all(len(v) == 4 and all(x > 0 for x in v) for v in pair["phase_step_ms"].values())
    for kind, trace in pair["step_traces"].items():  # every step's row behind those medians, its cycle place first
        assert trace["columns"] == ["cycle", *engine_bench.TRACE_COLUMNS]
        assert len(trace["rows"]) == pair["steps_per_engine"] == 13
        tokens, running = trace["columns"].index("tokens"), trace["columns"].index("running")
        assert all(row[tokens] == row[running] == 1 for row in trace["rows"])  # the whole batch in every step
        assert sorted({row[0] for row in trace["rows"]}) == [0, 1, 2, 3], kind


def test_launch_marks_time_each_engines_launch_by_cycle_place(tmp_path):
    """launch_marks: per engine and observation-cycle place, the host ms from a decode step's start to its
    forward's launch (inside the step), the marks before it in order, and no GPU time on the CPU; the patches are
    undone afterwards."""
    from benchmarks import engine_bench, launch_marks
    from pagedweight.engine import LLM
    from pagedweight.runner import DecodeGraphs

    step, run = LLM.step, DecodeGraphs.run
    assert launch_marks.main(["--tiny", "--device", "cpu", "--bits", "3", "--batches", "1", "--paged-home", "match",
                              "--gen", "13", "--rounds", "0", "--paired-chunk", "4", "--out-dir", str(tmp_path),
                              "--label", "t"]) == 0
    assert LLM.step is step and DecodeGraphs.run is run and engine_bench.StepPhases.__name__ == "StepPhases"
    (path,) = tmp_path.glob("launch_marks-*-t.json")
    rows = json.loads(path.read_text())["rows"]
    assert {(r["engine"], r["place"]) for r in rows} == {(e, p) for e in ("uniform", "paged") for p in range(4)}
    for r in rows:
        assert r["config"] == "ap3/b1/home3" and r["steps"] >= 2 and r["graph_gpu_ms"] is None
        assert 0 < r["launch_ms"] < r["step_ms"]
        assert 0 < r["scheduled_ms"] <= r["launch_ms"]
        assert "run_ms" not in r and "graph_lookup_ms" not in r  # on the CPU no static decode step (DecodeGraphs)


def test_kv_pressure_tiny_profiles_the_step_boundaries(tmp_path):
    from benchmarks import kv_pressure

    prof = tmp_path / "boundaries.txt"
    assert kv_pressure.main(["--tiny", "--device", "cpu", "--profile", str(prof), "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("kv_pressure-*.json")
    res = json.loads(path.read_text())
    rows = res["rows"]
    assert [r["mode"] for r in rows] == ["pagedweight", "static-ap6", "static-ap4"]  # the warm-up replay is not a row
    assert res["complete"] and not any(r["cut_short"] for r in rows)
    # the percentiles' population: every request but those that failed before a first token (static 6 bits' budget
    # cannot hold some contexts at all)
    assert all(r["requests_done"] <= r["ttft_requests"] <= r["requests"] for r in rows)
    assert rows[0]["ttft_requests"] == rows[0]["requests"]
    paged = rows[0]
    assert paged["run"] == 0
    assert paged["requests_done"] == paged["requests"] and paged["offload_triggers"] > 0
    # the wait for a slot and KV room is part of the time to first token, for the slowest request too
    for r in rows:
        assert 0 <= r["queued_p50_ms"] <= r["queued_p99_ms"] and r["queued_p50_ms"] <= r["ttft_p50_ms"]
        assert 0 <= r["ttft_max_queued_ms"] < r["ttft_max_ms"]
        # the slowest first tokens, each broken down: queued, then at least one step per chunk of its uncomputed
        # prompt (the tiny chunk is 64 tokens), and the steps it ran without advancing (its `prefill_waits`)
        tail = r["ttft_tail"]
        assert len(tail) == kv_pressure.TTFT_TAIL and [t["ttft_ms"] for t in tail] == sorted(
            (t["ttft_ms"] for t in tail), reverse=True)
        assert (tail[0]["ttft_ms"], tail[0]["queued_ms"]) == (r["ttft_max_ms"], r["ttft_max_queued_ms"])
        for t in tail:
            assert 0 <= t["cached_tokens"] < t["prompt_tokens"] and t["queued_ms"] < t["ttft_ms"]
            assert 0 <= t["sent_late_ms"] and t["sent_late_ms"] + t["queued_ms"] < t["ttft_ms"]
            assert t["prefill_steps"] >= -(-(t["prompt_tokens"] - t["cached_tokens"]) // 64)
        assert r["prefill_wait_steps"] >= sum(t["prefill_waits"] for t in tail) >= 0
        assert r["idle_call_max_ms"] >= 0
    text = prof.read_text()
    assert "pagedweight: step boundaries" in text and "_paging_boundary" in text and "_request_moves" in text
    assert "static-ap4: step boundaries" in text  # the same boundary without paging: the baseline


def test_kv_pressure_counts_the_static_decode_steps():
    """A drive's row counts the decode steps that went through the static decode path (on CUDA its graphs: eager
    first sights and captures are a fresh engine's slow steps); None where the engine packs every step (the CPU)."""
    from pathlib import Path

    from benchmarks.kv_pressure import drive
    from pagedweight.engine import LLM
    from pagedweight.runner import ModelRunner

    model = Path(__file__).resolve().parents[1] / "models" / "pw-tiny-moe"
    llm = LLM(model, device="cpu", block_size=4, detokenize=False)
    requests = [(0.0, [3, 5, 7, 9, 11]), (0.0, [2, 4, 6])]
    assert drive(llm, requests, gen=4)["decode_graph_steps"] is None
    llm.runner = ModelRunner(llm.model, llm.kv, llm.device, max_num_seqs=4, max_model_len=llm.max_model_len)
    steps = drive(llm, requests, gen=4)["decode_graph_steps"]  # on the CPU the static path runs eagerly
    assert steps == {"eager": 3, "captured": 0, "replayed": 0, "capture_failures": 0}, steps


def test_kv_pressure_turns_grow_each_conversation_s_prompt():
    """--turns: request i is turn i // C of conversation i % C, its prompt the previous turn's and more; one turn is
    the independent workload, arrivals included."""
    from benchmarks.kv_pressure import workload

    plain, convs = workload(12, 4.0, 40, 80, 100, seed=3, shared=16), workload(12, 4.0, 40, 80, 100, seed=3,
                                                                                   shared=16, turns=3)
    assert workload(12, 4.0, 40, 80, 100, seed=3, shared=16, turns=1) == plain
    assert [t for t, _ in convs] == [t for t, _ in plain]
    for i in range(4, 12):  # 4 conversations of 3 turns
        before, now = convs[i - 4][1], convs[i][1]
        assert now[:len(before)] == before and 10 <= len(now) - len(before) <= 20
    assert all(ids[:16] == plain[0][1][:16] for _, ids in convs)  # the system prompt


def test_kv_pressure_closed_loop_turns_carry_the_answer(tmp_path):
    """--think-s: a conversation's next turn is sent after the previous one ended, with its prompt and answer
    first, so with room to keep them it finds every full block of the previous turn's K/V computed."""
    from benchmarks import kv_pressure

    args = ["--tiny", "--device", "cpu", "--turns", "2", "--num-requests", "4", "--think-s", "0", "--rate", "8",
            "--kv-room-blocks", "96", "--static-bits", "none", "--warmup-replays", "0", "--trace",
            "--out-dir", str(tmp_path)]
    assert kv_pressure.main(args) == 0
    (path,) = tmp_path.glob("kv_pressure-*.json")
    res = json.loads(path.read_text())
    (row,) = res["rows"]
    assert res["think_s"] == 0 and row["requests_done"] == 4 and row["ttft_later_turns_p50_ms"] > 0
    assert row["prefill_wait_steps"] == 0  # 96 blocks of room: no prompt chunk waits for a block
    reqs = kv_pressure.workload(4, 8.0, 48, 160, 512, seed=0, turns=2, think_s=0.0)  # the tiny shape
    gen = kv_pressure.DEFAULTS["tiny"]["gen"]
    # turns 2, 3 follow turns 0, 1: each finds its predecessor's prompt and answer, less the never-computed last token
    assert [r[2] for r in reqs] == [None, None, 0, 1]
    assert row["prefix_hit_tokens"] == sum((len(reqs[p][1]) + gen - 1) // 16 * 16 for p in (0, 1))
    # a follower's prompt: its predecessor's prompt and answer, then its own new ids
    assert row["prefix_query_tokens"] == sum(len(r[1]) for r in reqs) + sum(len(reqs[p][1]) + gen for p in (0, 1))
    # the trace: each request sent before one step and given its first token by that step or a later one, a
    # follower sent after its predecessor's last token; step start times increase
    trace = row["step_trace"]
    assert trace["columns"] == kv_pressure.TRACE_COLUMNS + kv_pressure.DRIVE_COLUMNS
    col = {c: [r[i] for r in trace["rows"]] for i, c in enumerate(trace["columns"])}
    sent_at = {i: k for k, ids in enumerate(col["sent"]) for i in ids}
    first_at = {i: k for k, ids in enumerate(col["first_tokens"]) for i in ids}
    assert sorted(sent_at) == sorted(first_at) == [0, 1, 2, 3] and sum(map(len, col["sent"])) == 4
    assert all(sent_at[i] <= first_at[i] for i in range(4)) and sent_at[2] > first_at[0] and sent_at[3] > first_at[1]
    assert col["t_ms"] == sorted(col["t_ms"]) and all(0 <= f for f in col["kv_free"])


def test_kv_pressure_planner_knobs_reach_the_planner(tmp_path, monkeypatch):
    """--planner-knobs overrides PagedWeight's planner: with a reload hysteresis larger than any KV cache, widths
    released under pressure never come back (reload triggers 0, idle gaps included), and the result records the
    overrides; --observe-every reaches each PagedWeight engine. Two PagedWeight runs on the same arrivals, alone:
    their spread is in the result."""
    from benchmarks import kv_pressure

    built, from_parts = [], kv_pressure.LLM.from_parts

    def recorded(*args, **kwargs):
        built.append(from_parts(*args, **kwargs))
        return built[-1]
    monkeypatch.setattr(kv_pressure.LLM, "from_parts", recorded)
    knobs = {"hysteresis_blocks": 10**6}
    assert kv_pressure.main(["--tiny", "--device", "cpu", "--static-bits", "none", "--paged-runs", "2", "--warmup-replays", "0",
                             "--planner-knobs", json.dumps(knobs), "--observe-every", "3",
                             "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("kv_pressure-*.json")
    res = json.loads(path.read_text())
    assert res["planner_knobs"] == knobs and res["observe_every"] == 3
    assert len(built) == 2 and all(llm.options.observe_every == 3 for llm in built)
    runs = [r for r in res["rows"] if r["mode"] == "pagedweight"]
    assert [r["run"] for r in runs] == [0, 1] and len(res["rows"]) == 2  # --static-bits none: PagedWeight alone
    for paged in runs:
        assert paged["offload_triggers"] > 0 and paged["reload_triggers"] == 0
        assert paged["requests_done"] == paged["requests"]
    spread = res["pagedweight_runs"]
    assert spread["offload_triggers"]["runs"] == [r["offload_triggers"] for r in runs]
    assert spread["reload_triggers"] == {"runs": [0, 0], "median": 0.0}


@pytest.mark.parametrize("phase, title", [("decode", "4 decode steps"), ("prefill", "4 prefill steps (1 x 2043 tokens)")])
def test_engine_bench_torch_profile_covers_one_phase(tmp_path, phase, title):
    """Decode: the 4 decode steps after the first token, not the prefill. Prefill: the 4 chunks of 512 tokens up to the
    first token, not the decode steps."""
    from benchmarks import engine_bench

    prof = tmp_path / "profile.txt"
    assert engine_bench.main(["--tiny", "--device", "cpu", "--bits", "3", "--batches", "1", "--skip-fp16",
                              "--gen", "5", "--torch-profile", str(prof), "--torch-profile-phase", phase,
                              "--out-dir", str(tmp_path)]) == 0
    text = prof.read_text()
    titles = [line for line in text.splitlines() if line.startswith("=====")]
    assert titles[0].startswith(f"===== ap3-uniform batch 1: {title}") and len(titles) == 2
    # one forward per step of the phase: the other phase's forwards are not in the profile
    calls = re.findall(r"aten::embedding .* (\d+)\s*$", text, flags=re.M)
    assert calls and set(calls) == {"4"}


def test_attention_bench_quick_on_cpu(tmp_path):
    """The decode-attention benchmark runs the engine's torch path on the CPU and checks it against the twin."""
    from benchmarks import attention_bench

    assert attention_bench.main(["--device", "cpu", "--quick", "--iters", "2", "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("attention_bench-*.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert row["method"] == "sdpa" and row["context"] == 64 and row["max_abs_err_vs_twin"] < 1e-5
    assert row["kv_bytes"] == 2 * 64 * 2 * 64 * 4  # K and V of 64 keys, 2 KV heads of 64 dims, float32


def test_sdpa_ab_runs_on_cpu_against_an_old_copy(tmp_path, monkeypatch):
    """sdpa_ab on the CPU's smoke cases, its old arm an older layers.py whose sdpa builds its causal mask with a
    helper the module no longer has (`old_functions` defines it too): the arms agree."""
    from benchmarks import sdpa_ab

    old = tmp_path / "old_layers.py"
    old.write_text(textwrap.dedent("""
        def mask_of(t, s, device):
            return torch.arange(s, device=device)[None, :] <= torch.arange(s - t, s, device=device)[:, None]

        def sdpa(q, k, v, mask, scale):
            if mask is None and q.shape[2] > 1:
                mask = mask_of(q.shape[2], k.shape[2], q.device)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                  enable_gqa=k.shape[1] != q.shape[1])
    """))
    monkeypatch.setenv("OUT", str(tmp_path))
    assert sdpa_ab.main(["--old", str(old), "--device", "cpu"]) == 0
    (path,) = tmp_path.glob("sdpa_ab-*.json")
    record = json.loads(path.read_text())
    assert record["complete"] and [r["case"] for r in record["rows"]] == list(sdpa_ab.SMOKE)
    assert all(r["rel_new_vs_old"] < 2e-3 for r in record["rows"]), record["rows"]


def test_old_functions_see_the_old_files_constants(tmp_path):
    """An old arm's function sees its own file's constants and helpers, the new module's other names; the new
    module's namespace is left as it was."""
    from benchmarks.common import old_functions

    old = tmp_path / "old.py"
    old.write_text("SLACK = 0.5\nlower = 1\n\ndef helper():\n    return 10\n\n"
                   "def f():\n    return SLACK + helper() + SHARED + lower\n")
    new = {"SLACK": 1.0, "SHARED": 100, "lower": 2, "f": None}
    assert old_functions(str(old), ["f"], new)["f"]() == 0.5 + 10 + 100 + 2
    assert new == {"SLACK": 1.0, "SHARED": 100, "lower": 2, "f": None}


def test_output_cost_times_every_kind(tmp_path):
    from benchmarks import output_cost

    assert output_cost.main(["--requests", "3", "--generated", "8,40", "--prompt", "16", "--steps", "4",
                             "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("output_cost-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [(r["output_kind"], r["generated"]) for r in rows] == [
        (k, g) for k in ("cumulative", "delta", "final_only") for g in (8, 40)]
    assert all(r["step_host_ms_median"] > 0 for r in rows)


def test_swings_ignore_small_wiggles_that_reversals_count():
    from benchmarks.kv_pressure import reversals, swings

    assert reversals([6, 5, 6]) == 1 and swings([6, 5, 6], 0.5) == 1
    ramp_with_dip = [6.0, 5.0, 5.2, 5.4, 5.35, 5.6, 5.8, 6.0]  # down, back up with a 0.05-bit dip on the way
    assert reversals(ramp_with_dip) == 3 and swings(ramp_with_dip, 0.1) == 1
    waves = [6, 5, 6, 5, 6]
    assert swings(waves, 0.5) == 3 and swings(waves, 1.5) == 0
    assert swings([], 0.1) == swings([5.0], 0.1) == 0


def test_budgets_count_the_weights_outside_the_pool_as_the_engine_holds_them():
    """engine_bench and kv_pressure size their budgets with outside_bytes: the serving layout (fused projections and
    the fused input projection's alignment rows), exactly what the engine's model holds outside the pool. Counted
    from the unfused model, the budget came up short by the alignment rows, and a budget meant to hold every expert at
    the parent width started them a width lower. On CUDA the engine packs those weights in one allocation, each
    256-byte aligned, and counts its bytes (`packed_bytes`): the CUDA budgets count those."""
    import torch

    from benchmarks.engine_bench import ap_weights, model_config, outside_bytes, random_model
    from pagedweight.engine import LLM, param_bytes

    cfg = model_config(True, False)
    llm = LLM.from_parts(random_model(cfg, False, torch.float32, "cpu"), ap_weights(cfg, 6), None, None, "cpu",
                         detokenize=False)
    assert outside_bytes(cfg, torch.float32) == param_bytes(llm.model)
    assert outside_bytes(cfg, torch.float32) > param_bytes(random_model(cfg, False, torch.float32, "meta"))
    assert outside_bytes(cfg, torch.float32, "cuda") == llm.model.packed_bytes("cuda") > param_bytes(llm.model)


def test_engine_bench_observe_every_reaches_pagedweight_only():
    """--observe-every sets PagedWeight's routing-statistics interval; uniform engines have no planner to feed."""
    from types import SimpleNamespace

    from benchmarks import engine_bench

    args = SimpleNamespace(compact_every=None, observe_every=16, planner_knobs=None)
    assert engine_bench.engine_options("paged", 4, 4, args)["observe_every"] == 16
    assert "observe_every" not in engine_bench.engine_options("uniform", 4, None, args)
    assert "observe_every" not in engine_bench.engine_options("paged", 4, 4, SimpleNamespace(
        compact_every=None, observe_every=None, planner_knobs=None))
    # --planner-knobs reaches PagedWeight's planner only
    args = SimpleNamespace(compact_every=None, observe_every=None, planner_knobs='{"release_min_share": 0.5}')
    assert engine_bench.engine_options("paged", 4, 6, args)["planner_knobs"] == {"release_min_share": 0.5}
    assert "planner_knobs" not in engine_bench.engine_options("uniform", 4, None, args)


def test_class_rule_plans_both_runs(tmp_path, monkeypatch):
    """benchmarks/class_rule.py: per run the unruled release, the ruled one (no layer short of the share, the same
    demand met) and uniform 4 bits."""
    import json
    import sys

    from benchmarks import class_rule

    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["class_rule.py", "--label", "t"])
    assert class_rule.main() == 0
    rows = json.loads(next(tmp_path.glob("class-rule-*.json")).read_text())["rows"]
    assert [(r["run"], r["variant"]) for r in rows] == [(run, v) for run, *_ in class_rule.CASES
                                                         for v in ("unruled", "class rule", "uniform 4 bits")]
    for r in rows:
        shares = r["wide_layers_share_above_narrow"]
        if r["variant"] == "class rule":
            assert all(s >= class_rule.SHARE for s in shares) and r["layers_narrow"] > 0, r
        if r["variant"] == "unruled":
            assert any(s < class_rule.SHARE for s in shares), r  # the case the rule is for
        assert r["variant"] == "uniform 4 bits" or r["freed_bytes"] >= r["demand_bytes"]


def test_benchmark_checkpoints_carry_residual_heads_unless_told_not_to():
    """`convert` fits residual heads by default, so the benchmarks' random checkpoint has heads too: PagedWeight then
    pays what a converted checkpoint pays per observed step (block features, eta rows). --no-heads drops them."""
    import torch

    from benchmarks.engine_bench import ap_weights, model_config, random_model
    from pagedweight.engine import LLM
    from pagedweight.sampling import SamplingParams

    cfg = model_config(True, False)
    assert ap_weights(cfg, 6, heads=False).heads is None
    llm = LLM.from_parts(random_model(cfg, False, torch.float32, "cpu"), ap_weights(cfg, 6), None, None, "cpu",
                         detokenize=False, observe_every=1)
    assert llm.planner.heads is not None and llm.planner.features is None
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert llm.planner.features.shape == (llm.planner.tables.n_blocks, 4)  # the observed steps' block features
    assert np.isfinite(llm.planner.signals()[0]).all()


def test_memory_gap_attributes_each_live_segment_to_its_last_allocation():
    """A segment the allocator freed and allocated again at the same address counts once, by its last allocation
    (the first H200 run counted it per allocation), a freed one not at all, and a graph pool's apart."""
    from benchmarks.memory_gap import attribute

    frame = lambda name: [{"filename": "/elsewhere/x.py", "line": 1, "name": name}]  # noqa: E731
    snapshot = {
        "segments": [{"address": 1, "total_size": 4 << 20, "allocated_size": 0, "segment_pool_id": (0, 0)},
                     {"address": 2, "total_size": 2 << 20, "allocated_size": 1 << 20, "segment_pool_id": (1, 3)}],
        "device_traces": [[
            {"action": "segment_alloc", "addr": 1, "size": 4 << 20, "frames": frame("first")},
            {"action": "segment_free", "addr": 1, "size": 4 << 20, "frames": []},
            {"action": "segment_alloc", "addr": 1, "size": 4 << 20, "frames": frame("second")},
            {"action": "segment_alloc", "addr": 2, "size": 2 << 20, "frames": frame("graph")},
            {"action": "segment_alloc", "addr": 3, "size": 8 << 20, "frames": frame("gone")},
            {"action": "segment_free", "addr": 3, "size": 8 << 20, "frames": []},
        ]]}
    rows, by_pool, frees = attribute(snapshot)
    assert frees == 2 and by_pool == {"default": 4.0, "graph pool": 2.0}
    assert [(r["pool"], r["source"], r["segments"]) for r in rows] == [("default", "x.py:1 second", 1),
                                                                       ("graph pool", "x.py:1 graph", 1)]
    assert attribute(snapshot, 0, 2)[1] == {}  # that address's live segment is the later allocation's
    assert attribute(snapshot, 2)[0] == rows and attribute(snapshot, 2)[2] == 1


@pytest.mark.parametrize("takes_buffers", [False, True])
@pytest.mark.parametrize("parent_width", [False, True])
def test_prefill_bench_old_arm_takes_the_current_call(tmp_path, takes_buffers, parent_width):
    """prefill_bench's old arm, given the current `_prefill` call (11 arguments, then the arm's buffers): the LUT
    width swapped for the parent width when asked, the buffers passed on only to an old `_prefill` that takes them,
    and an old class named in --old-names defined over the kernel module for it."""
    from benchmarks import prefill_bench

    extra = ", buffers=None" if takes_buffers else ""
    old = tmp_path / "old_moe_kernels.py"
    old.write_text(textwrap.dedent(f"""
        class Helper:
            tag = "old"

        def _prefill(hidden, topk_ids, topk_weights, pool_words, pool_halves, q, plane_off, lut_off, D, F,
                     lut_width{extra}):
            return Helper.tag, lut_width, {"buffers" if takes_buffers else "None"}
    """))
    arms = prefill_bench.load_old(str(old), ["Helper"], parent_width)
    prefill_bench.PARENT_BITS[0] = 6
    got = arms["old"](*range(10), 4, "bufs")
    assert got == ("old", 6 if parent_width else 4, "bufs" if takes_buffers else None)


def test_run_budgets_collects_each_runs_summary_and_a_refusal(ap_dir, tmp_path):
    """One process per budget: the bundled default's budget drops widths and brings them back; a budget below the
    weights is refused, and its row keeps the reason."""
    from benchmarks import run_budgets

    assert run_budgets.main(["--model", str(ap_dir), "--device", "cpu", "--budgets", "41MiB,4MiB",
                             "--page-store-dir", str(tmp_path / "store"), "--out-dir", str(tmp_path)]) == 1
    (path,) = tmp_path.glob("run_budgets-*.json")
    res = json.loads(path.read_text())
    ok, refused = res["rows"]
    assert res["complete"] and ok["rc"] == 0 and ok["budget"] == "41MiB" and ok["requests"] == 8
    assert ok["finish_reasons"] == {"length": 8} and ok["generated_tokens"] == 8 * 32
    assert ok["widths_dropped"] and ok["widths_returned"] and ok["offload_triggers"] >= 1
    assert ok["warnings"] == []
    assert refused["rc"] != 0 and "budget" in refused["error"] and "requests" not in refused


def test_serving_quality_scores_both_waves_of_every_config(ap_dir, tmp_path):
    """Each configuration scores the light and then the heavy wave (every window's tokens once), with perplexity,
    steps and widths; a static width the budget cannot hold gets a row with the budget's refusal."""
    from benchmarks import serving_quality

    assert serving_quality.main(["--model", str(ap_dir), "--windows", "4", "--light", "1", "--ctx", "32", "--gen", "4",
                                 "--widths", "3,8", "--page-store-dir", str(tmp_path / "store"),
                                 "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("serving_quality-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [r["config"] for r in rows] == ["8-bit, no budget", "pagedweight", "uniform-3", "uniform-8"]
    for row in rows:
        if "error" in row:
            assert "gpu_memory_budget too small" in row["error"]
            continue
        assert row["light"]["scored_tokens"] == 32 and row["heavy"]["scored_tokens"] == 4 * 32
        assert row["heavy"]["preemptions"] >= 0 and 3 <= row["heavy"]["mean_width"] <= 8
        assert np.isfinite(row["ppl"]) and row["ppl"] > 1
    assert rows[0]["light"]["mean_width"] == rows[0]["heavy"]["mean_width"] == 8.0
    assert rows[2]["heavy"]["mean_width"] == 3.0 and rows[2]["ppl"] != rows[0]["ppl"]


def test_serving_quality_observe_every_gives_a_pagedweight_row_each(ap_dir, tmp_path):
    """--observe-every N,M: one PagedWeight row per routing-observation interval, in place of the default one."""
    from benchmarks import serving_quality

    assert serving_quality.main(["--model", str(ap_dir), "--windows", "2", "--light", "1", "--ctx", "32", "--gen", "4",
                                 "--widths", "8", "--observe-every", "1,4", "--page-store-dir", str(tmp_path / "store"),
                                 "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("serving_quality-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [r["config"] for r in rows] == ["8-bit, no budget", "pagedweight-observe1", "pagedweight-observe4",
                                           "uniform-8"]
    assert all(r["heavy"]["scored_tokens"] == 2 * 32 and np.isfinite(r["ppl"]) for r in rows[1:3])


def test_prefix_cost_rows(tmp_path):
    """benchmarks/prefix_cost: one row per prompt length and mode; only with caching are blocks kept, so only those
    rows time an eviction."""
    from benchmarks import prefix_cost

    assert prefix_cost.main(["--layers", "2", "--prompts", "64", "--reps", "2", "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("prefix_cost-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [(r["prompt_tokens"], r["prefix_caching"]) for r in rows] == [(64, False), (64, True)]
    assert rows[0]["evict_us_per_block"] is None and rows[1]["evict_us_per_block"] > 0
    assert all(r[k] > 0 for r in rows for k in ("start_us", "free_us", "hit_start_us"))


def test_engine_bench_rows_time_the_whole_batch_s_decode_steps(tmp_path):
    """The table's median decode step is of the steps the whole batch decoded: the requests that finish their
    prompts first also finish first, and the steps of the draining batch after them are left out (they were in)."""
    from benchmarks import engine_bench

    assert engine_bench.main(["--tiny", "--device", "cpu", "--bits", "3", "--batches", "4", "--skip-fp16",
                              "--paged-home", "match", "--seq-len", "96", "--gen", "12", "--chunk", "64", "--trace",
                              "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("engine_bench-*.json")
    for row in json.loads(path.read_text())["rows"]:
        cols, steps = row["step_trace"]["columns"], row["step_trace"]["rows"]
        ms, tokens, running = (cols.index(c) for c in ("step_ms", "tokens", "running"))
        whole = [b[ms] for a, b in zip(steps, steps[1:]) if a[running] == 4 and b[tokens] == 4]
        assert any(s[tokens] < 4 for s in steps), "no draining steps: the case tests nothing"
        assert row["decode_step_ms_median"] == pytest.approx(float(np.median(whole)), abs=0.02), row["config"]


def test_a_run_cut_by_its_time_budget_is_not_complete(tmp_path):
    """A configuration skipped or a mode cut short for the time budget leaves `complete` false (it was true
    whenever the script reached its end), and a cut mode says over how many requests its TTFT percentiles are."""
    from benchmarks import engine_bench, kv_pressure

    assert engine_bench.main(["--tiny", "--device", "cpu", "--bits", "3", "--batches", "1", "--skip-fp16",
                              "--paged-home", "match", "--gen", "4", "--time-budget-s", "0",
                              "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("engine_bench-*.json")
    res = json.loads(path.read_text())
    assert not res["complete"] and res["skipped_configs"] and not res["rows"]
    assert kv_pressure.main(["--tiny", "--device", "cpu", "--time-budget-s", "0.5", "--static-bits", "none",
                             "--warmup-replays", "0", "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("kv_pressure-*.json")
    res = json.loads(path.read_text())
    (row,) = res["rows"]
    assert row["cut_short"] and not res["complete"] and row["ttft_requests"] < row["requests"]


def test_step_host_times_prefill_and_decode_steps(tmp_path):
    """step_host at toy size on the CPU: each fresh prompt's prefill step and the decode steps after are timed (the
    graph parts, the launch A/B and cuBLAS's first sights are CUDA-only and left out)."""
    from benchmarks import step_host

    assert step_host.main(["--tiny", "--device", "cpu", "--prompts", "2", "--repeats", "3",
                           "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("step_host-*.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert len(row["prefill_ms"]) == 2 and len(row["decode_step_ms"]) == 3 and min(row["prefill_ms"]) > 0
    assert row["decode"] == [] and row["decode_stats_at_start"] is None and "launch_us" not in row


def test_result_files_keep_lists_of_values_on_one_line(tmp_path):
    """write_result's JSON reads back as the record (keys as json.dumps makes them); a list of values (a trace row)
    is one line, nested lists and dicts one item a line; a large record is one line without spaces."""
    from benchmarks.common import result_json, write_result

    record = {"rows": [{"trace": {"columns": ["a", "b"], "rows": [[1.5, None], [2, "x, y"]]}, 7: {}, "e": []}]}
    path = write_result("smoke", record["rows"], out_dir=tmp_path, label="fmt")
    saved = json.loads(path.read_text())
    assert saved["rows"] == json.loads(json.dumps(record["rows"])) and saved["benchmark"] == "smoke"
    lines = result_json(record).splitlines()
    assert '     [1.5, null],' in lines and '     [2, "x, y"]' in lines and '    "columns": ["a", "b"],' in lines
    big = {"rows": [{"trace": [[i, 0.5] for i in range(20_000)]}]}  # past COMPACT_OVER: one line, no spaces
    text = result_json(big)
    assert "\n" not in text and " " not in text and json.loads(text) == big


def test_source_digest_names_the_benchmarked_code_by_content(tmp_path, capsys):
    """source_digest moves with any byte or path of the benchmarked sources and not with what is not one (tests, docs,
    caches, the GPU box's folder links); `rev_digest` of a commit equals the digest of that commit's checkout, and a
    result file records its run's digest."""
    import subprocess

    from benchmarks.common import main, rev_digest, source_digest, write_result

    files = {"pagedweight/engine.py": "E = 1\n", "cuda/k.py": "K = 2\n", "actors/a.py": "", "benchmarks/b.py": "B\n",
             "tests/t.py": "T\n", "README.md": "r\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(git + ["init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(git + ["add", "-A"], cwd=tmp_path, check=True)
    subprocess.run(git + ["commit", "-qm", "x"], cwd=tmp_path, check=True)
    base = source_digest(tmp_path)
    assert rev_digest("HEAD", tmp_path) == base and len(base) == 16
    (tmp_path / "pagedweight/cuda").symlink_to("../cuda")  # what the GPU box's step runner adds
    (tmp_path / "cuda/__pycache__").mkdir()
    (tmp_path / "cuda/__pycache__/k.py").write_text("cached")
    (tmp_path / "tests/t.py").write_text("T2\n")
    (tmp_path / "README.md").write_text("r2\n")
    (tmp_path / "cuda/notes.md").write_text("n\n")
    assert source_digest(tmp_path) == base
    (tmp_path / "cuda/k.py").write_text("K = 3\n")
    assert source_digest(tmp_path) not in (base, rev_digest("HEAD", tmp_path))
    (tmp_path / "cuda/k.py").rename(tmp_path / "cuda/k2.py")
    (tmp_path / "cuda/k2.py").write_text("K = 2\n")  # the same bytes under another name
    assert source_digest(tmp_path) != base
    saved = json.loads(write_result("smoke", [], out_dir=tmp_path / "out").read_text())
    assert saved["source_digest"] == source_digest()  # this checkout's, untouched by the run
    assert main(["digest"]) == 0 and capsys.readouterr().out.split() == [saved["source_digest"]]


def test_layout_bench_times_each_shape_and_token_count(tmp_path):
    from benchmarks import layout_bench

    assert layout_bench.main(["--tokens", "16,40", "--calls", "2", "--rounds", "1", "--out-dir", str(tmp_path)]) == 0
    out = json.loads(next(tmp_path.glob("layout_bench-*.json")).read_text())
    assert [(r["shape"], r["tokens"]) for r in out["rows"]] == [(s, t) for s in layout_bench.SHAPES for t in (16, 40)]
    assert all(r["us_per_call_best"] > 0 for r in out["rows"]) and out["first_call_s"] >= 0


def test_gc_pauses_times_full_collections_and_counts_the_automatic_ones(tmp_path):
    from benchmarks import gc_pauses

    assert gc_pauses.main(["--waves", "1", "--requests", "3", "--tokens", "4", "--out-dir", str(tmp_path)]) == 0
    (row,) = json.loads(next(tmp_path.glob("gc_pauses-*.json")).read_text())["rows"]
    assert row["arm"] == "plain" and row["requests"] == 3 and row["steps"] >= 4
    assert row["tracked_objects"] > 1000 and row["full_collection_ms_median"] > 0
    assert all(row[f"gen{g}"]["collections"] >= 0 for g in range(3))
