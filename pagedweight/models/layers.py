"""Building blocks shared by every MoE family: RMSNorm, RoPE, GQA attention, experts, MoE block, KV cache.

Numerics follow the published models (checked against transformers in tests/test_models_oracle.py):
norms and softmaxes run in float32 and cast back, RoPE angles are computed in float32.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable, NamedTuple, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from numba import njit
from torch import nn

from pagedweight.models.config import ModelConfig

RouterObserver = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


class KVCache(Protocol):
    """What attention needs from a cache; `DenseKVCache` here, a paged one in the engine."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, scale: float
               ) -> torch.Tensor:
        """Store the new k, v [B, Hkv, T, hd] of `layer` (None: written through `kv_store`), then attend q [B, H, T,
        hd] over the context they extend; returns [B, H, T, hd]."""
        ...

    def kv_store(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """Where a kernel may write the new K/V of `layer` itself (kv_cache.PagedKVCache.kv_store), or None."""
        ...


FOLDED_MASK_BYTES = 64 << 20  # the most one slice of a chunk's folded mask may take (bool, and SDPA's copy of it)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
         ) -> torch.Tensor:
    """Attention of q [B, H, T, hd] over keys [B, Hkv, S, hd] under a head-independent mask (broadcast to
    [B, 1, T, S]); mask None means the T queries are the last T of the S positions, causally. When keys are exactly
    the queries' positions `is_causal` keeps SDPA on its fused kernels; otherwise the causal mask is built.

    Grouped heads (Hkv < H) under a mask are folded: a KV head's G = H / Hkv query heads become G * T queries of one
    head, so SDPA sees equal heads. Why: with cuDNN's SDPA off (runner.py) no fused CUDA kernel takes a mask with
    grouped heads (flash takes no mask, the memory-efficient kernel no grouped heads), and the math kernel repeats K
    and V per query head beside fp32 scores. On Qwen3-30B-A3B's 32 / 4 heads a chunk of 512 queries over 2,016 keys
    added 373 MiB to the allocated peak, 33 folded; 32 decode rows over 4,096 keys 6,673 MiB and 6.2 ms, 0.5 MiB
    and 0.22 ms folded (sdpa_ab-nvidia-h200-20261201-s24-fold.json). A chunk's mask is repeated per group member, in
    slices of its queries whose copy stays within FOLDED_MASK_BYTES."""
    b, h, t, hd = q.shape
    hkv, s = k.shape[1], k.shape[2]
    if mask is None and t > 1 and s > t:
        mask = causal_mask(t, s, q.device)
    if mask is None or hkv == h:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and t > 1, scale=scale,
                                              enable_gqa=hkv != h)
    g = h // hkv  # query head i reads KV head i // g, as SDPA's enable_gqa has it
    if t == 1:  # one query per row: the mask [B, 1, 1, S] broadcasts over the G queries of a KV head
        out = F.scaled_dot_product_attention(q.reshape(b, hkv, g, hd), k, v, attn_mask=mask, scale=scale)
        return out.reshape(b, h, 1, hd)
    mask = mask.reshape(-1, 1, t, s)
    rows = max(1, FOLDED_MASK_BYTES // (g * s * (1 + q.element_size())))
    outs = []
    for t0 in range(0, t, rows):
        n = min(rows, t - t0)
        folded = mask[:, :, None, t0:t0 + n].expand(-1, -1, g, -1, -1).reshape(-1, 1, g * n, s)
        out = F.scaled_dot_product_attention(q[:, :, t0:t0 + n].reshape(b, hkv, g * n, hd), k, v, attn_mask=folded,
                                             scale=scale)
        outs.append(out.reshape(b, h, n, hd))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


class MoEOut(NamedTuple):
    """An MoE block's output with a gated shared expert, not yet added to the residual stream (the layer kernels on):
    the next norm adds it and normalises the sum in one launch (`RMSNorm.forward`, layer_kernels.moe_out_norm), one
    launch a layer fewer than the block's own output kernel and then the norm. Rows [N, D] (gate [N, 1]); `shape`:
    the block's input shape."""
    residual: torch.Tensor
    routed: torch.Tensor
    gate: torch.Tensor
    shared: torch.Tensor
    shape: torch.Size

    def added(self) -> torch.Tensor:
        """residual + (routed + sigmoid(gate) * shared), in `shape` (where no norm of the kernels follows)."""
        from pagedweight.cuda import layer_kernels

        return layer_kernels.shared_expert_out(self.residual, self.routed, self.gate, self.shared).view(self.shape)


class RMSNorm(nn.Module):
    # here and in Attention, MLP and MoEBlock: cuda/layer_kernels.py while the model's layer kernels are on
    # (MoEForCausalLM.use_layer_kernels), else None (torch's ops)
    kernels: ModuleType | None = None

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor | MoEOut, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`: (residual + x, its norm), one launch on the kernel path (vLLM's convention); of
        an `MoEOut`: (its sum, the sum's norm), one launch."""
        if isinstance(x, MoEOut):
            if self.kernels is None:
                h = x.added()
                return h, self._norm(h)
            h, y = self.kernels.moe_out_norm(x.residual, x.routed, x.gate, x.shared, self.weight, self.eps)
            return h.view(x.shape), y.view(x.shape)
        if self.kernels is not None:
            return self.kernels.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = residual + x
        return x, self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # normalised in float32 by one fused op (a decode step is bound by host time per op), cast back, then
        # scaled in the input dtype: the published models' order of rounding
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, T, head_dim] (broadcast over heads) for integer positions [B, T]; angles in float32
    whatever `dtype` is. Computed once per forward, shaped once: every layer's q and k use them as they are."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device)
                                / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, hd], cos/sin [B, 1, T, hd]; rotate-half convention (first half pairs with second half)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def causal_mask(t_new: int, t_all: int, device: torch.device) -> torch.Tensor:
    """bool [t_new, t_all], True = may attend: the new tokens are the last t_new of t_all."""
    q_pos = torch.arange(t_all - t_new, t_all, device=device)
    return torch.arange(t_all, device=device)[None, :] <= q_pos[:, None]


class Attention(nn.Module):
    """Grouped-query attention with RoPE and optional q/k RMSNorm (per head, or over the full projection)."""

    # RoPE's kernel (with Qwen3's per-head q/k norm folded in): set only where q, k, v are fused, not clipped, and
    # normed per head or not at all
    kernels: ModuleType | None = None

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qk_norm, self.clip_qkv = cfg.qk_norm, cfg.clip_qkv
        d, q_out, kv_out = cfg.hidden_size, self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.q_proj = nn.Linear(d, q_out, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, kv_out, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, kv_out, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_out, d, bias=cfg.o_bias)
        self.qkv_proj: nn.Linear | None = None  # q, k, v in one projection after fuse_qkv()
        self._qkv_sizes = (q_out, kv_out, kv_out)
        if cfg.qk_norm == "head":
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        elif cfg.qk_norm == "full":
            self.q_norm = RMSNorm(q_out, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(kv_out, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None
                ) -> torch.Tensor:
        b, t, _ = x.shape
        if self.kernels is not None:
            qkv = self.qkv_proj(x)
            head_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm == "head" else None
            store = None if cache is None else cache.kv_store(self.layer)  # K/V written by RoPE's kernel: one launch
            if store is not None and store[0].dtype != qkv.dtype:
                store = None
            q, k = self.kernels.rope(qkv, cos, sin, self.n_heads, self.n_kv, head_norm, store)
            v = None if store is not None else (
                qkv[..., -self._qkv_sizes[2]:].view(b, t, self.n_kv, self.head_dim).transpose(1, 2))
            return self._attend(q, k, v, cache)
        if t > 1 and self.qkv_proj is not None and self.qk_norm == "none" and self.clip_qkv is None:
            # q's and k's heads are adjacent in the fused output: RoPE on both in one pass (one op each where two
            # passes ran two: a prefill step's host time is bound by torch calls, ~10 us each on the H100's host).
            # Not in decode steps, whose q and k stay whole tensors for the decode kernels (store_kv, attention)
            qkv, qk_out = self.qkv_proj(x), self._qkv_sizes[0] + self._qkv_sizes[1]
            qk = apply_rope(qkv[..., :qk_out].view(b, t, self.n_heads + self.n_kv, self.head_dim).transpose(1, 2),
                            cos, sin)
            v = qkv[..., qk_out:].view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
            return self._attend(qk[:, :self.n_heads], qk[:, self.n_heads:], v, cache)
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self._qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (z.clamp(-self.clip_qkv, self.clip_qkv) for z in (q, k, v))
        q = q.view(b, t, self.n_heads, self.head_dim)
        k = k.view(b, t, self.n_kv, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        v = v.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        return self._attend(q, k, v, cache)

    def _attend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, cache: KVCache | None
                ) -> torch.Tensor:
        """q [B, H, T, hd], k, v [B, Hkv, T, hd] after RoPE (None: in the cache already) -> the output projection's
        [B, T, D]."""
        b, _, t, _ = q.shape
        scale = self.head_dim ** -0.5
        out = sdpa(q, k, v, None, scale) if cache is None else cache.attend(self.layer, q, k, v, scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def fuse_qkv(self) -> None:
        """q, k and v from one projection (serving): a decode step launches one GEMM instead of three and reads the
        same bytes. The separate projections, and their checkpoint names, are dropped."""
        self.qkv_proj = fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj


def fuse_linears(*parts: nn.Linear, align: int = 1) -> nn.Linear:
    """One Linear whose output is the parts' outputs concatenated, in order (same dtype, device and bias use), then
    zero rows up to a multiple of `align` outputs. Each part is copied into its rows of the new weight: no
    concatenated temporary."""
    w = parts[0].weight
    bias = parts[0].bias is not None
    rows = sum(p.out_features for p in parts)
    fused = nn.utils.skip_init(nn.Linear, w.shape[1], -(-rows // align) * align, bias=bias, device=w.device,
                               dtype=w.dtype)
    with torch.no_grad():
        row = 0
        for p in parts:
            fused.weight[row:row + p.out_features].copy_(p.weight)
            if bias:
                fused.bias[row:row + p.out_features].copy_(p.bias)
            row += p.out_features
        fused.weight[row:].zero_()
        if bias:
            fused.bias[row:].zero_()
    return fused


class MLP(nn.Module):
    """SwiGLU MLP (the shared expert)."""

    kernels: ModuleType | None = None

    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The output from gate and up already projected side by side ([..., 2f], a fused projection's:
        `MoEBlock.fuse_inputs`)."""
        if self.kernels is not None:
            return self.down_proj(self.kernels.swiglu(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


@dataclass
class ExpertRows:
    """Where each routed (token, choice) pair sits in a grouped pass over the experts, planned on the host.

    Slots are experts in pass order; a group is up to `max_group` consecutive slots over consecutive rows. Padded, each
    slot of a group takes `width` rows (its pairs, then rows of zeros), so a group is one [n, width, D] batched matmul
    per projection; unpadded, a slot takes just its pairs' rows and `ends` closes each slot's run (the offsets of a
    grouped GEMM). A padding row reads token T (the caller's appended zero row) and adds its zero output there."""

    slots: np.ndarray  # [S] expert of each slot
    groups: list[tuple[int, int, int, int, int]]  # (first slot, slots, first row, end row, width; 0 when unpadded)
    token: np.ndarray  # [R] token of each row; T on padding rows
    pair: np.ndarray  # [R] flat pair index t * k + j of each row; 0 on padding rows (whose output is zero)
    ends: np.ndarray  # [S] end row of each slot's pairs, counted from its group's first row

    def to(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(slots, token, pair, ends) as int64 tensors on `device`, in one host-to-device copy."""
        parts = (self.slots, self.token, self.pair, self.ends)
        flat = torch.from_numpy(np.concatenate(parts).astype(np.int64)).to(device)
        return flat.split([len(p) for p in parts])


@njit(cache=True)
def split_groups(counts: np.ndarray, first: np.ndarray, bound: float) -> np.ndarray:
    """Group starts over pair counts sorted most first (a group pads to its first count): starting from `first`, the
    group split that saves the most padded rows is made until all rows are within `bound` (>= the pairs; a group of
    one slot never pads). Few splits where a per-group limit on padding split every small group at the tail too."""
    n = counts.size
    starts = np.zeros(n, np.bool_)
    for f in first:
        starts[f] = True
    while True:
        st = np.flatnonzero(starts)
        total = 0
        for j in range(st.size):
            total += counts[st[j]] * ((st[j + 1] if j + 1 < st.size else n) - st[j])
        if total <= bound:
            return st
        best, split, j, group_end, width = -1, 0, -1, 0, 0
        for i in range(n):  # the rows slot i would stop padding, for each slot up to its group's end
            if starts[i]:
                j += 1
                group_end, width = (st[j + 1] if j + 1 < st.size else n), counts[i]
            saved = (group_end - i) * (width - counts[i])
            if saved > best:
                best, split = saved, i
        starts[split] = True


@njit(cache=True)
def row_bucket(width: np.ndarray) -> np.ndarray:
    """Padded rows per slot rounded up to a quarter octave above 8 (9..16 by 2, 17..32 by 4, ...; at most 1/4 more),
    so that a padded group's batched matmul takes one of a few shapes: cuBLAS chooses a kernel on each shape's first
    sight (a median 112-2,221 us of host time on an H100 against 12-14 us after, h100-nvidia-h100-80gb-hbm3-20261206-
    s51-calls.log call 3), and exact widths give a new shape to many prefill calls
    (test_bucketed_rows_take_few_shapes)."""
    out = np.empty(width.size, np.int64)
    for i in range(width.size):
        w = np.int64(width[i])
        if w > 8:
            bits, v = 0, w
            while v:
                v >>= 1
                bits += 1
            quarter = np.int64(1) << (bits - 3)
            w = (w + quarter - 1) // quarter * quarter
        out[i] = w
    return out


@njit(cache=True)
def _plan_rows(flat: np.ndarray, num_experts: int, max_group: int, pad: bool, routed_only: bool, bound: float,
               bucket: bool, t: int, k: int):
    """`expert_rows`' layout, compiled: (slots, groups [G, 5], token, pair, ends). bound < 0: no padding bound.
    Compiled because it runs once per MoE layer of every prefill step, and as ~35 numpy calls on arrays of a few dozen
    slots it took ~110 us on the CPU box (~0.2 ms under cProfile on the H100's host, cprofile-nvidia-h100-80gb-hbm3-
    20261206-s52-prefill-b1.txt): per-call overhead, not work."""
    n = flat.size
    counts = np.zeros(num_experts, np.int64)
    for i in range(n):
        counts[flat[i]] += 1
    if routed_only:  # routed experts, most pairs first, ties by id: a counting sort by count (numpy's argsort,
        # compiled here, added 1.2 s to a cold cache's 7.5 s of compiling on the CPU box, layout_bench-…-s52-*-cold)
        most = counts.max()
        at = np.zeros(most + 2, np.int64)  # at[most - count + 1]: experts of larger counts, then the slot of each
        for e in range(num_experts):
            at[most - counts[e] + 1] += 1
        for j in range(1, most + 2):
            at[j] += at[j - 1]
        slots = np.empty(at[most], np.int64)  # the experts of count 0 are left out
        for e in range(num_experts):
            if counts[e]:
                slots[at[most - counts[e]]] = e
                at[most - counts[e]] += 1
    else:
        slots = np.arange(num_experts)
    s = slots.size
    c = counts[slots]
    first = np.arange(0, s, max_group)  # each group's first slot
    widths = np.zeros(first.size, np.int64)  # each group's rows per slot (padded)
    if pad:
        widths = _largest(c, first)
        if bound >= 0 and _padded(widths, first, s) > bound:
            first = split_groups(c, first, bound)
            widths = _largest(c, first)
        if bucket:
            rounded = row_bucket(widths)
            if bound < 0 or _padded(rounded, first, s) <= bound:
                widths = rounded
    rows = c.copy()
    if pad:
        for j in range(first.size):
            rows[first[j]:(first[j + 1] if j + 1 < first.size else s)] = widths[j]
    base = np.zeros(s, np.int64)  # each slot's first row
    for j in range(1, s):
        base[j] = base[j - 1] + rows[j - 1]
    total = base[s - 1] + rows[s - 1] if s else 0
    rank = np.full(num_experts, s, np.int64)
    for j in range(s):
        rank[slots[j]] = j
    token, pair, at = np.full(total, t, np.int64), np.zeros(total, np.int64), base.copy()
    for i in range(n):  # each slot's pairs in pair order (a stable counting sort)
        r = rank[flat[i]]
        token[at[r]], pair[at[r]] = i // k, i
        at[r] += 1
    groups = np.zeros((first.size, 5), np.int64)
    ends = np.empty(s, np.int64)
    g = 0
    for j in range(first.size):
        s0, s1 = first[j], (first[j + 1] if j + 1 < first.size else s)
        ends[s0:s1] = base[s0:s1] + c[s0:s1] - base[s0]
        r1 = base[s1 - 1] + rows[s1 - 1]
        if r1 > base[s0]:
            groups[g] = s0, s1 - s0, base[s0], r1, widths[j]
            g += 1
    return slots, groups[:g], token, pair, ends


@njit(cache=True)
def _largest(c: np.ndarray, first: np.ndarray) -> np.ndarray:
    """Each group's largest count (groups of consecutive slots starting at `first`)."""
    out = np.empty(first.size, np.int64)
    for j in range(first.size):
        out[j] = c[first[j]:(first[j + 1] if j + 1 < first.size else c.size)].max()
    return out


@njit(cache=True)
def _padded(widths: np.ndarray, first: np.ndarray, s: int) -> int:
    """Rows of groups starting at `first` (of s slots in all) that pad every slot to their width."""
    total = 0
    for j in range(first.size):
        total += widths[j] * ((first[j + 1] if j + 1 < first.size else s) - first[j])
    return total


def expert_rows(ids: np.ndarray, num_experts: int, max_group: int, pad: bool, routed_only: bool,
                slack: float | None = None, bucket: bool = False) -> ExpertRows:
    """The layout of routing ids [T, k]. routed_only: the slots are the routed experts, most pairs first (a padded
    group then pads little); else every expert in id order, so that a group's weights are a slice of stacked
    [E, ...] parameters. Padded groups of no rows (unrouted experts only) are left out. slack (routed_only): where
    groups of max_group slots would pad to more than (1 + slack) * T * k rows in all, groups are split where that
    saves most until they do not (`split_groups`). bucket (padded): each group's width rounded up by `row_bucket`
    where the rows stay within that bound (else exact). Each slot's pairs keep their order."""
    if slack is not None and (slack < 0 or not routed_only):
        raise ValueError(f"a slack >= 0 splits groups of counts sorted most first (routed_only=True); got {slack}")
    t, k = ids.shape
    bound = -1.0 if slack is None else (1 + slack) * t * k
    slots, groups, token, pair, ends = _plan_rows(ids.reshape(-1).astype(np.int64), num_experts, max_group, pad,
                                                  routed_only, bound, bucket, t, k)
    # plain ints (tolist): they size kernel grids, which take no numpy integers
    return ExpertRows(slots, [tuple(g) for g in groups.tolist()], token, pair, ends)


class DenseExperts(nn.Module):
    """E routed SwiGLU experts as two stacked weights; the paged any-precision experts replace this module.

    gate_up [E, 2F, D]: rows 0..F-1 are gate_proj, F..2F-1 up_proj; down [E, D, F].
    Three formulations, none loops over all E experts in Python on an accelerator:
    - gathered (few pairs on an accelerator, decode): the routed experts' weights are gathered per (token, slot)
      pair and run as one batched matmul per projection: a fixed handful of ops, no host synchronisation;
    - padded (more pairs on an accelerator: prefill): the routing read once, experts in groups of PADDED_GROUP, each
      group one batched matmul per projection over its pairs zero-padded to its largest expert's count: ~5 ops per
      group, where one matmul per expert made a Qwen1.5-shaped prefill step host-bound (~70 launches per layer);
    - grouped (the CPU, where reading back is free but copying weights and padding are not): pairs sorted by
      expert, one matmul per routed expert; the per-expert counts are the layer's one host read.
    `gather_max_pairs` picks: None = up to E pairs gathered on an accelerator, none on the CPU.
    """

    PADDED_GROUP = 16

    def __init__(self, num_experts: int, d: int, f: int) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * f, d))
        self.down = nn.Parameter(torch.empty(num_experts, d, f))
        self.gather_max_pairs: int | None = None

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [N, D], topk_ids [N, k], topk_weights [N, k] -> sum_k w * expert_k(x), [N, D] in x's dtype."""
        if topk_ids.numel() <= self.gather_limit(x.device):
            return self._gathered(x, topk_ids, topk_weights)
        if x.device.type == "cpu":
            return self._grouped(x, topk_ids, topk_weights)
        return self._padded(x, topk_ids, topk_weights)

    def gather_limit(self, device: torch.device) -> int:
        """Most (token, slot) pairs that take the gathered formulation on `device` (a CUDA graph needs it)."""
        if self.gather_max_pairs is not None:
            return self.gather_max_pairs
        return 0 if device.type == "cpu" else self.gate_up.shape[0]

    def _gathered(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Per (token, slot) pair: bmm with that pair's expert weights; no host synchronisation."""
        n, k = topk_ids.shape
        flat = topk_ids.reshape(-1)
        xs = x.unsqueeze(1).expand(n, k, x.shape[-1]).reshape(n * k, -1, 1)
        gate, up = torch.bmm(self.gate_up[flat], xs).squeeze(-1).chunk(2, dim=-1)
        y = torch.bmm(self.down[flat], (F.silu(gate) * up).unsqueeze(-1)).view(n, k, -1)
        return (y * topk_weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)

    def _padded(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Every expert in id order (a group's weights are a slice), groups zero-padded to their largest count; the
        routing is the layer's one host read, the layout one upload."""
        n, d = x.shape
        plan = expert_rows(topk_ids.cpu().numpy(), self.gate_up.shape[0], self.PADDED_GROUP, pad=True,
                           routed_only=False, bucket=True)
        _, token, pair, _ = plan.to(x.device)
        xs = F.pad(x, (0, 0, 0, 1)).index_select(0, token)  # padding rows read the appended zero row n
        ys = []
        for s0, g, r0, r1, width in plan.groups:
            h = torch.bmm(xs[r0:r1].view(g, width, d), self.gate_up[s0:s0 + g].transpose(1, 2))
            gate, up = h.chunk(2, dim=-1)
            ys.append(torch.bmm(F.silu(gate) * up, self.down[s0:s0 + g].transpose(1, 2)).view(-1, d))
        y = (torch.cat(ys) if len(ys) > 1 else ys[0]) * topk_weights.reshape(-1).index_select(0, pair).unsqueeze(-1)
        return x.new_zeros(n + 1, d).index_add_(0, token, y.to(x.dtype))[:n]

    def _grouped(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Pairs sorted by expert, one matmul per routed expert; the counts are the layer's one host read."""
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up.shape[0]).tolist()
        tok = order // k
        xs = x[tok]
        ys, start = [], 0
        for e, c in enumerate(counts):
            if c:
                gate, up = F.linear(xs[start:start + c], self.gate_up[e]).chunk(2, dim=-1)
                ys.append(F.linear(F.silu(gate) * up, self.down[e]))
                start += c
        y = torch.cat(ys) * topk_weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add_(0, tok, y.to(x.dtype))


class MoEBlock(nn.Module):
    """Router (softmax over all experts, then top-k, optional renormalisation) + routed experts
    (+ a sigmoid-gated shared expert when the family has one)."""

    kernels: ModuleType | None = None

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.top_k, self.norm_topk_prob = layer, cfg.top_k, cfg.norm_topk_prob
        self.num_experts = cfg.num_experts
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts: nn.Module = DenseExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        else:
            self.shared_expert = None
        # shared gate/up, router and shared-expert gate in one projection after fuse_inputs(), and its output's split
        self.in_proj: nn.Linear | None = None
        self._in_split: tuple[int, ...] = ()
        self.observer: RouterObserver | None = None

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [N, E] -> topk_ids [N, k] (long), topk_weights [N, k] (float32).

        Weights stay float32 (the kernel contract); transformers rounds them to the model dtype first for
        the Qwen/OLMoE families, a difference below bf16/fp16 rounding of the expert outputs.
        """
        if self.kernels is not None:
            return self.kernels.route_topk(logits, self.top_k, self.norm_topk_prob)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | MoEOut:
        """The block's output for x [..., D]; with `residual` (x's shape), residual + that output (with the kernels
        and a gated shared expert: as an `MoEOut`, which the next norm adds)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.in_proj is not None:
            shared_gate_up, logits, shared_gate, _ = self.in_proj(x).split(self._in_split, dim=-1)
            ids, weights = self.route(logits)
        elif self.kernels is not None:  # the router's GEMV and its top-k in one launch
            ids, weights = self.kernels.router_topk(x, self.gate.weight, self.top_k, self.norm_topk_prob)
        else:
            ids, weights = self.route(self.gate(x))
        if self.observer is not None:
            self.observer(self.layer, x, ids, weights)
        out = self.experts(x, ids, weights)
        if self.in_proj is not None:
            shared = self.shared_expert.down(shared_gate_up)
            if self.kernels is not None and residual is not None:
                return MoEOut(residual.reshape(x.shape), out, shared_gate, shared, shape)
            out = out + torch.sigmoid(shared_gate) * shared
        elif self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        out = out.reshape(shape)
        return out if residual is None else residual + out

    def fuse_inputs(self) -> None:
        """Serving layout for a block with a shared expert: its gate and up, the router and the shared expert's gate
        all read the same x, so one GEMM replaces three (the router's and the shared gate's [D, 1] GEMV, two launches
        of cuBLAS's, were ~4 % of an H200 batch-1 decode step: decode_profile-…-s6-attn2.txt). The same weight
        bytes but for the alignment rows below; the separate projections and their checkpoint names are dropped.

        The outputs are padded with zero rows to a multiple of 8: 2F + E + 1 is odd, and an output row of an odd
        number of fp16 values is not 16-byte aligned, which keeps cuBLAS off its TMA kernels (the H200 ran this
        GEMM as a GEMV at 20 us for 46 MB, 2.3 TB/s: decode_profile-nvidia-h200-20261130-s9-kernels.txt)."""
        shared = self.shared_expert
        if self.in_proj is not None or shared is None:
            return
        f2 = 2 * shared.gate_proj.out_features
        self.in_proj = fuse_linears(shared.gate_proj, shared.up_proj, self.gate, self.shared_expert_gate, align=8)
        self._in_split = (f2, self.num_experts, 1, self.in_proj.out_features - f2 - self.num_experts - 1)
        del shared.gate_proj, shared.up_proj, self.gate, self.shared_expert_gate


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoEBlock(cfg, layer)

    def forward(self, x: torch.Tensor | MoEOut, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None
                ) -> torch.Tensor | MoEOut:
        """The residual stream after this layer; an `MoEOut` (the previous layer's, and this one's) is added in the
        norm that follows it."""
        if isinstance(x, MoEOut):
            x, h = self.input_layernorm(x)
        else:
            h = self.input_layernorm(x)
        x, h = self.post_attention_layernorm(self.self_attn(h, cos, sin, cache), residual=x)
        return self.mlp(h, residual=x)


@dataclass
class DenseKVCache:
    """Contiguous per-layer K/V for a batch of equal-length rows (the simple dense generate path).

    `length` counts the tokens every layer holds; the model reads it for default positions.
    """

    k: torch.Tensor  # [L, B, Hkv, max_len, hd]
    v: torch.Tensor
    layer_lengths: list[int]

    @classmethod
    def allocate(cls, cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> "DenseKVCache":
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                   [0] * cfg.num_hidden_layers)

    @property
    def length(self) -> int:
        return self.layer_lengths[-1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def kv_store(self, layer: int) -> None:
        """No kernel writes this cache's K/V: `attend` does."""
        return None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        start = self.layer_lengths[layer]
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache full: {end} tokens > max_len {self.max_len}")
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        self.layer_lengths[layer] = end
        return sdpa(q, self.k[layer, :, :, :end], self.v[layer, :, :, :end], None, scale)
