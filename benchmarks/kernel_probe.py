"""A few launches of the fused decode MoE kernel on one shape, for a profiler to attach to (ncu).

    ncu --clock-control none --kernel-name regex:_gemv --launch-skip 4 --launch-count 2 \
        --set full python -m benchmarks.kernel_probe --shape mixtral-8x7b --T 1 --bits 4

At T > 64 the call is the prefill path, whose kernel is the dequantize launch (one per expert group):

    ncu ... --kernel-name regex:_dequant_kernel ... python -m benchmarks.kernel_probe --shape qwen1.5-moe-a2.7b --T 512

No timing here: the profiler's own report (stall reasons, DRAM throughput, occupancy) is the output. The launch is
the engine's: the kernel's `lut_width` is the LUT class the engine gives a layer of that width (`runner.lut_width`),
which sets its shared memory and K splits (until session 10 the probe passed the parent width, 8: the 8-bit LUT's
shared memory and 16-word splits at every width).
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.moe_kernel_bench import P, SEED_BITS, SHAPES, routing
from pagedweight.cuda.moe_kernels import moe_forward
from pagedweight.cuda.synthetic import build_synthetic_moe
from pagedweight.runner import lut_width


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="mixtral-8x7b", choices=list(SHAPES))
    ap.add_argument("--T", type=int, default=1)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--launches", type=int, default=4, help="moe_forward calls (each launches 3 kernels)")
    args = ap.parse_args()
    E, D, F, k = SHAPES[args.shape]
    moe = build_synthetic_moe(E, D, F, P, SEED_BITS, device="cuda", seed=21, shuffle=False)
    q, poff, loff = moe.tables(torch.full((E, 2), args.bits, dtype=torch.int32))
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids, w = routing(args.T, E, k, gen)
    x = torch.randn(args.T, D, device="cuda", dtype=torch.float16)
    for _ in range(args.launches):
        moe_forward(x, ids.cuda(), w.cuda(), moe.pool_words, moe.pool_halves, q, poff, loff, D, F, P,
                    lut_width(args.bits))
    torch.cuda.synchronize()
    print("done", args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
