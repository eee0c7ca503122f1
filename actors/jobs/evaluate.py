"""Cluster evaluation job: perplexity and/or greedy generation spread over every engine of the cluster.

    ray job submit -- python -m pagedweight.actors.jobs.evaluate MODEL_DIR \\
        --mode all --out eval.json                       # one engine per GPU (pagedweight installed on every node)
    ... --num-engines 4 --gpus-per-engine 0.5             # two engines share each of 2 GPUs
    RAY_ADDRESS=... python -m pagedweight.actors.jobs.evaluate MODEL_DIR --num-engines 2   # CPU cluster

The driver tokenizes the text into fixed windows (perplexity) or cuts prompts (generation), deals
them out to the engines in small shards and collects them as they finish (tqdm shows progress), then
writes one results JSON. Perplexity = exp(total NLL / total scored tokens) over all windows, the
same number whatever the number of engines. A failed engine call ends the job with status 1 and a
line naming the engine and its items (no results file); generations that ended with an error are
listed in the results' "errors" and end it with status 1 too.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import ray
from tqdm import tqdm

from pagedweight.actors.engine_actor import EngineConfig, engine_options_json, start_engines
from pagedweight.corpus import DATA_DIR
from pagedweight.pool import parse_budget
from pagedweight.run import check_output_file, write_json

DEFAULT_DATA = DATA_DIR / "eval.txt"  # installed with the package: `ray submit` copies this script alone


def token_windows(model_dir: Path, text: str, ctx: int, num_windows: int) -> list[list[int]]:
    """Non-overlapping windows of ctx+1 tokens (ctx predictions each) from the start of `text`."""
    from pagedweight.tokenizer import TextTokenizer

    ids = TextTokenizer.from_dir(model_dir).encode(text, add_special_tokens=False)
    windows = [ids[i:i + ctx + 1] for i in range(0, len(ids) - ctx, ctx)][:num_windows]
    if not windows:
        raise ValueError(f"the text has {len(ids)} tokens: not even one window of {ctx + 1}")
    return windows


def prompts_from(text: str, num_prompts: int, chars: int) -> list[str]:
    step = max(len(text) // max(num_prompts, 1), 1)
    return [text[i * step:i * step + chars] for i in range(num_prompts)]


class ShardFailed(RuntimeError):
    """An engine's call on a shard failed (the engine died, its step loop failed, a window could not be scored): the
    message names the engine and the items."""


def run_sharded(engines: list, method: str, items: list, shard: int, desc: str,
                names: list[str] | None = None) -> tuple[list, list[int]]:
    """Call engine.<method>(shard) over `items`, keeping every engine busy.

    Returns the per-shard results in item order and how many items each engine handled. A call that fails raises
    ShardFailed naming the engine (`names`, else its index) and its items: nothing of a failed call is counted."""
    shards = [(i, items[i:i + shard]) for i in range(0, len(items), shard)]
    results: list = [None] * len(shards)
    handled = [0] * len(engines)
    idle, pending = list(range(len(engines))), {}
    with tqdm(total=len(items), desc=desc, unit="item", file=sys.stdout) as bar:
        while shards or pending:
            while idle and shards:
                engine, (start, chunk) = idle.pop(), shards.pop(0)
                pending[getattr(engines[engine], method).remote(chunk)] = (engine, start, len(chunk))
            done, _ = ray.wait(list(pending), num_returns=1)
            engine, start, n = pending.pop(done[0])
            try:
                results[start // shard] = ray.get(done[0])
            except Exception as e:  # noqa: BLE001 - a Ray error of any kind: which engine, which items
                name = names[engine] if names else f"#{engine}"
                raise ShardFailed(f"engine {name} failed on {desc} items {start}-{start + n - 1} (of {len(items)}): "
                                  f"{e}") from e
            handled[engine] += n
            idle.append(engine)
            bar.update(n)
    return results, handled


def gather(refs: list, desc: str) -> list:
    """ray.get(refs) in their order, with a progress bar as they finish (engines take minutes to start on a large
    model: its page store, weights, kernels' compile and graphs' capture)."""
    results, index = [None] * len(refs), {ref: i for i, ref in enumerate(refs)}
    pending = list(refs)
    with tqdm(total=len(refs), desc=desc, unit="call", file=sys.stdout) as bar:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            results[index[done[0]]] = ray.get(done[0])
            bar.update(1)
    return results


def evaluate(args: argparse.Namespace, engines: list | None = None) -> dict:
    """Run the evaluation; on `engines` (EngineActor handles, left running) when given, else on engines it
    starts from the arguments and kills at the end."""
    model_dir = Path(args.model_dir).resolve()
    text = Path(args.data).read_text()
    budget = parse_budget(args.gpu_memory_budget) if args.gpu_memory_budget else None
    own = engines is None
    if own:
        cfg = EngineConfig(str(model_dir), budget, device=args.device,
                           engine_options=engine_options_json(args.engine_options), expert_impl=args.expert_impl)
        engines = start_engines(cfg, args.num_engines, cpus_per_engine=args.engine_cpus,
                                gpus_per_engine=args.gpus_per_engine)
    try:
        try:
            infos = gather([e.info.remote() for e in engines], "engines starting")
        except ray.exceptions.RayError as e:  # an engine that could not be built (a budget too small, no model)
            raise ShardFailed(f"an engine failed to start: {e}") from e
        names = [i["engine_id"] for i in infos]
        result: dict = {"model": model_dir.name, "model_dir": str(model_dir), "data": str(args.data),
                        "engines": [{k: i[k] for k in ("engine_id", "node_id", "device", "gpu_ids")} for i in infos]}
        # One call of each kind on every engine before the clock starts (the first window; a shard of 2-token
        # generations): first forwards pay CUDA context, allocator, kernel-load and graph-capture costs once per
        # process and shape, which would otherwise count against throughput.
        from pagedweight.sampling import SamplingParams

        tw = time.perf_counter()
        windows = token_windows(model_dir, text, args.ctx, args.windows) if args.mode in ("ppl", "all") else None
        warm = SamplingParams(max_tokens=2).validate()
        first = [(text[:args.prompt_chars], warm)] * args.shard
        try:
            gather([c for e in engines for c in (e.score.remote(windows[:1] if windows else [[1, 2, 3, 4]]),
                                                 e.generate_batch.remote(first))], "warm-up")
        except ray.exceptions.RayError as e:
            raise ShardFailed(f"an engine failed its warm-up calls: {e}") from e
        result["warmup_s"] = time.perf_counter() - tw
        t0 = time.perf_counter()
        if args.mode in ("ppl", "all"):
            parts, handled = run_sharded(engines, "score", windows, args.shard, "perplexity", names)
            nll, tokens = sum(p[0] for p in parts), sum(p[1] for p in parts)
            result["perplexity"] = {"ctx": args.ctx, "windows": len(windows), "tokens": tokens, "nll": nll,
                                    "ppl": math.exp(nll / tokens), "windows_per_engine": handled,
                                    "elapsed_s": time.perf_counter() - t0}
        if args.mode in ("generate", "all"):
            t1 = time.perf_counter()
            params = SamplingParams(max_tokens=args.max_tokens).validate()
            prompts = prompts_from(text, args.num_prompts, args.prompt_chars)
            parts, handled = run_sharded(engines, "generate_batch", [(p, params) for p in prompts], args.shard,
                                         "generate", names)
            outs = [o for part in parts for o in part]
            elapsed = time.perf_counter() - t1
            generated = sum(o.completion_tokens for o in outs)
            result["generation"] = {
                "prompts": len(prompts), "prompts_per_engine": handled, "max_tokens": args.max_tokens,
                "generated_tokens": generated,
                "tokens_per_s": generated / elapsed if elapsed > 0 else 0.0, "elapsed_s": elapsed,
                "finish_reasons": {r: sum(o.finish_reason == r for o in outs) for r in {o.finish_reason for o in outs}},
                "samples": [{"prompt": p, "text": o.text} for p, o in zip(prompts, outs)],
                # requests that ended with an error (their engine's step loop failed): the job reports them and fails
                "errors": [{"prompt": i, "error": o.error} for i, o in enumerate(outs) if o.finish_reason == "error"],
            }
        result["engine_stats"] = ray.get([e.stats.remote() for e in engines])
    finally:  # engines this job started end with it, also when it fails
        if own:
            try:
                ray.get([e.shutdown.remote() for e in engines], timeout=30)  # out of the planner's merge
            except Exception as e:  # noqa: BLE001 - a dead or hung engine is killed below; the job's own error, if
                print(f"engine shutdown: {type(e).__name__}: {e}", file=sys.stderr)  # any, stays the one raised
            finally:
                for e in engines:
                    ray.kill(e, no_restart=True)
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pagedweight.actors.jobs.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", help="AP checkpoint or HF model directory (on every node)")
    p.add_argument("--mode", choices=("ppl", "generate", "all"), default="all",
                   help="ppl: perplexity over token windows; generate: greedy completions of prompts; all: both")
    p.add_argument("--data", default=str(DEFAULT_DATA), help="evaluation text")
    p.add_argument("--ctx", type=int, default=512, help="perplexity window (tokens predicted per window)")
    p.add_argument("--windows", type=int, default=32, help="perplexity windows")
    p.add_argument("--num-prompts", type=int, default=16, help="generation prompts, cut evenly from the text")
    p.add_argument("--prompt-chars", type=int, default=200, help="characters of each generation prompt")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens per generation prompt")
    p.add_argument("--shard", type=int, default=2, help="items per engine call")
    p.add_argument("--num-engines", type=int, default=None,
                   help="engines (default: as many as --gpus-per-engine lets the cluster's GPUs hold; 1 without GPUs)")
    p.add_argument("--gpus-per-engine", type=float, default=1.0,
                   help="GPU share of each engine: 1 = one engine per GPU, 0.5 = two per GPU, 0 = CPU engines")
    p.add_argument("--engine-cpus", type=float, default=1.0, help="CPUs reserved per engine")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: GPU engines where the cluster has GPUs, else CPU; cuda with --num-engines: GPU engines "
                        "even while an autoscaling cluster has no GPU node yet (they bring them up)")
    p.add_argument("--expert-impl", choices=("auto", "reference"), default="auto",
                   help="auto: fused kernel on CUDA; reference: the torch twin (no kernel compile)")
    p.add_argument("--gpu-memory-budget", default=None,
                   help="per engine: bytes with unit (40GiB) or a fraction of device memory")
    p.add_argument("--engine-options", default="{}", help="JSON dict of LLM engine options")
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS / the job's cluster)")
    p.add_argument("--out", default="eval-results.json", help="results JSON (written once the job has ended)")
    return p


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what would fail or quietly count wrong after the cluster and its engines are up."""
    for name in ("ctx", "windows", "num_prompts", "prompt_chars", "max_tokens", "shard"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.num_engines is not None and args.num_engines < 1:
        parser.error(f"--num-engines {args.num_engines}: must be >= 1")
    if not 0 <= args.gpus_per_engine <= 1 or args.engine_cpus < 0:
        parser.error("--gpus-per-engine must be in [0, 1] (an engine drives one device) and --engine-cpus >= 0")
    if args.gpu_memory_budget:
        try:
            parse_budget(args.gpu_memory_budget)
        except ValueError as e:
            parser.error(f"--gpu-memory-budget: {e}")
    if not Path(args.data).is_file():
        parser.error(f"--data {args.data}: no such file")
    if args.mode != "generate" and not Path(args.model_dir).is_dir():  # the driver tokenizes the windows with it
        parser.error(f"{args.model_dir}: no such model directory (the driver reads its tokenizer)")
    try:
        check_output_file(args.out, "--out")  # checked now, not after hours of evaluation
    except ValueError as e:
        parser.error(str(e))
    try:
        engine_options_json(args.engine_options)
    except ValueError as e:
        parser.error(str(e))
    config = Path(args.model_dir) / "config.json"  # where the driver sees the model (it is on every node)
    if config.is_file() and args.mode != "generate":
        limit = json.loads(config.read_text()).get("max_position_embeddings")
        if limit is not None and args.ctx + 2 > limit:  # a window is ctx + 1 tokens, then one token is sampled
            parser.error(f"--ctx {args.ctx}: a window and its sampled token exceed the model's {limit} positions")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    try:
        ray.init(address=args.address or "auto", namespace="pagedweight", log_to_driver=False)
    except ConnectionError as e:
        parser.error(f"no Ray cluster to join: {e} (start one with `ray start --head`, or give --address / "
                     "RAY_ADDRESS)")
    try:
        result = evaluate(args)
    except ValueError as e:  # engines the cluster cannot hold, a device it lacks, a text too short for one window
        parser.error(str(e))
    except ShardFailed as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the engines it started are gone (evaluate's finally); no results file
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
    write_json(args.out, result)
    summary = {k: result[k][m] for k, m in (("perplexity", "ppl"), ("generation", "tokens_per_s")) if k in result}
    print(f"results -> {args.out}: {summary}")
    errors = result.get("generation", {}).get("errors", [])
    for e in errors:
        print(f"generation of prompt {e['prompt']} failed: {e['error']}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
