"""OpenAI-compatible HTTP ingress on Ray Serve, in front of PagedWeight engine replicas.

`ray.serve.llm` needs vLLM, so the ingress is ours: /v1/models, /v1/completions,
/v1/chat/completions, streaming (Server-Sent Events) and not, with `usage` counts; and vLLM's /tokenize,
/detokenize (a client sizes a long context before sending it) and /health (an engine replica's step loop is alive:
what a load balancer's or Kubernetes' probe asks).
Every bad request is answered with a 4xx and an OpenAI-style body
`{"error": {"message", "type", "param", "code"}}` before any engine work starts; checks that need the
tokenizer (prompt longer than the context, a chat template that refuses the messages) run in the engine replica
and come back as the first item of its stream. Chat messages are rendered there by the checkpoint's chat template
(pagedweight.chat), as transformers' apply_chat_template renders them. A client that disconnects cancels its Serve
request; the cancellation reaches the replica's generator, which aborts the engine request and frees its KV blocks.

(No `from __future__ import annotations` here: FastAPI must see real types on the ingress methods.)

Routing: with several engine replicas, each ingress routes a conversation's turns (and prompts that share their
start) to one replica, where its KV blocks are kept, unless that replica is well above its share of the requests in
flight (actors/routing.py; `prefix_affinity=False` restores Serve's default router).

Resources: the ingress takes no CPU; an engine replica takes one GPU (or `engine_num_cpus` CPUs when
the cluster has no GPU).
"""

import asyncio
import hmac
import json
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from ray import serve
from ray.serve.config import RequestRouterConfig
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedweight.actors.engine_actor import EngineConfig, make_engine
from pagedweight.actors.routing import PrefixAffinityRouter
from pagedweight.chat import ChatTemplateError
from pagedweight.checkpoint import resolve_model

REPO_ROOT = Path(__file__).resolve().parents[1]
MAX_BODY_BYTES = 4 << 20
MAX_STOP = 64  # OpenAI takes 4; vLLM any number, and lm-evaluation-harness sends a task's whole list (9 for humaneval)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# ---------------------------------------------------------------- errors
class APIError(Exception):
    """A request the API refuses; rendered as an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


# ---------------------------------------------------------------- request validation (pure)
@dataclass
class GenerationJob:
    """A validated request, as the engine replica receives it."""

    prompt: str | list[int]
    max_tokens: int | None  # None = the rest of the context
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    ignore_eos: bool
    request_id: str
    logprobs: int | None = None  # alternatives each generated token reports with its own log-probability; None: off
    # completions: the answer starts with the prompt (and its tokens' log-probabilities with `logprobs`: what
    # lm-evaluation-harness's loglikelihood reads); max_tokens may then be 0, the prompt alone
    echo: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None  # token id -> bias
    min_p: float = 0.0  # vLLM's extensions (an OpenAI client sends them in extra_body)
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    # chat: the messages (prompt unused), rendered in the replica by the checkpoint's chat template with these
    # extra template variables
    messages: list[dict] | None = None
    chat_template_kwargs: dict | None = None


@dataclass
class ParsedRequest:
    kind: str  # "completion" | "chat"
    model: str
    stream: bool
    include_usage: bool
    request_id: str
    # one per prompt and sample: choice i answers jobs[i], the (i % n)-th sample of prompt i // n (completions take a
    # list of prompts; both APIs take n)
    jobs: list[GenerationJob]
    n: int = 1


def parse_body(raw: bytes) -> dict:
    """Bytes -> JSON object, refusing oversize bodies, invalid UTF-8 and malformed JSON."""
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, f"request body larger than {MAX_BODY_BYTES} bytes", code="request_too_large")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _bad(f"request body is not valid UTF-8 ({exc.reason} at byte {exc.start})", code="invalid_utf8")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _bad(f"request body is not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})",
                   code="invalid_json")
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object", code="invalid_json")
    return body


def _text(value, param: str) -> str:
    """A string that can be encoded as UTF-8 (JSON allows lone surrogates such as \\ud800; we do not)."""
    if not isinstance(value, str):
        raise _bad(f"'{param}' must be a string", param)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(f"'{param}' contains invalid Unicode (lone surrogate)", param, "invalid_utf8")
    return value


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise _bad(f"'{name}' must be a number", name)
    if value < low or value > high or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise _bad(f"'{name}' must be in {interval}, got {value}", name)
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{name}' must be an integer", name)
    if not low <= value <= high:
        raise _bad(f"'{name}' must be in [{low}, {high}], got {value}", name)
    return value


def _prompts(value) -> list[str | list[int]]:
    """The completions API's prompt: a string, a list of token ids, or a list of up to MAX_PROMPTS of either (what
    lm-evaluation-harness sends at a batch size above 1)."""
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        if len(value) > MAX_PROMPTS:
            raise _bad(f"at most {MAX_PROMPTS} prompts a request, got {len(value)}", "prompt")
        return [_prompt(v) for v in value]
    return [_prompt(value)]


def _prompt(value) -> str | list[int]:
    if isinstance(value, str):
        if not value:
            raise _bad("'prompt' must not be empty", "prompt")
        return _text(value, "prompt")
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if min(value) < 0:
            raise _bad("'prompt' token ids must be >= 0", "prompt")
        return value
    raise _bad("'prompt' must be a non-empty string or a non-empty list of token ids", "prompt")


def chat_messages(messages) -> list[dict]:
    """The request's chat messages, checked, as {"role", "content"} dicts with text content (text parts joined by
    newlines, as vLLM joins them):
    the engine replica renders them with the checkpoint's chat template (pagedweight.chat)."""
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _bad(f"'{where}' must be an object", where)
        role = msg.get("role")
        if role not in ("system", "user", "assistant", "developer"):
            raise _bad(f"'{where}.role' must be one of system, developer, user, assistant", f"{where}.role")
        content = msg.get("content")
        if isinstance(content, list):  # content parts: only text is supported
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise _bad(f"'{where}.content[{j}]' must be a text part", f"{where}.content")
                parts.append(_text(part.get("text"), f"{where}.content[{j}].text"))
            content = "\n".join(parts)
        out.append({"role": role, "content": _text(content, f"{where}.content")})
    return out


MAX_LOGPROBS = 20  # the API's top_logprobs bound (SamplingParams takes the same)
# choices of one request (prompts x n), each an engine request: they are held whole in the ingress until the last one
# ends (vLLM takes any number; a bound keeps one request from holding an ingress's memory for thousands)
MAX_PROMPTS = 256
# parameters this server does not implement, with the value that asks for nothing: any other value is a 400 rather
# than an answer that silently ignores it (a client asking for JSON mode must not get free text back as if it were)
UNSUPPORTED = {"suffix": None, "best_of": 1, "tools": None, "functions": None, "response_format": {"type": "text"},
               "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
               # vLLM's top-level chat extras for continuing the last assistant message: not implemented (they got a
               # fresh assistant turn); chat_template_kwargs' add_generation_prompt still reaches the template
               "add_generation_prompt": True, "continue_final_message": False}


def _token_ids(body: dict, name: str) -> list[int] | None:
    """A list of token ids (ids beyond the vocabulary are refused by the engine)."""
    ids = body.get(name)
    if ids is None:
        return None
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise _bad(f"'{name}' must be a list of token ids (integers >= 0)", name)
    return ids


def _template_kwargs(body: dict) -> dict:
    """vLLM's `chat_template_kwargs` (variables the chat template reads, e.g. enable_thinking)."""
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise _bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    # the template's messages are the request's: these reached the replica's apply_chat_template as a second value
    # of its own arguments, a TypeError there (answered 503, which the OpenAI client retries)
    for name in ("messages", "self"):
        if name in kwargs:
            raise _bad(f"'chat_template_kwargs' must not set '{name}'", "chat_template_kwargs")
    return kwargs


def _logit_bias(value) -> dict[int, float] | None:
    """The API's logit_bias: {"token id": bias}; token ids beyond the vocabulary are refused by the engine."""
    from pagedweight.sampling import MAX_BIASED_TOKENS, MAX_LOGIT_BIAS

    if value is None or value == {}:
        return None
    if not isinstance(value, dict) or len(value) > MAX_BIASED_TOKENS:
        raise _bad(f"'logit_bias' must be an object of at most {MAX_BIASED_TOKENS} token ids", "logit_bias")
    out = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise _bad(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not abs(bias) <= MAX_LOGIT_BIAS:
            raise _bad(f"'logit_bias' values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r}",
                       "logit_bias")
        out[int(key)] = float(bias)
    return out


def _model(body: dict, served_model: str, required: bool = True) -> str:
    """The body's "model", which must name the served one (vLLM's tokenize API lets it be left out)."""
    model = body.get("model")
    if model is None and not required:
        return served_model
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required and must be a string", "model")
    if model != served_model:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{served_model}'",
                       "model", "model_not_found")
    return model


def _seed(body: dict) -> int | None:
    """The API's seed: any int64, as OpenAI and vLLM take it (clients send -1); the engine's generators take
    [0, 2**64), so a negative seed is its two's complement."""
    seed = _integer(body, "seed", None, -(1 << 63), (1 << 63) - 1)
    return None if seed is None else seed % (1 << 64)


def _flag(body: dict, name: str, default: bool) -> bool:
    """A boolean parameter; null is its default (as every other parameter's)."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(f"'{name}' must be a boolean", name)
    return value


def validate_request(body: dict, kind: str, served_model: str, max_model_len: int) -> ParsedRequest:
    """Check a completions/chat body against the API and this model; raises APIError."""
    from pagedweight.sampling import MAX_REPETITION_PENALTY

    model = _model(body, served_model)
    for name, neutral in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value != neutral and value not in ({}, []):
            raise _bad(f"'{name}' is not supported by this server", name, "unsupported_parameter")
    for name in ("tool_choice", "function_call"):  # "none" and "auto" ask for no call: a plain answer is theirs
        if body.get(name) not in (None, "none", "auto"):
            raise _bad(f"'{name}' asks for a tool call; this server does not support tools", name,
                       "unsupported_parameter")
    stream = _flag(body, "stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise _bad("'stream_options' must be an object with a boolean 'include_usage'", "stream_options")
    echo = _flag(body, "echo", False)
    if kind == "chat":
        if echo:
            raise _bad("'echo' is not supported by chat completions", "echo", "unsupported_parameter")
        messages, template_kwargs = chat_messages(body.get("messages")), _template_kwargs(body)
        prompts = [""]  # rendered in the engine replica, by the checkpoint's template
        tokens_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        default_tokens = None
    else:
        prompts, messages, template_kwargs = _prompts(body.get("prompt")), None, None
        tokens_field, default_tokens = "max_tokens", 16
    max_tokens = _integer(body, tokens_field, default_tokens, 0 if echo else 1, max_model_len)
    n = _integer(body, "n", 1, 1, MAX_PROMPTS)
    if len(prompts) * n > MAX_PROMPTS:
        raise _bad(f"prompts x n must be at most {MAX_PROMPTS}, got {len(prompts)} x {n}", "n")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise _bad(f"'stop' must be a non-empty string or a list of at most {MAX_STOP} non-empty strings", "stop")
    stop = [_text(s, "stop") for s in stop]
    ignore_eos = _flag(body, "ignore_eos", False)
    if kind == "chat":  # "logprobs": true, and "top_logprobs": alternatives
        wanted = body.get("logprobs") or False
        if not isinstance(wanted, bool):
            raise _bad("'logprobs' must be a boolean", "logprobs")
        top = _integer(body, "top_logprobs", None, 0, MAX_LOGPROBS)
        if top and not wanted:
            raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs = (top or 0) if wanted else None
    else:  # "logprobs": alternatives
        logprobs = _integer(body, "logprobs", None, 0, MAX_LOGPROBS)
    request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    job = GenerationJob(
        prompt=prompts[0], max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=max(0, _integer(body, "top_k", 0, -1, 1 << 20)),  # vLLM's -1: off, as 0
        seed=_seed(body),
        stop=stop, ignore_eos=ignore_eos,
        request_id=request_id, logprobs=logprobs, echo=echo,
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=_logit_bias(body.get("logit_bias")),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0), stop_token_ids=_token_ids(body, "stop_token_ids"),
        min_tokens=_integer(body, "min_tokens", 0, 0, max_model_len),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, MAX_REPETITION_PENALTY, low_open=True),
        messages=messages, chat_template_kwargs=template_kwargs,
    )
    # the j-th sample of a seeded request draws with seed + j: n different samples, each reproducible
    jobs = [job] if len(prompts) * n == 1 else \
        [replace(job, prompt=prompt, request_id=f"{request_id}-{i * n + j}",
                 seed=None if job.seed is None else (job.seed + j) % (1 << 64))
         for i, prompt in enumerate(prompts) for j in range(n)]
    return ParsedRequest(kind, model, stream, bool(options.get("include_usage", False)), request_id, jobs, n)


@dataclass
class TokenizeJob:
    """A checked /tokenize body (vLLM's): a prompt, or chat messages that the replica renders as a chat request's."""

    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = True  # a prompt's: the tokenizer's own special tokens (BOS) as generation adds them
    chat_template_kwargs: dict | None = None
    return_token_strs: bool = False


def validate_tokenize(body: dict, served_model: str) -> TokenizeJob:
    _model(body, served_model, required=False)
    if ("prompt" in body) == ("messages" in body):
        raise _bad("give either 'prompt' or 'messages'", "prompt")
    strs = _flag(body, "return_token_strs", False)
    if "messages" in body:
        if not _flag(body, "add_generation_prompt", True):
            raise _bad("'add_generation_prompt' false is not supported: prompts end with the assistant's cue, as "
                       "chat completions send them", "add_generation_prompt", "unsupported_parameter")
        return TokenizeJob(messages=chat_messages(body["messages"]), chat_template_kwargs=_template_kwargs(body),
                           return_token_strs=strs)
    return TokenizeJob(prompt=_text(body["prompt"], "prompt"),
                       add_special_tokens=_flag(body, "add_special_tokens", True), return_token_strs=strs)


def validate_detokenize(body: dict, served_model: str) -> list[int]:
    _model(body, served_model, required=False)
    tokens = _token_ids(body, "tokens")
    if tokens is None:
        raise _bad("'tokens' must be a list of token ids (integers >= 0)", "tokens")
    return tokens


# ---------------------------------------------------------------- engine replica
def _sampling_params(job: GenerationJob, max_tokens: int):
    from pagedweight.sampling import SamplingParams

    # the replica reads delta text and counts (token ids never leave it): delta outputs copy no generated tokens
    return SamplingParams(max_tokens=max_tokens, temperature=job.temperature, top_p=job.top_p, top_k=job.top_k,
                          seed=job.seed, stop=list(job.stop), ignore_eos=job.ignore_eos, output_kind="delta",
                          logprobs=job.logprobs, prompt_logprobs=job.logprobs if job.echo else None,
                          presence_penalty=job.presence_penalty, frequency_penalty=job.frequency_penalty,
                          logit_bias=job.logit_bias, min_p=job.min_p,
                          stop_token_ids=list(job.stop_token_ids or ()), min_tokens=job.min_tokens,
                          repetition_penalty=job.repetition_penalty).validate()


def token_logprobs(tokenizer, token_ids: list[int], entries: list[dict[int, float] | None], n: int) -> list[dict]:
    """Wire form of tokens' log-probabilities: per token its text, log-probability and UTF-8 bytes, and "top":
    [text, log-probability, bytes] of its n most likely alternatives, most likely first (a prompt's first token,
    entry None: no log-probability, no alternatives). A token that ends inside a UTF-8 character decodes (alone) to
    U+FFFD, and its bytes are that character's. Each token is decoded after an anchor token, its text what it adds:
    a SentencePiece-style decoder (Mixtral's) strips the leading space of a text that starts with it, so alone
    "▁the" came out "the" and the tokens no longer joined into the text."""
    anchor = tokenizer.encode("a", add_special_tokens=False)[:1]
    lead = tokenizer.decode(anchor, skip_special_tokens=False)

    def text(t: int, lp: float | None) -> list:
        s = tokenizer.decode(anchor + [t], skip_special_tokens=False)
        s = s[len(lead):] if s.startswith(lead) else tokenizer.decode([t], skip_special_tokens=False)
        return [s, lp, list(s.encode("utf-8"))]

    wire = []
    for tok, entry in zip(token_ids, entries):
        if entry is None:
            token, _, raw = text(tok, None)
            wire.append({"token": token, "logprob": None, "bytes": raw, "top": None})
            continue
        token, logprob, raw = text(tok, entry[tok])
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:n]
        wire.append({"token": token, "logprob": logprob, "bytes": raw, "top": [text(t, lp) for t, lp in top]})
    return wire


def _template_roles(tokenizer, messages: list[dict]) -> list[dict]:
    """The messages with OpenAI's `developer` role (o1 and later models' name for `system`) as `system`, unless the
    checkpoint's template names the role: templates of older models render a role they do not know as a turn the
    model never saw (ChatML, after a default system turn), skip it (Qwen3, OLMoE: the instructions vanish) or refuse
    it, where OpenAI answers a developer message to a model without the role as a system message."""
    source = tokenizer.chat_template.source or ""
    if "'developer'" in source or '"developer"' in source:
        return messages
    return [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]


def _chat_ids(tokenizer, messages: list[dict], template_kwargs: dict | None) -> list[int]:
    """Chat messages rendered by the checkpoint's template, tokenized; a template that refuses them is a 400."""
    try:
        return tokenizer.apply_chat_template(_template_roles(tokenizer, messages), **(template_kwargs or {}))
    except ChatTemplateError as e:
        raise _bad(str(e), "messages") from None


@serve.deployment(max_ongoing_requests=256, health_check_period_s=10, health_check_timeout_s=30,
                  graceful_shutdown_timeout_s=5)
class EngineReplica:
    """One engine behind the ingress. `generate` streams plain dicts (cheap to ship between actors):
    first {"prompt_tokens"} or {"error"}, then {"delta", "completion_tokens", "finish_reason"} items.

    Every item is one Ray message through the ingress, whose single event loop is shared by all requests: a
    non-streaming request gets one final item (`final_only`), and a stream joins the steps' deltas that piled
    up while its previous item was in transit (on the H200 with two replicas, per-step items capped the
    ingress at ~1,700 streamed tokens/s: multi_engine-nvidia-h200x2-20261129-serve-auto.json)."""

    def __init__(self, cfg: EngineConfig):
        replica_id = serve.get_replica_context().replica_id.unique_id
        self.engine = make_engine(cfg, replica_id)

    def __del__(self) -> None:  # Serve's graceful replica shutdown: leave the cluster planner's merge
        if hasattr(self, "engine"):
            self.engine.shutdown()

    def info(self) -> dict:
        llm = self.engine.llm
        return {"model_name": llm.model_name, "max_model_len": llm.max_model_len}

    def stats(self) -> dict:
        return self.engine.stats()

    def check_health(self) -> None:
        self.engine.check_health()

    def tokenize(self, job: TokenizeJob) -> dict:
        """vLLM's /tokenize answer: the ids a completion (or, with messages, a chat completion) would start from."""
        tok = self.engine.llm.tokenizer
        try:
            ids = _chat_ids(tok, job.messages, job.chat_template_kwargs) if job.messages is not None else \
                tok.encode(job.prompt, add_special_tokens=job.add_special_tokens)
        except APIError as exc:
            return exc.body()
        out = {"count": len(ids), "max_model_len": self.engine.llm.max_model_len, "tokens": ids}
        if job.return_token_strs:
            out["token_strs"] = [tok.tokenizer.id_to_token(i) for i in ids]
        return out

    def detokenize(self, ids: list[int]) -> dict:
        llm = self.engine.llm
        if any(i >= llm.config.vocab_size for i in ids):
            return _bad(f"'tokens' must lie in [0, {llm.config.vocab_size})", "tokens").body()
        return {"prompt": llm.tokenizer.decode(ids, skip_special_tokens=False)}

    async def generate(self, job: GenerationJob, final_only: bool = False):
        llm = self.engine.llm
        if job.messages is not None:
            try:
                prompt_ids = _chat_ids(llm.tokenizer, job.messages, job.chat_template_kwargs)
            except APIError as exc:
                yield exc.body()
                return
        else:
            prompt_ids = llm.tokenizer.encode(job.prompt) if isinstance(job.prompt, str) else job.prompt
        room = llm.max_model_len - len(prompt_ids)
        if room < 1:
            yield _bad(f"This model's maximum context length is {llm.max_model_len} tokens; the prompt "
                       f"has {len(prompt_ids)} tokens", "prompt" if job.messages is None else "messages",
                       "context_length_exceeded").body()
            return
        if job.max_tokens is not None and job.max_tokens > room:
            yield _bad(f"This model's maximum context length is {llm.max_model_len} tokens; "
                       f"{len(prompt_ids)} in the prompt + {job.max_tokens} to generate exceed it",
                       "max_tokens", "context_length_exceeded").body()
            return
        prompt_only = job.max_tokens == 0  # echo of the prompt alone: the engine samples one token, never sent
        try:
            params = _sampling_params(job, 1 if prompt_only else job.max_tokens or room)
        except ValueError as exc:
            yield _bad(str(exc)).body()
            return
        stream = self.engine.generate(prompt_ids, params, job.request_id, coalesce=True)
        try:
            try:
                out = await anext(stream)
            except ValueError as exc:  # the engine refused the request (add_request)
                yield _bad(str(exc)).body()
                return
            head = {"prompt_tokens": len(prompt_ids), "cached_tokens": out.num_cached_tokens}
            if job.echo:  # the first output carries the prompt's log-probabilities
                head["echo"] = job.prompt if isinstance(job.prompt, str) else \
                    llm.tokenizer.decode(prompt_ids, skip_special_tokens=False)
                if job.logprobs is not None:
                    head["echo_logprobs"] = token_logprobs(llm.tokenizer, prompt_ids, out.prompt_logprobs,
                                                           job.logprobs)
            yield head
            logprobs: list[dict] = []  # tokens' log-probabilities not shipped yet
            while True:
                if out.finish_reason == "error":
                    yield APIError(500, out.error or "engine error", type="server_error").body()
                    return
                if prompt_only:
                    yield {"delta": "", "completion_tokens": 0, "finish_reason": "length",
                           **({"logprobs": []} if job.logprobs is not None else {})}
                    return
                if job.logprobs is not None:
                    logprobs += token_logprobs(llm.tokenizer, out.token_ids, out.logprobs, job.logprobs)
                if out.finished or not final_only:
                    item = {"delta": out.text if final_only else out.delta_text,
                            "completion_tokens": out.completion_tokens,
                            "finish_reason": out.finish_reason if out.finished else None}
                    if job.logprobs is not None:
                        item["logprobs"], logprobs = logprobs, []
                    yield item
                if out.finished:
                    return
                out = await anext(stream)
        finally:
            await stream.aclose()  # aborts the engine request (frees its KV blocks) unless it finished


# ---------------------------------------------------------------- response bodies
def _status(chunk: dict) -> int:
    err = chunk["error"]
    if err["code"] == "engine_unavailable":
        return 503
    return 500 if err["type"] == "server_error" else 400


def _unavailable(exc: Exception) -> APIError:
    return APIError(503, f"engine unavailable: {type(exc).__name__}: {exc}"[:1000], type="server_error",
                    code="engine_unavailable")


async def _guarded(chunks):
    """The replica's chunks; a replica that fails or dies mid-request ends the stream with an error chunk
    (503) instead of an exception, so the client always gets an answer."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as exc:  # noqa: BLE001 - RayActorError, an error raised in the replica, ...
        yield _unavailable(exc).body()


def _usage(req: ParsedRequest, heads: list[dict], completion_tokens: int) -> dict:
    """Each prompt counted once, however many samples (n) it has; its cached tokens (prompt tokens whose KV the
    engine found computed: prefix sharing) are its first sample's."""
    prompt_tokens = sum(h["prompt_tokens"] for h in heads[::req.n])
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(h["cached_tokens"] for h in heads[::req.n])}}


def _logprobs_body(req: ParsedRequest, entries: list[dict] | None, offset: int = 0) -> dict | None:
    """A choice's "logprobs" (None unless the request asked): the chat API's "content" list, or the completions
    API's parallel lists, whose "text_offset" counts characters of token text from `offset` on."""
    if entries is None:
        return None
    if req.kind == "chat":
        return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
                             "top_logprobs": [{"token": t, "logprob": lp, "bytes": b} for t, lp, b in e["top"]]}
                            for e in entries]}
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            # the API "will always return the logprob of the sampled token, so there may be up to logprobs+1 elements"
            "top_logprobs": [None if e["top"] is None else {**{t: lp for t, lp, _ in e["top"]}, e["token"]: e["logprob"]}
                             for e in entries],
            "text_offset": offsets}


async def _collect(req: ParsedRequest, head: dict, chunks) -> dict:
    """One prompt's whole answer from its replica chunks: {"text", "logprobs", "finish_reason", "completion_tokens"}
    (the echoed prompt first), or the error chunk that ended it."""
    text, logprobs = [head.get("echo", "")], list(head.get("echo_logprobs", ()))
    out = {"finish_reason": None, "completion_tokens": 0}
    async for chunk in chunks:
        if "error" in chunk:
            return chunk
        text.append(chunk["delta"])
        logprobs += chunk.get("logprobs", ())
        out = {"finish_reason": chunk["finish_reason"], "completion_tokens": chunk["completion_tokens"]}
    return {**out, "text": "".join(text), "logprobs": logprobs if req.jobs[0].logprobs is not None else None}


def _final_body(req: ParsedRequest, heads: list[dict], answers: list[dict]) -> dict:
    usage = _usage(req, heads, sum(a["completion_tokens"] for a in answers))
    base = {"id": req.request_id, "created": int(time.time()), "model": req.model, "usage": usage}
    if req.kind == "chat":
        choices = [{"index": i, "message": {"role": "assistant", "content": a["text"]},
                    "logprobs": _logprobs_body(req, a["logprobs"]), "finish_reason": a["finish_reason"]}
                   for i, a in enumerate(answers)]
        return {**base, "object": "chat.completion", "choices": choices}
    choices = [{"index": i, "text": a["text"], "logprobs": _logprobs_body(req, a["logprobs"]),
                "finish_reason": a["finish_reason"]} for i, a in enumerate(answers)]
    return {**base, "object": "text_completion", "choices": choices}


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _merged(streams: list):
    """(index, chunk) of every stream as each comes; closing it stops the readers."""
    if len(streams) == 1:
        async for chunk in streams[0]:
            yield 0, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def read(i: int, stream) -> None:
        async for chunk in stream:
            await queue.put((i, chunk))
        await queue.put((i, None))

    tasks = [asyncio.create_task(read(i, stream)) for i, stream in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            i, chunk = await queue.get()
            if chunk is None:
                open_streams -= 1
            else:
                yield i, chunk
    finally:
        for task in tasks:
            task.cancel()


async def _sse(req: ParsedRequest, heads: list[dict], streams: list, cancel):
    """Server-Sent Events: the echoed prompts (completions with `echo`), one chunk per engine step of each prompt
    (choice `index`), a usage chunk when asked (`"usage": null` in the others then), then [DONE]. An error event
    ends the stream (then [DONE], no usage chunk) and `cancel`s the other prompts' calls."""
    chat = req.kind == "chat"
    base = {"id": req.request_id, "created": int(time.time()), "model": req.model,
            "object": "chat.completion.chunk" if chat else "text_completion"}
    if req.include_usage:  # OpenAI's: every chunk has "usage", null but in the last one
        base["usage"] = None
    if chat:
        for i in range(len(heads)):
            yield _event({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}]})
    completion_tokens, offsets = [0] * len(heads), [0] * len(heads)
    for i, head in enumerate(heads):
        if "echo" in head:
            echoed = head.get("echo_logprobs")
            yield _event({**base, "choices": [{"index": i, "text": head["echo"],
                                               "logprobs": _logprobs_body(req, echoed), "finish_reason": None}]})
            offsets[i] = sum(len(e["token"]) for e in echoed or ())
    chunks, failed = _merged(streams), False
    try:
        async for i, chunk in chunks:
            if "error" in chunk:
                cancel()
                yield _event(chunk)
                failed = True
                break
            completion_tokens[i] = chunk["completion_tokens"]
            logprobs = _logprobs_body(req, chunk.get("logprobs"), offsets[i])
            offsets[i] += sum(len(e["token"]) for e in chunk.get("logprobs", ()))
            if chat:
                delta = {"content": chunk["delta"]} if chunk["delta"] else {}
                choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": chunk["finish_reason"]}
            else:
                choice = {"index": i, "text": chunk["delta"], "logprobs": logprobs,
                          "finish_reason": chunk["finish_reason"]}
            yield _event({**base, "choices": [choice]})
    finally:
        await chunks.aclose()
    if req.include_usage and not failed:  # as vLLM: the error, then [DONE]
        usage = _usage(req, heads, sum(completion_tokens))
        yield _event({**base, "choices": [], "usage": usage})
    yield "data: [DONE]\n\n"


class _EngineStreamResponse(StreamingResponse):
    """A StreamingResponse that, however it ends, closes its body and, unless the body ran to its end, cancels the
    engine call (`cancel`). Starlette leaves the body iterator suspended when the client goes away while a chunk is
    being sent, so the generators (and with them the replica's request) would be closed only by the garbage
    collector: once in a CI run the request then ran to the end of its 13 s generation after the hang-up."""

    def __init__(self, content, cancel, **kwargs) -> None:
        self._cancel, self._done = cancel, False
        super().__init__(self._track(content), **kwargs)

    async def _track(self, content):
        try:
            async for chunk in content:
                yield chunk
            self._done = True
        finally:
            await content.aclose()

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._done:
                self._cancel()
            await self.body_iterator.aclose()


# ---------------------------------------------------------------- ingress
app = FastAPI(title="PagedWeight OpenAI-compatible API")


@app.exception_handler(StarletteHTTPException)
async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return APIError(exc.status_code, str(exc.detail), code=code).response()


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=512)
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, engine, api_key: str | None = None):
        self.engine = engine
        self.api_key = api_key
        self._info: dict | None = None

    async def _model_info(self) -> dict:
        if self._info is None:
            try:
                self._info = await self.engine.info.remote()
            except Exception as exc:  # noqa: BLE001 - no replica answers (as _guarded's)
                raise _unavailable(exc) from None
        return self._info

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise APIError(401, "Incorrect or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    async def _model_card(self, request: Request) -> dict:
        self._authorize(request)
        info = await self._model_info()
        return {"id": info["model_name"], "object": "model", "created": 0, "owned_by": "pagedweight",
                "max_model_len": info["max_model_len"]}

    @app.get("/v1/models")
    async def models(self, request: Request):
        try:
            return {"object": "list", "data": [await self._model_card(request)]}
        except APIError as exc:
            return exc.response()

    @app.get("/v1/models/{model:path}")
    async def model(self, request: Request, model: str):
        """OpenAI's model retrieval (`client.models.retrieve`; tools such as Copilot ask it)."""
        try:
            card = await self._model_card(request)
            _model({"model": model}, card["id"])
        except APIError as exc:
            return exc.response()
        return card

    @app.get("/health")
    async def health(self):
        """200 once an engine replica answers with its step loop alive, else 503 (no API key asked: probes have
        none)."""
        try:
            await self.engine.check_health.remote()
        except Exception as exc:  # a dead step loop, or no replica to ask
            return APIError(503, f"engine unhealthy: {exc}", type="server_error").response()
        return JSONResponse({})

    @app.post("/tokenize")
    async def tokenize(self, request: Request):
        return await self._tokens(request, validate_tokenize, "tokenize")

    @app.post("/detokenize")
    async def detokenize(self, request: Request):
        return await self._tokens(request, validate_detokenize, "detokenize")

    async def _tokens(self, request: Request, validate, method: str):
        try:
            self._authorize(request)
            job = validate(parse_body(await request.body()), (await self._model_info())["model_name"])
            try:
                out = await getattr(self.engine, method).remote(job)
            except Exception as exc:  # noqa: BLE001
                raise _unavailable(exc) from None
        except APIError as exc:
            return exc.response()
        return JSONResponse(out, status_code=_status(out) if "error" in out else 200)

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._handle(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._handle(request, "chat")

    async def _handle(self, request: Request, kind: str):
        try:
            self._authorize(request)
            info = await self._model_info()
            req = validate_request(parse_body(await request.body()), kind, info["model_name"],
                                   info["max_model_len"])
        except APIError as exc:
            return exc.response()
        calls = [self.engine.options(stream=True).generate.remote(job, final_only=not req.stream)
                 for job in req.jobs]
        streams, settled = [_guarded(call) for call in calls], False

        def cancel() -> None:
            for call in calls:
                call.cancel()
        try:  # a handler cancelled here (the client went away) cancels the engine calls at once
            heads = list(await asyncio.gather(*(anext(stream) for stream in streams)))
            error = next((h for h in heads if "error" in h), None)
            if error is not None:  # the other prompts' calls are cancelled below
                return JSONResponse(error, status_code=_status(error))
            if req.stream:
                settled = True  # the response owns the calls from here
                return _EngineStreamResponse(_sse(req, heads, streams, cancel), cancel,
                                             media_type="text/event-stream", headers=SSE_HEADERS)
            answers = await asyncio.gather(*(_collect(req, h, stream) for h, stream in zip(heads, streams)))
            error = next((a for a in answers if "error" in a), None)
            if error is not None:
                return JSONResponse(error, status_code=_status(error))
            settled = True
            return _final_body(req, heads, answers)
        finally:
            if not settled:
                cancel()


# ---------------------------------------------------------------- application builder
class AppArgs(BaseModel):
    """Arguments of `build_app` (the `args:` of a Serve config)."""

    model_config = ConfigDict(extra="forbid")

    model_dir: str
    num_replicas: int = 1
    gpu_memory_budget: int | float | None = None
    api_key: str | None = None
    num_gpus_per_replica: float | None = None  # None: 1 when the cluster has GPUs, else 0
    engine_num_cpus: float = 1.0  # CPUs of a CPU-only engine replica
    engine_options: dict = {}
    expert_impl: str = "auto"  # "reference": the torch twin of the fused kernel (no kernel compile)
    store_root: str = "/dev/shm"  # tmpfs where the node's page store writes the planes
    prefix_affinity: bool = True  # route by affinity key under a load bound (actors/routing.py), else Serve's default


def _cluster_has_gpus() -> bool:
    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    import torch

    return torch.cuda.is_available()


def resolve_model_dir(path: str) -> tuple[str, str]:
    """Absolute path of a model directory and the name it is served under by default (its own name); a relative one
    is looked up in the current directory, then in the repository root (where models/ ships the bundled model), so
    `serve run clusters/serve.yaml` works from anywhere with an in-tree install; else `path` is a Hugging Face Hub
    repository id (fetched into the Hub's cache on this node), served under that id."""
    for candidate in (Path(path), REPO_ROOT / path):
        if candidate.is_dir():
            return str(candidate.resolve()), candidate.resolve().name
    try:
        return str(resolve_model(path).resolve()), path
    except FileNotFoundError as e:
        raise FileNotFoundError(f"model directory {path!r} not found (cwd {Path.cwd()}, repository {REPO_ROOT}), "
                                f"nor on the Hub: {e}") from None


def engine_actor_options(args: AppArgs) -> dict:
    """Ray resources of one engine replica: a GPU (or `num_gpus_per_replica`) and a CPU where the cluster has GPUs,
    else `engine_num_cpus` CPUs."""
    gpus = args.num_gpus_per_replica
    if gpus is None:
        gpus = 1.0 if _cluster_has_gpus() else 0.0
    return {"num_gpus": gpus, "num_cpus": 1.0 if gpus else args.engine_num_cpus}


def build_app(args: AppArgs) -> serve.Application:
    """The Serve application: engine replicas behind the OpenAI ingress."""
    actor_options = engine_actor_options(args)
    model_dir, name = resolve_model_dir(args.model_dir)
    options = {"served_model_name": name, **args.engine_options}  # unless engine_options name it
    cfg = EngineConfig(model_dir, args.gpu_memory_budget, "cuda" if actor_options["num_gpus"] else "cpu", options,
                       store_root=args.store_root, expert_impl=args.expert_impl)
    routing = {"request_router_config": RequestRouterConfig(request_router_class=PrefixAffinityRouter)} \
        if args.prefix_affinity else {}
    engine = EngineReplica.options(num_replicas=args.num_replicas, ray_actor_options=actor_options, **routing).bind(cfg)
    # one ingress (no CPU reserved) per engine replica: each is one event loop relaying HTTP and replica messages
    return OpenAIIngress.options(num_replicas=args.num_replicas).bind(engine, args.api_key)

