"""EngineActor: one engine (pagedweight.engine.LLM) per GPU, or a CPU engine where there is no GPU.

`AsyncEngine` runs the engine's step loop in a background thread and fans each step's outputs out to
per-request asyncio queues, so many concurrent callers share one continuous batch. The Serve engine
replica (openai_app.py) and the plain actor below both wrap it.

Failure rules: a request whose caller goes away (cancelled task, closed stream) is aborted at the
next step boundary, which frees its KV blocks. If a step raises, every in-flight request ends with
finish_reason "error" and the message, and the engine refuses new work (the health check fails, so
Serve replaces the replica). If the actor process dies, Ray restarts it (max_restarts) and the
constructor rebuilds the engine from the node's page store; calls that were in flight fail at once
with RayActorError (max_task_retries=0: a generation is not idempotent to replay mid-stream).
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

import numpy as np
import ray

from pagedweight.actors.metrics import EngineMetrics

STATS_INTERVAL_S = 1.0
IDLE_PAGING_PAUSE_S = 0.005  # between batches of idle paging boundaries (LLM.step_idle)
SYNC_TIMEOUT_S = 10.0  # a routing sync's wait for the cluster planner's reply


@dataclass
class EngineConfig:
    """What an engine is built from; picklable, so Ray can rebuild the engine after a restart."""

    model_dir: str
    gpu_memory_budget: int | float | None = None
    device: str = "auto"  # "auto" = cuda when this worker was given a GPU, else cpu
    engine_options: dict = field(default_factory=dict)
    use_page_store: bool = True  # map the node's shared CPU planes instead of re-reading the checkpoint
    store_root: str = "/dev/shm"  # where the node's page store writes the planes (a tmpfs: shared pages)
    # push routing mass to the cluster planner this often; None = never, math.inf = only on `sync_routing`
    routing_sync_s: float | None = 5.0
    # the engine's expert_impl (EngineOptions) unless engine_options give one: "reference" runs the fused kernel's
    # torch twin on CUDA too (no kernel compile: for runs about actor plumbing)
    expert_impl: str = "auto"

    def __post_init__(self) -> None:
        if self.expert_impl not in ("auto", "reference"):
            raise ValueError(f"expert_impl {self.expert_impl!r}: use 'auto' or 'reference'")


class EngineDeadError(RuntimeError):
    """The engine's step loop failed; the engine takes no more work."""


def engine_options_json(text: str) -> dict:
    """A command line's --engine-options: a JSON object of pagedweight.engine.EngineOptions fields. ValueError names
    what is wrong, before Ray starts, not in an engine that then fails to start over and over."""
    from dataclasses import fields

    from pagedweight.engine import EngineOptions

    try:
        options = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--engine-options is not JSON: {e}") from None
    if not isinstance(options, dict):
        raise ValueError("--engine-options must be a JSON object")
    unknown = sorted(set(options) - {f.name for f in fields(EngineOptions)})
    if unknown:
        raise ValueError(f"--engine-options: unknown engine option(s) {unknown} (pagedweight.engine.EngineOptions)")
    return options


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() and ray.get_gpu_ids() else "cpu"


def build_llm(cfg: EngineConfig):
    """Construct the engine, mapping the node's page store when asked (and when running under Ray)."""
    from pagedweight.engine import LLM, serving_reserve

    options = dict(cfg.engine_options)
    options.setdefault("expert_impl", cfg.expert_impl)  # in place from the start: the "auto" reserve profiles it
    if cfg.use_page_store and ray.is_initialized():
        from pagedweight.actors.page_store_actor import page_store_for_node

        store_dir = ray.get(page_store_for_node(root=cfg.store_root).ensure.remote(cfg.model_dir))
        if store_dir is not None:
            options.setdefault("page_store_dir", store_dir)
    device = resolve_device(cfg.device)
    options.setdefault("activation_reserve", serving_reserve(cfg.gpu_memory_budget, device))
    return LLM(cfg.model_dir, gpu_memory_budget=cfg.gpu_memory_budget, device=device, **options)


def make_engine(cfg: EngineConfig, engine_id: str) -> "AsyncEngine":
    """The engine with its metrics and, when routing sync is on, the cluster planner."""
    from pagedweight.actors.planner_actor import get_or_create_planner

    llm = build_llm(cfg)
    planner = None
    if cfg.routing_sync_s is not None and llm.planner is not None:  # buckets cut as this engine's planner cuts them
        planner = get_or_create_planner(llm.planes_id, llm.planner.knobs.n_buckets)
    return AsyncEngine(llm, engine_id, EngineMetrics(engine_id), planner, cfg.routing_sync_s)


class AsyncEngine:
    """Background step loop around one LLM; `generate` is an async iterator of RequestOutputs."""

    def __init__(self, llm, engine_id: str, metrics: EngineMetrics | None = None, planner=None,
                 routing_sync_s: float | None = None):
        self.llm = llm
        self.engine_id = engine_id
        self._metrics = metrics
        self._planner = planner if routing_sync_s is not None and llm.planner is not None else None
        self._sync_s = routing_sync_s
        self._last_sync = time.monotonic()
        self._synced_tokens = 0  # llm.num_tokens_computed at the last push
        self._sync_ref = None  # (the periodic push's reply ref, when it went out) while it is awaited
        self._adopted_version = -1  # the planner's merge version last adopted (an older reply is not taken)
        self._lock = threading.Lock()  # every LLM call happens under it
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._aborts: list[str] = []
        self._dead: BaseException | None = None
        self.num_aborted = 0  # requests aborted because their caller went away
        self._stop = False
        self._closed = False  # shutdown closed the LLM: nothing may call it after
        self._last_stats = 0.0
        self._thread = threading.Thread(target=self._run, name=f"engine-{engine_id}", daemon=True)
        self._thread.start()

    # ---- caller side (event loop thread) ----
    async def generate(self, prompt, params, request_id: str | None = None, coalesce: bool = False,
                       work: str = "generate") -> AsyncIterator:
        """Yield the request's outputs until it finishes; closing the iterator early aborts it. `work` labels its
        latency metric ("score": a perplexity window, not a request someone waits on).

        ValueError from add_request (bad prompt or params) propagates before the first output. With `coalesce`,
        outputs that piled up while the caller was busy come as one (their delta texts joined, and their token ids
        and log-probabilities with output_kind "delta"): a consumer slower than the engine (a Serve hop per output)
        then ships fewer, larger messages instead of falling further behind. A final_only request's one output is its
        last, so it records no time to first token.
        """
        kind = params.output_kind if params is not None else "cumulative"
        self.check_health()
        start = time.perf_counter()  # the wait for the engine lock (up to a step) is part of the request's latency
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        # the add waits for the lock (up to a step) in a thread that a cancelled caller cannot stop: shielded, so a
        # request added after its caller left is aborted once the add returns instead of running to its end
        add = asyncio.ensure_future(asyncio.to_thread(self._add, prompt, params, request_id or uuid.uuid4().hex,
                                                      loop, queue))
        try:
            rid = await asyncio.shield(add)
        except asyncio.CancelledError:
            add.add_done_callback(self._abort_added)
            raise
        first, finished, out, queued = None, False, None, None
        try:
            while not finished:
                out = await queue.get()
                queued = out.queued_s if queued is None else queued
                if coalesce and not out.finished and not queue.empty():
                    joined = [out]
                    while not out.finished and not queue.empty():
                        out = queue.get_nowait()
                        joined.append(out)
                    ids = [t for o in joined for t in o.token_ids] if kind == "delta" else out.token_ids
                    logprobs = [e for o in joined for e in o.logprobs] \
                        if kind == "delta" and out.logprobs is not None else out.logprobs
                    out = replace(out, token_ids=ids, delta_text="".join(o.delta_text for o in joined),
                                  logprobs=logprobs, prompt_logprobs=joined[0].prompt_logprobs
                                  if kind == "delta" else out.prompt_logprobs)
                if first is None and kind != "final_only":
                    first = time.perf_counter() - start
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._aborts.append(rid)
                self._wake.set()
            if self._metrics is not None:
                reason = out.finish_reason if finished else "abort"
                self._metrics.observe_request(time.perf_counter() - start, first, reason, work, queued)

    def _abort_added(self, add: asyncio.Future) -> None:
        if not add.cancelled() and add.exception() is None:
            self._aborts.append(add.result())
            self._wake.set()

    def _add(self, prompt, params, request_id, loop, queue) -> str:
        with self._lock:
            self.check_health()
            rid = self.llm.add_request(prompt, params, request_id=request_id)
            self._queues[rid] = (loop, queue)
        self._wake.set()
        return rid

    async def score(self, windows: list[list[int]]) -> tuple[float, int]:
        """(summed next-token NLL in nats, tokens scored) of token windows. Each window is a request of the engine
        whose prompt tokens report their log-probabilities (SamplingParams.prompt_logprobs): windows batch with
        each other and with whatever else runs, their prefill is chunked, their KV cache and LM-head chunks stay
        within the budget, and the weights are read at the widths the paging loop has committed, as for any
        request. The one token each window samples is not scored."""
        from pagedweight.sampling import SamplingParams

        params = SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=0, output_kind="final_only")

        async def one(window: list[int]) -> float:
            out = None
            async for out in self.generate(window, params, work="score"):
                pass
            if out.finish_reason == "error":
                raise RuntimeError(f"scoring a window of {len(window)} tokens failed: {out.error}")
            return -sum(entry[t] for t, entry in zip(window[1:], out.prompt_logprobs[1:]))

        nll = await asyncio.gather(*(one(w) for w in windows))
        return float(sum(nll)), sum(len(w) - 1 for w in windows)

    def call(self, fn, *args):
        """fn(llm, *args) between engine steps (under the lock): benchmarks and diagnostics that need the
        engine's own process (its pinned store mapping, its device, its mover) without a step racing them."""
        with self._lock:
            self._check_open()
            return fn(self.llm, *args)

    def stats(self) -> dict:
        with self._lock:
            self._check_open()
            stats = dict(self.llm.stats())
        stats["in_flight"] = len(self._queues)
        stats["aborted_by_caller"] = self.num_aborted
        stats["engine_id"] = self.engine_id  # the `engine` label of its metrics
        return stats

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine {self.engine_id} step loop failed: {self._dead!r}")
        self._check_open()
        if not self._thread.is_alive() and not self._stop:
            raise EngineDeadError(f"engine {self.engine_id} step loop is not running")

    def _check_open(self) -> None:
        if self._closed:
            raise EngineDeadError(f"engine {self.engine_id} was shut down")

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        if self._planner is not None:  # a retired engine's table leaves the cluster's merge (first: close may raise)
            self._planner.forget.remote(self.engine_id)
        if not self._thread.is_alive():  # the loop no longer steps: the engine and its page store mapping can go
            with self._lock:  # after any stats / call / add under way; those that come later find it closed
                self._closed = True
                self.llm.close()

    # ---- step loop (background thread) ----
    def _run(self) -> None:
        from pagedweight.engine import IDLE_SLICE_S

        try:
            while not self._stop:
                with self._lock:
                    while self._aborts:
                        rid = self._aborts.pop()
                        self.num_aborted += int(self.llm.abort(rid))
                        self._queues.pop(rid, None)
                    busy = self.llm.has_unfinished()
                    outputs = self.llm.step() if busy else []
                    # idle: reloads run now (widths lowered for requests that have ended come back)
                    paging = not busy and self.llm.step_idle(max_s=IDLE_SLICE_S)
                for out in outputs:
                    self._deliver(out)
                self._export_stats()
                self._sync_routing()
                if not busy:  # idle reloads still under way: back soon (a short pause bounds a spin)
                    self._wake.wait(IDLE_PAGING_PAUSE_S if paging else STATS_INTERVAL_S)
                    self._wake.clear()
        except BaseException as exc:  # noqa: BLE001 - any failure must reach the waiting callers
            from loguru import logger

            with self._lock:  # an add holding the lock registered before this (failed below), any later one sees it
                self._dead = exc
                self._fail_all(f"engine {self.engine_id} failed: {exc!r}")
            logger.exception("engine {} step loop failed", self.engine_id)

    def _deliver(self, out) -> None:
        entry = self._queues.pop(out.request_id, None) if out.finished else self._queues.get(out.request_id)
        if entry is not None:
            loop, queue = entry
            loop.call_soon_threadsafe(queue.put_nowait, out)

    def _fail_all(self, message: str) -> None:
        from pagedweight.engine import RequestOutput

        for rid, (loop, queue) in list(self._queues.items()):
            out = RequestOutput(request_id=rid, prompt_token_ids=[], token_ids=[], text="", delta_text="",
                                finished=True, finish_reason="error", error=message)
            loop.call_soon_threadsafe(queue.put_nowait, out)
        self._queues.clear()

    def _sync_routing(self) -> None:
        """The periodic routing sync, without waiting in the step loop: a push goes out when due and its reply is
        adopted on a later pass, once it came; a planner that has not answered in SYNC_TIMEOUT_S is given up on
        (serving goes on: the cluster view is an optimisation)."""
        if self._planner is None:
            return
        from loguru import logger

        now = time.monotonic()
        if self._sync_ref is not None:
            ref, sent = self._sync_ref
            if ray.wait([ref], timeout=0)[0]:
                self._sync_ref = None
                try:
                    from pagedweight.actors.planner_actor import decode_reply

                    self._adopt(decode_reply(ray.get(ref)))
                except Exception as exc:  # noqa: BLE001
                    logger.warning("engine {}: routing sync with the planner failed: {!r}", self.engine_id, exc)
            elif now - sent > SYNC_TIMEOUT_S:
                self._sync_ref = None
                logger.warning("engine {}: the planner did not answer a routing sync in {} s", self.engine_id,
                               SYNC_TIMEOUT_S)
            return
        if now - self._last_sync < self._sync_s or self.llm.num_tokens_computed == self._synced_tokens:
            return
        try:
            self._sync_ref = (self._push()[0], now)
        except Exception as exc:  # noqa: BLE001
            logger.warning("engine {}: routing sync with the planner failed: {!r}", self.engine_id, exc)

    def _push(self) -> tuple:
        """Send this engine's routing mass, weighted by the tokens its steps computed since the last push; returns
        (the reply's ref, the mass, the tokens)."""
        from pagedweight.actors.planner_actor import encode_table

        self._last_sync = time.monotonic()
        with self._lock:  # also orders a push of the step loop against one of `sync_routing`
            self._check_open()
            mass, done = self.llm.routing_mass(), self.llm.num_tokens_computed
            tokens, self._synced_tokens = done - self._synced_tokens, done
        return self._planner.push.remote(encode_table(self.engine_id, mass, tokens)), mass, tokens

    def _adopt(self, reply: dict) -> np.ndarray:
        """Take the planner's merged mass unless a newer merge was taken already; returns the mass now held."""
        with self._lock:
            self._check_open()
            if reply["version"] >= self._adopted_version:
                self.llm.set_routing_mass(reply["mass"])
                self._adopted_version = reply["version"]
            return self.llm.routing_mass()

    def sync_routing(self, push: bool = True) -> dict:
        """Push this engine's routing mass (weighted by the tokens since the last push) to the cluster planner
        and adopt the merged mass it returns, waiting for it, so bucket assignment follows the whole cluster's
        traffic; push=False only adopts the planner's current merge. Returns the planner's reply plus what was
        pushed ("pushed_mass", "pushed_tokens") and the buckets this engine's planner now cuts ("engine_buckets")."""
        from pagedweight.actors.planner_actor import decode_reply
        from pagedweight.signals import bucket_experts

        if self._planner is None:
            raise RuntimeError(f"engine {self.engine_id} has no cluster planner (routing_sync_s=None or no planner)")
        if push:
            ref, mass, tokens = self._push()
        else:
            mass, tokens, ref = None, 0, self._planner.merged.remote()
        reply = decode_reply(ray.get(ref, timeout=SYNC_TIMEOUT_S))
        adopted = self._adopt(reply)
        reply.update(pushed_mass=mass, pushed_tokens=tokens,
                     engine_buckets=bucket_experts(adopted, self.llm.planner.knobs.n_buckets))
        return reply

    def _export_stats(self) -> None:
        now = time.monotonic()
        if self._metrics is None or now - self._last_stats < STATS_INTERVAL_S:
            return
        self._last_stats = now
        with self._lock:
            stats = self.llm.stats()
        self._metrics.update(stats)


@ray.remote(max_restarts=-1, max_task_retries=0, max_concurrency=1000)
class EngineActor:
    """One engine; create with `start_engines` (a GPU or a fraction of one per engine, or CPU engines)."""

    def __init__(self, cfg: EngineConfig, engine_id: str | None = None):
        ctx = ray.get_runtime_context()
        self.engine_id = engine_id or ctx.get_actor_id()[:12]
        self.restarted = ctx.was_current_actor_reconstructed
        self.cfg = cfg
        self.engine = make_engine(cfg, self.engine_id)

    async def generate(self, prompt, params, request_id: str | None = None):
        """The final RequestOutput of one request."""
        out = None
        async for out in self.engine.generate(prompt, params, request_id):
            pass
        return out

    async def generate_batch(self, requests: list[tuple]) -> list:
        """Final RequestOutputs of (prompt, params) pairs, all in the engine's batch at once."""
        return list(await asyncio.gather(*(self.generate(prompt, params) for prompt, params in requests)))

    async def stream(self, prompt, params, request_id: str | None = None):
        """Every RequestOutput of one request (call with .options(num_returns="streaming"))."""
        async for out in self.engine.generate(prompt, params, request_id):
            yield out

    async def score(self, windows: list[list[int]]) -> tuple[float, int]:
        """Summed NLL and token count of token windows (perplexity evaluation)."""
        return await self.engine.score(windows)

    async def call(self, fn, *args):
        """fn(llm, *args) in this engine's process between steps (see AsyncEngine.call)."""
        return await asyncio.to_thread(self.engine.call, fn, *args)

    async def sync_routing(self, push: bool = True) -> dict:
        """Routing sync with the cluster planner now (see AsyncEngine.sync_routing)."""
        return await asyncio.to_thread(self.engine.sync_routing, push)

    async def stats(self) -> dict:
        return await asyncio.to_thread(self.engine.stats)  # it waits for the engine lock: not on the event loop

    def shutdown(self) -> None:
        """Stop the step loop and leave the cluster planner's merge (Ray calls it when the actor ends gracefully)."""
        self.engine.shutdown()

    __ray_shutdown__ = shutdown

    def info(self) -> dict:
        llm = self.engine.llm
        return {"engine_id": self.engine_id, "node_id": ray.get_runtime_context().get_node_id(),
                "restarted": self.restarted, "pid": os.getpid(),
                "gpu_ids": ray.get_gpu_ids(), "device": str(llm.device), "model_name": llm.model_name,
                "max_model_len": llm.max_model_len, "page_store_dir": llm.options.page_store_dir}

    def check_health(self) -> bool:
        self.engine.check_health()
        return True


def start_engines(cfg: EngineConfig, num_engines: int | None = None, cpus_per_engine: float = 1.0,
                  gpus_per_engine: float = 1.0) -> list:
    """EngineActors over the cluster's GPUs, `gpus_per_engine` each (1 = one engine per GPU; 0.5 = two engines
    share a GPU); `num_engines` defaults to as many as fit. CPU engines (`num_engines`, default 1) when the
    cluster has no GPU, gpus_per_engine is 0 or cfg.device is "cpu" ("auto" included, when there is no GPU). Asking for
    more GPU engines than the cluster's GPUs fit is an error (Ray would leave the extra ones pending forever); but
    `num_engines` GPU engines with cfg.device "cuda" on a cluster with no GPU yet are started, for an autoscaler
    to bring GPU nodes up for them. Engines are named `<job>-gpu<i>` (or `-cpu<i>`), the job being the caller's Ray
    job: two jobs on one cluster keep apart in the model's planner and in the metrics' `engine` label."""
    job = f"job{ray.get_runtime_context().get_job_id()}"
    if not 0 <= gpus_per_engine <= 1:
        raise ValueError(f"gpus_per_engine {gpus_per_engine}: an engine drives one device, use a value in [0, 1]")
    if num_engines is not None and num_engines < 1:
        raise ValueError(f"num_engines {num_engines}: want at least one engine")
    gpus = ray.cluster_resources().get("GPU", 0)
    # GPU engines asked of a cluster with none yet (an autoscaling one whose GPU workers scale from 0): the pending
    # actors are the demand that brings the nodes up
    awaited = not gpus and num_engines is not None and gpus_per_engine > 0 and cfg.device not in ("cpu", "auto")
    if (gpus or awaited) and gpus_per_engine > 0 and cfg.device != "cpu":
        if awaited:
            from loguru import logger

            logger.warning("the cluster has no GPU yet: {} engine(s) wait for GPU nodes to join", num_engines)
            n = num_engines
        else:
            fit = math.floor(gpus / gpus_per_engine + 1e-9)
            n = fit if num_engines is None else num_engines
            if n > fit:
                raise ValueError(f"{n} engines at {gpus_per_engine} GPU each need {n * gpus_per_engine:g} GPUs; "
                                 f"the cluster has {gpus:g}")
        return [EngineActor.options(num_gpus=gpus_per_engine, num_cpus=cpus_per_engine).remote(cfg, f"{job}-gpu{i}")
                for i in range(n)]
    if cfg.device not in ("cpu", "auto"):  # its engines would fail inside their actors ("CUDA is not available")
        raise ValueError(f"device {cfg.device!r} with " + ("gpus_per_engine 0" if gpus_per_engine == 0 else
                         "no GPU in the cluster: give num_engines to start engines that wait for GPU nodes (an "
                         "autoscaling cluster)"))
    if cfg.device == "auto" and not gpus:
        from loguru import logger

        logger.warning("the cluster has no GPU: CPU engines (device 'cuda' with num_engines asks for GPU engines that "
                       "wait for GPU nodes)")
    n = 1 if num_engines is None else num_engines
    return [EngineActor.options(num_gpus=0, num_cpus=cpus_per_engine).remote(cfg, f"{job}-cpu{i}") for i in range(n)]
