"""A/B of session 8: PagedWeight under the KV-pressure workload with (new) the padded-bmm fp16 prefill and the fused
router/shared inputs, (oldprefill) the per-expert mm prefill of 6b9336f, (unfused) without fuse_inputs. The arms
rotate within each repetition in one process, after one untimed replay, so drift and one-time costs land on none.

    git show 6b9336f:cuda/moe_kernels.py > .ab/old_moe_kernels.py
    python3 benchmarks/prefill_ab.py 3          # on the H200, after run_h200.sh's setup (pagedweight/cuda link)

kv_pressure_prefill_ab-nvidia-h200-20261130-s8.json came from this file, run as .ab/prefill_ab.py."""
import ast
import json
import os
import sys
import tempfile

import numpy as np
sys.path.insert(0, os.getcwd())
import torch
import pagedweight.cuda.moe_kernels as mk
import pagedweight.cuda.prefill as pf
from pagedweight.models.layers import MoEBlock
from benchmarks import kv_pressure
from benchmarks.common import write_result

src = open(".ab/old_moe_kernels.py").read()
ns = {**vars(mk), **vars(pf)}
for node in ast.parse(src).body:
    if isinstance(node, ast.FunctionDef) and node.name in ("_grouped_mm", "_prefill"):
        exec(compile(ast.Module([node], []), "old_moe_kernels.py", "exec"), ns)
old_prefill, new_prefill, fuse = ns["_prefill"], pf.prefill_forward, MoEBlock.fuse_inputs
assert old_prefill is not new_prefill
KEYS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tokens_per_s", "requests_waited", "preemptions",
        "offload_triggers", "reload_triggers", "bytes_offloaded", "bytes_reloaded", "mean_width_min",
        "mean_width_reversals", "elapsed_s", "steps")
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
extra_args = sys.argv[2:]
arms = ["new", "oldprefill", "unfused"]
rows, tmp = [], tempfile.mkdtemp()
for rep in range(-1, reps):  # rep -1: warm-up (compiles), not kept
    for arm in (arms if rep % 2 == 0 else arms[::-1]) if rep >= 0 else ["new"]:
        pf.prefill_forward = old_prefill if arm == "oldprefill" else new_prefill
        MoEBlock.fuse_inputs = (lambda self: None) if arm == "unfused" else fuse
        label = f"{arm}{rep}"
        kv_pressure.main(["--static-bits", "none", "--paged-runs", "1", "--warmup-replays", "0", "--trace", "--out-dir", tmp,
                          "--label", label,
                          *extra_args])
        (f,) = [p for p in os.listdir(tmp) if p.endswith(f"-{label}.json")]
        row = json.load(open(os.path.join(tmp, f)))["rows"][0]
        t = row["step_trace"]; c = t["columns"]
        fw = np.array([r[c.index("forward_ms")] or 0 for r in t["rows"]])
        step = np.array([r[0] for r in t["rows"]])
        kept = {k: row[k] for k in KEYS} | {"arm": arm, "rep": rep, "prefill_forward_ms_sum": float(fw[fw > 50].sum()),
                                            "short_step_ms_median": float(np.median(step[fw <= 50])),
                                            "running_median": float(np.median([r[c.index("running")] for r in t["rows"]]))}
        print(kept, flush=True)
        if rep >= 0:
            rows.append(kept)
summary = {arm: {k: sorted(r[k] for r in rows if r["arm"] == arm) for k in ("ttft_p50_ms", "ttft_p99_ms", "tokens_per_s", "prefill_forward_ms_sum", "requests_waited")} for arm in arms}
print(json.dumps(summary, indent=1))
write_result("kv_pressure_prefill_ab", rows, extra={"summary": summary, "note": __doc__}, label="s8")
