"""`pagedweight run`: the main job. Serve a batch of prompts with continuous batching under a GPU memory budget,
expert widths moving with KV pressure (pagedweight.engine.LLM), and print what moved: tokens/s, KV blocks, widths,
offload and reload triggers, bytes each way. Which figures are measured and which computed is said where the
summary is built.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from tqdm import tqdm

from pagedweight.apformat import MANIFEST
from pagedweight.checkpoint import model_name, resolve_model
from pagedweight.cli import HelpFormatter
from pagedweight.convert import ap_checkpoint_for
from pagedweight.engine import LLM, RequestOutput, check_device, serving_reserve
from pagedweight.page_store import PageStore
from pagedweight.pool import parse_budget
from pagedweight.sampling import SamplingParams


def load_prompts(path: str | None, num_prompts: int | None) -> list[str]:
    """Prompts from a file or N slices of data/eval.txt. A file holds one prompt a line; a line that is a JSON object
    with a string "prompt" is that prompt, any other line the prompt as written (code that begins with `{` too). In a
    .jsonl file every line must be such an object, and one that is not is refused by its file and line."""
    if path:
        if not Path(path).is_file():
            raise ValueError(f"--prompts {path}: " + ("not a file" if Path(path).exists() else "no such file"))
        try:
            lines = Path(path).read_text().splitlines()
        except UnicodeDecodeError as e:
            raise ValueError(f"--prompts {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        prompts = []
        for i, ln in enumerate(lines, 1):
            if not ln.strip():
                continue
            try:
                obj = json.loads(ln) if ln.lstrip().startswith("{") else None
            except json.JSONDecodeError:
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and obj["prompt"]:
                prompts.append(obj["prompt"])
            elif path.endswith(".jsonl"):
                raise ValueError(f"{path}:{i}: not a JSON object with a non-empty string \"prompt\"")
            else:
                prompts.append(ln)
        if not prompts:
            raise ValueError(f"--prompts {path}: no prompt in it (every line is empty)")
        return prompts
    from pagedweight.corpus import load_slice

    text = load_slice("eval")
    step = max(len(text) // max(num_prompts, 1), 1)
    starts = [text.find("\n", i * step) + 1 for i in range(num_prompts)]  # begin on a line
    return [text[s:s + 400].rstrip() for s in starts]


def write_json(path: str | Path, obj) -> None:
    """`obj` as JSON in `path`, whole or not at all: written beside it, then renamed over it (a full disk or a Ctrl-C
    midway leaves an earlier file as it was, not a truncated one)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # not mkstemp's: its file is private (0600)
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(obj, indent=1) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_output_file(path: str, flag: str) -> None:
    """Refuse an output file that could not be written, before the work whose results it would hold."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {path}: is a directory")
    if not p.resolve().parent.is_dir():
        raise ValueError(f"{flag} {path}: no such directory")
    if not os.access(p.resolve().parent, os.W_OK):
        raise ValueError(f"{flag} {path}: its directory is not writable")


def default_page_store(model_dir: Path) -> Path | None:
    """Where an engine over `model_dir` maps the node page store when given no directory
    (runner.default_store_dir); None for a dense checkpoint."""
    if not (model_dir / MANIFEST).is_file():
        return None
    from pagedweight.apformat import load_ap
    from pagedweight.runner import default_store_dir

    return default_store_dir(load_ap(model_dir, verify=False))


@contextmanager
def engine(model_dir: Path, *, keep_page_store: bool = False, **llm_args) -> Iterator[LLM]:
    """LLM(model_dir, **llm_args), closed at the end; the default page store it wrote (the checkpoint's planes in
    /dev/shm, which is RAM) is removed then unless `keep_page_store`, also when the build is refused or the work is
    interrupted. A store it found (other engines of the node may map it) and a given directory stay."""
    store = None if keep_page_store or llm_args.get("page_store_dir") else default_page_store(model_dir)
    found = store is not None and store.exists()
    try:
        llm = LLM(model_dir, **llm_args)
    except BaseException:  # LLM closes what it opened; the store it wrote stays unless removed here
        if store is not None and not found and store.exists():
            PageStore.destroy(store)
        raise
    wrote = llm.page_store_dir is not None and llm.mover is not None and llm.mover.store.written
    try:
        yield llm
    finally:
        llm.close()  # this process's mapping of the store goes with it
        if wrote and store is not None:
            PageStore.destroy(llm.page_store_dir)  # tmpfs is RAM (a Mixtral's planes: ~54 GB)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "run", help="serve a batch of prompts with dynamic weight paging under a GPU memory budget",
        description="Serve prompts with continuous batching; expert precision moves with KV pressure inside the "
                    "budget (weights + KV cache). A HF checkpoint is converted to any-precision planes first "
                    "(cached). Prints a summary: tokens/s, widths moved, KV blocks.",
        formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR|ORG/NAME",
                   help="AP checkpoint or HF checkpoint directory, or a Hugging Face Hub repository id")
    p.add_argument("--gpu-memory-budget", default=None, metavar="BYTES",
                   help="weights + KV cache budget: bytes with unit (1GiB) or a fraction of device memory "
                        "(default: every block at full width plus 64 MiB of KV)")
    p.add_argument("--activation-reserve", default=None, metavar="BYTES|auto",
                   help="share of the budget kept for activations, CUDA-graph pools and scratch, so that the budget "
                        "bounds it all: auto (measured by profile steps at start-up) or bytes, e.g. 1GiB (the "
                        "summary's measured peak minus the budget on an earlier run); default: auto on CUDA under "
                        "a budget, else 0")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", metavar="FILE", help="prompts, one per line; a line {\"prompt\": ...} is a JSON "
                                                     "prompt (in a .jsonl file every line must be)")
    src.add_argument("--num-prompts", type=int, metavar="N", help="N prompts cut from the bundled eval text")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: the smallest set of tokens whose probability reaches P, in (0, 1]; 1 = off")
    p.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens only; 0 = off")
    p.add_argument("--seed", type=int, default=None,
                   help="random seed of sampling, makes sampled output repeatable (default: unseeded)")
    p.add_argument("--bits", type=int, default=None, help="home width (default: the checkpoint's parent width)")
    p.add_argument("--static", action="store_true", help="no paging: every block stays at --bits")
    p.add_argument("--dense", action="store_true", help="serve the HF checkpoint's dense weights (no planes)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device of the engine: cuda (the current GPU; CUDA_VISIBLE_DEVICES picks which) or cpu")
    p.add_argument("--dtype", default=None, help="float16 | bfloat16 | float32 (default: fp16 on CUDA, fp32 on CPU)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="most requests running in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="most tokens computed in one step (prefill chunks and decodes together)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="each request computes its whole prompt (default: share computed blocks of a common prefix)")
    p.add_argument("--prefix-retention-s", type=float, default=0.0, metavar="S",
                   help="with paging: a finished request's kept prefix blocks are held for S seconds as a running "
                        "request's are: weights are lowered to make room rather than the blocks evicted, and reloads "
                        "leave them (a chat's next turn finds them; default 0: reloads and allocations take them)")
    p.add_argument("--page-store-dir", default=None,
                   help="node page store of the planes (default: /dev/shm/pagedweight-<checkpoint id>, removed at "
                        "the end if this run wrote it, unless --keep-page-store: it holds the planes in RAM; one it "
                        "found, which other engines of the node may map, and a given directory are kept)")
    p.add_argument("--keep-page-store", action="store_true",
                   help="leave the default page store in /dev/shm for the next run (no rewrite of the planes)")
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "pagedweight"),
                   help="where converted AP checkpoints are kept")
    p.add_argument("--show", type=int, default=2, metavar="N", help="print the first N completions")
    p.add_argument("--summary-json", default=None, metavar="FILE",
                   help="also write the summary's figures to FILE as JSON (for scripts and benchmarks)")
    return p


def serve_prompts(llm: LLM, prompts: list[str], params: SamplingParams, show: int, budget: int | float | None,
                  reserve: int | str) -> dict:
    """Serve `prompts` to the end on `llm`, then let it reload as a server does once idle; print the first `show`
    completions and the summary, and return the summary's figures."""

    def mean_width(hist: list[list[int]]) -> float:
        counts = np.asarray(hist).sum(axis=0)
        return float((counts * np.arange(len(counts))).sum() / max(counts.sum(), 1))

    start_stats = llm.stats()
    min_free = start_stats["kv_free_blocks"]
    min_width = mean_width(start_stats["committed_width_hist"]) if llm.table is not None else None
    for rid, prompt in enumerate(prompts):
        llm.add_request(prompt, params, request_id=str(rid))
    done: dict[str, RequestOutput] = {}
    t0 = time.perf_counter()
    with tqdm(total=len(prompts), desc="run", unit="req") as bar:
        while llm.has_unfinished():
            for out in llm.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
            min_free = min(min_free, llm.kv.num_free_blocks)
            if min_width is not None:
                min_width = min(min_width, mean_width(llm.stats()["committed_width_hist"]))
    elapsed = time.perf_counter() - t0
    last = llm.stats()
    for _ in range(100):  # as a server does once idle: the reloads the ended requests allow (bounded)
        if not llm.step_idle():
            break
    st = llm.stats()
    reasons: dict[str, int] = {}
    for o in done.values():
        reasons[o.finish_reason] = reasons.get(o.finish_reason, 0) + 1
    for rid in map(str, range(min(show, len(prompts)))):
        print(f"--- request {rid} ({done[rid].finish_reason}) ---\n{done[rid].text}")
    errors = {rid: o.error for rid, o in done.items() if o.finish_reason == "error"}
    for rid, why in errors.items():
        print(f"request {rid} failed: {why}", file=sys.stderr)
    gen = sum(o.completion_tokens for o in done.values())
    # measured: time, blocks, widths, the device's peak reserved bytes; computed: the bytes the budget covers
    summary = {
        "model": llm.model_name, "device": str(llm.device), "gpu_memory_budget": budget,
        "budget_bytes": st["budget_bytes"],  # what the budget covers (weights + pool + reserve), computed
        "activation_reserve_bytes": llm.options.activation_reserve, "reserve_measured": reserve == "auto",
        "requests": len(done), "finish_reasons": reasons,
        "prompt_tokens": sum(o.prompt_tokens for o in done.values()), "generated_tokens": gen,
        "elapsed_s": elapsed, "tokens_per_s": gen / elapsed if elapsed > 0 else 0.0,
        "kv_total_blocks": st["kv_total_blocks"], "kv_free_blocks_at_start": start_stats["kv_free_blocks"],
        "kv_free_blocks_min": min_free, "preemptions": st["preemptions"],
        "device_peak_reserved_bytes": st["device_peak_reserved_bytes"], "errors": errors,
    }
    if llm.table is not None:
        summary.update(
            mean_width_start=mean_width(start_stats["committed_width_hist"]), mean_width_min=min_width,
            mean_width_last_request=mean_width(last["committed_width_hist"]),
            mean_width_idle=mean_width(st["committed_width_hist"]), offload_triggers=st["offload_triggers"],
            reload_triggers=st["reload_triggers"], bytes_offloaded=st["bytes_offloaded"],
            bytes_reloaded=st["bytes_reloaded"])

    MiB = 2**20
    print("--- summary ---")
    asked = ("unbounded" if budget is None else f"{budget:g} of the device's memory" if isinstance(budget, float)
             else f"{budget / MiB:.1f} MiB ({budget:,} B)")
    print(f"model {llm.model_name} on {llm.device}, budget {asked}")
    print(f"requests {len(done)} ({', '.join(f'{k} {v}' for k, v in sorted(reasons.items()))}), "
          f"prompt tokens {summary['prompt_tokens']}, generated {gen} in {elapsed:.2f} s "
          f"= {summary['tokens_per_s']:.1f} tokens/s")
    print(f"KV blocks: {st['kv_total_blocks']} total now, {start_stats['kv_free_blocks']} free at start, "
          f"{min_free} free at the tightest step; preemptions {st['preemptions']}")
    over = (st["device_peak_reserved_bytes"] or 0) - st["budget_bytes"]
    print(f"memory: {st['budget_bytes'] / MiB:.1f} MiB under the budget (weights outside the pool + the pool"
          f" + {llm.options.activation_reserve / MiB:.1f} MiB of activation reserve"
          f"{', measured at start-up' if reserve == 'auto' else ''})"
          + ("" if st["device_peak_reserved_bytes"] is None else
             f"; the process's peak reserved on the device {st['device_peak_reserved_bytes'] / MiB:.1f} MiB "
             f"(measured), {abs(over) / MiB:.1f} MiB {'above' if over > 0 else 'within'} the budget"))
    if llm.table is not None:
        print(f"expert widths: mean {summary['mean_width_start']:.2f} bits at start, {min_width:.2f} at the lowest "
              f"step, {summary['mean_width_last_request']:.2f} when the last request ended, "
              f"{summary['mean_width_idle']:.2f} once idle; offload triggers {st['offload_triggers']}, reload "
              f"triggers {st['reload_triggers']}; moved {st['bytes_offloaded'] / MiB:.1f} MiB out, "
              f"{st['bytes_reloaded'] / MiB:.1f} MiB in")
    return summary


def run(args) -> int:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, output_kind="final_only").validate()  # keeps finished only
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if not args.prefix_retention_s >= 0.0:
        raise ValueError(f"--prefix-retention-s {args.prefix_retention_s}: must be >= 0 seconds")
    if args.bits is not None and args.bits < 1:
        raise ValueError(f"--bits {args.bits}: a width of at least 1 bit")
    if args.dense and (args.bits is not None or args.static):
        raise ValueError("--dense serves the dense weights: --bits and --static are for any-precision planes")
    if args.summary_json:
        check_output_file(args.summary_json, "--summary-json")  # not after the whole run
    prompts = load_prompts(args.prompts, args.num_prompts)  # a bad file before a conversion (minutes for a model)
    check_device(args.device)  # refused before a conversion that would run on it
    budget = parse_budget(args.gpu_memory_budget) if args.gpu_memory_budget else None
    if args.activation_reserve is None:
        reserve = serving_reserve(budget, args.device)
    elif args.activation_reserve == "auto":
        reserve = "auto"
    else:
        reserve = parse_budget(args.activation_reserve, "--activation-reserve", allow_zero=True)
    if isinstance(reserve, float):
        raise ValueError(f"--activation-reserve {args.activation_reserve!r}: give bytes (1GiB) or auto, not a "
                         "fraction")
    model_dir = resolve_model(args.model)
    if args.dense and (model_dir / MANIFEST).is_file():
        raise ValueError(f"--dense: {model_dir} is an any-precision checkpoint (its experts are planes)")
    if not args.dense:
        model_dir = ap_checkpoint_for(model_dir, Path(args.cache_dir), args.device)
    with engine(model_dir, keep_page_store=args.keep_page_store, gpu_memory_budget=budget, device=args.device,
                dtype=args.dtype, bits=args.bits, paging=not args.static, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                page_store_dir=args.page_store_dir, activation_reserve=reserve, prefix_caching=args.prefix_caching,
                prefix_retention_s=args.prefix_retention_s, served_model_name=model_name(args.model)) as llm:
        summary = serve_prompts(llm, prompts, params, args.show, budget, reserve)
    if args.summary_json:  # after the printed summary: a failed write loses nothing
        write_json(args.summary_json, summary)
    return 0 if not summary["errors"] else 1
