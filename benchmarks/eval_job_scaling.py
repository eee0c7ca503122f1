"""Scaling of the cluster evaluation job with the number of engines, submitted as real Ray jobs.

Needs a running cluster with its dashboard (job API), e.g. on one box:
    RAY_AUTH_MODE=disabled PATH=$PWD/.venv/bin:$PATH ray start --head --num-cpus 2 --dashboard-host 127.0.0.1
    python -m benchmarks.eval_job_scaling MODEL_DIR --engines 1,2
    python -m benchmarks.eval_job_scaling MODEL_DIR --engines 1,2,4,8 --gpus-per-engine 1   # an 8-GPU node
Each engine count runs `ray job submit -- python -m pagedweight.actors.jobs.evaluate ...`; the rows compare
throughput and check that perplexity and greedy samples are identical whatever the engine count.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from benchmarks.common import write_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--engines", default="1,2")
    ap.add_argument("--address", default="http://127.0.0.1:8265")
    ap.add_argument("--engine-cpus", type=float, default=1)
    ap.add_argument("--gpus-per-engine", type=float, default=1, help="0.5: two engines per GPU; 0: CPU engines")
    ap.add_argument("--job-args", default="--mode all --windows 16 --ctx 256 --num-prompts 8 --max-tokens 16")
    ap.add_argument("--label", default=None, help="suffix of the result file name (a second run the same day)")
    args = ap.parse_args()
    rows, first = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in args.engines.split(",")]:
            out = Path(tmp) / f"eval-{n}.json"
            cmd = ["ray", "job", "submit", "--address", args.address, "--", "python", "-m",
                   "pagedweight.actors.jobs.evaluate", args.model_dir, *args.job_args.split(),
                   "--num-engines", str(n), "--engine-cpus", str(args.engine_cpus),
                   "--gpus-per-engine", str(args.gpus_per_engine), "--out", str(out)]
            subprocess.run(cmd, check=True, capture_output=True, text=True)
            res = json.loads(out.read_text())
            samples = [s["text"] for s in res["generation"]["samples"]]
            first = first or (res["perplexity"]["ppl"], samples)
            rows.append({"engines": n, "devices": [e["device"] for e in res["engines"]],
                         "ppl": res["perplexity"]["ppl"], "ppl_windows_per_engine": res["perplexity"]["windows_per_engine"],
                         "ppl_elapsed_s": res["perplexity"]["elapsed_s"], "warmup_s": res["warmup_s"],
                         "gen_tokens_per_s": res["generation"]["tokens_per_s"],
                         "gen_prompts_per_engine": res["generation"]["prompts_per_engine"],
                         "finish_reasons": res["generation"]["finish_reasons"],
                         "samples_differing_from_first": sum(a != b for a, b in zip(samples, first[1])),
                         "identical_to_first": res["perplexity"]["ppl"] == first[0] and samples == first[1]})
            print(rows[-1])
    write_result("eval_job_scaling", rows, label=args.label)


if __name__ == "__main__":
    main()
