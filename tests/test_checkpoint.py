"""Checkpoint directory errors are one CheckpointError naming the file (and tensor); save/load round trips."""
from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedweight.checkpoint import CheckpointError, read_config, save_hf
from pagedweight.models import ModelConfig, build_model, load_model
from pagedweight.tokenizer import TextTokenizer
from helpers import Terminal

torch.set_num_threads(1)


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(family="qwen2_moe", vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2,
                  num_experts=4, top_k=2, norm_topk_prob=False, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=128,
                  shared_expert_intermediate_size=24, qkv_bias=True, bos_token_id=1, eos_token_ids=(2,))
    return ModelConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def model():
    return build_model(tiny_config(), seed=0)


@pytest.fixture
def sharded(model, tmp_path) -> Path:
    save_hf(model, tmp_path, max_shard_bytes=8_000)
    return tmp_path


def index_of(path: Path) -> dict:
    return json.loads((path / "model.safetensors.index.json").read_text())


def test_sharded_roundtrip_is_exact(model, sharded):
    assert len(set(index_of(sharded)["weight_map"].values())) > 2
    loaded = load_model(sharded)
    assert loaded.config.family == "qwen2_moe" and loaded.config.eos_token_ids == (2,)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_weight_files_are_the_index_and_its_shards(model, sharded, tmp_path):
    from pagedweight.checkpoint import weight_files

    (sharded / "consolidated.safetensors").write_bytes(b"junk")  # Mistral's own format beside the HF one
    shards = sorted(set(index_of(sharded)["weight_map"].values()))
    assert weight_files(sharded) == [sharded / "model.safetensors.index.json", *(sharded / s for s in shards)]
    save_hf(model, tmp_path / "single")
    assert weight_files(tmp_path / "single") == [tmp_path / "single" / "model.safetensors"]


def test_save_over_a_sharded_dir_removes_old_shards(model, sharded):
    save_hf(model, sharded)
    assert sorted(p.name for p in sharded.glob("model*")) == ["model.safetensors"]
    assert torch.equal(load_model(sharded).lm_head.weight, model.lm_head.weight)


def test_tied_embeddings_roundtrip(tmp_path):
    model = build_model(tiny_config(family="mixtral", norm_topk_prob=True, shared_expert_intermediate_size=0,
                                    qkv_bias=False, tie_word_embeddings=True), seed=1)
    save_hf(model, tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    loaded = load_model(tmp_path, dtype="bf16")
    assert loaded.lm_head.weight is loaded.embed_tokens.weight
    assert torch.equal(loaded.embed_tokens.weight, model.embed_tokens.weight.bfloat16())


def test_unknown_model_type(sharded):
    cfg = json.loads((sharded / "config.json").read_text())
    (sharded / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(CheckpointError, match=r"config\.json: unknown model_type 'llama'"):
        load_model(sharded)


def test_missing_config_and_missing_dir(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        load_model(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=r"config\.json: file not found"):
        load_model(tmp_path)


def test_config_missing_key_and_unsupported(sharded):
    cfg = json.loads((sharded / "config.json").read_text())
    (sharded / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "num_experts"}))
    with pytest.raises(CheckpointError, match=r"config\.json: config\.json has no 'num_experts'"):
        read_config(sharded)
    (sharded / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": True}))
    with pytest.raises(CheckpointError, match="use_sliding_window"):
        read_config(sharded)
    (sharded / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_type": "yarn"}}))
    with pytest.raises(CheckpointError, match="rope_type 'yarn'"):
        read_config(sharded)
    # transformers 5 runs rope_scaling over its own rope_parameters: a YaRN one beside default parameters is refused
    (sharded / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_type": "default",
                                                                                 "rope_theta": 5e5},
                                                     "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    with pytest.raises(CheckpointError, match="rope_scaling rope_type 'yarn'"):
        read_config(sharded)
    (sharded / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_type": "default",
                                                                                 "rope_theta": 5e5}}))
    assert read_config(sharded).rope_theta == 5e5
    (sharded / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(CheckpointError, match="quant_method 'fp8'.*bf16/fp16 original"):
        read_config(sharded)
    (sharded / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_config(sharded)


def test_missing_shard(sharded):
    shard = sorted(set(index_of(sharded)["weight_map"].values()))[1]
    (sharded / shard).unlink()
    with pytest.raises(CheckpointError, match=rf"{shard}: shard file not found"):
        load_model(sharded)


def test_truncated_shard(sharded):
    weight_map = index_of(sharded)["weight_map"]
    shard = sorted(set(weight_map.values()))[-1]
    data = (sharded / shard).read_bytes()
    (sharded / shard).write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=rf"{shard}"):
        load_model(sharded)


def test_truncated_header(sharded):
    shard = sorted(set(index_of(sharded)["weight_map"].values()))[0]
    (sharded / shard).write_bytes((sharded / shard).read_bytes()[:20])
    with pytest.raises(CheckpointError, match=rf"{shard}: not a readable safetensors file"):
        load_model(sharded)


def _rewrite_shard_of(path: Path, tensor: str, edit) -> str:
    shard = index_of(path)["weight_map"][tensor]
    tensors = load_file(path / shard)
    edit(tensors)
    save_file(tensors, str(path / shard), metadata={"format": "pt"})
    return shard


def test_shape_mismatch_names_file_and_tensor(sharded):
    name = "model.layers.1.self_attn.k_proj.weight"
    shard = _rewrite_shard_of(sharded, name, lambda t: t.__setitem__(name, torch.zeros(8, 32)))
    with pytest.raises(CheckpointError, match=rf"{shard}: tensor '{name}' has shape \[8, 32\], config\.json implies \[16, 32\]"):
        load_model(sharded)


def test_fp8_weights_are_refused_not_cast(sharded):
    """fp8 weights (a quantized checkpoint's, with scales beside them) would lose their scales in a cast."""
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    shard = _rewrite_shard_of(sharded, name, lambda t: t.__setitem__(name, t[name].to(torch.float8_e4m3fn)))
    with pytest.raises(CheckpointError, match=rf"{shard}: tensor '{name}' is float8_e4m3fn: a quantized checkpoint"):
        load_model(sharded)


def test_float64_weights_load_as_floats(model, sharded):
    """A float64 tensor is a float like the others (cast to the load dtype), not 'a quantized checkpoint'."""
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    _rewrite_shard_of(sharded, name, lambda t: t.__setitem__(name, t[name].double()))
    loaded = load_model(sharded)
    assert torch.equal(loaded.layers[0].mlp.experts.down[1], model.layers[0].mlp.experts.down[1])


def test_expert_shape_mismatch(sharded):
    name = "model.layers.0.mlp.experts.2.up_proj.weight"
    _rewrite_shard_of(sharded, name, lambda t: t.__setitem__(name, torch.zeros(15, 32)))
    with pytest.raises(CheckpointError, match=r"model-\d+-of-\d+\.safetensors: tensor 'model\.layers\.0\.mlp\.experts\.2\.up_proj\.weight' has shape \[15, 32\], config\.json implies \[16, 32\]"):
        load_model(sharded)


def test_missing_tensor_in_index_and_in_file(sharded):
    name = "model.layers.1.mlp.shared_expert_gate.weight"
    index = index_of(sharded)
    del index["weight_map"][name]
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"missing tensor '{name}'"):
        load_model(sharded)


def test_index_points_at_shard_without_the_tensor(sharded):
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    shard = _rewrite_shard_of(sharded, name, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=rf"{shard}: lacks tensor '{name}'"):
        load_model(sharded)


def test_missing_expert_tensor_single_file(model, tmp_path):
    save_hf(model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.experts.2.gate_proj.weight"
    del tensors[name]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"missing tensor '{name}'"):
        load_model(tmp_path)


def test_no_weights_at_all(model, tmp_path):
    save_hf(model, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_model(tmp_path)


def test_bad_dtype():
    with pytest.raises(CheckpointError, match="unsupported dtype 'int8'"):
        load_model(".", dtype="int8")


def test_tokenizer_and_generation_config(model, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "hello", "world"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    save_hf(model, tmp_path, tokenizer_json=tok)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4], "bos_token_id": None}))
    wrapped = TextTokenizer.from_dir(tmp_path)
    assert wrapped.eos_token_ids == (2, 4) and wrapped.bos_token_id == 1  # bos falls back to config.json
    assert wrapped.encode("hello world") == [3, 4]
    assert wrapped.decode([3, 4]) == "hello world"
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: file not found"):
        TextTokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_absent_kv_heads_take_the_family_s_transformers_default(family):
    """A config.json without num_key_value_heads means what transformers' config class says (Mixtral 8, Qwen2-MoE
    16, Qwen3-MoE 4, OLMoE the attention heads), not always the attention heads (the k/v weights then refused to
    load)."""
    import transformers

    from pagedweight.models import FAMILIES, ModelConfig

    cfg = ModelConfig(family=family, vocab_size=64, hidden_size=64, moe_intermediate_size=8, num_hidden_layers=1,
                      num_experts=4, top_k=2, norm_topk_prob=family == "mixtral", num_attention_heads=32,
                      num_key_value_heads=2,
                      head_dim=8, rope_theta=1e6, rms_norm_eps=1e-5, max_position_embeddings=64)
    raw = {k: v for k, v in FAMILIES[family].to_hf(cfg).items() if k != "num_key_value_heads"}
    want = transformers.AutoConfig.for_model(family, **{k: v for k, v in raw.items() if k != "model_type"})
    assert FAMILIES[family].from_hf(raw).num_key_value_heads == want.num_key_value_heads
    assert FAMILIES[family].from_hf({**raw, "num_key_value_heads": None}).num_key_value_heads == 32


# ---- progress of large loads (pagedweight.progress.byte_progress) ----

def _read(model_dir: Path) -> dict[str, torch.Tensor]:
    from pagedweight.checkpoint import read_state_dict
    from pagedweight.models import MoEForCausalLM

    cfg = read_config(model_dir)
    with torch.device("meta"):
        expected = {k: v.shape for k, v in MoEForCausalLM(cfg).state_dict().items()}
    return read_state_dict(model_dir, cfg, expected, torch.float32)


def test_a_large_load_s_bar_counts_every_checkpoint_byte_once_per_parameter(model, sharded, bars, monkeypatch):
    """Above the threshold one bar over the bytes read from the safetensors files (their headers say how many), on
    stderr, updated once per parameter (an expert stack at once, not per expert tensor), reaching its total."""
    from pagedweight import checkpoint

    monkeypatch.setattr(checkpoint, "PROGRESS_MIN_BYTES", 0)
    loaded = load_model(sharded)
    shards = sorted(set(index_of(sharded)["weight_map"].values()))
    tensors = {k: v for s in shards for k, v in load_file(sharded / s).items()}
    assert len(bars) == 1
    bar = bars[0]
    assert bar.kw["desc"] == "load weights" and bar.kw["unit"] == "B" and bar.kw["unit_scale"]
    assert bar.kw["file"] is sys.stderr and bar.kw["disable"] is None  # tqdm's own: silent off a terminal
    assert bar.total == sum(t.numel() * t.element_size() for t in tensors.values()) == sum(bar.updates)
    assert len(bar.updates) == len(model.state_dict()) < len(tensors) and bar.closed
    for name, tensor in model.state_dict().items():  # what it loads is unchanged
        assert torch.equal(loaded.state_dict()[name], tensor), name
    bars.clear()
    monkeypatch.setattr(checkpoint, "PROGRESS_MIN_BYTES", sum(t.numel() * t.element_size() for t in tensors.values())
                        + 1)
    load_model(sharded)
    assert bars == []  # just below the threshold: no bar at all


def test_a_large_load_s_progress_shows_on_a_terminal_and_is_logged_off_one(model_dir, messages, capfd, monkeypatch):
    """The bundled model loads without a word (below the threshold, even on a terminal); above it a terminal gets
    the bar, and a log (not a terminal: Ray actors', containers') gets no bar but a start and an end line."""
    from pagedweight import checkpoint

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    _read(model_dir)
    assert terminal.getvalue() == "" and messages == []
    assert capfd.readouterr() == ("", "")

    monkeypatch.setattr(checkpoint, "PROGRESS_MIN_BYTES", 0)
    _read(model_dir)
    assert "load weights" in terminal.getvalue() and "100%" in terminal.getvalue() and messages == []

    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    _read(model_dir)
    # no bar drawn (a bar always holds "%|"; the stream may hold the lines of a loguru sink on stderr, such as the
    # one an earlier test's `pagedweight` main left)
    assert "%|" not in log.getvalue()
    assert len(messages) == 2 and all(m.startswith("load weights: ") for m in messages)
    assert str(model_dir) in messages[0] and " GB" in messages[0] and " s (" in messages[1]
