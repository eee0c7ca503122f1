"""PLANSTEP and the reload planner (DESIGN.md §2): which expert blocks lose or regain bits.

The planner only writes desired widths; the mover commits them. Inputs are numpy arrays; internally every table
is width-major ([P+1, n]) so each per-width operation runs over one contiguous row and no Python loop touches
blocks (loops run over widths, at most P of them).

A block's drops form a chain d -> next supported width below -> ... -> its floor; each step has bytes freed
(Delta, page-rounded) and predicted damage d_hat. Taking steps greedily by d_hat/Delta is only consistent when
the ratios grow along each chain, so chains that break that order are replaced by their lower convex hull
(merged steps): the classic greedy for the multiple-choice knapsack. Its guarantee, which the tests check against
brute force: for a release that meets demand D at stage k,

    LP_k <= OPT_k <= greedy <= OPT_k + gap_bound,   gap_bound = d_last * (1 - (D - freed_before_last) / Delta_last)

where OPT_k is the least damage of any legal configuration of stage k that frees >= D, LP_k its fractional
relaxation and d_last, Delta_last the damage and bytes of the last (merged) step taken. After the cut, steps the
last step's overshoot makes redundant are undone (which only lowers the damage). In ratio terms the greedy can be
far from optimal on tiny instances (one expensive last step; the tests report the worst seen); the additive bound
is what holds. Ranking sorts only the steps in the key histogram's bins up to the demand (exact, see
`_greedy_order`), so a step over 10,000 blocks costs well under a millisecond. The reload
planner mirrors it (concave hull, budget packing, then fill rounds with steps that still fit):
greedy >= OPT - d_next * (B - used) / Delta_next, with d_next, Delta_next the first step the prefix left out.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from pagedweight.knobs import PlannerKnobs
from pagedweight.signals import (N_FEATURES, ResidualHeads, RoutingTracker, bucket_block_signals, bucket_experts,
                                 global_damage, predicted_damage)

_NBINS_SHIFT = 19  # float32 bits >> 19: sign(0) + 8 exponent + 4 mantissa bits -> 4096 bins of ~6% relative width
_NBINS = 1 << (32 - _NBINS_SHIFT)
_F32_MAX = 3.0e38


@dataclass
class BlockTables:
    """Static per-block tables of one checkpoint at one page size. Inputs are block-major [n, P+1]."""

    supported: np.ndarray  # bool [n, P+1]: widths the block can take
    mem: np.ndarray  # [n, P+1] bytes as allocated (page-rounded); only supported entries are read
    sens: np.ndarray  # [n, P+1] s_i^b; only supported entries are read
    num_layers: int
    num_experts: int
    # derived, width-major [P+1, n]
    parent_bits: int = field(init=False)
    low: int = field(init=False)  # lowest supported width of any block
    kinds: np.ndarray = field(init=False)  # [n] 0 gate_up, 1 down
    sup_rows: np.ndarray = field(init=False)
    mem_rows: np.ndarray = field(init=False)
    prev_rows: np.ndarray = field(init=False)  # supported width just above row b (P+1 when none)
    has_step: np.ndarray = field(init=False)  # a drop prev[b] -> b exists
    step_bytes: np.ndarray = field(init=False)  # M[prev] - M[b] where has_step, else 0
    step_g: np.ndarray = field(init=False)  # global damage g^{prev -> b}
    trans: np.ndarray = field(init=False)  # [K, 3] distinct (kind, from, to) transitions
    trans_flat: np.ndarray = field(init=False)  # [P+1, n] index into an eta table [K, n] raveled

    def __post_init__(self) -> None:
        self.supported = np.asarray(self.supported, dtype=bool)
        n, w = self.supported.shape
        if n != self.num_layers * self.num_experts * 2:
            raise ValueError(f"{n} blocks, expected num_layers*num_experts*2 = {self.num_layers * self.num_experts * 2}")
        if not self.supported.any(axis=1).all():
            raise ValueError("every block needs at least one supported width")
        self.parent_bits = w - 1
        self.kinds = np.arange(n) % 2
        self.sup_rows = np.ascontiguousarray(self.supported.T)
        self.mem_rows = np.ascontiguousarray(np.asarray(self.mem, dtype=np.float64).T)
        sens_rows = np.asarray(self.sens, dtype=np.float64).T
        if not np.isfinite(sens_rows[self.sup_rows]).all():  # inf - inf would be a NaN damage that no order ranks
            raise ValueError("a supported width's sensitivity is not finite")
        self.low = int(np.flatnonzero(self.sup_rows.any(axis=1))[0])
        prev = np.full((w, n), w, dtype=np.int64)
        nxt = np.full(n, w, dtype=np.int64)
        for b in range(w - 1, -1, -1):
            prev[b] = nxt
            nxt = np.where(self.sup_rows[b], b, nxt)
        self.prev_rows = prev
        self.has_step = self.sup_rows & (prev < w)
        cols = np.arange(n)
        pc = np.minimum(prev, w - 1)
        self.step_bytes = np.where(self.has_step, self.mem_rows[pc, cols] - self.mem_rows, 0.0)
        self.step_g = np.where(self.has_step, global_damage(sens_rows[pc, cols], sens_rows), 0.0)
        if (self.step_bytes[self.has_step] <= 0).any():
            raise ValueError("M_i^b must grow strictly with b over each block's supported widths")
        rows = np.broadcast_to(np.arange(w)[:, None], (w, n))
        key = (self.kinds[None, :] * w + pc) * w + rows
        uniq, inv = np.unique(np.where(self.has_step, key, 0), return_inverse=True)
        self.trans = np.stack([uniq // (w * w), (uniq // w) % w, uniq % w], axis=1)
        self.trans_flat = inv.reshape(w, n) * n + cols[None, :]

    @property
    def n_blocks(self) -> int:
        return self.supported.shape[0]

    def bytes_at(self, widths: np.ndarray) -> np.ndarray:
        return self.mem_rows[widths, np.arange(self.n_blocks)]

    def check_widths(self, widths: np.ndarray) -> None:
        if not self.sup_rows[widths, np.arange(self.n_blocks)].all():
            raise ValueError("a width outside its block's supported set")


def damage_rows(tables: BlockTables, mu: np.ndarray, eps: float, eta: np.ndarray | None = None) -> np.ndarray:
    """d_hat [P+1, n] of every drop step prev[b] -> b under multipliers mu [n]; eta [P - low, n] covers rows low..P-1."""
    lo, p = tables.low, tables.parent_bits
    out = np.empty(tables.step_g.shape)
    out[:lo], out[p:] = eps, eps
    predicted_damage(mu[None, :], tables.step_g[lo:p], eta, eps, out=out[lo:p])
    return out


@dataclass
class EtaScratch:
    """Buffers reused by `eta_rows` every step: fresh MB-sized temporaries each step cost page faults."""

    x: np.ndarray  # [n, N_FEATURES] transformed features
    cols: np.ndarray  # [n, K] log eta per transition
    cols_t: np.ndarray  # [K, n]
    eta: np.ndarray  # [P - low, n]

    @classmethod
    def for_tables(cls, tables: BlockTables) -> "EtaScratch":
        n, k = tables.n_blocks, len(tables.trans)
        return cls(np.empty((n, N_FEATURES)), np.empty((n, k)), np.empty((k, n)),
                   np.empty((tables.parent_bits - tables.low, n)))


def eta_rows(tables: BlockTables, heads: ResidualHeads, phi: np.ndarray, alpha: float, clip: tuple[float, float],
             scratch: EtaScratch | None = None) -> np.ndarray:
    """eta [P - low, n] of every block's drop steps, gathered from one [n, K] table of its K distinct transitions."""
    s = scratch or EtaScratch.for_tables(tables)
    t = tables.trans
    heads.log_eta_columns(t[:, 0], t[:, 1], t[:, 2], phi, alpha, clip, out=s.cols, x_out=s.x)
    np.copyto(s.cols_t, s.cols.T)
    np.take(s.cols_t.ravel(), tables.trans_flat[tables.low:tables.parent_bits], out=s.eta)
    return np.exp(s.eta, out=s.eta)


@dataclass
class Plan:
    """Desired widths and what reaching them costs. Release: bytes freed, damage added; reload: the mirror."""

    kind: str  # "release" | "reload" | "none"
    base: np.ndarray  # widths planned from
    widths: np.ndarray  # desired widths
    amount_bytes: float  # demand (release) or budget (reload)
    delta_bytes: float  # bytes freed (release) or claimed (reload)
    damage: float  # predicted damage added (release) or avoided (reload)
    met: bool  # release: freed >= demand
    stage: int  # index into stage_floors of a release; -1 for a reload or no change
    gap_bound: float  # |greedy - OPT| <= gap_bound (see module docstring)
    # greedy order of the steps taken: a release for a smaller demand at the same stage is a prefix of it
    blocks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    end_widths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    cum_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    cum_damage: np.ndarray = field(default_factory=lambda: np.zeros(0))
    stage_release: np.ndarray = field(default_factory=lambda: np.zeros(0))  # max release per stage
    version: int = -1

    def prefix(self, demand: float) -> "Plan":
        """The release for a smaller demand at the same stage: the shortest prefix of this plan that covers it,
        less the redundant steps (see `_drop_redundant`)."""
        if demand <= 0 or not len(self.blocks):
            return unchanged(self.base, demand, "none")
        cut = min(int(np.searchsorted(self.cum_bytes, demand, "left")) + 1, len(self.blocks))
        blocks, ends = self.blocks[:cut], self.end_widths[:cut]
        x = np.diff(self.cum_bytes[:cut], prepend=0.0)
        y = np.diff(self.cum_damage[:cut], prepend=0.0)
        keep = _drop_redundant(blocks, x, y, float(self.cum_bytes[cut - 1]) - demand)
        widths = self.base.copy()
        np.minimum.at(widths, blocks[keep], ends[keep])
        freed = float(x[keep].sum())
        before = self.cum_bytes[cut - 2] if cut > 1 else 0.0
        return Plan("release", self.base, widths, demand, freed, float(y[keep].sum()), freed >= demand, self.stage,
                    _cover_gap(float(y[-1]), float(x[-1]), demand - before), blocks, ends,
                    self.cum_bytes[:cut], self.cum_damage[:cut], self.stage_release, self.version)


def _drop_redundant(blocks: np.ndarray, x: np.ndarray, y: np.ndarray, slack: float) -> np.ndarray:
    """Mask of the steps to keep after undoing the costliest deepest-per-block steps that the overshoot covers.

    The last step taken often frees more than the demand still needed, so some earlier steps become unnecessary;
    only a block's deepest taken step can be undone without breaking its chain. One pass, costliest first.
    """
    keep = np.ones(len(blocks), dtype=bool)
    if slack <= 0:
        return keep
    _, first_rev = np.unique(blocks[::-1], return_index=True)
    last = len(blocks) - 1 - first_rev  # index of each block's deepest taken step
    last = last[x[last] <= slack]
    last = last[np.argsort(-y[last], kind="stable")]
    undo = last[np.cumsum(x[last]) <= slack]
    keep[undo] = False
    return keep


def unchanged(base: np.ndarray, amount: float, kind: str = "none") -> Plan:
    return Plan(kind, base, base.copy(), float(amount), 0.0, 0.0, amount <= 0, -1, 0.0)


def _cover_gap(d_last: float, x_last: float, need_last: float) -> float:
    return float(d_last * max(0.0, 1.0 - need_last / x_last)) if x_last > 0 else 0.0


def _chain_steps(x: np.ndarray, y: np.ndarray, legal: np.ndarray, y_over_x: bool):
    """Steps in chain order [S, m] -> (key, bytes, value) of the steps to rank; key is inf off-step.

    key = y/x (release: damage per byte, ascending) or x/y (reload: bytes per damage avoided, ascending).
    Chains whose keys do not grow are replaced by their hull (merged steps placed at the hull's vertices).
    """
    sx = np.where(legal, x, 0.0)
    sy = np.where(legal, y, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):  # y >= eps > 0, so y / 0 is inf off-step
        key = y / sx if y_over_x else np.where(legal, x / sy, np.inf)
    viol = np.zeros(x.shape[1], dtype=bool)
    last = np.full(x.shape[1], -np.inf)
    for r in range(x.shape[0]):
        viol |= legal[r] & (key[r] < last)
        last = np.where(legal[r], key[r], last)
    bad = np.flatnonzero(viol)
    if bad.size:
        key[:, bad], sx[:, bad], sy[:, bad] = _hull(sx[:, bad], sy[:, bad], legal[:, bad], y_over_x)
    return key, sx, sy


def _hull(x: np.ndarray, y: np.ndarray, legal: np.ndarray, y_over_x: bool):
    """Convex hull of each chain's cumulative (bytes, value) curve; vertex iteration over at most S steps."""
    s, m = x.shape
    cx = np.vstack([np.zeros(m), np.cumsum(x, axis=0)])
    cy = np.vstack([np.zeros(m), np.cumsum(y, axis=0)])
    ok = np.vstack([np.ones(m, dtype=bool), legal])
    vertex = np.zeros((s + 1, m), dtype=bool)
    rows = np.arange(s + 1)[:, None]
    cols = np.arange(m)
    cur = np.zeros(m, dtype=np.int64)
    for _ in range(s):
        dx, dy = cx - cx[cur, cols], cy - cy[cur, cols]
        cand = ok & (rows > cur[None, :])
        with np.errstate(divide="ignore", invalid="ignore"):
            k = np.where(cand, dy / dx if y_over_x else dx / dy, np.inf)
        kmin = k.min(axis=0)
        active = np.isfinite(kmin)
        if not active.any():
            break
        tie = cand & (k <= kmin + 1e-12 * np.abs(kmin))
        nxt = s - np.argmax(tie[::-1], axis=0)  # furthest among ties: collinear steps merge
        vertex[nxt[active], cols[active]] = True
        cur = np.where(active, nxt, cur)
    key = np.full((s, m), np.inf)
    mx, my = np.zeros((s, m)), np.zeros((s, m))
    lx, ly, lk = np.zeros(m), np.zeros(m), np.zeros(m)
    for r in range(1, s + 1):
        v = vertex[r]
        dx, dy = cx[r] - lx, cy[r] - ly
        with np.errstate(divide="ignore", invalid="ignore"):
            kr = np.maximum(dy / dx if y_over_x else dx / dy, lk)  # max(): float noise must not reorder a chain
        key[r - 1] = np.where(v, kr, np.inf)
        mx[r - 1], my[r - 1] = np.where(v, dx, 0.0), np.where(v, dy, 0.0)
        lx, ly, lk = np.where(v, cx[r], lx), np.where(v, cy[r], ly), np.where(v, kr, lk)
    return key, mx, my


def _greedy_order(key: np.ndarray, sx: np.ndarray, amount: float, cover: bool) -> tuple[np.ndarray, int]:
    """Flat step ids in greedy order (ascending key, ties in chain order) and how many of them to take.

    cover: shortest prefix with bytes >= amount. pack: longest prefix with bytes <= amount. Only the steps in the
    histogram bins up to the crossing bin are sorted (bins are monotone in the key, so the order is exact).
    """
    fk, fx = key.ravel(), sx.ravel()
    bins = np.minimum(fk, _F32_MAX).astype(np.float32).view(np.int32) >> _NBINS_SHIFT
    cs = np.cumsum(np.bincount(bins, weights=fx, minlength=_NBINS))
    bstar = int(np.searchsorted(cs, amount, "left" if cover else "right"))
    cand = np.flatnonzero((bins <= bstar) & (fx > 0))
    order = cand[np.argsort(fk[cand], kind="stable")]
    cum = np.cumsum(fx[order])
    if cover:
        cut = min(int(np.searchsorted(cum, amount, "left")) + 1, len(order))
    else:
        cut = int(np.searchsorted(cum, amount, "right"))
    return order, cut


def plan_release(tables: BlockTables, widths: np.ndarray, demand: float, dhat: np.ndarray, floors: np.ndarray,
                 stage_floors: tuple[int, ...], keep_order_to: float = 0.0) -> Plan:
    """PLANSTEP: free >= `demand` bytes from `widths` with the least predicted damage, stage by stage.

    Stage k allows widths >= max(floors[i], stage_floors[k]). The first stage that can meet the demand is planned
    greedily; when none can, every legal step of the last stage is taken (the largest safe release, met=False).
    `keep_order_to` > demand keeps the greedy order long enough to serve that larger demand later by `Plan.prefix`
    (the standing plan of the plan queue); with demand <= 0 the widths stay as they are.
    """
    widths = np.asarray(widths, dtype=np.int64)
    target = max(demand, keep_order_to)
    if target <= 0:
        return unchanged(widths, demand)
    lo, p, n = tables.low, tables.parent_bits, tables.n_blocks
    rows = np.arange(lo, p)[:, None]
    legal = tables.has_step[lo:p] & (rows < widths[None, :]) & (rows >= floors[None, :])
    row_release = (tables.step_bytes[lo:p] * legal).sum(axis=1)
    stage_release = np.array([row_release[max(f - lo, 0):].sum() for f in stage_floors])
    if demand > stage_release[-1]:  # short even at the last stage: take every legal step, no ranking needed
        f = max(stage_floors[-1], lo)
        leg = legal[f - lo:]
        lowest = np.where(leg.any(axis=0), np.argmax(leg, axis=0) + f, widths)
        return Plan("release", widths, lowest, float(demand), float(stage_release[-1]),
                    float((dhat[f:p] * leg).sum()), False, len(stage_floors) - 1, 0.0, stage_release=stage_release)
    target = min(target, float(stage_release[-1]))
    stage = _first_stage(stage_release, target)
    if demand > 0 and _first_stage(stage_release, demand) != stage:
        return plan_release(tables, widths, demand, dhat, floors, stage_floors)
    f = max(stage_floors[stage], lo)
    # chain order: shallowest drop first (rows descending)
    key, sx, sy = _chain_steps(tables.step_bytes[f:p][::-1], dhat[f:p][::-1], legal[f - lo:][::-1], True)
    order, cut = _greedy_order(key, sx, target, cover=True)
    order = order[:cut]
    end = (p - 1 - order // n).astype(np.int64)
    full = Plan("none", widths, widths.copy(), float(target), 0.0, 0.0, True, stage, 0.0, order % n, end,
                np.cumsum(sx.ravel()[order]), np.cumsum(sy.ravel()[order]), stage_release)
    return full.prefix(demand) if demand > 0 else full


def _first_stage(stage_release: np.ndarray, amount: float) -> int:
    """First stage whose maximal release covers `amount`; the last stage when none does."""
    ok = np.flatnonzero(stage_release >= amount)
    return int(ok[0]) if ok.size else len(stage_release) - 1


def _serves(standing: Plan, target: float) -> bool:
    """Whether `standing` (a standing plan from the same widths and d_hat) serves every demand that the standing plan
    for `target` would serve, the same way.

    A standing plan serves a demand it covers at its own stage, by `Plan.prefix`. The greedy order is the same
    whatever the target (bins are monotone in the key and the sort is stable), so a plan at the same stage planned
    for a target at least as large holds the other's order as a prefix, and cuts every such demand alike.
    """
    if target <= 0:  # that plan would be `unchanged`: it serves no demand
        return True
    if not standing.stage_release.size:
        return False
    clipped = min(target, float(standing.stage_release[-1]))  # plan_release clips the target the same way
    return clipped <= 0 or (standing.amount_bytes >= clipped
                            and _first_stage(standing.stage_release, clipped) == standing.stage)


def plan_reload(tables: BlockTables, widths: np.ndarray, budget: float, dhat: np.ndarray,
                caps: np.ndarray, narrow: int | None = None, min_share: float = 0.0) -> Plan:
    """Mirror of PLANSTEP: restore the bits with the most damage avoided per byte within `budget` bytes.

    A raise over drop row a (a -> prev[a]) avoids d_hat[a] and costs step_bytes[a]; widths never exceed caps.

    With `narrow` set, a layer whose blocks all have `narrow` bits or less (the MoE kernel's narrow class,
    `runner.lut_width`) goes above `narrow` only for at least `min_share` of its blocks. At one token a layer runs
    on the wider class's kernel and at its widest routed block's pace, so a few raised blocks slow every token of
    the layer for little quality: a Qwen3 layer at T=1 took 36.4 us all at 4 bits, 37.8 at 4 bits on the wider
    class's kernel, 53.6 all at 6 (moe_kernel_bench-nvidia-h200-20261202-s31-t1-main.json). Layers short of the
    share are capped at `narrow`, the half of them with the smallest shares at a time, and the budget is planned
    again: it goes to the other layers, which may then reach the share, or to raises up to `narrow`.
    """
    widths = np.asarray(widths, dtype=np.int64)
    plan = _reload_greedy(tables, widths, budget, dhat, caps)
    if narrow is None or min_share <= 0:
        return plan
    L = tables.num_layers
    narrow_now = widths.reshape(L, -1).max(axis=1) <= narrow
    caps = np.array(caps, dtype=np.int64)
    while True:  # each pass caps at least one more layer, so at most L passes
        share = (plan.widths.reshape(L, -1) > narrow).mean(axis=1)
        short = np.flatnonzero(narrow_now & (share > 0) & (share < min_share))
        if not short.size:
            return plan
        drop = short[np.argsort(share[short], kind="stable")[:(short.size + 1) // 2]]
        layer_caps = caps.reshape(L, -1)
        layer_caps[drop] = np.minimum(layer_caps[drop], narrow)
        plan = _reload_greedy(tables, widths, budget, dhat, caps)


def plan_release_narrow(tables: BlockTables, widths: np.ndarray, demand: float, dhat: np.ndarray, floors: np.ndarray,
                        stage_floors: tuple[int, ...], narrow: int, min_share: float, plan: Plan | None = None) -> Plan:
    """plan_release under plan_reload's class rule: a layer the release leaves with some but fewer than `min_share`
    of its blocks above `narrow` goes wholly to `narrow` (its blocks above it drop to the largest legal width at or
    below it), and the rest of the demand is planned again from there.

    Why: a release from a wide home toward about 4 bits a block spreads widths 3..6 over every layer, and each such
    layer runs the wider class's kernel at about its widest routed block's pace. The Qwen1.5 shape at the parent's
    6 bits released to 4-bit memory left all 24 layers in class 7 and decoded at 0.895 / 0.929 of uniform 4 bits at
    batch 32 / 8 (engine_bench-nvidia-h100-80gb-hbm3-20261205-s44-paired-b328.json). Layers are capped the half
    with the smallest shares at a time, as in plan_reload, until none is short; a layer whose floors keep a block
    above `narrow` is never capped. The forced drops can free more than the demand (a layer's last wide blocks go
    at once). `plan`: the unruled release of these inputs, when the caller has it (the plan queue's prefix).
    """
    widths = np.asarray(widths, dtype=np.int64)
    if plan is None:
        plan = plan_release(tables, widths, demand, dhat, floors, stage_floors)
    if min_share <= 0 or plan.kind != "release":
        return plan
    L, n = tables.num_layers, tables.n_blocks
    cols = np.arange(n)
    # the largest legal width at or below `narrow` of each block (floors and the last stage's floor), -1: none
    rows = np.arange(narrow + 1)[:, None]
    legal = tables.sup_rows[:narrow + 1] & (rows >= np.maximum(floors, stage_floors[-1])[None, :])
    target = np.where(legal.any(axis=0), narrow - np.argmax(legal[::-1], axis=0), -1)
    wide = widths > narrow
    can = ~(wide & (target < 0)).reshape(L, -1).any(axis=1)
    below = _damage_below(tables, dhat)
    capped = np.zeros(L, dtype=bool)
    while True:  # each pass caps at least one more layer, so at most L passes
        share = (plan.widths.reshape(L, -1) > narrow).mean(axis=1)
        short = np.flatnonzero(can & ~capped & (share > 0) & (share < min_share))
        if not short.size:
            return plan
        capped[short[np.argsort(share[short], kind="stable")[:(short.size + 1) // 2]]] = True
        forced = np.where(np.repeat(capped, n // L) & wide, target, widths)
        freed = float((tables.bytes_at(widths) - tables.bytes_at(forced)).sum())
        damage = float((below[widths, cols] - below[forced, cols]).sum())
        rest = plan_release(tables, forced, demand - freed, dhat, floors, stage_floors)
        total = freed + rest.delta_bytes
        plan = Plan("release", widths, rest.widths, float(demand), total, damage + rest.damage, total >= demand,
                    rest.stage if rest.kind == "release" else plan.stage, rest.gap_bound)


def _damage_below(tables: BlockTables, dhat: np.ndarray, cols: np.ndarray | slice = slice(None)) -> np.ndarray:
    """below [P+2, m] of blocks `cols`: below[b] is the damage of the drop steps of rows < b (d_hat row b: the step
    prev[b] -> b), so a drop from width w to w' costs below[w] - below[w']."""
    steps = np.where(tables.has_step[:, cols], dhat[:, cols], 0.0)
    return np.vstack([np.zeros(steps.shape[1]), np.cumsum(steps, axis=0)])


def _reload_greedy(tables: BlockTables, widths: np.ndarray, budget: float, dhat: np.ndarray,
                   caps: np.ndarray) -> Plan:
    """plan_reload's packing greedy (no class rule)."""
    if budget <= 0:
        return unchanged(widths, budget, "reload")
    lo, p, n = tables.low, tables.parent_bits, tables.n_blocks
    rows = np.arange(lo, p)[:, None]
    legal = tables.has_step[lo:p] & (rows >= widths[None, :]) & (tables.prev_rows[lo:p] <= caps[None, :])
    key, sx, sy = _chain_steps(tables.step_bytes[lo:p], dhat[lo:p], legal, False)
    order, cut = _greedy_order(key, sx, budget, cover=False)
    fx, fy = sx.ravel(), sy.ravel()
    used = float(fx[order[:cut]].sum())
    gap = float(fy[order[cut]] * (budget - used) / fx[order[cut]]) if cut < len(order) else 0.0
    taken = np.zeros(sx.shape, dtype=bool)
    taken.ravel()[order[:cut]] = True
    cols = np.arange(n)
    for _ in range(sx.shape[0]):  # fill: each block's next step, best key first, while it fits (chains stay whole)
        avail = (sx > 0) & ~taken
        nxt = np.argmax(avail, axis=0)
        ok = np.flatnonzero(avail.any(axis=0) & (sx[nxt, cols] <= budget - used))
        if not ok.size:
            break
        ids = nxt[ok] * n + ok
        ids = ids[np.argsort(key.ravel()[ids], kind="stable")]
        c = np.cumsum(fx[ids])
        k = int(np.searchsorted(c, budget - used, "right"))
        taken.ravel()[ids[:k]] = True
        used += float(c[k - 1])
    srow, blocks = np.nonzero(taken)
    out = widths.copy()
    np.maximum.at(out, blocks, tables.prev_rows[lo + srow, blocks])
    return Plan("reload", widths, out, float(budget), float(sx[taken].sum()), float(sy[taken].sum()), True, -1,
                gap)


def _immutable(a: np.ndarray) -> bool:
    """Read-only and owning its data: no write through it or through a base can change it (compare by identity)."""
    return not a.flags.writeable and a.flags.owndata


def _frozen(a: np.ndarray | None) -> np.ndarray | None:
    """A snapshot of a that no later write changes: a itself when immutable, else a read-only copy."""
    if a is None or _immutable(a):
        return a
    a = a.copy()
    a.flags.writeable = False
    return a


@dataclass
class _SignalsCache:
    """The inputs `Planner.signals` last computed from and what it computed."""

    bucket: np.ndarray  # [L, E] routing buckets
    heads: ResidualHeads | None
    features: np.ndarray | None  # [n, 4], read-only (the observed array, else a copy); None when no heads read them
    dhat: np.ndarray
    floors: np.ndarray
    mass: np.ndarray | None = None  # the read-only routing mass last found to give `bucket` (compared by identity)


@dataclass
class KVState:
    """What the KV allocator reports at a step boundary.

    `target_free_blocks` is the demand: every block the admitted work will still need (the engine's scheduler
    counts remaining prompt and tokens still to generate), so one release covers a request for its whole life and
    the free blocks minus the target stay put while it runs; a reload needs that margin to grow (a request ends).
    `transit_bytes` are pool bytes that moves hold beyond the committed widths' footprint (PageMover.transit_bytes).
    `used_blocks` are the blocks the requests hold now: with the target, what the KV cache needs whatever the widths.
    `retained_blocks` are kept prefix blocks within their retention (PagedKVCache.retention_s): among the free
    blocks, since a KV allocation may evict them, but the planner keeps them as it keeps the target: a release makes
    room for them (so allocations take other blocks first) and no reload takes their bytes.
    """

    free_blocks: int
    target_free_blocks: int
    block_bytes: int
    transit_bytes: int = 0
    used_blocks: int = 0
    retained_blocks: int = 0

    @property
    def need_blocks(self) -> int:
        return self.used_blocks + self.target_free_blocks


class Planner:
    """Stateful planner of one engine: signals in, desired widths out.

    `decide` runs at a step boundary: when free KV blocks (counting planned but uncommitted moves) fall to
    target + retained kept blocks + trigger_blocks, reloads not yet committed are taken back first
    (`_cancel_reloads`), then the newest queued plan is cut to what is still short and written; when they exceed that
    threshold by more than hysteresis_blocks, bits are reloaded, never past the point that would re-trigger an
    offload within hysteresis_blocks if the KV cache needed again its peak of the last `knobs.reload_dwell_steps`
    steps (blocks held + still wanted, `KVState.need_blocks`). Work arriving and finishing in turns (a request ends,
    the next arrives) would otherwise raise and lower the same bits each time: a reload takes only bytes the KV cache
    has not needed for a while, so it comes once the load has fallen and stayed down, and only as far as it fell.
    (Counting from the last release instead let a request's end reload everything the next arrival then released
    again: 15 reloads for 16 releases on the H200 workload, kv_pressure-nvidia-h200-20261129-s6-final.json.)
    With `narrow_width` (the engine passes the kernels' narrow class bound) a reload follows `plan_reload`'s class
    rule at `knobs.narrow_min_share` and a release `plan_release_narrow`'s at `knobs.release_min_share` (off by
    default): a layer sits wholly in the narrow class or above it for at least that share of its blocks.
    `refresh` (every step, may overlap the GPU step) keeps the plan queue fresh; it recomputes the standing plan
    only when its inputs changed, so a step where nothing changed costs a few array compares.
    """

    def __init__(self, tables: BlockTables, knobs: PlannerKnobs, widths: np.ndarray,
                 heads: ResidualHeads | None = None, routing_prior: np.ndarray | None = None,
                 home_widths: np.ndarray | None = None, narrow_width: int | None = None) -> None:
        self.tables, self.knobs, self.heads = tables, knobs, heads
        self.narrow_width = narrow_width  # the kernels' narrow class bound (plan_reload); None: no class rule
        self.desired = np.asarray(widths, dtype=np.int64).copy()
        tables.check_widths(self.desired)
        self.home = self.desired.copy() if home_widths is None else np.asarray(home_widths, dtype=np.int64)
        L, E = tables.num_layers, tables.num_experts
        self.routing = (RoutingTracker.uniform(L, E, knobs.routing_decay) if routing_prior is None
                        else RoutingTracker.from_prior(routing_prior, knobs.routing_decay))
        self.features: np.ndarray | None = None
        self._scratch: EtaScratch | None = None
        self._signals: _SignalsCache | None = None
        # version, widths, d_hat and bucket floors the newest queued plan was planned on
        self._standing_inputs: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None
        self.queue: deque[Plan] = deque(maxlen=knobs.queue_len)
        self.version = 0
        self.counters = {"release": 0, "reload": 0, "queue_hit": 0, "queue_miss": 0, "refresh": 0, "quiet": 0}
        self._quiet: tuple | None = None  # inputs of the last step that wrote no plan, and its committed widths
        # (desired widths' version, budget) of the last reload that found nothing to take: no step fits, or the
        # narrow-class rule turned every raise down. Asked again once the widths change or the budget grows: the
        # ruled plan took 10 ms of CPU at 10,000 blocks (planner-speed-cpu-2c-20261202-s31-narrow.json), and the
        # routing signals change every observed step
        self._no_reload: tuple[int, float] | None = None
        self.steps = 0  # decide() calls so far
        self._needs: deque[int] = deque(maxlen=max(knobs.reload_dwell_steps, 1))  # KV need (blocks) of recent steps

    def observe(self, step_mass: np.ndarray | None = None, features: np.ndarray | None = None) -> None:
        """Fold in one step's routing mass [L, E] (already merged across the batch) and block features [n, 4]."""
        if step_mass is not None:
            self.routing.update(step_mass)
        if features is not None:
            features = np.array(features, dtype=np.float64)  # a read-only copy: `signals` compares it by identity
            if features.shape != (self.tables.n_blocks, N_FEATURES):
                raise ValueError(f"features {features.shape}, expected ({self.tables.n_blocks}, {N_FEATURES})")
            features.flags.writeable = False
            self.features = features

    def signals(self) -> tuple[np.ndarray, np.ndarray]:
        """(d_hat [P+1, n], floors [n]) under the current signals, read-only.

        The routing mass acts only through its buckets and the features only through the heads, so the arrays are
        recomputed only when the buckets, the features (heads present) or the heads object changed; otherwise the
        same arrays come back, which tells `refresh` its standing plan still holds. Heads are compared by identity:
        replace the object to change them. The mass and features that `RoutingTracker.update` and `observe` store
        are read-only, so while they are the very arrays of the last call nothing is compared or ranked again: most
        decode steps observe nothing (at 10,000 blocks with heads, 0.019 -> 0.001 ms of CPU per call, a quiet `step`
        0.028 -> 0.008: planner-speed-cpu-2c-20261203-s32-{base,quiet}.json). A writable array (assigned from
        outside) is compared by value.
        """
        mass = self.routing.mass
        phi = self.features if self.heads is not None else None
        c = self._signals
        if (c is not None and c.heads is self.heads and c.mass is mass and c.features is phi and _immutable(mass)
                and (phi is None or _immutable(phi))):
            return c.dhat, c.floors
        bucket = bucket_experts(mass, self.knobs.n_buckets)
        if (c is not None and c.heads is self.heads and np.array_equal(c.bucket, bucket)
                and (phi is None) == (c.features is None) and (phi is None or np.array_equal(c.features, phi))):
            c.mass, c.features = mass, _frozen(phi)
            return c.dhat, c.floors
        mu, floors = bucket_block_signals(bucket, self.knobs)
        eta = None
        if phi is not None:
            self._scratch = self._scratch or EtaScratch.for_tables(self.tables)
            eta = eta_rows(self.tables, self.heads, phi, self.knobs.alpha, self.knobs.rho_clip, self._scratch)
        dhat = damage_rows(self.tables, mu, self.knobs.eps, eta)
        dhat.flags.writeable = floors.flags.writeable = False
        self._signals = _SignalsCache(bucket, self.heads, _frozen(phi), dhat, floors, mass)
        return dhat, floors

    def _pending(self, committed: np.ndarray) -> float:
        """Bytes the mover will still free (+) or claim (-) to reach the desired widths."""
        if np.array_equal(committed, self.desired):  # the usual step: nothing in flight
            return 0.0
        return float((self.tables.bytes_at(committed) - self.tables.bytes_at(self.desired)).sum())

    def _release_below(self, kv: KVState) -> int:
        """Free bytes below which a release comes: the target, retained kept blocks (held as a request's are:
        released for, never reloaded over; KVState), one block and the trigger margin."""
        return (kv.target_free_blocks + kv.retained_blocks + 1 + self.knobs.trigger_blocks) * kv.block_bytes

    def _free_bytes(self, kv: KVState, committed: np.ndarray) -> float:
        """Free KV bytes once every pending move has landed (committed widths -> desired)."""
        return kv.free_blocks * kv.block_bytes + kv.transit_bytes + self._pending(committed)

    def _write(self, plan: Plan) -> Plan:
        self.desired = plan.widths.copy()
        self.version += 1
        self.queue.clear()
        self.counters[plan.kind] += 1
        return plan

    def refresh(self, kv: KVState, committed: np.ndarray) -> Plan:
        """Keep the standing plan (current demand + lookahead_blocks) on the plan queue; returns it.

        It is recomputed and pushed only when its inputs changed: the desired widths (or their version), d_hat and
        floors (`signals`), or a target the newest plan does not serve (`_serves`). Otherwise the newest plan cuts
        every demand the recomputed one would serve to the same release, so `decide` finds the same plans.
        """
        k = self.knobs
        demand = self._release_below(kv) - self._free_bytes(kv, committed)
        target = max(demand, 0.0) + k.lookahead_blocks * kv.block_bytes
        dhat, floors = self.signals()
        if self.queue and self._standing_inputs is not None:
            version, widths, planned_dhat, _ = self._standing_inputs
            newest = self.queue[-1]
            if (version == self.version == newest.version and planned_dhat is dhat
                    and np.array_equal(widths, self.desired) and _serves(newest, target)):
                return newest
        plan = plan_release(self.tables, self.desired, 0.0, dhat, floors, k.stage_floors, keep_order_to=target)
        plan.version = self.version
        self.queue.append(plan)
        self._standing_inputs = (self.version, self.desired.copy(), dhat, floors)
        self.counters["refresh"] += 1
        return plan

    def _peak_need(self, kv: KVState) -> int:
        """Count this step's KV need into the window; the window's peak (blocks)."""
        self.steps += 1
        self._needs.append(kv.need_blocks)
        return max(self._needs)

    def forget_need(self) -> None:
        """Clear the reload window: the KV need of past steps no longer holds (the engine has no request)."""
        self._needs.clear()

    def decide(self, kv: KVState, committed: np.ndarray) -> Plan | None:
        """Write new desired widths if pressure crossed a threshold; returns the plan written, else None."""
        return self._decide(kv, committed, self._peak_need(kv))

    def _decide(self, kv: KVState, committed: np.ndarray, peak: int) -> Plan | None:
        k = self.knobs
        free = self._free_bytes(kv, committed)
        low = self._release_below(kv)
        if free < low:
            cancel = self._cancel_reloads(committed, low - free)
            if cancel is not None:
                self._write(cancel)
                if cancel.met:  # the class rule may take more raises back than the demand asks
                    self._hold_overshoot(cancel, low - free, kv.block_bytes)
                    return cancel
                free += cancel.delta_bytes
            plan = self._release(low - free)
            if np.array_equal(plan.widths, self.desired):
                return cancel
            self._hold_overshoot(plan, low - free, kv.block_bytes)
            return self._write(plan)
        # free bytes were the window's peak need back (it is never below the need now)
        budget = free - low - (k.hysteresis_blocks + peak - kv.need_blocks) * kv.block_bytes
        turned_down = self._no_reload is not None and self._no_reload[0] == self.version \
            and budget <= self._no_reload[1]
        if budget >= kv.block_bytes and (self.desired < self.home).any() and not turned_down:
            dhat, _ = self.signals()
            plan = plan_reload(self.tables, self.desired, budget, dhat, self.home, self.narrow_width,
                               k.narrow_min_share)
            if plan.delta_bytes > 0:
                return self._write(plan)
            self._no_reload = (self.version, budget)
        return None

    def step(self, kv: KVState, committed: np.ndarray) -> Plan | None:
        """decide, then refresh the queue for the next step.

        A quiet step is answered at once: the same KV state, committed and desired widths, signals and newest
        queued plan as the last step, which wrote no plan, and the same peak need in the reload window. decide would
        write nothing again and refresh keep its plan. Most decode steps are quiet (KV changes once a block fills);
        at 2,880 blocks a quiet step takes 0.007 ms instead of 0.017 (warm caches, planner-speed-cpu-2c-20261129-
        quiet-step.json), more between model steps, whose work leaves the caches cold."""
        dhat, _ = self.signals()
        peak = self._peak_need(kv)
        key = (kv, self.version, peak)
        q = self._quiet
        if (q is not None and q[0] == key and q[1] is dhat and q[2] is (self.queue[-1] if self.queue else None)
                and ((q[3] is committed and _immutable(committed)) or np.array_equal(q[3], committed))):
            self.counters["quiet"] += 1
            return None
        plan = self._decide(kv, committed, peak)
        self.refresh(kv, committed)
        self._quiet = None if plan is not None else (key, dhat, self.queue[-1] if self.queue else None,
                                                       _frozen(committed))
        return plan

    def _hold_overshoot(self, plan: Plan, demand: float, block_bytes: int) -> None:
        """Count the whole KV blocks a release frees beyond `demand` as needed in this step's entry of the reload
        window, so no reload takes them back before the window has passed. A release under the class rule can free
        far more than asked (a capped layer's last wide blocks at once, or all of a narrow layer's pending raises),
        and the next step reloaded the excess into other layers' dropped blocks: 73-192 block reversals against 0-2
        on a ramp of rising KV need (a review's planner simulation, 6 layers of 16 experts)."""
        over = int((plan.delta_bytes - max(demand, 0.0)) // block_bytes)
        if over > 0 and self._needs:
            self._needs[-1] += over

    def _cancel_reloads(self, committed: np.ndarray, demand: float) -> Plan | None:
        """A release that takes back reloads not yet committed (desired above committed), those that avoid the least
        damage per byte first, until `demand` is covered; None if no reload is pending. Cheaper than any other
        release: no committed width drops and no copy runs, so a request arriving while widths climb back does not
        lower blocks that have just come back (a reversal of the widths) while others are still on their way up.
        Under the class rule (`narrow_width`) a layer within the narrow class as committed keeps all of its pending
        raises above the class or none: a cancel of some would leave it short of `narrow_min_share`."""
        pending = np.flatnonzero(self.desired > committed)
        if not pending.size:
            return None
        dhat, _ = self.signals()
        up, now = self.desired[pending], committed[pending]
        gain = self.tables.mem_rows[up, pending] - self.tables.mem_rows[now, pending]  # bytes a cancel gives back
        # the reload now -> up avoids the drop steps it undoes, rows now..up-1 (d_hat row b: the step prev[b] -> b)
        below = _damage_below(self.tables, dhat, pending)
        cols = np.arange(pending.size)
        avoided = below[up, cols] - below[now, cols]
        order = np.argsort(avoided / np.maximum(gain, 1.0), kind="stable")
        cum = np.cumsum(gain[order])
        n = min(int(np.searchsorted(cum, demand, "left")) + 1, len(order))
        cancel = np.zeros(pending.size, dtype=bool)
        cancel[order[:n]] = True
        narrow, share = self.narrow_width, self.knobs.narrow_min_share
        if narrow is not None and share > 0:  # the class rule: a layer narrow as committed is not left short of it
            L = self.tables.num_layers
            widths = self.desired.copy()
            widths[pending[cancel]] = committed[pending[cancel]]
            above = (widths.reshape(L, -1) > narrow).mean(axis=1)
            short = (committed.reshape(L, -1).max(axis=1) <= narrow) & (above > 0) & (above < share)
            cancel |= np.repeat(short, widths.size // L)[pending] & (up > narrow)  # its raises above the class go too
        widths = self.desired.copy()
        widths[pending[cancel]] = committed[pending[cancel]]
        freed = float(gain[cancel].sum())
        return Plan("release", self.desired.copy(), widths, float(demand), freed, float(avoided[cancel].sum()),
                    freed >= demand, -1, 0.0)

    def _planned_on(self, dhat: np.ndarray, floors: np.ndarray) -> bool:
        """Whether the newest queued plan was planned on these d_hat and floors (the same arrays, or equal ones)."""
        if self._standing_inputs is None:
            return False
        _, _, planned_dhat, planned_floors = self._standing_inputs
        return ((planned_dhat is dhat or np.array_equal(planned_dhat, dhat))
                and (planned_floors is floors or np.array_equal(planned_floors, floors)))

    def _release(self, demand: float) -> Plan:
        """Newest queued plan cut to `demand` when it is current (same widths' version, and planned on the d_hat and
        bucket floors the signals give now: routing that moved an expert to a hotter bucket since must not be
        released below its new floor) and was planned at the right stage; then, with `narrow_width`, the class rule
        (`plan_release_narrow` at `knobs.release_min_share`: the queue's plans are unruled, a prefix of the greedy
        order)."""
        dhat, floors = self.signals()
        k = self.knobs
        plan = None
        if self.queue:
            newest = self.queue[-1]
            if (newest.version == self.version and self._planned_on(dhat, floors) and newest.cum_bytes.size
                    and newest.cum_bytes[-1] >= demand and _first_stage(newest.stage_release, demand) == newest.stage):
                self.counters["queue_hit"] += 1
                plan = newest.prefix(demand)
        if plan is None:
            self.counters["queue_miss"] += 1
            plan = plan_release(self.tables, self.desired, demand, dhat, floors, k.stage_floors)
        if self.narrow_width is None or k.release_min_share <= 0:
            return plan
        return plan_release_narrow(self.tables, self.desired, demand, dhat, floors, k.stage_floors, self.narrow_width,
                                   k.release_min_share, plan)
