"""Several engines on one node: one shared page store, concurrent reloads, the cluster planner, batch evaluation.

    python -m benchmarks.multi_engine --engines 2 --gpus-per-engine 0.5    # one GPU shared by two engines
    python -m benchmarks.multi_engine --engines 8 --gpus-per-engine 1      # an 8-GPU node
    python -m benchmarks.multi_engine --device cpu --engines 2 --engine-cpus 0.5   # CPU check

Starts a local Ray cluster without the dashboard (or joins --address, or the cluster this process already joined),
converts the bundled model to an AP checkpoint (short calibration; cached), makes the node's page-store actor write
the planes once, starts N EngineActors, then measures:
(a) store: the planes exist once on the node: every engine maps the same file (same inode), the engines'
    proportional set sizes of that mapping (Pss splits each shared page among the processes that map it) add up
    to about one copy, not N, and the store root's used bytes grow by the store when it is written and by ~0 when
    the N engines start, pin and read it;
(b) reload: through its own mover, each engine drops every expert block to the seed width and reloads its width
    (the engine's reload path: one copy per plane/LUT slot), and copies its whole pinned store mapping to its
    device in bulk (the mapping's raw speed); first each engine alone, then all at once from a common start time.
    The aggregate counts all bytes over the union of the reload intervals; `overlap_frac` says how much of that
    union had two or more engines reloading. The ceiling is a private pinned buffer copied by each engine alone;
(c) planner: engine i serves code (even i) or prose (odd i), pushes its routing mass to the cluster planner, then
    adopts the merge; the merge is recomputed here from the planner's stored tables, and each engine's planner
    must then cut exactly the merged buckets;
(d) eval: the batch evaluation job's own code (actors/jobs/evaluate.py) over engines[:1] and all N (or the
    --eval-counts given): throughput, and perplexity and greedy samples identical to the one-engine run;
(e) serve: the OpenAI-compatible Serve app (actors/openai_app.py) with N, then 1 engine replicas (one per
    --gpus-per-engine share; the ingress takes no CPU), under a closed-loop HTTP load of --serve-clients threads
    (stdlib urllib), non-streaming then streaming completions of exactly --serve-tokens tokens: requests, errors,
    tokens/s, P50/P99 latency and time to first token, and the N-vs-1 ratios. The engine sections' actors are
    gone by then, so each replica has its GPU share to itself. --sections picks a subset.
Experts (--expert-impl): "reference" (default) runs the torch twin of the fused kernel on the GPU: the point here
is the actor plumbing, and the kernel's first compile (~67 s on the H200) would take half the time budget; "auto"
runs the kernel, compiled once in a child process into NUMBA_CACHE_DIR, which every engine then loads.
On the GPU box (no Ray there) carry the wheels of `../shared/tools/gpu-wheels --ray fastapi==0.165.0
starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
typing-inspection==0.4.5 opentelemetry-api==1.45.2 grpcio-reflection==1.84.0 protobuf==7.36.2`: grpcio-reflection
must match the image's grpcio (1.84.0 on 2026-11-29; 1.85.1 refused to import there and section (e) failed).
`ray job submit` (benchmarks/eval_job_scaling.py) needs the dashboard's job API too, whose imports the image lacks:
add aiohttp-cors==0.8.1 colorful==0.5.8 googleapis-common-protos==1.76.0 opencensus==0.11.4
opencensus-context==0.1.3 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2
opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-prometheus==0.66b2 (~1.5 MB; ran there 2026-11-29).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import write_result

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "models" / "pw-tiny-moe"
DATA = ROOT / "data"
_MAP_HEADER = re.compile(r"^[0-9a-f]+-[0-9a-f]+\s")
ENGINE_SECTIONS = ("store", "reload", "planner", "eval")  # over EngineActors (measure)
SECTIONS = (*ENGINE_SECTIONS, "serve")  # serve: Serve replicas behind the HTTP ingress (measure_serve)


# ---------------------------------------------------------------- run inside an engine (EngineActor.call)

def _sync(llm) -> None:
    if llm.device.type == "cuda":
        torch.cuda.synchronize(llm.device)


def _wait_until(start_at: float | None) -> None:
    if start_at is not None and start_at > time.time():
        time.sleep(start_at - time.time())


def mapping_info(llm) -> dict:
    """This process's view of the page store: the file, the inode it maps, and that mapping's Rss and Pss."""
    store = llm.mover.store
    pages = os.path.realpath(Path(store.path) / "pages.bin")
    st = os.stat(pages)
    inodes, rss, pss, current = set(), 0, 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if _MAP_HEADER.match(line):
                current = len(parts) >= 6 and parts[5] == pages
                if current:
                    inodes.add((parts[3], int(parts[4])))
            elif current and parts[0] == "Rss:":
                rss += int(parts[1]) << 10
            elif current and parts[0] == "Pss:":
                pss += int(parts[1]) << 10
    return {"pid": os.getpid(), "store_file": pages, "file_dev": st.st_dev, "file_inode": st.st_ino,
            "mapped_inodes": sorted(i for _, i in inodes), "mapping_rss_bytes": rss, "mapping_pss_bytes": pss,
            "pinned": bool(getattr(store, "pinned", False))}


def reload_cycles(llm, low: int, repeats: int, start_at: float | None) -> dict:
    """`repeats` times: every block offloaded to `low` bits, then reloaded to its width through the engine's mover;
    returns the reload bytes and the wall-clock interval of each reload (issue to last copy done).

    The mover's per-step reload pacing (if it has one) is off meanwhile: no engine step runs here, and this
    measures how fast the store feeds the device, not the pacing policy."""
    mover = llm.mover
    if mover is None:
        raise ValueError("this engine serves dense weights: no planes to reload")
    pace = getattr(mover, "pace", None)
    if pace is not None:
        mover.pace = None
    try:
        return _reload_cycles(llm, mover, low, repeats, start_at)
    finally:
        if pace is not None:
            mover.pace = pace


def _reload_cycles(llm, mover, low: int, repeats: int, start_at: float | None) -> dict:
    home = llm.committed_widths()
    if int(home.min()) <= low:
        raise ValueError(f"some block is already at {int(home.min())} <= {low} bits: nothing to reload")

    def settle() -> None:  # commit what is copied, free what retired
        for _ in range(100):
            _sync(llm)
            mover.boundary()
            if mover.idle():
                return
        raise RuntimeError(f"the mover did not settle: {len(mover._moves)} moves pending, {len(mover._retiring)} "
                           f"slots retiring, steps launched {mover.launched}, completed {mover.completed}")

    def move(widths) -> None:
        for i, b in enumerate(widths):
            if not mover.request(i, int(b)):
                raise RuntimeError(f"block {i}: the mover refused a move to {int(b)} bits (pool too small?)")

    settle()
    intervals, nbytes = [], 0
    _wait_until(start_at)
    for _ in range(repeats):
        move(np.full_like(home, low))
        settle()
        before, t0 = mover.stats.bytes_copied, time.time()
        move(home)
        _sync(llm)
        intervals.append((t0, time.time()))
        nbytes += mover.stats.bytes_copied - before
        settle()
    if not np.array_equal(llm.committed_widths(), home):
        raise RuntimeError("widths did not return to where they started")
    return {"bytes": nbytes, "intervals": intervals}


def store_copy(llm, repeats: int, start_at: float | None, ceiling: bool = False) -> dict:
    """Copy the whole (pinned) store mapping to this engine's device `repeats` times; with `ceiling`, also a
    private pinned buffer of the same size (the host-to-device ceiling of this process)."""
    store = llm.mover.store
    with warnings.catch_warnings():  # a read-only mapping: only read here
        warnings.simplefilter("ignore", UserWarning)
        src = torch.from_numpy(store.array)
    dst = torch.empty(src.numel(), dtype=torch.uint8, device=llm.device)

    def timed(source: torch.Tensor, wait: float | None) -> tuple[float, float]:
        dst.copy_(source, non_blocking=True)  # warm-up
        _sync(llm)
        _wait_until(wait)
        t0 = time.time()
        for _ in range(repeats):
            dst.copy_(source, non_blocking=True)
        _sync(llm)
        return t0, time.time()

    out = {"bytes": repeats * src.numel(), "intervals": [timed(src, start_at)]}
    if ceiling:
        private = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=llm.device.type == "cuda").fill_(1)
        t0, t1 = timed(private, None)
        out["ceiling_gb_per_s"] = out["bytes"] / (t1 - t0) / 1e9
    return out


def routing_view(llm) -> dict:
    return {"mass": llm.routing_mass(), "n_buckets": llm.planner.knobs.n_buckets}


# ---------------------------------------------------------------- driver side

def union_and_overlap(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """(length of the union of the intervals, length covered by two or more of them)."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    union = overlap = 0.0
    depth, last = 0, None
    for t, d in events:
        if last is not None:
            union += (t - last) if depth >= 1 else 0.0
            overlap += (t - last) if depth >= 2 else 0.0
        depth, last = depth + d, t
    return union, overlap


def merge_here(tables: dict[str, tuple[np.ndarray, float]]) -> np.ndarray:
    """Token-weighted mean of row-normalised routing masses (the planner's documented rule, recomputed)."""
    w = np.array([t for _, t in tables.values()], dtype=np.float64)
    w = w if w.sum() > 0 else np.ones_like(w)
    rows = [m.astype(np.float64) / m.astype(np.float64).sum(1, keepdims=True) for m, _ in tables.values()]
    mixed = sum(wi * r for wi, r in zip(w, rows)) / w.sum()
    return mixed / mixed.sum(1, keepdims=True)


def buckets_here(mass: np.ndarray, n_buckets: int) -> np.ndarray:
    """Rank experts per layer, hottest first (ties by index), and cut the ranks into n_buckets equal groups."""
    out = np.empty(mass.shape, dtype=np.int64)
    for layer, row in enumerate(mass):
        for rank, e in enumerate(sorted(range(len(row)), key=lambda e: (-row[e], e))):
            out[layer, e] = rank * n_buckets // len(row)
    return out


def root_used_bytes(root: str) -> int:
    """Bytes in use on the filesystem of `root` (a tmpfs: what files there hold in memory). The store should add
    one copy of the planes and the N engines nothing (a busy shared machine adds noise)."""
    vfs = os.statvfs(root)
    return (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize


def prepare_model(args) -> Path:
    """The AP checkpoint to serve: --model itself if it is one, else converted once on the CPU (short calibration:
    a few seconds for the bundled model; the numbers here do not depend on its quality)."""
    from pagedweight.apformat import MANIFEST

    src = Path(args.model).resolve()
    if (src / MANIFEST).is_file():
        return src
    out = Path(args.cache_dir) / f"{src.name}-ap-s{args.calib_seqs}"
    if not (out / MANIFEST).is_file():
        from pagedweight.convert import convert

        t0 = time.perf_counter()
        convert(src, out, DATA / "calib.txt", device="cpu", num_seqs=args.calib_seqs, seq_len=256)
        print(f"converted {src.name} -> {out} in {time.perf_counter() - t0:.1f} s", flush=True)
    return out


def check_store_room(ap_dir: Path, root: str) -> None:
    """A clear error before the store actor hits ENOSPC on a small tmpfs (containers default /dev/shm to 64 MiB)."""
    from pagedweight.apformat import load_ap
    from pagedweight.runner import planes_id

    ap = load_ap(ap_dir, verify=False)
    if (Path(root) / f"pagedweight-{planes_id(ap)}" / "index.msgpack").is_file():
        return  # already written
    need = ap.planes_file.stat().st_size
    vfs = os.statvfs(root)
    free = vfs.f_bavail * vfs.f_frsize
    if free < need + (8 << 20):
        raise SystemExit(f"{root} has {free / 2**20:.0f} MiB free; the page store needs {need / 2**20:.0f} MiB "
                         f"(+8 MiB slack). Give the machine a larger /dev/shm (docker --shm-size) or pass "
                         f"--store-root on another tmpfs.")


def compile_kernels(ap_dir: str, store_dir: str, device: str = "cuda") -> None:
    """One short engine run that goes through every fused kernel: prefill (> 64 tokens: dequantize) and decode
    (route + GEMV); with NUMBA_CACHE_DIR set, the compiled kernels land there."""
    from pagedweight.engine import LLM
    from pagedweight.sampling import SamplingParams

    llm = LLM(ap_dir, device=device, page_store_dir=store_dir)
    llm.generate(["def f(x):\n    return x\n" * 12], SamplingParams(max_tokens=3, ignore_eos=True))


def warm_kernels(ap_dir: Path, store_root: str) -> float:
    """Compile the fused kernels once, in a child process (no CUDA context or store mapping left in this one)."""
    from pagedweight.apformat import load_ap
    from pagedweight.runner import planes_id

    store = Path(store_root) / f"pagedweight-{planes_id(load_ap(ap_dir, verify=False))}"
    code = "import sys; from benchmarks.multi_engine import compile_kernels; compile_kernels(*sys.argv[1:])"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, str(ap_dir), str(store)], check=True, cwd=ROOT)
    return time.perf_counter() - t0


def start_cluster(args) -> bool:
    """Join or start Ray; True if this process started the cluster (and so shuts it down)."""
    import ray

    if ray.is_initialized():
        return False
    if args.address:
        ray.init(address=args.address, namespace="pagedweight", log_to_driver=args.verbose)
        return False
    ray.init(address="local", num_cpus=args.num_cpus,
             num_gpus=0 if args.device == "cpu" else torch.cuda.device_count(),
             include_dashboard=False, namespace="pagedweight", object_store_memory=args.object_store_mib << 20,
             logging_level="WARNING", log_to_driver=args.verbose)
    return True


def _phase(name: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:6.1f} s] {name}", flush=True)


def measure(args, ap_dir: Path, sections: set[str]) -> tuple[list[dict], dict, dict]:
    """Sections store, reload, planner and eval, over N EngineActors."""
    import ray

    from pagedweight.actors.engine_actor import EngineConfig, start_engines
    from pagedweight.actors.jobs.evaluate import build_parser, evaluate, prompts_from, token_windows
    from pagedweight.actors.page_store_actor import page_store_for_node
    from pagedweight.actors.planner_actor import decode_reply, decode_tables, get_or_create_planner
    from pagedweight.apformat import load_ap
    from pagedweight.runner import planes_id
    from pagedweight.sampling import SamplingParams

    t_start = time.perf_counter()
    rows: list[dict] = []
    ap = load_ap(ap_dir, verify=False)
    cpu = args.device == "cpu"
    if not cpu and ray.cluster_resources().get("GPU", 0) == 0:
        raise SystemExit("--device cuda but the Ray cluster has no GPU")
    opts = {"kv_cache_bytes": args.kv_cache_mib << 20, "max_num_seqs": 32}
    cfg = EngineConfig(str(ap_dir), device="cpu" if cpu else "auto", engine_options=opts, store_root=args.store_root,
                       routing_sync_s=math.inf, expert_impl=args.expert_impl)
    used = [root_used_bytes(args.store_root)]
    try:
        store_dir = ray.get(page_store_for_node(root=args.store_root).ensure.remote(str(ap_dir)))
    except ray.exceptions.RayTaskError as exc:
        raise SystemExit(f"the page store actor could not write the planes under {args.store_root}: {exc}") from exc
    used.append(root_used_bytes(args.store_root))
    engines = start_engines(cfg, args.engines, cpus_per_engine=args.engine_cpus,
                            gpus_per_engine=0 if cpu else args.gpus_per_engine)
    infos = ray.get([e.info.remote() for e in engines], timeout=600)
    names = [i["engine_id"] for i in infos]
    _phase(f"{len(engines)} engines up on {[i['device'] for i in infos]}, gpu ids {[i['gpu_ids'] for i in infos]}",
           t_start)

    ceiling, planner_extra = None, {}
    texts = {"code": (DATA / "eval.txt").read_text(), "prose": (DATA / "eval_prose.txt").read_text()}
    # (b) reloads, alone then together (first, so that (a) sees every store page touched by every engine)
    if "reload" in sections:
        low = ap.seed_bits
        solo_copy = [ray.get(e.call.remote(store_copy, args.probe_copies, None, True)) for e in engines]
        solo_reload = [ray.get(e.call.remote(reload_cycles, low, args.probe_cycles, None)) for e in engines]
        ceiling = max(s["ceiling_gb_per_s"] for s in solo_copy)

        def rate(res: dict) -> float:
            return res["bytes"] / sum(b - a for a, b in res["intervals"]) / 1e9

        def add_rows(mode: str, path: str, results: list[dict]) -> None:
            for name, res in zip(names, results):
                rows.append({"phase": "reload", "mode": mode, "path": path, "engine": name, "bytes": res["bytes"],
                             "s": sum(b - a for a, b in res["intervals"]), "gb_per_s": rate(res),
                             "frac_of_copy_ceiling": rate(res) / ceiling})
            union, overlap = union_and_overlap([iv for res in results for iv in res["intervals"]])
            total = sum(res["bytes"] for res in results)
            rows.append({"phase": "reload", "mode": mode, "path": path, "engine": "all", "bytes": total, "s": union,
                         "gb_per_s": total / union / 1e9, "frac_of_copy_ceiling": total / union / 1e9 / ceiling,
                         "overlap_frac": overlap / union if union else 0.0})

        add_rows("solo", "store_copy", solo_copy)
        add_rows("solo", "mover", solo_reload)
        copies = [max(1, round(args.reload_seconds * rate(s) * 1e9 / (s["bytes"] / args.probe_copies)))
                  for s in solo_copy]
        cycles = [max(1, round(args.reload_seconds * rate(s) * 1e9 / (s["bytes"] / args.probe_cycles)))
                  for s in solo_reload]
        start_at = time.time() + args.barrier_s
        together = ray.get([e.call.remote(store_copy, n, start_at) for e, n in zip(engines, copies)])
        add_rows("concurrent", "store_copy", together)
        start_at = time.time() + args.barrier_s
        together = ray.get([e.call.remote(reload_cycles, low, n, start_at) for e, n in zip(engines, cycles)])
        add_rows("concurrent", "mover", together)
        _phase("reloads measured", t_start)

    # (a) the planes exist once on the node
    if "store" in sections:
        maps = ray.get([e.call.remote(mapping_info) for e in engines])
        used.append(root_used_bytes(args.store_root))
        store_file = Path(store_dir) / "pages.bin"
        st = store_file.stat()
        for name, m in zip(names, maps):
            rows.append({"phase": "store", "engine": name, **{k: v for k, v in m.items() if k != "mapped_inodes"},
                         "mapped_inode": m["mapped_inodes"][0] if len(m["mapped_inodes"]) == 1 else m["mapped_inodes"]})
        rows.append({"phase": "store", "engine": "node", "store_dir": store_dir, "store_file_bytes": st.st_size,
                     "store_allocated_bytes": st.st_blocks * 512, "engines": len(engines),
                     "bytes_if_one_copy_per_engine": len(engines) * st.st_size,
                     "sum_mapping_pss_bytes": sum(m["mapping_pss_bytes"] for m in maps),
                     "root_used_by_store_bytes": used[1] - used[0], "root_used_by_engines_bytes": used[2] - used[1],
                     "same_file_and_inode": len({(m["store_file"], m["file_dev"], m["file_inode"]) for m in maps}) == 1
                     and all(m["mapped_inodes"] == [st.st_ino] for m in maps)})
        _phase("store mappings read", t_start)

    # (c) planner: different traffic per engine, push, merge, adopt
    if "planner" in sections:
        kinds = ["code" if i % 2 == 0 else "prose" for i in range(len(engines))]
        params = SamplingParams(max_tokens=args.traffic_tokens, ignore_eos=True)
        traffic = []
        for i, (e, kind) in enumerate(zip(engines, kinds)):
            text = texts[kind][i * len(texts[kind]) // len(engines):]
            prompts = prompts_from(text, args.traffic_prompts, 300)
            traffic.append(e.generate_batch.remote([(p, params) for p in prompts]))
        ray.get(traffic)
        local = ray.get([e.call.remote(routing_view) for e in engines])
        pushed = [ray.get(e.sync_routing.remote(True)) for e in engines]  # one at a time: each adds its table
        adopted = ray.get([e.sync_routing.remote(False) for e in engines])  # everyone takes the full merge
        planner = get_or_create_planner(planes_id(ap))  # the planner of this model's engines
        final = decode_reply(ray.get(planner.merged.remote()))
        tables = decode_tables(ray.get(planner.tables.remote()))
        want = merge_here(tables)
        n_buckets = local[0]["n_buckets"]
        for name, kind, loc, push, adopt in zip(names, kinds, local, pushed, adopted):
            rows.append({"phase": "planner", "engine": name, "traffic": kind, "pushed_tokens": push["pushed_tokens"],
                         "pushed_equals_local": bool(np.allclose(push["pushed_mass"], loc["mass"], atol=1e-6)),
                         "adopted_version": int(adopt["version"]), "merged_engines": len(adopt["engines"]),
                         "local_vs_merged_l1": float(np.abs(loc["mass"] - final["mass"]).sum(1).mean()),
                         "local_buckets_changed": int((buckets_here(loc["mass"], n_buckets) != final["buckets"]).sum()),
                         "engine_buckets_equal_merged": bool(np.array_equal(adopt["engine_buckets"],
                                                                            final["buckets"]))})
        rows.append({"phase": "planner", "engine": "planner", "version": int(final["version"]),
                     "engines_merged": final["engines"], "tokens": final["tokens"],
                     "merge_max_abs_err_vs_recomputed": float(np.abs(final["mass"] - want).max()),
                     "buckets_equal_recomputed": bool(np.array_equal(final["buckets"], buckets_here(want, n_buckets)))})
        planner_extra = {"merged_buckets": final["buckets"].tolist(),
                         "merged_mass": np.round(final["mass"], 5).tolist(),
                         "local_mass": {n: np.round(loc["mass"], 5).tolist() for n, loc in zip(names, local)}}
        _phase("planner merge checked", t_start)

    # (d) the evaluation job's code over 1 and N engines
    if "eval" in sections:
        job = build_parser().parse_args([str(ap_dir), "--mode", "all", "--ctx", str(args.eval_ctx), "--windows",
                                         str(args.eval_windows), "--num-prompts", str(args.eval_prompts),
                                         "--max-tokens", str(args.eval_tokens), "--shard", str(args.eval_shard)])
        warm = token_windows(ap_dir, texts["code"], args.eval_ctx, 1)
        ray.get([e.score.remote(warm) for e in engines])  # first forward at this shape off the clock
        first = None
        counts = sorted({len(engines) if c == "all" else int(c) for c in args.eval_counts.split(",")} | {1})
        if counts[-1] > len(engines):
            raise SystemExit(f"--eval-counts asks for {counts[-1]} engines, {len(engines)} are running")
        for n in counts:
            res = evaluate(job, engines[:n])
            ppl, gen = res["perplexity"], res["generation"]
            samples = [s["text"] for s in gen["samples"]]
            first = first or (ppl["ppl"], samples, ppl["elapsed_s"], gen["elapsed_s"])
            rows.append({"phase": "eval", "engines": n, "ppl": ppl["ppl"], "ppl_tokens": ppl["tokens"],
                         "ppl_tokens_per_s": ppl["tokens"] / ppl["elapsed_s"],
                         "ppl_windows_per_engine": ppl["windows_per_engine"],
                         "gen_tokens": gen["generated_tokens"], "gen_tokens_per_s": gen["tokens_per_s"],
                         "gen_prompts_per_engine": gen["prompts_per_engine"],
                         "ppl_speedup_vs_1": first[2] / ppl["elapsed_s"],
                         "gen_speedup_vs_1": first[3] / gen["elapsed_s"],
                         "identical_ppl": ppl["ppl"] == first[0], "identical_samples": samples == first[1]})
            _phase(f"evaluation over {n} engine(s)", t_start)
    for e in engines:
        ray.kill(e, no_restart=True)
    ceilings = {} if ceiling is None else {"pinned_h2d_gb_per_s" if not cpu else "private_copy_gb_per_s": ceiling}
    extra = {"engines": infos, "expert_impl": args.expert_impl, "checkpoint": str(ap_dir),
             "planner": planner_extra, "wall_s": time.perf_counter() - t_start}
    return rows, ceilings, extra


# ---------------------------------------------------------------- (e) serve: HTTP load on the OpenAI app

@dataclass
class Reply:
    """One HTTP completion as the client saw it; `error` says why it does not count."""

    start: float
    end: float
    ttft_s: float | None  # streaming: time to the first token chunk
    tokens: int
    text: str
    error: str | None


def http_completion(url: str, model: str, prompt: str, max_tokens: int, stream: bool, timeout: float = 120.0) -> Reply:
    """POST /v1/completions (greedy, ignore_eos: every request generates exactly max_tokens) with the stdlib client;
    a non-200 status, an error chunk, a stream without [DONE] or a short completion is an error."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, text, tokens, done, error = None, [], 0, not stream, None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            if not stream:
                out = json.loads(resp.read())
                text.append(out["choices"][0]["text"])
                tokens = out["usage"]["completion_tokens"]
            for raw in resp if stream else ():
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    error = f"error chunk: {event['error']['message']}"
                    break
                if event["choices"]:
                    ttft = time.perf_counter() - t0 if ttft is None else ttft
                    text.append(event["choices"][0]["text"])
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    except urllib.error.HTTPError as exc:
        error = f"HTTP {exc.code}: {exc.read()[:300]!r}"
    except (OSError, ValueError, KeyError) as exc:  # connection refused/reset, timeout, a malformed body
        error = f"{type(exc).__name__}: {exc}"
    if error is None and not done:
        error = "the stream ended without [DONE]"
    if error is None and tokens != max_tokens:
        error = f"{tokens} completion tokens, asked for {max_tokens}"
    return Reply(t0, time.perf_counter(), ttft, tokens, "".join(text), error)


def http_load(url: str, model: str, prompts: list[str], clients: int, seconds: float, max_tokens: int,
              stream: bool) -> dict:
    """A closed loop: `clients` threads each send one request after another until `seconds` have passed (requests
    in flight then still finish and count). Tokens/s = completion tokens of the good requests / wall time."""
    replies: list[Reply] = []
    lock = threading.Lock()
    t0 = time.perf_counter()
    deadline = t0 + seconds

    def client(i: int) -> None:
        k = i
        while time.perf_counter() < deadline:
            reply = http_completion(url, model, prompts[k % len(prompts)], max_tokens, stream)
            with lock:
                replies.append(reply)
            k += clients

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max([r.end for r in replies], default=time.perf_counter()) - t0
    good = [r for r in replies if r.error is None]
    latency = np.array([r.end - r.start for r in good]) * 1e3
    ttft = np.array([r.ttft_s for r in good if r.ttft_s is not None]) * 1e3

    def pct(a: np.ndarray, q: float) -> float | None:
        return float(np.percentile(a, q)) if a.size else None

    tokens = sum(r.tokens for r in good)
    return {"clients": clients, "wall_s": wall, "requests": len(good), "errors": len(replies) - len(good),
            "error_examples": sorted({r.error for r in replies if r.error})[:3], "completion_tokens": tokens,
            "tokens_per_s": tokens / wall, "requests_per_s": len(good) / wall,
            "latency_p50_ms": pct(latency, 50), "latency_p99_ms": pct(latency, 99), "latency_max_ms": pct(latency, 100),
            "ttft_p50_ms": pct(ttft, 50) if stream else None, "ttft_p99_ms": pct(ttft, 99) if stream else None}


def running_replicas(app_name: str, deployment: str = "EngineReplica") -> int:
    from ray import serve

    states = serve.status().applications[app_name].deployments[deployment].replica_states
    return int(sum(n for state, n in states.items() if str(getattr(state, "value", state)) == "RUNNING"))


def measure_serve(args, ap_dir: Path) -> list[dict]:
    """Section serve: the OpenAI app with N, then 1 engine replica(s) (each `--gpus-per-engine` of a GPU, or
    `--engine-cpus` CPUs on a CPU), under the same closed-loop HTTP load, non-streaming then streaming.
    Joins a running Serve instance (its HTTP port) under its own app name and route prefix, and deletes the app
    afterwards; starts Serve on 127.0.0.1:--serve-port otherwise, and shuts it down afterwards."""
    from ray import serve
    from ray.serve.context import _get_global_client

    from pagedweight.actors.jobs.evaluate import prompts_from
    from pagedweight.actors.openai_app import AppArgs, build_app

    t_start = time.perf_counter()
    cpu = args.device == "cpu"
    had_serve = _get_global_client(raise_if_no_controller_running=False) is not None
    if not had_serve:
        serve.start(http_options={"host": "127.0.0.1", "port": args.serve_port})
    prefix = f"/{args.serve_app}"
    url = f"http://127.0.0.1:{_get_global_client().http_config.port}{prefix}"
    prompts = prompts_from((DATA / "eval.txt").read_text(), args.serve_prompts, args.serve_prompt_chars)
    opts = {"kv_cache_bytes": args.kv_cache_mib << 20, "max_num_seqs": 32}
    rows: list[dict] = []
    texts: dict[int, list[str]] = {}
    # Each serve.run deploys new code versions, so Serve replaces every replica: each configuration starts cold
    # (its own engines, each warmed up by the unrecorded load) and the order does not matter.
    try:
        for n in sorted({1, args.engines}, reverse=True):
            app = build_app(AppArgs(model_dir=str(ap_dir), num_replicas=n, num_gpus_per_replica=0 if cpu
                                    else args.gpus_per_engine, engine_num_cpus=args.engine_cpus,
                                    engine_options=opts, expert_impl=args.expert_impl, store_root=args.store_root))
            serve.run(app, name=args.serve_app, route_prefix=prefix)  # returns once the new replicas are up
            deadline = time.monotonic() + 60
            while (replicas := running_replicas(args.serve_app)) != n and time.monotonic() < deadline:
                time.sleep(0.2)
            with urllib.request.urlopen(f"{url}/v1/models", timeout=60) as resp:
                model = json.loads(resp.read())["data"][0]["id"]
            _phase(f"serve: {replicas} replica(s) running at {url}", t_start)
            clients = args.serve_clients * (n if args.serve_clients_per_replica else 1)
            warm = http_load(url, model, prompts, clients, args.serve_warmup_s, args.serve_tokens, False)
            # greedy text, one request at a time (batch 1: the same numerics in every configuration)
            checks = [http_completion(url, model, p, args.serve_tokens, False) for p in prompts[:4]]
            texts[n] = [r.text for r in checks]
            for stream in (False, True):
                res = http_load(url, model, prompts, clients, args.serve_seconds, args.serve_tokens, stream)
                rows.append({"phase": "serve", "replicas": n, "replicas_running": replicas, "stream": stream,
                             "max_tokens": args.serve_tokens, **res, "warmup_errors": warm["errors"],
                             "text_check_errors": sum(r.error is not None for r in checks)})
                _phase(f"serve: {n} replica(s), stream={stream}: {res['requests']} requests, "
                       f"{res['errors']} errors, {res['tokens_per_s']:.0f} tokens/s", t_start)
    finally:
        serve.delete(args.serve_app)
        if not had_serve:
            serve.shutdown()
    rows.sort(key=lambda r: (r["replicas"], r["stream"]))
    base = {r["stream"]: r for r in rows if r["replicas"] == 1}
    for r in rows:
        one = base[r["stream"]]
        r["tokens_per_s_vs_1"] = r["tokens_per_s"] / one["tokens_per_s"] if one["tokens_per_s"] else None
        r["latency_p99_vs_1"] = (r["latency_p99_ms"] / one["latency_p99_ms"]
                                 if r["latency_p99_ms"] and one["latency_p99_ms"] else None)
        r["identical_text_vs_1"] = texts[r["replicas"]] == texts[1]
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.multi_engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(BUNDLED), help="HF model (converted here) or AP checkpoint directory")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--gpus-per-engine", type=float, default=0.5, help="GPU share per engine (0.5: two per GPU)")
    p.add_argument("--engine-cpus", type=float, default=1.0, help="CPUs reserved per engine")
    p.add_argument("--expert-impl", choices=("reference", "auto"), default="reference",
                   help="reference: torch twin (no kernel compile); auto: the fused kernel on CUDA")
    p.add_argument("--store-root", default="/dev/shm", help="tmpfs where the node's page store writes the planes")
    p.add_argument("--kv-cache-mib", type=int, default=64, help="KV cache per engine")
    p.add_argument("--calib-seqs", type=int, default=8, help="calibration sequences of the conversion")
    p.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "pagedweight-multi-engine"))
    p.add_argument("--probe-copies", type=int, default=20, help="bulk store copies per engine, solo")
    p.add_argument("--probe-cycles", type=int, default=2, help="offload/reload cycles per engine, solo")
    p.add_argument("--reload-seconds", type=float, default=0.5, help="target length of each concurrent reload run")
    p.add_argument("--barrier-s", type=float, default=1.0, help="common start this far ahead of the calls")
    p.add_argument("--traffic-prompts", type=int, default=4, help="planner phase: prompts per engine")
    p.add_argument("--traffic-tokens", type=int, default=24)
    p.add_argument("--eval-ctx", type=int, default=256)
    p.add_argument("--eval-windows", type=int, default=16)
    p.add_argument("--eval-prompts", type=int, default=8)
    p.add_argument("--eval-tokens", type=int, default=16)
    p.add_argument("--eval-shard", type=int, default=2)
    p.add_argument("--eval-counts", default="1,all", help="engine counts of the evaluation (1 always runs first)")
    p.add_argument("--serve-clients", type=int, default=16, help="serve: client threads (a closed loop each)")
    p.add_argument("--serve-clients-per-replica", action="store_true",
                   help="serve: --serve-clients per replica (load grows with N) instead of in all")
    p.add_argument("--serve-seconds", type=float, default=6.0, help="serve: load duration per configuration/mode")
    p.add_argument("--serve-warmup-s", type=float, default=2.0, help="serve: unrecorded load after each deploy")
    p.add_argument("--serve-tokens", type=int, default=32, help="serve: max_tokens of every request")
    p.add_argument("--serve-prompts", type=int, default=16)
    p.add_argument("--serve-prompt-chars", type=int, default=200)
    p.add_argument("--serve-port", type=int, default=8000, help="serve: HTTP port if Serve is not running yet")
    p.add_argument("--serve-app", default="multi-engine-bench", help="serve: app name and route prefix")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS))
    p.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local cluster (default: all)")
    p.add_argument("--object-store-mib", type=int, default=512)
    p.add_argument("--out-dir", default=None, help="default: $OUT, else benchmarks/results")
    p.add_argument("--verbose", action="store_true", help="stream worker logs")
    p.add_argument("--label", default=None, help="suffix of the result file name (a second run the same day)")
    return p


def main(argv: list[str] | None = None) -> Path:
    args = build_parser().parse_args(argv)
    sections = set(args.sections.split(","))
    if not sections or not sections <= set(SECTIONS):
        raise SystemExit(f"--sections {args.sections!r}: choose from {','.join(SECTIONS)}")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the engine processes
    if args.device == "cpu" and args.expert_impl == "auto":
        args.expert_impl = "reference"  # the same thing on a CPU
    ap_dir = prepare_model(args)
    check_store_room(ap_dir, args.store_root)
    if args.expert_impl == "auto":
        os.environ.setdefault("NUMBA_CACHE_DIR", str(Path(args.cache_dir) / "numba-cache"))
        print(f"kernels compiled into {os.environ['NUMBA_CACHE_DIR']} in "
              f"{warm_kernels(ap_dir, args.store_root):.1f} s", flush=True)
    import ray

    started = start_cluster(args)
    try:
        rows, ceilings, extra = measure(args, ap_dir, sections) if sections & set(ENGINE_SECTIONS) else ([], {}, {})
        if "serve" in sections:  # the sections so far are kept if Serve fails (e.g. a package missing)
            write_result("multi_engine", rows, ceilings=ceilings, out_dir=args.out_dir, label=args.label,
                         extra={**extra, "complete": False})
            t0 = time.perf_counter()
            rows += measure_serve(args, ap_dir)
            extra["serve_wall_s"] = time.perf_counter() - t0
    finally:
        if started:
            from pagedweight.actors.page_store_actor import page_store_for_node

            ray.get(page_store_for_node(root=args.store_root).destroy.remote())
            ray.shutdown()
    path = write_result("multi_engine", rows, ceilings=ceilings, out_dir=args.out_dir, label=args.label,
                        extra={**extra, "complete": True})
    for row in rows:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}))
    print(f"results -> {path}")
    return path


if __name__ == "__main__":
    main()
