"""Multi-turn chats through several engine replicas, routed by prefix affinity (actors/routing.py) or by Serve's
default router (power of two choices): how much of each later turn's history is found computed, and what that does
to its time to first token.

`--conversations` chats of `--turns` turns run through the OpenAI app (streamed chat completions, greedy,
`--max-tokens` each), `--clients` at a time, each client sending a conversation's turns one after another (a turn
is sent when the previous answer has ended, its answer included). All chats share a system prompt; each starts with
its own question (`--question-chars` of data/eval.txt). The KV cache is large enough to keep every conversation's blocks, so what a
later turn finds depends only on where it is routed. Rows, per router: later turns' prompt tokens, tokens found
computed (usage.prompt_tokens_details.cached_tokens) and the share found of what the earlier turn's blocks could give
(its prompt's whole blocks, measured as the previous turn's prompt tokens), their TTFT P50 / P99 (measured at the
client, first content chunk), the first turns' TTFT (no history: what routing cannot change), and wall time.

    python -m benchmarks.routing_affinity --replicas 2 --conversations 24 --turns 3   # CPU, the bundled model
"""
from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from benchmarks.common import local_serve, write_result

ROOT = Path(__file__).resolve().parent.parent
SYSTEM = "You are a careful Python programmer. Answer with short, correct code and one line of explanation. " * 2
FOLLOW_UPS = ["Now add type hints.", "Add a docstring.", "Write one test for it.", "Make it faster."]


def questions(n: int, chars: int) -> list[str]:
    """n distinct opening questions, each about `chars` characters of the evaluation text (its own history, which the
    shared system prompt is not)."""
    text = " ".join(ln.strip() for ln in (ROOT / "data" / "eval.txt").read_text().splitlines() if ln.strip())
    if len(text) < n * chars:
        raise ValueError(f"data/eval.txt has {len(text)} characters, {n} x {chars} asked")
    step = len(text) // n
    return [f"Explain this code and rewrite it: {text[i * step:i * step + chars]}" for i in range(n)]


def chat_turn(url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat completion: its text, usage and TTFT (seconds to the first content chunk)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", ()):
                piece = choice["delta"].get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(piece)
    return {"text": "".join(text), "ttft_s": ttft if ttft is not None else time.perf_counter() - t0,
            "prompt_tokens": usage["prompt_tokens"], "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


def run_chats(url: str, model: str, args) -> list[dict]:
    """Every conversation's turns, `args.clients` conversations at a time; one record per turn."""
    todo = list(enumerate(questions(args.conversations, args.question_chars)))
    records, lock = [], threading.Lock()

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                conv, question = todo.pop(0)
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            before = 0
            for turn in range(args.turns):
                try:
                    out = chat_turn(url, model, messages, args.max_tokens)
                except urllib.error.HTTPError as exc:  # e.g. the history outgrew the context: the chat ends
                    with lock:
                        records.append({"conversation": conv, "turn": turn, "error": exc.read().decode()[:300]})
                    break
                with lock:
                    records.append({"conversation": conv, "turn": turn, "previous_prompt_tokens": before, **out})
                before = out["prompt_tokens"]
                messages = messages + [{"role": "assistant", "content": out["text"]},
                                       {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]

    threads = [threading.Thread(target=client) for _ in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records


def summarize(records: list[dict], block_size: int) -> dict:
    errors = [r for r in records if "error" in r]
    records = [r for r in records if "error" not in r]
    later = [r for r in records if r["turn"] > 0]
    possible = sum((r["previous_prompt_tokens"] - 1) // block_size * block_size for r in later)
    found = sum(r["cached_tokens"] for r in later)
    ttft = np.array([r["ttft_s"] for r in later]) * 1e3
    first = np.array([r["ttft_s"] for r in records if r["turn"] == 0]) * 1e3
    return {"later_turns": len(later), "later_prompt_tokens": sum(r["prompt_tokens"] for r in later),
            "later_cached_tokens": found, "later_possible_tokens": possible,
            "found_share_of_possible": found / possible if possible else 0.0,
            "later_ttft_ms_p50": float(np.percentile(ttft, 50)), "later_ttft_ms_p99": float(np.percentile(ttft, 99)),
            "first_ttft_ms_p50": float(np.percentile(first, 50)), "errors": len(errors),
            "first_error": errors[0]["error"] if errors else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "models" / "pw-tiny-moe"), help="HF or AP checkpoint directory")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--clients", type=int, default=4, help="conversations in flight at once")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--question-chars", type=int, default=1000, help="characters of each opening question")
    p.add_argument("--kv-cache-bytes", type=int, default=32 << 20, help="per engine: room to keep every history")
    p.add_argument("--engine-num-cpus", type=float, default=0.0, help="CPUs each CPU engine replica reserves")
    p.add_argument("--routers", default="affinity,default", help="which routers to run, in this order")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--label", default=None)
    args = p.parse_args()
    if args.replicas < 2:
        p.error("--replicas must be >= 2 (one replica has nothing to route)")
    if args.turns < 2:
        p.error("--turns must be >= 2 (a first turn has no history to find)")
    from ray import serve

    from pagedweight.actors.openai_app import AppArgs, build_app
    from pagedweight.convert import ap_checkpoint_for

    model_dir = ap_checkpoint_for(Path(args.model), Path.home() / ".cache" / "pagedweight", "cpu")
    name, block_size, rows = Path(args.model).name, 16, []
    with local_serve(args.port) as url:
        for router in args.routers.split(","):
            app = build_app(AppArgs(model_dir=str(model_dir), num_replicas=args.replicas,
                                    engine_num_cpus=args.engine_num_cpus, prefix_affinity=router == "affinity",
                                    engine_options={"kv_cache_bytes": args.kv_cache_bytes, "served_model_name": name,
                                                    "block_size": block_size}))
            serve.run(app, name="routing", route_prefix="/")
            chat_turn(url, name, [{"role": "user", "content": "warm up"}], 4)
            t0 = time.perf_counter()
            records = run_chats(url, name, args)
            row = {"router": router, "replicas": args.replicas, "conversations": args.conversations,
                   "turns": args.turns, "clients": args.clients, "max_tokens": args.max_tokens,
                   **summarize(records, block_size), "wall_s": time.perf_counter() - t0}
            print(json.dumps(row), flush=True)
            rows.append(row)
            serve.delete("routing")
    path = write_result("routing_affinity", rows, label=args.label,
                        extra={"model": name, "note": "KV room keeps every history: what a later turn finds "
                                                      "depends only on where it is routed"})
    print(path)


if __name__ == "__main__":
    main()
