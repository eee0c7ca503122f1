"""Where a paired run's per-step gap between PagedWeight and uniform comes from: for every decode step of each
engine, the host time from the step's start to the launch of its forward (a CUDA graph's replay, or the eager
forward's start) and, for a replay, the forward's GPU time between two events around the replay.

The device idles while the host works before the launch (the previous step ended by reading its tokens), so host
time there adds to the step; host time after the launch overlaps the forward. On the H200 the two engines' graphs
took the same GPU time per step (3.09 ms at 3 bits, batch 1) while PagedWeight's launch came 0.05-0.15 ms later on
the steps that toggled its routing observers (launch_marks-nvidia-h200-20261130-s12.json).

Runs `engine_bench` with these arguments (a paired run: --rounds 0 --paired-chunk N; --trace is added) and writes
`launch_marks-<machine>-<date>[-label].json`: per paired configuration, engine and place in the routing-observation
cycle (step % observe_every; 0 = observed), the median step, launch and GPU ms, and the medians of the marks on
the way to the launch (SUB_MARKS: the scheduler's return, DecodeGraphs.run's entry, its graph lookup after the
inputs' copy), each from the step's start. Diagnostic: the events and marks
add host time to every step of both engines.

    python -m benchmarks.launch_marks --rounds 0 --paired-chunk 4 --bits 3 --batches 1 --paged-home match --gen 64
"""
from __future__ import annotations

import sys
import time

import numpy as np
import torch

from benchmarks import engine_bench
from benchmarks.common import write_result
from pagedweight.engine import LLM
from pagedweight.models.model import MoEForCausalLM
from pagedweight.runner import DecodeGraphs
from pagedweight.scheduler import Scheduler

# host marks inside a step before its launch, each the first time a step reaches it: (name, class, method, where)
SUB_MARKS = (("scheduled", Scheduler, "schedule", "exit"), ("run", DecodeGraphs, "run", "entry"),
             ("graph_lookup", DecodeGraphs, "_graph", "entry"))


class LaunchMarks:
    """Patches LLM.step, CUDAGraph.replay, the model's forward and the SUB_MARKS methods for the marks; `restore`
    undoes it."""

    def __init__(self) -> None:
        self.steps: dict[tuple[str, str], list[tuple]] = {}  # (config, engine) -> (place, step, launch, sub-marks, events)
        self.on, self._step = False, {}
        self._saved = LLM.step, torch.cuda.CUDAGraph.replay, MoEForCausalLM.forward
        step, replay, forward = self._saved
        marks = self

        def marked_step(llm: LLM):
            if not marks.on:
                return step(llm)
            marks._step = {}
            place, t0 = llm.num_steps % llm.options.observe_every, time.perf_counter()
            out = step(llm)
            t1, mark = time.perf_counter(), marks._step
            if "launch" in mark:
                kind = "paged" if llm.planner is not None else "uniform"
                subs = {name: mark[name] - t0 for name, *_ in SUB_MARKS if name in mark}
                marks.steps.setdefault((marks.config, kind), []).append(
                    (place, t1 - t0, mark["launch"] - t0, subs, mark.get("events")))
            return out

        def marked_replay(graph):
            marks._step.setdefault("launch", time.perf_counter())
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            replay(graph)
            end.record()
            marks._step["events"] = start, end

        def marked_forward(model, *args, **kwargs):
            marks._step.setdefault("launch", time.perf_counter())
            return forward(model, *args, **kwargs)

        LLM.step, torch.cuda.CUDAGraph.replay, MoEForCausalLM.forward = marked_step, marked_replay, marked_forward
        self._sub_saved = [(cls, name, getattr(cls, name)) for _, cls, name, _ in SUB_MARKS]
        for (mark, cls, name, where), (*_, method) in zip(SUB_MARKS, self._sub_saved):
            setattr(cls, name, self._marked(mark, method, where))
        self.config = ""

    def _marked(self, mark: str, method, where: str):
        marks = self

        def marked(*args, **kwargs):
            if where == "entry":
                marks._step.setdefault(mark, time.perf_counter())
            out = method(*args, **kwargs)
            if where == "exit":
                marks._step.setdefault(mark, time.perf_counter())
            return out
        return marked

    def restore(self) -> None:
        LLM.step, torch.cuda.CUDAGraph.replay, MoEForCausalLM.forward = self._saved
        for cls, name, method in self._sub_saved:
            setattr(cls, name, method)

    def rows(self) -> list[dict]:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        rows = []
        for (config, kind), steps in self.steps.items():
            for place in sorted({s[0] for s in steps}):
                at = [s for s in steps if s[0] == place]
                gpu = [ev[0].elapsed_time(ev[1]) for *_, ev in at if ev is not None]
                subs = {f"{name}_ms": float(np.median([s[3][name] for s in at if name in s[3]])) * 1e3
                        for name, *_ in SUB_MARKS if any(name in s[3] for s in at)}
                rows.append({"config": config, "engine": kind, "place": place, "steps": len(at),
                             "step_ms": float(np.median([s[1] for s in at])) * 1e3,
                             **subs, "launch_ms": float(np.median([s[2] for s in at])) * 1e3,
                             "graph_gpu_ms": float(np.median(gpu)) if gpu else None})
        return rows


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    marks = LaunchMarks()
    paired, phases = engine_bench.paired_decode, engine_bench.StepPhases

    def marked_pair(cfg, weights, budget, batch, b, home, args):
        marks.config = f"ap{b}/b{batch}/home{home}"
        try:
            return paired(cfg, weights, budget, batch, b, home, args)
        finally:
            marks.on = False

    class MarkedPhases(phases):  # made right before the paired loop: the engines' warm-up and prefill are not marked
        def __init__(self, llm: LLM) -> None:
            super().__init__(llm)
            marks.on = True

    engine_bench.paired_decode, engine_bench.StepPhases = marked_pair, MarkedPhases
    try:
        engine_bench.main(argv + ["--trace"])
    finally:
        engine_bench.paired_decode, engine_bench.StepPhases = paired, phases
        marks.restore()
    label = argv[argv.index("--label") + 1] if "--label" in argv else None
    out_dir = argv[argv.index("--out-dir") + 1] if "--out-dir" in argv else None
    print(write_result("launch_marks", marks.rows(), out_dir=out_dir, label=label,
                       extra={"engine_bench_args": argv}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
