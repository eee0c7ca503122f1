"""Calibration statistics against references computed through a different path (module hooks, .backward())."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedweight.calibrate import calibrate, calibration_batches
from pagedweight.models import ModelConfig, build_model

torch.set_num_threads(1)


def _model():
    cfg = ModelConfig(family="qwen2_moe", vocab_size=50, hidden_size=32, moe_intermediate_size=24,
                      num_hidden_layers=2, num_experts=4, top_k=2, norm_topk_prob=False, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, rope_theta=1e4, rms_norm_eps=1e-6,
                      max_position_embeddings=128, shared_expert_intermediate_size=16)
    return build_model(cfg, seed=1, std=0.2)


def test_activation_statistics_and_routing_mass():
    model = _model()
    batches = torch.randint(0, 50, (5, 16), generator=torch.Generator().manual_seed(0))
    seen = []
    hooks = [layer.mlp.experts.register_forward_pre_hook(lambda mod, args, l=l: seen.append((l, *args)))
             for l, layer in enumerate(model.layers)]
    stats = calibrate(model, batches, "activation", batch_size=2)
    for h in hooks:
        h.remove()
    gu, dn = torch.zeros(2, 4, 32, dtype=torch.float64), torch.zeros(2, 4, 24, dtype=torch.float64)
    mass = torch.zeros(2, 4, dtype=torch.float64)
    for l, x, ids, w in seen:
        ex = model.layers[l].mlp.experts
        for e in range(4):
            for slot in range(2):
                sel = ids[:, slot] == e
                mass[l, e] += w[sel, slot].double().sum()
                xe = x[sel].double()
                gate_up = xe @ ex.gate_up[e].detach().double().t()
                gu[l, e] += (xe ** 2).sum(0)
                dn[l, e] += ((F.silu(gate_up[:, :24]) * gate_up[:, 24:]) ** 2).sum(0)
    torch.testing.assert_close(stats.gate_up.double(), gu, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats.down.double(), dn, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(stats.routing_mass, mass / mass.sum(1, keepdim=True))
    assert int(stats.routed_tokens.sum()) == 2 * 5 * 16 * 2 and stats.tokens == 80


def test_fisher_is_sum_of_squared_per_sequence_gradients():
    model = _model()
    batches = torch.randint(0, 50, (3, 12), generator=torch.Generator().manual_seed(2))
    stats = calibrate(model, batches, "fisher")
    ref_gu, ref_dn = torch.zeros(2, 4, 48, 32), torch.zeros(2, 4, 32, 24)
    for seq in batches:
        model.zero_grad()
        logits = model(seq[None])
        F.cross_entropy(logits[0, :-1], seq[1:]).backward()
        for l, layer in enumerate(model.layers):
            ref_gu[l] += layer.mlp.experts.gate_up.grad ** 2
            ref_dn[l] += layer.mlp.experts.down.grad ** 2
    torch.testing.assert_close(stats.gate_up, ref_gu, rtol=1e-4, atol=1e-12)
    torch.testing.assert_close(stats.down, ref_dn, rtol=1e-4, atol=1e-12)
    assert stats.gate_up.abs().sum() > 0
    assert all(p.requires_grad for p in model.parameters())  # the pass leaves the model as it found it


def test_non_finite_statistics_are_refused():
    """An overflow in the calibration forward is an error, not NaN sensitivities written into the checkpoint."""
    model = _model()
    with torch.no_grad():
        model.layers[0].mlp.experts.gate_up[1, 0, 0] = float("inf")
    batches = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(2))
    for kind in ("activation", "fisher"):
        with pytest.raises(ValueError, match="not finite"):
            calibrate(model, batches, kind)


def test_calibration_batches_cut_disjoint_sequences_spread_over_the_text():
    b = calibration_batches(list(range(100)), num_seqs=4, seq_len=30)
    assert b.shape == (3, 30) and b[:, 0].tolist() == [0, 33, 66]
    assert (b[:, 1:] - b[:, :-1] == 1).all()  # each sequence is contiguous text
    b = calibration_batches(list(range(1000)), num_seqs=4, seq_len=10)
    assert b[:, 0].tolist() == [0, 250, 500, 750] and b[-1, -1] == 759
