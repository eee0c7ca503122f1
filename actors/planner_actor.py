"""Cluster-wide routing mass: engines push their tables, the planner actor merges and buckets them.

Each engine measures routing mass m_{l,e} on the requests it served. One engine sees a biased slice
of the traffic, so the routing buckets (damage multiplier and bitwidth floor of each expert) come
from the cluster-wide mass instead: the token-weighted mean of the latest table of every engine,
bucketed with the same rule the engine's own planner uses (pagedweight.signals). KV pressure stays
local to each engine; only this table crosses actors.

Wire format (msgpack maps, arrays as raw little-endian bytes):
  push:  {"engine_id": str, "tokens": float, "shape": [L, E], "mass": float32 bytes}
  reply: {"version": int, "engines": [engine ids], "tokens": float, "shape": [L, E],
          "mass": float32 bytes, "buckets": int8 bytes}   (bucket 0 = hottest)
"""
from __future__ import annotations

import time

import msgpack
import numpy as np
import ray

from pagedweight.signals import bucket_experts, merge_routing_mass

PLANNER_NAME = "pagedweight-planner"
NAMESPACE = "pagedweight"
# a table no push has refreshed for this long leaves the merge: an engine killed without `forget` (SIGKILL, a lost
# node, a Serve replica replaced under a new id) would weigh in forever; engines push every few seconds they serve
STALE_S = 60.0


def encode_table(engine_id: str, mass: np.ndarray, tokens: float) -> bytes:
    """An engine's push message."""
    mass = np.ascontiguousarray(mass, dtype="<f4")
    return msgpack.packb({"engine_id": engine_id, "tokens": float(tokens),
                          "shape": list(mass.shape), "mass": mass.tobytes()})


def decode_reply(payload: bytes) -> dict:
    """The planner's reply with "mass" float32 [L, E] and "buckets" int8 [L, E] arrays."""
    reply = msgpack.unpackb(payload)
    shape = tuple(reply["shape"])
    reply["mass"] = np.frombuffer(reply["mass"], dtype="<f4").reshape(shape)
    reply["buckets"] = np.frombuffer(reply["buckets"], dtype=np.int8).reshape(shape)
    return reply


def decode_tables(payload: bytes) -> dict[str, tuple[np.ndarray, float]]:
    """`PlannerActor.tables()` as {engine id: (mass float32 [L, E], tokens)}."""
    return {e: (np.frombuffer(t["mass"], dtype="<f4").reshape(t["shape"]), float(t["tokens"]))
            for e, t in msgpack.unpackb(payload).items()}


@ray.remote(num_cpus=0)
class PlannerActor:
    """One per model (named, detached): the latest table of every engine that pushed within `stale_s`, merged on
    demand."""

    def __init__(self, n_buckets: int = 4, stale_s: float = STALE_S, clock=time.monotonic):
        self._n_buckets, self._stale_s, self._clock = n_buckets, stale_s, clock
        self._tables: dict[str, tuple[np.ndarray, float]] = {}  # engine id -> (mass [L, E], tokens)
        self._pushed_at: dict[str, float] = {}
        self._version = 0

    def _expire(self) -> None:
        now = self._clock()
        for engine in [e for e, t in self._pushed_at.items() if now - t > self._stale_s]:
            self.forget(engine)

    def push(self, payload: bytes) -> bytes:
        """Store an engine's table (msgpack) and return the merged cluster table (msgpack)."""
        msg = msgpack.unpackb(payload)
        engine = msg["engine_id"]
        mass = np.frombuffer(msg["mass"], dtype="<f4").reshape(msg["shape"]).astype(np.float64)
        if mass.ndim != 2:
            raise ValueError(f"engine {engine} pushed a {mass.ndim}-d table, want [layers, experts]")
        others = [m.shape for e, (m, _) in self._tables.items() if e != engine]
        if others and mass.shape != others[0]:
            raise ValueError(f"engine {engine} pushed a {mass.shape} table, the cluster has {others[0]}")
        tokens = float(msg["tokens"])
        if not np.all(np.isfinite(mass)) or (mass < 0).any() or not 0 <= tokens < np.inf:
            raise ValueError(f"engine {engine} pushed negative or non-finite routing mass or tokens")
        if tokens == 0 and engine in self._tables:  # nothing served since its last push: its weight stays
            tokens = self._tables[engine][1]
        self._tables[engine] = (mass, tokens)
        self._pushed_at[engine] = self._clock()
        self._version += 1
        return self.merged()

    def merged(self) -> bytes:
        self._expire()
        if not self._tables:
            raise ValueError("no routing-mass table pushed yet")
        masses = np.stack([m for m, _ in self._tables.values()])
        tokens = np.array([t for _, t in self._tables.values()])
        mass = merge_routing_mass(masses, tokens)
        return msgpack.packb({
            "version": self._version, "engines": sorted(self._tables), "tokens": float(tokens.sum()),
            "shape": list(mass.shape), "mass": mass.astype("<f4").tobytes(),
            "buckets": bucket_experts(mass, self._n_buckets).astype(np.int8).tobytes(),
        })

    def tables(self) -> bytes:
        """The latest pushed table of every engine (msgpack {engine id: {"tokens", "shape", "mass"}}), so a
        caller can check the merge against its own arithmetic."""
        self._expire()
        return msgpack.packb({e: {"tokens": t, "shape": list(m.shape), "mass": m.astype("<f4").tobytes()}
                              for e, (m, t) in self._tables.items()})

    def forget(self, engine_id: str) -> bool:
        """Drop a retired engine's table."""
        removed = self._tables.pop(engine_id, None) is not None
        self._pushed_at.pop(engine_id, None)
        self._version += int(removed)
        return removed


def get_or_create_planner(model: str, n_buckets: int = 4):
    """The cluster's planner actor of one model (`model`: its planes id, runner.planes_id), created detached on first
    use: engines of different models, whose routing tables neither match nor mix, never share one."""
    return PlannerActor.options(name=f"{PLANNER_NAME}-{model}", namespace=NAMESPACE, lifetime="detached",
                                get_if_exists=True).remote(n_buckets)
