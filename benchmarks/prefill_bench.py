"""Prefill cost at the layer and engine level, optionally A/B against an older prefill: the arms alternate in one
process (ABBA...), so that the host's drift, which moved prefill times by up to 1.9x between runs of the same code
(README), lands on both.

    git show <rev>:cuda/moe_kernels.py > _ab/old_moe_kernels.py
    python3 -m benchmarks.prefill_bench --old _ab/old_moe_kernels.py --label L        # on the H200

Layer (Qwen1.5-MoE expert shapes, synthetic planes at 4 bits, fp16): one routed-expert prefill call
(`prefill.prefill_forward`) at T tokens: GPU time per call (CUDA events over back-to-back calls) and host time (from an
idle GPU until the call returns). Engine (engine_bench's random Qwen1.5-shaped model, fp16 dense experts and uniform
4-bit experts, 512-token chunks): the time until every request of a batch of 2016-token prompts has its first token.
`--old FILE`: the "old" arm runs FILE's `_prefill` (an older moe_kernels.py, before the prefill moved to
cuda/prefill.py; loaded into the two modules' namespace; `--old-names`: with
FILE's versions of those helpers too); `--old-parent-width`: given the parent width where the new arm gets the
runner's LUT width (4 bits: `runner.lut_width`), as the revisions before 2badfdb passed it. At the layer level each
arm that takes them has its own `PrefillBuffers`, as an engine's layers share one, and the rows carry how far each
arm's output is from the old arm's first (the old arm's own: run to run). Both arms run the same dense experts
(session 16's A/B, prefill_bench-nvidia-h200-20261130-s16-prefill-ab.json, also swapped the dense experts' loop: that
file records it).
"""
from __future__ import annotations

import argparse
import cProfile
import inspect
import pstats
import statistics
import sys
import time

import torch

import pagedweight.cuda.moe_kernels as mk
import pagedweight.cuda.prefill as pf
from benchmarks import engine_bench as eb
from benchmarks.common import old_functions, write_result
from benchmarks.moe_kernel_bench import SHAPES, routing
from pagedweight.cuda.synthetic import build_synthetic_moe
from pagedweight.runner import lut_width as lut_class

PROMPT, GEN = 2016, 2  # engine_bench's prompt (2048 - 32 generated) and the fewest tokens that finish after a decode


def load_old(path: str, names: list[str], parent_width: bool) -> dict:
    """The arms' `_prefill`: FILE's (`old_functions`: with FILE's `names` too) and the current one. The old arm takes
    the current call's arguments: the parent width in place of the LUT width when `parent_width`, no buffers when
    FILE's `_prefill` takes none (before 917ff2d)."""
    old = old_functions(path, ["_prefill", *names], {**vars(mk), **vars(pf)})["_prefill"]
    takes_buffers = "buffers" in inspect.signature(old).parameters

    def old_arm(*args):
        head, buffers = args[:11], args[11:]  # hidden ... lut_width, then the buffers when given
        if parent_width:
            head = head[:-1] + (PARENT_BITS[0],)
        return old(*head, *(buffers if takes_buffers else ()))
    return {"old": old_arm, "new": pf.prefill_forward}


PARENT_BITS = [8]  # of the planes the running level reads (the old arm sizes its LUT by it)


def use(arms: dict, arm: str) -> None:
    pf.prefill_forward = arms[arm]  # moe_forward looks it up at each prefill call


def skewed_routing(T: int, E: int, k: int, skew: float, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing whose experts' popularity falls as (rank + 1) ** -skew, ranks shuffled: each token's k experts
    drawn without replacement in proportion (Gumbel top-k); 0 = moe_kernel_bench's uniform routing. The engine's
    random Qwen1.5-shaped model routes unevenly (its deeper layers' chunks to a few dozen experts); a skew of 2.5
    routes a 512-token call to 38-47 of the 60 experts, padded to 1.9-2.0x the pairs in groups of 7 (20 draws)."""
    if skew == 0:
        return routing(T, E, k, gen)
    pop = (torch.arange(E, device="cuda") + 1.0).pow(-skew)[torch.randperm(E, generator=gen, device="cuda")]
    u = torch.rand(T, E, generator=gen, device="cuda").clamp_min(1e-20)
    _, ids = (pop.log() - (-u.log()).log()).topk(k, dim=1)
    return ids.to(torch.int32), torch.softmax(torch.rand(T, k, generator=gen, device="cuda") * 4, dim=1)


def layer_rows(arms: dict, tokens: list[int], reps: int, profile: str | None = None, skew: float = 0.0
               ) -> list[dict]:
    E, D, F, k = SHAPES["qwen1.5-moe-a2.7b"]
    moe = build_synthetic_moe(E, D, F, 8, 3, device="cuda", seed=21, shuffle=False)
    q, po, lo = moe.tables(torch.full((E, 2), 4))
    gen = torch.Generator(device="cuda").manual_seed(9)
    rows, buffers = [], {a: pf.PrefillBuffers() for a in arms}
    for T in tokens:
        ids, w = skewed_routing(T, E, k, skew, gen)
        h = torch.randn(T, D, generator=gen, device="cuda").half()
        PARENT_BITS[0] = 8
        args = (h, ids, w, moe.pool_words, moe.pool_halves, q, po, lo, D, F, lut_class(4))  # as the runner passes
        calls = {a: lambda a=a: arms[a](*args, buffers[a]) for a in arms}
        base = calls["old" if "old" in arms else "new"]()
        rel = {a: float((calls[a]().float() - base.float()).norm() / base.float().norm()) for a in arms}
        samples: dict[str, dict[str, list[float]]] = {a: {"gpu": [], "host": []} for a in arms}
        for rep in range(-1, reps):  # rep -1 warms both arms up (allocator, compile)
            for arm in (list(arms) if rep % 2 == 0 else list(arms)[::-1]):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                for _ in range(5):
                    calls[arm]()
                end.record()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                calls[arm]()
                host = (time.perf_counter() - t0) * 1e6
                torch.cuda.synchronize()
                if rep >= 0:
                    samples[arm]["gpu"].append(start.elapsed_time(end) * 1e3 / 5)
                    samples[arm]["host"].append(host)
        if profile and T == tokens[0]:  # where the new arm's host time goes (cProfile slows it: not a timing)
            prof = cProfile.Profile()
            torch.cuda.synchronize()
            prof.runcall(lambda: [calls["new"]() for _ in range(20)])
            with open(profile, "w") as f:
                f.write(f"# cProfile of 20 calls of _prefill, qwen1.5-moe-a2.7b T={T} fp16 4 bits, by tottime\n")
                pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(30)
        for arm, s in samples.items():
            rows.append(dict(level="layer", arm=arm, shape="qwen1.5-moe-a2.7b", T=T, skew=skew, bits=4, dtype="float16",
                             us_per_call_back_to_back=statistics.median(s["gpu"]),
                             host_us_per_call=statistics.median(s["host"]), rel_vs_old=rel[arm],
                             buffers_mib=buffers[arm].data.numel() / 2**20 if buffers[arm].data is not None else None,
                             samples=s))
            print(rows[-1]["arm"], T, round(rows[-1]["us_per_call_back_to_back"]),
                  round(rows[-1]["host_us_per_call"]), flush=True)
    return rows


def engine_rows(arms: dict, batches: list[int], reps: int) -> list[dict]:
    ns = argparse.Namespace(device="cuda", block_size=16, decode_attention="kernel", layer_kernels=True, chunk=512)
    cfg = eb.model_config(False)
    dtype = torch.float16
    page = eb.page_bytes(cfg, ns.block_size, dtype)
    outside = eb.outside_bytes(cfg, dtype, ns.device)
    PARENT_BITS[0] = 6
    weights = eb.ap_weights(cfg, PARENT_BITS[0])
    dense = cfg.num_hidden_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
    rows = []
    for batch in batches:
        kv = eb.kv_bytes(cfg, batch, PROMPT + GEN, ns.block_size, page, ns.chunk)
        for name, w, budget, options in (
                ("fp16-dense", None, outside + dense + kv, {}),
                ("ap4-uniform", weights, outside + eb.expert_pool_bytes(weights, 4, page) + kv,
                 dict(bits=4, paging=False))):
            use(arms, "new")
            model, llm = eb.warm_engine(name, cfg, w, budget, batch, PROMPT + GEN, GEN, ns, **options)
            ttft: dict[str, list[float]] = {a: [] for a in arms}
            for rep in range(-1, reps):
                for arm in (list(arms) if rep % 2 == 0 else list(arms)[::-1]):
                    use(arms, arm)
                    res = eb.serve(llm, batch, PROMPT, GEN, cfg.vocab_size, seed=2 + rep)
                    if rep >= 0:
                        ttft[arm].append(res["prefill_ms"])
            for arm, v in ttft.items():
                rows.append(dict(level="engine", arm=arm, config=name, batch=batch, prompt_tokens=PROMPT,
                                 chunk=ns.chunk, prefill_ms_median=statistics.median(v), prefill_ms=v))
                print(name, batch, arm, [round(x) for x in v], flush=True)
            del model, llm
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", default=None, metavar="FILE", help="an older moe_kernels.py whose _prefill is the A arm")
    p.add_argument("--old-names", default="", help="comma list: FILE's functions or classes the A arm also takes "
                   "(e.g. _dequantizer,_PreparedLaunch)")
    p.add_argument("--old-parent-width", action="store_true",
                   help="FILE's _prefill takes the parent width where the current takes the LUT width (before 2badfdb)")
    p.add_argument("--tokens", default="512,2048", help="layer level: tokens per call")
    p.add_argument("--skew", type=float, default=0.0, help="layer level: routing skew (`skewed_routing`; 0 = uniform)")
    p.add_argument("--batches", default="1,4", help="engine level: prompts per batch")
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--profile", default=None, metavar="FILE", help="cProfile of the new arm's layer call (first T)")
    p.add_argument("--label", default=None)
    args = p.parse_args(argv)
    arms = load_old(args.old, [n for n in args.old_names.split(",") if n], args.old_parent_width) if args.old \
        else {"new": pf.prefill_forward}
    rows = layer_rows(arms, [int(t) for t in args.tokens.split(",")], args.reps, args.profile, args.skew)
    extra = {"old_file": args.old, "old_names": args.old_names, "old_parent_width": args.old_parent_width,
             "complete": False}
    write_result("prefill_bench", rows, label=args.label, extra=extra)
    if not args.skip_engine:
        rows += engine_rows(arms, [int(b) for b in args.batches.split(",")], args.reps)
    extra["complete"] = True
    print(write_result("prefill_bench", rows, label=args.label, extra=extra))
    return 0


if __name__ == "__main__":
    sys.exit(main())
