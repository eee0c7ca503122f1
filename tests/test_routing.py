"""Prefix-affinity routing (actors/routing.py): the key, the rendezvous order and the load bound as pure functions,
then a live two-replica app whose conversations find their earlier turns' KV blocks on every later turn."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedweight.actors.openai_app import GenerationJob
from pagedweight.actors.routing import (AFFINITY_CHARS, AFFINITY_TOKENS, affinity_key, bounded_choice,
                                        rendezvous_order)

from conftest import API_KEY, ENGINE_OPTIONS


def job(prompt="", messages=None, **kw) -> GenerationJob:
    return GenerationJob(prompt, 8, 0.0, 1.0, 0, None, [], False, "r", messages=messages, **kw)


def chat(*contents: str, system: str | None = "Be brief.") -> list[dict]:
    roles = ["user", "assistant"] * len(contents)
    head = [{"role": "system", "content": system}] if system is not None else []
    return head + [{"role": r, "content": c} for r, c in zip(roles, contents)]


def test_a_conversations_turns_share_its_key_and_conversations_differ():
    turn1 = affinity_key((job(messages=chat("Reverse a string.")),))
    turn3 = affinity_key((job(messages=chat("Reverse a string.", "s[::-1]", "And a list?")),))
    assert turn1 == turn3
    assert affinity_key((job(messages=chat("Sort a list.")),)) != turn1  # same system prompt, another question
    assert affinity_key((job(messages=chat("Reverse a string.", system="Be verbose.")),)) != turn1
    assert affinity_key((job(messages=chat("Reverse a string.", system=None)),)) != turn1
    # the template's variables render a different prompt
    assert affinity_key((job(messages=chat("Reverse a string."), chat_template_kwargs={"x": 1}),)) != turn1
    # a conversation with no user message yet keys on all of it
    assert affinity_key((job(messages=chat(system="Only a system prompt.")[:1]),)) is not None


def test_completion_prompts_key_on_their_start():
    base = "x" * AFFINITY_CHARS
    assert affinity_key((job(base + "one"),)) == affinity_key((job(base + "two"),))
    assert affinity_key((job("short one"),)) != affinity_key((job("short one, longer"),))
    ids = list(range(AFFINITY_TOKENS))
    assert affinity_key((job(ids + [1]),)) == affinity_key((job(ids + [2]),))
    assert affinity_key((job(ids[:5]),)) != affinity_key((job(ids[:6]),))
    assert affinity_key((job(ids[:5]),)) != affinity_key((job("ids"),))  # kinds never collide
    # not a generation request (tokenize jobs carry messages but no prompt-or-messages generation job shape)
    assert affinity_key(()) is None and affinity_key(([1, 2, 3],)) is None


replica_sets = st.lists(st.text(alphabet="abcdef0123456789", min_size=4, max_size=8), min_size=2, max_size=8,
                        unique=True)


@settings(max_examples=200, deadline=None)
@given(key=st.binary(min_size=1, max_size=64), ids=replica_sets, drop=st.integers(min_value=0))
def test_rendezvous_order_is_stable_when_a_replica_leaves(key, ids, drop):
    """A permutation that depends only on (key, ids); removing one replica keeps the others' relative order, so
    only the keys whose first replica left move."""
    order = rendezvous_order(key, ids)
    assert sorted(order) == list(range(len(ids)))
    rev = ids[::-1]
    assert [rev[i] for i in rendezvous_order(key, rev)] == [ids[i] for i in order]
    gone = ids[drop % len(ids)]
    rest = [r for r in ids if r != gone]
    assert [rest[i] for i in rendezvous_order(key, rest)] == [ids[i] for i in order if ids[i] != gone]


@settings(max_examples=300, deadline=None)
@given(loads=st.lists(st.integers(min_value=0, max_value=50), min_size=2, max_size=8), seed=st.randoms(),
       epsilon=st.sampled_from([0.0, 0.25, 0.5, 1.0]))
def test_bounded_choice_takes_the_first_replica_under_the_bound(loads, seed, epsilon):
    order = list(range(len(loads)))
    seed.shuffle(order)
    cap = math.ceil((1 + epsilon) * (sum(loads) + 1) / len(loads))
    chosen = bounded_choice(order, loads, epsilon)
    assert loads[chosen] < cap
    assert all(loads[i] >= cap for i in order[:order.index(chosen)])


def test_a_hot_key_spills_over_and_loads_stay_bounded():
    """Every request with one key, none finishing: the key's replica takes them until it holds (1 + epsilon) times
    the mean, then the next ones in its order take the rest; no replica ever exceeds the bound."""
    ids = [f"replica{i}" for i in range(4)]
    order = rendezvous_order(b"text\0hot", ids)
    loads = [0] * 4
    for n in range(1, 201):
        i = bounded_choice(order, loads, 0.5)
        loads[i] += 1
        assert max(loads) <= math.ceil(1.5 * n / 4)
    assert [loads[i] for i in order] == [75, 75, 50, 0]  # 1.5 x the mean of 50, twice, then the rest


def test_router_ranks_by_key_counts_calls_and_spills_under_load():
    """The router's own state, without Serve: a generation call goes to its key's replica alone, the rest behind it;
    the calls of one HTTP request share an internal id and are counted apiece; a rejected call (completed, never
    routed) changes nothing; once the key's replica holds its bound the next call goes to the next replica."""
    import asyncio
    from collections import namedtuple
    from types import SimpleNamespace as NS

    from pagedweight.actors.routing import PrefixAffinityRouter

    Rid = namedtuple("Rid", "unique_id")  # hashable, as Serve's ReplicaID

    router = PrefixAffinityRouter.__new__(PrefixAffinityRouter)  # Serve's constructor wants a live deployment
    router.initialize_state(load_epsilon=0.0)
    ids = ["aaaa", "bbbb", "cccc"]
    replicas = [NS(replica_id=Rid(u)) for u in ids]
    key_job = job("x" * 600)
    order = rendezvous_order(affinity_key((key_job,)), ids)

    def choose(request_id: str) -> list[list]:
        pending = NS(args=(key_job,), metadata=NS(internal_request_id=request_id))
        return asyncio.run(router.choose_replicas(replicas, pending))

    ranks = choose("r")
    assert ranks[0] == [replicas[order[0]]] and ranks[1] == [replicas[i] for i in order[1:]]
    first = replicas[order[0]].replica_id
    for _ in range(2):  # two prompts of one HTTP request
        router.on_request_routed(NS(metadata=NS(internal_request_id="r")), first, None)
    assert router._loads[first] == 2
    assert choose("s")[0] == [replicas[order[1]]]  # bound ceil(3 / 3) = 1: the key's replica is full
    router.on_request_completed(replicas[order[2]].replica_id, "r")  # a rejection elsewhere: not counted
    router.on_request_completed(first, "r")
    router.on_request_completed(first, "r")
    router.on_request_completed(first, "r")  # more completions than calls: nothing below zero
    assert not router._loads and not router._routed
    assert choose("t")[0] == [replicas[order[0]]]
    no_key = asyncio.run(router.choose_replicas(replicas, NS(args=(), metadata=NS(internal_request_id="u"))))
    assert len(no_key) == 1 and len(no_key[0]) == 2


@pytest.fixture(scope="module")
def affinity_app(serve_app, ap_model_dir):
    """The OpenAI app with two engine replicas (and two ingresses) beside the session's one-replica app."""
    from ray import serve

    from pagedweight.actors.openai_app import AppArgs, build_app

    args = AppArgs(model_dir=str(ap_model_dir), num_replicas=2, api_key=API_KEY, engine_num_cpus=0,
                   engine_options=ENGINE_OPTIONS)
    serve.run(build_app(args), name="affinity", route_prefix="/affinity")
    yield f"{serve_app.base_url}/affinity/v1"
    serve.delete("affinity")


def test_every_later_turn_finds_its_history_on_two_replicas(affinity_app, serve_app):
    """Six two-turn conversations through two ingresses and two engine replicas: each second turn reports the first
    turn's prompt blocks as cached, so it reached the replica that served the first. Routed at random (Serve's
    default with two replicas), all six would find them with probability 1/64."""
    import openai

    client = openai.OpenAI(base_url=affinity_app, api_key=API_KEY, max_retries=0, timeout=120)
    questions = ["Reverse a string.", "Sort a list.", "Parse an int.", "Merge two dicts.", "Read a file.",
                 "Count words."]
    for q in questions:
        first = chat("Write Python for this task, with a docstring and type hints: " + q)
        a = client.chat.completions.create(model=serve_app.model, messages=first, max_tokens=8, temperature=0)
        second = first + [{"role": "assistant", "content": a.choices[0].message.content},
                          {"role": "user", "content": "Now add tests."}]
        b = client.chat.completions.create(model=serve_app.model, messages=second, max_tokens=8, temperature=0)
        full_blocks = (a.usage.prompt_tokens - 1) // 16 * 16  # the first turn's whole blocks (its last token aside)
        assert full_blocks > 0
        assert b.usage.prompt_tokens_details.cached_tokens >= full_blocks, q
