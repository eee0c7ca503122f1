"""Fused bit-plane MoE kernels on the GPU: correctness vs the torch twin, CUDA-graph table updates, and speed.

Sections (each appends rows; the JSON is rewritten after every row, `complete` false until the end, so a
cut-short run still leaves a valid partial result):
  correctness  moe_forward vs moe_forward_reference on fresh random inputs, random mixed widths, fp16 and bf16,
               decode (T <= 64) and prefill (T > 64) paths.
  graph        one capture; q, plane offsets and LUT offsets rewritten in the device tables between replays;
               each replay checked against the reference with the new tables (no recapture).
  prefill      the large-T path alone (no decode compile): correctness at mixed widths, eager time per layer, host
               time per call, one dequantize launch against the copy ceiling; T in {64, 256, 2048}, fp16 and bf16.
  speed        per-layer MoE time under CUDA graphs for Qwen1.5-MoE / Mixtral-8x7B / Qwen3-30B-A3B expert shapes,
               T in {1,4,16,64} (`--tokens`), uniform widths 3,4,6,8 and a mixed plan, rotating routing sets over a
               pool larger than L2; fp16 per-expert cuBLAS under a graph and torch._grouped_mm (bf16) as baselines;
               the device-to-device copy ceiling measured in the same run.
  splits       the decode kernel's split-K sizing (SPLIT_SIZING of the plan's LUT class: launch arguments,
               no recompile) swept at T 1 and 4 (`--tokens`), 4, 6 and 8 bits (LUT classes 4, 7 and 8; `--plans`):
               small experts (Qwen1.5: 704 blocks at T=1) run below the copy ceiling with few warps per SM, and more
               K splits mean more warps but more LUT and x staging per weight.
Run on the GPU box: python benchmarks/moe_kernel_bench.py [--quick]
"""
from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as tf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import write_result  # noqa: E402
from pagedweight.bitplanes import lut_bytes, num_words, plane_bytes  # noqa: E402
from pagedweight.cuda import moe_kernels as mk  # noqa: E402
from pagedweight.cuda import prefill as pf  # noqa: E402
from pagedweight.cuda.moe_kernels import moe_forward  # noqa: E402
from pagedweight.cuda.reference import moe_forward_reference  # noqa: E402
from pagedweight.cuda.synthetic import build_synthetic_moe  # noqa: E402
from pagedweight.runner import lut_width as lut_class  # noqa: E402

SHAPES = {  # name: (E, D, F, top_k)
    "mixtral-8x7b": (8, 4096, 14336, 2),
    "qwen1.5-moe-a2.7b": (60, 2048, 1408, 4),
    "qwen3-30b-a3b": (128, 2048, 768, 8),
}
P, SEED_BITS = 8, 3
ROUTING_SETS = 8
DEV = "cuda"
ROWS: list[dict] = []
CEIL: dict = {}
STATE = {"t0": time.time()}


def log(msg: str) -> None:
    print(f"[{time.time() - STATE['t0']:7.1f}s] {msg}", flush=True)


def save(complete: bool = False) -> None:
    write_result("moe_kernel_bench", ROWS, command=CMD, ceilings=CEIL, label=STATE.get("label"),
                 out_dir=STATE.get("out_dir"), extra={"complete": complete, "max_registers": mk.MAX_REGISTERS})


def add(row: dict) -> None:
    ROWS.append(row)
    save()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def routing(T: int, E: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.rand(T, E, generator=gen, device=DEV)
    w, ids = scores.topk(k, dim=1)
    return ids.to(torch.int32), torch.softmax(w * 4, dim=1)


def time_cycle(fns: list, reps: int = 12, warm: int = 3) -> float:
    """Median µs per call of a round-robin over fns (each replay touches other weights: no L2 reuse)."""
    for _ in range(warm):
        for f in fns:
            f()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for f in fns:
            f()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(fns))
    return statistics.median(times)


def copy_ceiling() -> float:
    src = torch.empty(2 << 30, dtype=torch.uint8, device=DEV).random_()
    dst = torch.empty_like(src)
    us = time_cycle([lambda: dst.copy_(src)], reps=10)
    del src, dst
    return 2 * (2 << 30) / (us * 1e-6) / 1e12


# ------------------------------------------------------------------------------------------- correctness

def correctness(quick: bool) -> None:
    E, D, F, k = 8, 1024, 704, 4
    moe = build_synthetic_moe(E, D, F, P, SEED_BITS, device=DEV, seed=11)
    gen = torch.Generator(device=DEV).manual_seed(5)
    gcpu = torch.Generator().manual_seed(6)
    # T=1 also at the narrow LUT class (widths 3..4, lut_width 4): its own one-token kernel
    for T, widest in ([(1, P), (1, 4), (16, P), (80, P)] if quick else [(1, P), (1, 4), (4, P), (16, P), (64, P),
                                                                       (80, P)]):
        for dtype in (torch.float16, torch.bfloat16):
            q = torch.randint(SEED_BITS, widest + 1, (E, 2), generator=gcpu)
            qd, po, lo = moe.tables(q)
            hidden = torch.randn(T, D, generator=gen, device=DEV).to(dtype)
            ids, w = routing(T, E, k, gen)
            args = (hidden, ids, w, moe.pool_words, moe.pool_halves, qd, po, lo, D, F, P)
            out = moe_forward(*args, lut_width=widest)
            torch.cuda.synchronize()
            ref = moe_forward_reference(*args)
            err = rel(out, ref)
            ok = bool(torch.isfinite(out).all()) and out.dtype == dtype and err <= 1e-2
            add(dict(section="correctness", T=T, k=k, D=D, F=F, widest=widest, dtype=str(dtype).split(".")[-1],
                     path="decode" if T <= 64 else "prefill", rel_err=err, passed=ok))
            log(f"correctness T={T} widths<={widest} {dtype}: rel_err={err:.2e} {'ok' if ok else 'FAIL'}")


def graph_test() -> None:
    E, D, F, k, T = 8, 1024, 512, 2, 4
    moe = build_synthetic_moe(2 * E, D, F, P, SEED_BITS, device=DEV, seed=12)  # second half: where blocks "move"
    gen = torch.Generator(device=DEV).manual_seed(7)
    gcpu = torch.Generator().manual_seed(8)
    q0 = torch.full((E, 2), P)
    qd, _, lo_all = moe.tables(torch.cat([q0, q0]))
    q_dev = qd[:E].clone()
    po_dev = moe.plane_off[:E].clone().to(DEV)
    lo_dev = lo_all[:E].clone()
    hidden = torch.randn(T, D, generator=gen, device=DEV).half()
    ids, w = routing(T, E, k, gen)
    args = (hidden, ids, w, moe.pool_words, moe.pool_halves, q_dev, po_dev, lo_dev, D, F, P)
    moe_forward(*args)  # warm-up: compile and load outside the capture
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        moe_forward(*args)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_forward(*args)
    for step in range(4):
        if step:
            q = torch.randint(SEED_BITS, P + 1, (E, 2), generator=gcpu)
            src = torch.randint(0, 2 * E, (E, 2, P), generator=gcpu)  # each plane from any block of the pool
            po_dev.copy_(moe.plane_off[src, torch.arange(2).view(1, 2, 1), torch.arange(P)])
            lsrc = torch.randint(0, 2 * E, (E, 2), generator=gcpu)
            lo_dev.copy_(moe.lut_offs[lsrc, torch.arange(2).view(1, 2), q].to(DEV))
            q_dev.copy_(q.to(torch.int32))
            hidden.copy_(torch.randn(T, D, generator=gen, device=DEV))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = moe_forward_reference(*args)
        err = rel(out, ref)
        ok = bool(torch.isfinite(out).all()) and err <= 1e-2
        add(dict(section="graph", step=step, T=T, rel_err=err, passed=ok,
                         q_hist=torch.bincount(q_dev.flatten().long().cpu(), minlength=P + 1).tolist()))
        log(f"graph replay {step}: rel_err={err:.2e} {'ok' if ok else 'FAIL'}")


# ------------------------------------------------------------------------------------------------ speed

_KEEP: list = []  # closures of captured steps: their tensors (index lists, outputs) must outlive the graphs


def capture(fn) -> torch.cuda.CUDAGraph:
    _KEEP.append(fn)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def fp16_expert_step(hidden, ids, w, wgu, wd, F):
    """Per-expert cuBLAS path (groups known on the host at capture time)."""
    T, k = ids.shape
    out = torch.zeros(T, wd.shape[1], dtype=torch.float32, device=DEV)
    groups = []
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        groups.append((e, tok, w[tok, slot].float().unsqueeze(1)))

    def run():
        out.zero_()
        for e, tok, ww in groups:
            h = hidden.index_select(0, tok) @ wgu[e].t()
            y = (tf.silu(h[:, :F]) * h[:, F:]) @ wd[e].t()
            out.index_add_(0, tok, y.float() * ww)
        return out
    return run


def grouped_step(hidden, ids, w, wgu_t, wd_t, F, E):
    """torch._grouped_mm (bf16): pairs sorted by expert on the device, offsets by a cumulative count."""
    T, k = ids.shape
    flat = ids.reshape(-1).long()

    def run():
        order = torch.argsort(flat)
        counts = torch.zeros(E, dtype=torch.int32, device=DEV).scatter_add_(0, flat, torch.ones_like(flat,
                                                                                                  dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        x = hidden.index_select(0, order // k)
        h = torch._grouped_mm(x, wgu_t, offs=offs)
        a = (tf.silu(h[:, :F]) * h[:, F:]).to(torch.bfloat16)
        y = torch._grouped_mm(a, wd_t, offs=offs)
        return torch.zeros(T, y.shape[1], device=DEV, dtype=torch.float32).index_add_(
            0, order // k, y.float() * w.reshape(-1)[order].unsqueeze(1))
    return run


def block_bytes(D: int, F: int, qg: int, qd: int) -> int:
    return (qg * plane_bytes(2 * F, D) + lut_bytes(2 * F, qg)) + (qd * plane_bytes(D, F) + lut_bytes(D, qd))


def plan_widths(plan: str, E: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """A speed plan's widths q [E, 2] and LUT class. `wN`: every block at N bits, the engine's class of N; `wNcC`: the
    same in LUT class C (the class's kernel and split sizing at the same bytes); `mA-B`: each block at a width drawn
    from A..B (a PagedWeight layer's spread); `mixed`: drawn from 3, 4, 5, 6, 8."""
    if plan == "mixed":
        q = torch.tensor([3, 4, 5, 6, 8])[torch.randint(0, 5, (E, 2), generator=gen)]
        return q, lut_class(int(q.max()))
    m = re.fullmatch(r"w(\d)(?:c(\d))?|m(\d)-(\d)", plan)
    if m is None:
        raise ValueError(f"plan {plan!r}: want wN, wNcC, mA-B or mixed")
    if m[1]:
        width = int(m[1])
        cls = int(m[2]) if m[2] else lut_class(width)
        if not SEED_BITS <= width <= P or lut_class(width) > cls or cls not in mk.SPLIT_SIZING:
            raise ValueError(f"plan {plan!r}: widths {SEED_BITS}..{P}, a class of {sorted(mk.SPLIT_SIZING)} holding it")
        return torch.full((E, 2), width), cls
    lo, hi = int(m[3]), int(m[4])
    if not SEED_BITS <= lo <= hi <= P:
        raise ValueError(f"plan {plan!r}: want {SEED_BITS} <= A <= B <= {P}")
    q = torch.randint(lo, hi + 1, (E, 2), generator=gen)
    return q, lut_class(int(q.max()))


def speed(quick: bool, shapes: list[str], tokens: list[int] | None = None, plans: list[str] | None = None) -> None:
    plans = plans or (["w4", "w8", "mixed"] if quick else ["w3", "w4", "w6", "w8", "mixed"])
    for name in shapes:
        shape = SHAPES[name]
        try:
            speed_shape(name, *shape, plans=plans, quick=quick, tokens=tokens)
        except Exception as exc:  # noqa: BLE001 - one shape failing must not hide the others
            add(dict(section="speed", shape=name, error=f"{type(exc).__name__}: {str(exc)[:300]}"))
            log(f"{name}: FAILED {type(exc).__name__}: {exc}")
        torch.cuda.empty_cache()


def speed_shape(name: str, E: int, D: int, F: int, k: int, plans: list[str], quick: bool,
                tokens: list[int] | None = None) -> None:
    t_build = time.time()
    moe = build_synthetic_moe(E, D, F, P, SEED_BITS, device=DEV, seed=21, shuffle=False)
    log(f"{name}: pool {moe.pool.numel() / 2**30:.2f} GiB built in {time.time() - t_build:.1f}s")
    gen = torch.Generator(device=DEV).manual_seed(3)
    gcpu = torch.Generator().manual_seed(4)
    q_dev, po_dev, lo_dev = moe.tables(torch.full((E, 2), 4))
    wgu = torch.randn(E, 2 * F, D, device=DEV, dtype=torch.float16) / D ** 0.5
    wd = torch.randn(E, D, F, device=DEV, dtype=torch.float16) / F ** 0.5
    widths = {plan: plan_widths(plan, E, gcpu) for plan in plans}
    for T in tokens or ([1, 4, 16] if quick else [1, 4, 16, 64]):
        sets = [routing(T, E, k, gen) for _ in range(ROUTING_SETS)]
        hiddens = [torch.randn(T, D, generator=gen, device=DEV).half() for _ in sets]
        fp16 = [capture(fp16_expert_step(h, s[0], s[1], wgu, wd, F)) for h, s in zip(hiddens, sets)]
        us_fp16 = time_cycle([g.replay for g in fp16])
        active = [torch.unique(s[0]).tolist() for s in sets]
        fp16_bytes = statistics.mean(len(a) * 2 * (3 * F * D) for a in active)
        us_grouped, grouped_err = None, None
        try:
            wgu_t = wgu.to(torch.bfloat16).transpose(1, 2)  # [E, D, 2F], column-major per expert
            wd_t = wd.to(torch.bfloat16).transpose(1, 2)
            grouped = [capture(grouped_step(h.to(torch.bfloat16), s[0], s[1], wgu_t, wd_t, F, E))
                       for h, s in zip(hiddens, sets)]
            us_grouped = time_cycle([g.replay for g in grouped])
            del wgu_t, wd_t, grouped
        except Exception as exc:  # noqa: BLE001 - recorded, not hidden
            grouped_err = f"{type(exc).__name__}: {str(exc)[:160]}"
        for plan, (q, lut_width) in widths.items():
            moe.write_tables(q, q_dev, lo_dev)
            graphs = [capture(lambda h=h, s=s: moe_forward(h, s[0], s[1], moe.pool_words, moe.pool_halves, q_dev,
                                                            po_dev, lo_dev, D, F, P, lut_width))
                      for h, s in zip(hiddens, sets)]
            us = time_cycle([g.replay for g in graphs])
            del graphs
            nbytes = statistics.mean(sum(block_bytes(D, F, int(q[e, 0]), int(q[e, 1])) for e in a) for a in active)
            tbs = nbytes / (us * 1e-6) / 1e12
            row = dict(section="speed", shape=name, E=E, D=D, F=F, top_k=k, T=T, plan=plan, dtype="float16",
                       lut_width=lut_width,
                       active_experts=statistics.mean(len(a) for a in active), us=us, bytes_read=nbytes,
                       tb_per_s=tbs, frac_of_copy_ceiling=tbs / CEIL["copy_tb_per_s"],
                       us_fp16_cublas_graph=us_fp16, fp16_bytes=fp16_bytes,
                       fp16_frac_of_copy_ceiling=fp16_bytes / (us_fp16 * 1e-6) / 1e12 / CEIL["copy_tb_per_s"],
                       speedup_vs_fp16=us_fp16 / us, us_grouped_mm_bf16_graph=us_grouped,
                       speedup_vs_grouped=(us_grouped / us) if us_grouped else None, grouped_error=grouped_err)
            add(row)
            log(f"{name} T={T} {plan}: {us:.1f} us, {tbs:.2f} TB/s ({row['frac_of_copy_ceiling']:.0%}), "
                f"fp16 {us_fp16:.1f} us (x{us_fp16 / us:.2f}), grouped {us_grouped}")
        del fp16
        _KEEP.clear()
    del moe, wgu, wd


SPLIT_SIZINGS = ((16, 2048), (8, 2048), (4, 2048), (8, 4096), (4, 4096), (2, 8192))  # (fewest words, target blocks)
SPLIT_PLANS = ("w4", "w6", "w8")  # the LUT classes 4, 7 (the engine's for widths 5..7) and 8


def splits(shapes: list[str], tokens: list[int] | None = None, plans: list[str] | None = None) -> None:
    """Decode time per layer under CUDA graphs for each split-K sizing of the plan's LUT class (the other classes
    keep theirs); outputs checked against the default sizing's."""
    default = dict(mk.SPLIT_SIZING)
    try:
        for name in shapes:
            E, D, F, k = SHAPES[name]
            moe = build_synthetic_moe(E, D, F, P, SEED_BITS, device=DEV, seed=21, shuffle=False)
            q_dev, po_dev, lo_dev = moe.tables(torch.full((E, 2), 4))
            gen = torch.Generator(device=DEV).manual_seed(5)
            widths = {plan: plan_widths(plan, E, torch.Generator().manual_seed(4)) for plan in plans or SPLIT_PLANS}
            for T in tokens or (1, 4):
                sets = [routing(T, E, k, gen) for _ in range(ROUTING_SETS)]
                hiddens = [torch.randn(T, D, generator=gen, device=DEV).half() for _ in sets]
                for plan, (q, cls) in widths.items():
                    moe.write_tables(q, q_dev, lo_dev)
                    call = [lambda h=h, s=s, c=cls: moe_forward(
                        h, s[0], s[1], moe.pool_words, moe.pool_halves, q_dev, po_dev, lo_dev, D, F, P, c)
                        for h, s in zip(hiddens, sets)]
                    mk.SPLIT_SIZING.update(default)
                    want = call[0]()
                    for min_words, target in SPLIT_SIZINGS:
                        mk.SPLIT_SIZING[mk.split_class(cls)] = min_words, target, target
                        err = rel(call[0](), want)
                        graphs = [capture(c) for c in call]
                        us = time_cycle([g.replay for g in graphs])
                        del graphs
                        slots = min(E, T * k)
                        blocks = [-(-n // mk.ROWS) * -(-num_words(kk) // mk._words_per_split(
                            num_words(kk), -(-n // mk.ROWS), slots, cls, T)) * slots
                            for n, kk in ((2 * F, D), (D, F))]
                        add(dict(section="splits", shape=name, T=T, plan=plan, lut_width=cls,
                                 bits=int(q[0, 0]) if plan.startswith("w") else None, min_split_words=min_words,
                                 target_blocks=target, blocks_gate_up_down=blocks, us=us, rel_err_vs_default=err,
                                 passed=err < 1e-3))
                        log(f"{name} T={T} {plan} min_words={min_words} target={target}: {us:.1f} us, blocks "
                            f"{blocks}, rel {err:.1e}")
                        _KEEP.clear()
            del moe
            torch.cuda.empty_cache()
    finally:
        mk.SPLIT_SIZING.update(default)


# ---------------------------------------------------------------------------------------------- prefill

BEFORE = Path(__file__).resolve().parent / "results" / "moe_kernel_bench-nvidia-h200-20261129-full.json"


def prefill(shapes: list[str]) -> None:
    """The prefill path (T > 64) alone, so it needs no decode-kernel compile: per shape, correctness at mixed widths
    3..8 (fp16, bf16) against the twin; then at 4 bits for T in {64, 256, 2048} (2048 = the engine's 4 x 512-token
    chunk) and both dtypes: GPU time per layer (eager, CUDA events), host time of one call from an idle GPU, and one
    dequantize launch alone (bytes written + read against the copy ceiling). `us_before` is the same measurement
    (fp16, T 64/256) of the previous prefill path, from the committed result file named in `before_file`."""
    before = {}
    if BEFORE.is_file():
        for r in json.loads(BEFORE.read_text())["rows"]:
            if r.get("section") == "prefill":
                before[(r["shape"], r["T"])] = r["us_prefill_path_eager"]
    for name in shapes:
        E, D, F, k = SHAPES[name]
        moe = build_synthetic_moe(E, D, F, P, SEED_BITS, device=DEV, seed=21, shuffle=False)
        gen = torch.Generator(device=DEV).manual_seed(9)
        gcpu = torch.Generator().manual_seed(10)
        mixed = torch.randint(SEED_BITS, P + 1, (E, 2), generator=gcpu)
        q_dev, po_dev, lo_dev = moe.tables(mixed)
        for dtype in (torch.float16, torch.bfloat16):
            ids, w = routing(256, E, k, gen)
            h = torch.randn(256, D, generator=gen, device=DEV).to(dtype)
            args = (h, ids, w, moe.pool_words, moe.pool_halves, q_dev, po_dev, lo_dev, D, F, P)
            out = moe_forward(*args)
            err = rel(out, moe_forward_reference(*args))
            ok = bool(torch.isfinite(out).all()) and out.dtype == dtype and err <= 1e-2
            add(dict(section="prefill", check="correctness", shape=name, T=256, dtype=str(dtype).split(".")[-1],
                     plan="mixed3-8", rel_err=err, passed=ok))
            log(f"{name} prefill correctness {dtype}: rel_err={err:.2e} {'ok' if ok else 'FAIL'}")
        moe.write_tables(torch.full((E, 2), 4), q_dev, lo_dev)
        G = pf.prefill_group(D, F)
        for T in (64, 256, 2048):
            ids, w = routing(T, E, k, gen)
            n_routed = int(torch.unique(ids).numel())
            for dtype in (torch.float16, torch.bfloat16):
                h = torch.randn(T, D, generator=gen, device=DEV).to(dtype)
                # the LUT width the runner passes for a uniform 4-bit layer (until 2badfdb the prefill took P)
                args = (h, ids, w, moe.pool_words, moe.pool_halves, q_dev, po_dev, lo_dev, D, F, lut_class(4))
                us = time_cycle([lambda: pf.prefill_forward(*args)], reps=5, warm=1)
                host = []
                for _ in range(5):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    pf.prefill_forward(*args)
                    host.append((time.perf_counter() - t0) * 1e6)
                # one dequantize launch of a full group (the first G routed experts), both kinds
                n = min(G, n_routed)
                wdt = torch.bfloat16 if dtype == torch.bfloat16 else torch.float16
                scratch = pf.prefill_scratch(n, D, F, wdt, DEV)
                slots = torch.unique(ids).long()
                us_dq, us_dq_p = (time_cycle([functools.partial(dequantize, 0, n)], reps=10) for dequantize in (
                    pf._dequantizer(moe.pool_words, moe.pool_halves, q_dev, po_dev, lo_dev, slots, D, F, lw, scratch)
                    for lw in (lut_class(4), P)))
                dq_bytes = scratch.numel() * 2 + n * block_bytes(D, F, 4, 4)
                tbs = dq_bytes / (us_dq * 1e-6) / 1e12
                del scratch
                row = dict(section="prefill", check="speed", shape=name, T=T, dtype=str(dtype).split(".")[-1],
                           plan="w4", routed_experts=n_routed, group=G, us_prefill_path_eager=us,
                           host_us_per_call=statistics.median(host), us_dequant_launch=us_dq,
                           us_dequant_launch_lut_P=us_dq_p,
                           dequant_experts=n, dequant_bytes=dq_bytes, dequant_tb_per_s=tbs,
                           dequant_frac_of_copy_ceiling=tbs / CEIL["copy_tb_per_s"],
                           grouped_mm_kernel=dtype == torch.bfloat16 and pf._has_grouped_kernel(h.device),
                           us_before=before.get((name, T)) if dtype == torch.float16 else None,
                           before_file=BEFORE.name)
                add(row)
                log(f"{name} prefill T={T} {dtype}: {us:.0f} us/layer (before {row['us_before']}), host "
                    f"{row['host_us_per_call']:.0f} us, dequant {n} experts {us_dq:.0f} us "
                    f"(LUT of {P} bits {us_dq_p:.0f}) {tbs:.2f} TB/s ({row['dequant_frac_of_copy_ceiling']:.0%})")
        del moe
        torch.cuda.empty_cache()


def table() -> None:
    print("\nshape              T  plan    us    TB/s  frac  fp16us  x_fp16  grouped_us")
    for r in ROWS:
        if r["section"] == "speed" and "error" not in r:
            g = f"{r['us_grouped_mm_bf16_graph']:.1f}" if r["us_grouped_mm_bf16_graph"] else "-"
            print(f"{r['shape'][:18]:18s} {r['T']:2d} {r['plan']:5s} {r['us']:7.1f} {r['tb_per_s']:5.2f} "
                  f"{r['frac_of_copy_ceiling']:5.0%} {r['us_fp16_cublas_graph']:7.1f} {r['speedup_vs_fp16']:6.2f} {g}")
    checks = [r for r in ROWS if "passed" in r]
    bad = [r for r in checks if not r["passed"]]
    print(f"correctness+graph+prefill checks: {len(checks)} run, "
          f"{len(bad)} failed; copy ceiling {CEIL.get('copy_tb_per_s', 0):.2f} TB/s")


CMD = "python benchmarks/moe_kernel_bench.py"


def main() -> int:
    global CMD
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer T values and checks")
    ap.add_argument("--sections", default="correctness,graph,speed,prefill")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma list of " + ", ".join(SHAPES))
    ap.add_argument("--label", default=None, help="suffix of the result file name (a variant measured the same day)")
    ap.add_argument("--out-dir", default=None, help="where the result file goes (run_h200.sh abfiles' warm-up runs)")
    ap.add_argument("--tokens", default=None, help="comma list of T for the speed section (default 1,4,16 or 1,4,16,64)"
                    " and the splits section (default 1,4)")
    ap.add_argument("--plans", default=None, help="comma list of speed and splits plans: wN, wNcC (N bits in LUT "
                    "class C), mA-B (widths drawn from A..B), mixed; speed's default w4,w8,mixed or w3,w4,w6,w8,mixed, "
                    "splits' w4,w6,w8")
    a = ap.parse_args()
    plans = a.plans.split(",") if a.plans else None
    for plan in plans or []:
        plan_widths(plan, 1, torch.Generator())  # a bad plan name fails here, not after the compile
    STATE["label"], STATE["out_dir"] = a.label, a.out_dir
    CMD = ("python benchmarks/moe_kernel_bench.py" + (" --quick" if a.quick else "")
           + f" --sections {a.sections} --shapes {a.shapes}" + (f" --label {a.label}" if a.label else "")
           + (f" --tokens {a.tokens}" if a.tokens else "") + (f" --plans {a.plans}" if a.plans else ""))
    torch.manual_seed(0)
    CEIL["copy_tb_per_s"] = copy_ceiling()
    CEIL["device"] = torch.cuda.get_device_name(0)
    log(f"copy ceiling {CEIL['copy_tb_per_s']:.2f} TB/s")
    sections = a.sections.split(",")
    tokens = [int(t) for t in a.tokens.split(",")] if a.tokens else None
    if {"correctness", "graph", "speed", "splits"} & set(sections):  # the decode kernel's compile, timed on its own
        t = time.time()
        moe = build_synthetic_moe(2, 256, 128, P, SEED_BITS, device=DEV)
        qd, po, lo = moe.tables(torch.full((2, 2), 4))
        moe_forward(torch.randn(1, 256, device=DEV).half(), torch.tensor([[0, 1]], dtype=torch.int32, device=DEV),
                    torch.ones(1, 2, device=DEV), moe.pool_words, moe.pool_halves, qd, po, lo, 256, 128, P)
        torch.cuda.synchronize()
        CEIL["first_call_compile_s"] = time.time() - t
        log(f"first call (Numba compile) {CEIL['first_call_compile_s']:.1f}s")
    for sec, fn in (("correctness", lambda: correctness(a.quick)), ("graph", graph_test)):
        if sec in sections:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - recorded as a failed check
                add(dict(section=sec, passed=False, error=f"{type(exc).__name__}: {str(exc)[:300]}"))
                log(f"{sec}: FAILED {type(exc).__name__}: {exc}")
    if "speed" in sections:
        speed(a.quick, a.shapes.split(","), tokens, plans)
    if "splits" in sections:
        splits(a.shapes.split(","), tokens, plans)
    if "prefill" in sections:
        try:
            prefill(a.shapes.split(","))
        except Exception as exc:  # noqa: BLE001 - recorded as a failed check
            add(dict(section="prefill", passed=False, error=f"{type(exc).__name__}: {str(exc)[:300]}"))
            log(f"prefill: FAILED {type(exc).__name__}: {exc}")
    save(complete=True)
    table()
    return 0 if all(r.get("passed", True) for r in ROWS) else 1


if __name__ == "__main__":
    raise SystemExit(main())
