"""The OpenAI-compatible Serve app, live on the session's local Ray cluster (conftest.serve_app).

References: greedy text must equal what the engine produces offline for the same prompt (so the
HTTP/SSE layers lose or reorder nothing), prompt token counts must equal the tokenizer's own count,
and the engine replica's KV accounting must return to "all free" after every request, including
ones whose client went away.
"""
from __future__ import annotations

import json
import socket
import threading
import time
import warnings

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from conftest import ENGINE_OPTIONS, ROOT

PROMPT = "def fibonacci(n):\n    "
MESSAGES = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "A function that adds two numbers."}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def client(serve_app):
    return openai.OpenAI(base_url=f"{serve_app.base_url}/v1", api_key=serve_app.api_key, max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def offline(ap_model_dir):
    """The same engine, offline, in this process: the reference for greedy text."""
    import torch

    from pagedweight.engine import LLM
    from pagedweight.sampling import SamplingParams

    torch.set_num_threads(1)
    llm = LLM(ap_model_dir, **ENGINE_OPTIONS)

    def greedy(prompt: str, max_tokens: int = MAX_TOKENS, **kw):
        return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, **kw), use_tqdm=False)[0]

    greedy.max_model_len = llm.max_model_len
    greedy.chat_ids = llm.tokenizer.apply_chat_template  # messages -> the prompt's ids, as the replica renders them
    return greedy


@pytest.fixture(scope="module")
def n_tokens(model_dir):
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return lambda text: len(tok.encode(text).ids)


def engine_stats() -> dict:
    from ray import serve

    return serve.get_deployment_handle("EngineReplica", app_name="pagedweight").stats.remote().result()


def wait_idle(timeout: float = 20.0) -> dict:
    """Stats once the replica has no request in flight and every KV block is free again."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine_stats()
        if stats["in_flight"] == 0 and stats["kv_free_blocks"] == stats["kv_total_blocks"]:
            return stats
        assert time.monotonic() < deadline, f"engine did not go idle: {stats}"
        time.sleep(0.1)


def test_models_lists_the_bundled_model(client, serve_app, offline):
    models = client.models.list().data
    assert [m.id for m in models] == [serve_app.model]
    assert models[0].model_extra["max_model_len"] == offline.max_model_len
    assert client.models.retrieve(serve_app.model) == models[0]  # GET /v1/models/{model}
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert info.value.body["code"] == "model_not_found"


def test_completion_matches_offline_engine(client, serve_app, offline, n_tokens):
    ref = offline(PROMPT)
    resp = client.completions.create(model=serve_app.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    (choice,) = resp.choices
    assert choice.text == ref.text and choice.text.strip()
    assert choice.finish_reason == ref.finish_reason
    assert resp.usage.prompt_tokens == n_tokens(PROMPT)
    assert resp.usage.completion_tokens == len(ref.token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_completion_stream_matches_non_stream(client, serve_app, offline, n_tokens):
    ref = offline(PROMPT)
    stream = client.completions.create(model=serve_app.model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) >= 2  # streamed step by step, not in one piece
    assert "".join(c.choices[0].text for c in text_chunks) == ref.text
    assert text_chunks[-1].choices[0].finish_reason == ref.finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.prompt_tokens == n_tokens(PROMPT)
    assert usage.completion_tokens == len(ref.token_ids)


def test_chat_matches_offline_engine_stream_and_not(client, serve_app, offline):
    ref = offline(offline.chat_ids(MESSAGES))
    resp = client.chat.completions.create(model=serve_app.model, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                          temperature=0)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.text and ref.text.strip()
    assert resp.usage.completion_tokens == len(ref.token_ids)
    chunks = list(client.chat.completions.create(model=serve_app.model, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True, response_format={"type": "text"}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason
    wait_idle()


def test_tokenize_detokenize_and_health(client, serve_app, offline, model_dir):
    """vLLM's /tokenize gives the ids a completion or chat completion starts from (usage.prompt_tokens counts them),
    /detokenize turns them back into text, /health answers probes without a key; bad bodies get 4xx."""
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    headers = {"Authorization": f"Bearer {serve_app.api_key}"}
    with httpx.Client(base_url=serve_app.base_url, timeout=60, headers=headers) as http:
        r = http.post("/tokenize", json={"model": serve_app.model, "prompt": PROMPT, "return_token_strs": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tokens"] == tok.encode(PROMPT).ids and body["count"] == len(body["tokens"])
        assert body["max_model_len"] == offline.max_model_len
        assert body["token_strs"] == [tok.id_to_token(i) for i in body["tokens"]]
        done = client.completions.create(model=serve_app.model, prompt=PROMPT, max_tokens=1, temperature=0)
        assert done.usage.prompt_tokens == body["count"]
        chat = http.post("/tokenize", json={"messages": MESSAGES}).json()  # "model" may be left out, as vLLM's
        assert chat["tokens"] == offline.chat_ids(MESSAGES) and "token_strs" not in chat
        done = client.chat.completions.create(model=serve_app.model, messages=MESSAGES, max_tokens=1)
        assert done.usage.prompt_tokens == chat["count"]
        back = http.post("/detokenize", json={"model": serve_app.model, "tokens": body["tokens"]})
        assert back.status_code == 200 and back.json() == {"prompt": tok.decode(body["tokens"],
                                                                                skip_special_tokens=False)}
        assert back.json()["prompt"] == PROMPT
        bad = [("/tokenize", {"prompt": PROMPT, "messages": MESSAGES}, 400), ("/tokenize", {}, 400),
               ("/tokenize", {"prompt": 5}, 400), ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, 400),
               ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}, 400),
               ("/tokenize", {"model": "other", "prompt": "x"}, 404), ("/detokenize", {"tokens": [1, -2]}, 400),
               ("/detokenize", {"tokens": [1 << 30]}, 400), ("/detokenize", {"tokens": "1 2"}, 400)]
        for url, payload, status in bad:
            r = http.post(url, json=payload)
            assert r.status_code == status and r.json()["error"]["message"], (url, payload, r.status_code, r.text)
        assert httpx.post(f"{serve_app.base_url}/tokenize", json={"prompt": "x"}).status_code == 401  # no key
        assert httpx.get(f"{serve_app.base_url}/health").status_code == 200  # no key needed
    wait_idle()


def test_next_chat_turn_reuses_the_kept_blocks(client, serve_app, offline):
    """A conversation's second turn, sent after the first has ended, finds the first turn's KV blocks kept: usage
    counts them as cached prompt tokens (whole 16-token blocks), and the answer is the offline engine's."""
    system = {"role": "system", "content": "You write short, correct Python. " * 6}
    first = [system, {"role": "user", "content": "A function that reverses a string."}]
    answer = client.chat.completions.create(model=serve_app.model, messages=first, max_tokens=MAX_TOKENS,
                                            temperature=0).choices[0].message.content
    wait_idle()
    second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Now add a docstring."}]
    ref = offline(offline.chat_ids(second))
    resp = client.chat.completions.create(model=serve_app.model, messages=second, max_tokens=MAX_TOKENS,
                                          temperature=0)
    assert resp.choices[0].message.content == ref.text
    cached = resp.usage.prompt_tokens_details.cached_tokens
    assert resp.usage.prompt_tokens == len(offline.chat_ids(second))
    # whole blocks, at least the first turn's prompt's (its rendering begins the second's), short of the last token
    assert cached % 16 == 0 and (len(offline.chat_ids(first)) - 1) // 16 * 16 <= cached < resp.usage.prompt_tokens
    wait_idle()


def test_logprobs_match_offline_engine_stream_and_not(client, serve_app, offline):
    """Completions' logprobs (tokens, token_logprobs, top_logprobs, text_offset) and chat's (content: token,
    logprob, bytes, top_logprobs) carry the offline engine's log-probabilities of the same greedy tokens, whole and
    streamed alike."""
    ref = offline(PROMPT, logprobs=2)
    want = [entry[tok] for tok, entry in zip(ref.token_ids, ref.logprobs)]
    kw = dict(model=serve_app.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=2)
    lp = client.completions.create(**kw).choices[0].logprobs
    assert "".join(lp.tokens) == ref.text and len(lp.token_logprobs) == len(ref.token_ids)
    assert all(abs(a - b) < 1e-4 for a, b in zip(lp.token_logprobs, want))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for tok, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2 and abs(max(top.values()) - tok) < 1e-6  # greedy: its token is the most likely
    chunks = [c for c in client.completions.create(**kw, stream=True) if c.choices]
    streamed = [c.choices[0].logprobs for c in chunks]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [x for s in streamed for x in s.token_logprobs] == lp.token_logprobs
    assert [x for s in streamed for x in s.text_offset] == lp.text_offset
    assert client.completions.create(**{**kw, "logprobs": None}).choices[0].logprobs is None
    # sampled, so often not the most likely: the API "will always return the logprob of the sampled token"
    hot = client.completions.create(**{**kw, "temperature": 2.0, "seed": 3, "logprobs": 1}).choices[0].logprobs
    assert all(top[t] == x and len(top) <= 2 for t, x, top in zip(hot.tokens, hot.token_logprobs, hot.top_logprobs))
    assert any(len(top) == 2 for top in hot.top_logprobs)

    ref = offline(offline.chat_ids(MESSAGES), logprobs=3)
    resp = client.chat.completions.create(model=serve_app.model, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert "".join(c.token for c in content) == ref.text and len(content) == len(ref.token_ids)
    for c, tok, entry in zip(content, ref.token_ids, ref.logprobs):
        assert abs(c.logprob - entry[tok]) < 1e-4 and c.bytes == list(c.token.encode())
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == c.logprob
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
    plain = client.chat.completions.create(model=serve_app.model, messages=MESSAGES, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None
    wait_idle()


def test_echo_scores_the_prompt_as_lm_eval_reads_it(serve_app, offline):
    """lm-evaluation-harness's loglikelihood request (local-completions: token-id prompt, temperature 0, max_tokens 1,
    logprobs 1, echo): the answer starts with the prompt, token_logprobs[0] and top_logprobs[0] are null, and the
    prompt tokens' values are the offline engine's prompt log-probabilities; streamed alike; max_tokens 0 echoes the
    prompt alone."""
    headers = {"Authorization": f"Bearer {serve_app.api_key}"}
    ref = offline(PROMPT, max_tokens=1, prompt_logprobs=1, logprobs=1)
    ids = ref.prompt_token_ids
    want = [None] + [entry[tok] for tok, entry in zip(ids[1:], ref.prompt_logprobs[1:])] + \
        [ref.logprobs[0][ref.token_ids[0]]]
    body = {"model": serve_app.model, "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    with httpx.Client(base_url=serve_app.base_url, timeout=60, headers=headers) as http:
        (choice,) = http.post("/v1/completions", json=body).json()["choices"]
        lp = choice["logprobs"]
        assert choice["text"] == PROMPT + ref.text and "".join(lp["tokens"]) == choice["text"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert len(lp["token_logprobs"]) == len(want) == len(ids) + 1
        assert all(abs(a - b) < 1e-4 for a, b in zip(lp["token_logprobs"][1:], want[1:]))
        # the most likely token and the prompt's own (the API always returns the sampled token's)
        assert all(1 <= len(top) <= 2 and top[t] == x
                   for t, x, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]))
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
        ctxlen = 2  # lm-eval: the continuation's log-likelihood and whether greedy decoding would produce it
        cont = lp["token_logprobs"][ctxlen:-1]
        greedy = all(tok == max(top.values()) for tok, top in zip(cont, lp["top_logprobs"][ctxlen:-1]))
        assert abs(sum(cont) - sum(want[ctxlen:-1])) < 1e-3
        scored = zip(ids[ctxlen + 1:], ref.prompt_logprobs[ctxlen + 1:])
        assert greedy == all(max(e.values()) == e[t] for t, e in scored)

        events = stream_events(http, {**body, "stream": True})
        assert events[0]["choices"][0]["text"] == PROMPT  # the prompt first, then the completion
        assert [x for e in events for x in e["choices"][0]["logprobs"]["token_logprobs"]] == lp["token_logprobs"]

        alone = http.post("/v1/completions", json={**body, "max_tokens": 0}).json()
        assert alone["choices"][0]["text"] == PROMPT and alone["usage"]["completion_tokens"] == 0
        assert alone["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][:-1]
        plain = http.post("/v1/completions", json={**body, "logprobs": None, "max_tokens": 0}).json()["choices"][0]
        assert plain["text"] == PROMPT and plain["logprobs"] is None
    wait_idle()


def test_batched_prompts_answer_each_in_its_choice(serve_app, offline, n_tokens):
    """A list of prompts (strings or token-id lists, as lm-evaluation-harness sends at batch sizes above 1) gets one
    choice per prompt, in order, each the offline engine's answer; usage sums over them; streamed events carry their
    choice's index. One prompt past the context fails the request (400) and its other prompts are cancelled."""
    headers = {"Authorization": f"Bearer {serve_app.api_key}"}
    prompts = [PROMPT, "class Stack:", "import os\n"]
    refs = [offline(p, max_tokens=6, prompt_logprobs=1, logprobs=1) for p in prompts]
    body = {"model": serve_app.model, "prompt": [prompts[0], refs[1].prompt_token_ids, prompts[2]],
            "max_tokens": 6, "temperature": 0}
    with httpx.Client(base_url=serve_app.base_url, timeout=60, headers=headers) as http:
        resp = http.post("/v1/completions", json=body).json()
        assert [c["index"] for c in resp["choices"]] == [0, 1, 2]
        assert [c["text"] for c in resp["choices"]] == [r.text for r in refs]
        assert resp["usage"]["prompt_tokens"] == sum(n_tokens(p) for p in prompts)
        assert resp["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # no common full block
        assert resp["usage"]["completion_tokens"] == sum(len(r.token_ids) for r in refs)

        events = stream_events(http, {**body, "stream": True, "stream_options": {"include_usage": True}})
        texts = ["", "", ""]
        for e in events[:-1]:
            (choice,) = e["choices"]
            texts[choice["index"]] += choice["text"]
        assert texts == [r.text for r in refs] and events[-1]["usage"] == resp["usage"]
        assert all("usage" in e and e["usage"] is None for e in events[:-1])  # OpenAI's: null but in the last
        assert all("usage" not in e for e in stream_events(http, {**body, "stream": True}))

        scored = http.post("/v1/completions", json={**body, "max_tokens": 1, "logprobs": 1, "echo": True}).json()
        for choice, ref in zip(scored["choices"], refs):
            want = [entry[t] for t, entry in zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:])]
            got = choice["logprobs"]["token_logprobs"]
            assert got[0] is None and len(got) == len(want) + 2
            assert all(abs(a - b) < 1e-4 for a, b in zip(got[1:-1], want))

        too_long = [1] * (offline.max_model_len + 1)
        r = http.post("/v1/completions", json={**body, "prompt": [prompts[0], too_long], "max_tokens": 200,
                                                 "ignore_eos": True})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    wait_idle()


def test_n_samples_each_prompt(client, serve_app, offline, n_tokens):
    """n > 1: n choices per prompt (prompt-major), the j-th drawn with seed + j, so each is the offline engine's
    answer at that seed; prompt tokens count once per prompt; chat's choices likewise, streamed with their index."""
    kw = dict(max_tokens=8, temperature=1.0, seed=11)
    resp = client.completions.create(model=serve_app.model, prompt=[PROMPT, "class Stack:"], n=3, **kw)
    assert [c.index for c in resp.choices] == list(range(6))
    want = [offline(p, seed=11 + j, **{k: v for k, v in kw.items() if k != "seed"}).text
            for p in (PROMPT, "class Stack:") for j in range(3)]
    assert [c.text for c in resp.choices] == want and len(set(want[:3])) > 1
    assert resp.usage.prompt_tokens == n_tokens(PROMPT) + n_tokens("class Stack:")
    chunks = list(client.chat.completions.create(model=serve_app.model, messages=MESSAGES, n=2, max_tokens=6,
                                                 temperature=0, stream=True))
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    whole = client.chat.completions.create(model=serve_app.model, messages=MESSAGES, n=2, max_tokens=6, temperature=0)
    assert texts[0] == texts[1] == whole.choices[0].message.content == whole.choices[1].message.content
    wait_idle()


def test_penalties_and_logit_bias_match_offline_engine(client, serve_app, offline):
    """presence_penalty, frequency_penalty and logit_bias reach the engine: the greedy text is the offline engine's
    under the same adjustments, and a bias of +100 makes every token the biased one."""
    kw = dict(presence_penalty=1.2, frequency_penalty=0.8, logit_bias={"13": 3.0})
    ref = offline(PROMPT, presence_penalty=1.2, frequency_penalty=0.8, logit_bias={13: 3.0})
    assert ref.text != offline(PROMPT).text
    resp = client.completions.create(model=serve_app.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                     **kw)
    assert resp.choices[0].text == ref.text
    forced = offline(PROMPT, max_tokens=4, logit_bias={13: 100.0}, ignore_eos=True)
    assert forced.token_ids == [13] * 4
    chat = client.chat.completions.create(model=serve_app.model, messages=MESSAGES, max_tokens=4, temperature=0,
                                          logit_bias={"13": 100}, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == forced.text
    # vLLM's min_p and stop_token_ids, as an OpenAI client sends them (extra_body): the text ends at the stop token
    stop_id = ref.token_ids[2]
    cut = offline(PROMPT, stop_token_ids=[stop_id], presence_penalty=1.2, frequency_penalty=0.8,
                  logit_bias={13: 3.0})
    assert cut.finish_reason == "stop" and len(cut.token_ids) < len(ref.token_ids)
    resp = client.completions.create(model=serve_app.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"stop_token_ids": [stop_id], "min_p": 0.5}, **kw)
    assert resp.choices[0].text == cut.text and resp.choices[0].finish_reason == "stop"
    held = offline(PROMPT, stop_token_ids=[stop_id], min_tokens=6, presence_penalty=1.2, frequency_penalty=0.8,
                   logit_bias={13: 3.0})
    assert len(held.token_ids) >= 6 and stop_id not in held.token_ids[:6]
    resp = client.completions.create(model=serve_app.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"stop_token_ids": [stop_id], "min_tokens": 6}, **kw)
    assert resp.choices[0].text == held.text and resp.usage.completion_tokens == len(held.token_ids)
    rep = offline(PROMPT, repetition_penalty=1.5)
    assert rep.text != offline(PROMPT).text
    resp = client.completions.create(model=serve_app.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"repetition_penalty": 1.5})
    assert resp.choices[0].text == rep.text
    wait_idle()


def stream_events(http: httpx.Client, body: dict) -> list[dict]:
    """The data events of a streamed completion, [DONE] excluded."""
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_sampling_with_seed_is_reproducible(client, serve_app):
    kw = dict(model=serve_app.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.9, seed=7)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_sixteen_concurrent_clients_lose_nothing(serve_app):
    """16 clients loop for a bounded time over all four endpoint modes; every request must come back
    complete with 200 (a 5xx or a dropped/short response fails)."""
    duration_s, results, errors = 6.0, [], []
    deadline = time.monotonic() + duration_s
    headers = {"Authorization": f"Bearer {serve_app.api_key}"}

    def worker(i: int) -> None:
        with httpx.Client(base_url=serve_app.base_url, headers=headers, timeout=120) as http:
            n = 0
            while time.monotonic() < deadline:
                chat, stream = (i + n) % 2 == 0, (i + n) % 4 < 2
                body = {"model": serve_app.model, "max_tokens": 6, "temperature": 0.7, "seed": i * 1000 + n,
                        "stream": stream, "ignore_eos": True}
                if chat:
                    body["messages"] = [{"role": "user", "content": f"client {i} request {n}"}]
                else:
                    body["prompt"] = f"# client {i} request {n}\n"
                url = "/v1/chat/completions" if chat else "/v1/completions"
                try:
                    if stream:
                        with http.stream("POST", url, json=body) as r:
                            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
                        ok = r.status_code == 200 and lines[-1] == "data: [DONE]" and \
                            json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
                    else:
                        r = http.post(url, json=body)
                        ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
                    results.append((r.status_code, ok))
                except Exception as exc:  # noqa: BLE001 - every failure is a lost request
                    errors.append(repr(exc))
                n += 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not errors, errors[:3]
    assert len(results) >= 16
    assert all(code == 200 and ok for code, ok in results), [r for r in results if r != (200, True)][:5]
    wait_idle()


def test_vllm_clients_parameters_are_taken():
    """What clients written for vLLM send: top_k -1 (off), null for a boolean (its default), a harness task's whole
    stop list (lm-evaluation-harness's humaneval: 8 strings and the EOS), and text parts (joined by newlines)."""
    from pagedweight.actors.openai_app import validate_request

    body = {"model": "m", "prompt": "x", "top_k": -1, "stream": None, "echo": None,
            "stop": ["\nclass", "\ndef", "\n#", "\nif", "\nprint", "\n```", "<file_sep>", "\nassert", "<|endoftext|>"]}
    req = validate_request(body, "completion", "m", 64)
    assert req.jobs[0].top_k == 0 and not req.stream and not req.jobs[0].echo and len(req.jobs[0].stop) == 9
    parts = [{"type": "text", "text": "Read this:"}, {"type": "text", "text": "x = 1"}]
    chat = validate_request({"model": "m", "messages": [{"role": "user", "content": parts}]}, "chat", "m", 64)
    assert chat.jobs[0].messages == [{"role": "user", "content": "Read this:\nx = 1"}]


def test_openai_clients_parameters_are_taken():
    """The API's seed is any int64 (OpenAI's and vLLM's range; clients send -1): a negative one reaches the engine's
    generators, which take [0, 2**64), as its two's complement, and the j-th of n samples draws with seed + j there.
    tool_choice / function_call "none" and "auto" ask for no tool call and get a plain answer; one that asks for a
    call is refused (400), not answered with text as if no tool had been asked for."""
    from pagedweight.actors.openai_app import APIError, _sampling_params, validate_request

    def jobs(**kw) -> list:
        return validate_request({"model": "m", "prompt": "x", **kw}, "completion", "m", 64).jobs

    assert [j.seed for j in jobs(seed=-1)] == [(1 << 64) - 1]
    assert [j.seed for j in jobs(seed=-1, n=3)] == [(1 << 64) - 1, 0, 1]
    assert [j.seed for j in jobs(seed=(1 << 63) - 1, n=2)] == [(1 << 63) - 1, 1 << 63]
    assert [j.seed for j in jobs(seed=-(1 << 63))] == [1 << 63]
    for job in jobs(seed=-5, n=8) + jobs(seed=(1 << 63) - 1, n=8):
        assert _sampling_params(job, 4).seed == job.seed  # the engine takes it
    for bad in (1 << 63, -(1 << 63) - 1, 1.5, "7"):
        with pytest.raises(APIError) as info:
            jobs(seed=bad)
        assert info.value.status == 400 and info.value.param == "seed"

    msgs = [{"role": "user", "content": "hi"}]
    # chat_template_kwargs that would set apply_chat_template's own arguments: a 400 (they were a TypeError in the
    # replica, answered 503, which the OpenAI client retries)
    for kwargs in ({"messages": []}, {"self": 1}):
        with pytest.raises(APIError) as info:
            validate_request({"model": "m", "messages": msgs, "chat_template_kwargs": kwargs}, "chat", "m", 64)
        assert info.value.status == 400 and info.value.param == "chat_template_kwargs"
    for name, value in [("tool_choice", "none"), ("tool_choice", "auto"), ("function_call", "none"),
                        ("function_call", "auto"), ("tool_choice", None)]:
        validate_request({"model": "m", "messages": msgs, name: value}, "chat", "m", 64)
    for name, value in [("tool_choice", "required"), ("tool_choice", {"type": "function", "function": {"name": "f"}}),
                        ("function_call", {"name": "f"})]:
        with pytest.raises(APIError) as info:
            validate_request({"model": "m", "messages": msgs, name: value}, "chat", "m", 64)
        err = info.value.body()["error"]
        assert info.value.status == 400 and err["param"] == name and err["code"] == "unsupported_parameter"


def test_stream_error_ends_with_done_and_no_usage():
    """An error mid-stream is the last data event before [DONE]: no usage chunk after it (as vLLM's), whose counts
    would describe an answer that was not given; the other prompts' calls are cancelled."""
    import asyncio

    from pagedweight.actors.openai_app import APIError, _sse, validate_request

    req = validate_request({"model": "m", "prompt": ["x", "y"], "stream": True,
                            "stream_options": {"include_usage": True}}, "completion", "m", 64)
    heads = [{"prompt_tokens": 1, "cached_tokens": 0}] * 2

    async def fails():
        yield {"delta": "a", "completion_tokens": 1, "finish_reason": None}
        yield APIError(500, "engine error", type="server_error").body()

    async def fine():
        yield {"delta": "b", "completion_tokens": 1, "finish_reason": "length"}

    async def events(streams) -> tuple[list[str], list]:
        cancels = []
        return [e async for e in _sse(req, heads, streams, lambda: cancels.append(True))], cancels

    out, cancels = asyncio.run(events([fails(), fine()]))
    data = [e.removeprefix("data: ").rstrip("\n") for e in out]
    assert data[-1] == "[DONE]" and json.loads(data[-2])["error"]["message"] == "engine error"
    assert cancels == [True] and not any(json.loads(d).get("usage") for d in data[:-1])
    out, cancels = asyncio.run(events([fine(), fine()]))  # no error: the usage chunk before [DONE]
    assert json.loads(out[-2][6:])["usage"]["completion_tokens"] == 2 and not cancels


def _ingress(engine, api_key: str | None = None):
    """The ingress class as written (without Serve's wrapper), on a stand-in engine handle."""
    from pagedweight.actors.openai_app import OpenAIIngress

    return OpenAIIngress.func_or_class.__mro__[1](engine, api_key)


def _request(method: str, path: str, body: dict | None = None, key: str | None = None):
    from starlette.requests import Request

    raw = json.dumps(body).encode() if body is not None else b""

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    return Request({"type": "http", "method": method, "path": path, "headers": headers}, receive)


def test_model_retrieval_and_no_replica_answers_503():
    """GET /v1/models/{model} (the OpenAI client's models.retrieve) answers the served model's card, 404
    model_not_found for another name, 401 without the key. An engine handle that fails outside a generation stream
    (no replica answers the first request's model info, or a tokenize call) is a 503 with an OpenAI-style body,
    not an exception that the server turns into a bare 500."""
    import asyncio
    import types

    async def info():
        return {"model_name": "org/m", "max_model_len": 64}

    async def gone(*_):
        raise ConnectionError("no replica")

    def engine(info_fn, tokenize_fn=gone):
        return types.SimpleNamespace(info=types.SimpleNamespace(remote=info_fn),
                                     tokenize=types.SimpleNamespace(remote=tokenize_fn))

    up = _ingress(engine(info), "k")
    card = asyncio.run(up.model(_request("GET", "/v1/models/org/m", key="k"), "org/m"))
    assert card == asyncio.run(up.models(_request("GET", "/v1/models", key="k")))["data"][0]
    assert card["id"] == "org/m" and card["object"] == "model"
    other = asyncio.run(up.model(_request("GET", "/v1/models/gpt-4o", key="k"), "gpt-4o"))
    assert other.status_code == 404 and json.loads(other.body)["error"]["code"] == "model_not_found"
    assert asyncio.run(up.model(_request("GET", "/v1/models/org/m"), "org/m")).status_code == 401

    down = _ingress(engine(gone))
    body = {"model": "org/m", "prompt": "x"}
    for response in (asyncio.run(down._handle(_request("POST", "/v1/completions", body), "completion")),
                     asyncio.run(down.models(_request("GET", "/v1/models"))),
                     asyncio.run(down.model(_request("GET", "/v1/models/org/m"), "org/m")),
                     asyncio.run(_ingress(engine(info)).tokenize(_request("POST", "/tokenize", body)))):
        err = json.loads(response.body)["error"]
        assert response.status_code == 503 and err["code"] == "engine_unavailable", err
        assert err["type"] == "server_error" and "no replica" in err["message"]


def test_context_length_error_names_the_field_that_is_too_long(model_dir):
    """A prompt past the context is a 400 context_length_exceeded whose param is what the client sent: 'prompt' for a
    completion, 'messages' for a chat completion (OpenAI's)."""
    import asyncio

    from pagedweight.actors.engine_actor import AsyncEngine, EngineConfig, build_llm
    from pagedweight.actors.openai_app import EngineReplica, _status, validate_request

    replica = object.__new__(EngineReplica.func_or_class)  # outside Serve: no replica context to ask for an id
    replica.engine = AsyncEngine(build_llm(EngineConfig(str(model_dir), device="cpu", use_page_store=False,
                                                        engine_options=ENGINE_OPTIONS)), "r")
    long_text = "x = 1\n" * replica.engine.llm.max_model_len

    async def first(body: dict, kind: str) -> dict:
        (job,) = validate_request({"model": "m", **body}, kind, "m", replica.engine.llm.max_model_len).jobs
        return [c async for c in replica.generate(job)][0]

    try:
        chat = asyncio.run(first({"messages": [{"role": "user", "content": long_text}]}, "chat"))
        completion = asyncio.run(first({"prompt": long_text}, "completion"))
    finally:
        replica.engine.shutdown()
    for chunk, param in ((chat, "messages"), (completion, "prompt")):
        assert _status(chunk) == 400 and chunk["error"]["code"] == "context_length_exceeded"
        assert chunk["error"]["param"] == param


# Qwen3's and OLMoE's templates' shape: the first system message, then user and assistant turns; other roles skipped
SKIPS_UNKNOWN_ROLES = ("{% if messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
                       "{% endif %}{% for m in messages %}"
                       "{% if m.role in ('user', 'assistant') or (m.role == 'system' and not loop.first) %}"
                       "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
                       "<|im_start|>assistant\n")


def test_developer_role_reaches_the_template_as_system(model_dir):
    """OpenAI's `developer` message (o1 and later models' system message) reaches a template that does not name the
    role as `system`: the bundled model's template renders it as the system turn, and one that skips roles it does
    not know keeps the instructions (they were dropped); a template that names `developer` gets it as sent."""
    from pagedweight.actors.openai_app import _chat_ids, validate_request
    from pagedweight.chat import ChatTemplate
    from pagedweight.tokenizer import TextTokenizer

    def ids(tok, first_role: str) -> list[int]:
        body = {"model": "m", "messages": [{"role": first_role, "content": "Answer in French."},
                                           {"role": "user", "content": "hi"}]}
        return _chat_ids(tok, validate_request(body, "chat", "m", 64).jobs[0].messages, None)

    tok = TextTokenizer.from_dir(model_dir)
    assert ids(tok, "developer") == ids(tok, "system") == tok.apply_chat_template(
        [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "hi"}])
    tok.chat_template = ChatTemplate(SKIPS_UNKNOWN_ROLES)
    assert ids(tok, "developer") == ids(tok, "system")
    assert "Answer in French." in tok.decode(ids(tok, "developer"), skip_special_tokens=False)
    tok.chat_template = ChatTemplate(SKIPS_UNKNOWN_ROLES.replace("'assistant')", "'assistant', 'developer')"))
    assert "<|im_start|>developer\nAnswer in French." in tok.decode(ids(tok, "developer"), skip_special_tokens=False)


def _bad_requests(model: str, max_model_len: int) -> list[tuple[str, str, bytes, int]]:
    def body(**kw) -> bytes:
        return json.dumps({"model": model, "prompt": "x = 1", **kw}).encode()

    chat = lambda **kw: json.dumps({"model": model, **kw}).encode()  # noqa: E731
    long_prompt = "x = 1\n" * max_model_len
    return [
        ("malformed json", "/v1/completions", b'{"model": "m", "prompt": ', 400),
        ("invalid utf-8", "/v1/completions", b'{"model": "' + model.encode() + b'", "prompt": "\xff\xfe"}', 400),
        ("lone surrogate", "/v1/completions", body()[:-1] + b', "stop": "\\ud800"}', 400),
        ("not an object", "/v1/completions", b"[1, 2]", 400),
        ("unknown model", "/v1/completions", json.dumps({"model": "gpt-9", "prompt": "x"}).encode(), 404),
        ("missing prompt", "/v1/completions", json.dumps({"model": model}).encode(), 400),
        ("prompt longer than context", "/v1/completions", body(prompt=long_prompt), 400),
        ("prompt + max_tokens over context", "/v1/completions", body(max_tokens=max_model_len - 1), 400),
        ("token id outside vocab", "/v1/completions", body(prompt=[1, 2, 10**9]), 400),
        ("too many prompts", "/v1/completions", body(prompt=["x"] * 257), 400),
        ("presence_penalty above 2", "/v1/completions", body(presence_penalty=2.5), 400),
        ("frequency_penalty not a number", "/v1/completions", body(frequency_penalty="1"), 400),
        ("logit_bias key not a token id", "/v1/completions", body(logit_bias={"a": 1}), 400),
        ("logit_bias above 100", "/v1/completions", body(logit_bias={"1": 101}), 400),
        ("logit_bias id outside vocab", "/v1/completions", body(logit_bias={"999999999": 1}), 400),
        ("an empty prompt in a batch", "/v1/completions", body(prompt=["x", ""]), 400),
        ("a bad token id in a batch", "/v1/completions", body(prompt=[[1, 2], [-1]]), 400),
        ("negative max_tokens", "/v1/completions", body(max_tokens=-5), 400),
        ("zero max_tokens", "/v1/completions", body(max_tokens=0), 400),
        ("absurd max_tokens", "/v1/completions", body(max_tokens=10**12), 400),
        ("string max_tokens", "/v1/completions", body(max_tokens="10"), 400),
        ("negative temperature", "/v1/completions", body(temperature=-0.1), 400),
        ("huge temperature", "/v1/completions", body(temperature=1e9), 400),
        ("nan temperature", "/v1/completions", body()[:-1] + b', "temperature": NaN}', 400),
        ("top_p zero", "/v1/completions", body(top_p=0), 400),
        ("top_p above one", "/v1/completions", body(top_p=1.5), 400),
        ("top_k below -1", "/v1/completions", body(top_k=-2), 400),
        ("min_p above one", "/v1/completions", body(min_p=1.5), 400),
        ("stop_token_ids not a list", "/v1/completions", body(stop_token_ids=7), 400),
        ("a negative stop token id", "/v1/completions", body(stop_token_ids=[3, -1]), 400),
        ("negative min_tokens", "/v1/completions", body(min_tokens=-1), 400),
        ("repetition_penalty zero", "/v1/completions", body(repetition_penalty=0), 400),
        ("min_tokens above max_tokens", "/v1/completions", body(min_tokens=5, max_tokens=2), 400),
        ("seed beyond int64", "/v1/completions", body(seed=1 << 63), 400),
        ("too many stops", "/v1/completions", body(stop=[f"s{i}" for i in range(65)]), 400),
        ("n=0", "/v1/completions", body(n=0), 400),
        ("prompts x n above 256", "/v1/completions", body(prompt=["x", "y"], n=200), 400),
        ("stream not bool", "/v1/completions", body(stream="yes"), 400),
        ("logprobs above 20", "/v1/completions", body(logprobs=21), 400),
        ("logprobs not an integer", "/v1/completions", body(logprobs="2"), 400),
        ("echo not a boolean", "/v1/completions", body(echo="yes"), 400),
        ("chat echo", "/v1/chat/completions", chat(messages=[{"role": "user", "content": "hi"}], echo=True), 400),
        ("chat logprobs not a boolean", "/v1/chat/completions",
         chat(messages=[{"role": "user", "content": "hi"}], logprobs=2), 400),
        ("chat top_logprobs without logprobs", "/v1/chat/completions",
         chat(messages=[{"role": "user", "content": "hi"}], top_logprobs=2), 400),
        ("empty messages", "/v1/chat/completions", chat(messages=[]), 400),
        ("bad role", "/v1/chat/completions", chat(messages=[{"role": "wizard", "content": "hi"}]), 400),
        ("content not text", "/v1/chat/completions", chat(messages=[{"role": "user", "content": 5}]), 400),
        ("chat absurd max_tokens", "/v1/chat/completions",
         chat(messages=[{"role": "user", "content": "hi"}], max_tokens=-1), 400),
        ("chat JSON mode", "/v1/chat/completions",
         chat(messages=[{"role": "user", "content": "hi"}], response_format={"type": "json_object"}), 400),
        ("chat tools", "/v1/chat/completions", chat(messages=[{"role": "user", "content": "hi"}],
                                                    tools=[{"type": "function", "function": {"name": "f"}}]), 400),
        ("tool_choice required", "/v1/chat/completions",
         chat(messages=[{"role": "user", "content": "hi"}], tool_choice="required"), 400),
        ("a named tool_choice", "/v1/chat/completions", chat(
            messages=[{"role": "user", "content": "hi"}], tool_choice={"type": "function", "function": {"name": "f"}}),
         400),
        ("chat messages longer than context", "/v1/chat/completions",
         chat(messages=[{"role": "user", "content": long_prompt}]), 400),
        ("suffix", "/v1/completions", body(suffix="x"), 400),
        ("best_of 2", "/v1/completions", body(best_of=2), 400),
        ("guided_json", "/v1/completions", body(guided_json={"type": "object"}), 400),
        ("continue_final_message", "/v1/chat/completions",
         chat(messages=[{"role": "user", "content": "hi"}], continue_final_message=True), 400),
        ("add_generation_prompt false", "/v1/chat/completions",
         chat(messages=[{"role": "user", "content": "hi"}], add_generation_prompt=False), 400),
        ("chat_template_kwargs not an object", "/v1/chat/completions",
         chat(messages=[{"role": "user", "content": "hi"}], chat_template_kwargs=[1]), 400),
        ("chat_template_kwargs setting messages", "/v1/chat/completions",
         chat(messages=[{"role": "user", "content": "hi"}], chat_template_kwargs={"messages": []}), 400),
    ]


def test_bad_requests_get_4xx_and_server_keeps_serving(serve_app, offline):
    headers = {"Authorization": f"Bearer {serve_app.api_key}", "Content-Type": "application/json"}
    cases = _bad_requests(serve_app.model, offline.max_model_len)
    with httpx.Client(base_url=serve_app.base_url, timeout=60) as http:
        for name, url, raw, status in cases:
            r = http.post(url, content=raw, headers=headers)
            assert r.status_code == status, f"{name}: {r.status_code} {r.text[:200]}"
            err = r.json()["error"]
            assert err["message"] and err["type"] == "invalid_request_error", name
        ok = {"model": serve_app.model, "prompt": "x = 1", "max_tokens": 2}
        assert http.post("/v1/completions", json=ok).status_code == 401  # no key
        wrong = {"Authorization": "Bearer nope"}
        r = http.post("/v1/completions", json=ok, headers=wrong)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert http.get("/v1/models").status_code == 401
        assert http.get("/v1/completions", headers=headers).status_code == 405
        assert http.get("/v1/nothing", headers=headers).status_code == 404
        r = http.post("/v1/completions", json=ok, headers=headers)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    wait_idle()


def _hang_up_mid_request(serve_app, body: dict) -> dict:
    """Send the request on a raw socket, wait until the engine is generating it, then close the socket.
    Returns the engine stats seen while it was busy."""
    payload = json.dumps(body).encode()
    host, port = serve_app.base_url.removeprefix("http://").split(":")
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {serve_app.api_key}\r\nContent-Length: {len(payload)}\r\n\r\n")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode() + payload)
        deadline = time.monotonic() + 60
        while True:
            busy = engine_stats()
            if busy["in_flight"] == 1 and busy["kv_free_blocks"] < busy["kv_total_blocks"]:
                return busy  # the with-block closes the socket: the client is gone mid-generation
            assert time.monotonic() < deadline, f"request never started: {busy}"
            time.sleep(0.05)


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_kv(serve_app, offline, stream):
    """The hang-up travels client -> proxy -> ingress -> replica; it normally aborts the request within ~50 ms of
    a 13 s generation. Once in a full CI run on 2 loaded cores the request ran to its end unaborted: the ingress's
    streaming response left its body suspended, so only the garbage collector would close it (fixed by
    _EngineStreamResponse, tested above without the collector). A second hang-up still gets one more chance; a
    warning says when it was needed, and two lost ones fail."""
    body = {"model": serve_app.model, "prompt": PROMPT, "max_tokens": offline.max_model_len - 32,
            "ignore_eos": True, "temperature": 0, "stream": stream}
    for attempt in range(2):
        before = wait_idle(timeout=60)
        busy = _hang_up_mid_request(serve_app, body)
        assert busy["kv_total_blocks"] == before["kv_total_blocks"]
        after = wait_idle(timeout=60)
        if after["aborted_by_caller"] == before["aborted_by_caller"] + 1:
            return
        warnings.warn(f"hang-up {attempt + 1} did not abort the request (stream={stream})")
    pytest.fail("two client hang-ups in a row did not abort their requests")


@pytest.mark.parametrize("asgi", ["2.4", "2.3"])
def test_stream_response_cancels_the_engine_call_when_the_client_leaves(asgi):
    """A client that goes away while a chunk is being sent: the response closes its body and cancels the engine
    call at once, with the garbage collector off (Starlette alone leaves the body suspended until a collection).
    ASGI 2.4 cancels the sending task; older servers report http.disconnect, which Starlette turns into a normal
    return. A body that runs to its end cancels nothing."""
    import asyncio
    import gc

    from pagedweight.actors.openai_app import _EngineStreamResponse

    async def scenario(hang_up: bool) -> tuple[list, list]:
        cancels, closed, sending = [], [], asyncio.Event()
        disconnect = asyncio.Event()

        async def body():
            try:
                for i in range(5):
                    yield f"data: {i}\n\n"
            finally:
                closed.append(True)

        async def send(message):
            if hang_up and message.get("body", b"").startswith(b"data: 2"):
                sending.set()
                await asyncio.sleep(3600)  # the client is gone: this write never completes

        async def receive():
            await disconnect.wait()
            return {"type": "http.disconnect"}

        response = _EngineStreamResponse(body(), lambda: cancels.append(True), media_type="text/event-stream")
        task = asyncio.create_task(response({"type": "http", "asgi": {"spec_version": asgi}}, receive, send))
        if hang_up:
            await sending.wait()
            if asgi == "2.4":
                task.cancel()
            else:
                disconnect.set()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return cancels, closed

    gc.disable()
    try:
        assert asyncio.run(scenario(hang_up=True)) == ([True], [True])
        assert asyncio.run(scenario(hang_up=False)) == ([], [True])
    finally:
        gc.enable()


def test_serve_cli_defaults_and_bad_input():
    """`pagedweight serve`: loopback by default; bad input is refused before any cluster starts."""
    import argparse

    from pagedweight.actors import serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "/nonexistent/model"])
    assert args.host == "127.0.0.1" and args.port == 8000 and args.num_replicas is None
    with pytest.raises(FileNotFoundError):
        serve_cli.run(args)
    args = parser.parse_args(["serve", str(ROOT / "models"), "--port", "70000"])
    with pytest.raises(ValueError, match="port"):
        serve_cli.run(args)


def test_engine_failure_mid_request_becomes_a_503_error_chunk():
    """A replica that dies or raises mid-stream must end the response with an OpenAI-style error, not an
    exception that would leave the client with a broken connection."""
    import asyncio

    from pagedweight.actors.openai_app import _guarded, _status

    async def dying():
        yield {"prompt_tokens": 3}
        raise ConnectionError("replica died")

    async def collect():
        return [c async for c in _guarded(dying())]

    head, err = asyncio.run(collect())
    assert head == {"prompt_tokens": 3}
    assert _status(err) == 503 and "replica died" in err["error"]["message"]
    assert err["error"]["type"] == "server_error" and err["error"]["code"] == "engine_unavailable"


def test_health_is_503_once_the_engine_step_loop_died():
    """/health asks an engine replica (EngineActor.check_health raises once its step loop died): a probe then gets
    503 with the reason, and the orchestrator can replace the replica."""
    import asyncio
    import types

    from pagedweight.actors.openai_app import OpenAIIngress

    async def dead():
        raise RuntimeError("engine 0 step loop failed: CUDA error")

    health = OpenAIIngress.func_or_class.__mro__[1].__dict__["health"]  # the method as written, without Serve's wrapper
    ingress = types.SimpleNamespace(engine=types.SimpleNamespace(check_health=types.SimpleNamespace(remote=dead)))
    response = asyncio.run(health(ingress))
    err = json.loads(response.body)["error"]
    assert response.status_code == 503 and err["type"] == "server_error" and "step loop failed" in err["message"]


def test_replica_ships_one_final_item_for_a_non_streaming_request(ap_model_dir):
    """Each replica item is one Ray message through the ingress: a non-streaming request gets the head and one
    final item whose text is the whole completion, the same text a stream's deltas join to. Chat messages are
    rendered there by the checkpoint's template, with the request's chat_template_kwargs; a template that refuses
    them answers 400 as the first item."""
    import asyncio

    from pagedweight.actors.engine_actor import AsyncEngine, EngineConfig, build_llm
    from pagedweight.actors.openai_app import EngineReplica, GenerationJob, _status
    from pagedweight.chat import ChatTemplate

    replica = object.__new__(EngineReplica.func_or_class)  # outside Serve: no replica context to ask for an id
    replica.engine = AsyncEngine(build_llm(EngineConfig(str(ap_model_dir), device="cpu", use_page_store=False)), "r")

    def job(rid: str) -> GenerationJob:
        return GenerationJob("def main():", 12, 0.0, 1.0, 0, None, [], True, rid)

    async def items(rid: str, final_only: bool) -> list[dict]:
        return [c async for c in replica.generate(job(rid), final_only=final_only)]

    def chat(rid: str, messages: list[dict]) -> list[dict]:
        job = GenerationJob("", 4, 0.0, 1.0, 0, None, [], True, rid, messages=messages,
                            chat_template_kwargs={"cue": "A:"})

        async def run():
            return [c async for c in replica.generate(job, final_only=True)]
        return asyncio.run(run())

    try:
        final = asyncio.run(items("final", True))
        streamed = asyncio.run(items("stream", False))
        # the checkpoint's chat template renders the messages in the replica; one that refuses them is a 400
        tokenizer = replica.engine.llm.tokenizer
        tokenizer.chat_template = ChatTemplate("{% for m in messages %}{% if m['role'] == 'system' %}"
                                               "{{ raise_exception('no system turns here') }}{% endif %}"
                                               "{{ m['content'] }}\n{% endfor %}{{ cue }}")
        user = [{"role": "user", "content": "def main():"}]
        good, refused = chat("chat", user), chat("refused", [{"role": "system", "content": "x"}] + user)
    finally:
        replica.engine.shutdown()
    assert good[0]["prompt_tokens"] == len(tokenizer.encode("def main():\nA:", add_special_tokens=False))
    assert good[1]["completion_tokens"] == 4
    assert len(refused) == 1 and _status(refused[0]) == 400 and "no system turns" in refused[0]["error"]["message"]
    assert len(final) == 2 and final[0] == streamed[0] == {"prompt_tokens": final[0]["prompt_tokens"],
                                                           "cached_tokens": 0}
    assert final[1]["finish_reason"] == streamed[-1]["finish_reason"] == "length"
    assert final[1]["completion_tokens"] == streamed[-1]["completion_tokens"] == 12
    assert final[1]["delta"] == "".join(c["delta"] for c in streamed[1:])
    assert all(c["finish_reason"] is None for c in streamed[1:-1])
