"""Host cost of one step's request outputs: appending each running request's new token (with incremental
detokenization and the stop checks) and building its RequestOutput, per `SamplingParams.output_kind`.

This work runs between a step's token read and the next step's launch, while the device idles, once per running
request. A "cumulative" output copies every token the request generated so far, so the step's cost grows with
concurrency x generated length; "delta" and "final_only" outputs do not. The model does not run here: requests of
`--prompt` prompt tokens that already generated L tokens are built directly (token ids from a real text, through
the bundled model's tokenizer), then `--steps` steps of one new token each go through the engine's own `_append`
and `_output`. Rows: per kind, running requests and generated length, the median host ms per step.

    python -m benchmarks.output_cost --label after
    python -m benchmarks.output_cost --kinds cumulative --label before   # on a tree without output kinds
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from benchmarks.common import write_result
from pagedweight.engine import LLM
from pagedweight.sampling import SamplingParams
from pagedweight.sequence import Sequence

ROOT = Path(__file__).resolve().parents[1]


def step_ms(llm: LLM, kind: str, requests: int, generated: int, prompt: int, steps: int, text_ids: list[int]) -> float:
    """Median host ms of one step's appends and outputs for `requests` requests that generated `generated` tokens."""
    kw = {} if kind == "cumulative" else {"output_kind": kind}  # a tree without output kinds takes cumulative only
    params = SamplingParams(max_tokens=generated + steps + 1, ignore_eos=True, **kw)
    ids = (text_ids * (1 + (prompt + generated + steps) // len(text_ids)))[:prompt + generated + steps]
    seqs = []
    for i in range(requests):
        seq = Sequence(f"r{i}", ids[:prompt], params)
        seq.token_ids.extend(ids[prompt:prompt + generated])
        seq.text = llm.tokenizer.decode(ids[prompt:prompt + generated])
        seq.sent_text_len = len(seq.text)
        seq.prefix_offset, seq.read_offset = generated - 1, generated  # as incremental detokenization leaves them
        llm._requests[seq.request_id] = seq
        seqs.append(seq)
    times = []
    for k in range(steps):
        tok, t0 = ids[prompt + generated + k], time.perf_counter()
        for seq in seqs:
            llm._append(seq, tok, t0)
            if kind != "final_only":
                llm._output(seq)
        times.append(time.perf_counter() - t0)
    if any(seq.is_finished for seq in seqs):
        raise RuntimeError("a request finished during the measured steps: the rows would not be steady state")
    llm._requests.clear()
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default="cumulative,delta,final_only")
    p.add_argument("--requests", default="32,256", help="running requests per step")
    p.add_argument("--generated", default="128,1024,4096", help="tokens each request generated before the step")
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--out-dir", default=None)
    p.add_argument("--label", default=None)
    args = p.parse_args(argv)
    llm = LLM(ROOT / "models" / "pw-tiny-moe", device="cpu")
    llm.max_model_len = 1 << 30  # requests longer than the model's context: no step runs the model here
    text = (ROOT / "pagedweight" / "engine.py").read_text()
    text_ids = llm.tokenizer.encode(text)
    rows = []
    for kind in args.kinds.split(","):
        for n in map(int, args.requests.split(",")):
            for g in map(int, args.generated.split(",")):
                ms = step_ms(llm, kind, n, g, args.prompt, args.steps, text_ids)
                rows.append({"output_kind": kind, "requests": n, "generated": g, "prompt": args.prompt,
                             "steps": args.steps, "step_host_ms_median": round(ms, 4)})
                print(rows[-1], flush=True)
    write_result("output_cost", rows, out_dir=args.out_dir, label=args.label)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
