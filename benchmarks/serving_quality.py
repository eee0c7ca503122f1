"""Perplexity served under memory pressure: what the answers of an engine are worth when its load comes and goes,
PagedWeight against static uniform widths in the same budget (CPU, the bundled model).

Windows of data/eval.txt are scored through the engine, each a request whose prompt tokens report their
log-probabilities (SamplingParams.prompt_logprobs: the evaluation job's perplexity path) and which then generates
`--gen` tokens (greedy), so that the windows of a wave hold their KV together as decoding requests do, in two waves: a light one
(`--light` windows, at most two at a time) and then a heavy one (the other windows, all at once), with an idle engine
between them (`LLM.step_idle`, as a server calls it). The budget holds the weights outside the pool, the experts at
`--budget-bits` and the KV cache of the heavy wave (prompts and generated tokens). PagedWeight serves at the widest widths the KV in use leaves room
for; a static engine keeps its width, and a width whose experts leave too little KV is refused by the budget or makes
windows wait. Rows, per wave and over both: perplexity, steps, preemptions, the mean committed width over the
wave's steps (measured from the page table after each step; static: its width) and the lowest, offload / reload
triggers, wall seconds (on this machine). A reference row scores at 8 bits with no budget.

    python -m benchmarks.serving_quality              # light 8 and heavy 16 windows of 256 tokens, 5-bit budget
    python -m benchmarks.serving_quality --windows 32 --budget-bits 4 --label b4
    python -m benchmarks.serving_quality --budget-bits 3 --observe-every 1,4,8 --widths 3,4 --label b3-observe
"""
from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import write_result
from pagedweight.convert import ap_checkpoint_for
from pagedweight.engine import LLM
from pagedweight.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def score(llm: LLM, windows: list[list[int]], at_once: int, gen: int) -> dict:
    """The windows through `llm`, at most `at_once` in the engine at a time, each generating `gen` tokens after its
    prompt; perplexity of the prompts and how the engine served them."""
    params = SamplingParams(max_tokens=gen, ignore_eos=True, prompt_logprobs=0, output_kind="final_only")
    ids, widths, outs = [], [], {}
    before, steps0 = llm.stats(), llm.num_steps
    t0 = time.perf_counter()
    while len(outs) < len(windows):
        while len(ids) - len(outs) < at_once and len(ids) < len(windows):
            ids.append(llm.add_request(windows[len(ids)], params))
        for out in llm.step():
            outs[out.request_id] = out
        if llm.table is not None:
            widths.append(float(np.mean(llm.committed_widths())))
    wall = time.perf_counter() - t0
    after = llm.stats()
    failed = [o.error for o in outs.values() if o.finish_reason != "length"]
    if failed:
        raise RuntimeError(f"{len(failed)} windows failed: {failed[0]}")
    nll = -sum(e[t] for w, rid in zip(windows, ids) for t, e in zip(w[1:], outs[rid].prompt_logprobs[1:]))
    tokens = sum(len(w) - 1 for w in windows)
    return {"ppl": math.exp(nll / tokens), "nll": nll, "scored_tokens": tokens,
            "steps": llm.num_steps - steps0, "preemptions": after["preemptions"] - before["preemptions"],
            "mean_width": float(np.mean(widths)) if widths else None, "min_width": min(widths) if widths else None,
            "offload_triggers": after["offload_triggers"] - before["offload_triggers"],
            "reload_triggers": after["reload_triggers"] - before["reload_triggers"], "wall_s": wall}


def serve_waves(name: str, llm: LLM, waves: dict[str, tuple[list[list[int]], int]], gen: int) -> dict:
    """One configuration's row: each wave in turn, the engine idle between them, and both together."""
    row: dict = {"config": name, "kv_blocks": llm.stats()["kv_total_blocks"]}
    for wave, (windows, at_once) in waves.items():
        llm.step_idle()
        row[wave] = score(llm, windows, at_once, gen)
    nll = sum(row[w]["nll"] for w in waves)
    row["ppl"] = math.exp(nll / sum(row[w]["scored_tokens"] for w in waves))
    print({k: v if not isinstance(v, dict) else {m: round(x, 4) if isinstance(x, float) else x for m, x in v.items()}
           for k, v in row.items()}, flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "models" / "pw-tiny-moe")
    p.add_argument("--data", type=Path, default=ROOT / "data" / "eval.txt")
    p.add_argument("--windows", type=int, default=16, help="windows of the heavy wave")
    p.add_argument("--light", type=int, default=8, help="windows of the light wave (two at a time)")
    p.add_argument("--ctx", type=int, default=256, help="tokens scored per window")
    p.add_argument("--gen", type=int, default=32, help="tokens each window generates after its prompt")
    p.add_argument("--budget-bits", type=int, default=5, help="the budget holds the experts at this width")
    p.add_argument("--widths", default="3,4,5,6,8", help="static uniform widths to compare")
    p.add_argument("--observe-every", default=None, metavar="N[,N...]",
                   help="PagedWeight rows reading routing statistics every N-th step (default: one row, the engine's)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "pagedweight-cache")
    p.add_argument("--page-store-dir", default=str(Path(tempfile.gettempdir()) / "pagedweight-serving-quality"))
    p.add_argument("--out-dir", default=None)
    p.add_argument("--label", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    from pagedweight.actors.jobs.evaluate import token_windows

    ap_dir = ap_checkpoint_for(args.model, args.cache_dir, "cpu")
    windows = token_windows(ap_dir, args.data.read_text(), args.ctx, args.light + args.windows)
    waves = {"light": (windows[:args.light], 2), "heavy": (windows[args.light:], len(windows))}
    common = dict(block_size=args.block_size, page_store_dir=args.page_store_dir, max_num_seqs=max(len(windows), 1))
    ref = LLM(ap_dir, None, "cpu", bits=8, paging=False, **common)
    rows = [serve_waves("8-bit, no budget", ref, waves, args.gen)]
    probe = LLM(ap_dir, None, "cpu", bits=args.budget_bits, paging=False, **common)
    heavy = waves["heavy"][0]
    blocks = sum(-(-(len(w) + args.gen) // args.block_size) for w in heavy) + len(heavy)  # a block of slack each
    budget = probe.weights_outside_bytes + probe.stats()["resident_weight_bytes"] + \
        probe.pool.bytes_of(probe.pool.reserve_pages) + blocks * probe.kv.block_bytes
    del ref, probe
    if args.observe_every is None:
        configs = [("pagedweight", dict(bits=8, paging=True))]
    else:
        configs = [(f"pagedweight-observe{n}", dict(bits=8, paging=True, observe_every=int(n)))
                   for n in args.observe_every.split(",")]
    configs += [(f"uniform-{b}", dict(bits=b, paging=False)) for b in (int(x) for x in args.widths.split(","))]
    for name, options in configs:
        try:
            llm = LLM(ap_dir, budget, "cpu", **options, **common)
        except ValueError as exc:  # a static width whose experts leave no KV: the budget refuses it
            rows.append({"config": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
            print(rows[-1], flush=True)
            continue
        rows.append(serve_waves(name, llm, waves, args.gen))
    path = write_result("serving_quality", rows, out_dir=args.out_dir, label=args.label,
                        extra={"light_windows": args.light, "heavy_windows": args.windows, "ctx": args.ctx,
                               "gen": args.gen, "budget_bits": args.budget_bits,
                               "budget_bytes": budget, "kv_blocks_of_all_windows": blocks, "model": args.model.name})
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
