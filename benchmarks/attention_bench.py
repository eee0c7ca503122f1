"""Decode attention alone: the paged decode attention kernel against the engine's torch path (gather + SDPA).

One query per row against `ctx` keys in pool pages laid out as the engine lays them out (pages of PAGE_ALIGN-rounded
bytes, each row's blocks scattered over the pool). On CUDA each method is captured in a CUDA graph and replayed, so
the time per call is device time (CUDA events over the replays), not Numba's host launch cost; the row carries the
K/V bytes a call must read and the rate that implies. Every row also gives the largest difference to the float32
torch twin. On the CPU only the torch path runs (the kernel needs CUDA): a check that the script works. cuDNN's SDPA
is off, as the engine's runner has it (before session 24 it was on here, and grouped heads' SDPA rows timed cuDNN,
which takes their mask, where the engine then ran the math kernel).

    python -m benchmarks.attention_bench                      # H200: Qwen1.5 and GQA shapes, batch 1-16, 512-8192 keys
    python -m benchmarks.attention_bench --device cpu --quick
    git show REV:cuda/attention_kernels.py > /tmp/old.py    # A/B: FILE's kernel as the arm "kernel-old"
    python -m benchmarks.attention_bench --arm old=/tmp/old.py
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time

import torch

from benchmarks.common import write_result
from pagedweight.cuda.reference import paged_decode_attention_reference
from pagedweight.engine import round_up
from pagedweight.kv_cache import gathered_decode_attention
from pagedweight.pool import PAGE_ALIGN

SHAPES = {  # name: (query heads, KV heads, head dim)
    "qwen1.5-moe": (16, 16, 128),
    "gqa-32x4": (32, 4, 128),  # 8 query heads per KV head (Qwen3-MoE-30B-A3B)
    "gqa-32x8": (32, 8, 128),  # 4 (Mixtral-8x7B)
    "gqa-16x8": (16, 8, 128),  # 2
    "pw-tiny-moe": (4, 2, 64),
}


def build(heads: int, kv_heads: int, head_dim: int, batch: int, ctx: int, block_size: int, device: str,
          dtype: torch.dtype, seed: int = 0) -> tuple:
    """q [B, H, hd], the pool view [blocks, 2, bs, Hkv, hd], tables [B, M], lengths [B] (= ctx) and the length mask."""
    g = torch.Generator(device=device).manual_seed(seed)
    m = -(-ctx // block_size)
    layer = 2 * block_size * kv_heads * head_dim
    row = round_up(layer * torch.empty((), dtype=dtype).element_size(), PAGE_ALIGN) // torch.empty(
        (), dtype=dtype).element_size()
    blocks = batch * m + 7
    rows = torch.randn(blocks, row, generator=g, device=device).to(dtype)
    view = rows[:, :layer].view(blocks, 2, block_size, kv_heads, head_dim)
    tables = torch.randperm(blocks, generator=g, device=device)[:batch * m].view(batch, m)
    lengths = torch.full((batch,), ctx, dtype=torch.long, device=device)
    mask = (torch.arange(m * block_size, device=device)[None, :] < lengths[:, None])[:, None, None, :]
    q = torch.randn(batch, heads, head_dim, generator=g, device=device).to(dtype)
    return q, view, tables, lengths, mask


def device_us(fn, iters: int) -> float:
    """Device time per call of fn (captured in a CUDA graph, replayed `iters` times between two events)."""
    fn()  # compiles / warms outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def host_us(fn, iters: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e6 / iters


def arm_kernel(name: str, path: str):
    """`paged_decode_attention` of another copy of cuda/attention_kernels.py, imported whole as a module of
    pagedweight.cuda (its relative imports resolve there; its kernels compile apart from the current ones)."""
    spec = importlib.util.spec_from_file_location(f"pagedweight.cuda._attention_arm_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.paged_decode_attention


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {sorted(SHAPES)}")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--contexts", default="512,2048,8192")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--quick", action="store_true", help="one small shape, batch 1, 64 keys (CPU check)")
    p.add_argument("--arm", action="append", default=[], metavar="NAME=FILE",
                   help="also time FILE's kernel (another attention_kernels.py) as method kernel-NAME (CUDA only)")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--label", default=None)
    args = p.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        p.error(f"unknown shapes {unknown}; known: {sorted(SHAPES)}")
    batches, contexts = [int(x) for x in args.batches.split(",")], [int(x) for x in args.contexts.split(",")]
    if args.quick:
        shapes, batches, contexts = ["pw-tiny-moe"], [1], [64]
    cuda = args.device == "cuda"
    if args.arm and not cuda:
        p.error("--arm times kernels: CUDA only")
    dtype = torch.float16 if cuda else torch.float32
    methods = {"sdpa": None}
    if cuda:
        torch.backends.cuda.enable_cudnn_sdp(False)  # as the engine's runner has it
        from pagedweight.cuda.attention_kernels import paged_decode_attention
        methods = {"kernel": paged_decode_attention, "sdpa": None}
        for arm in args.arm:
            name, sep, path = arm.partition("=")
            if not sep:
                p.error(f"--arm takes NAME=FILE, got {arm!r}")
            methods[f"kernel-{name}"] = arm_kernel(name, path)
    rows: list[dict] = []
    for shape in shapes:
        heads, kv_heads, hd = SHAPES[shape]
        for batch in batches:
            for ctx in contexts:
                q, view, tables, lengths, mask = build(heads, kv_heads, hd, batch, ctx, args.block_size, args.device,
                                                       dtype)
                scale = hd ** -0.5
                want = paged_decode_attention_reference(q, view, tables, lengths, scale).float()
                kv_bytes = 2 * batch * ctx * kv_heads * hd * view.element_size()
                for name, kernel in methods.items():
                    if kernel is not None:
                        call = lambda: kernel(q, view, tables, lengths, scale)  # noqa: E731
                    else:
                        call = lambda: gathered_decode_attention(q[:, :, None], view, tables, mask, scale)[:, :, 0]  # noqa: E731
                    err = (call().float() - want).abs().max().item()
                    us = device_us(call, args.iters) if cuda else host_us(call, args.iters)
                    row = {"shape": shape, "method": name, "batch": batch, "context": ctx, "heads": heads,
                           "kv_heads": kv_heads, "head_dim": hd, "us_per_call": us,
                           "time_kind": "device (CUDA graph replays)" if cuda else "host wall (CPU)",
                           "kv_bytes": kv_bytes, "kv_gb_per_s": kv_bytes / us / 1e3, "max_abs_err_vs_twin": err}
                    print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, file=sys.stderr)
                    rows.append(row)
    print(write_result("attention_bench", rows, out_dir=args.out_dir, label=args.label,
                       extra={"dtype": str(dtype), "block_size": args.block_size, "iters": args.iters,
                              "arms": args.arm, "cudnn_sdp": False if cuda else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
