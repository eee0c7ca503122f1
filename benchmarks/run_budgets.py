"""The README's main job (`pagedweight run`) at a range of budgets, one process per run so that each run's peak
reserved memory is its own: the figures behind `make run`'s default budget (widths must drop while the prompts run
and come back once idle, every request must finish, the process's peak must stay within the budget).

    python -m benchmarks.run_budgets --device cuda --budgets 118MiB,126MiB,134MiB --repeats 2 --label s26

Every row is the run's `--summary-json` (pagedweight.run: which figures are measured, which computed) plus
its budget, repeat, exit status and logged warnings (the start-up profile says when it peaked above the budget); a
refused budget keeps its error's last line.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import write_result

ROOT = Path(__file__).resolve().parent.parent


def run_once(args, budget: str, summary: Path) -> dict:
    cmd = [sys.executable, "-m", "pagedweight.cli", "run", "--model", args.model, "--gpu-memory-budget", budget,
           "--device", args.device, "--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens),
           "--show", "0", "--summary-json", str(summary)]
    if args.page_store_dir:
        cmd += ["--page-store-dir", args.page_store_dir]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=args.timeout_s)
    row = {"budget": budget, "rc": proc.returncode,
           # e.g. "activation reserve: the profile peaked X MiB above the budget at start-up (measured)"
           "warnings": [ln.split(" - ", 1)[-1] for ln in proc.stderr.splitlines() if "| WARNING" in ln]}
    if summary.is_file():
        row.update(json.loads(summary.read_text()))
        if row.get("mean_width_min") is not None:
            row["widths_dropped"] = row["mean_width_min"] < row["mean_width_start"]
            row["widths_returned"] = row["mean_width_idle"] == row["mean_width_start"]
        if row["device_peak_reserved_bytes"] is not None:
            row["peak_over_budget_bytes"] = row["device_peak_reserved_bytes"] - row["budget_bytes"]
    else:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        row["error"] = lines[-1] if lines else f"exit status {proc.returncode}, no output"
    return row


def describe(row: dict) -> str:
    if "error" in row:
        return f"{row['budget']:>9}: {row['error']}"
    over = row.get("peak_over_budget_bytes")
    return (f"{row['budget']:>9}: rc {row['rc']}, reserve {row['activation_reserve_bytes'] / 2**20:.0f} MiB, KV free "
            f"{row['kv_free_blocks_at_start']} -> {row['kv_free_blocks_min']} blocks, widths "
            f"{row.get('mean_width_start', 0):.2f} -> {row.get('mean_width_min', 0):.2f} -> "
            f"{row.get('mean_width_idle', 0):.2f}, preemptions {row['preemptions']}, {row['tokens_per_s']:.0f} tok/s"
            + ("" if over is None else f", peak {abs(over) / 2**20:.1f} MiB {'above' if over > 0 else 'within'}"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/pw-tiny-moe")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budgets", required=True, help="comma-separated, as --gpu-memory-budget takes them")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each budget (the reserve is measured each time)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--page-store-dir", default=None)
    ap.add_argument("--timeout-s", type=float, default=300, help="per run (a cold Numba cache compiles ~120 s)")
    ap.add_argument("--label", default=None)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    if not budgets or args.repeats < 1:
        ap.error("give at least one budget and --repeats >= 1")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for i, budget in enumerate(budgets):
                row = {"repeat": rep, **run_once(args, budget, Path(tmp) / f"{rep}-{i}.json")}
                rows.append(row)
                print(describe(row), flush=True)
                write_result("run_budgets", rows, out_dir=args.out_dir, label=args.label, extra={"complete": False})
    write_result("run_budgets", rows, out_dir=args.out_dir, label=args.label, extra={"complete": True})
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
