"""Prompt residual heads (issue 7): per-sequence damage, training targets, persistence in the AP manifest, and
the engine's planner running on the heads it loaded. References are written with plain loops and module hooks."""
from __future__ import annotations

import hashlib
import math
import shutil
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedweight.apformat import MANIFEST, APFormatError, load_ap, read_manifest
from pagedweight.calibrate import DamageProbe, calibration_batches
from pagedweight.engine import LLM
from pagedweight.models import ModelConfig, build_model
from pagedweight.planner import damage_rows, eta_rows
from pagedweight.signals import block_bucket_signals, damage_samples
from pagedweight.tokenizer import TextTokenizer

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "models" / "pw-tiny-moe"


def test_damage_samples_targets_against_loops():
    rng = np.random.default_rng(0)
    S, n, P, s = 5, 4, 5, 2
    phi = rng.lognormal(0, 1, (S, n, 4))
    phi[1, 2] = 0.0  # block 2 got no token in sequence 1
    damage = rng.lognormal(0, 1, (S, n, P + 1))
    damage[3, 0, 3] = 0.0  # a drop that changes nothing in that sequence
    blocks, b_from, b_to, rows, y = damage_samples(phi, damage, s)
    want = []
    for b in range(s, P):
        for i in range(n):
            ok = [q for q in range(S) if phi[q, i, 3] > 0 and damage[q, i, b] > 0]
            geo = math.exp(sum(math.log(damage[q, i, b]) for q in ok) / len(ok))  # the block's geometric mean
            want += [(i, b + 1, b, q, math.log(damage[q, i, b] / geo)) for q in ok]
    got = sorted(zip(blocks, b_from, b_to, [tuple(r) for r in rows], y))
    want = sorted((i, a, b, tuple(phi[q, i]), t) for i, a, b, q, t in want)
    assert len(got) == len(want) == (P - s) * S * n - 4  # (seq 1, block 2) x 3 drops and one zero drop
    for g, w in zip(got, want):
        assert g[:4] == w[:4] and g[4] == pytest.approx(w[4], rel=1e-12, abs=1e-12)


def test_heads_leave_a_typical_prompt_at_eta_one():
    """Blocks whose damage varies from prompt to prompt (log-damage spread 1, more for down blocks): the fitted
    bias is ~0 for both kinds, so a typical prompt and a block with no evidence keep the global estimate (an
    arithmetic-mean target put it at about -0.5 and -0.7: eta 0.6 / 0.5, a lean toward dropping down blocks)."""
    from pagedweight.signals import fit_residual_heads

    rng = np.random.default_rng(1)
    S, n, P, s = 64, 8, 4, 2
    phi = rng.lognormal(0, 1, (S, n, 4))
    spread = np.where(np.arange(n) % 2 == 1, 1.2, 1.0)[None, :, None]  # down blocks (odd) vary more
    damage = rng.lognormal(0, 1, (S, n, P + 1)) * spread * rng.lognormal(0, 1, (1, n, P + 1))
    damage = np.exp(np.log(damage) * spread)
    heads = fit_residual_heads(phi, damage, s)
    assert np.abs(heads.bias[:, s + 1:P + 1, s:P]).max() < 0.05, heads.bias


def test_damage_probe_against_hook_reference():
    cfg = ModelConfig(family="qwen2_moe", vocab_size=50, hidden_size=32, moe_intermediate_size=24,
                      num_hidden_layers=2, num_experts=4, top_k=2, norm_topk_prob=False, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, rope_theta=1e4, rms_norm_eps=1e-6,
                      max_position_embeddings=128, shared_expert_intermediate_size=16)
    model = build_model(cfg, seed=1, std=0.2)
    seqs = torch.randint(0, 50, (3, 12), generator=torch.Generator().manual_seed(0))
    seed, parent = 2, 4
    probe = DamageProbe(model, seed, parent).capture(seqs)
    gen = torch.Generator().manual_seed(1)
    widths = {}  # (layer, expert, kind) -> {b: W_b}, any weights per width will do
    for l, layer in enumerate(model.layers):
        for kind in ("gate_up", "down"):
            w = getattr(layer.mlp.experts, kind).detach()
            for e in range(4):
                widths[l, e, kind] = {b: w[e] + torch.randn(w[e].shape, generator=gen) * 0.1 / b
                                      for b in range(seed, parent + 1)}
                probe.measure(l, e, kind, lambda b, ws=widths[l, e, kind]: ws[b])
    seen = []
    hooks = [layer.mlp.experts.register_forward_pre_hook(lambda mod, args, l=l: seen.append((l, *args)))
             for l, layer in enumerate(model.layers)]
    try:
        for q in range(len(seqs)):
            seen.clear()
            with torch.no_grad():
                model(seqs[q:q + 1])
            for l, x, ids, w in seen:
                x = x.detach()
                ex = model.layers[l].mlp.experts
                for e in range(4):
                    for u, kind in enumerate(("gate_up", "down")):
                        for b in range(seed, parent):
                            delta = widths[l, e, kind][b + 1] - widths[l, e, kind][b]
                            want = 0.0
                            for t in range(x.shape[0]):
                                for j in range(2):
                                    if ids[t, j] != e:
                                        continue
                                    inp = x[t]
                                    if kind == "down":
                                        g, up = (ex.gate_up[e].detach() @ x[t]).chunk(2)
                                        inp = F.silu(g) * up
                                    want += float(w[t, j]) * float(((delta @ inp) ** 2).sum())
                            i = (l * 4 + e) * 2 + u
                            assert probe.damage[q, i, b] == pytest.approx(want, rel=1e-4, abs=1e-9)
                            # features: the expert's routing share of the layer, zero when it got no token
                            share = float(w[ids == e].sum() / w.sum())
                            assert probe.features[q, i, 3] == pytest.approx(share, rel=1e-5, abs=1e-12)
    finally:
        for h in hooks:
            h.remove()
    assert (probe.damage[:, :, :seed] == 0).all() and (probe.damage[:, :, parent] == 0).all()


@pytest.fixture(scope="module")
def ap_dir(tmp_path_factory):
    """The bundled model converted with residual heads on 8 calibration sequences of 64 tokens."""
    from pagedweight.convert import convert

    out = tmp_path_factory.mktemp("ap") / "pw-tiny-moe"
    convert(BUNDLED, out, ROOT / "data" / "calib.txt", sensitivity="activation", num_seqs=8, seq_len=64,
            device="cpu", heads_seqs=8)
    return out


def rewrite_manifest(ap_dir: Path, version: int, **changes) -> None:
    """Rewrite manifest.msgpack with a changed body and version (the checksum kept valid)."""
    path = ap_dir / MANIFEST
    body = read_manifest(path)
    body.update(changes)
    for k in [k for k, v in changes.items() if v is ...]:
        del body[k]
    packed = msgpack.packb(body, use_bin_type=True)
    head = msgpack.unpackb(path.read_bytes(), raw=False)
    head.update(version=version, body=packed, blake2b=hashlib.blake2b(packed, digest_size=32).hexdigest())
    path.write_bytes(msgpack.packb(head, use_bin_type=True))


def test_convert_trains_and_persists_heads(ap_dir):
    """The manifest's heads equal heads fitted afresh on the same sequences from the checkpoint's own planes."""
    ap = load_ap(ap_dir)
    heads = ap.residual_heads
    n = len(ap.blocks)
    assert heads is not None and heads.feat_mean.shape == (n, 4) and heads.parent_bits == ap.parent_bits
    assert ap.manifest["calibration"]["residual_heads"] == {"seqs": 8, "seq_len": 64}
    from pagedweight.models import load_model

    model = load_model(BUNDLED)
    tok = TextTokenizer.from_dir(BUNDLED)
    seqs = calibration_batches(tok.encode((ROOT / "data" / "calib.txt").read_text(encoding="utf-8")), 8, 64)
    probe = DamageProbe(model, ap.seed_bits, ap.parent_bits).capture(seqs)
    for i, blk in enumerate(ap.blocks):
        probe.measure(blk.layer, blk.expert, blk.kind, lambda b, i=i: ap.dequantized(i, b))
    ref = probe.fit()
    for k, v in ref.to_dict().items():
        np.testing.assert_allclose(getattr(heads, k), v, rtol=1e-9, atol=1e-12, err_msg=k)
    assert load_ap(ap_dir, verify=False).residual_heads.to_dict().keys() == heads.to_dict().keys()
    # the heads learned something here (the test below relies on it): some drops have real confidence
    assert heads.confidence.max() > 0.3


def test_manifest_versions(ap_dir, tmp_path):
    old = tmp_path / "v1"
    shutil.copytree(ap_dir, old)
    rewrite_manifest(old, 1, residual_heads=...)  # a session-1 checkpoint: version 1, no heads
    assert load_ap(old).residual_heads is None
    future = tmp_path / "v3"
    shutil.copytree(ap_dir, future)
    rewrite_manifest(future, 3)
    with pytest.raises(APFormatError, match=r"manifest\.msgpack: manifest version 3 is not supported.*1, 2"):
        load_ap(future)
    bad = tmp_path / "bad"
    shutil.copytree(ap_dir, bad)
    heads = read_manifest(ap_dir / MANIFEST)["residual_heads"]
    rewrite_manifest(bad, 2, residual_heads={k: v for k, v in heads.items() if k != "bias"})
    with pytest.raises(APFormatError, match="residual heads"):
        load_ap(bad).residual_heads


def test_engine_planner_runs_on_the_loaded_heads(ap_dir, tmp_path):
    heads = load_ap(ap_dir).residual_heads
    llm = LLM(ap_dir, block_size=4, page_store_dir=str(tmp_path / "store"))
    planner = llm.planner
    assert planner.heads is not None
    for k, v in heads.to_dict().items():
        assert np.array_equal(getattr(planner.heads, k), v)
    # the planner's damage estimate is the heads' estimate on the observed features, not the global one
    llm.generate(["def fibonacci(n):"], None, use_tqdm=False)  # one observed step gives features
    assert planner.features is not None and planner.features.shape == (len(heads.feat_mean), 4)
    mu, _ = block_bucket_signals(planner.routing.mass, planner.knobs)
    k = planner.knobs
    with_heads = damage_rows(planner.tables, mu, k.eps, eta_rows(planner.tables, heads, planner.features, k.alpha,
                                                                  k.rho_clip))
    dhat, _ = planner.signals()
    np.testing.assert_array_equal(dhat, with_heads)
    assert not np.allclose(dhat, damage_rows(planner.tables, mu, k.eps))
    old = tmp_path / "v1"
    shutil.copytree(ap_dir, old)
    rewrite_manifest(old, 1, residual_heads=...)
    assert LLM(old, block_size=4, page_store_dir=str(tmp_path / "store1")).planner.heads is None
