"""Perplexity of the bundled model on data/eval.txt at FP16 and at uniform 3, 4, 5, 6, 8 bits (AP checkpoint).

Also times the conversion of the bundled model on this machine (the issue asks < 2 min on 2 CPU cores).
Checks: perplexity falls monotonically with width and 8 bits are within 1% of FP16 (exit status 1 if not).
`python benchmarks/quality_uniform.py` (CPU is enough: the bundled model is small).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # standalone run from a plain checkout

from benchmarks.common import write_result  # noqa: E402
from pagedweight.apformat import load_ap_model  # noqa: E402
from pagedweight.convert import convert  # noqa: E402
from pagedweight.models import load_model  # noqa: E402
from pagedweight.train import evaluate_text  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "pw-tiny-moe")
    ap.add_argument("--eval", type=Path, default=ROOT / "data" / "eval.txt")
    ap.add_argument("--calib", type=Path, default=ROOT / "data" / "calib.txt")
    ap.add_argument("--sensitivity", choices=("fisher", "activation"), nargs="+", default=["fisher", "activation"],
                    help="one AP checkpoint (and one set of rows) per sensitivity")
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--widths", type=int, nargs="+", default=[3, 4, 5, 6, 8])
    ap.add_argument("--context", type=int, default=1024, help="evaluation window in tokens")
    ap.add_argument("--max-eval-bytes", type=int, default=None)
    ap.add_argument("--work-dir", type=Path, default=None,
                    help="parent of the AP checkpoint dirs, one per sensitivity (default: a temp dir)")
    args = ap.parse_args()
    from tokenizers import Tokenizer

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="pw-quality-"))
    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    text = args.eval.read_text()[:args.max_eval_bytes]
    common = {"model": args.model.name, "slice": args.eval.name, "context": args.context}

    def ppl_row(model, label: str, bits: int, sensitivity: str | None) -> dict:
        with torch.no_grad():
            r = evaluate_text(model, tok, text, args.context, "cpu")
        row = {**common, "sensitivity": sensitivity, "weights": label, "bits": bits, "ppl": round(r["ppl"], 5),
               "bits_per_byte": round(r["bits_per_byte"], 5), "tokens": r["tokens"]}
        print(row, flush=True)
        return row

    source = load_model(args.model)
    with torch.no_grad():
        for layer in source.layers:  # FP16 experts: the unquantized serving baseline
            layer.mlp.experts.gate_up.copy_(layer.mlp.experts.gate_up.half().float())
            layer.mlp.experts.down.copy_(layer.mlp.experts.down.half().float())
    fp16 = ppl_row(source, "fp16", 16, None)
    rows, checks = [fp16], {}
    for kind in args.sensitivity:
        t0 = time.perf_counter()
        convert(args.model, work / kind, args.calib, sensitivity=kind, num_seqs=args.num_seqs,
                seq_len=args.seq_len, device="cpu")
        convert_s = time.perf_counter() - t0
        ap_rows = [ppl_row(load_ap_model(work / kind, b), f"ap-{b}bit", b, kind) for b in sorted(args.widths)]
        ppls = [r["ppl"] for r in ap_rows] + [fp16["ppl"]]
        top = ap_rows[-1]
        checks[kind] = {"ppl_monotone_in_bits": all(a > b for a, b in zip(ppls, ppls[1:])),
                        "ppl_8bit_within_1pct_of_fp16": top["bits"] < 8 or abs(top["ppl"] / fp16["ppl"] - 1) <= 0.01}
        rows += ap_rows + [{**common, "sensitivity": kind, "weights": "convert", "convert_s": round(convert_s, 2),
                            "torch_threads": torch.get_num_threads()}]
    path = write_result("quality_uniform", rows, extra={"checks": checks})
    print(path, checks)
    return 0 if all(all(c.values()) for c in checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
