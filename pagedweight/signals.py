"""Planner signals (DESIGN.md §2): routing mass, routing buckets, global damage, prompt residual heads.

Everything here is numpy on small arrays so the planner can refresh it every engine step; the only torch code is
the router observer, which reduces each MoE layer's routing to [E]-sized sums before leaving torch.
Block index rule: i = (layer*E + expert)*2 + (0 gate_up, 1 down).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from pagedweight.host_copy import HostCopy
from pagedweight.knobs import PlannerKnobs

# routing-weighted mean input norm, routing-weighted RMS input norm, max input norm, routing share of the layer
N_FEATURES = 4
_TINY = 1e-30


def global_damage(s_from: np.ndarray, s_to: np.ndarray) -> np.ndarray:
    """g^{b->b'} = max(s^{b'} - s^b, 0): sensitivity-weighted error added by the drop."""
    return np.maximum(s_to - s_from, 0.0)


def predicted_damage(mu: np.ndarray, g: np.ndarray, eta: np.ndarray | None, eps: float,
                     out: np.ndarray | None = None) -> np.ndarray:
    """d_hat = max(eps, mu * g * eta) (eta None: the global estimate); `out` lets the planner reuse its rows."""
    out = np.multiply(mu, g, out=out)
    if eta is not None:
        out *= eta
    return np.maximum(out, eps, out=out)


def normalize_mass(mass: np.ndarray) -> np.ndarray:
    """Per-layer normalisation; a layer that saw no tokens gets the uniform distribution."""
    mass = np.asarray(mass, dtype=np.float64)
    tot = mass.sum(axis=1, keepdims=True)
    uniform = np.full_like(mass, 1.0 / mass.shape[1])
    return np.where(tot > 0, mass / np.where(tot > 0, tot, 1.0), uniform)


def merge_routing_mass(masses: np.ndarray, kv_blocks: np.ndarray) -> np.ndarray:
    """Merge per-request routing mass [R, L, E] into one [L, E], each request weighted by its KV blocks."""
    masses = normalize_mass(np.asarray(masses, dtype=np.float64).reshape(-1, masses.shape[-1])).reshape(masses.shape)
    w = np.asarray(kv_blocks, dtype=np.float64)
    if w.sum() <= 0:
        w = np.ones_like(w)
    return normalize_mass(np.tensordot(w, masses, axes=1))


@dataclass
class RoutingTracker:
    """Exponentially decayed routing mass m_{l,e}; `decay` is the weight kept by the old estimate."""

    mass: np.ndarray  # [L, E], rows sum to 1
    decay: float

    @classmethod
    def uniform(cls, num_layers: int, num_experts: int, decay: float) -> "RoutingTracker":
        return cls(np.full((num_layers, num_experts), 1.0 / num_experts), decay)

    @classmethod
    def from_prior(cls, prior: np.ndarray, decay: float) -> "RoutingTracker":
        """Start from the checkpoint's calibration routing mass."""
        return cls(normalize_mass(prior), decay)

    def update(self, step_mass: np.ndarray) -> None:
        """Fold in one step's mass; layers that saw no tokens this step keep their estimate."""
        step_mass = np.asarray(step_mass, dtype=np.float64)
        seen = step_mass.sum(axis=1, keepdims=True) > 0
        new = self.decay * self.mass + (1.0 - self.decay) * normalize_mass(step_mass)
        self.mass = np.where(seen, new, self.mass)
        self.mass.flags.writeable = False  # a new array per update: the planner's signals compare it by identity


def bucket_experts(mass: np.ndarray, n_buckets: int) -> np.ndarray:
    """Rank the experts of each layer by mass (hottest first) and cut the ranks into `n_buckets` equal groups. Equal
    masses take the coldest rank among them, so they share a bucket and no routing evidence protects none of them
    (no routing seen yet, or experts never routed): by index, experts 0-3 of a uniform layer of 8 were hot."""
    if n_buckets == 1:  # every rank lands in bucket 0: skip the per-step sort
        return np.zeros(mass.shape, dtype=np.int64)
    num_experts = mass.shape[1]
    ascending = np.sort(mass, axis=1)  # rank: the experts with at least this mass, less itself
    rank = np.stack([num_experts - 1 - np.searchsorted(row, m, side="left") for row, m in zip(ascending, mass)])
    return (rank * n_buckets) // num_experts


def block_bucket_signals(mass: np.ndarray, knobs: PlannerKnobs) -> tuple[np.ndarray, np.ndarray]:
    """Per-block damage multiplier mu [n] and bitwidth floor [n]; gate_up and down of an expert share a bucket."""
    return bucket_block_signals(bucket_experts(mass, knobs.n_buckets), knobs)


def bucket_block_signals(expert_bucket: np.ndarray, knobs: PlannerKnobs) -> tuple[np.ndarray, np.ndarray]:
    """mu [n] and floor [n] of the blocks of experts bucketed [L, E]: the routing mass acts only through these."""
    bucket = np.repeat(expert_bucket.ravel(), 2)
    mu = np.asarray(knobs.bucket_multipliers, dtype=np.float64)[bucket]
    floor = np.asarray(knobs.bucket_floors, dtype=np.int64)[bucket]
    return mu, floor


def batch_token_weights(tokens_per_request: list[int], kv_blocks_per_request: list[int]) -> torch.Tensor:
    """Per-token weights so a batch's routing merges across requests weighted by KV blocks (not by token count).
    Exactly so only where each token's top-k weights sum to 1: otherwise a request weighs its KV blocks times its
    tokens' mean top-k sum (Qwen1.5-MoE's norm_topk_prob=False), which an armed `RouterStats` corrects per layer."""
    tokens = np.asarray(tokens_per_request, dtype=np.int64)
    per_token = (np.asarray(kv_blocks_per_request, dtype=np.float64) / np.maximum(tokens, 1)).astype(np.float32)
    return torch.from_numpy(np.repeat(per_token, tokens))  # numpy: a few us on the step's critical path


_KERNEL_DTYPES = (torch.float16, torch.float32)  # what layer_kernels.route_stats reads (Numba has no bf16 arrays)


def _fused_fold(x: torch.Tensor, topk_weights: torch.Tensor) -> bool:
    """Whether `RouterStats.observe_layers` folds with cuda/layer_kernels.route_stats (a test under the CUDA
    simulator says yes on the CPU)."""
    return x.is_cuda and x.dtype in _KERNEL_DTYPES and topk_weights.dtype in _KERNEL_DTYPES


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; on CUDA through pinned memory (a pageable copy would wait for the step's graph:
    the host would stall there)."""
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


class RouterStats:
    """Router observer for `model.set_router_observer`: routing mass and per-expert input-norm features.

    The observer sees the expert input x, so both blocks of an expert get features of x (the down block's input
    is a function of it; residual heads are per block type and learn their own map). Set `token_weights` before a
    batched forward to weight each token by its request's KV blocks (see `batch_token_weights`); `arm` a batch of
    several requests to merge their routing mass as DESIGN.md §2 defines it whatever the top-k weights sum to.
    Each call only queues a few device ops (no host read inside the layer loop); the first read of `mass`,
    `norm_sum`, `norm2_sum`, `norm_max`, `routing_mass()` or `features()` reduces everything queued with two
    scatters and one copy to the host. Calls without reads fold into a device accumulator every 4L calls.
    `prefetch()` starts that copy without waiting (CUDA), so a read after later device work does not wait for it.
    With `track_requests` (an engine whose planner has residual heads) each request's observed tokens also add up
    in a row of their own, and `features()` describes the window's requests' tokens so far, not the window's only.
    """

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self._token_weights: torch.Tensor | None = None
        self._device_weights: torch.Tensor | None = None  # token_weights on the device of the last call
        self._offsets: tuple | None = None  # ((layers, device), layer * E as [L']) of the last stacked call
        self.active = True  # calls fold only while active (an engine turns it on for its observed steps: `arm`)
        self._window: tuple[list[int], list[int], list | None] | None = None  # `arm`'s batch: a new window next call
        # per request (track_requests): rows of _req, one per running request, and a last row (index _slots) that
        # takes the tokens of a request without one; only the window's requests' rows are read (`_merged`)
        self._slots = 0
        self._live: Callable[[], Iterable] | None = None
        self._rows: dict[int, tuple[int, object]] = {}  # id(request) -> (its row, the request: its id stays its own)
        self._free: list[int] = []
        self._zero: list[int] = []  # rows handed out since the last fold: zeroed before the next
        self._req: torch.Tensor | None = None  # [4, (slots + 1) * L * E] on the device: the four sums per row
        self.reset()

    def track_requests(self, max_requests: int, live: Callable[[], Iterable]) -> None:
        """Keep the sums of each request's observed tokens, for `features()` of the tokens of the window's requests
        so far (DESIGN.md §2: phi of the current sequence's tokens; the residual heads are fitted on whole calibration
        sequences, `calibrate.DamageProbe`), merged weighted by their KV blocks as the routing mass is. Without it
        a decode window has one token per request, whose max |x| is that token's norm: not what the heads learnt.
        Rows for up to `max_requests` requests at once; `live()` gives the requests still running (the `requests`
        of `arm`), and the rows of any other are reused."""
        if max_requests < 1:
            raise ValueError(f"track_requests needs max_requests >= 1, got {max_requests}")
        self._slots, self._live = max_requests, live
        self._rows, self._free, self._zero, self._req = {}, list(range(max_requests - 1, -1, -1)), [], None

    def arm(self, tokens_per_request: list[int], kv_blocks_per_request: list[int], requests: list | None = None
            ) -> None:
        """Observe the next forward, a batch of these requests: its first call starts a new window (`reset`)
        with their token weights (`batch_token_weights`); `requests` (objects, one per entry) say whose tokens they
        are, for `track_requests`. Only flags are set here: an engine arms before it launches the step, where host
        time leaves the GPU idle, and the calls come after the launch. An engine sets `active = False` once the
        step's statistics are prefetched; while inactive, calls return at once."""
        self._window = tokens_per_request, kv_blocks_per_request, requests
        self.active = True

    def _begin(self) -> None:
        if self._window is not None:
            tokens, blocks, requests = self._window
            self._window = None
            self.reset()
            self.token_weights = batch_token_weights(tokens, blocks)
            if sum(t > 0 for t in tokens) > 1:
                self._requests = (torch.from_numpy(np.repeat(np.arange(len(tokens)), tokens)),
                                  torch.tensor(blocks, dtype=torch.float32))
            if self._live is not None and requests is not None:
                self._assign(requests, tokens, blocks)

    def _assign(self, requests: list, tokens: list[int], blocks: list[int]) -> None:
        """Rows of the window's requests (a new request takes a free row, zeroed before the next fold), each
        token's row, and their KV blocks, the merge weights (`_merged`)."""
        rows = np.empty(len(requests), dtype=np.int64)
        for i, req in enumerate(requests):
            got = self._rows.get(id(req))
            if got is None:
                if not self._free:
                    self._reclaim(requests)
                row = self._free.pop() if self._free else self._slots  # none left: the untracked row
                if row < self._slots:
                    self._rows[id(req)] = row, req
                    self._zero.append(row)
            else:
                row = got[0]
            rows[i] = row
        tracked = rows < self._slots
        self._token_rows = torch.from_numpy(np.repeat(rows, tokens))
        self._merge = rows[tracked], np.asarray(blocks, dtype=np.float32)[tracked]

    def _reclaim(self, batch: list) -> None:
        """When rows run out: those of requests no longer running (finished, aborted, preempted) go back. A preempted
        request that kept its row re-observes its recomputed tokens into it (its means stay, its weight halves)."""
        keep = {id(r) for r in self._live()} | {id(r) for r in batch}
        for key in [k for k in self._rows if k not in keep]:
            self._free.append(self._rows.pop(key)[0])

    @property
    def token_weights(self) -> torch.Tensor | None:
        return self._token_weights

    @token_weights.setter
    def token_weights(self, w: torch.Tensor | None) -> None:
        self._token_weights, self._device_weights = w, None

    def reset(self) -> None:
        self._host = np.zeros((4, self.num_layers, self.num_experts))  # mass, sum r|x|, sum r|x|^2, max |x|
        self._feat: np.ndarray | None = None  # the same four, of the window's requests so far (`_merged`)
        self._ids: list[torch.Tensor] = []  # per call: flat block row layer*E + expert of every (token, slot)
        self._r: list[torch.Tensor] = []  # its routing weight (the token weight applies at `_reduce`)
        self._norm: list[torch.Tensor] = []  # |x| per token
        self._k: list[int] = []
        self._token_rows: torch.Tensor | None = None  # the window's row of each token [n] (track_requests)
        self._device_rows: torch.Tensor | None = None
        self._merge: tuple[np.ndarray, np.ndarray] | None = None  # the window's tracked rows and their KV blocks
        # an armed window of several requests: each token's request [n] and each request's KV blocks [R] (host),
        # and the same on the device of the last call (`_request_scale`)
        self._requests: tuple[torch.Tensor, torch.Tensor] | None = None
        self._device_requests: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rw: list[torch.Tensor] = []  # per call of such a window: its routing weights times `_request_scale`
        self._acc: torch.Tensor | None = None  # [4, L*E] on the device: the same four sums, not yet read back
        self._copy: HostCopy | None = None  # a prefetch's copy

    @torch.no_grad()
    def __call__(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        if not self.active:
            return
        self._begin()
        self._ids.append(topk_ids.reshape(-1) + layer * self.num_experts)
        self._r.append(topk_weights.float().reshape(-1))
        scale = self._request_scale(topk_weights)
        if scale is not None:
            self._rw.append((topk_weights.float() * scale[:, None]).reshape(-1))
        self._norm.append(torch.linalg.vector_norm(x.float(), dim=-1))
        self._k.append(topk_ids.shape[1])
        if len(self._ids) >= 4 * self.num_layers:  # many forwards without a read: bound the queue
            self._reduce()

    @property
    def _stride(self) -> int:
        return self.num_layers * self.num_experts

    @torch.no_grad()
    def observe_layers(self, layers: list[int], x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                       ) -> None:
        """All layers of one forward at once: x [L', n, D], ids and weights [L', n, k] of `layers`. A whole-step
        graph hands over its layers' router inputs together, so an observed step costs ~15 device ops, not ~8 per
        layer (on the H200 the per-layer calls took 8.5 ms per observed step under cProfile); on CUDA one fused
        kernel. Folded at once: the inputs may be views of a graph's outputs, overwritten by its next replay."""
        if not self.active:
            return
        self._begin()
        key = (tuple(layers), x.device)
        if self._offsets is None or self._offsets[0] != key:
            self._offsets = key, _to_device(torch.tensor(layers) * self.num_experts, x.device)
        offsets = self._offsets[1]
        tracked = self._token_rows is not None
        scale = self._request_scale(topk_weights)  # [L', n], or None: the token weights [n] apply
        if _fused_fold(x, topk_weights):
            # one launch (cuda/layer_kernels.route_stats) for the ~15 small kernels of the fold below
            from pagedweight.cuda import layer_kernels
            rows, req = (self._rows_on(x.device), self._req_acc(x.device)) if tracked else (None, None)
            weights = self._device_token_weights(x.device) if scale is None else scale
            layer_kernels.route_stats(x, topk_ids, topk_weights, offsets, weights, self._window_acc(x.device), rows,
                                      req)
            return
        r0 = topk_weights.float()
        if scale is None:
            w = self._device_token_weights(x.device)
            r = r0 if w is None else r0 * w[:, None]  # [L', n, k] times the token weights [n]
        else:
            r = r0 * scale[:, :, None]  # times each (layer, token)'s weight [L', n]
        norm = torch.linalg.vector_norm(x.float(), dim=-1)[:, :, None].expand(topk_ids.shape).reshape(-1)
        flat = topk_ids + offsets[:, None, None]
        self._fold(self._window_acc(x.device), flat.reshape(-1), r.reshape(-1), norm)
        if tracked:
            rows = self._rows_on(x.device)[None, :, None] * self._stride
            self._fold(self._req_acc(x.device), (flat + rows).reshape(-1), r0.reshape(-1), norm)

    def _device_token_weights(self, device: torch.device) -> torch.Tensor | None:
        """The token weights [n] (float32) on `device`, moved there once per batch; None if unset."""
        if self._token_weights is None:
            return None
        if self._device_weights is None or self._device_weights.device != device:
            self._device_weights = _to_device(self._token_weights.float(), device)
        return self._device_weights

    def _request_scale(self, topk_weights: torch.Tensor) -> torch.Tensor | None:
        """Each token's weight [..., n] in a window of several requests: its request's KV blocks over the request's
        routing weight in that layer (topk_weights [..., n, k]). Each request's routing mass then adds up to its KV
        blocks in every layer, DESIGN.md §2's merge of per-request mass (sum_t sum_k r over the request's sum_t sum_k
        r), where `batch_token_weights` alone weighs it also by its tokens' mean top-k sum when that is not 1
        (norm_topk_prob=False). None otherwise: one request's token weight is one factor per layer, which every
        read divides out (`normalize_mass`, the features' means and shares)."""
        if self._requests is None:
            return None
        device = topk_weights.device
        if self._device_requests is None or self._device_requests[0].device != device:
            self._device_requests = tuple(_to_device(t, device) for t in self._requests)
        token_request, blocks = self._device_requests
        per_token = topk_weights.float().sum(-1)
        per_request = per_token.new_zeros(*per_token.shape[:-1], len(blocks)).index_add_(-1, token_request, per_token)
        return (blocks / per_request.clamp_min(_TINY)).index_select(-1, token_request)

    def _rows_on(self, device: torch.device) -> torch.Tensor:
        """Each token's row of _req [n] (int64) on `device`, moved there once per window."""
        if self._device_rows is None or self._device_rows.device != device:
            self._device_rows = _to_device(self._token_rows, device)
        return self._device_rows

    def _window_acc(self, device: torch.device) -> torch.Tensor:
        if self._acc is None:
            self._acc = torch.zeros(4, self._stride, device=device)
        return self._acc

    def _req_acc(self, device: torch.device) -> torch.Tensor:
        """The per-request sums on `device`, rows handed out since the last fold zeroed first."""
        if self._req is None or self._req.device != device:
            self._req = torch.zeros(4, (self._slots + 1) * self._stride, device=device)
        if self._zero:
            rows = _to_device(torch.tensor(self._zero, dtype=torch.int64), device)
            self._req.view(4, self._slots + 1, self._stride).index_fill_(1, rows, 0.0)
            self._zero = []
        return self._req

    @torch.no_grad()
    def _reduce(self) -> None:
        """Fold the queued calls into the device accumulators (device ops only, no host read). The calls are of
        one batch (its n tokens each): a token's weight and row repeat over its k slots and over the calls."""
        if not self._ids:
            return
        device = self._norm[0].device

        def per_slot(t: torch.Tensor) -> torch.Tensor:  # [n] per token -> the calls' (token, slot) order
            if len(set(self._k)) == 1:
                return t.repeat_interleave(self._k[0]).repeat(len(self._k))
            return torch.cat([t.repeat_interleave(k) for k in self._k])

        if len(set(self._k)) == 1:
            norm = torch.cat(self._norm).repeat_interleave(self._k[0])
        else:
            norm = torch.cat([n.repeat_interleave(k) for n, k in zip(self._norm, self._k)])
        ids, r0 = torch.cat(self._ids), torch.cat(self._r)
        w = self._device_token_weights(device)
        r = torch.cat(self._rw) if self._rw else r0 if w is None else r0 * per_slot(w)
        self._fold(self._window_acc(device), ids, r, norm)
        if self._token_rows is not None:
            self._fold(self._req_acc(device), ids + per_slot(self._rows_on(device)) * self._stride, r0, norm)
        self._ids, self._r, self._norm, self._k, self._rw = [], [], [], [], []

    @staticmethod
    def _fold(acc: torch.Tensor, ids: torch.Tensor, r: torch.Tensor, norm: torch.Tensor) -> None:
        """Add flat (row, routing weight, |x|) triples to a [4, rows] accumulator."""
        ids = ids.long()
        rn = r * norm
        acc[:3].index_add_(1, ids, torch.stack([r, rn, rn * norm]))
        acc[3].scatter_reduce_(0, ids, norm, reduce="amax", include_self=True)

    def _merged(self) -> torch.Tensor | None:
        """[4, L*E] on the device: the sums of the window's tracked requests, each weighted per layer by its KV
        blocks over its routing weight so far (as `_request_scale` weighs a window's; the max: the largest); None
        without tracked requests."""
        if self._merge is None or not len(self._merge[0]) or self._req is None:
            return None
        rows, blocks = self._merge
        device = self._req.device
        req = self._req_acc(device).view(4, self._slots + 1, self._stride)[:, _to_device(torch.from_numpy(rows),
                                                                                           device)]
        per_layer = req[0].view(len(rows), self.num_layers, self.num_experts).sum(-1)  # [b, L]
        weights = _to_device(torch.from_numpy(blocks), device)[:, None] / per_layer.clamp_min(_TINY)
        out = torch.empty(4, self._stride, device=device)
        out[:3] = (req[:3] * weights.repeat_interleave(self.num_experts, dim=1)).sum(1)
        out[3] = req[3].amax(0)
        return out

    def _with_merged(self) -> torch.Tensor:
        """The window's sums, and the window's requests' below them if tracked: [4 or 8, L*E]."""
        merged = self._merged()
        return self._acc if merged is None else torch.cat([self._acc, merged])

    @torch.no_grad()
    def prefetch(self) -> None:
        """Start the device-to-host copy of everything observed so far: into pinned memory behind a CUDA event, so
        the engine can read the statistics during the next step without waiting for that step's graph. An armed
        forward that made no call still starts its (empty) window: a read must not see the last one again."""
        self._begin()
        self._reduce()
        if self._acc is None:
            return
        self._land_copy()
        sums = self._with_merged()
        self._copy = HostCopy.start(sums)
        self._acc = None

    def _land_copy(self) -> None:
        if self._copy is not None:
            self._add(self._copy.wait().numpy())
            self._copy = None

    def _add(self, sums: np.ndarray) -> None:
        """Window sums [4, L*E] add up; the tracked requests' sums below them, if any, are the latest snapshot."""
        sums = sums.reshape(-1, *self._host.shape)
        self._host[:3] += sums[0, :3]
        np.maximum(self._host[3], sums[0, 3], out=self._host[3])
        if len(sums) > 1:
            self._feat = sums[1].copy()

    def _flush(self) -> None:
        """Everything observed so far into the host sums: a prefetched copy, then the one device-to-host copy."""
        self._reduce()
        self._land_copy()
        if self._acc is None:
            return
        self._add(self._with_merged().cpu().numpy())
        self._acc = None

    def _stat(self, i: int) -> np.ndarray:
        self._flush()
        return self._host[i]

    @property
    def mass(self) -> np.ndarray:
        """[L, E] sum of routing weights, times the token weights (an armed window of several requests: each
        request's scaled to add up to its KV blocks per layer, `_request_scale`)."""
        return self._stat(0)

    @property
    def norm_sum(self) -> np.ndarray:
        """[L, E] sum of r * |x|."""
        return self._stat(1)

    @property
    def norm2_sum(self) -> np.ndarray:
        """[L, E] sum of r * |x|^2."""
        return self._stat(2)

    @property
    def norm_max(self) -> np.ndarray:
        """[L, E] max |x| over tokens routed to the expert."""
        return self._stat(3)

    def routing_mass(self) -> np.ndarray:
        return normalize_mass(self.mass)

    def features(self) -> np.ndarray:
        """phi [n_blocks, 4] = (routing-weighted mean |x|, routing-weighted RMS |x|, max |x|, the expert's share of
        its layer's routing mass); all 0 for an expert that got no token. Of the window's tokens, or with
        `track_requests` of its requests' observed tokens so far (merged weighted by their KV blocks)."""
        self._flush()
        mass, norm_sum, norm2_sum, norm_max = self._host if self._feat is None else self._feat
        denom = np.where(mass > 0, mass, 1.0)
        share = mass / np.maximum(mass.sum(axis=1, keepdims=True), _TINY)
        phi = np.stack([norm_sum / denom, np.sqrt(norm2_sum / denom), norm_max, share], axis=-1)
        return np.repeat(phi.reshape(-1, N_FEATURES), 2, axis=0)


@dataclass
class ResidualHeads:
    """Linear heads rho_hat = w . x + a per (block type u, transition b->b'), x = centred log features.

    x = (log phi - feat_mean) / feat_scale. feat_mean is each block's mean log features over the calibration
    sequences that routed to it ([n_blocks, 4]; a [4] row applies to every block), so a head sees how this prompt
    differs from the block's usual traffic, which is what its target (the block's damage over its geometric mean
    damage, `damage_samples`) varies with; a block with no token in the observation gets x = 0 (no evidence: rho_hat = a).
    Arrays are indexed [u, b, b'] (u: 0 gate_up, 1 down). confidence c in [0, 1]; c = 0 gives eta = 1 exactly.
    """

    weight: np.ndarray  # [2, P+1, P+1, 4]
    bias: np.ndarray  # [2, P+1, P+1]
    confidence: np.ndarray  # [2, P+1, P+1]
    feat_mean: np.ndarray  # [n_blocks, 4] or [4]
    feat_scale: np.ndarray  # [4]

    def __post_init__(self) -> None:
        w = self.weight.shape[1]
        shapes = {"weight": (2, w, w, N_FEATURES), "bias": (2, w, w), "confidence": (2, w, w),
                  "feat_scale": (N_FEATURES,)}
        for name, shape in shapes.items():
            if getattr(self, name).shape != shape:
                raise ValueError(f"residual heads: {name} has shape {getattr(self, name).shape}, expected {shape}")
        if self.feat_mean.shape[-1:] != (N_FEATURES,) or self.feat_mean.ndim > 2:
            raise ValueError(f"residual heads: feat_mean has shape {self.feat_mean.shape}, expected [n, 4] or [4]")

    @property
    def parent_bits(self) -> int:
        return self.weight.shape[1] - 1

    @classmethod
    def zeros(cls, parent_bits: int) -> "ResidualHeads":
        w = parent_bits + 1
        return cls(np.zeros((2, w, w, N_FEATURES)), np.zeros((2, w, w)), np.zeros((2, w, w)),
                   np.zeros(N_FEATURES), np.ones(N_FEATURES))

    def transform(self, phi: np.ndarray, blocks: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """x of every row of phi; rows are blocks 0..n-1, or `blocks` [m] when given (per-row form). A NaN feature
        (an overflowed activation norm) is no evidence (0), an infinite one the largest finite: eta stays finite."""
        phi = np.nan_to_num(np.asarray(phi, dtype=np.float64), nan=0.0, posinf=1e300, neginf=0.0)
        mean = self.feat_mean if blocks is None or self.feat_mean.ndim == 1 else self.feat_mean[blocks]
        out = np.add(phi, _TINY, out=out)
        np.log(out, out=out)
        out -= mean
        out /= self.feat_scale
        out *= phi[:, -1:] > 0
        return out

    def eta(self, blocks: np.ndarray, b_from: np.ndarray, b_to: np.ndarray, phi: np.ndarray, alpha: float,
            clip: tuple[float, float]) -> np.ndarray:
        """eta = exp(alpha * c * clip(rho_hat)) of block blocks[j] under b_from[j] -> b_to[j] (per-row reference)."""
        kinds = np.asarray(blocks) % 2
        x = self.transform(phi, np.asarray(blocks))
        rho = np.einsum("nf,nf->n", self.weight[kinds, b_from, b_to], x) + self.bias[kinds, b_from, b_to]
        return np.exp(alpha * self.confidence[kinds, b_from, b_to] * np.clip(rho, clip[0], clip[1]))

    def log_eta_columns(self, u: np.ndarray, b_from: np.ndarray, b_to: np.ndarray, phi: np.ndarray, alpha: float,
                        clip: tuple[float, float], out: np.ndarray | None = None,
                        x_out: np.ndarray | None = None) -> np.ndarray:
        """log eta of every block under each of K transitions (u[k], b_from[k], b_to[k]): [n, K], one small matmul.

        `out` [n, K] and `x_out` [n, 4] are optional scratch, so a caller running every step allocates nothing.
        """
        rho = np.matmul(self.transform(phi, out=x_out), self.weight[u, b_from, b_to].T, out=out)
        rho += self.bias[u, b_from, b_to]
        np.clip(rho, clip[0], clip[1], out=rho)
        rho *= alpha * self.confidence[u, b_from, b_to]
        return rho

    @classmethod
    def fit(cls, parent_bits: int, blocks: np.ndarray, b_from: np.ndarray, b_to: np.ndarray, phi: np.ndarray,
            log_ratio: np.ndarray, n_blocks: int, ridge: float = 1e-2, min_samples: int = 8) -> "ResidualHeads":
        """Ridge fit of each head on samples (block, transition, phi, log(measured damage / the block's mean)).

        Features are centred per block (blocks without samples get the mean over all samples). Confidence is the
        adjusted R^2 of the head's fit, clipped to [0, 1]; heads with fewer than `min_samples` samples keep
        confidence 0 (they fall back to the global estimate).
        """
        blocks = np.asarray(blocks, dtype=np.int64)
        if not len(blocks):
            return cls.zeros(parent_bits)
        logphi = np.log(np.asarray(phi, dtype=np.float64) + _TINY)
        count = np.bincount(blocks, minlength=n_blocks)[:, None]
        sums = np.zeros((n_blocks, N_FEATURES))
        np.add.at(sums, blocks, logphi)
        feat_mean = np.where(count > 0, sums / np.maximum(count, 1), logphi.mean(axis=0))
        centred = logphi - feat_mean[blocks]
        heads = cls.zeros(parent_bits)
        heads.feat_mean, heads.feat_scale = feat_mean, np.maximum(centred.std(axis=0), 1e-6)
        x = centred / heads.feat_scale
        keys = np.stack([blocks % 2, b_from, b_to], axis=1)
        for key in np.unique(keys, axis=0):
            sel = np.all(keys == key, axis=1)
            m = int(sel.sum())
            if m < min_samples:
                continue
            xs = np.concatenate([x[sel], np.ones((m, 1))], axis=1)
            y = log_ratio[sel]
            reg = ridge * np.eye(N_FEATURES + 1)
            reg[-1, -1] = 0.0
            coef = np.linalg.solve(xs.T @ xs + m * reg, xs.T @ y)
            sse = float(((xs @ coef - y) ** 2).sum())
            sst = float(((y - y.mean()) ** 2).sum())
            r2 = 1.0 - sse / sst if sst > 0 else 0.0
            adj = 1.0 - (1.0 - r2) * (m - 1) / max(m - N_FEATURES - 1, 1)
            u, a, b = (int(k) for k in key)
            heads.weight[u, a, b] = coef[:N_FEATURES]
            heads.bias[u, a, b] = coef[N_FEATURES]
            heads.confidence[u, a, b] = float(np.clip(adj, 0.0, 1.0))
        return heads

    def to_dict(self) -> dict[str, np.ndarray]:
        return {k: np.asarray(getattr(self, k), dtype=np.float64)
                for k in ("weight", "bias", "confidence", "feat_mean", "feat_scale")}

    @classmethod
    def from_dict(cls, d: dict) -> "ResidualHeads":
        names = {"weight", "bias", "confidence", "feat_mean", "feat_scale"}
        if set(d) != names:
            raise ValueError(f"residual heads: fields {sorted(d)}, expected {sorted(names)}")
        return cls(**{k: np.asarray(v, dtype=np.float64) for k, v in d.items()})


def damage_samples(phi: np.ndarray, damage: np.ndarray, seed_bits: int):
    """Training samples of the residual heads from per-sequence features [S, n, 4] and damage [S, n, P+1].

    damage[s, i, b] is sequence s's measured damage of block i's drop b+1 -> b. A sample is a (sequence, block,
    drop) whose expert saw tokens of the sequence; its target is log(damage / the block's geometric mean damage over
    those sequences): the prompt's deviation from the block's usual damage, which eta applies to the global
    estimate g (DESIGN.md §2 names the ratio to g itself; measured output error and a Fisher g are in other units,
    and g is already the block's global figure). The geometric mean centres every block's targets at 0, so a typical
    prompt and a block without evidence get eta = 1 (an arithmetic mean put the bias at about minus half the
    log-damage spread, unequal between gate_up and down: a planner lean toward one kind).
    Returns (blocks, b_from, b_to, phi rows, targets).
    """
    S, n, w = damage.shape
    out = [], [], [], [], []
    for b in range(seed_bits, w - 1):
        d = damage[:, :, b]
        ok = (phi[:, :, -1] > 0) & (d > 0)
        log_d = np.log(np.where(ok, d, 1.0))
        log_mean = log_d.sum(axis=0) / np.maximum(ok.sum(axis=0), 1)
        s_idx, i_idx = np.nonzero(ok)
        for lst, v in zip(out, (i_idx, np.full(len(i_idx), b + 1), np.full(len(i_idx), b), phi[s_idx, i_idx],
                                log_d[s_idx, i_idx] - log_mean[i_idx])):
            lst.append(v)
    blocks, b_from, b_to, rows, y = (np.concatenate(v) if v else np.zeros(0) for v in out)
    return blocks.astype(np.int64), b_from.astype(np.int64), b_to.astype(np.int64), rows.reshape(-1, N_FEATURES), y


def fit_residual_heads(phi: np.ndarray, damage: np.ndarray, seed_bits: int, **fit_options) -> ResidualHeads:
    """Residual heads from per-sequence measured damage (`damage_samples`), one head per kind and drop b+1 -> b."""
    blocks, b_from, b_to, rows, y = damage_samples(phi, damage, seed_bits)
    return ResidualHeads.fit(damage.shape[2] - 1, blocks, b_from, b_to, rows, y, damage.shape[1], **fit_options)
