"""Speed of the torch reference twin on the CPU: `bitplanes.dequantize` of one expert block, and the bundled model
served by the engine through it (what `make run` and the CPU tests run: the twin dequantizes every routed block at
its committed width on every MoE call).

Rows (one CPU thread; medians):
- `dequantize`: ms per block, shapes of the bundled model's experts (gate_up [128, 256], down [256, 64]) and of
  Qwen1.5-MoE-A2.7B's ([2816, 2048], [2048, 1408]), at 3, 4 and 8 bits;
- `engine`: the bundled model converted to any precision (parent 8 bits), 8 prompts of the evaluation text, 32
  greedy tokens each, batched by the engine: generated tokens per second of wall time (prefill included).

`--old FILE` (an older pagedweight/bitplanes.py, `git show REV:pagedweight/bitplanes.py > FILE`) adds arm "old":
its unpack_planes and dequantize, in the engine too (patched where the twin calls them).

    python -m benchmarks.reference_speed --old /tmp/old_bitplanes.py --label ab
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import old_functions, write_result
from pagedweight import bitplanes
from pagedweight.cuda import reference

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"bundled gate_up": (128, 256), "bundled down": (256, 64), "qwen1.5 gate_up": (2816, 2048),
          "qwen1.5 down": (2048, 1408)}


def time_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


@contextlib.contextmanager
def twin_uses(dequantize):
    """The reference twin calls `dequantize` (bound at its import) for the duration."""
    saved = reference.dequantize
    reference.dequantize = dequantize
    try:
        yield
    finally:
        reference.dequantize = saved


def engine_tokens_per_s(dequantize, ap_dir: Path) -> float:
    from pagedweight.engine import LLM
    from pagedweight.run import load_prompts
    from pagedweight.sampling import SamplingParams

    llm = LLM(ap_dir, device="cpu")  # the default page store, as `make run`'s
    prompts = load_prompts(None, 8)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    with twin_uses(dequantize):
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
    return sum(o.completion_tokens for o in outs) / elapsed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", default=None, metavar="FILE", help="an older bitplanes.py: arm 'old'")
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "pagedweight"))
    p.add_argument("--no-engine", action="store_true", help="only the dequantize rows")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--label", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    arms = {"new": bitplanes.dequantize}
    if args.old:
        old = old_functions(args.old, ["unpack_planes", "dequantize"], vars(bitplanes))
        arms = {"old": old["dequantize"], **arms}
    rows = []
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        idx = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen)
        planes = bitplanes.pack_planes(idx, 8)
        for b in (3, 4, 8):
            lut = torch.randn(1 << b, n, generator=gen).half()
            want = None
            for arm, deq in arms.items():
                got = deq(planes, lut, b, k)
                want = got if want is None else want
                assert torch.equal(got, want), f"arms disagree on {name} at {b} bits"
                reps = 200 if n * k < 1 << 16 else 5
                rows.append({"what": "dequantize", "arm": arm, "block": name, "rows": n, "cols": k, "bits": b,
                             "ms_median": round(time_ms(lambda: deq(planes, lut, b, k), reps), 4)})
                print(rows[-1], flush=True)
    if not args.no_engine:
        from pagedweight.convert import ap_checkpoint_for

        ap_dir = ap_checkpoint_for(ROOT / "models" / "pw-tiny-moe", Path(args.cache_dir), "cpu")
        for arm, deq in arms.items():
            rows.append({"what": "engine", "arm": arm, "prompts": 8, "max_tokens": 32,
                         "tokens_per_s": round(engine_tokens_per_s(deq, ap_dir), 2)})
            print(rows[-1], flush=True)
    write_result("reference_speed", rows, out_dir=args.out_dir, label=args.label)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
