"""Prefix-affinity routing among engine replicas: a Ray Serve request router (`serve.request_router.RequestRouter`).

Why: every engine keeps the published KV blocks of finished requests (prefix caching, kv_cache.py), so a chat's next
turn finds its history, and a prompt its shared preamble, only on the replica that served them. Serve's default
router (power of two choices) sends a request to the less busy of two random replicas: with N replicas a later turn
lands where its history is about 1/N of the time and recomputes the rest.

How: each generation request has an affinity key, the part of it that the requests worth co-locating repeat:
  - chat: the messages up to and including the first user message (every later turn of the conversation repeats
    them verbatim; conversations that only share a system prompt still differ there);
  - completions: the prompt's first AFFINITY_CHARS characters (AFFINITY_TOKENS ids for a token prompt): prompts that
    share that much (few-shot examples, one document) tend to share more. A prompt shorter than that is its own key,
    so a completion-API conversation whose first prompt was short may move after it, losing at most that prefix.
Replicas are ordered by rendezvous (highest random weight) hashing of (key, replica id): a key has the same order
on every ingress replica without shared state, and a replica joining or leaving moves only the keys it wins or held.
The request goes to the first replica in that order whose in-flight requests (those this router sent it) are below
ceil((1 + load_epsilon) * (in flight + 1) / replicas): consistent hashing with bounded loads (Mirrokni, Thorup and
Zadimoghaddam, 2018), so a hot key spills over to its next replicas instead of queueing behind one while others
idle. A request without a key (tokenize, health, info) goes to the less busy of two random replicas.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
from collections import Counter

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

AFFINITY_CHARS = 512  # a text prompt's key: its first 512 characters (~128 tokens, 8 KV blocks of 16)
AFFINITY_TOKENS = 128  # a token-id prompt's key


def affinity_key(args: tuple) -> bytes | None:
    """The affinity key of a generation request (the GenerationJob among a handle call's args); None for others."""
    job = next((a for a in args if hasattr(a, "messages") and hasattr(a, "prompt")), None)
    if job is None:
        return None
    if job.messages is not None:
        first_user = next((i for i, m in enumerate(job.messages) if m["role"] == "user"), len(job.messages) - 1)
        head = [[m["role"], m["content"]] for m in job.messages[:first_user + 1]]
        return b"chat\0" + json.dumps([head, job.chat_template_kwargs], sort_keys=True).encode()
    if isinstance(job.prompt, str):
        return b"text\0" + job.prompt[:AFFINITY_CHARS].encode()
    return b"ids\0" + json.dumps(list(job.prompt[:AFFINITY_TOKENS])).encode()


def rendezvous_order(key: bytes, replica_ids: list[str]) -> list[int]:
    """Indices of `replica_ids` by decreasing hash weight of (key, id): deterministic across processes (blake2b, not
    Python's salted hash)."""
    digest = hashlib.blake2b(key, digest_size=16).digest()
    weight = [hashlib.blake2b(digest + rid.encode(), digest_size=8).digest() for rid in replica_ids]
    return sorted(range(len(replica_ids)), key=lambda i: weight[i], reverse=True)


def bounded_choice(order: list[int], loads: list[int], epsilon: float) -> int:
    """The first index in `order` whose load is below the bound ceil((1 + epsilon) * (sum(loads) + 1) / n): one
    always is, since not every load can reach a bound above the mean."""
    cap = math.ceil((1.0 + epsilon) * (sum(loads) + 1) / len(loads))
    return next(i for i in order if loads[i] < cap)


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Routes a generation request to its key's replica under a load bound (module docstring); Serve tries the
    replicas of the ranks it returns in order, so a replica at max_ongoing_requests passes the request on.

    FIFO: the calls one HTTP request makes (its prompts, `n` samples, the model info) share Serve's internal request
    id, and matching a chosen replica to its request by that id (the base router's default) leaves all but one of
    them waiting forever; the FIFO mixin gives it to the oldest request instead, which is the one chosen for except
    when routing tasks finish out of order."""

    def initialize_state(self, load_epsilon: float = 0.5) -> None:
        if load_epsilon < 0:
            raise ValueError(f"load_epsilon must be >= 0, got {load_epsilon}")
        self._epsilon = load_epsilon
        # internal request id (shared by one HTTP request's calls) -> how many of its calls each replica holds
        self._routed: dict[str, Counter[ReplicaID]] = {}
        self._loads: Counter[ReplicaID] = Counter()  # requests in flight per replica (this router's)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        key = affinity_key(pending_request.args) if pending_request is not None else None
        if key is None or len(candidate_replicas) < 2:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        ids = [r.replica_id for r in candidate_replicas]
        order = rendezvous_order(key, [rid.unique_id for rid in ids])
        first = bounded_choice(order, [self._loads[rid] for rid in ids], self._epsilon)
        return [[candidate_replicas[first]], [candidate_replicas[i] for i in order if i != first]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._routed.setdefault(pending_request.metadata.internal_request_id, Counter())[replica_id] += 1
        self._loads[replica_id] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        # also called for a call a replica rejected (never routed): only routed ones count
        held = self._routed.get(internal_request_id)
        if held is None or not held[replica_id]:
            return
        held[replica_id] -= 1
        if not +held:
            del self._routed[internal_request_id]
        self._loads[replica_id] -= 1
        if not self._loads[replica_id]:
            del self._loads[replica_id]
