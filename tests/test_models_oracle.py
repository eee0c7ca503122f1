"""Oracle: our plain-PyTorch families compute what transformers 5.17 computes.

For each family a tiny random model is built with transformers' own classes and saved with save_pretrained;
our loader reads the directory; fp32 logits must match (max relative error <= 1e-4) on batches of several
lengths, and 16 greedy tokens must be identical to transformers' generate (which exercises our KV cache).
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from pagedweight.checkpoint import save_hf
from pagedweight.engine import param_bytes
from pagedweight.generate import generate
from pagedweight.models import DenseExperts, iter_expert_blocks, load_model
from pagedweight.models.layers import expert_rows, row_bucket
from pagedweight.sampling import SamplingParams

torch.set_num_threads(1)

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = {
    # Qwen1.5-MoE shape: softmax router, no renormalisation, sigmoid-gated shared expert, q/k/v bias
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
                       num_experts_per_tok=4, norm_topk_prob=False, rope_parameters={"rope_type": "default",
                                                                                    "rope_theta": 1e6})),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
    # per-head q/k norm, renormalised top-k; head_dim != hidden/heads like the published Qwen3-MoE
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True,
                       head_dim=32)),
    # q/k norm over the full projection, clip_qkv on
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM,
              dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2, clip_qkv=0.4)),
}


def hf_model(family: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**{**COMMON, **extra, **overrides})
    model = model_cls(config).eval()
    with torch.no_grad():  # larger-than-init weights so routing, norms and the shared gate matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15 if "gate" in name else 0.08)
    return model


def max_rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    """(family, transformers model, our model loaded from the transformers-saved directory)."""
    family = request.param
    ref = hf_model(family)
    path = tmp_path_factory.mktemp(family)
    ref.save_pretrained(path)
    return family, ref, load_model(path), path


@pytest.mark.parametrize("batch,length", [(1, 1), (2, 7), (3, 33)])
def test_logits_match_transformers(pair, batch, length):
    family, ref, ours, _ = pair
    ids = torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(batch * 100 + length))
    with torch.no_grad():
        expected = ref(ids).logits
    got = ours(ids)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert max_rel_err(got, expected) <= 1e-4, family


def test_greedy_tokens_match_transformers(pair):
    family, ref, ours, _ = pair
    prompt = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(7))
    ref.generation_config.eos_token_id = None  # both sides run the full 16 steps
    with torch.no_grad():
        expected = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16,
                                do_sample=False, pad_token_id=0)[:, 5:]
    got = generate(ours, prompt.tolist(), SamplingParams(max_tokens=16))
    assert expected.shape == (2, 16)
    assert got == expected.tolist(), family


def test_cached_decode_matches_full_forward(pair):
    """Prefill + one-token steps through DenseKVCache give the logits of one full forward pass."""
    from pagedweight.models import DenseKVCache

    _, _, ours, _ = pair
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    full = ours(ids)
    cache = DenseKVCache.allocate(ours.config, 2, 12, torch.float32)
    steps = [ours(ids[:, :8], cache=cache)] + [ours(ids[:, t:t + 1], cache=cache) for t in range(8, 12)]
    assert max_rel_err(torch.cat(steps, dim=1), full) <= 1e-5


def mean_rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().mean() / ref.float().abs().mean()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_close_to_transformers(pair, dtype):
    family, ref, _, path = pair
    ours = load_model(path, dtype=dtype)
    assert ours.embed_tokens.weight.dtype == dtype and ours.layers[0].mlp.experts.gate_up.dtype == dtype
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(11))
    ref_lp = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        expected_lp, expected_fp32 = ref_lp(ids).logits, ref(ids).logits
    got = ours(ids)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    # same dtype as transformers: rounding-order differences only (measured <= 0.014 bf16, <= 0.002 fp16)
    assert max_rel_err(got, expected_lp) <= (0.03 if dtype == torch.bfloat16 else 0.005), family
    # vs fp32, a near-tie in a router may send a token elsewhere in either implementation: ours must drift
    # from fp32 no more than transformers' own low-precision run does (mean error, plus rounding slack)
    assert mean_rel_err(got, expected_fp32) <= 1.5 * mean_rel_err(expected_lp, expected_fp32) + 0.005, family


def test_save_hf_roundtrip_through_transformers(pair, tmp_path):
    """save_hf writes a (sharded) directory transformers loads to the same model."""
    family, ref, ours, _ = pair
    save_hf(ours, tmp_path, max_shard_bytes=40_000)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back) is type(ref)
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    # same weights; only the memory alignment of the loaded tensors may differ (BLAS rounding, ~1e-7)
    with torch.no_grad():
        assert max_rel_err(back(ids).logits, ref(ids).logits) <= 1e-6, family
    assert max_rel_err(load_model(tmp_path)(ids), ours(ids)) <= 1e-6


def test_fused_expert_layout_loads(pair, tmp_path):
    """A checkpoint storing experts fused (experts.gate_up_proj [E,2F,D], as transformers holds them in memory)."""
    family, ref, ours, path = pair
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    fused = load_model(tmp_path)
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(1))
    assert max_rel_err(fused(ids), ours(ids)) <= 1e-6, family  # alignment-only rounding differences


def test_expert_blocks_are_the_checkpoint_weights(pair):
    """iter_expert_blocks yields, in flat-index order, each expert's [gate; up] and down as stored by transformers."""
    _, ref, ours, _ = pair
    blocks = list(iter_expert_blocks(ours))
    cfg = ours.config
    assert len(blocks) == cfg.num_hidden_layers * cfg.num_experts * 2
    hf_experts = ref.model.layers[1].mlp.experts
    (key, w) = blocks[(1 * cfg.num_experts + 3) * 2]
    assert key == (1, 3, "gate_up") and torch.equal(w, hf_experts.gate_up_proj[3])
    (key, w) = blocks[(1 * cfg.num_experts + 3) * 2 + 1]
    assert key == (1, 3, "down") and torch.equal(w, hf_experts.down_proj[3])


def test_router_observer_and_set_experts(pair):
    family, _, ours, _ = pair
    seen = []
    ours.set_router_observer(lambda layer, x, ids, w: seen.append((layer, x.shape, ids.shape, w.dtype)))
    ids = torch.randint(0, VOCAB, (2, 3))
    base = ours(ids)
    ours.set_router_observer(None)
    k, d = ours.config.top_k, ours.config.hidden_size
    assert seen == [(0, (6, d), (6, k), torch.float32), (1, (6, d), (6, k), torch.float32)]
    original = ours.layers[0].mlp.experts

    class Doubled(torch.nn.Module):  # same forward contract: scaled routed output must change the logits
        def forward(self, x, topk_ids, topk_weights):
            return 2 * original(x, topk_ids, topk_weights)

    ours.set_experts(0, Doubled())
    try:
        assert not torch.allclose(ours(ids), base)
    finally:
        ours.set_experts(0, original)
    assert isinstance(ours.layers[0].mlp.experts, DenseExperts)
    assert torch.equal(ours(ids), base), family


def test_transformers_sharded_save_loads(pair, tmp_path):
    family, ref, ours, _ = pair
    ref.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    assert max_rel_err(load_model(tmp_path)(ids), ours(ids)) <= 1e-6, family


SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::_unique2", "aten::unique_consecutive",
            "aten::unique_dim", "aten::masked_select"}


def _experts_reference(experts: DenseExperts, x, ids, w):
    """Token by token, slot by slot: the definition of the routed output."""
    out = torch.zeros_like(x)
    f = experts.down.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = experts.gate_up[e] @ x[t]
            out[t] += w[t, j] * (experts.down[e] @ (torch.nn.functional.silu(h[:f]) * h[f:]))
    return out


@pytest.mark.parametrize("n", [1, 3, 40])
def test_dense_experts_gathered_and_grouped_agree(n):
    """All three formulations (gathered = the accelerator's decode path, padded = its prefill, grouped = the CPU's)
    against the token-by-token definition, on every token count where each would run; the padded groups (run here on
    the CPU: the engine takes them on accelerators only) with skewed routing, so that groups pad unequally."""
    torch.manual_seed(n)
    E, k, D, F = 12, 4, 16, 8
    experts = DenseExperts(E, D, F)
    with torch.no_grad():
        experts.gate_up.normal_(0, 0.3)
        experts.down.normal_(0, 0.3)
        x = torch.randn(n, D)
        w, ids = torch.softmax(torch.randn(n, E) + torch.linspace(3, 0, E), -1).topk(k)
        want = _experts_reference(experts, x, ids, w)
        got = {}
        for limit in (E * n * k, 0):
            experts.gather_max_pairs = limit
            got[limit] = experts(x, ids, w)
        experts.PADDED_GROUP = 5  # groups of 5, 5 and 2 experts
        got["padded"] = experts._padded(x, ids, w)
    for out in got.values():
        assert out.shape == (n, D) and torch.allclose(out, want, rtol=1e-5, atol=1e-6)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 30), st.integers(2, 10), st.integers(1, 4), st.integers(1, 5), st.booleans(), st.booleans(),
       st.sampled_from([None, 0.0, 0.5, 2.0]), st.floats(0, 3), st.randoms(use_true_random=False), st.booleans())
def test_expert_rows_place_every_pair_once_in_its_experts_slot(t, num_experts, k, max_group, pad, routed_only, slack,
                                                               skew, rnd, bucket):
    """The prefill layout: every (token, choice) pair on exactly one row, inside its expert's slot; the other rows
    are padding (token T) inside padded slots only; groups hold at most max_group slots, padded slots `width` rows,
    unpadded ones their pairs' rows closed by `ends`; routed_only lists the routed experts, most pairs first. With a
    slack, a call's padded rows are within (1 + slack) * T * k, under routing skewed towards low ids (a popularity
    term) as well as uniform. Bucketed, a padded group's width is its largest count or that count's `row_bucket`
    (the bound kept either way)."""
    k = min(k, num_experts)
    popularity = [(e + 1.0) ** -skew for e in range(num_experts)]
    ids = np.array([_weighted_sample(rnd, popularity, k) for _ in range(t)])
    slack = slack if routed_only else None  # (the slack needs counts sorted most first)
    plan = expert_rows(ids, num_experts, max_group, pad, routed_only, slack, bucket)
    real = plan.token < t
    assert sorted(plan.pair[real].tolist()) == list(range(t * k))
    assert (plan.token[real] == plan.pair[real] // k).all() and (plan.token[~real] == t).all()
    counts = np.bincount(ids.reshape(-1), minlength=num_experts)
    if routed_only:
        assert sorted(plan.slots.tolist()) == np.flatnonzero(counts).tolist()
        assert (np.diff(counts[plan.slots]) <= 0).all()
    else:
        assert plan.slots.tolist() == list(range(num_experts))
    covered = np.zeros(len(plan.token), dtype=bool)
    for s0, n, r0, r1, width in plan.groups:
        assert all(type(v) is int for v in (s0, n, r0, r1, width))  # they size kernel grids: no numpy integers
        assert 1 <= n <= max_group and r1 > r0
        for j in range(n):
            s = s0 + j
            lo, hi = (r0 + j * width, r0 + (j + 1) * width) if pad else (r0 + (plan.ends[s - 1] if j else 0),
                                                                          r0 + plan.ends[s])
            rows = np.arange(lo, hi)
            assert not covered[rows].any()
            covered[rows] = True
            assert real[rows].sum() == counts[plan.slots[s]]
            assert (ids.reshape(-1)[plan.pair[rows[real[rows]]]] == plan.slots[s]).all()
            assert (np.diff(plan.pair[rows[real[rows]]]) > 0).all()  # a slot's pairs in pair order
            assert pad or real[rows].all()
        assert r1 == (r0 + n * width if pad else r0 + plan.ends[s0 + n - 1])
        if pad:
            largest = int(counts[plan.slots[s0:s0 + n]].max())
            assert width in ((largest, int(row_bucket(np.array([largest]))[0])) if bucket else (largest,))
    assert covered.all()
    if pad and slack is not None:
        assert len(plan.token) <= (1 + slack) * t * k


def test_bucketed_rows_take_few_shapes():
    """Padded widths rounded by `row_bucket` (a quarter octave above 8, at most a quarter more rows) give the
    prefill's batched matmuls few (slots, width) shapes, each of which cuBLAS chooses a kernel for on first sight:
    40 layer calls of 64-1,024 tokens under skewed routing (Qwen1.5's 60 experts, top-4, groups of 7)."""
    rng = np.random.default_rng(0)
    exact, bucketed = set(), set()
    for _ in range(40):
        t = int(rng.integers(64, 1025))
        popularity = rng.dirichlet(np.full(60, 0.5))
        ids = np.stack([rng.choice(60, 4, replace=False, p=popularity) for _ in range(t)])
        for shapes, bucket in ((exact, False), (bucketed, True)):
            plan = expert_rows(ids, 60, 7, True, True, 1.0, bucket)
            shapes.update((n, width) for _, n, _, _, width in plan.groups)
            assert len(plan.token) <= 2.0 * t * 4
    assert len(bucketed) * 3 <= len(exact)
    w = np.arange(1, 5000)
    assert (row_bucket(w) >= w).all() and (row_bucket(w) <= np.maximum(w * 1.25, w)).all()
    assert len(np.unique(row_bucket(np.arange(1, 1025)))) == 8 + 4 * 7


def test_expert_rows_refuses_a_slack_it_cannot_meet():
    ids = np.array([[0, 1], [0, 2]])
    for slack, routed_only in ((-0.5, True), (0.5, False)):
        with pytest.raises(ValueError, match="slack >= 0"):
            expert_rows(ids, 3, 2, True, routed_only, slack)


def _weighted_sample(rnd, weights: list[float], k: int) -> list[int]:
    """k distinct indices drawn one after another with probability proportional to their weights."""
    left, out = list(range(len(weights))), []
    for _ in range(k):
        out.append(left.pop(rnd.choices(range(len(left)), [weights[i] for i in left])[0]))
    return out


def test_gathered_decode_has_no_sync_and_ops_independent_of_experts():
    """The accelerator decode path: no op that reads the device back, and the same op count for 8 or 64 experts."""
    from torch.profiler import ProfilerActivity, profile

    counts = []
    for E in (8, 64):
        experts = DenseExperts(E, 16, 8)
        experts.gather_max_pairs = E
        with torch.no_grad():
            experts.gate_up.normal_(0, 0.3)
            experts.down.normal_(0, 0.3)
            w, ids = torch.softmax(torch.randn(2, E), -1).topk(4)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                experts(torch.randn(2, 16), ids, w)
        names = [e.name for e in prof.events()]
        assert not SYNC_OPS & set(names), names
        counts.append(len(names))
    assert counts[0] == counts[1]


def test_fused_projections_match_transformers(pair):
    """The serving layout (q/k/v fused; with a shared expert, its gate and up with the router and its gate,
    `fuse_projections`) computes what transformers does, with the same parameter bytes but for the zero rows that
    align the fused input projection's outputs to 8; fusing twice changes nothing. Families without a shared expert
    keep their router."""
    family, hf, ours, _ = pair
    fused = copy.deepcopy(ours)
    fused.fuse_projections()
    fused.fuse_projections()
    names = {n for n, _ in fused.named_parameters()}
    assert not any(k in n for n in names for k in (".q_proj.", ".k_proj.", ".v_proj.", "shared_expert.gate_proj",
                                                   "shared_expert.up_proj", "shared_expert_gate"))
    assert any("qkv_proj" in n for n in names)
    shared = ours.config.shared_expert_intermediate_size
    assert any(".mlp.in_proj." in n for n in names) == bool(shared)
    assert any(".mlp.gate." in n for n in names) == (not shared)
    pad = [layer.mlp.in_proj.weight[sum(layer.mlp._in_split[:3]):] for layer in fused.layers if shared]
    assert all(p.shape[0] == (-sum(layer.mlp._in_split[:3])) % 8 and not p.any()
               for p, layer in zip(pad, fused.layers))
    assert param_bytes(fused) == param_bytes(ours) + sum(p.numel() * p.element_size() for p in pad)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(ids).logits
        assert max_rel_err(fused(ids), ref) <= 1e-4, family


def test_packed_weights_are_views_of_one_allocation(pair):
    """`pack_weights` puts every parameter in one 256-byte-aligned allocation, each a view of it, a tied head still
    the embedding's tensor (moved once), and the model computes the same logits bit for bit (the engine packs on
    CUDA; the copy is the same on any device)."""
    family, _, ours, _ = pair
    packed = copy.deepcopy(ours)
    packed.fuse_projections()
    packed.lm_head.weight = packed.embed_tokens.weight  # tied, as some checkpoints are
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        before = packed(ids)
    names = [n for n, _ in packed.named_parameters()]
    expected = packed.packed_bytes()
    total = packed.pack_weights()
    assert total == expected
    params = list(packed.parameters())
    base = params[0].untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == base for p in params), family
    assert total == params[0].untyped_storage().nbytes() == sum(-(-p.numel() * p.element_size() // 256) * 256
                                                                for p in params)
    assert all((p.data_ptr() - base) % 256 == 0 for p in params)
    spans = sorted((p.data_ptr() - base, p.numel() * p.element_size()) for p in params)
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))  # no two weights overlap
    assert [n for n, _ in packed.named_parameters()] == names
    assert packed.lm_head.weight is packed.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(packed(ids), before)


@pytest.mark.parametrize("b, h, hkv, t, s, masked", [
    (3, 8, 2, 1, 37, True),  # grouped decode rows under a length mask: folded queries
    (2, 4, 4, 1, 20, True),  # equal heads, masked
    (1, 8, 2, 9, 40, False),  # a chunk after its context: causal mask, folded per group member
    (1, 4, 4, 9, 40, False),
    (1, 8, 2, 12, 12, False),  # a first chunk: SDPA's own causal
    (2, 8, 1, 1, 15, False),  # one query over every key, one KV head
])
@pytest.mark.parametrize("slices", [False, True])
def test_sdpa_matches_an_explicit_masked_softmax(b, h, hkv, t, s, masked, slices, monkeypatch):
    """`sdpa` against softmax(q k^T * scale + mask) v in float64 with K/V repeated per query head: queries are the
    last t of s positions, causally, or (masked) one query per row over its first lengths[row] keys. `slices`: a
    folded chunk's mask within so few bytes that every query is a slice of its own."""
    from pagedweight.models import layers

    if slices:
        monkeypatch.setattr(layers, "FOLDED_MASK_BYTES", 1)
    g = torch.Generator().manual_seed(b * 100 + h * 10 + t)
    q, k, v = (torch.randn(b, n, m, 16, generator=g) for n, m in ((h, t), (hkv, s), (hkv, s)))
    lengths = torch.randint(1, s + 1, (b,), generator=g)
    keys = torch.arange(s)
    allowed = (keys[None, None, :] < lengths[:, None, None]) if masked else \
        (keys[None, :] <= torch.arange(s - t, s)[:, None])[None].expand(b, t, s)  # [b, t, s]
    mask = allowed[:, None, :1, :] if masked else None  # [b, 1, 1, s], t == 1
    got = layers.sdpa(q, k, v, mask, 0.25)
    kr, vr = (x.double().repeat_interleave(h // hkv, dim=1) for x in (k, v))
    scores = (q.double() @ kr.transpose(-1, -2) * 0.25).masked_fill(~allowed[:, None], float("-inf"))
    want = scores.softmax(-1) @ vr
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
