"""Reads `ncu --page raw --csv` on stdin and prints, per profiled kernel, the warp-state stall breakdown
(cycles per issued instruction by reason), largest first, and the headline figures it is read against."""
from __future__ import annotations

import csv
import sys

HEAD = ("gpu__time_duration.sum", "smsp__inst_executed.sum", "sm__warps_active.avg.pct_of_peak_sustained_active",
        "dram__throughput.avg.pct_of_peak_sustained_elapsed", "launch__registers_per_thread",
        "smsp__issue_active.avg.pct_of_peak_sustained_active")
STALL = "smsp__average_warps_issue_stalled_"
SUFFIX = "_per_issue_active.ratio"


def main() -> int:
    rows = list(csv.reader(sys.stdin))
    start = next((i for i, r in enumerate(rows) if r and r[0] == "ID"), None)
    if start is None:
        print("no raw table in the input")
        return 1
    names = rows[start]
    for r in rows[start + 2:]:  # the line after the header holds units
        rec = dict(zip(names, r))
        print(f"== kernel {rec.get('Kernel Name', '?')[:60]}  (id {rec.get('ID')})")
        for h in HEAD:
            print(f"  {h:60s} {rec.get(h, '-')}")
        stalls = [(k[len(STALL):-len(SUFFIX)], v) for k, v in rec.items() if k.startswith(STALL) and k.endswith(SUFFIX)]
        stalls = sorted(((n, float(v.replace(",", ""))) for n, v in stalls if v not in ("", "n/a")), key=lambda x: -x[1])
        for n, v in stalls[:12]:
            print(f"  stall {n:40s} {v:8.3f} cycles/issue")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
