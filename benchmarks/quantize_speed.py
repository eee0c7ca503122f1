"""Conversion speed of the expert blocks of a Qwen1.5-MoE-A2.7B-shaped random model (24 x 60 experts,
D=2048, F=1408): seed k-means + upscaling + packing on the GPU, the planes file written to local disk.

Run standalone: `python benchmarks/quantize_speed.py` (the H200), or a CPU check:
`python benchmarks/quantize_speed.py --layers 1 --experts 2 --device cpu`.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # standalone run from a plain checkout

from benchmarks.common import write_result  # noqa: E402
from pagedweight.apformat import APWriter, load_ap  # noqa: E402
from pagedweight.convert import quantize_layer  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--experts", type=int, default=60)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=1408)
    ap.add_argument("--seed-bits", type=int, default=3)
    ap.add_argument("--parent-bits", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-weights", type=int, default=None,
                    help="weights per quantizer call (default 2^27 on cuda, 2^23 on cpu)")
    ap.add_argument("--work-dir", default=None, help="where the planes file goes (default: a temp dir, removed after)")
    args = ap.parse_args()
    device = torch.device(args.device)
    batch = args.batch_weights or (1 << 27 if device.type == "cuda" else 1 << 23)
    torch.manual_seed(0)
    L, E, D, Fi = args.layers, args.experts, args.hidden, args.inter
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="pw-qspeed-"))
    hf = {"model_type": "qwen2_moe", "hidden_size": D, "moe_intermediate_size": Fi, "num_hidden_layers": L,
          "num_experts": E}
    writer = APWriter(work, hf, "qwen2_moe", L, E, args.seed_bits, args.parent_bits)
    quant_s = write_s = 0.0
    rows: list[dict] = []

    def save(complete: bool = False):
        """Rewrite the JSON with every row so far (one per layer, then the total): a cut run keeps its layers."""
        return write_result("quantize_speed", rows, extra={"complete": complete})

    t_start = time.perf_counter()
    for l in range(L):
        gate_up = torch.randn(E, 2 * Fi, D, device=device) * 0.02
        down = torch.randn(E, D, Fi, device=device) * 0.02
        # activation-style sensitivity: one heavy-tailed value per input column and expert
        sens = {"gate_up": torch.randn(E, D, device=device) ** 2, "down": torch.randn(E, Fi, device=device) ** 2}
        if device.type == "cuda":
            torch.cuda.synchronize()
        q, w = quantize_layer(writer, l, gate_up, down, lambda e, kind: sens[kind][e], device, batch)
        quant_s, write_s = quant_s + q, write_s + w
        print(f"layer {l + 1}/{L}: quantize {q:.1f} s, write {w:.1f} s", flush=True)
        rows.append({"section": "layer", "layer": l, "quantize_s": round(q, 2), "write_s": round(w, 2)})
        save()
    writer.finish(np.full((L, E), 1.0 / E), {}, None)
    total_s = time.perf_counter() - t_start
    planes_bytes = load_ap(work, verify=False).planes_file.stat().st_size
    if args.work_dir is None:
        shutil.rmtree(work)
    weights = L * E * 3 * Fi * D
    row = {"section": "total", "layers": L, "experts": E, "hidden": D, "inter": Fi, "seed_bits": args.seed_bits,
           "parent_bits": args.parent_bits, "device": str(device), "weights": weights,
           "batch_weights": batch, "quantize_s": round(quant_s, 2), "write_s": round(write_s, 2),
           "total_s": round(total_s, 2), "total_min": round(total_s / 60, 3),
           "quantize_ns_per_weight": round(quant_s / weights * 1e9, 2), "planes_bin_bytes": planes_bytes,
           "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None}
    print(row)
    rows.append(row)
    print(save(complete=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
