"""KV-pressure workload (issue 8 item 6): Poisson arrivals of long-context requests push the KV cache past what
the budget holds at full expert width, then ebb. PagedWeight (paging on) against static uniform widths at the
same budget. Reports P50/P99 time-to-first-token and inter-token latency, offload/reload triggers, bytes moved,
time with pages in flight, width oscillation, and how many requests waited or were preempted.

Same random Qwen1.5-MoE-A2.7B-shaped model as engine_bench (random planes, pinned CPU store).

    python -m benchmarks.kv_pressure                        # H200
    python -m benchmarks.kv_pressure --tiny --device cpu    # CPU check at toy sizes
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import heapq
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import failed_row, write_result
from benchmarks.engine_bench import (TRACE_COLUMNS, StepPhases, ap_weights, append_profile, expert_pool_bytes,
                                     model_config, outside_bytes, page_bytes, random_model, trace_row)
from pagedweight.engine import IDLE_SLICE_S, LLM, EngineOptions
from pagedweight.sampling import SamplingParams


IDLE_POLL_S = 1.0  # actors/engine_actor.py's STATS_INTERVAL_S: an idle engine's paging boundaries, as often
# H200 defaults, computed (not measured) from the 2026-11-29 runs: with whole-step graphs a request of ~640 prompt and
# 16 generated tokens lived ~0.25 s, so 1 arrival/s never overflowed static 6 bits' 128 KV blocks
# (kv_pressure-nvidia-h200-20261129-home.json: 0 waits). 128 tokens (~1.1 s at ~8 ms a step) at 4/s keep ~4 requests
# of ~48 blocks each alive: ~200 blocks wanted against 128.
DEFAULTS = {"h200": dict(num_requests=24, rate=4.0, prompt_len=(256, 1024), gen=128, kv_room_blocks=128, chunk=1024),
            "tiny": dict(num_requests=10, rate=4.0, prompt_len=(48, 160), gen=12, kv_room_blocks=6, chunk=64)}


def budget_and_options(cfg, weights, parent_bits: int, outside: int, page: int, room: int, chunk: int,
                       longest: int) -> tuple[int, dict]:
    """The workload's budget (the weights outside the pool, every expert at the parent width with the mover's
    reserve, and `room` KV blocks) and the engine options of every mode (sequences up to `longest` tokens)."""
    budget = outside + expert_pool_bytes(weights, parent_bits, page) + room * page * cfg.num_hidden_layers
    return budget, dict(max_num_seqs=64, max_num_batched_tokens=chunk, max_model_len=longest + 16)


def workload(n: int, rate: float, prompt_lo: int, prompt_hi: int, vocab: int, seed: int, shared: int = 0,
             turns: int = 1, think_s: float | None = None) -> list[tuple]:
    """(arrival second, prompt ids) with exponential inter-arrival times of mean 1/rate; every prompt starts with
    the same `shared` tokens (a system prompt) before its own prompt_lo..prompt_hi.

    With `turns` > 1 the requests are conversations of that many turns: request i is turn i // C of conversation
    i % C (C = ceil(n / turns) conversations, so a conversation's turns are C arrivals apart), and a turn's prompt is
    the previous turn's followed by prompt_lo/4..prompt_hi/4 new tokens. The replay is open-loop, so a turn does not
    carry the previous turn's answer: it finds the previous turn's prompt blocks computed if they are still held or
    were kept (a client resending a growing context, as a chat or an agent does).

    With `think_s` too, the conversations are closed-loop, as a chat client is: only the first turns arrive by the
    clock; turn t + 1 is (think seconds, new ids, index of turn t), sent that long (exponential, mean think_s) after
    turn t ended, its prompt turn t's prompt, turn t's answer and the new ids (`drive` builds it)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    arrivals -= arrivals[0]
    system = rng.integers(0, vocab, shared).tolist()
    convs, prompts = -(-n // turns), []
    for i in range(n):
        if i < convs:
            prompts.append(system + rng.integers(0, vocab, int(rng.integers(prompt_lo, prompt_hi + 1))).tolist())
        else:
            more = int(rng.integers(prompt_lo // 4, prompt_hi // 4 + 1))
            new = rng.integers(0, vocab, more).tolist()
            prompts.append(new if think_s is not None else prompts[i - convs] + new)
    if think_s is None:
        return [(float(t), ids) for t, ids in zip(arrivals, prompts)]
    think = rng.exponential(think_s, n)
    return [(float(arrivals[i]), ids, None) if i < convs else (float(think[i]), ids, i - convs)
            for i, ids in enumerate(prompts)]


TTFT_TAIL = 3  # the slowest first tokens broken down per request (`drive`'s ttft_tail)
SWING_BITS = 0.05  # a mean-width swing reverses by at least this many bits (`swings`)


def reversals(series: np.ndarray) -> int:
    """Direction changes of a series (ignoring flat stretches): 1 for down-then-up, more means oscillation."""
    d = np.sign(np.diff(series))
    d = d[d != 0]
    return int((d[1:] != d[:-1]).sum()) if d.size > 1 else 0


def swings(series, min_move: float) -> int:
    """Direction changes of a series that each go back by at least `min_move` from the last turning point (a
    zig-zag filter): a small release in the middle of a reload ramp is a reversal but not a swing."""
    if len(series) < 2:
        return 0
    hi = lo = float(series[0])
    direction, count = 0, 0
    for v in map(float, series[1:]):
        if direction == 0:  # no move of min_move yet
            if v - lo >= min_move:
                direction, hi = 1, v
            elif hi - v >= min_move:
                direction, lo = -1, v
            else:
                hi, lo = max(hi, v), min(lo, v)
        elif direction == 1:
            if v > hi:
                hi = v
            elif hi - v >= min_move:
                direction, lo, count = -1, v, count + 1
        elif v < lo:
            lo = v
        elif v - lo >= min_move:
            direction, hi, count = 1, v, count + 1
    return count


DRIVE_COLUMNS = ["t_ms", "kv_free", "sent", "first_tokens"]  # a trace row's end, drive's own


def drive(llm: LLM, requests: list[tuple], gen: int, deadline: float | None = None,
          trace: list | None = None) -> dict:
    """Replay the arrivals in real time; one engine step per loop; latencies from step-end wall times.

    A request is (arrival second, prompt ids), or (think seconds, new ids, index of the previous turn) for a
    closed-loop conversation's later turn (`workload`): it is sent that long after the previous turn ended, with the
    previous turn's prompt and answer before its new ids. Past `deadline` (a perf_counter time) the replay stops:
    unfinished requests are aborted, later arrivals never sent, and the row says so (cut_short, requests_done).
    `trace` collects engine_bench.trace_row per step (which step was slow, and which part of its boundary) and
    DRIVE_COLUMNS (when it began, the free KV it left, the arrivals before it, the first tokens it sampled)."""
    params = SamplingParams(max_tokens=gen, ignore_eos=True)
    sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
    arrival, last, ttft, itl, ttft_later, queued = {}, {}, [], [], [], []
    first: dict[str, dict] = {}  # request -> its first token's latency parts (the TTFT tail's breakdown)
    prefill: dict[str, list[int]] = {}  # request -> [steps its prompt advanced in, steps it ran without advancing]
    waited, mean_w, free_kv, widths = set(), [], [], []
    finished, failed, steps0, cut = 0, 0, llm.num_steps, False
    hits0, queries0 = llm.scheduler.prefix_hit_tokens, llm.scheduler.prefix_query_tokens
    evicted0, reclaimed0 = llm.kv.evicted_blocks, llm.kv.reclaimed_blocks
    st0, paging0 = llm.stats(), dataclasses.replace(llm.paging)  # counters since this drive began (not the warm-up's)
    decode = llm.runner.decode  # static decode steps (CUDA graphs), None where the engine packs every step
    graphs0 = dataclasses.replace(decode.stats) if decode is not None else None
    phases = StepPhases(llm) if trace is not None else None
    after = [r[2] if len(r) > 2 else None for r in requests]  # the turn each request follows, if any
    due = [(r[0], i) for i, r in enumerate(requests) if after[i] is None]  # (second, index): sendable
    heapq.heapify(due)
    later: dict[int, list[int]] = {}  # a turn -> the turns that follow it
    for i, prev in enumerate(after):
        if prev is not None:
            later.setdefault(prev, []).append(i)
    sent: dict[int, list[int]] = {}  # index -> the prompt it was sent with
    late: dict[str, float] = {}  # request -> how long after it was due the loop sent it (a step or idle paging held it)
    idle_max = 0.0  # the longest step_idle call: how long an arrival may wait for idle paging
    sent_since: list[int] = []  # requests sent since the last step (trace: the step that follows them)
    t0 = time.perf_counter()
    while finished < len(requests):
        if deadline is not None and time.perf_counter() > deadline:
            cut = True
            for rid in arrival:
                llm.abort(rid)
            break
        now = time.perf_counter() - t0
        while due and due[0][0] <= now:
            when, i = heapq.heappop(due)
            # a later turn: the previous turn's prompt and answer, then its own ids
            sent[i] = requests[i][1] if after[i] is None else sent.pop(after[i]) + requests[i][1]
            rid = llm.add_request(sent[i], params, request_id=str(i))
            arrival[rid], late[rid] = t0 + when, now - when
            sent_since.append(i)
        if not llm.has_unfinished():
            t_idle = time.perf_counter()
            paging = llm.step_idle(max_s=IDLE_SLICE_S)  # idle, as the engine actor is: reloads a slice at a time,
            idle_max = max(idle_max, time.perf_counter() - t_idle)
            if not paging:  # then wait for the next arrival, looking again each IDLE_POLL_S as the actor does (a
                # kept block's retention may end meanwhile)
                now = time.perf_counter() - t0  # after the idle call: the sleep ends when the arrival is due
                time.sleep(min(max(0.0, due[0][0] - now), IDLE_POLL_S) if due else 0.0)
            continue
        t_step, paging, compactions = time.perf_counter(), dataclasses.replace(llm.paging), llm.pool.relocations
        # requests before their first token: did this step advance their prompt, or did a running one wait (no KV
        # block for its next chunk, or preempted)? Waiting ones that stay waiting are in queued_s
        unsampled = [(s, s.num_computed_tokens, s in llm.scheduler.running)
                     for s in (*llm.scheduler.running, *llm.scheduler.waiting) if s.request_id not in last]
        outs = llm.step()
        sync()
        t = time.perf_counter()
        for seq, computed, running in unsampled:
            if seq.num_computed_tokens > computed or running:
                prefill.setdefault(seq.request_id, [0, 0])[seq.num_computed_tokens <= computed] += 1
        if trace is not None:
            trace.append(trace_row(llm, paging, t_step, compactions, phases))
        firsts = []  # requests whose first token this step sampled
        for out in outs:
            n = out.completion_tokens
            if n and out.request_id not in last:
                firsts.append(int(out.request_id))
                ttft.append(t - arrival[out.request_id])
                # the engine's queue time, from its add_request: this loop sends a due request between steps
                queued.append(out.queued_s)
                steps, waits = prefill.get(out.request_id, (0, 0))
                first[out.request_id] = {
                    "request": int(out.request_id), "ttft_ms": ttft[-1] * 1e3,
                    "sent_late_ms": late[out.request_id] * 1e3, "queued_ms": out.queued_s * 1e3,
                    "prompt_tokens": len(sent[int(out.request_id)]), "cached_tokens": out.num_cached_tokens,
                    "prefill_steps": steps, "prefill_waits": waits}
                if after[int(out.request_id)] is not None:
                    ttft_later.append(ttft[-1])  # a closed-loop conversation's later turn
            elif n and n > last[out.request_id][1]:
                itl.append(t - last[out.request_id][0])
            if n:
                last[out.request_id] = (t, n)
            if out.finished:
                finished += 1
                failed += out.finish_reason != "length"  # "error": its context can never fit this budget
                i = int(out.request_id)
                if i in later:  # the answer joins the prompt; the next turn is due after the think time
                    sent[i] = sent[i] + list(out.token_ids)
                    for k in later.pop(i):
                        heapq.heappush(due, (t - t0 + requests[k][0], k))
        waited.update(s.request_id for s in llm.scheduler.waiting)
        free_kv.append(llm.kv.num_free_blocks)
        if llm.table is not None:
            w = llm.committed_widths()
            widths.append(w)
            mean_w.append(float(w.mean()))
        if trace is not None:  # when the step began, the free KV blocks it left, the requests sent since the last
            # step, those whose first token it sampled: which steps an arrival's first token waited behind
            trace[-1] += [round((t_step - t0) * 1e3, 3), free_kv[-1], sent_since, firsts]
        sent_since = []
    elapsed = time.perf_counter() - t0
    st = llm.stats()
    pct = lambda xs, q: float(np.percentile(np.asarray(xs) * 1e3, q)) if xs else None  # noqa: E731
    block_rev = [reversals(col) for col in np.asarray(widths).T] if widths else [0]
    return {
        "requests": len(requests), "cut_short": cut, "requests_done": finished - failed,
        "elapsed_s": elapsed, "steps": llm.num_steps - steps0,
        # over the requests that got a first token (`ttft_requests`): one still waiting when a run is cut has none
        "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99), "ttft_requests": len(ttft),
        # closed-loop conversations (--think-s): the turns after the first, whose context may be found computed
        "ttft_later_turns_p50_ms": pct(ttft_later, 50), "ttft_later_turns_p99_ms": pct(ttft_later, 99),
        # of the time to first token, measured per request: the wait for a slot and KV room (arrival to the first
        # step the engine gave it, RequestOutput.queued_s) and the rest (the driver's send between steps, and the
        # prefill's steps); the TTFT tail's requests' own waits, not the percentiles of each part
        "queued_p50_ms": pct(queued, 50), "queued_p99_ms": pct(queued, 99),
        "ttft_max_queued_ms": float(queued[int(np.argmax(ttft))] * 1e3) if ttft else None,
        "ttft_max_ms": float(max(ttft) * 1e3) if ttft else None,
        # the TTFT_TAIL slowest first tokens, each: arrival to first step (queued_ms), its prompt and the part found
        # computed, the steps that computed its prompt and those it ran through without advancing (no KV block
        # for its next chunk: the release it waited for, or a preemption)
        "ttft_tail": sorted(first.values(), key=lambda r: -r["ttft_ms"])[:TTFT_TAIL],
        "prefill_wait_steps": sum(w for _, w in prefill.values()),
        # measured: the longest LLM.step_idle call (an arrival due meanwhile is sent after it: sent_late_ms)
        "idle_call_max_ms": idle_max * 1e3,
        "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99),
        "tokens_per_s": (finished - failed) * gen / elapsed,
        "requests_failed": failed, "requests_waited": len(waited), "preemptions": st["preemptions"],
        **{k: st[k] - st0[k] for k in ("offload_triggers", "reload_triggers", "bytes_offloaded", "bytes_reloaded")},
        "time_pages_in_flight_s": llm.paging.time_in_flight_s - paging0.time_in_flight_s,
        "steps_pages_in_flight": llm.paging.steps_in_flight - paging0.steps_in_flight,
        "sync_waits": llm.paging.syncs - paging0.syncs,
        # decode steps through runner.DecodeGraphs: run eagerly (a key's first sight), captured (then replayed:
        # counted in both), replayed, failed captures; a fresh engine's eager and captured steps are its slow ones
        "decode_graph_steps": None if decode is None else {
            k: getattr(decode.stats, k) - getattr(graphs0, k) for k in ("eager", "captured", "replayed",
                                                                         "capture_failures")},
        # prefix sharing: prompt tokens found computed (in blocks other requests held or kept blocks), of those
        # looked up; kept blocks evicted for KV or weights (reclaimed: by weights), and those still kept at the end
        "prefix_hit_tokens": st["prefix_hit_tokens"] - hits0,
        "prefix_query_tokens": st["prefix_query_tokens"] - queries0,
        "kv_evicted_blocks": st["kv_evicted_blocks"] - evicted0, "kv_cached_blocks_end": st["kv_cached_blocks"],
        "kv_reclaimed_blocks": st["kv_reclaimed_blocks"] - reclaimed0,  # of the evicted: taken by weight reloads
        "min_free_kv_blocks": int(min(free_kv)) if free_kv else None,
        "mean_width_min": min(mean_w) if mean_w else None, "mean_width_max": max(mean_w) if mean_w else None,
        "mean_width_end": mean_w[-1] if mean_w else None,
        "mean_width_avg": float(np.mean(mean_w)) if mean_w else None,  # over steps: the widths the work was served at
        "mean_width_reversals": reversals(np.asarray(mean_w)) if mean_w else 0,
        "mean_width_swings": swings(mean_w, SWING_BITS),  # reversals of at least SWING_BITS bits
        "blocks_with_2plus_reversals": int(sum(r >= 2 for r in block_rev)),
        "max_block_reversals": int(max(block_rev)),
        # with a trace: the committed mean width after each step (how the widths moved, not only how often)
        **({"mean_width_series": [round(w, 4) for w in mean_w]} if trace is not None else {}),
    }


SPREAD_METRICS = ("mean_width_avg", "mean_width_reversals", "mean_width_swings", "blocks_with_2plus_reversals",
                  "offload_triggers", "reload_triggers", "bytes_offloaded", "bytes_reloaded", "ttft_p50_ms",
                  "ttft_p99_ms", "queued_p50_ms", "queued_p99_ms", "tokens_per_s")


def run_spread(rows: list[dict]) -> dict:
    """Each metric of the PagedWeight rows over its repeated runs (the same arrivals: what differs is timing) and
    the median: one run's width reversals can differ from the next by more than a setting changes them."""
    ok = [r for r in rows if "error" not in r]
    return {k: {"runs": [r.get(k) for r in ok], "median": float(np.median([r.get(k) or 0 for r in ok]))}
            for k in SPREAD_METRICS} if ok else {}


def _profile_boundaries(llm: LLM) -> cProfile.Profile:
    """Profile every step boundary of `llm` (planner, move requests, mover) and nothing else."""
    prof, inner = cProfile.Profile(), llm._paging_boundary

    def profiled(*args) -> bool:  # the engine's deadline, if any
        prof.enable()
        try:
            return inner(*args)
        finally:
            prof.disable()

    llm._paging_boundary = profiled
    return prof


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="toy shapes (CPU check)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--num-requests", type=int, default=None, help="default 24 (tiny: 10)")
    p.add_argument("--rate", type=float, default=None, help="arrivals per second (default 4)")
    p.add_argument("--prompt-len", default=None, help="lo,hi prompt tokens (default 256,1024; tiny: 48,160)")
    p.add_argument("--gen", type=int, default=None, help="generated tokens per request (default 128; tiny: 12)")
    p.add_argument("--kv-room-blocks", type=int, default=None,
                   help="KV blocks the budget leaves with every expert at the parent width (default 128; tiny: 6)")
    p.add_argument("--parent-bits", type=int, default=6)
    p.add_argument("--no-heads", dest="heads", action="store_false",
                   help="no prompt residual heads in the random checkpoint (default: random heads, as convert fits)")
    p.add_argument("--paged-runs", type=int, default=1,
                   help="run PagedWeight this many times on the same arrivals (spread in the result: pagedweight_runs)")
    p.add_argument("--warmup-replays", type=int, default=1,
                   help="untimed replays of the workload (PagedWeight) before the measured modes (default 1)")
    p.add_argument("--static-bits", default=None,
                   help="static uniform widths to compare (default: parent,4; 'none': PagedWeight alone)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                   help="every prompt starts with the same N tokens (a system prompt) before its own --prompt-len")
    p.add_argument("--turns", type=int, default=1,
                   help="requests are conversations of this many turns, each turn's prompt the previous one's and "
                        "a quarter of --prompt-len more (default 1: independent prompts)")
    p.add_argument("--think-s", type=float, default=None, metavar="S",
                   help="with --turns: closed-loop conversations, each turn sent S seconds on average after the "
                        "previous one ended, its answer included (default: open loop, turns by the clock)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="every mode computes each prompt whole (default: requests share a common prefix's blocks)")
    p.add_argument("--prefix-retention-s", type=float, default=0.0, metavar="S",
                   help="PagedWeight's prefix_retention_s: kept prefix blocks stay out of weight reloads' reach for S "
                        "seconds after their release (default 0)")
    p.add_argument("--chunk", type=int, default=None, help="token budget per step (default 1024; tiny: 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="wall-time budget: each mode's replay gets an equal share of what is left and is cut "
                        "short past it; no mode starts once the budget is spent (default: no limit)")
    p.add_argument("--trace", action="store_true",
                   help="add each step's wall ms and the parts of its boundary to the row (engine_bench.TRACE_COLUMNS)")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="append a cProfile summary of each mode's step boundaries to FILE (which calls a release "
                        "plan's move requests spend their host time in; slows the boundaries)")
    p.add_argument("--observe-every", type=int, default=None, metavar="N",
                   help="PagedWeight reads routing statistics every N-th step (default: the engine's)")
    p.add_argument("--no-prefill-warm-up", dest="prefill_warm_up", action="store_false",
                   help="engines skip the prefill GEMM warm-up at start (EngineOptions.prefill_warm_up; an A/B arm)")
    p.add_argument("--no-packed-layer-kernels", dest="packed_layer_kernels", action="store_false",
                   help="engines run torch's ops in the prefill steps, not the fused layer kernels "
                        "(EngineOptions.packed_layer_kernels off; an A/B arm)")
    p.add_argument("--planner-knobs", default=None, metavar="JSON",
                   help='PagedWeight planner knob overrides, e.g. \'{"reload_dwell_steps": 64}\' (pagedweight/knobs.py)')
    p.add_argument("--out-dir", default=None)
    p.add_argument("--label", default=None, help="suffix of the result file name (a second run the same day)")
    args = p.parse_args(argv)
    if args.paged_runs < 1:
        p.error("--paged-runs must be at least 1")
    if args.turns < 1:
        p.error("--turns must be at least 1")
    if args.think_s is not None and (args.turns < 2 or args.think_s < 0):
        p.error("--think-s needs --turns of 2 or more and is at least 0")
    t_start = time.perf_counter()
    tiny = args.tiny
    d = DEFAULTS["tiny" if tiny else "h200"]
    n = args.num_requests or d["num_requests"]
    rate = args.rate or d["rate"]
    lo, hi = (int(x) for x in args.prompt_len.split(",")) if args.prompt_len else d["prompt_len"]
    gen = args.gen or d["gen"]
    room = args.kv_room_blocks or d["kv_room_blocks"]
    chunk = args.chunk or d["chunk"]
    static = args.static_bits or f"{args.parent_bits},4"
    static_bits = [] if static == "none" else [int(b) for b in static.split(",")]

    cfg = model_config(tiny)
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    page = page_bytes(cfg, args.block_size, dtype)
    weights = ap_weights(cfg, args.parent_bits, seed=args.seed, heads=args.heads)
    outside = outside_bytes(cfg, dtype, args.device)
    kv_block = page * cfg.num_hidden_layers
    budget, options = budget_and_options(cfg, weights, args.parent_bits, outside, page, room, chunk,
                                         args.shared_prefix + hi + (args.turns - 1) * (hi // 4) + gen
                                         + (args.turns - 1) * gen * (args.think_s is not None))
    options.update(detokenize=False, block_size=args.block_size, prefix_caching=args.prefix_caching,
                   prefix_retention_s=args.prefix_retention_s,  # static widths: no reload, no retention
                   prefill_warm_up=args.prefill_warm_up, packed_layer_kernels=args.packed_layer_kernels)
    requests = workload(n, rate, lo, hi, cfg.vocab_size, args.seed, args.shared_prefix, args.turns, args.think_s)
    knobs = json.loads(args.planner_knobs) if args.planner_knobs else None
    paged = ("pagedweight", dict(bits=args.parent_bits, paging=True, planner_knobs=knobs))
    if args.observe_every is not None:
        paged[1]["observe_every"] = args.observe_every
    # untimed replays first: the first engine of a process pays one-time costs (kernel modules loaded, cuBLAS
    # heuristics per GEMM shape, allocator growth) that later modes were spared: PagedWeight's first run had the
    # worst TTFT of three in every H200 run of session 8, and the static modes ran after it
    modes = [("warm-up", paged[1])] * args.warmup_replays + [paged] * args.paged_runs
    modes += [(f"static-ap{b}", dict(bits=b, paging=False)) for b in static_bits]
    rows: list[dict] = []
    skipped: list[str] = []
    meta = {"model": "tiny" if tiny else "Qwen1.5-MoE-A2.7B shape, random planes", "page_bytes": page,
            "kv_block_bytes": kv_block, "time_budget_s": args.time_budget_s, "planner_knobs": knobs,
            "observe_every": paged[1].get("observe_every", EngineOptions.observe_every),
            "residual_heads": "random" if args.heads else None, "shared_prefix": args.shared_prefix,
            "turns": args.turns, "think_s": args.think_s, "prefix_caching": args.prefix_caching,
            "prefix_retention_s": args.prefix_retention_s, "prefill_warm_up": args.prefill_warm_up,
            "packed_layer_kernels": args.packed_layer_kernels}

    def save(complete: bool = False) -> Path:
        """Rewrite the JSON with every row so far: a run cut short still leaves a valid partial result. `complete`:
        the run reached its end with no mode skipped and none cut short by the time budget."""
        return write_result("kv_pressure", rows, out_dir=args.out_dir, label=args.label,
                            extra={**meta, "complete": complete, "skipped_modes": skipped,
                                   "pagedweight_runs": run_spread([r for r in rows if r.get("mode") == "pagedweight"])})

    save()
    for m, (name, extra) in enumerate(modes):
        deadline = None
        if args.time_budget_s is not None:
            left = t_start + args.time_budget_s - time.perf_counter()
            if left <= 0:
                skipped.append(name)
                continue
            deadline = time.perf_counter() + left / (len(modes) - m)  # an equal share of what is left
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            model = random_model(cfg, False, dtype, args.device, seed=args.seed)
            llm = LLM.from_parts(model, weights, None, budget, args.device, model_name=name, **options, **extra)
            drive(llm, [(0.0, requests[0][1][:32])], 2)  # warm-up: kernels compile outside the timed replay
            llm.reset_prefix_cache()  # the replay starts with no kept prefix block
            llm.scheduler.num_preemptions = 0
            trace = [] if args.trace else None
            prof = _profile_boundaries(llm) if args.profile and llm.mover is not None else None
            row = {"mode": name, "budget_gib": budget / 2**30, "kv_blocks_at_start": llm.kv.num_free_blocks,
                   "rate_req_per_s": rate, "prompt_lo": lo, "prompt_hi": hi, "gen_tokens": gen,
                   **drive(llm, requests, gen, deadline, trace),
                   "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if args.device == "cuda" else None}
            if trace is not None:
                row["step_trace"] = {"columns": TRACE_COLUMNS + DRIVE_COLUMNS, "rows": trace}
            if prof is not None:
                append_profile(args.profile, f"{name}: step boundaries (cProfile)", prof)
        except Exception as exc:  # noqa: BLE001 - one failing mode must not cost the others
            row = failed_row(exc, mode=name)
        llm = model = None  # free this mode's pool before the next one allocates its own
        if name == "warm-up":
            continue
        if name == "pagedweight":
            row["run"] = m - args.warmup_replays
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
               if not isinstance(v, (list, dict))}, file=sys.stderr)
        rows.append(row)
        save()
    print(save(complete=not skipped and not any(r.get("cut_short") for r in rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
