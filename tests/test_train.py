"""The training script: sorted expert execution equals DenseExperts, and the whole pipeline runs end to end."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math

import pytest
import torch

from pagedweight import train
from pagedweight.models import DenseExperts, load_model


def test_sorted_experts_match_dense_forward_and_grads():
    torch.manual_seed(0)
    E, D, F, N, k = 6, 32, 16, 40, 2
    dense = DenseExperts(E, D, F)
    torch.nn.init.normal_(dense.gate_up, std=0.2)
    torch.nn.init.normal_(dense.down, std=0.2)
    ids = torch.randint(0, E - 1, (N, k))  # expert E-1 never routed: empty segment
    ids[:, 1] = (ids[:, 0] + 1) % (E - 1)
    x = torch.randn(N, D, requires_grad=True)
    w = torch.rand(N, k, requires_grad=True)
    ref = dense(x, ids, w)
    g_ref = torch.autograd.grad((ref ** 2).sum(), (x, w, dense.gate_up, dense.down))
    out = train.SortedExperts(dense)(x, ids, w)
    g_out = torch.autograd.grad((out ** 2).sum(), (x, w, dense.gate_up, dense.down))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_out, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_routing_summary_by_hand():
    mass = torch.tensor([[6.0, 2.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    rows = train.routing_summary(mass)
    assert rows[0]["max_mass"] == pytest.approx(0.6) and rows[0]["max_over_min"] == pytest.approx(6.0)
    assert rows[0]["top_quarter_mass_frac"] == pytest.approx(0.6)
    p = [0.6, 0.2, 0.1, 0.1]
    assert rows[0]["entropy_nats"] == pytest.approx(-sum(q * math.log(q) for q in p))
    assert rows[1]["entropy_frac_of_uniform"] == pytest.approx(1.0)
    assert rows[0]["experts_below_quarter_uniform"] == 0 and rows[1]["max_over_min"] == pytest.approx(1.0)


def test_lr_schedule():
    cfg = train.CONFIGS["tiny"]
    assert train.lr_at(0, cfg, 1000) == pytest.approx(cfg.lr / cfg.warmup_steps)
    assert train.lr_at(cfg.warmup_steps, cfg, 1000) == pytest.approx(cfg.lr)
    assert train.lr_at(1000, cfg, 1000) == pytest.approx(cfg.lr * cfg.min_lr_frac)


def test_micro_pipeline_end_to_end(tmp_path):
    parser = argparse.ArgumentParser()
    train.add_parser(parser.add_subparsers(dest="command"))
    out, res = tmp_path / "model", tmp_path / "results"
    argv = ["train", "--config", "micro", "--work-dir", str(tmp_path / "work"), "--out", str(out),
            "--results-dir", str(res), "--device", "cpu", "--max-eval-bytes", "6000"]
    args = parser.parse_args(argv)
    assert args.func(args) == 0
    (result,) = res.glob("train-micro-*.json")
    record = json.loads(result.read_text())
    kinds = [r["kind"] for r in record["rows"]]
    assert kinds.count("train") == 1 and kinds.count("routing") == 2 and kinds.count("sample") == 3
    fig = record["rows"][0]
    assert fig["steps"] == train.CONFIGS["micro"].max_steps
    assert fig["final_loss"] < math.log(fig["vocab_size"])  # learnt something beyond uniform
    # the saved bf16 checkpoint is exactly what the run evaluated
    model = load_model(out)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    from pagedweight import corpus

    again = train.evaluate_text(model, tok, corpus.load_slice("eval")[:6000], model.config.max_position_embeddings,
                                "cpu")
    (reported,) = [r for r in record["rows"] if r["kind"] == "eval" and r["slice"] == "eval"]
    assert again["ppl"] == pytest.approx(reported["ppl"], rel=1e-4)
    assert isinstance(model.layers[0].mlp.experts, DenseExperts)
    # resuming a finished run trains no further step
    args = parser.parse_args(argv + ["--resume"])
    assert args.func(args) == 0
    assert json.loads(result.read_text())["rows"][0]["steps"] == fig["steps"]


def test_resume_before_the_step_budget_is_fixed(tmp_path, monkeypatch):
    """A checkpoint written while the speed probe ran (no step budget yet) resumes: the probe starts again from the
    resumed step (t_probe was None there and the budget's computation raised); configurations sharing a work
    directory keep their own tokenizers."""
    cfg = dataclasses.replace(train.CONFIGS["micro"], corpus_bytes=300_000, tokenizer_bytes=200_000, max_steps=12)
    lr_at = train.lr_at

    def killed_at_step_5(step, c, total):
        if step == 5:
            raise KeyboardInterrupt
        return lr_at(step, c, total)

    monkeypatch.setattr(train, "lr_at", killed_at_step_5)
    with pytest.raises(KeyboardInterrupt):
        train.train(cfg, tmp_path, "cpu", resume=False, ckpt_every=5)
    state = torch.load(tmp_path / "ckpt-micro.pt", weights_only=False)
    assert state["step"] == 5 and state["total_steps"] is None
    monkeypatch.setattr(train, "lr_at", lr_at)
    res = train.train(cfg, tmp_path, "cpu", resume=True, ckpt_every=5)
    assert res["figures"]["steps"] == 12
    other = dataclasses.replace(cfg, vocab_size=600)
    assert train.data_cache_paths(other, tmp_path)[0] != train.data_cache_paths(cfg, tmp_path)[0]
    assert train.prepare_data(other, tmp_path)[0].get_vocab_size() == 600
