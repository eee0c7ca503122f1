"""Host time of a static decode step's inputs (`runner.DecodeGraphs.run` before its forward), per batch x context.

The device idles while the host prepares a step (the previous step ended by reading its tokens), so this time adds
to every decode step. What it covers: each request's token, position and block tables reaching the step's input
buffer on the device (`--device`), and the slot bookkeeping of the device-resident tables where the tree has them.
The forward is left out (stubbed): with CUDA graphs it is one replay, whose device work the engine benchmarks
measure. The model is a stand-in with `--layers` layers; the block tables are the kv cache's own
(`PagedKVCache.block_tables` over `--block-size`-token blocks), each request appending a block every block-size
steps as decoding does. Rows: batch, context tokens, the median host ms per step and the first step's (when the
requests take their slots).

    python -m benchmarks.decode_inputs --label after
    PYTHONPATH=/tmp/old python -m benchmarks.decode_inputs --label before    # a tree before the change
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch

from benchmarks.common import write_result
from pagedweight.kv_cache import PagedKVCache
from pagedweight.runner import DecodeGraphs, decode_batch_sizes
from pagedweight.sampling import SamplingParams
from pagedweight.sequence import Sequence


class Tables:
    """What DecodeGraphs reads of a kv cache: its device and `block_tables`, the cache's own method over this
    object's block -> pages map (pages numbered in allocation order)."""

    block_tables = PagedKVCache.block_tables

    def __init__(self, layers: int, block_size: int, device: torch.device) -> None:
        self.num_layers, self.block_size = layers, block_size
        self.view = torch.empty(0, device=device)
        self.block_pages: dict[int, list[int]] = {}
        self._tables: dict[str, np.ndarray] = {}
        self._pages = itertools.count()
        self._ids = itertools.count()

    def grow(self, seq: Sequence, tokens: int) -> None:
        """Give seq the blocks for `tokens` tokens."""
        while len(seq.block_table) * self.block_size < tokens:
            lid = next(self._ids)
            self.block_pages[lid] = [next(self._pages) for _ in range(self.num_layers)]
            seq.block_table.append(lid)


def stand_in(layers: int) -> SimpleNamespace:
    """The parts of a model DecodeGraphs reads when it does not capture: its layers' MoE blocks."""
    mlp = SimpleNamespace(experts=None, observer=None)
    return SimpleNamespace(config=SimpleNamespace(num_hidden_layers=layers), layers=[SimpleNamespace(mlp=mlp)] * layers)


def step_times(batch: int, context: int, steps: int, layers: int, block_size: int, max_len: int,
               device: torch.device) -> list[float]:
    """Host seconds of each of `steps` decode steps of `batch` requests at `context` tokens."""
    kv = Tables(layers, block_size, device)
    graphs = DecodeGraphs(stand_in(layers), kv, decode_batch_sizes(batch), -(-max_len // block_size), capture=False)
    rows = max(graphs.batch_sizes)
    logits = torch.zeros(rows, 1, device=device)
    graphs._forward = lambda *args: (logits, [])  # the forward is not what is measured
    seqs = []
    for i in range(batch):
        seq = Sequence(f"r{i}", [1] * (context + steps), SamplingParams(max_tokens=1))
        seq.num_computed_tokens = context - 1
        seqs.append(seq)
    times = []
    for _ in range(steps):
        for seq in seqs:
            kv.grow(seq, seq.num_computed_tokens + 1)  # the scheduler's allocation for the step's token
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        graphs.run(seqs)
        times.append(time.perf_counter() - t0)
        for seq in seqs:
            seq.num_computed_tokens += 1
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,4,32,256")
    p.add_argument("--contexts", default="1024,4096", help="tokens each request holds at the first step")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--layers", type=int, default=24, help="24: Qwen1.5-MoE-A2.7B")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--label", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    rows = []
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            times = step_times(batch, context, args.steps, args.layers, args.block_size, args.max_model_len, device)
            rows.append({"batch": batch, "context": context, "layers": args.layers, "block_size": args.block_size,
                         "steps": args.steps, "device": str(device),
                         "host_ms_median": round(statistics.median(times) * 1e3, 4),
                         "host_ms_p90": round(float(np.percentile(times, 90)) * 1e3, 4),
                         "first_step_ms": round(times[0] * 1e3, 4)})
            print(rows[-1], flush=True)
    write_result("decode_inputs", rows, out_dir=args.out_dir, label=args.label)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
