"""Planner quality on the bundled model (issue 7, items 4 and 6), CPU.

At equal weight memory, does the planner's mixed-width configuration beat uniform width? Budgets lie between the
3-bit and 6-bit footprints of the expert blocks (raw bytes, page 1: the bundled model's blocks are smaller than a
page). Every planned configuration starts from 8 bits and releases down to the budget with PLANSTEP.

Variants (each an ablation of one signal):
  uniform            largest uniform width whose footprint fits (equal memory at the 4/5/6-bit footprints)
  bytes-only         planner with s replaced by one unit of damage per bit dropped (no sensitivity)
  global             planner, global damage g from the checkpoint's sensitivity table, mu = 1
  global+buckets     + routing buckets from the checkpoint's calibration routing mass (the chosen buckets, or the
                     search's best bucketed setting when it chose one bucket: "bucket_rows_knobs" in the JSON)
  online-buckets     + routing buckets from each evaluation window's own routing mass (per-window plan)
  online+residual    the chosen knobs on each window's routing mass and residual heads (per-window plan)
  ..., narrow rule   online+residual under the release's class rule (planner.plan_release_narrow): a layer wholly
                     at 4 bits or less, or above 4 for at least half its blocks (release_min_share 0.5)
  ..., stages X      the same with the other depth-stage setting: one stage (3,) when the chosen knobs have stages,
                     stages (5, 3) when they have one (at a footprint equal to a stage floor, stages force uniform)
  measured, one stage  damage table = measured single-block NLL increase on calibration windows (no Fisher proxy)
  uniform-interp     (midpoints only) byte-linear interpolation of the two neighbouring uniform widths' NLL: a
                     stricter reference than the realisable lower uniform width, reported next to it

Every eval row carries the paired difference to the uniform row of its budget (nll_diff_vs_uniform_per_token) and
its standard error over the evaluation windows (se_diff_per_token); "eval-uniform" rows give uniform width 3..P
against the parent width, which shows where quantization stops costing anything measurable (saturation).

Item 4 (knob search) runs first on windows spread evenly over data/calib.txt, the residual heads are fitted on the
windows between them exactly as `pagedweight convert` fits them (calibrate.DamageProbe; target: log of the window's
measured output error of a block's drop over its geometric mean across windows; features centred per block, including the
expert's routing share), and the evaluation uses data/eval.txt only (its first --eval-windows windows).

    python benchmarks/planner_quality.py [--ap DIR] [--eval-windows 32] [--context 512] [--measured-cache NPY]
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import write_result  # noqa: E402
from pagedweight.apformat import load_ap, load_ap_model  # noqa: E402
from pagedweight.knobs import PlannerKnobs  # noqa: E402
from pagedweight.planner import BlockTables, damage_rows, eta_rows, plan_release, plan_release_narrow  # noqa: E402
from pagedweight.runner import NARROW_WIDTH  # noqa: E402
from pagedweight.calibrate import DamageProbe  # noqa: E402
from pagedweight.signals import ResidualHeads, RouterStats, block_bucket_signals  # noqa: E402


class Widths:
    """Puts each expert block of a dense model at a chosen width from per-width dequantized copies."""

    def __init__(self, ap, model) -> None:
        cfg = ap.config
        self.model, self.seed, self.parent = model, ap.seed_bits, ap.parent_bits
        self.L, self.E = cfg.num_hidden_layers, cfg.num_experts
        self.w = {}  # (b, kind) -> [L, E, N, K]
        for b in range(self.seed, self.parent + 1):
            for u, kind in enumerate(("gate_up", "down")):
                self.w[b, kind] = torch.stack([torch.stack([ap.dequantized((l * self.E + e) * 2 + u, b)
                                                            for e in range(self.E)]) for l in range(self.L)])

    @torch.no_grad()
    def apply(self, widths: np.ndarray) -> None:
        w = np.asarray(widths).reshape(self.L, self.E, 2)
        for l in range(self.L):
            experts = self.model.layers[l].mlp.experts
            for u, kind in enumerate(("gate_up", "down")):
                for b in np.unique(w[l, :, u]):
                    sel = np.flatnonzero(w[l, :, u] == b)
                    getattr(experts, kind)[sel] = self.w[int(b), kind][l, sel]


def window_starts(n: int, limit: int, phase: float | None) -> list[int]:
    """Indices of `limit` of the n windows: the first ones (phase None), or spread evenly over all n, window j at
    floor((j + phase) * n / limit) (a calibration text is many documents that route differently: a prefix is not
    a sample of it)."""
    if phase is None:
        return list(range(min(n, limit)))
    return sorted({int((j + phase) * n / limit) for j in range(min(n, limit))})


def token_windows(tok, path: Path, context: int, limit: int, phase: float | None = None) -> torch.Tensor:
    ids = torch.tensor(tok.encode(path.read_text(), add_special_tokens=False).ids, dtype=torch.long)
    n = (len(ids) - 1) // context
    return torch.stack([ids[i * context: i * context + context + 1] for i in window_starts(n, limit, phase)])


@torch.no_grad()
def nll_windows(model, wins: torch.Tensor, batch: int = 16) -> np.ndarray:
    """Summed NLL of each window [len(wins)] (per-window values give paired standard errors between configs)."""
    out = []
    for s in range(0, len(wins), batch):
        x = wins[s:s + batch]
        logits = model(x[:, :-1])
        tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="none")
        out.append(tok.reshape(len(x), -1).sum(1).double().numpy())
    return np.concatenate(out)


def nll(model, wins: torch.Tensor, batch: int = 16) -> float:
    return float(nll_windows(model, wins, batch).sum())


@torch.no_grad()
def window_signals(model, widths: Widths, win: torch.Tensor):
    """(routing mass [L,E], features [n,4]) of one window, as the engine's router observer sees them."""
    stats = RouterStats(widths.L, widths.E)
    model.set_router_observer(stats)
    try:
        model(win[None, :-1])
    finally:
        model.set_router_observer(None)
    return stats.routing_mass(), stats.features()


def fit_heads(model, widths: Widths, wins: torch.Tensor) -> ResidualHeads:
    """Residual heads as `convert` fits them (calibrate.DamageProbe), on these windows at the parent width."""
    widths.apply(np.full(widths.L * widths.E * 2, widths.parent))
    probe = DamageProbe(model, widths.seed, widths.parent).capture(wins[:, :-1])
    for l in range(widths.L):
        for e in range(widths.E):
            for kind in ("gate_up", "down"):
                probe.measure(l, e, kind, lambda b, l=l, e=e, kind=kind: widths.w[b, kind][l, e])
    return probe.fit()


def measured_sensitivity(model, widths: Widths, wins: torch.Tensor, cache: Path | None) -> np.ndarray:
    """s_i^b measured [n, P+1]: NLL increase (nats summed over `wins`) when block i alone drops from P to b bits.

    The damage table the planner would use if every drop could be measured directly: n_blocks * (P - s) forward
    passes over the calibration windows, affordable for the bundled model only (a large model keeps the Fisher
    table). Block interactions are ignored as in the Fisher table; a drop that lowers the calibration loss gets
    g = 0 (global_damage clips), so it is taken first. Cached in `cache` (keyed by the caller) when given.
    """
    if cache is not None and cache.exists():
        return np.load(cache)
    n, P = widths.L * widths.E * 2, widths.parent
    widths.apply(np.full(n, P))
    base = nll(model, wins)
    out = np.zeros((n, P + 1))
    with torch.no_grad():
        for i in tqdm(range(n), desc="measured sensitivity", unit="block"):
            l, e, u = i // (2 * widths.E), (i // 2) % widths.E, i % 2
            kind = ("gate_up", "down")[u]
            param = getattr(model.layers[l].mlp.experts, kind)
            for b in range(widths.seed, P):
                param[e] = widths.w[b, kind][l, e]
                out[i, b] = nll(model, wins) - base
            param[e] = widths.w[P, kind][l, e]
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        np.save(cache, out)
    return out


def paired_se(a: np.ndarray, b: np.ndarray, tokens: int) -> float:
    """Standard error (per token) of the summed NLL difference a - b over windows, from per-window differences."""
    d = np.asarray(a) - np.asarray(b)
    return float(d.std(ddof=1) * math.sqrt(len(d)) / tokens) if len(d) > 1 else float("nan")


def planned(tables, knobs: PlannerKnobs, budget: float, mass=None, heads=None, phi=None, sens_free=False,
            narrow: int | None = None):
    """Widths after releasing from the parent width down to `budget` bytes (with `narrow`: under the engine's class
    rule, `plan_release_narrow`)."""
    n, p = tables.n_blocks, tables.parent_bits
    top = np.full(n, p)
    if mass is None:
        mu, floors = np.ones(n), np.full(n, tables.low)
    else:
        mu, floors = block_bucket_signals(mass, knobs)
    eta = None if heads is None else eta_rows(tables, heads, phi, knobs.alpha, knobs.rho_clip)
    if sens_free:
        dhat = damage_rows(replace_sens(tables), mu, knobs.eps)
    else:
        dhat = damage_rows(tables, mu, knobs.eps, eta)
    demand = float(tables.bytes_at(top).sum() - budget)
    if narrow is not None:
        return plan_release_narrow(tables, top, demand, dhat, floors, knobs.stage_floors, narrow,
                                   0.5).widths
    return plan_release(tables, top, demand, dhat, floors, knobs.stage_floors).widths


_UNIT = {}
NARROW_LABEL = "online+residual, narrow rule"  # layers wholly in the kernels' narrow class or not (release_min_share)


def replace_sens(tables: BlockTables) -> BlockTables:
    """The same tables with one unit of damage per bit dropped (the no-sensitivity ablation)."""
    if id(tables) not in _UNIT:
        s = -np.arange(tables.parent_bits + 1, dtype=np.float64)[None, :].repeat(tables.n_blocks, 0)
        _UNIT[id(tables)] = BlockTables(tables.supported, tables.mem, s, tables.num_layers, tables.num_experts)
    return _UNIT[id(tables)]


def knob_grid() -> list[PlannerKnobs]:
    out = []
    stage_options = ((3,), (4, 3), (5, 3), (6, 5, 4, 3))
    for stages, nb, spread, hot_floor in itertools.product(stage_options, (1, 2, 4), (2.0, 4.0), (3, 4)):
        if nb == 1 and (spread != 2.0 or hot_floor != 3):
            continue
        mult = tuple(spread ** (1 - k / (nb - 1)) for k in range(nb)) if nb > 1 else (1.0,)
        floors = (hot_floor,) + (3,) * (nb - 1)
        out.append(PlannerKnobs(n_buckets=nb, bucket_multipliers=mult, bucket_floors=floors, stage_floors=stages))
    return out


def main() -> int:
    ap_ = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap_.add_argument("--model", type=Path, default=ROOT / "models" / "pw-tiny-moe")
    ap_.add_argument("--ap", type=Path, default=None, help="existing AP checkpoint of --model (else converted)")
    ap_.add_argument("--context", type=int, default=512)
    ap_.add_argument("--eval-windows", type=int, default=32)
    ap_.add_argument("--calib-windows", type=int, default=16, help="windows of data/calib.txt the heads are fitted on")
    ap_.add_argument("--search-windows", type=int, default=8)
    ap_.add_argument("--measure-windows", type=int, default=12,
                     help="calibration windows (between the search windows) of the measured-sensitivity table")
    ap_.add_argument("--measured-cache", type=Path, default=None, help=".npy of that table (read if present)")
    ap_.add_argument("--label", default=None, help="suffix of the result file (runs of one day apart)")
    args = ap_.parse_args()
    torch.set_num_threads(1)
    from tokenizers import Tokenizer

    from pagedweight.convert import convert

    ap_dir = args.ap
    if ap_dir is None:
        ap_dir = Path(tempfile.mkdtemp(prefix="pw-planner-quality-"))
        convert(args.model, ap_dir, ROOT / "data" / "calib.txt", device="cpu")
    ap = load_ap(ap_dir)
    tok = Tokenizer.from_file(str(ap_dir / "tokenizer.json"))
    model = load_ap_model(ap_dir, ap.parent_bits)
    widths = Widths(ap, model)
    n, P, s = len(ap.blocks), ap.parent_bits, ap.seed_bits
    sup = np.zeros((n, P + 1), dtype=bool)
    sup[:, s:] = True
    tables = BlockTables(sup, ap.raw_bytes, ap.sensitivity, widths.L, widths.E)
    foot = {b: float(ap.raw_bytes[:, b].sum()) for b in range(s, P + 1)}
    # the 4/5/6-bit footprints (equal memory with uniform) and the midpoints between consecutive footprints
    budgets = [(f"{b}-bit footprint", foot[b]) for b in (4, 5, 6)]
    budgets += [(f"midpoint {b}/{b + 1}-bit", (foot[b] + foot[b + 1]) / 2) for b in (3, 4, 5)]
    budgets.sort(key=lambda t: t[1])
    calib = ROOT / "data" / "calib.txt"

    def uniform_width(budget: float) -> int:
        return max(b for b in range(s, P + 1) if foot[b] <= budget + 0.5)

    t0 = time.perf_counter()
    rows: list[dict] = []

    def ppl(wins: torch.Tensor, w: np.ndarray) -> float:
        widths.apply(w)
        return nll(model, wins)

    # ---- item 4: knob search on windows spread over the calibration slice (static plans, calibration mass)
    # selection: most budgets where the plan beats uniform width on this slice, then the lowest mean NLL
    search = token_windows(tok, calib, args.context, args.search_windows, phase=0.0)
    tokens = search[:, 1:].numel()
    uniform_nll = [ppl(search, np.full(n, uniform_width(b))) for _, b in budgets]
    scored = []
    for knobs in knob_grid():
        total = [ppl(search, planned(tables, knobs, b, mass=ap.routing_mass)) for _, b in budgets]
        wins = sum(t < u for t, u in zip(total, uniform_nll))
        score = float(np.mean(total)) / tokens
        scored.append((-wins, score, knobs))
        rows.append({"phase": "knob-search", "knobs": json.dumps(knobs.to_dict()), "nll_per_token": round(score, 5),
                     "ppl": round(math.exp(score), 4), "budgets": "all six", "budgets_beating_uniform": wins})
    best_static = min(scored, key=lambda t: t[:2])[2]
    best_bucketed = min((t for t in scored if t[2].n_buckets > 1), key=lambda t: t[:2])[2]
    print("best static knobs", best_static, flush=True)

    # ---- residual heads: fit on the calibration windows between the search windows
    heads_wins = token_windows(tok, calib, args.context, args.calib_windows, phase=0.5)
    heads = fit_heads(model, widths, heads_wins)
    conf = heads.confidence[:, np.arange(s + 1, P + 1), np.arange(s, P)]
    print("head confidence [kind, transition]", conf.round(3), flush=True)

    # alpha / clip on the search windows, per-window plans
    def per_window(wins, knobs, budget, use_heads: bool) -> float:
        total = 0.0
        for win in wins:
            widths.apply(np.full(n, P))
            mass, phi = window_signals(model, widths, win)
            total += ppl(win[None], planned(tables, knobs, budget, mass=mass, heads=heads if use_heads else None,
                                            phi=phi))
        return total

    best, best_score = replace(best_static, alpha=0.0), None
    for alpha, clip in itertools.product((0.0, 0.5, 1.0, 2.0), ((-1.0, 1.0), (-2.0, 2.0))):
        if alpha == 0.0 and clip != (-1.0, 1.0):
            continue
        knobs = replace(best_static, alpha=alpha, rho_clip=clip)
        score = float(np.mean([per_window(search, knobs, b, True) for _, b in budgets])) / tokens
        rows.append({"phase": "knob-search", "knobs": json.dumps(knobs.to_dict()), "nll_per_token": round(score, 5),
                     "ppl": round(math.exp(score), 4), "budgets": "all six", "per_window": True})
        if best_score is None or score < best_score:
            best, best_score = knobs, score
    print("best knobs", best, flush=True)

    # ---- item 6: evaluation slice
    ev = token_windows(tok, ROOT / "data" / "eval.txt", args.context, args.eval_windows)
    ev_tokens = ev[:, 1:].numel()
    sigs = []
    widths.apply(np.full(n, P))
    for win in ev:
        mass, phi = window_signals(model, widths, win)
        sigs.append((mass, phi))
    # bucket rows: the chosen buckets, or the search's best bucketed ones when it chose one bucket (mu = 1: no-op)
    bk = best if best.n_buckets > 1 else replace(best, n_buckets=best_bucketed.n_buckets,
                                                 bucket_multipliers=best_bucketed.bucket_multipliers,
                                                 bucket_floors=best_bucketed.bucket_floors)
    one_stage = replace(best, stage_floors=(s,))  # no depth stages: a stage floor at a footprint forces uniform
    other = one_stage if len(best.stage_floors) > 1 else replace(best, stage_floors=(5, s))
    other_label = f"online+residual, stages {other.stage_floors}"
    # measured damage table (single-block NLL increase on calibration windows between the search windows)
    meas_wins = token_windows(tok, calib, args.context, args.measure_windows, phase=0.5)
    measured = BlockTables(sup, ap.raw_bytes, measured_sensitivity(model, widths, meas_wins, args.measured_cache),
                           widths.L, widths.E)
    # uniform at every width: where quantization stops costing anything measurable (saturation)
    per_window = {}
    for b in range(s, P + 1):
        widths.apply(np.full(n, b))
        per_window[b] = nll_windows(model, ev)
    for b in range(s, P + 1):
        rows.append({"phase": "eval-uniform", "width_bits": b, "weight_bytes": foot[b],
                     "nll_per_token": round(float(per_window[b].sum()) / ev_tokens, 5),
                     "ppl": round(math.exp(float(per_window[b].sum()) / ev_tokens), 4),
                     "nll_diff_vs_8bit_per_token": round(float((per_window[b] - per_window[P]).sum()) / ev_tokens, 6),
                     "se_diff_per_token": round(paired_se(per_window[b], per_window[P], ev_tokens), 6)})
        print(rows[-1], flush=True)
    for label, budget in budgets:
        uni = uniform_width(budget)
        base = per_window[uni]
        if foot[uni] < budget - 0.5 and uni < P:  # between footprints: byte-linear interpolation of uniform NLL
            f = (budget - foot[uni]) / (foot[uni + 1] - foot[uni])
            interp = float(((1 - f) * base + f * per_window[uni + 1]).sum())
            rows.append({"phase": "eval", "budget": label, "budget_bytes": budget, "variant": "uniform-interp",
                         "note": f"byte-linear interpolation between uniform {uni} and {uni + 1} bits (not realisable)",
                         "nll_per_token": round(interp / ev_tokens, 5), "ppl": round(math.exp(interp / ev_tokens), 4),
                         "tokens": ev_tokens})
            print(rows[-1], flush=True)
        configs = {
            "uniform": lambda: [np.full(n, uni)],
            "bytes-only": lambda: [planned(tables, best, budget, sens_free=True)],
            "global": lambda: [planned(tables, best, budget)],
            "global+buckets": lambda: [planned(tables, bk, budget, mass=ap.routing_mass)],
            "online-buckets": lambda: [planned(tables, bk, budget, mass=m) for m, _ in sigs],
            "online+residual": lambda: [planned(tables, best, budget, mass=m, heads=heads, phi=f) for m, f in sigs],
            other_label: lambda: [planned(tables, other, budget, mass=m, heads=heads, phi=f) for m, f in sigs],
            NARROW_LABEL: lambda: [planned(tables, best, budget, mass=m, heads=heads, phi=f, narrow=NARROW_WIDTH)
                                   for m, f in sigs],
            "measured, one stage": lambda: [planned(measured, one_stage, budget)],
        }
        for variant, make in configs.items():
            ws = make()
            if len(ws) == 1:
                widths.apply(ws[0])
                pw, used = nll_windows(model, ev), [tables.bytes_at(ws[0]).sum()]
            else:
                pw = np.array([ppl(win[None], w) for win, w in zip(ev, ws)])
                used = [tables.bytes_at(w).sum() for w in ws]
            total = float(pw.sum())
            row = {"phase": "eval", "budget": label, "budget_bytes": budget, "variant": variant,
                   "weight_bytes_max": float(max(used)), "mean_bits": round(float(np.mean([w.mean() for w in ws])), 3),
                   "nll_per_token": round(total / ev_tokens, 5), "ppl": round(math.exp(total / ev_tokens), 4),
                   "nll_diff_vs_uniform_per_token": round(float((pw - base).sum()) / ev_tokens, 6),
                   "se_diff_per_token": round(paired_se(pw, base, ev_tokens), 6), "tokens": ev_tokens}
            rows.append(row)
            print(row, flush=True)
    evals = [r for r in rows if r["phase"] == "eval"]
    beats, beats_2se = {}, {}
    for variant in ("online+residual", NARROW_LABEL, other_label, "global", "measured, one stage"):
        for label, _ in budgets:
            r = next(r for r in evals if r["budget"] == label and r["variant"] == variant)
            beats[f"{variant} @ {label}"] = r["nll_diff_vs_uniform_per_token"] < 0
            beats_2se[f"{variant} @ {label}"] = r["nll_diff_vs_uniform_per_token"] < -2 * r["se_diff_per_token"]
    path = write_result("planner-quality", rows, extra={
        "chosen_knobs": best.to_dict(), "bucket_rows_knobs": bk.to_dict(), "residual_head_confidence": conf.tolist(),
        "checks": {"planner_beats_uniform_at": beats, "planner_beats_uniform_by_2se_at": beats_2se},
        "wall_s": round(time.perf_counter() - t0, 1), "context": args.context, "eval_windows": args.eval_windows,
        "model_sha256": hashlib.sha256((args.model / "model.safetensors").read_bytes()).hexdigest()[:16]},
        label=args.label)
    print(path)
    plot(path)
    return 0


def plot(path: Path) -> None:
    """PNG of perplexity against budget per variant, made from the JSON (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG (run `python benchmarks/planner_quality.py --plot JSON` where it is)")
        return
    rec = json.loads(Path(path).read_text())
    evals = [r for r in rec["rows"] if r["phase"] == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for variant in dict.fromkeys(r["variant"] for r in evals):
        pts = sorted((r["budget_bytes"] / 1024, r["ppl"]) for r in evals if r["variant"] == variant)
        ax.plot(*zip(*pts), marker="o", label=variant, drawstyle="steps-post" if variant == "uniform" else "default")
    ax.set_xlabel("expert weight budget (KiB, raw bytes)")
    ax.set_ylabel("eval perplexity (data/eval.txt)")
    ax.set_title(f"planner vs uniform width, {rec['machine']}, {rec['date'][:10]}")
    ax.legend()
    ax.grid(alpha=0.3)
    out = Path(path).with_suffix(".png")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(out)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--plot":
        plot(Path(sys.argv[2]))
        raise SystemExit(0)
    raise SystemExit(main())
