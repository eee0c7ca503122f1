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


# ---------------------------------------------------------------- calibration in a 16-bit dtype (convert --dtype)
def _calib_batches(model_dir, num_seqs: int, seq_len: int) -> torch.Tensor:
    from pagedweight.corpus import DATA_DIR
    from pagedweight.tokenizer import TextTokenizer

    text = (DATA_DIR / "calib.txt").read_text(encoding="utf-8")
    return calibration_batches(TextTokenizer.from_dir(model_dir).encode(text), num_seqs, seq_len)


def test_add_square_widens_a_16_bit_gradient_before_squaring_it():
    """Squares of bfloat16 gradients go into the float32 sums exactly as float32 squares do, chunk by chunk (the
    chunk sizes here leave a ragged last chunk): not rounded to bfloat16's 8 bits, nor float16's range (256^2)."""
    from pagedweight.calibrate import add_square

    g = (torch.randn(3, 7, 5, generator=torch.Generator().manual_seed(0)) * 300).to(torch.float16)
    g[0, 0, 0] = 1000  # its float16 square is inf
    for dtype in (torch.bfloat16, torch.float16):
        gd = g.to(dtype)
        ref = torch.full((3, 7, 5), 0.5) + gd.float() ** 2
        for chunk in (1, 4, 16, 1 << 24):
            acc = torch.full((3, 7, 5), 0.5)
            add_square(acc, gd, chunk)
            assert torch.equal(acc, ref), (dtype, chunk)
        assert not torch.equal(ref, 0.5 + (gd * gd).float())  # what squaring in the 16-bit dtype would give


def test_bfloat16_calibration_agrees_with_float32(model_dir):
    """The bundled model calibrated in bfloat16 (forward and backward in bfloat16, sums in float32) against float32:
    not bit-equal, but per layer and block kind the sensitivities correlate > 0.99 (measured: Pearson >= 0.9997,
    Spearman >= 0.995, fisher and activation), the routing mass is within 1e-2 (measured 1.4e-4) and the statistics
    stay float32.
    bfloat16 keeps 8 bits of each weight and activation: a relative error of ~0.4% per product, far below what
    would reorder the weights a quantizer distinguishes."""
    from pagedweight.models import load_model

    batches = _calib_batches(model_dir, 3, 48)
    m32, m16 = load_model(model_dir, dtype=torch.float32), load_model(model_dir, dtype=torch.bfloat16)
    for kind in ("fisher", "activation"):
        ref, got = calibrate(m32, batches, kind), calibrate(m16, batches, kind)
        assert (ref.dtype, got.dtype) == ("float32", "bfloat16")
        torch.testing.assert_close(got.routing_mass, ref.routing_mass, rtol=0, atol=1e-2)
        for name in ("gate_up", "down"):
            a, b = getattr(ref, name), getattr(got, name)
            assert b.dtype == torch.float32 and b.shape == a.shape and torch.isfinite(b).all()
            assert not torch.equal(a, b)  # it did run in bfloat16
            for layer in range(a.shape[0]):
                pearson = torch.corrcoef(torch.stack([a[layer].flatten(), b[layer].flatten()]).double())[0, 1]
                assert pearson > 0.99, (kind, name, layer, float(pearson))
    assert next(m16.parameters()).dtype == torch.bfloat16 and all(p.requires_grad for p in m16.parameters())


def test_non_finite_statistics_of_a_16_bit_model_name_the_dtype():
    model = _model().to(torch.bfloat16)
    with torch.no_grad():
        model.layers[0].mlp.experts.gate_up[1, 0, 0] = float("inf")
    batches = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match=r"not finite: .* bfloat16 model \(try --dtype float32"):
        calibrate(model, batches, "fisher")
    with pytest.raises(ValueError, match=r"not finite: .* float16 model \(try --dtype bfloat16"):
        calibrate(model.to(torch.float16), batches, "activation")


def test_non_finite_activation_statistics_do_not_suggest_activation():
    """An overflow in an activation calibration suggests what could help, never `--sensitivity activation` (the
    sensitivity that just failed; before, every dtype's message ended in it); a fisher one still does."""
    batches = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(2))
    for dtype, hint in ((torch.float32, r"\(check the checkpoint for inf/NaN weights\)"),
                        (torch.bfloat16, r"\(try --dtype float32\)"),
                        (torch.float16, r"\(try --dtype bfloat16 \(float32's range at half its memory\) or --dtype "
                                        r"float32\)")):
        model = _model().to(dtype)
        with torch.no_grad():
            model.layers[0].mlp.experts.gate_up[1, 0, 0] = float("inf")
        with pytest.raises(ValueError, match=r"activation calibration statistics are not finite: .* " + hint + "$"):
            calibrate(model, batches, "activation")
    with pytest.raises(ValueError, match=r"float32 model \(try --sensitivity activation, or check the checkpoint"):
        calibrate(model.float(), batches, "fisher")


def test_calibration_cache_is_keyed_by_dtype(model_dir, tmp_path, monkeypatch):
    """A float32 calibration is not served to a bfloat16 model, nor the other way round; each is reused by its own
    dtype, and float32's key is the key of before the dtype was an option (cached statistics stay valid)."""
    import pagedweight.calibrate as cal
    from pagedweight.checkpoint import TOKENIZER, weight_files
    from pagedweight.models import load_model
    from pagedweight.tokenizer import TextTokenizer

    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(f"w{i % 97}" for i in range(600)))
    files = [model_dir / "config.json", model_dir / TOKENIZER, *weight_files(model_dir)]
    encode = TextTokenizer.from_dir(model_dir).encode
    ran = []
    real = cal.calibrate
    monkeypatch.setattr(cal, "calibrate", lambda model, *a, **k: ran.append(next(model.parameters()).dtype)
                        or real(model, *a, **k))
    m32, m16 = load_model(model_dir, dtype=torch.float32), load_model(model_dir, dtype=torch.bfloat16)
    out = tmp_path / "out"
    for model in (m32, m16, m32, m16):
        stats = cal.cached_calibrate(model, files, calib, out, "activation", 2, 32, encode)
        assert stats.dtype == {torch.float32: "float32", torch.bfloat16: "bfloat16"}[next(model.parameters()).dtype]
    assert ran == [torch.float32, torch.bfloat16]
    old_key = cal.cache_key(files, calib.read_bytes(), kind="activation", num_seqs=2, seq_len=32)
    names = sorted(p.name for p in out.iterdir())
    assert len(names) == 2 and f"calib-activation-{old_key}.safetensors" in names


def _float32_checkpoint(model_dir, out):
    """The bundled (bfloat16) model as a float32 checkpoint whose weights bfloat16 cannot hold."""
    from pagedweight.checkpoint import TOKENIZER, save_hf
    from pagedweight.models import load_model

    model = load_model(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 1e-3 * torch.randn(p.shape, generator=gen))
    save_hf(model, out, model_dir / TOKENIZER)
    return out


def test_convert_in_bfloat16_keeps_the_float32_weights_and_records_the_dtype(model_dir, tmp_path, monkeypatch,
                                                                              messages):
    """A float32 checkpoint converted with dtype bfloat16: the manifest records the calibration dtype, the dense
    weights are the checkpoint's float32 values and the quantizer is given its float32 experts (neither rounded
    through the bfloat16 model), with no warning about tensors left unread; `auto` is float32 here."""
    import pagedweight.convert as convert_module
    from pagedweight.apformat import load_ap
    from pagedweight.corpus import DATA_DIR
    from pagedweight.models import load_model

    src = _float32_checkpoint(model_dir, tmp_path / "f32")
    source = load_model(src, dtype=torch.float32).state_dict()
    quantized = {}

    def quantize_layer(writer, layer, gate_up, down, *args, **kwargs):
        quantized[layer] = (gate_up, down)
        return quantize_layer.real(writer, layer, gate_up, down, *args, **kwargs)

    quantize_layer.real = convert_module.quantize_layer
    monkeypatch.setattr(convert_module, "quantize_layer", quantize_layer)
    for dtype, recorded in (("bfloat16", "bfloat16"), ("auto", "float32")):
        out, quantized = tmp_path / f"ap-{dtype}", {}
        convert_module.convert(src, out, DATA_DIR / "calib.txt", seed_bits=2, parent_bits=3, sensitivity="activation",
                               num_seqs=2, seq_len=32, heads_seqs=1, device="cpu", dtype=dtype)
        ap = load_ap(out)
        assert ap.manifest["calibration"]["dtype"] == recorded and ap.hf_config["dtype"] == "float32"
        dense = ap.dense_state_dict()
        assert "layers.0.self_attn.q_proj.weight" in dense and set(dense) <= set(source)
        assert all(v.dtype == torch.float32 and torch.equal(v, source[k]) for k, v in dense.items())
        assert sorted(quantized) == list(range(ap.config.num_hidden_layers))
        for l, (gate_up, down) in quantized.items():
            assert torch.equal(gate_up.float(), source[f"layers.{l}.mlp.experts.gate_up"])
            assert torch.equal(down.float(), source[f"layers.{l}.mlp.experts.down"])
    assert not [m for m in messages if "unused" in m]
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16, auto, got 'int8'"):
        convert_module.convert(src, tmp_path / "bad", DATA_DIR / "calib.txt", dtype="int8")
    assert not (tmp_path / "bad").exists()


def test_cli_convert_dtype(model_dir, tmp_path, capsys):
    """`pagedweight convert --dtype auto` calibrates the bundled model in its own bfloat16 (fisher: forward and
    backward in bfloat16) end to end, the manifest saying so; a dtype it does not know is refused by name."""
    from pagedweight.apformat import load_ap
    from pagedweight.cli import main
    from pagedweight.corpus import DATA_DIR

    out = tmp_path / "ap"
    assert main(["convert", str(model_dir), str(out), "--calib", str(DATA_DIR / "calib.txt"), "--dtype", "auto",
                 "--num-seqs", "2", "--seq-len", "32", "--heads-seqs", "1", "--seed-bits", "2", "--parent-bits", "3",
                 "--device", "cpu"]) == 0
    calibration = load_ap(out).manifest["calibration"]
    assert calibration["dtype"] == "bfloat16" and calibration["sensitivity"] == "fisher"
    assert len(list(out.glob("calib-fisher-*.safetensors"))) == 1
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["convert", str(model_dir), str(tmp_path / "bad"), "--calib", str(DATA_DIR / "calib.txt"),
              "--dtype", "int8"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("pagedweight convert: error: argument --dtype: invalid choice: 'int8'") and "auto" in err
    assert not (tmp_path / "bad").exists()
