"""Ray actors on the session's local cluster: planner merge, engine actor restart, evaluation job."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import msgpack
import numpy as np
import pytest
import ray

from conftest import ENGINE_CPUS, ENGINE_OPTIONS, ROOT
from helpers import budget_with
from pagedweight.actors.engine_actor import EngineActor, EngineConfig
from pagedweight.actors.page_store_actor import page_store_for_node
from pagedweight.actors.planner_actor import PlannerActor, decode_reply, encode_table, get_or_create_planner
from pagedweight.sampling import SamplingParams

# ---------------------------------------------------------------- planner


def test_planner_merges_token_weighted_and_buckets_by_rank(ray_cluster):
    rng = np.random.default_rng(0)
    L, E = 3, 8
    a = rng.random((L, E)) + 0.01
    b = rng.random((L, E)) + 0.01
    a /= a.sum(1, keepdims=True)
    b /= b.sum(1, keepdims=True)
    planner = PlannerActor.remote(n_buckets=4)
    first = decode_reply(ray.get(planner.push.remote(encode_table("e0", a, tokens=300))))
    assert first["engines"] == ["e0"] and np.allclose(first["mass"], a, atol=1e-6)
    merged = decode_reply(ray.get(planner.push.remote(encode_table("e1", b, tokens=100))))
    want = (300 * a + 100 * b) / 400  # rows of a and b sum to 1, so this one does too
    assert merged["engines"] == ["e0", "e1"] and merged["tokens"] == 400 and merged["version"] == 2
    np.testing.assert_allclose(merged["mass"], want, rtol=1e-5)
    for layer in range(L):  # bucket = rank // (E / n_buckets), hottest expert first
        order = np.argsort(-want[layer], kind="stable")
        assert [int(merged["buckets"][layer, e]) for e in order] == [r * 4 // E for r in range(E)]

    # a re-push replaces that engine's table; forget drops it
    again = decode_reply(ray.get(planner.push.remote(encode_table("e1", a, tokens=100))))
    np.testing.assert_allclose(again["mass"], a, rtol=1e-5)
    assert ray.get(planner.forget.remote("e1")) and not ray.get(planner.forget.remote("e1"))
    assert decode_reply(ray.get(planner.merged.remote()))["engines"] == ["e0"]

    with pytest.raises(ValueError, match="table"):  # wrong shape for this cluster
        ray.get(planner.push.remote(encode_table("e2", np.ones((L, E + 1)) / (E + 1), tokens=1)))
    bad = msgpack.packb({"engine_id": "e3", "tokens": 1.0, "shape": [L, E],
                         "mass": (-np.ones((L, E), "<f4")).tobytes()})
    with pytest.raises(ValueError, match="negative"):
        ray.get(planner.push.remote(bad))
    ray.kill(planner)


# ---------------------------------------------------------------- engine actor


def _long_params(max_model_len: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_model_len - 16, ignore_eos=True)


def test_engine_actor_restart_fails_in_flight_and_rebuilds(ray_cluster, ap_model_dir):
    cfg = EngineConfig(str(ap_model_dir), engine_options=ENGINE_OPTIONS, routing_sync_s=0.2)
    actor = EngineActor.options(num_cpus=ENGINE_CPUS).remote(cfg, "restart-test")
    info = ray.get(actor.info.remote(), timeout=120)
    assert info["restarted"] is False and info["device"] == "cpu"
    assert info["page_store_dir"] and os.path.isfile(os.path.join(info["page_store_dir"], "index.msgpack"))
    stores = ray.get(page_store_for_node(info["node_id"]).stores.remote())  # the node's store actor owns it
    assert stores[str(ap_model_dir.resolve())] == info["page_store_dir"]
    short = SamplingParams(max_tokens=8)
    before = ray.get(actor.generate.remote("def main():\n", short), timeout=60)
    assert before.finished and before.finish_reason in ("stop", "length")

    stream = actor.stream.options(num_returns="streaming").remote("import os\n", _long_params(info["max_model_len"]))
    blocking = actor.generate.remote("class A:\n", _long_params(info["max_model_len"]))
    first = ray.get(next(stream), timeout=60)
    assert not first.finished
    ray.kill(actor, no_restart=False)  # the process dies; Ray restarts the actor

    t0 = time.monotonic()
    with pytest.raises(ray.exceptions.RayActorError):
        for ref in stream:  # in-flight stream fails with a clear error, it does not hang
            ray.get(ref, timeout=60)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(blocking, timeout=60)
    assert time.monotonic() - t0 < 60

    deadline = time.monotonic() + 120
    while True:
        try:
            after_info = ray.get(actor.info.remote(), timeout=120)
            break
        except ray.exceptions.RayActorError:  # still restarting
            assert time.monotonic() < deadline
            time.sleep(0.5)
    assert after_info["restarted"] is True and after_info["pid"] != info["pid"]
    assert after_info["page_store_dir"] == info["page_store_dir"]  # rebuilt from the same node store
    after = ray.get(actor.generate.remote("def main():\n", short), timeout=60)
    assert after.token_ids == before.token_ids and after.text == before.text  # same greedy output
    stats = ray.get(actor.stats.remote())
    assert stats["in_flight"] == 0 and stats["kv_free_blocks"] == stats["kv_total_blocks"]

    # the engine pushed its routing mass to the cluster planner (after serving, at most 0.2 s apart)
    from pagedweight.apformat import load_ap
    from pagedweight.runner import planes_id

    planner = get_or_create_planner(planes_id(load_ap(ap_model_dir, verify=False)))  # this model's

    def cluster_table():
        try:
            return decode_reply(ray.get(planner.merged.remote()))
        except ValueError:  # nothing pushed yet
            return {"engines": []}

    deadline = time.monotonic() + 30
    while "restart-test" not in (reply := cluster_table())["engines"]:
        assert time.monotonic() < deadline, reply["engines"]
        ray.get(actor.generate.remote("x = 1\n", short))
    hf = json.loads((ap_model_dir / "config.json").read_text())
    assert reply["mass"].shape == (hf["num_hidden_layers"], hf["num_experts"])
    assert np.allclose(reply["mass"].sum(1), 1, atol=1e-5)
    ray.kill(actor, no_restart=True)


# ---------------------------------------------------------------- job entrypoint


def _reference_ppl(ap_dir, ctx: int, windows: int) -> float:
    """Perplexity of the same windows with a dense model whose experts are the checkpoint's planes
    dequantized at the parent width (apformat.load_ap_model), loaded here: no engine, pool or actor."""
    import torch
    import torch.nn.functional as F

    from pagedweight.actors.jobs.evaluate import token_windows
    from pagedweight.apformat import load_ap, load_ap_model

    torch.set_num_threads(1)
    model = load_ap_model(ap_dir, load_ap(ap_dir, verify=False).parent_bits).eval()
    nll, n = 0.0, 0
    for w in token_windows(ap_dir, (ROOT / "data" / "eval.txt").read_text(), ctx, windows):
        ids = torch.tensor([w])
        with torch.inference_mode():
            nll += F.cross_entropy(model(ids[:, :-1])[0].float(), ids[0, 1:], reduction="sum").item()
        n += len(w) - 1
    return math.exp(nll / n)


def test_evaluation_job_spreads_over_engines(ray_cluster, ap_model_dir, tmp_path):
    out = tmp_path / "eval.json"
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.address, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pagedweight.actors.jobs.evaluate", str(ap_model_dir), "--mode", "all",
           "--ctx", "64", "--windows", "6", "--num-prompts", "4", "--max-tokens", "8", "--shard", "1",
           "--num-engines", "2", "--engine-cpus", "0.25", "--engine-options", json.dumps(ENGINE_OPTIONS),
           "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "perplexity" in proc.stdout + proc.stderr  # tqdm progress was shown
    result = json.loads(out.read_text())
    ids = [e["engine_id"] for e in result["engines"]]  # named by the job: two jobs' engines never share a name
    assert sorted(i.split("-")[1] for i in ids) == ["cpu0", "cpu1"] and len({i.split("-")[0] for i in ids}) == 1
    assert ids[0].startswith("job") and ids[0].split("-")[0] != "job"
    ppl = result["perplexity"]
    assert ppl["windows"] == 6 and ppl["tokens"] == 6 * 64
    assert sum(ppl["windows_per_engine"]) == 6 and min(ppl["windows_per_engine"]) >= 1  # both engines worked
    assert ppl["ppl"] == pytest.approx(_reference_ppl(ap_model_dir, 64, 6), rel=1e-3)
    gen = result["generation"]
    assert gen["prompts"] == 4 and len(gen["samples"]) == 4
    assert 4 <= gen["generated_tokens"] <= 4 * 8 and gen["tokens_per_s"] > 0
    assert sum(gen["finish_reasons"].values()) == 4 and set(gen["finish_reasons"]) <= {"stop", "length"}


def test_reference_experts_run_without_cuda_graphs(ap_model_dir):
    """The torch twin reads routing on the host, so an engine built on it must not capture CUDA graphs (a failed
    capture broke every later one on the H200); the fused kernel's engine keeps them."""
    from pagedweight.actors.engine_actor import build_llm
    from pagedweight.cuda.reference import moe_forward_reference
    from pagedweight.runner import APExperts

    twin = build_llm(EngineConfig(str(ap_model_dir), device="cpu", use_page_store=False, expert_impl="reference"))
    assert twin.options.cuda_graphs is False
    assert all(m.fn is moe_forward_reference for m in twin.model.modules() if isinstance(m, APExperts))
    fused = build_llm(EngineConfig(str(ap_model_dir), device="cpu", use_page_store=False, expert_impl="auto"))
    assert fused.options.cuda_graphs is True


@pytest.mark.parametrize("kind", ["cumulative", "delta"])
def test_coalesced_stream_joins_deltas_of_a_slow_consumer(ap_model_dir, kind):
    """A consumer slower than the engine gets fewer outputs, whose joined deltas are exactly the text of the
    uncoalesced run (greedy: the same tokens), and the last one is the finished output. The slow consumer waits
    after its first output until the engine has finished the request, so what piles up does not depend on how fast
    the machine steps (a fixed 50 ms pause let a loaded CI machine step slower than the consumer read)."""
    import asyncio

    from pagedweight.actors.engine_actor import AsyncEngine, build_llm

    engine = AsyncEngine(build_llm(EngineConfig(str(ap_model_dir), device="cpu", use_page_store=False)), "coalesce")
    params = SamplingParams(max_tokens=24, ignore_eos=True, output_kind=kind, logprobs=1,
                            prompt_logprobs=1).validate()

    async def run(coalesce: bool, slow: bool) -> list:
        outs = []
        async for out in engine.generate("def main():", params, coalesce=coalesce):
            outs.append(out)
            for _ in range(1200 if slow else 0):  # up to 60 s
                if not engine.llm.has_unfinished():
                    break
                await asyncio.sleep(0.05)
        return outs

    try:
        plain = asyncio.run(run(False, False))
        joined = asyncio.run(run(True, True))
    finally:
        engine.shutdown()
    assert len(plain) == 24 and plain[-1].finished
    assert joined[-1].finished and joined[-1].finish_reason == plain[-1].finish_reason == "length"
    assert "".join(o.delta_text for o in joined) == joined[-1].text == plain[-1].text
    if kind == "delta":  # each joined output carries the tokens (and log-probabilities) of the outputs it merged
        assert [t for o in joined for t in o.token_ids] == [t for o in plain for t in o.token_ids]
        assert len(plain[-1].token_ids) == 1
        got, want = [e for o in joined for e in o.logprobs], [e for o in plain for e in o.logprobs]
    else:
        assert joined[-1].token_ids == plain[-1].token_ids
        got, want = joined[-1].logprobs, plain[-1].logprobs
    assert len(got) == len(want) == 24
    assert all(g.keys() == w.keys() and all(abs(g[t] - w[t]) < 1e-6 for t in g) for g, w in zip(got, want))
    assert [o.completion_tokens for o in plain] == list(range(1, 25)) and joined[-1].completion_tokens == 24
    assert len(joined) < len(plain)  # outputs piled up while the consumer slept were merged
    # the prompt's log-probabilities: in the first output only (delta) or in every output
    assert joined[0].prompt_logprobs == plain[0].prompt_logprobs
    assert len(plain[0].prompt_logprobs) == plain[0].prompt_tokens
    if kind == "delta":
        assert all(o.prompt_logprobs is None for o in joined[1:] + plain[1:])
    else:
        assert joined[-1].prompt_logprobs == plain[-1].prompt_logprobs == plain[0].prompt_logprobs


def test_a_caller_cancelled_while_its_request_is_added_aborts_it(ap_model_dir):
    """The add waits for the engine lock (a step holds it); a caller cancelled then (a client that hung up) must
    still have its request aborted once the add lands, not run to max_tokens with nobody reading."""
    import asyncio
    import time

    from pagedweight.actors.engine_actor import AsyncEngine, build_llm

    engine = AsyncEngine(build_llm(EngineConfig(str(ap_model_dir), device="cpu", use_page_store=False)), "cancel")
    params = SamplingParams(max_tokens=500, ignore_eos=True).validate()

    async def cancelled_while_adding() -> None:
        with engine._lock:  # what a long step does
            task = asyncio.ensure_future(engine.generate("def main():", params).__anext__())
            await asyncio.sleep(0.2)  # the add's thread now waits for the lock
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        deadline = time.monotonic() + 20  # the loop lives on (as the replica's does) while the add lands
        while (engine.num_aborted == 0 or engine.llm.has_unfinished()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    try:
        asyncio.run(cancelled_while_adding())
        assert engine.num_aborted == 1 and not engine.llm.has_unfinished() and not engine._queues
    finally:
        engine.shutdown()


def test_final_only_stream_has_one_output_and_no_time_to_first_token(ap_model_dir):
    """A final_only request yields its finished output alone; its metrics record the latency but no time to first
    token (its first output is its last), where a cumulative request records both."""
    import asyncio

    from pagedweight.actors.engine_actor import AsyncEngine, build_llm

    class Recorder:
        def __init__(self):
            self.requests, self.queued = [], []

        def observe_request(self, latency_s, ttft_s, finish_reason, work="generate", queued_s=None):
            self.requests.append((latency_s, ttft_s, finish_reason))
            self.queued.append(queued_s)

        def update(self, stats):
            pass

    metrics = Recorder()
    engine = AsyncEngine(build_llm(EngineConfig(str(ap_model_dir), device="cpu", use_page_store=False)), "final",
                         metrics)

    async def run(kind: str) -> list:
        params = SamplingParams(max_tokens=6, ignore_eos=True, output_kind=kind).validate()
        return [out async for out in engine.generate("def main():", params)]

    try:
        final, cumulative = asyncio.run(run("final_only")), asyncio.run(run("cumulative"))
    finally:
        engine.shutdown()
    assert len(final) == 1 and final[0].finished and final[0].token_ids == cumulative[-1].token_ids
    assert len(cumulative) == 6
    (lat_f, ttft_f, reason_f), (lat_c, ttft_c, reason_c) = metrics.requests
    assert ttft_f is None and lat_f > 0 and reason_f == reason_c == "length"
    assert 0 < ttft_c < lat_c
    # both record their wait for the first step (the engine's, on every output): a final_only request's too
    assert all(q is not None and 0 <= q < lat for q, (lat, _, _) in zip(metrics.queued, metrics.requests))


def test_idle_engine_loop_brings_the_widths_back(ap_model_dir, tmp_path):
    """The engine's step loop, once its requests have ended and none arrive, reloads what KV pressure took: the
    widths return to home with no further request (an idle loop takes no steps, so the reload window alone would
    keep them low)."""
    import asyncio

    from pagedweight.actors.engine_actor import AsyncEngine
    from pagedweight.engine import LLM

    store = str(tmp_path / "store")
    probe = LLM(ap_model_dir, device="cpu", block_size=16, page_store_dir=store)
    budget = budget_with(probe, 8)
    del probe
    llm = LLM(ap_model_dir, budget, "cpu", block_size=16, max_num_batched_tokens=16, page_store_dir=store)
    home = llm.planner.home.copy()
    engine = AsyncEngine(llm, "idle-reload")
    params = SamplingParams(max_tokens=24, ignore_eos=True).validate()
    prompts = ["def main():", "import os\n", "class Node:", "for i in range(10):"]

    async def run_all() -> list:
        async def one(p):
            return [o async for o in engine.generate(p, params)][-1]
        return await asyncio.gather(*(one(p) for p in prompts))

    try:
        outs = asyncio.run(run_all())
        assert all(o.finish_reason == "length" for o in outs)
        assert llm.stats()["offload_triggers"] > 0, "the scenario no longer lowers widths"
        deadline = time.monotonic() + 30
        while True:
            with engine._lock:
                back = (llm.committed_widths() == home).all() and llm.mover.idle()
            if back:
                break
            assert time.monotonic() < deadline, "the idle loop never brought the widths back"
            time.sleep(0.05)
        assert llm.stats()["reload_triggers"] > 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("extra,reason", [
    (["--shard", "-1"], "--shard -1: must be >= 1"), (["--windows", "0"], "--windows 0: must be >= 1"),
    (["--ctx", "1023"], "--ctx 1023: a window and its sampled token exceed the model's 1024 positions"),
    (["--data", "/nonexistent.txt"], "--data /nonexistent.txt: no such file"),
    (["--engine-options", "{bad"], "--engine-options is not JSON"),
    (["--gpus-per-engine", "2"], "--gpus-per-engine must be in [0, 1]"),
    (["--gpu-memory-budget", "lots"], "--gpu-memory-budget: "),
])
def test_evaluation_job_refuses_bad_arguments_before_starting(model_dir, extra, reason, capsys):
    """Refused by the parser before Ray or an engine starts (a --shard -1 ran nothing and reported success)."""
    from pagedweight.actors.jobs.evaluate import main

    with pytest.raises(SystemExit) as exit_info:
        main([str(model_dir), *extra])
    assert exit_info.value.code == 2 and reason in capsys.readouterr().err


def test_gpu_engines_asked_of_a_cluster_without_gpus_wait_for_them(ray_cluster, ap_model_dir):
    """On an autoscaling cluster whose GPU workers are at 0, `num_engines` GPU engines with device "cuda" are
    started pending (the demand that scales GPU nodes up), not quietly replaced by CPU engines; device "auto" there
    still means CPU engines."""
    import unittest.mock as mock

    import ray

    from pagedweight.actors.engine_actor import start_engines

    assert ray.cluster_resources().get("GPU", 0) == 0
    cfg = EngineConfig(str(ap_model_dir), device="cuda", use_page_store=False)
    (pending,) = start_engines(cfg, num_engines=1, cpus_per_engine=0, gpus_per_engine=1)
    try:
        ready, _ = ray.wait([pending.info.remote()], timeout=2)
        assert not ready  # waits for a GPU
    finally:
        ray.kill(pending, no_restart=True)
    # a cluster with GPUs still refuses more engines than it holds
    with mock.patch.object(ray, "cluster_resources", return_value={"GPU": 1.0}):
        with pytest.raises(ValueError, match="need 2 GPUs"):
            start_engines(cfg, num_engines=2, gpus_per_engine=1)
    # device "cuda" that would land on CPU engines (no engine count to wait for, or no GPU per engine) is refused
    # before any actor starts (each would fail inside with "CUDA is not available")
    with pytest.raises(ValueError, match="no GPU in the cluster: give num_engines"):
        start_engines(cfg)
    with pytest.raises(ValueError, match="gpus_per_engine 0"):
        start_engines(cfg, num_engines=1, gpus_per_engine=0)


# ---------------------------------------------------------------- AsyncEngine with a stand-in LLM (no Ray)
class _StandInLLM:
    """What AsyncEngine calls of an LLM: requests finish after one step of `step_s`; `fail` makes the step raise."""

    planner = None

    def __init__(self, step_s: float = 0.0, fail: bool = False, slow_add: str | None = None) -> None:
        self.step_s, self.fail, self.slow_add, self.requests = step_s, fail, slow_add, []
        self.num_tokens_computed = 0
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def add_request(self, prompt, params, request_id):
        if prompt == self.slow_add:
            time.sleep(0.2)  # an add still in progress while the step loop fails
        self.requests.append(request_id)
        return request_id

    def abort(self, request_id) -> bool:
        return False

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self):
        from pagedweight.engine import RequestOutput

        time.sleep(self.step_s)
        if self.fail:
            raise RuntimeError("boom")
        done, self.requests = self.requests, []
        return [RequestOutput(request_id=r, prompt_token_ids=[], token_ids=[1], text="x", delta_text="x",
                              finished=True, finish_reason="length") for r in done]

    def step_idle(self, max_s: float | None = None) -> bool:
        return False

    def stats(self) -> dict:
        return {}


def test_a_request_added_while_the_step_loop_fails_is_answered():
    """A step fails while a second request is being added (the add holds the engine lock): every caller gets an
    error, as an output or as EngineDeadError; none waits forever (the failure path used to fail the requests it
    saw without the lock, and a request registered just after waited on a loop that had ended)."""
    import asyncio

    from pagedweight.actors.engine_actor import AsyncEngine, EngineDeadError

    engine = AsyncEngine(_StandInLLM(step_s=0.05, fail=True, slow_add="slow"), "failing")

    async def one(prompt: str) -> str:
        try:
            outs = [o async for o in engine.generate(prompt, None, request_id=prompt)]
        except EngineDeadError:
            return "dead"
        return outs[-1].finish_reason

    async def both():
        first = asyncio.ensure_future(one("fast"))
        await asyncio.sleep(0.02)  # the step holding the lock is under way; the slow add waits for it
        return await asyncio.wait_for(asyncio.gather(first, one("slow")), timeout=5)

    try:
        reasons = asyncio.run(both())
        assert reasons[0] == "error" and reasons[1] in ("error", "dead"), reasons
        assert not engine._queues
    finally:
        engine.shutdown()
    assert engine.llm.closed  # the stopped loop's engine let go of its page store mapping
    with pytest.raises(EngineDeadError, match="shut down"):  # nothing reaches the closed engine
        engine.stats()
    with pytest.raises(EngineDeadError, match="shut down"):
        engine.call(lambda llm: llm)


def test_request_latency_counts_the_wait_for_the_engine_lock():
    """A request that arrives during a step waits for the engine lock before its add: its latency and time to
    first token count that wait (they started after the add, and a 0.3 s step's wait was left out)."""
    import asyncio

    from pagedweight.actors.engine_actor import AsyncEngine

    class Metrics:
        def __init__(self) -> None:
            self.seen = []

        def observe_request(self, latency, ttft, reason, work="generate", queued=None) -> None:
            self.seen.append((latency, ttft, reason))

        def update(self, stats) -> None:
            pass

    metrics = Metrics()
    engine = AsyncEngine(_StandInLLM(step_s=0.3), "slow-steps", metrics=metrics)

    async def run(prompt: str) -> float:
        t = time.perf_counter()
        [o async for o in engine.generate(prompt, None)]
        return time.perf_counter() - t

    async def two():
        first = asyncio.ensure_future(run("a"))
        await asyncio.sleep(0.05)  # a's step holds the lock
        return await run("b"), await first

    try:
        wall_b, _ = asyncio.run(two())
        latency, ttft, _ = metrics.seen[-1]
        assert wall_b > 0.5 and latency > wall_b - 0.05 and ttft > wall_b - 0.05, (wall_b, metrics.seen)
    finally:
        engine.shutdown()


def test_routing_sync_weighs_a_table_by_the_tokens_computed_since_the_last():
    """The table an engine pushes to the cluster planner weighs the tokens its steps computed since its last push
    (prefill included), not its outputs (a final-only request counted 1 however long)."""
    from types import SimpleNamespace

    from pagedweight.actors import engine_actor
    from pagedweight.actors.engine_actor import AsyncEngine

    planner = PlannerActor.__ray_metadata__.modified_class.__new__(PlannerActor.__ray_metadata__.modified_class)
    planner.__init__(2)
    llm = _StandInLLM()
    llm.planner = SimpleNamespace(knobs=SimpleNamespace(n_buckets=2))
    llm.routing_mass = lambda: np.full((2, 4), 0.25)
    llm.set_routing_mass = lambda mass: None
    handle = SimpleNamespace(**{m: SimpleNamespace(remote=getattr(planner, m)) for m in ("push", "merged", "forget")})
    engine = AsyncEngine(llm, "weighed", planner=handle, routing_sync_s=3600.0)
    get = engine_actor.ray.get
    engine_actor.ray.get = lambda ref, timeout=None: ref  # the stand-in planner answers in place
    try:
        llm.num_tokens_computed = 37
        assert engine.sync_routing()["pushed_tokens"] == 37
        llm.num_tokens_computed = 50
        assert engine.sync_routing()["pushed_tokens"] == 13
    finally:
        engine_actor.ray.get = get
        engine.shutdown()
    assert planner.forget("weighed") is False  # shutdown already took it out of the merge


def test_page_store_follows_a_checkpoint_requantized_in_place(tmp_path, monkeypatch):
    """The node's page store names a store by the checkpoint's planes: a checkpoint re-quantized in the same
    directory gets a fresh store (it was cached by directory, and every new engine then found a store of other
    planes and failed to start); `destroy` removes every store written."""
    from types import SimpleNamespace

    import pagedweight.apformat as apformat
    import pagedweight.runner as runner
    from pagedweight.actors.page_store_actor import PageStoreActor

    (tmp_path / apformat.MANIFEST).write_text("{}")
    planes, written = {"id": "aaaa"}, []
    monkeypatch.setattr(apformat, "load_ap", lambda path, verify=False: SimpleNamespace(id=planes["id"]))
    monkeypatch.setattr(runner, "planes_id", lambda ap: ap.id)
    monkeypatch.setattr(runner, "ap_weights", lambda ap, path: written.append(path.name) or SimpleNamespace(
        store=SimpleNamespace(close=lambda: None)))
    cls = PageStoreActor.__ray_metadata__.modified_class
    store = cls.__new__(cls)
    store.__init__(str(tmp_path / "shm"))
    assert store.ensure(str(tmp_path)) == str(tmp_path / "shm" / "pagedweight-aaaa")
    assert store.ensure(str(tmp_path)).endswith("pagedweight-aaaa") and written == ["pagedweight-aaaa"]  # once
    planes["id"] = "bbbb"
    assert store.ensure(str(tmp_path)).endswith("pagedweight-bbbb") and written[-1] == "pagedweight-bbbb"
    assert store.destroy() == 2


def test_the_periodic_routing_sync_does_not_wait_in_the_step_loop():
    """The step loop's sync sends its push and goes on; the reply is adopted on a later pass once it has come, and
    an older merge never replaces a newer one (a blocking ray.get there paused generation every sync)."""
    from types import SimpleNamespace

    from pagedweight.actors import engine_actor
    from pagedweight.actors.engine_actor import AsyncEngine

    planner = PlannerActor.__ray_metadata__.modified_class.__new__(PlannerActor.__ray_metadata__.modified_class)
    planner.__init__(2)
    llm, held = _StandInLLM(), []
    llm.planner = SimpleNamespace(knobs=SimpleNamespace(n_buckets=2))
    llm.routing_mass = lambda: held[-1] if held else np.full((2, 4), 0.25)
    llm.set_routing_mass = held.append
    ready = {"now": False}
    handle = SimpleNamespace(**{m: SimpleNamespace(remote=getattr(planner, m)) for m in ("push", "merged", "forget")})
    engine = AsyncEngine(llm, "async-sync", planner=handle, routing_sync_s=3600.0)
    engine._stop = True  # its loop stopped (not shut down: that closes the engine): the passes below are this test's
    engine._wake.set()
    engine._thread.join(timeout=10)
    get, wait = engine_actor.ray.get, engine_actor.ray.wait
    engine_actor.ray.get = lambda ref, timeout=None: ref
    engine_actor.ray.wait = lambda refs, timeout=None: (refs, []) if ready["now"] else ([], refs)
    try:
        # due: the last sync an hour and more ago (0.0 is not, on a machine up for less than routing_sync_s)
        engine._last_sync, llm.num_tokens_computed = float("-inf"), 40
        engine._sync_routing()
        assert engine._sync_ref is not None and not held  # pushed, not waited for
        engine._sync_routing()
        assert engine._sync_ref is not None and not held  # the reply has not come: nothing adopted, no new push
        ready["now"] = True
        engine._sync_routing()
        assert engine._sync_ref is None and len(held) == 1 and engine._adopted_version == 1
        stale = decode_reply(planner.merged())
        stale["version"] = 0
        engine._adopt(stale)
        assert len(held) == 1  # an older merge is not taken
    finally:
        engine_actor.ray.get, engine_actor.ray.wait = get, wait


def test_planner_merge_drops_silent_engines_and_keeps_an_idle_pushs_weight():
    """A table no push refreshed within stale_s leaves the merge (an engine killed without forget weighed in forever:
    one 50k-token push outweighed a live engine's hundred 1k pushes); a push with no new tokens keeps the engine's
    weight (it replaced it by 0); infinite token counts are refused."""
    cls = PlannerActor.__ray_metadata__.modified_class
    now = {"t": 0.0}
    planner = cls.__new__(cls)
    planner.__init__(2, stale_s=60.0, clock=lambda: now["t"])
    hot, cold = np.array([[0.97, 0.01, 0.01, 0.01]]), np.array([[0.01, 0.01, 0.01, 0.97]])
    planner.push(encode_table("dead", hot, 50_000))
    for _ in range(10):
        now["t"] += 5.0
        reply = decode_reply(planner.push(encode_table("live", cold, 1_000)))
    assert reply["engines"] == ["dead", "live"] and reply["mass"][0, 0] > 0.5  # within stale_s: still counted
    for _ in range(4):
        now["t"] += 5.0
        reply = decode_reply(planner.push(encode_table("live", cold, 1_000)))
    assert reply["engines"] == ["live"] and reply["mass"][0, 3] == pytest.approx(0.97, abs=1e-6)
    planner.push(encode_table("other", hot, 1_000))
    reply = decode_reply(planner.push(encode_table("live", cold, 0)))  # nothing new: its 1,000 tokens still weigh
    assert reply["mass"][0, 0] == pytest.approx(0.49, abs=1e-6) and reply["tokens"] == 2_000
    with pytest.raises(ValueError, match="non-finite"):
        planner.push(encode_table("live", cold, float("inf")))
