"""Host cost of prefix sharing and kept blocks in the paged KV cache, per request, without a model.

What a request's life adds on the host, with prefix caching on and off (`PagedKVCache` over a CPU `PagePool` of
one small page per layer block: the page size does not change the host work, and the KV bytes are never read):
- `start_us`: looking its prompt up (`share_prefix`; none with caching off) and allocating its blocks;
- `publish_us`: publishing its full blocks after its prefill (the engine calls it after each step);
- `free_us`: releasing its blocks at its end (kept, with caching on);
- `hit_start_us`: the same prompt again, started after the first ended: its blocks are found kept;
- `evict_us_per_block`: evicting kept blocks, per block, when a new request's allocation needs their pages.
Rows: per prompt length and mode, medians over `--reps` requests. The engine's step (forward, sampling) is
untouched by any of this; these run once per request, beside its prefill.

    python -m benchmarks.prefix_cost --label s38
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import write_result
from pagedweight.kv_cache import PagedKVCache
from pagedweight.models import ModelConfig
from pagedweight.pool import PAGE_ALIGN, PagePool
from pagedweight.sampling import SamplingParams
from pagedweight.sequence import Sequence

BLOCK = 16


def cache(layers: int, blocks: int, prefix_caching: bool) -> PagedKVCache:
    """A KV cache of `blocks` logical blocks of `layers` layers, one PAGE_ALIGN page each (head_dim 2, fp32)."""
    cfg = ModelConfig(family="qwen2_moe", vocab_size=151936, hidden_size=16, moe_intermediate_size=8,
                      num_hidden_layers=layers, num_experts=2, top_k=1, norm_topk_prob=False, num_attention_heads=1,
                      num_key_value_heads=1, head_dim=2, rope_theta=1e6, rms_norm_eps=1e-6,
                      max_position_embeddings=1 << 20)
    pool = PagePool(blocks * layers * PAGE_ALIGN, PAGE_ALIGN)
    return PagedKVCache(cfg, pool, torch.float32, block_size=BLOCK, decode_kernel=False,
                        prefix_caching=prefix_caching)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def lifecycle(kv: PagedKVCache, rid: str, ids: list[int]) -> dict[str, float]:
    """One request's start (lookup + allocation), publish and free, as the engine runs them; µs each."""
    seq = Sequence(rid, ids, SamplingParams(max_tokens=1))

    def start():
        kv.share_prefix(seq)
        kv.allocate(seq, seq.num_tokens - seq.num_computed_tokens)

    out = {"start_us": timed(start)}
    seq.num_computed_tokens = seq.num_tokens
    out["publish_us"] = timed(lambda: kv.publish([seq]))
    out["free_us"] = timed(lambda: kv.free(seq))
    return out


def measure(layers: int, prompt: int, reps: int, prefix_caching: bool) -> dict:
    blocks = 4 * (prompt // BLOCK + 1)
    kv = cache(layers, blocks, prefix_caching)
    rows = {"start_us": [], "publish_us": [], "free_us": [], "hit_start_us": [], "evict_us_per_block": []}
    for r in range(reps):
        ids = [(r * 7919 + i * 31) % 151936 for i in range(prompt)]  # distinct prompts: a miss, then a hit
        for key, value in lifecycle(kv, f"{r}", ids).items():
            rows[key].append(value)
        again = lifecycle(kv, f"{r}-again", ids)
        rows["hit_start_us"].append(again["start_us"])
        kept = kv.num_cached_blocks
        if kept:
            rows["evict_us_per_block"].append(timed(lambda: kv.evict(kept)) / kept)
    return {"layers": layers, "prompt_tokens": prompt, "prefix_caching": prefix_caching, "reps": reps,
            **{k: statistics.median(v) if v else None for k, v in rows.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=24, help="layers (default 24: Qwen1.5-MoE-A2.7B)")
    p.add_argument("--prompts", default="256,2048,8192", help="prompt lengths in tokens")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--label", default=None)
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for prompt in (int(x) for x in args.prompts.split(",")):
        for on in (False, True):
            row = measure(args.layers, prompt, args.reps, on)
            rows.append(row)
            print({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()})
    print(write_result("prefix_cost", rows, out_dir=args.out_dir, label=args.label))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
