"""Engine metrics exported through ray.util.metrics (Prometheus on each node's metrics export port).

Fed from `LLM.stats()` snapshots: gauges mirror the snapshot, counters advance by the growth of the
engine's cumulative totals, and request latency is observed per finished request. Objects are
created inside the Ray worker that owns the engine (ray.util.metrics must not be pickled).
Prometheus names carry Ray's `ray_` prefix, e.g. `ray_pagedweight_kv_free_blocks`.
"""
from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

PREFIX = "pagedweight_"

# snapshot value in LLM.stats() -> (metric name, description)
GAUGES = {
    "kv_free_blocks": ("kv_free_blocks", "Free KV-cache blocks (kept prefix blocks included)."),
    "kv_cached_blocks": ("kv_cached_blocks", "KV blocks no request holds, kept for their prefix and counted free."),
    "kv_retained_blocks": ("kv_retained_blocks", "Kept prefix blocks within prefix_retention_s of their release: "
                                                 "the planner holds them as a request's (within kv_cached_blocks)."),
    "kv_total_blocks": ("kv_total_blocks", "KV-cache blocks the page pool holds now (free + used)."),
    "resident_weight_bytes": ("resident_weight_bytes", "Bytes of expert bit-planes and LUTs resident on the device."),
    "pages_in_flight": ("pages_in_flight", "Weight pages being copied host->device or released."),
    "planner_step_ms": ("planner_step_seconds", "Wall time of the last planner step, s."),
    "plan_staleness_steps": ("plan_staleness_steps", "Engine steps since the executed plan was computed."),
    "num_running": ("running_requests", "Requests in the running batch."),
    "num_waiting": ("waiting_requests", "Requests waiting for KV blocks."),
    "budget_bytes": ("budget_bytes", "Bytes gpu_memory_budget covers: weights outside the page pool, the pool and "
                                     "the activation reserve (computed)."),
    "device_reserved_bytes": ("device_reserved_bytes", "Bytes torch's caching allocator holds on the engine's GPU "
                                                       "(measured; weights, pool, activations, graph pools)."),
    "device_peak_reserved_bytes": ("device_peak_reserved_bytes", "Peak of device_reserved_bytes since the process "
                                                                 "started, or since an activation_reserve='auto' "
                                                                 "profile began (measured)."),
}
# cumulative total in LLM.stats() -> (metric name, description)
COUNTERS = {
    "bytes_offloaded": ("offloaded_bytes", "Weight bytes released from the device by precision drops."),
    "bytes_reloaded": ("reloaded_bytes", "Weight bytes copied back to the device by precision raises."),
    "offload_triggers": ("offload_triggers", "Times KV pressure triggered a precision drop."),
    "reload_triggers": ("reload_triggers", "Times free KV blocks triggered a precision raise."),
    "preemptions": ("preemptions", "Requests preempted for lack of KV blocks."),
    "engine_steps": ("engine_steps", "Engine steps run."),
    "steps_in_flight": ("steps_with_pages_in_flight", "Engine steps that ran while weight pages were being copied "
                                                      "or awaited release (copy/compute overlap)."),
    "time_in_flight_s": ("time_with_pages_in_flight_seconds", "Wall seconds of the steps that ran while weight pages were "
                                                        "in flight."),
    "prefix_query_tokens": ("prefix_query_tokens", "Prompt tokens of requests that looked for a shared prefix."),
    "prefix_hit_tokens": ("prefix_hit_tokens", "Prompt tokens found computed in blocks other requests hold or "
                                               "that were kept (prefix sharing)."),
    "kv_evicted_blocks": ("kv_evicted_blocks", "Kept prefix blocks given back for KV or weight pages."),
    "kv_reclaimed_blocks": ("kv_reclaimed_blocks", "Kept prefix blocks that weight reloads took back (within "
                                                   "kv_evicted_blocks)."),
}
# cumulative totals by collector generation (0-2) in LLM.stats() -> (metric name, description), tagged `generation`
GC_COUNTERS = {
    "gc_collections": ("gc_collections", "Garbage collections in the engine's process (generation 2: full, each "
                                         "walks every tracked object while the step loop waits)."),
    "gc_pause_s": ("gc_pause_seconds", "Wall seconds the engine's process spent in garbage collections (measured)."),
}
# Prometheus base units: seconds (stats() keys in ms are scaled, SCALE)
SCALE = {"planner_step_ms": 1e-3}
LATENCY_BOUNDARIES_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]


class EngineMetrics:
    """All metrics of one engine, tagged with its id."""

    def __init__(self, engine_id: str):
        tags = {"engine": engine_id}
        self._gauges = {}
        for key, (name, desc) in GAUGES.items():
            self._gauges[key] = Gauge(PREFIX + name, description=desc, tag_keys=("engine",))
            self._gauges[key].set_default_tags(tags)
        self._counters = {}
        for key, (name, desc) in COUNTERS.items():
            self._counters[key] = Counter(PREFIX + name, description=desc, tag_keys=("engine",))
            self._counters[key].set_default_tags(tags)
        self._gc = {}
        for key, (name, desc) in GC_COUNTERS.items():
            self._gc[key] = Counter(PREFIX + name, description=desc, tag_keys=("engine", "generation"))
            self._gc[key].set_default_tags(tags)
        self._width = Gauge(PREFIX + "committed_width_blocks",
                            description="Expert linear blocks per layer at each committed bit width (the "
                                        "checkpoint's seed width and up).",
                            tag_keys=("engine", "layer", "width"))
        self._width.set_default_tags(tags)
        self._latency = Histogram(PREFIX + "request_latency_seconds",
                                  description="End-to-end request latency, s (finish_reason and work tagged: "
                                              "generate, or score for a perplexity window).",
                                  boundaries=LATENCY_BOUNDARIES_S, tag_keys=("engine", "finish_reason", "work"))
        self._latency.set_default_tags(tags)
        self._ttft = Histogram(PREFIX + "time_to_first_token_seconds", description="Time to first token, s.",
                               boundaries=LATENCY_BOUNDARIES_S, tag_keys=("engine",))
        self._ttft.set_default_tags(tags)
        self._queued = Histogram(PREFIX + "request_queue_time_seconds",
                                 description="Arrival to the first step the engine gave the request (its wait for a "
                                             "slot and KV room; time to first token less this is its prefill's), s.",
                                 boundaries=LATENCY_BOUNDARIES_S, tag_keys=("engine",))
        self._queued.set_default_tags(tags)
        self._last_totals: dict[str, float] = {}

    def update(self, stats: dict) -> None:
        """Export one LLM.stats() snapshot."""
        for key, gauge in self._gauges.items():
            if stats.get(key) is not None:
                gauge.set(float(stats[key]) * SCALE.get(key, 1.0))
        for key, counter in self._counters.items():
            if stats.get(key) is not None:
                self._advance(counter, key, float(stats[key]))
        for key, counter in self._gc.items():
            for generation, total in enumerate(stats.get(key) or ()):
                self._advance(counter, f"{key}{generation}", float(total), {"generation": str(generation)})
        for layer, counts in enumerate(stats.get("committed_width_hist") or []):  # per layer, indexed by width
            for width in range(stats.get("seed_width") or 0, len(counts)):  # none holds a width below the seed
                self._width.set(float(counts[width]), tags={"layer": str(layer), "width": str(width)})

    def _advance(self, counter, key: str, total: float, tags: dict | None = None) -> None:
        """Counters advance by the growth of the engine's cumulative total `key`."""
        growth = total - self._last_totals.get(key, 0.0)
        if growth < 0:  # the engine was rebuilt and its totals restarted from zero
            growth = total
        if growth > 0:
            counter.inc(growth, tags=tags)
        self._last_totals[key] = total

    def observe_request(self, latency_s: float, ttft_s: float | None, finish_reason: str | None,
                        work: str = "generate", queued_s: float | None = None) -> None:
        self._latency.observe(latency_s, tags={"finish_reason": finish_reason or "none", "work": work})
        if ttft_s is not None:
            self._ttft.observe(ttft_s)
        if queued_s is not None:
            self._queued.observe(queued_s)

