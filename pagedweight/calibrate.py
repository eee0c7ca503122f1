"""Calibration pass: per-weight sensitivity of every expert block and routing mass per layer and expert.

Two sensitivities (DESIGN.md §2), the caller says which:
- `activation`: diag(XᵀX) of the inputs routed to each expert, per input column (shared by the rows of the block).
  For gate_up the inputs are the hidden states routed to the expert; for down they are silu(gate)·up of those
  tokens. Forward passes only.
- `fisher`: empirical Fisher diagonal as Any-Precision LLM: sum over calibration sequences of the squared
  per-sequence gradient of the LM loss w.r.t. every expert weight (one backward pass per sequence).
Routing mass m_{l,e} is measured in the same forward passes. The passes run in the model's dtype (float32, or a
16-bit one to halve the model's memory); every statistic is accumulated in float32 (Fisher sums) or float64
(activation sums, routing mass) whatever it is. Statistics are cached next to the output, keyed by a hash of the
model files, the calibration text and the settings (the dtype included), so a second conversion reuses them.
`DamageProbe` measures, per calibration sequence, the damage each width drop of each block would do, the
training data of the planner's prompt residual heads.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

import torch
import torch.nn.functional as F
from loguru import logger
from tqdm import tqdm

from pagedweight.models import MoEForCausalLM
from pagedweight.models.config import DTYPE_NAMES
from pagedweight.signals import N_FEATURES, ResidualHeads, RouterStats, fit_residual_heads

KINDS = ("activation", "fisher")
CACHE_VERSION = 2  # 2: calibration sequences spread over the text (1: its prefix)


@dataclass
class CalibStats:
    """Sensitivities [L, E, K] (activation) or [L, E, N, K] (fisher) per block kind, and routing statistics."""

    kind: str
    gate_up: torch.Tensor  # float32 [L, E, D] or [L, E, 2F, D]
    down: torch.Tensor  # float32 [L, E, F] or [L, E, D, F]
    routing_mass: torch.Tensor  # float64 [L, E]: share of the layer's routing weight each expert received
    routed_tokens: torch.Tensor  # int64 [L, E]: how many (token, slot) pairs chose the expert
    tokens: int  # calibration tokens seen
    dtype: str = "float32"  # the dtype the model ran the calibration passes in (the statistics are float32)

    def block(self, layer: int, expert: int, kind: str) -> torch.Tensor:
        """Sensitivity of one block: [K] (broadcast over rows) or [N, K]."""
        return (self.gate_up if kind == "gate_up" else self.down)[layer, expert]

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        tensors = {"gate_up": self.gate_up, "down": self.down, "routing_mass": self.routing_mass,
                   "routed_tokens": self.routed_tokens}
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(path),
                  metadata={"kind": self.kind, "tokens": str(self.tokens), "version": str(CACHE_VERSION),
                            "dtype": self.dtype})

    @classmethod
    def load(cls, path: Path) -> "CalibStats":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
            t = {k: f.get_tensor(k) for k in f.keys()}
        return cls(meta["kind"], t["gate_up"], t["down"], t["routing_mass"], t["routed_tokens"], int(meta["tokens"]),
                   meta.get("dtype", "float32"))  # files of before the dtype was recorded: float32 passes


def calibration_batches(token_ids: list[int], num_seqs: int, seq_len: int) -> torch.Tensor:
    """Up to `num_seqs` disjoint sequences of `seq_len` tokens, spread evenly over the tokenised calibration text.

    Sequence j starts at j * (len // count): a calibration text is many documents, and the first few of them
    route very differently from the rest (on the bundled model the first 16k tokens of data/calib.txt leave
    experts unrouted that the rest of the text uses), so a contiguous prefix gives wrong sensitivities.
    """
    count = min(num_seqs, len(token_ids) // seq_len)
    if count == 0:
        raise ValueError(f"calibration text has {len(token_ids)} tokens, fewer than one sequence of {seq_len}")
    if count < num_seqs:
        logger.warning("calibration text gives {} sequences of {} tokens, not the {} asked for", count, seq_len,
                       num_seqs)
    stride = len(token_ids) // count
    return torch.tensor(token_ids[:count * stride], dtype=torch.long).view(count, stride)[:, :seq_len].contiguous()


def cache_key(files: list[Path], calib_text: bytes, **settings: object) -> str:
    """blake2b over the model files' bytes, the calibration text and the settings."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps({"version": CACHE_VERSION, **settings}, sort_keys=True).encode())
    total = sum(p.stat().st_size for p in files)
    # tens of seconds for a large checkpoint, cache hit or not: shown
    with tqdm(total=total, desc="calibration cache key", unit="B", unit_scale=True, disable=total < 1 << 30) as bar:
        for path in sorted(files):
            h.update(path.name.encode())
            with open(path, "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
                    bar.update(len(chunk))
    h.update(calib_text)
    return h.hexdigest()


class _RoutingObserver:
    """Router observer accumulating routing mass and, for `activation`, diag(XᵀX) of each expert's inputs."""

    def __init__(self, model: MoEForCausalLM, activation: bool) -> None:
        cfg = model.config
        dev = next(model.parameters()).device
        L, E, D, Fi = cfg.num_hidden_layers, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.model, self.activation = model, activation
        self.mass = torch.zeros(L, E, dtype=torch.float64, device=dev)
        self.count = torch.zeros(L, E, dtype=torch.int64, device=dev)
        self.gate_up = torch.zeros(L, E, D, dtype=torch.float64, device=dev) if activation else None
        self.down = torch.zeros(L, E, Fi, dtype=torch.float64, device=dev) if activation else None

    @torch.no_grad()
    def __call__(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        E = self.mass.shape[1]
        ids = topk_ids.reshape(-1)
        self.mass[layer].index_add_(0, ids, topk_weights.reshape(-1).to(torch.float64))
        self.count[layer] += torch.bincount(ids, minlength=E)
        if not self.activation:
            return
        experts = self.model.layers[layer].mlp.experts
        x = x.detach().float()
        for e in torch.unique(ids).tolist():
            xe = x[(topk_ids == e).any(-1)]
            gate, up = F.linear(xe, experts.gate_up[e].float()).chunk(2, dim=-1)
            self.gate_up[layer, e] += (xe.double() ** 2).sum(0)
            self.down[layer, e] += ((F.silu(gate) * up).double() ** 2).sum(0)


def calibrate(model: MoEForCausalLM, batches: torch.Tensor, kind: str, batch_size: int = 8) -> CalibStats:
    """Run the calibration pass over `batches [S, T]` on the model's device, in the model's dtype."""
    if kind not in KINDS:
        raise ValueError(f"sensitivity must be one of {KINDS}, got {kind!r}")
    dev = next(model.parameters()).device
    dtype = DTYPE_NAMES[next(model.parameters()).dtype]
    obs = _RoutingObserver(model, activation=kind == "activation")
    model.set_router_observer(obs)
    try:
        if kind == "activation":
            with torch.no_grad():
                for start in tqdm(range(0, len(batches), batch_size), desc="calibrate (activation)", unit="batch"):
                    model(batches[start:start + batch_size].to(dev))
            gate_up, down = obs.gate_up.float(), obs.down.float()
        else:
            gate_up, down = _fisher(model, batches, dev)
    finally:
        model.set_router_observer(None)
    if not (torch.isfinite(gate_up).all() and torch.isfinite(down).all()):  # quantize_rows would fall back to
        # uniform weights for those rows and the checkpoint's sensitivities would be NaN
        passes = "forward" if kind == "activation" else "forward or backward"
        tries = ["--dtype bfloat16 (float32's range at half its memory) or --dtype float32"] if dtype == "float16" \
            else ["--dtype float32"] if dtype != "float32" else []
        if kind == "fisher":  # no backward pass
            tries.append("--sensitivity activation")
        hint = "try " + ", or ".join(tries) if tries else ""
        if dtype == "float32":
            hint += (", or " if hint else "") + "check the checkpoint for inf/NaN weights"
        raise ValueError(f"the {kind} calibration statistics are not finite: an overflow in the calibration {passes} "
                         f"pass of the {dtype} model ({hint})")
    total = obs.mass.sum(1, keepdim=True)
    mass = torch.where(total > 0, obs.mass / total.clamp_min(1e-300), torch.zeros_like(obs.mass))
    return CalibStats(kind, gate_up.cpu(), down.cpu(), mass.cpu(), obs.count.cpu(), int(batches.numel()), dtype)


# Elements of a 16-bit gradient squared per step into the float32 sums: each step makes a float32 copy of this many
# (64 MiB), not of the whole gradient (one layer's gate_up of Qwen1.5-MoE: 346 M weights, 1.4 GB in float32). A
# mixed-dtype acc.addcmul_(g, g) made two whole float32 copies on the CPU (peak RSS +512 MiB for a 64 M-element
# bfloat16 gradient; add_square +64 MiB).
SQUARE_CHUNK = 1 << 24


def add_square(acc: torch.Tensor, g: torch.Tensor, chunk: int = SQUARE_CHUNK) -> None:
    """acc += g * g with the square taken in acc's dtype (float32): a 16-bit gradient is widened before it is squared
    (a bfloat16 square would lose all but 8 bits, a float16 one would overflow above 256), `chunk` elements at a
    time so the widened copy stays small."""
    if g.dtype == acc.dtype:
        acc.addcmul_(g, g)
        return
    a, flat = acc.view(-1), g.reshape(-1)  # acc is a slice of contiguous sums; a gradient is laid out as its weight
    for start in range(0, flat.numel(), chunk):
        x = flat[start:start + chunk].to(acc.dtype)
        a[start:start + chunk].addcmul_(x, x)
        del x  # freed before the next chunk's copy is made: one copy at a time


def _fisher(model: MoEForCausalLM, batches: torch.Tensor, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over sequences of the squared per-sequence gradient w.r.t. every expert weight. Each gradient is squared
    into its layer's slice of two preallocated float32 sums as soon as the backward pass has it, then freed: beyond
    the model the pass holds the sums (4 bytes per expert weight, whatever the model's dtype) and about one gradient
    in the model's dtype (every expert's gradient at once, their squares and a final stack took 3.4x the experts'
    float32 bytes: at Qwen1.5-MoE's 46 GiB more than an H200 holds). A 16-bit gradient is squared in float32
    (`add_square`)."""
    experts = [layer.mlp.experts for layer in model.layers]
    saved = {p: p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    gate_up = torch.zeros(len(experts), *experts[0].gate_up.shape, dtype=torch.float32, device=dev)
    down = torch.zeros(len(experts), *experts[0].down.shape, dtype=torch.float32, device=dev)

    def fold(acc: torch.Tensor):
        def hook(p: torch.Tensor) -> None:
            add_square(acc, p.grad)
            p.grad = None
        return hook

    params, hooks = [], []
    for l, ex in enumerate(experts):
        for p, acc in ((ex.gate_up, gate_up[l]), (ex.down, down[l])):
            p.requires_grad_(True)
            params.append(p)
            hooks.append(p.register_post_accumulate_grad_hook(fold(acc)))
    try:
        for seq in tqdm(batches, desc="calibrate (fisher)", unit="seq"):
            seq = seq.to(dev).unsqueeze(0)
            F.cross_entropy(model(seq)[0, :-1], seq[0, 1:]).backward()
    finally:
        for h in hooks:
            h.remove()
        for p in params:
            p.grad = None
        for p, flag in saved.items():
            p.requires_grad_(flag)
    return gate_up, down


def cached_calibrate(model: MoEForCausalLM, model_files: list[Path], calib_path: str | Path, cache_dir: str | Path,
                     kind: str, num_seqs: int, seq_len: int, encode) -> CalibStats:
    """calibrate() unless `cache_dir` already holds statistics for the same model files, text and settings.

    The settings include the dtype the model is in (statistics of a bfloat16 pass are not those of a float32 one);
    float32 adds nothing to the key, so the keys of float32 statistics are those of before the dtype was an option.
    `encode` turns the calibration text into token ids.
    """
    text = Path(calib_path).read_bytes()
    dtype = DTYPE_NAMES[next(model.parameters()).dtype]
    settings = {"kind": kind, "num_seqs": num_seqs, "seq_len": seq_len}
    if dtype != "float32":
        settings["dtype"] = dtype
    key = cache_key(model_files, text, **settings)
    path = Path(cache_dir) / f"calib-{kind}-{key}.safetensors"
    if path.exists():
        try:
            stats = CalibStats.load(path)
            if stats.dtype != dtype:
                raise ValueError(f"a {stats.dtype} pass, the model is {dtype}")
            logger.info("reusing calibration statistics {}", path)
            return stats
        except Exception as exc:  # cut short by a crash before writes were atomic, or damaged: compute it again
            logger.warning("calibration statistics {} unusable ({}): recomputing them", path, exc)
    batches = calibration_batches(encode(text.decode("utf-8")), num_seqs, seq_len)
    stats = calibrate(model, batches, kind)
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    stats.save(tmp)
    os.replace(tmp, path)  # a kill mid-write leaves no file under the cache's name
    logger.info("calibration statistics cached in {}", path)
    return stats


class DamageProbe:
    """Per-sequence measured damage of every width drop, to train the prompt residual heads (DESIGN.md §2).

    `capture` runs each sequence once at full precision (the model's dtype) and keeps every MoE layer's expert inputs
    (float32) and routing (on the CPU) plus the sequence's `RouterStats` features, so they match what the engine
    observes. `measure` then needs only a block's weights at each width: the damage of sequence s for the drop
    b+1 -> b is sum over its tokens t routed to the expert of r_t |(W_{b+1} - W_b) in_t|^2, with in_t the block's
    input at full precision (x_t for gate_up, silu(gate) * up for down), computed in float32 whatever the model's
    dtype.
    """

    def __init__(self, model: MoEForCausalLM, seed_bits: int, parent_bits: int) -> None:
        cfg = model.config
        self.model, self.seed_bits, self.parent_bits = model, seed_bits, parent_bits
        self.num_layers, self.num_experts = cfg.num_hidden_layers, cfg.num_experts
        self.features = np.zeros((0, self.num_layers * self.num_experts * 2, N_FEATURES))  # [S, n, 4]
        self.damage = np.zeros((0, self.features.shape[1], parent_bits + 1))  # [S, n, P+1]
        # per layer: expert inputs [tokens, D] and, per expert, (token rows, routing weights, sequence of each)
        self._x: list[torch.Tensor] = []
        self._routes: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []

    @torch.no_grad()
    def capture(self, batches: torch.Tensor) -> "DamageProbe":
        """Observe the sequences `batches [S, T]` (one forward each on the model's device)."""
        L, E = self.num_layers, self.num_experts
        dev = next(self.model.parameters()).device
        feats, xs, seen = [], [[] for _ in range(L)], [[] for _ in range(L)]  # per layer, one entry per sequence
        for seq in tqdm(batches, desc="residual heads: capture", unit="seq"):
            stats = RouterStats(L, E)

            def observe(layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> None:
                stats(layer, x, ids, w)
                xs[layer].append(x.detach().float().cpu())
                seen[layer].append((ids.detach().cpu(), w.detach().float().cpu()))

            self.model.set_router_observer(observe)
            try:
                self.model(seq.to(dev)[None])
            finally:
                self.model.set_router_observer(None)
            feats.append(stats.features())
        self.features = np.stack(feats)
        self.damage = np.zeros((len(feats), self.features.shape[1], self.parent_bits + 1))
        self._x = [torch.cat(x) for x in xs]
        self._routes = []
        for layer in range(L):
            ids = torch.cat([i for i, _ in seen[layer]])
            w = torch.cat([w for _, w in seen[layer]])
            seq_of = torch.cat([torch.full((len(i),), s) for s, (i, _) in enumerate(seen[layer])])
            rows = []
            for e in range(E):
                tok, slot = torch.nonzero(ids == e, as_tuple=True)
                rows.append((tok, w[tok, slot], seq_of[tok]))
            self._routes.append(rows)
        return self

    @torch.no_grad()
    def measure(self, layer: int, expert: int, kind: str, weight_at: Callable[[int], torch.Tensor]) -> None:
        """Fill damage[:, block, b] for b in [seed, P) from `weight_at(b)` (float32 [N, K], block at width b)."""
        tok, r, seq_of = self._routes[layer][expert]
        if not len(tok):
            return
        w = {b: weight_at(b) for b in range(self.seed_bits, self.parent_bits + 1)}
        dev = w[self.parent_bits].device
        inp = self._x[layer][tok].to(dev)
        if kind == "down":
            gate, up = F.linear(inp, self.model.layers[layer].mlp.experts.gate_up[expert].float().to(dev)).chunk(2, -1)
            inp = F.silu(gate) * up
        r, seq_of = r.to(dev), seq_of.to(dev)
        i = (layer * self.num_experts + expert) * 2 + (kind == "down")
        for b in range(self.seed_bits, self.parent_bits):
            err = (F.linear(inp, w[b + 1] - w[b]) ** 2).sum(1) * r
            per_seq = torch.zeros(len(self.damage), dtype=torch.float64, device=dev).index_add_(0, seq_of, err.double())
            self.damage[:, i, b] = per_seq.cpu().numpy()

    def fit(self, **fit_options) -> ResidualHeads:
        """The residual heads fitted on everything measured (`signals.fit_residual_heads`)."""
        return fit_residual_heads(self.features, self.damage, self.seed_bits, **fit_options)
