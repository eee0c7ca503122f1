"""Time and memory of one step's sampling: `Sampler` over a batch of last-position logits, through its host read.

The sampler's host read ends a step: the next step launches after it. The OpenAI app samples at temperature 1 unless a
request says otherwise, so this is the path of most HTTP traffic. Logits are random fp32 [B, V] on the device (V:
Qwen1.5-MoE's vocabulary by default); the rows of a case take its parameters (or cycle through its list), and the
generator the engine gives such a request (`make_generator`: before eda0590 every sampled request had one of its own;
since, seeded requests only). Rows: per arm, case and batch, the median and P90 ms of a call (wall time, ending
with its host read) and the peak bytes the call allocated beyond its inputs (`torch.cuda.max_memory_allocated`; not
measured on the CPU).

    python -m benchmarks.sampler_bench --label after
    git show REV:pagedweight/sampling.py > /tmp/old_sampling.py
    python -m benchmarks.sampler_bench --old /tmp/old_sampling.py --label ab   # the old file's Sampler beside it
    python -m benchmarks.sampler_bench --nucleus-arms --cases t0.8-p0.9 --label nucleus   # top-p: kernel, sort
    python -m benchmarks.sampler_bench --prompt 73,512,2048 --chunk-mib 64,256 --label plp

`--prompt R,...` times `Sampler.prompt_logprobs` instead: R prompt rows' final hidden states [R, H] (fp16 on CUDA, H:
Qwen1.5-MoE's 2048) through an LM head [V, H] in chunks of SAMPLE_CHUNK_BYTES (`--chunk-mib`), with 0, 1 and 5
alternatives per row, beside the head's GEMM over all R rows at once (arm "head", [R, V] logits, no log-softmax): what
the chunking and the log-probabilities add to the floor of the head's own work.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time

import numpy as np
import torch

from benchmarks.common import write_result
from pagedweight import sampling
from pagedweight.sampling import SamplingParams

CASES = {  # SamplingParams fields of every row (a list: row i takes entry i % its length); "seed" seeds row i with i
    # (its own generator), else the global RNG
    "greedy": dict(),
    "t1": dict(temperature=1.0),  # the OpenAI app's default
    "t1-seeded": dict(temperature=1.0, seed=True),
    "t0.8-p0.9": dict(temperature=0.8, top_p=0.9),
    "t0.7-k50": dict(temperature=0.7, top_k=50),
    "t1-minp0.05": dict(temperature=1.0, min_p=0.05),  # vLLM's min_p: a mask, no sort
    "half-greedy-t1": [dict(), dict(temperature=1.0)],  # even rows greedy, odd rows at temperature 1
    "t0.7-k20-p0.8": dict(temperature=0.7, top_k=20, top_p=0.8),  # Qwen's generation_config
    # half the rows as Qwen's generation_config, half top-p alone: the sort, or top-k as a threshold and the kernel
    "mixed-k20p0.8-p0.9": [dict(temperature=0.7, top_k=20, top_p=0.8), dict(temperature=0.8, top_p=0.9)],
    # adjusted rows (sampling.adjust_logits): the penalties count `--history` generated tokens a row
    "greedy-penalties": dict(presence_penalty=0.5, frequency_penalty=0.5),
    "t1-penalties": dict(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.5),
    "greedy-bias": dict(logit_bias={t: 5.0 for t in range(0, 3000, 30)}),  # 100 biased tokens a row
}


def case_params(case: str, batch: int) -> list[SamplingParams]:
    cycle = CASES[case] if isinstance(CASES[case], list) else [CASES[case]]
    out = []
    for i in range(batch):
        fields = dict(cycle[i % len(cycle)])
        out.append(SamplingParams(seed=i if fields.pop("seed", False) else None, **fields))
    return out


def measure(sampler, make_generator, logits: torch.Tensor, params: list[SamplingParams], reps: int,
            history: list | None = None) -> dict:
    dev = logits.device
    gens = [None if p.greedy else make_generator(p.seed, dev) for p in params]
    cuda = dev.type == "cuda"
    times, peak = [], None
    for rep in range(reps + 3):
        if cuda:
            torch.cuda.synchronize(dev)
            base = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        tokens = sampler(logits, params, gens, *([history] if history is not None else []))
        elapsed = time.perf_counter() - t0
        if len(tokens) != len(params):
            raise RuntimeError(f"{len(tokens)} tokens for {len(params)} rows")
        if rep >= 3:  # the first calls warm the allocator and the kernels
            times.append(elapsed * 1e3)
            if cuda:
                peak = max(peak or 0, torch.cuda.max_memory_allocated(dev) - base)
    times.sort()
    return {"median_ms": round(statistics.median(times), 4), "p90_ms": round(times[int(0.9 * (len(times) - 1))], 4),
            "peak_extra_mib": None if peak is None else round(peak / 2**20, 2)}


def prompt_rows(args: argparse.Namespace, dev: torch.device) -> list[dict]:
    """`--prompt`: Sampler.prompt_logprobs at each row count and chunk bound, and the head alone."""
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False, device=dev, dtype=dtype)
    torch.nn.init.normal_(head.weight, std=0.02)
    rows, default = [], sampling.SAMPLE_CHUNK_BYTES
    for r in [int(x) for x in args.prompt.split(",")]:
        hidden = torch.randn(r, args.hidden, device=dev, dtype=dtype)
        tokens = torch.randint(0, args.vocab, (r,)).tolist()
        params = [SamplingParams()] * r

        def head_only(*_):
            with torch.inference_mode():
                return head(hidden).argmax(dim=-1).tolist()  # one host read, as the call ends with its own
        row = {"arm": "head", "case": "all-rows", "batch": r, "vocab": args.vocab,
               **measure(head_only, lambda *_: None, hidden, params, args.reps)}
        print(row, flush=True)
        rows.append(row)
        for mib in [int(x) for x in args.chunk_mib.split(",")]:
            sampling.SAMPLE_CHUNK_BYTES = mib << 20
            for n in (0, 1, 5):
                def call(*_, n=n):
                    return sampling.Sampler.prompt_logprobs(hidden, head, tokens, [n] * r)
                row = {"arm": f"chunk{mib}MiB", "case": f"prompt-lp{n}", "batch": r, "vocab": args.vocab,
                       **measure(call, lambda *_: None, hidden, params, args.reps)}
                print(row, flush=True)
                rows.append(row)
        sampling.SAMPLE_CHUNK_BYTES = default
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--vocab", type=int, default=151936, help="Qwen1.5-MoE-A2.7B's vocabulary")
    p.add_argument("--batches", default="1,4,32,256")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--old", default=None, metavar="FILE", help="an older sampling.py: its Sampler is arm 'old'")
    p.add_argument("--nucleus-arms", action="store_true",
                   help="also arms 'sort' and 'kernel': top-p always through the sort, always through the nucleus cut "
                        "kernel ('new': from sampling.NUCLEUS_KERNEL_MIN_ROWS rows)")
    p.add_argument("--history", type=int, default=1024, help="generated tokens a penalized row counts")
    p.add_argument("--prompt", default=None, metavar="R,...", help="time prompt log-probabilities of R rows instead")
    p.add_argument("--hidden", type=int, default=2048, help="with --prompt: the LM head's input width")
    p.add_argument("--chunk-mib", default="64", help="with --prompt: SAMPLE_CHUNK_BYTES values to try, MiB")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--label", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    dev = torch.device(args.device)
    arms = {"new": (sampling.Sampler(), sampling.make_generator)}
    if args.old:  # the whole old module: its Sampler calls its own helpers, whatever their signatures now
        spec = importlib.util.spec_from_file_location("old_sampling", args.old)
        old = sys.modules["old_sampling"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
        spec.loader.exec_module(old)
        arms = {"old": (old.Sampler(), old.make_generator), **arms}
    if args.nucleus_arms:
        arms["sort"] = (sampling.Sampler(nucleus_min_rows=1 << 30), sampling.make_generator)
        arms["kernel"] = (sampling.Sampler(nucleus_min_rows=1), sampling.make_generator)
    rows = prompt_rows(args, dev) if args.prompt else []
    for batch in [] if args.prompt else [int(b) for b in args.batches.split(",")]:
        logits = torch.randn(batch, args.vocab, device=dev) * 3
        for case in args.cases.split(","):
            params = case_params(case, batch)
            history = None
            if any(p.penalized for p in params):
                rng = np.random.default_rng(batch)
                history = [rng.integers(0, args.vocab, args.history) for _ in params]
            for arm, (sampler, make_generator) in arms.items():
                if history is not None and arm == "old":
                    continue  # no penalties before session 36
                row = {"arm": arm, "case": case, "batch": batch, "vocab": args.vocab,
                       **measure(sampler, make_generator, logits, params, args.reps, history),
                       **({"history": args.history} if history is not None else {})}
                print(row, flush=True)
                rows.append(row)
    path = write_result("sampler_bench", rows, out_dir=args.out_dir, label=args.label,
                        extra={"device": str(dev), "reps": args.reps})
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
