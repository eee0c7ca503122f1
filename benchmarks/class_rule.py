"""What the release's class rule does to a Qwen1.5-MoE-shaped release (computed, CPU, no model run).

The planner's release follows the kernels' class rule (`planner.plan_release_narrow`): a layer it would leave above
the narrow LUT class (4 bits) for fewer than `release_min_share` of its blocks goes wholly into the class (off by
default; here at 0.5, the reload's `narrow_min_share`). This plans
the releases of engine_bench's paired runs at 4-bit memory with the parent home (the same synthetic tables:
`engine_bench.ap_weights`, s ~ 4x per bit dropped, lognormal scale; mu = 1, no residual heads) with and without
the rule, beside uniform 4 bits (the paired run's other engine), and reports the widths, the layers in the narrow
class and the predicted damage (d_hat, the tables' units: only ratios between the plans mean anything). The demands
are those engine_bench logged on an H100 in session 44 (`h100-nvidia-h100-80gb-hbm3-20261205-s44-calls.log`): batch
32 released 3869.2 MB from 6 bits, batch 8 1793.1 MB from the 5 bits it started at.

    python benchmarks/class_rule.py [--label NAME]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import write_result  # noqa: E402
from benchmarks.engine_bench import ap_weights, model_config  # noqa: E402
from pagedweight.knobs import PlannerKnobs  # noqa: E402
from pagedweight.planner import BlockTables, Plan, damage_rows, plan_release, plan_release_narrow  # noqa: E402
from pagedweight.runner import NARROW_WIDTH  # noqa: E402

PAGE = 131072  # the engine's pool page on that run (engine_bench's log: "pool pages of 131072 B")
SHARE = 0.5  # the reload's narrow_min_share
CASES = (("batch 32", 6, 3869.2e6), ("batch 8", 5, 1793.1e6))  # (run, width the engine started at, demand)


def main() -> int:
    ap_ = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap_.add_argument("--label", default=None)
    args = ap_.parse_args()
    cfg, knobs = model_config(False), PlannerKnobs()
    weights = ap_weights(cfg, parent_bits=6)
    n, P, L = len(weights.specs), weights.parent_bits, cfg.num_hidden_layers
    sup = np.zeros((n, P + 1), dtype=bool)
    sup[:, weights.seed_bits:] = True
    mem = np.zeros((n, P + 1))
    for i, spec in enumerate(weights.specs):
        for b in spec.widths:
            mem[i, b] = -(-(spec.plane_bytes * b + spec.lut_bytes[b]) // PAGE) * PAGE
    tables = BlockTables(sup, mem, weights.sensitivity, L, cfg.num_experts)
    dhat = damage_rows(tables, np.ones(n), knobs.eps)
    floors = np.full(n, weights.seed_bits)
    rows = []
    for run, start, demand in CASES:
        widths = np.full(n, start)
        plain = plan_release(tables, widths, demand, dhat, floors, knobs.stage_floors)
        ruled = plan_release_narrow(tables, widths, demand, dhat, floors, knobs.stage_floors, NARROW_WIDTH,
                                    SHARE)
        uniform = np.full(n, NARROW_WIDTH)  # the paired run's other engine: every block at 4 bits
        steps = np.where(tables.has_step, dhat, 0.0)[NARROW_WIDTH:start].sum()
        flat = Plan("release", widths, uniform, demand, float((tables.bytes_at(widths) - tables.bytes_at(uniform)).sum()),
                    float(steps), True, 0, 0.0)
        for variant, plan in (("unruled", plain), ("class rule", ruled), ("uniform 4 bits", flat)):
            layers = plan.widths.reshape(L, -1)
            share = (layers > NARROW_WIDTH).mean(axis=1)
            rows.append({"run": run, "start_width": start, "demand_bytes": demand, "variant": variant,
                         "freed_bytes": plan.delta_bytes, "mean_width": round(float(plan.widths.mean()), 4),
                         "blocks_by_width": {int(b): int(c) for b, c in enumerate(np.bincount(plan.widths)) if c},
                         "layers_narrow": int((layers.max(axis=1) <= NARROW_WIDTH).sum()), "layers": L,
                         "wide_layers_share_above_narrow": sorted(round(float(s), 3) for s in share if s > 0),
                         "damage_predicted": plan.damage,
                         "damage_vs_unruled": round(plan.damage / plain.damage, 4)})
            print({k: v for k, v in rows[-1].items() if k != "wide_layers_share_above_narrow"})
    print(write_result("class-rule", rows, extra={"page_bytes": PAGE, "computed": True}, label=args.label))
    return 0


if __name__ == "__main__":
    sys.exit(main())
