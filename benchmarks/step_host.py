"""Host time of a fresh engine's slow steps (issue 8, item 6's tails): where a decode step that is not replayed
from a CUDA graph, a graph capture and a prefill step spend their time, on kv_pressure's engine (Qwen1.5-MoE-A2.7B
shape, random planes, PagedWeight at 6 bits).

In the H100 conversations every decode-graph capture was a 58-77 ms step (seven to nine a run) and a prefill step of
a few hundred tokens 46-84 ms, while a replayed decode step takes ~4 ms. Measured here, all wall times with the
device synchronised before and after (measured, not computed):
- `prefill_ms`: engine steps that each prefill a fresh prompt of --prompt tokens (the first pays one-time costs);
- per decode batch size: `eager_ms` (the step's forward run eagerly, several times), `capture_ms` (a CUDA graph
  capture of it) and `replay_ms`;
- `launch_us`: host time of one launch of the RMSNorm kernel through Numba's launch and through
  `launcher.launch` (the driver directly), alternating, --launches each;
- `bmm_us`: host time of torch.bmm (fp16, the prefill's padded expert GEMM shapes) on a shape's first sight and
  again: cuBLAS chooses a kernel per new shape. Run after the engine's prefills, whose shapes are no longer first
  sights here (a fresh process, call 3 of h100-nvidia-h100-80gb-hbm3-20261206-s51-calls.log: medians 112-2,221 us).

    python -m benchmarks.step_host --label s51
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import numpy as np
import torch

from benchmarks import kv_pressure
from benchmarks.common import write_result
from benchmarks.engine_bench import ap_weights, model_config, outside_bytes, page_bytes, random_model
from pagedweight.engine import LLM
from pagedweight.sampling import SamplingParams


def timed(fn: Callable[[], object], n: int, device: str) -> list[float]:
    """Wall ms of n calls of fn, each between two device synchronisations."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(round((time.perf_counter() - t0) * 1e3, 3))
    return out


def build(tiny: bool, device: str, prefill_warm_up: bool = True, packed_layer_kernels: bool = True
          ) -> tuple[LLM, int]:
    """kv_pressure's PagedWeight engine (its budget: every expert at 6 bits and 128 KV blocks) and the vocabulary;
    `prefill_warm_up`, `packed_layer_kernels`: EngineOptions' (the prefill GEMM shapes run at start; the fused layer
    kernels in the prefill steps too)."""
    cfg = model_config(tiny)
    dtype = torch.float16 if device == "cuda" else torch.float32
    page = page_bytes(cfg, 16, dtype)
    weights = ap_weights(cfg, 6)
    budget, options = kv_pressure.budget_and_options(cfg, weights, 6, outside_bytes(cfg, dtype, device), page,
                                                     6 if tiny else 128, 64 if tiny else 1024, 4096)
    llm = LLM.from_parts(random_model(cfg, False, dtype, device), weights, None, budget, device,
                         model_name="step_host", bits=6, paging=True, detokenize=False,
                         prefill_warm_up=prefill_warm_up, packed_layer_kernels=packed_layer_kernels, **options)
    return llm, cfg.vocab_size


def prefill_and_decode(llm: LLM, vocab: int, prompts: int, tokens: int, batch_sizes: list[int], repeats: int
                       ) -> dict:
    """Prefill steps of fresh prompts (each request aborted after its step), then one request kept decoding, whose
    step is run eagerly, captured and replayed at each batch size (its row repeated)."""
    rng = np.random.default_rng(0)
    device = llm.device.type
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    prefill = []
    for _ in range(prompts):
        llm.add_request(rng.integers(0, vocab, tokens).tolist(), params)
        prefill += timed(llm.step, 1, device)
        for seq in list(llm._running()):
            llm.abort(seq.request_id)
    llm.add_request(rng.integers(0, vocab, tokens).tolist(), params)
    llm.step()
    out = {"prefill_ms": prefill, "decode_step_ms": timed(llm.step, repeats, device), "decode": []}
    graphs = llm.runner.decode
    if graphs is None or not graphs.capture:
        return out
    from pagedweight.runner import capture

    seq = llm._running()[0]
    with torch.inference_mode():
        for rows in batch_sizes:
            inputs, blocks = graphs._step_inputs([seq], rows)
            graph = torch.cuda.CUDAGraph()
            step = lambda: graphs._forward(inputs, blocks)  # noqa: E731 (timed, captured)
            out["decode"].append({
                "rows": rows, "blocks": blocks, "eager_ms": timed(step, repeats, device),
                "capture_ms": timed(lambda: capture(graph, graphs._pool, step, "step_host"), 1, device)[0],
                "replay_ms": timed(graph.replay, repeats, device)})
    return out


def launch_ab(launches: int) -> dict:
    """Host us of one RMSNorm launch [8, 2048] fp16 through Numba (cached views, as the launchers made them) and
    through `launcher.launch`, alternating in blocks of 10."""
    from pagedweight.cuda import layer_kernels as lk
    from pagedweight.cuda import launcher as lm
    from pagedweight.cuda._compat import cuda

    x = torch.randn(8, 2048, dtype=torch.float16, device="cuda")
    w, y = torch.ones(2048, dtype=torch.float16, device="cuda"), torch.empty_like(x)
    args = (x, x, y, y, w, np.float32(1e-6), False, True)
    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)

    def numba() -> None:
        views = [lm._dev(a) if isinstance(a, torch.Tensor) else a for a in args]
        lk._rms_norm_kernel[8, lk.NORM_THREADS, stream](*views)

    def direct() -> None:
        lm.launch(lk._rms_norm_kernel, 8, lk.NORM_THREADS, args)

    times: dict[str, list[float]] = {"numba": [], "direct": []}
    for fn in (numba, direct):  # compiled and views cached before timing
        fn()
    torch.cuda.synchronize()
    for _ in range(max(1, launches // 10)):
        for name, fn in (("numba", numba), ("direct", direct)):
            for _ in range(10):
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
    assert torch.isfinite(y).all()
    return {name: {"median": round(statistics.median(v), 2), "mean": round(statistics.mean(v), 2)}
            for name, v in times.items()}


def bmm_first_sight(widths: list[int], n: int = 7, d: int = 2048, f2: int = 2816) -> dict:
    """Host us of torch.bmm [n, w, d] x [n, d, f2] into a buffer (fp16), each width's first call and again."""
    def host_us(w: int) -> float:
        a = torch.randn(n, w, d, dtype=torch.float16, device="cuda")
        b = torch.randn(n, d, f2, dtype=torch.float16, device="cuda")
        o = torch.empty(n, w, f2, dtype=torch.float16, device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.bmm(a, b, out=o)
        dt = time.perf_counter() - t0
        torch.cuda.synchronize()
        return dt * 1e6

    first = [host_us(w) for w in widths]
    again = [host_us(w) for w in widths]
    return {"n": n, "widths": [widths[0], widths[-1]], "first_median": round(statistics.median(first), 1),
            "first_mean": round(statistics.mean(first), 1), "again_median": round(statistics.median(again), 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="toy shapes (CPU check)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", type=int, default=4, help="prefill steps, each of a fresh prompt (default 4)")
    p.add_argument("--prompt", type=int, default=None, help="tokens per prompt (default 453; tiny: 40)")
    p.add_argument("--batch-sizes", default="1,8", help="decode rows to run eagerly, capture and replay")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--launches", type=int, default=400, help="launches per arm of the launch A/B (CUDA)")
    p.add_argument("--no-prefill-warm-up", dest="prefill_warm_up", action="store_false",
                   help="skip the engine's prefill GEMM warm-up at start (an A/B arm: the prefill steps then meet "
                        "cuBLAS's first sight of each group shape)")
    p.add_argument("--no-packed-layer-kernels", dest="packed_layer_kernels", action="store_false",
                   help="the prefill steps run torch's ops, not the fused layer kernels (EngineOptions."
                        "packed_layer_kernels off; an A/B arm)")
    p.add_argument("--prefill-scratch-mib", type=int, default=None, metavar="MIB",
                   help="the prefill's dequantize scratch (cuda/prefill.PREFILL_SCRATCH_BYTES, default 128 MiB): "
                        "how many experts a group holds, so how many groups, GEMMs and launches a layer call runs")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--label", default=None)
    args = p.parse_args(argv)
    if args.prefill_scratch_mib is not None:
        from pagedweight.cuda import prefill

        prefill.PREFILL_SCRATCH_BYTES = args.prefill_scratch_mib << 20
    t0 = time.perf_counter()
    llm, vocab = build(args.tiny, args.device, args.prefill_warm_up, args.packed_layer_kernels)
    graphs = llm.runner.decode
    row = {"engine_build_s": round(time.perf_counter() - t0, 3),
           "decode_stats_at_start": None if graphs is None else dict(vars(graphs.stats))}
    row.update(prefill_and_decode(llm, vocab, args.prompts, args.prompt or (40 if args.tiny else 453),
                                  [int(b) for b in args.batch_sizes.split(",")], args.repeats))
    if args.device == "cuda" and args.launches > 0:
        row["launch_us"] = launch_ab(args.launches)
    if args.device == "cuda":
        row["bmm_us"] = bmm_first_sight(list(range(1, 161)))
    llm.close()
    print(row, file=sys.stderr)
    print(write_result("step_host", [row], out_dir=args.out_dir, label=args.label,
                       extra={"model": "tiny" if args.tiny else "Qwen1.5-MoE-A2.7B shape, random planes",
                              "prompt_tokens": args.prompt or (40 if args.tiny else 453),
                              "prefill_warm_up": args.prefill_warm_up,
                              "prefill_scratch_mib": args.prefill_scratch_mib,
                              "packed_layer_kernels": args.packed_layer_kernels}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
