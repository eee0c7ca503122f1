"""Cluster evaluation job: perplexity and/or greedy generation spread over every engine of the cluster.

    ray job submit -- python -m pagedweight.actors.jobs.evaluate MODEL_DIR \\
        --mode all --out eval.json                       # one engine per GPU (pagedweight installed on every node)
    ... --num-engines 4 --gpus-per-engine 0.5             # two engines share each of 2 GPUs
    RAY_ADDRESS=... python -m pagedweight.actors.jobs.evaluate MODEL_DIR --num-engines 2   # CPU cluster

The driver tokenizes the text into fixed windows (perplexity) or cuts prompts (generation), deals
them out to the engines in small shards and collects them as they finish (tqdm shows progress), then
writes one results JSON. Perplexity = exp(total NLL / total scored tokens) over all windows, the
same number whatever the number of engines.
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


def run_sharded(engines: list, method: str, items: list, shard: int, desc: str) -> tuple[list, list[int]]:
    """Call engine.<method>(shard) over `items`, keeping every engine busy.

    Returns the per-shard results in item order and how many items each engine handled."""
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
            results[start // shard] = ray.get(done[0])
            handled[engine] += n
            idle.append(engine)
            bar.update(n)
    return results, handled


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
        infos = ray.get([e.info.remote() for e in engines])
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
        ray.get([c for e in engines for c in (e.score.remote(windows[:1] if windows else [[1, 2, 3, 4]]),
                                              e.generate_batch.remote(first))])
        result["warmup_s"] = time.perf_counter() - tw
        t0 = time.perf_counter()
        if args.mode in ("ppl", "all"):
            parts, handled = run_sharded(engines, "score", windows, args.shard, "perplexity")
            nll, tokens = sum(p[0] for p in parts), sum(p[1] for p in parts)
            result["perplexity"] = {"ctx": args.ctx, "windows": len(windows), "tokens": tokens, "nll": nll,
                                    "ppl": math.exp(nll / tokens), "windows_per_engine": handled,
                                    "elapsed_s": time.perf_counter() - t0}
        if args.mode in ("generate", "all"):
            t1 = time.perf_counter()
            params = SamplingParams(max_tokens=args.max_tokens).validate()
            prompts = prompts_from(text, args.num_prompts, args.prompt_chars)
            parts, handled = run_sharded(engines, "generate_batch", [(p, params) for p in prompts], args.shard,
                                         "generate")
            outs = [o for part in parts for o in part]
            elapsed = time.perf_counter() - t1
            generated = sum(o.completion_tokens for o in outs)
            result["generation"] = {
                "prompts": len(prompts), "prompts_per_engine": handled, "max_tokens": args.max_tokens,
                "generated_tokens": generated,
                "tokens_per_s": generated / elapsed if elapsed > 0 else 0.0, "elapsed_s": elapsed,
                "finish_reasons": {r: sum(o.finish_reason == r for o in outs) for r in {o.finish_reason for o in outs}},
                "samples": [{"prompt": p, "text": o.text} for p, o in zip(prompts, outs)],
            }
        result["engine_stats"] = ray.get([e.stats.remote() for e in engines])
    finally:  # engines this job started end with it, also when it fails
        if own:
            try:
                ray.get([e.shutdown.remote() for e in engines], timeout=30)  # out of the planner's merge
            finally:
                for e in engines:
                    ray.kill(e, no_restart=True)
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pagedweight.actors.jobs.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", help="AP checkpoint or HF model directory (on every node)")
    p.add_argument("--mode", choices=("ppl", "generate", "all"), default="all")
    p.add_argument("--data", default=str(DEFAULT_DATA), help="evaluation text")
    p.add_argument("--ctx", type=int, default=512, help="perplexity window (tokens predicted per window)")
    p.add_argument("--windows", type=int, default=32, help="perplexity windows")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-chars", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=32)
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
    p.add_argument("--out", default="eval-results.json")
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
    ray.init(address=args.address or "auto", namespace="pagedweight", log_to_driver=False)
    result = evaluate(args)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    summary = {k: result[k][m] for k, m in (("perplexity", "ppl"), ("generation", "tokens_per_s")) if k in result}
    print(f"results -> {args.out}: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
