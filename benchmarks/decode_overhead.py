"""Host overhead of one batch-1 decode step (issue 8, engine speed): aten ops, host syncs and CPU ms per step.

On the H200 a decode step of the Qwen1.5-MoE-shaped engine took 80-150 ms while the fused MoE kernel takes ~60 us
per layer: the step is bound by host work. This script counts that work on CPU, where it is the same code: a
Qwen-shaped model scaled down (24 layers, 60 experts, top-4, D=256, F=128) is served by the engine at batch 1
(configs: `dense` with the experts' accelerator dispatch, `dense-cpu` with their CPU dispatch, `ap4-uniform`,
`pagedweight` observing routing every step, `pagedweight-observe4` every 4th step as the engine's default);
after a prefill and a few warm decode steps, `torch.profiler` records several decode steps and we report per step
- `aten_ops`: every aten op dispatched (nested ones included), outside the fused expert kernel on the AP paths
  (there the kernel is one call per layer on the GPU; its CPU torch twin is not what runs there);
- `sync_ops`: ops that synchronise a CUDA stream with the host (item/_local_scalar_dense, nonzero, unique, ...);
- `host_reads`: Python-level reads of tensor data (.item, .tolist, .cpu, .numpy), the other way to synchronise;
- `top_level_ops`: the aten ops called from Python (the count above without their nested dispatches);
- `cpu_ms`: wall time per decode step without the profiler (median and best: the CI box is shared), and the same
  less the time spent in the expert kernel's CPU twin (AP paths);
- `paging_ms`: wall time of the engine's paging loop per step (`LLM._paging_boundary`: planner decide + refresh,
  move requests, mover boundary) and its mean over the timed steps (a refresh that runs only on some steps
  shows in the mean, not the median); no page moves here, so this is the loop's cost when nothing changes.

    python -m benchmarks.decode_overhead --label before --raw /tmp/before.json   # on the old tree
    python -m benchmarks.decode_overhead --before /tmp/before.json               # after: JSON with both
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections import Counter
from typing import Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.common import write_result
from benchmarks.engine_bench import QWEN15_MOE, ap_weights, random_model
from pagedweight.engine import LLM
from pagedweight.models import ModelConfig
from pagedweight.sampling import SamplingParams

SCALED = dict(QWEN15_MOE, vocab_size=2048, hidden_size=256, moe_intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=4, head_dim=64, shared_expert_intermediate_size=512, max_position_embeddings=4096)
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::_unique2", "aten::unique_dim",
            "aten::unique_consecutive", "aten::masked_select", "aten::nonzero_static")
HOST_READS = ("item", "tolist", "cpu", "numpy")
KERNEL = "moe_kernel"


class HostReads:
    """Counts Python-level reads of tensor data while active (patched Tensor methods), except inside the kernel."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.active = False
        self.kernel_s = 0.0  # wall time inside the expert kernel

    @contextlib.contextmanager
    def patched(self) -> Iterator["HostReads"]:
        originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

        def wrap(name: str, fn: Callable) -> Callable:
            def counted(t, *a, **kw):
                if self.active:
                    self.counts[name] += 1
                return fn(t, *a, **kw)
            return counted

        for name, fn in originals.items():
            setattr(torch.Tensor, name, wrap(name, fn))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(torch.Tensor, name, fn)


def mark_kernel(llm: LLM, reads: HostReads) -> None:
    """Wrap every layer's expert kernel (AP path) in a profiler range and pause host-read counting inside it."""
    for layer in llm.model.layers:
        experts = layer.mlp.experts
        if not hasattr(experts, "fn"):
            return
        inner = experts.fn

        def fn(*args, _inner=inner, **kw):
            was, reads.active = reads.active, False
            t0 = time.perf_counter()
            try:
                with record_function(KERNEL):
                    return _inner(*args, **kw)
            finally:
                reads.active = was
                reads.kernel_s += time.perf_counter() - t0
        experts.fn = fn


def inside_kernel(event) -> bool:
    parent = event
    while parent is not None:
        if parent.name == KERNEL:
            return True
        parent = parent.cpu_parent
    return False


def make_llm(kind: str, cfg: ModelConfig) -> LLM:
    common = dict(detokenize=False, block_size=16, max_num_seqs=1, max_num_batched_tokens=512)
    if kind.startswith("dense"):
        llm = LLM.from_parts(random_model(cfg, True, torch.float32, "cpu"), None, model_name=kind,
                             kv_cache_bytes=64 << 20, **common)
        if kind == "dense":  # the accelerator dispatch (gathered experts); "dense-cpu" keeps the CPU's grouped one
            for layer in llm.model.layers:
                if hasattr(layer.mlp.experts, "gather_max_pairs"):
                    layer.mlp.experts.gather_max_pairs = cfg.num_experts
        return llm
    weights = ap_weights(cfg, parent_bits=6)
    model = random_model(cfg, False, torch.float32, "cpu")
    if kind == "ap4-uniform":
        return LLM.from_parts(model, weights, model_name=kind, bits=4, paging=False, **common)
    observe_every = 4 if kind == "pagedweight-observe4" else 1
    return LLM.from_parts(model, weights, model_name=kind, bits=6, paging=True, observe_every=observe_every, **common)


def time_paging_boundary(llm: LLM) -> list[float]:
    """Wrap the engine's paging loop; the list it returns collects each call's wall ms."""
    inner, calls = llm._paging_boundary, []

    def timed(*args) -> bool:  # the engine's deadline, if any
        t0 = time.perf_counter()
        try:
            return inner(*args)
        finally:
            calls.append((time.perf_counter() - t0) * 1e3)
    llm._paging_boundary = timed
    return calls


def measure(kind: str, cfg: ModelConfig, prompt_len: int, steps: int, timed: int) -> dict:
    llm = make_llm(kind, cfg)
    reads = HostReads()
    mark_kernel(llm, reads)
    ids = torch.randint(0, cfg.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    llm.add_request(ids, SamplingParams(max_tokens=steps + timed + 8, ignore_eos=True))
    while not any(out.token_ids for out in llm.step()):  # prefill (chunked) until the first token
        pass
    for _ in range(3):
        llm.step()  # warm decode steps
    with reads.patched(), profile(activities=[ProfilerActivity.CPU]) as prof:
        reads.active = True
        for _ in range(steps):
            llm.step()
        reads.active = False
    ops = Counter()
    top_level = 0
    kernel_calls = 0
    for ev in prof.events():
        if ev.name == KERNEL:
            kernel_calls += 1
        elif ev.name.startswith("aten::") and not inside_kernel(ev):
            ops[ev.name] += 1
            top_level += ev.cpu_parent is None or not ev.cpu_parent.name.startswith("aten::")
    times, outside = [], []
    paging = time_paging_boundary(llm)
    for _ in range(timed):
        reads.kernel_s = 0.0
        t0 = time.perf_counter()
        llm.step()
        dt = time.perf_counter() - t0
        times.append(dt * 1e3)
        outside.append((dt - reads.kernel_s) * 1e3)
    per = 1.0 / steps
    row = {"config": kind, "batch": 1, "context_tokens": prompt_len, "layers": cfg.num_hidden_layers,
           "experts": cfg.num_experts, "top_k": cfg.top_k,
           "aten_ops_per_step": sum(ops.values()) * per,
           "top_level_ops_per_step": top_level * per,
           "sync_ops_per_step": sum(ops[n] for n in SYNC_OPS) * per,
           "host_reads_per_step": sum(reads.counts.values()) * per,
           "kernel_calls_per_step": kernel_calls * per,
           "cpu_ms_per_step": statistics.median(times),
           "cpu_ms_per_step_best": min(times),
           "cpu_ms_per_step_outside_kernel": statistics.median(outside),
           "cpu_ms_per_step_outside_kernel_best": min(outside),
           "paging_ms_per_step": statistics.median(paging) if paging else None,
           "paging_ms_per_step_mean": statistics.fmean(paging) if paging else None,
           "top_ops": {k: v * per for k, v in ops.most_common(12)},
           "host_reads_by_kind": {k: v * per for k, v in reads.counts.items()}}
    print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, file=sys.stderr)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="dense,dense-cpu,ap4-uniform,pagedweight")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=4, help="profiled decode steps")
    p.add_argument("--timed", type=int, default=10, help="timed decode steps (median)")
    p.add_argument("--label", default="after", help="phase name stored in each row")
    p.add_argument("--raw", default=None, help="also dump the rows to this JSON file (for a later --before)")
    p.add_argument("--before", default=None, help="rows of an earlier run (--raw) to store alongside")
    p.add_argument("--before-source", default=None, help="what tree the --before rows were measured on")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--result-label", default=None, help="suffix of the JSON file name (keeps another run's file)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = ModelConfig(**SCALED)
    rows = [{"phase": args.label, **measure(k, cfg, args.prompt_len, args.steps, args.timed)}
            for k in args.configs.split(",")]
    if args.raw:
        with open(args.raw, "w") as f:
            json.dump(rows, f, indent=1)
    if args.before:
        with open(args.before) as f:
            rows = json.load(f) + rows
    path = write_result("decode_overhead", rows, out_dir=args.out_dir, label=args.result_label,
                        extra={"model": "Qwen1.5-MoE shape scaled: L=24 E=60 top-4 D=256 F=128, random weights, "
                                        "fp32 on CPU, 1 thread", "before_source": args.before_source})
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
