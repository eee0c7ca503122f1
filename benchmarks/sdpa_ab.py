"""`models.layers.sdpa` (this tree) against an older layers.py's (--old FILE, e.g. `git show
e59beab:pagedweight/models/layers.py`), on the attention calls the engine makes on CUDA in fp16, with cuDNN's SDPA
off as the engine has it (runner.py), the arms alternating in one process: GPU time (CUDA events over 5 back-to-back
calls, median of the reps), the peak of allocated memory a call adds (what the caching allocator must find room for
beside the KV pages), and how far apart the two arms' outputs are.

Cases (name: q heads / KV heads x head size; rows, new queries, keys), q, K and V laid out as the engine hands them:
- decode rows under a length mask (the gather path of grouped heads): Qwen3-30B-A3B's 32/4 x 128 at 4 rows of 2,064
  keys and 32 of 4,096, the bundled model's 4/2 x 64 at 32 rows of 1,024;
- a prefill chunk of 512 queries after its context (the causal mask aligned to the end): 32/4 over 2,016, 8,192 and
  32,768 keys, the bundled model's over 1,024, and Qwen1.5's equal heads (16 x 128) over 8,192.

    python -m benchmarks.sdpa_ab --old /tmp/old_layers.py [--reps 10]
"""
from __future__ import annotations

import argparse
import statistics

import torch

import pagedweight.models.layers as layers
from benchmarks.common import old_functions, write_result

CASES = {  # name: (b, h, hkv, hd, t, s, masked)
    "decode-32x4-b4-s2064": (4, 32, 4, 128, 1, 2064, True),
    "decode-32x4-b32-s4096": (32, 32, 4, 128, 1, 4096, True),
    "decode-4x2-b32-s1024": (32, 4, 2, 64, 1, 1024, True),
    "chunk-32x4-t512-s2016": (1, 32, 4, 128, 512, 2016, False),
    "chunk-32x4-t512-s8192": (1, 32, 4, 128, 512, 8192, False),
    "chunk-32x4-t512-s32768": (1, 32, 4, 128, 512, 32768, False),
    "chunk-4x2-t512-s1024": (1, 4, 2, 64, 512, 1024, False),
    "chunk-16x16-t512-s8192": (1, 16, 16, 128, 512, 8192, False),
}
SMOKE = {"decode-4x2-b3-s40": (3, 4, 2, 16, 1, 40, True), "chunk-4x2-t8-s40": (1, 4, 2, 16, 8, 40, False)}


def inputs(b: int, h: int, hkv: int, hd: int, t: int, s: int, masked: bool, gen: torch.Generator):
    """q, k, v as the engine hands them (fp16): a chunk's q a view of the [T, H, hd] projection, its K/V views of
    the gathered [S, 2, Hkv, hd] context; decode rows' q [B, H, 1, hd] and K/V each a gathered [B, S, Hkv, hd]
    (kv_cache.py); the mask (decode: [B, 1, 1, S] bool of random lengths; chunk: None)."""
    dev = gen.device
    if masked:
        q = torch.randn(b, h, hd, generator=gen, device=dev).half()[:, :, None]
        k, v = (torch.randn(b, s, hkv, hd, generator=gen, device=dev).half().transpose(1, 2) for _ in range(2))
        lengths = torch.randint(1, s + 1, (b,), generator=gen, device=dev)
        mask = (torch.arange(s, device=dev)[None, :] < lengths[:, None])[:, None, None, :]
    else:
        q = torch.randn(t, h, hd, generator=gen, device=dev).half().permute(1, 0, 2)[None]
        kv = torch.randn(s, 2, hkv, hd, generator=gen, device=dev).half().permute(1, 2, 0, 3)  # [2, Hkv, S, hd]
        k, v, mask = kv[0:1], kv[1:2], None
    return q, k, v, mask


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True, metavar="FILE", help="a layers.py whose sdpa is the old arm")
    p.add_argument("--cases", default=None, help=f"comma-separated, of {list(CASES)} (default: all; on the CPU the "
                   f"smoke cases {list(SMOKE)})")
    p.add_argument("--device", default="cuda", help="cuda; cpu only checks that the script runs (no times, peaks)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--label", default=None)
    args = p.parse_args(argv)
    arms = {"old": old_functions(args.old, ["sdpa"], vars(layers))["sdpa"], "new": layers.sdpa}
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.backends.cuda.enable_cudnn_sdp(False)  # as the engine's runner has it
    cases = {**CASES, **SMOKE}
    gen = torch.Generator(device=args.device).manual_seed(5)
    extra = {"dtype": "float16", "cudnn_sdp": False if cuda else None, "old": args.old}
    rows = []
    for name in (args.cases or ",".join(CASES if cuda else SMOKE)).split(","):
        b, h, hkv, hd, t, s, masked = cases[name]
        q, k, v, mask = inputs(b, h, hkv, hd, t, s, masked, gen)
        scale = hd ** -0.5
        outs, peak, times = {}, {}, {a: [] for a in arms}
        for arm, fn in arms.items():  # the peak a call adds, from a settled allocator
            if not cuda:
                outs[arm], peak[arm] = fn(q, k, v, mask, scale), None
                continue
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            outs[arm] = fn(q, k, v, mask, scale)
            torch.cuda.synchronize()
            peak[arm] = (torch.cuda.max_memory_allocated() - base) / 2**20
        for rep in range(-1, args.reps if cuda else -1):  # rep -1 warms both arms up
            for arm in (list(arms) if rep % 2 == 0 else list(arms)[::-1]):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(5):
                    arms[arm](q, k, v, mask, scale)
                end.record()
                torch.cuda.synchronize()
                if rep >= 0:
                    times[arm].append(start.elapsed_time(end) * 1e3 / 5)
        rel = float((outs["new"].float() - outs["old"].float()).norm() / outs["old"].float().norm())
        row = dict(case=name, b=b, h=h, hkv=hkv, head_dim=hd, t=t, s=s, masked=masked, rel_new_vs_old=rel,
                   **{f"{a}_us_median": statistics.median(v) if v else None for a, v in times.items()},
                   **{f"{a}_peak_added_mib": v for a, v in peak.items()})
        print({key: round(v, 4) if isinstance(v, float) else v for key, v in row.items()}, flush=True)
        rows.append(row)
        write_result("sdpa_ab", rows, extra=dict(extra, complete=False), label=args.label)
    write_result("sdpa_ab", rows, extra=dict(extra, complete=True), label=args.label)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
