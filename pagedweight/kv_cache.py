"""Paged KV cache over the shared page pool: block tables per sequence, scatter of new K/V, gather for attention.

A logical KV block holds `block_size` tokens of every layer. Its layer-l part is one pool KV block (one page by
default), so a logical block is L pool blocks that need not be contiguous: the pool never has to find a long
free run for KV, and every page that weights give back is usable by the cache at once. Logical block ids come
from their own counter, never from page ids: the pool may relocate KV pages (compaction for a weight reload), and
the cache then only rewrites its page map; sequences' block tables stay as they are.

The engine packs a step's sequences into one row of tokens; `prepare` builds, once per step, where each new token's
K/V go and which cached tokens each query may see. `attend` (the models' cache protocol) then writes the new K/V
(unless the layer kernels' RoPE wrote them where `kv_store` says) and attends per kind of sequence: each prefill
chunk (several new tokens) over its own gathered context under a causal mask aligned to its end, and the one-token
rows (decodes) together, each over its own blocks under a length mask, as a static decode step does. So prefill
chunks and decodes of different sequences share one forward pass without attending to each other, and no query is
scored against another sequence's keys: a block-diagonal mask over every sequence's context (before session 16) cost
a [T, S_total] host-built mask and T x S_total scores.

Prefix sharing (`prefix_caching`): a block whose `block_size` tokens are all computed is published under a key,
(the logical block before it, its token ids), so equal keys mean equal K/V all the way back to the first token. A
request that starts (or restarts after preemption) looks its prompt's full blocks up in order and takes the ones
found instead of computing them, holding a reference. Shared blocks are full and never written again: a request's
own tokens go to blocks after them. When its last holder lets go, a published block is kept (a later turn of a
chat, the next request with the same system prompt, a preempted request's recompute find it) but counted free:
`num_free_blocks` includes it, an allocation of KV blocks evicts the least recently released first, and a weight
run that finds too few free pages has the pool reclaim them (`PagePool.set_kv_reclaimer`). So a kept block is
never a byte the planner or a reload waits for; weights come first. With `retention_s` > 0 a kept block is retained
for that long after its release: weight runs do not reclaim it, and the planner holds it as it holds the admitted
work's blocks (`num_retained_blocks`): it leaves its bytes out of a reload, and releases weights so that
allocations find other free blocks (one the release cannot make room for in time still evicts it, least recently
released first). A chat's next turn, sent seconds after the last answer, then finds its history where an idle
engine would otherwise have reloaded the weights over it, or a new request's allocation evicted it. A request's
blocks are released last block first, so a block leaves after the blocks that continue it (an evicted block's
continuations could no longer be found). A block computed again under a key another block already has (a prompt of
whole blocks recomputes its last one, whose logits are needed; two requests of one prompt at once) is not published:
the request's next blocks continue the key's block instead, and the request holds that block (a pin) until the step
that wrote the copy is done (`fold_copies`, at the end of the engine's step): then the key's block replaces the copy
in its block table (equal keys, equal K/V) and the copy goes back to the pool. So no continuation outlives the block
it continues, and a copy costs a block for one step (a request scoring its prompt keeps reading its copies, its
scores must not depend on other requests: the key's block takes the copy's pages once no block table names it).
Before, the chain stopped at the copy: a repeated prompt's answer was never published.

A decode step can also run at static shapes (what a CUDA graph captures, runner.DecodeGraphs): one row per
sequence, padded to a bucket of rows, each row's block table padded to a bucket of blocks; `decode_layout`
derives everything from device tensors (no host data, no page id baked in). In both kinds of step, on CUDA, the
paged decode attention kernel (cuda/attention_kernels.py) reads each decode row's keys in place up to its length;
elsewhere (and for bf16) attention reads whole gathered blocks under a length mask. Masked keys are still read
there, so every block is zeroed when allocated: a page that held weight planes may hold NaN bit patterns, and a
masked NaN value still poisons softmax(...) @ V.
"""
from __future__ import annotations

import itertools
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedweight.models.config import ModelConfig
from pagedweight.models.layers import sdpa
from pagedweight.pool import PagePool
from pagedweight.sequence import Sequence


def kv_layer_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one layer's K and V for `block_size` tokens."""
    return 2 * block_size * cfg.num_key_value_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass
class DecodeRows:
    """The one-token sequences of a packed step, attended as a batch (device tensors)."""

    rows: torch.Tensor  # [B] their rows in the packed step
    tables: torch.Tensor  # [B, L, M] pool KV block of each of the row's logical blocks (padded with its last)
    lengths: torch.Tensor  # [B] keys each row sees: the kernel's bound
    mask: torch.Tensor | None  # bool [B, 1, 1, M * block_size], key position < the row's length: SDPA's (no kernel)


@dataclass
class StepLayout:
    """Index tensors of one packed step (device tensors, built once and read by every layer)."""

    write_rows: torch.Tensor  # [L, 2, T] rows of `PagedKVCache.rows` of the K and of the V of each new token
    ctx_rows: torch.Tensor  # [L, 2, S] rows of the K and of the V of each context token of the prefill chunks
    chunks: list[tuple[int, int, int, int]]  # per prefill chunk: its rows [r0, r1) and its context [c0, c1) of S
    decode: DecodeRows | None


@dataclass
class DecodeLayout:
    """One static-shape decode step: B rows of one token, derived on the device from the static inputs."""

    tables: torch.Tensor  # [B, L, M] pool KV block of each of the row's M (padded) logical blocks, per layer
    write_rows: torch.Tensor  # [L, 2, B] rows of `PagedKVCache.rows` of the K and of the V of each row's new token
    src_rows: torch.Tensor  # [B] whose K/V each row writes: a padding row rewrites its source row's exact values
    lengths: torch.Tensor | None  # [B] keys each row sees (its position + 1): the kernel's bound
    mask: torch.Tensor | None  # bool [B, 1, 1, M * block_size], key position <= the row's position: SDPA's bound


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, pool: PagePool, dtype: torch.dtype, block_size: int = 16,
                 decode_kernel: bool = True, prefix_caching: bool = True, retention_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic, max_model_len: int | None = None) -> None:
        """`decode_kernel`: on CUDA, decode rows (static decode steps and the one-token rows of packed steps) attend
        with the paged decode attention kernel (keys read in place, split over the context) where it supports the
        dtype and head size; otherwise they gather each row's blocks and run SDPA under a length mask.
        `prefix_caching`: requests share the computed full blocks of a common prefix; `retention_s`: how long a kept
        block is held after its release (out of weight runs' reach, and kept by the planner), by `clock` (module
        docstring)."""
        if not retention_s >= 0.0:
            raise ValueError(f"retention_s must be >= 0 seconds, got {retention_s!r}")
        self.num_layers = cfg.num_hidden_layers
        self.block_size = block_size
        self.pool = pool
        self.dtype = dtype
        self.layer_bytes = kv_layer_block_bytes(cfg, block_size, dtype)
        if self.layer_bytes > pool.kv_block_bytes:
            raise ValueError(f"a layer's KV block needs {self.layer_bytes} B, the pool's KV block is "
                             f"{pool.kv_block_bytes} B")
        # pool rows [capacity, page_bytes] -> [capacity, 2 (k|v), block_size, Hkv, hd]; row id = pool KV block id
        rows = pool.kv_blocks_view()
        if pool.pages_per_kv != 1:
            raise ValueError("the paged KV cache wants one page per pool KV block")
        self.view = rows[:, :self.layer_bytes].view(dtype).view(
            rows.shape[0], 2, block_size, cfg.num_key_value_heads, cfg.head_dim)
        # the same bytes as rows of one token's K or V ([capacity * page_rows, Hkv, hd]): a packed step writes and
        # reads them by row number, one index_copy_ and one index_select a layer, where indexing `view` by block and
        # slot is torch's advanced indexing with two index tensors (more host work a call; a prefill step's pace is
        # its host's: cuda/KERNEL_NOTES.md, session 54)
        token_bytes = cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize
        if rows.shape[1] % token_bytes:
            raise ValueError(f"the pool's page of {rows.shape[1]} B is not a whole number of a token's K or V "
                             f"({token_bytes} B)")
        self.page_rows = rows.shape[1] // token_bytes  # rows a page holds: K of block slot s is row s, its V bs + s
        self.rows = rows.view(dtype).view(-1, cfg.num_key_value_heads, cfg.head_dim)
        self.block_pages: dict[int, list[int]] = {}  # logical block id -> its L pool blocks (layer order)
        # pool block -> logical block * L + layer, -1 if none: one array write per allocation (a dict entry per page
        # cost ~0.1 us each, prefix_cost-cpu-2c-20261204-s38-after2.json); read only when the pool relocates pages
        self._owner = np.full(rows.shape[0], -1, dtype=np.int64)
        self._tables: dict[str, np.ndarray] = {}  # request id -> its block_tables, extended as blocks are added
        self._next_id = 0  # the next logical block id (never reused)
        self.prefix_caching = prefix_caching
        self._refs: dict[int, int] = {}  # logical block -> sequences holding it (held blocks only)
        # published blocks nobody holds, oldest release first, in two lists: the aged ones (weight runs may reclaim
        # them), then the retained ones (released within retention_s, with their release time); every aged block was
        # released before every retained one, so aged + retained is the eviction order
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._retained: OrderedDict[int, float] = OrderedDict()
        self.retention_s, self._clock = retention_s, clock
        self.evicted_blocks = 0  # kept blocks given back to the pool for KV or weights
        self.reclaimed_blocks = 0  # of those, the ones a weight run reclaimed
        self._shared: dict[tuple[int, tuple[int, ...]], int] = {}  # (block before, its tokens) -> published block
        self._key: dict[int, tuple[int, tuple[int, ...]]] = {}  # published block -> its key
        # request id -> (its leading blocks published or found under their keys, the block the next one's key continues)
        self._published: dict[str, tuple[int, int]] = {}
        self._pins: dict[str, dict[int, int]] = {}  # request id -> {position of a copy: the published block it copies}
        self.layout: StepLayout | DecodeLayout | None = None
        self._kernels = None  # cuda/attention_kernels.py when decode rows use it
        # grouped query heads too: against the gather + SDPA the engine runs (cuDNN's SDPA off, heads folded:
        # models/layers.py) the kernel took 0.05-0.9x the time with 8, 4 or 2 query heads per KV head at 1-16 rows of
        # 512-8,192 keys, but for 32/4 heads at 16 rows of 512 and 2,048 keys (1.15x, 1.27x) (attention_bench-nvidia-
        # h200-20261201-s25-nocudnn.json; before session 24 that benchmark's SDPA was cuDNN's, 2-9x faster there)
        # the longest row a decode step attends (its table padded to whole blocks): what the engine serves
        # (`max_model_len`), not what the model could (a 128K-position model served at 8K kept the gather)
        self.max_keys = (max_model_len or cfg.max_position_embeddings) + block_size
        if decode_kernel and pool.device.type == "cuda":
            from pagedweight.cuda import attention_kernels
            if attention_kernels.supports(dtype, cfg.head_dim, self.max_keys):
                self._kernels = attention_kernels
        pool.add_kv_listener(self._relocated)
        pool.set_kv_reclaimer(lambda: len(self._cached) * self.num_layers, self._reclaim)

    # ---- block accounting (what the scheduler reads) ----
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can have now: the pool's free ones and the kept prefix blocks it would evict."""
        return self.pool.kv_capacity(self.num_cached_blocks * self.num_layers) // self.num_layers

    @property
    def reserve_borrowed_bytes(self) -> int:
        """Pool bytes an offload's new LUT borrowed from the reserve beyond what the kept blocks cover (KV had filled
        the pool): `num_free_blocks` floors at 0 there, and pages freed later refill the reserve before any reaches
        the KV cache, so the planner takes these bytes off what moves hand back."""
        pool = self.pool
        short = pool.reserve_pages - pool.free_pages - self.num_cached_blocks * self.num_layers
        return max(0, short) * pool.page_bytes

    @property
    def num_used_blocks(self) -> int:
        """Blocks some request holds."""
        return len(self.block_pages) - self.num_cached_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Published blocks nobody holds, kept for a later request and counted free."""
        return len(self._cached) + len(self._retained)

    @property
    def num_retained_blocks(self) -> int:
        """Kept blocks released within retention_s (as of the last `age`): weight runs do not reclaim them."""
        return len(self._retained)

    @property
    def num_unretained_free_blocks(self) -> int:
        """Free blocks an allocation takes before any retained one: what the engine may count on while the planner
        holds the retained ones (the module docstring)."""
        return self.num_free_blocks - len(self._retained)

    def age(self) -> None:
        """Hand the kept blocks whose retention ran out to the weight runs' reach (the engine calls it at each
        paging boundary, before it reads the counts)."""
        cutoff = self._clock() - self.retention_s
        while self._retained:
            b, released = next(iter(self._retained.items()))
            if released > cutoff:
                break
            del self._retained[b]
            self._cached[b] = None

    @property
    def block_bytes(self) -> int:
        """Pool bytes of one logical block (all layers), the planner's B_KV."""
        return self.num_layers * self.pool.pages_per_kv * self.pool.page_bytes

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def tokens_fit(self, seq: Sequence) -> int:
        """New tokens seq can append with the blocks it holds plus every free block."""
        return (len(seq.block_table) + self.num_free_blocks) * self.block_size - seq.num_computed_tokens

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        n = self.blocks_needed(seq, num_new_tokens)
        if n == 0:
            return
        short = n * self.num_layers - (self.pool.free_pages - self.pool.reserve_pages)  # the reserve refills first
        if short > 0:
            self.evict(-(-short // self.num_layers))
        pages = self.pool.alloc_kv_blocks(n * self.num_layers)
        self.view.index_fill_(0, torch.tensor(pages, device=self.view.device), 0)  # finite bytes (module doc)
        L, first = self.num_layers, self._next_id
        self._next_id += n
        self._owner[pages] = np.arange(first * L, (first + n) * L)  # pages[j * L + layer]: block first + j
        for j in range(n):
            self.block_pages[first + j] = pages[j * L:(j + 1) * L]
            self._refs[first + j] = 1
        seq.block_table.extend(range(first, first + n))

    def free(self, seq: Sequence) -> None:
        """Let go of every block of seq now (finish, abort, preemption), last first: a block no other sequence
        holds is kept if published (module docstring), else goes back to the pool."""
        self._tables.pop(seq.request_id, None)
        self._published.pop(seq.request_id, None)
        pins = self._pins.pop(seq.request_id, {})
        gone = []
        for j in reversed(range(len(seq.block_table))):
            for b in (seq.block_table[j], pins.get(j)):
                if b is None:
                    continue
                self._refs[b] -= 1
                if self._refs[b]:
                    continue
                del self._refs[b]
                if b in self._key:
                    if self.retention_s > 0.0:
                        self._retained[b] = self._clock()
                    else:
                        self._cached[b] = None
                else:
                    gone.append(b)
        self._drop(gone)
        seq.block_table = []

    def evict(self, n: int) -> None:
        """Give the `n` least recently released kept blocks back to the pool (fewer if fewer are kept): the aged
        ones, then the retained ones."""
        gone = list(itertools.islice(itertools.chain(self._cached, self._retained), max(n, 0)))
        for b in gone:
            if b in self._cached:
                del self._cached[b]
            else:
                del self._retained[b]
            del self._shared[self._key.pop(b)]
        self.evicted_blocks += len(gone)
        self._drop(gone)

    def _reclaim(self, pages: int) -> None:
        """The pool's reclaimer: free at least `pages` pages of aged kept blocks for a weight run."""
        before = self.evicted_blocks
        self.evict(min(-(-pages // self.num_layers), len(self._cached)))
        self.reclaimed_blocks += self.evicted_blocks - before

    def _drop(self, blocks: list[int]) -> None:
        pages = [p for b in blocks for p in self.block_pages.pop(b)]
        if pages:
            self._owner[pages] = -1
            self.pool.free_kv_blocks(pages)

    def _prefix_run(self, seq: Sequence) -> list[int] | None:
        """The published blocks seq's tokens begin with, in order (all but its last token: that one's logits are
        needed); None if it may not look: prefix caching off, K/V already computed, or prompt log-probabilities
        (every position's logits are needed)."""
        if not self.prefix_caching or seq.num_computed_tokens or seq.params.prompt_logprobs is not None:
            return None
        bs, ids, run = self.block_size, seq.token_ids, []
        for j in range((seq.num_tokens - 1) // bs):
            lid = self._shared.get((run[-1] if run else -1, tuple(ids[j * bs:(j + 1) * bs])))
            if lid is None:
                break
            run.append(lid)
        return run

    def shared_blocks(self, seq: Sequence) -> int:
        """Blocks a waiting seq would take from running requests or from the retained kept blocks if it started now:
        the scheduler's demand leaves them out, since the planner keeps both already (a retained block is in
        `num_retained_blocks`: counted in its demand too, the next turn of a chat would have its history released
        for twice, and reloaded once it started). An aged kept block it would take is counted free, so its demand
        keeps it."""
        return sum(1 for lid in self._prefix_run(seq) or () if lid in self._refs or lid in self._retained)

    def share_prefix(self, seq: Sequence) -> int | None:
        """A sequence about to compute from its first token takes the published blocks its tokens begin with
        (`_prefix_run`) and holds a reference to each; returns the tokens found, None if it may not look."""
        run = self._prefix_run(seq)
        if run is None:
            return None
        for lid in run:
            self._hold(lid)
        seq.block_table += run
        found = len(run) * self.block_size
        seq.num_computed_tokens = found
        if not seq.num_preemptions:
            seq.num_cached_tokens = min(found, seq.num_prompt_tokens)
        self._published[seq.request_id] = (len(run), run[-1] if run else -1)
        return found

    def _hold(self, lid: int) -> None:
        """Take a reference to a published block (a kept one is held again)."""
        self._refs[lid] = self._refs.get(lid, 0) + 1
        self._cached.pop(lid, None)
        self._retained.pop(lid, None)

    def publish(self, seqs: list[Sequence]) -> None:
        """After a step computed them: publish the blocks of `seqs` that are now full. A block whose key another
        block already has is a copy: not published, the request pins the key's block and its next blocks' keys
        continue that one (module docstring)."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        for seq in seqs:
            rid = seq.request_id
            done, parent = self._published.get(rid, (0, -1))
            full = min(seq.num_computed_tokens // bs, len(seq.block_table))
            for j in range(done, full):  # every block a key continues is held, so none was evicted
                lid = seq.block_table[j]
                if lid not in self._key:
                    key = (parent, tuple(seq.token_ids[j * bs:(j + 1) * bs]))
                    other = self._shared.get(key)
                    if other is not None:  # a copy: pinned, the next blocks continue it
                        self._hold(other)
                        self._pins.setdefault(rid, {})[j] = lid = other
                    else:
                        self._shared[key], self._key[lid] = lid, key
                parent = lid
            if full > done:
                self._published[rid] = (full, parent)

    def fold_copies(self, running: list[Sequence]) -> None:
        """Between steps (the step that wrote them is done): each copy `publish` found leaves its request's block
        table for the block it copies, which the request already holds (its pin), and goes back to the pool. A
        request scoring its prompt (prompt_logprobs) reads its own K/V, not another request's (its scores must not
        depend on them): once no request reads the original (none names it in its block table; pins do not read),
        the original takes the copy's pages instead (equal keys, equal K/V) and gives its own back; while one
        reads it, the pin waits. Before, a scoring request held every pinned original to its end beside its
        copies: a prompt whose blocks an earlier request had left kept took twice its blocks, and one of 9 blocks
        failed in a cache of 14."""
        if not self._pins:
            return
        gone, L = [], self.num_layers
        pinned = Counter(b for pins in self._pins.values() for b in pins.values())
        for seq in running:
            pins = self._pins.get(seq.request_id)
            if pins is None:
                continue
            scoring, folded = seq.params.prompt_logprobs is not None, len(gone)
            for j, original in list(pins.items()):
                copy = seq.block_table[j]  # never published, so held by this request alone
                if scoring:
                    if self._refs[original] > pinned[original]:
                        continue  # a request's block table names the original (it reads its pages): the pin waits
                    pages = self.block_pages[copy]
                    self.block_pages[copy], self.block_pages[original] = self.block_pages[original], pages
                    self._owner[pages] = np.arange(original * L, (original + 1) * L)  # the copy's pages, its own K/V
                gone.append(copy)  # with the pages nobody reads any more
                del self._refs[copy], pins[j]
                seq.block_table[j] = original
                pinned[original] -= 1  # its pin is a block table's reference now
            if not pins:
                del self._pins[seq.request_id]
            if len(gone) > folded:
                self._tables.pop(seq.request_id, None)  # a new array: decode graphs see a change by identity
        self._drop(gone)

    def _relocated(self, moves: dict[int, int]) -> None:
        """The pool moved pool blocks old -> new (bytes already copied on the compute stream): follow them.

        Only between steps: a step's layout holds page ids, so a move while one is live would misdirect it.
        """
        if self.layout is not None:
            raise RuntimeError("KV pages relocated while a step's layout is live")
        old = np.fromiter(moves.keys(), dtype=np.int64, count=len(moves))
        new = np.fromiter(moves.values(), dtype=np.int64, count=len(moves))
        code = self._owner[old]
        mine = code >= 0
        old, new, code = old[mine], new[mine], code[mine]
        self._owner[old] = -1  # the moves' sources and destinations are disjoint
        self._owner[new] = code
        self._tables.clear()
        L = self.num_layers
        for c, page in zip(code.tolist(), new.tolist()):
            self.block_pages[c // L][c % L] = page

    def block_tables(self, seq: Sequence) -> np.ndarray:
        """[L, blocks] pool KV block of each of seq's logical blocks, per layer (read-only). Kept per request and
        extended with its new blocks: every step reads the tables of every running request, and rebuilding them
        costs ~0.1 ms of host time per 128 blocks. Blocks are only appended, folded (`fold_copies`) or all freed
        (`free`), and those two drop the entry; a relocation changes pool blocks, so it drops every entry."""
        have = self._tables.get(seq.request_id)
        done = 0 if have is None else have.shape[1]
        if done < len(seq.block_table):
            new = np.array([self.block_pages[b] for b in seq.block_table[done:]], dtype=np.int64)
            new = new.reshape(-1, self.num_layers).T
            have = new if have is None else np.concatenate([have, new], axis=1)
            self._tables[seq.request_id] = have
        return have if have is not None else np.empty((self.num_layers, 0), dtype=np.int64)

    # ---- one forward step ----
    def prepare(self, seqs: list[Sequence], num_new_tokens: list[int]) -> None:
        """Lay out one packed step: seqs[i] appends num_new_tokens[i] tokens after its computed ones.

        Index arrays are built in numpy and reach the device as one int64 copy. A sequence of several new tokens (a
        prefill chunk) gets its context's pages and slots; a one-token row gets its block table (padded to the
        step's longest with its last block, which holds finite bytes) and its length (the kernel's bound; without the
        kernel the device builds the length mask from it).
        """
        bs, L = self.block_size, self.num_layers
        w_pages, w_slot, c_pages, c_slot, chunks, d_rows, d_tables, d_lens = ([] for _ in range(8))
        row = ctx = 0
        for seq, n in zip(seqs, num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            table = self.block_tables(seq)  # [L, blocks]
            new_pos = np.arange(start, end)
            w_pages.append(table.T[new_pos // bs])
            w_slot.append(new_pos % bs)
            if n == 1:
                d_rows.append(row)
                d_tables.append(table[:, :-(-end // bs)])
                d_lens.append(end)
            else:
                ctx_pos = np.arange(end)
                c_pages.append(table.T[ctx_pos // bs])
                c_slot.append(ctx_pos % bs)
                chunks.append((row, row + n, ctx, ctx + end))
                ctx += end
            row += n
        t, s = row, ctx
        parts = [self._kv_rows(w_pages, w_slot)]
        if chunks:
            parts.append(self._kv_rows(c_pages, c_slot))
        b = len(d_rows)
        if b:
            m = max(x.shape[1] for x in d_tables)
            tables = np.empty((b, L, m), dtype=np.int64)
            for i, x in enumerate(d_tables):  # slice assignments: np.pad costs ~15 us a row
                tables[i, :, :x.shape[1]], tables[i, :, x.shape[1]:] = x, x[:, -1:]
            parts += [np.array(d_rows), tables.ravel(), np.array(d_lens)]
        dev = torch.from_numpy(np.concatenate(parts)).to(self.view.device)  # every part is int64
        decode = None
        if b:
            off = 2 * L * (t + s)
            rows, tables, lengths = dev[off:].split([b, b * L * m, b])
            decode = DecodeRows(rows, tables.view(b, L, m), lengths,
                                None if self._kernels is not None else self._length_mask(m, lengths))
        self.layout = StepLayout(write_rows=dev[:2 * L * t].view(L, 2, t),
                                 ctx_rows=dev[2 * L * t:2 * L * (t + s)].view(L, 2, s), chunks=chunks, decode=decode)

    def _kv_rows(self, pages: list[np.ndarray], slots: list[np.ndarray]) -> np.ndarray:
        """[L, 2, N] (flat): the `rows` of the K, then of the V, of N tokens, from their pages [N, L] and slots [N]."""
        k = np.concatenate(pages).T * self.page_rows + np.concatenate(slots)
        return np.stack((k, k + self.block_size), axis=1).ravel()

    def decode_layout(self, positions: torch.Tensor, src_rows: torch.Tensor, tables: torch.Tensor) -> DecodeLayout:
        """The layout of a static decode step from device tensors alone (graph-capturable): positions [B] of the
        new tokens, src_rows [B], tables [B, L, M] pool KV blocks (padded with blocks of finite bytes)."""
        b, layers, m = tables.shape
        block = (positions // self.block_size)[:, None, None].expand(b, layers, 1)
        lengths = mask = None  # only the bound the step's attention reads (each is device work in every step)
        if self._kernels is not None:
            lengths = positions + 1
        else:
            mask = self._length_mask(m, positions + 1)
        k_rows = tables.gather(2, block)[..., 0].t() * self.page_rows + positions % self.block_size  # [L, B]
        return DecodeLayout(tables=tables, write_rows=torch.stack((k_rows, k_rows + self.block_size), dim=1),
                            src_rows=src_rows, lengths=lengths, mask=mask)

    def _length_mask(self, blocks: int, lengths: torch.Tensor) -> torch.Tensor:
        """bool [B, 1, 1, blocks * block_size]: key position < the row's length (SDPA's bound over gathered blocks)."""
        keys = torch.arange(blocks * self.block_size, device=lengths.device)
        return (keys[None, :] < lengths[:, None])[:, None, None, :]

    def kv_store(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """Where the step's new K/V of `layer` go, for a kernel that writes them as it makes them (layer_kernels.rope):
        (rows [R, Hkv, hd], dst [2, N]: the rows of token i's K and V, src [N] or None: whose K/V token i writes).
        `attend` with k and v None then writes nothing. None before `prepare`."""
        lay = self.layout
        if lay is None:
            return None
        return self.rows, lay.write_rows[layer], lay.src_rows if isinstance(lay, DecodeLayout) else None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, scale: float
               ) -> torch.Tensor:
        """Write the step's new k, v of `layer` into their pages (None: already written, see `kv_store`), then
        attend: the packed step's q [1, H, T, hd], each prefill chunk over its own context and the one-token rows
        over their own blocks; a static decode step's q [B, H, 1, hd] over each row's blocks."""
        lay = self.layout
        if lay is None:
            raise RuntimeError("PagedKVCache.attend called before prepare()")
        if isinstance(lay, DecodeLayout):
            return self._attend_decode(lay, layer, q, k, v, scale)
        if k is not None:
            new = torch.stack((k[0].transpose(0, 1), v[0].transpose(0, 1))).to(self.dtype)  # [2 (k|v), T, Hkv, hd]
            self.rows.index_copy_(0, lay.write_rows[layer].view(-1), new.view(-1, *new.shape[2:]))
        if lay.decode is None and len(lay.chunks) == 1:  # one prefill chunk alone: its attention is the step's
            return self._attend_chunk(lay, layer, q, *lay.chunks[0][2:], scale)
        out = torch.empty_like(q)
        for r0, r1, c0, c1 in lay.chunks:
            out[:, :, r0:r1] = self._attend_chunk(lay, layer, q[:, :, r0:r1], c0, c1, scale)
        if lay.decode is not None:
            d = lay.decode
            qd = q[0].index_select(1, d.rows).transpose(0, 1)  # [B, H, hd]
            if self._kernels is not None:  # keys read in place: no gathered copy, whose size follows the step
                od = self._kernels.paged_decode_attention(qd, self.view, d.tables[:, layer], d.lengths, scale)
            else:
                od = gathered_decode_attention(qd[:, :, None], self.view, d.tables[:, layer], d.mask, scale)[:, :, 0]
            out[0].index_copy_(1, d.rows, od.transpose(0, 1))
        return out

    def _attend_chunk(self, lay: StepLayout, layer: int, q: torch.Tensor, c0: int, c1: int, scale: float
                      ) -> torch.Tensor:
        """A prefill chunk's queries [1, H, t, hd] over its context, rows [c0, c1) of the step's context: its new
        tokens are the context's last t, so `sdpa` aligns the causal mask to the end (or runs a fused causal kernel
        for a first chunk)."""
        rows = lay.ctx_rows[layer, :, c0:c1].reshape(-1)  # a view where the chunk is the step's whole context
        kv = self.rows.index_select(0, rows).view(2, c1 - c0, *self.rows.shape[1:]).transpose(1, 2)  # [2, Hkv, S, hd]
        return sdpa(q, kv[0:1], kv[1:2], None, scale)

    def _attend_decode(self, lay: DecodeLayout, layer: int, q: torch.Tensor, k: torch.Tensor | None,
                       v: torch.Tensor | None, scale: float) -> torch.Tensor:
        """Write each row's new K/V (unless written: k None); then the kernel reads every row's blocks in place, or
        (CPU, bf16) each row's M blocks are gathered, per K and V, for SDPA under the length mask
        (`gathered_decode_attention`)."""
        pages = lay.tables[:, layer]  # [B, M]
        if k is not None and self._kernels is not None:
            self._kernels.store_kv(k, v, self.rows, lay.write_rows[layer], lay.src_rows)
        elif k is not None:
            new = torch.stack((k[:, :, 0], v[:, :, 0]))[:, lay.src_rows]  # [2 (k|v), B, Hkv, hd]
            self.rows.index_copy_(0, lay.write_rows[layer].view(-1), new.flatten(0, 1).to(self.dtype))
        if self._kernels is not None:
            return self._kernels.paged_decode_attention(q[:, :, 0], self.view, pages, lay.lengths, scale)[:, :, None]
        return gathered_decode_attention(q, self.view, pages, lay.mask, scale)


GATHER_BYTES = 64 << 20  # the most that one gathered copy of decode rows' K and V may take


def gathered_decode_attention(q: torch.Tensor, view: torch.Tensor, pages: torch.Tensor, mask: torch.Tensor,
                              scale: float) -> torch.Tensor:
    """The torch decode path: q [B, H, 1, hd] over each row's M blocks of `view` [blocks, 2, bs, Hkv, hd], gathered
    whole per K and V (one copy each), under the length mask [B, 1, 1, M * bs]. Rows go in slices whose copy stays
    within GATHER_BYTES (a slice of one row at the least): the copy of every row at once grows with the batch times
    its longest table, 512 MiB a layer for 32 rows of 4,096 keys of 8 KV heads of 128 in fp16 (computed)."""
    b, m = pages.shape
    _, _, bs, hkv, hd = view.shape
    rows = max(1, GATHER_BYTES // (2 * m * bs * hkv * hd * view.element_size()))
    if rows < b:
        return torch.cat([gathered_decode_attention(q[i:i + rows], view, pages[i:i + rows], mask[i:i + rows], scale)
                          for i in range(0, b, rows)])
    k_all, v_all = (view[:, j][pages].view(b, m * bs, hkv, hd).transpose(1, 2) for j in (0, 1))
    return sdpa(q, k_all, v_all, mask, scale)
