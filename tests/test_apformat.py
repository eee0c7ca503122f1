"""AP checkpoint: convert a tiny random model, read it back, check tables, damage detection and the model path."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from pagedweight.apformat import ALIGN, APFormatError, APWriter, load_ap, load_ap_model
from pagedweight.bitplanes import dequantize, unpack_planes
from pagedweight.calibrate import CalibStats
from pagedweight.checkpoint import save_hf
from pagedweight.convert import convert
from pagedweight.models import ModelConfig, build_model, load_model
from pagedweight.quantize import quantize_blocks
from pagedweight.train import train_tokenizer

torch.set_num_threads(1)
DATA = Path(__file__).resolve().parent.parent / "data"
CHAT = "{% for m in messages %}{{ m['role'] }}> {{ m['content'] }}{{ eos_token }}{% endfor %}"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(source dir, AP dir, calibration text) for a 2-layer, 4-expert model with K=40 down blocks (a word tail)."""
    d = tmp_path_factory.mktemp("ap")
    text = (DATA / "calib.txt").read_text()[:60_000]
    tok = train_tokenizer([text[:30_000]], 300)
    cfg = ModelConfig(family="qwen2_moe", vocab_size=tok.get_vocab_size(), hidden_size=64, moe_intermediate_size=40,
                      num_hidden_layers=2, num_experts=4, top_k=2, norm_topk_prob=False, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, rope_theta=1e6, rms_norm_eps=1e-6,
                      max_position_embeddings=512, shared_expert_intermediate_size=32, qkv_bias=True,
                      eos_token_ids=(0,))
    save_hf(build_model(cfg, seed=0), d / "src", tokenizer_json=tok)
    (d / "src" / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT, "eos_token": "x"}))
    (d / "calib.txt").write_text(text)
    convert(d / "src", d / "ap", d / "calib.txt", sensitivity="activation", num_seqs=6, seq_len=64, device="cpu")
    return d / "src", d / "ap", d / "calib.txt"


def test_round_trip_against_independent_quantization(converted):
    src, ap_dir, _ = converted
    ap = load_ap(ap_dir)
    model = load_model(src)
    stats = CalibStats.load(next(ap_dir.glob("calib-activation-*.safetensors")))
    assert ap.sensitivity.shape == (16, 9) and ap.routing_mass.shape == (2, 4)
    np.testing.assert_allclose(ap.routing_mass.sum(1), 1.0, rtol=1e-12)
    np.testing.assert_array_equal(ap.routing_mass, stats.routing_mass.numpy())
    for i, blk in enumerate(ap.blocks):
        ex = model.layers[blk.layer].mlp.experts
        w = (ex.gate_up if blk.kind == "gate_up" else ex.down)[blk.expert].detach()
        assert (blk.n, blk.k) == tuple(w.shape) and i == (blk.layer * 4 + blk.expert) * 2 + (blk.kind == "down")
        ref = quantize_blocks([w], [stats.block(blk.layer, blk.expert, blk.kind)], 3, 8)[0]
        np.testing.assert_array_equal(ap.planes(i), ref.planes.numpy())
        np.testing.assert_allclose(ap.sensitivity[i], ref.sensitivity.numpy(), rtol=1e-12)
        for b in range(3, 9):
            np.testing.assert_array_equal(ap.lut(i, b), ref.luts[b].numpy())
        err8 = (ap.dequantized(i, 8) - w).abs().max() / w.abs().max()
        assert err8 < 0.02  # 8 bits reproduce the block closely
    assert ap.plane(0, 0).base is not None and not ap.plane(0, 0).flags.owndata  # zero-copy view of the map
    dense = ap.dense_state_dict()
    assert not any(".mlp.experts." in k for k in dense)
    for k, v in dense.items():
        assert torch.equal(v, model.state_dict()[k])


def test_memory_table_matches_real_bytes(converted):
    _, ap_dir, _ = converted
    ap = load_ap(ap_dir)
    runs = []
    for i, blk in enumerate(ap.blocks):
        for b in range(3, 9):
            real = sum(ap.plane(i, p).nbytes for p in range(b)) + ap.lut(i, b).nbytes
            assert ap.raw_bytes[i, b] == real == ap.block_bytes(i, b)
            assert real == b * 4 * -(-blk.k // 32) * blk.n + 2 * 2**b * blk.n
            page = 512
            assert ap.block_bytes(i, b, page) == sum(-(-ap.plane(i, p).nbytes // page) * page for p in range(b)) + \
                -(-ap.lut(i, b).nbytes // page) * page
            runs.append((ap.lut_offset(i, b), ap.lut(i, b).nbytes))
        runs += [(ap.plane_offset(i, p), ap.plane(i, p).nbytes) for p in range(8)]
    runs.sort()
    assert all(off % ALIGN == 0 for off, _ in runs)
    assert all(a + n <= b for (a, n), (b, _) in zip(runs, runs[1:]))  # no two runs overlap
    assert ap.planes_file.stat().st_size % ALIGN == 0 and runs[-1][0] + runs[-1][1] <= ap.planes_file.stat().st_size


@pytest.mark.parametrize("b", [3, 5, 8])
def test_uniform_width_model_equals_dequantize_then_dense(converted, b):
    src, ap_dir, _ = converted
    ap = load_ap(ap_dir)
    ref = load_model(src)
    with torch.no_grad():
        for i, blk in enumerate(ap.blocks):
            planes = np.stack([ap.plane(i, p) for p in range(b)])  # only the b-plane prefix
            target = ref.layers[blk.layer].mlp.experts.gate_up if blk.kind == "gate_up" else \
                ref.layers[blk.layer].mlp.experts.down
            target[blk.expert].copy_(dequantize(planes, ap.lut(i, b), b, blk.k))
    ids = torch.randint(0, ref.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(b))
    got = load_ap_model(ap_dir, b)(ids)
    torch.testing.assert_close(got, ref(ids), rtol=0, atol=1e-5)
    if b == 8:  # the expert weights differ from the source only by 8-bit quantization
        assert (got - load_model(src)(ids)).abs().max() < 0.05 * ref(ids).abs().max()


def test_mixed_widths(converted):
    _, ap_dir, _ = converted
    ap = load_ap(ap_dir)
    widths = np.array([3 + i % 6 for i in range(len(ap.blocks))])
    model = load_ap_model(ap_dir, widths)
    for i, blk in enumerate(ap.blocks):
        ex = model.layers[blk.layer].mlp.experts
        w = (ex.gate_up if blk.kind == "gate_up" else ex.down)[blk.expert]
        idx = unpack_planes(ap.planes(i), blk.k).long() >> (8 - widths[i])
        expect = torch.from_numpy(ap.lut(i, widths[i]).astype(np.float32)).t().gather(1, idx)
        assert torch.equal(w, expect)
    with pytest.raises(ValueError):
        load_ap_model(ap_dir, 2)


@pytest.fixture
def damaged(converted, tmp_path):
    ap_copy = tmp_path / "ap"
    shutil.copytree(converted[1], ap_copy)
    return ap_copy


def _planes(ap_dir: Path) -> Path:
    return load_ap(ap_dir, verify=False).planes_file


def _flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_checksum_mismatch_names_file(damaged):
    _flip_byte(_planes(damaged), 5000)
    with pytest.raises(APFormatError, match=r"planes-[0-9a-f]{16}\.bin.*checksum"):
        load_ap(damaged)
    load_ap(damaged, verify=False)  # sizes still agree: only the checksum can see it


def test_dense_checksum_names_file(damaged):
    path = load_ap(damaged, verify=False).dense_file
    _flip_byte(path, path.stat().st_size - 3)
    with pytest.raises(APFormatError, match=r"dense-[0-9a-f]{16}\.safetensors.*checksum"):
        load_ap(damaged)


def test_truncated_planes_names_file(damaged):
    path = _planes(damaged)
    path.write_bytes(path.read_bytes()[:-4096])
    with pytest.raises(APFormatError, match=r"planes-[0-9a-f]{16}\.bin.*truncated"):
        load_ap(damaged, verify=False)


@pytest.mark.parametrize("cut", [0.5, 0.999])
def test_truncated_manifest_names_file(damaged, cut):
    path = damaged / "manifest.msgpack"
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * cut)])
    with pytest.raises(APFormatError, match=r"manifest\.msgpack"):
        load_ap(damaged)


@pytest.mark.parametrize("data", [b"\x81\x81\x00\x00\x00", b"\x81\x91\x00\x00"])
def test_manifest_with_unhashable_map_key_names_file(damaged, data):
    """A damaged manifest that decodes to a map keyed by a map or an array (msgpack raises TypeError) is an
    APFormatError naming the file like any other damage, not a bare TypeError (found by mutating manifest bytes)."""
    (damaged / "manifest.msgpack").write_bytes(data)
    with pytest.raises(APFormatError, match=r"manifest\.msgpack: not a valid msgpack manifest"):
        load_ap(damaged)


def test_manifest_body_corruption_names_file(damaged):
    path = damaged / "manifest.msgpack"
    head = msgpack.unpackb(path.read_bytes())
    body = bytearray(head["body"])
    body[len(body) // 2] ^= 0x01
    head["body"] = bytes(body)
    path.write_bytes(msgpack.packb(head))
    with pytest.raises(APFormatError, match=r"manifest\.msgpack.*checksum"):
        load_ap(damaged)


@pytest.mark.parametrize("edit, reason", [
    (lambda m: m["blocks"].pop(), r"\d+ blocks for \d+ layers of \d+ experts"),
    (lambda m: m["blocks"].reverse(), r"block 0 is layer \d+ expert \d+ down, out of order"),
    (lambda m: m["blocks"][3]["plane_offsets"].__setitem__(0, 1 << 40),
     r"block 3: planes or LUTs beyond planes-[0-9a-f]{16}\.bin"),
    (lambda m: m["blocks"][1].pop("lut_offsets"), r"KeyError: 'lut_offsets'"),
    (lambda m: m["tables"].__setitem__("routing_mass", m["tables"]["sensitivity"]), r"table routing_mass of shape"),
    (lambda m: m.pop("files"), r"KeyError: 'files'"),
    (lambda m: m["files"][0].pop("size"), r"KeyError: 'size'"),
])
def test_a_manifest_of_another_layout_is_refused_by_name(damaged, edit, reason):
    """A manifest body with a valid checksum but blocks, offsets or tables that do not fit the checkpoint (another
    writer, a hand edit) is an APFormatError naming the manifest at load, not an IndexError in a later read."""
    path = damaged / "manifest.msgpack"
    head = msgpack.unpackb(path.read_bytes())
    body = msgpack.unpackb(head["body"], raw=False, strict_map_key=False)
    edit(body)
    head["body"] = msgpack.packb(body)
    head["blake2b"] = hashlib.blake2b(head["body"], digest_size=32).hexdigest()
    path.write_bytes(msgpack.packb(head))
    with pytest.raises(APFormatError, match=r"manifest\.msgpack.*bad manifest body.*" + reason):
        load_ap(damaged, verify=False)


def test_wrong_version_names_file(damaged):
    path = damaged / "manifest.msgpack"
    head = msgpack.unpackb(path.read_bytes())
    head["version"] = 99
    path.write_bytes(msgpack.packb(head))
    with pytest.raises(APFormatError, match=r"manifest\.msgpack.*version 99"):
        load_ap(damaged)


def test_chat_template_travels_with_the_checkpoint(converted):
    """tokenizer_config.json (the chat template, the special tokens' text) is copied and listed in the manifest:
    the AP checkpoint chats as its source does."""
    from pagedweight.tokenizer import TextTokenizer

    src, ap_dir, _ = converted
    assert (ap_dir / "tokenizer_config.json").read_bytes() == (src / "tokenizer_config.json").read_bytes()
    assert not (ap_dir / "chat_template.jinja").exists()  # copied only where the source has it
    tok = TextTokenizer.from_dir(ap_dir)
    assert tok.chat_template.render([{"role": "user", "content": "hi"}]) == "user> hix"
    assert "tokenizer_config.json" in {f["name"] for f in load_ap(ap_dir).manifest["files"]}


def test_missing_file_names_it(damaged):
    (damaged / "tokenizer.json").unlink()
    with pytest.raises(APFormatError, match=r"tokenizer\.json.*missing"):
        load_ap(damaged)


def _with_cached_calibration(ap_dir: Path, out: Path, monkeypatch) -> None:
    """`out` holds `ap_dir`'s calibration statistics, and a calibration run fails: a convert must take the cache."""
    out.mkdir()
    cache = next(ap_dir.glob("calib-activation-*.safetensors"))
    shutil.copy(cache, out / cache.name)

    def refuse(*args, **kwargs):
        raise AssertionError("calibration ran although cached statistics exist")

    monkeypatch.setattr("pagedweight.calibrate.calibrate", refuse)


def test_second_conversion_reuses_calibration(converted, tmp_path, monkeypatch):
    src, ap_dir, calib = converted
    out = tmp_path / "again"
    _with_cached_calibration(ap_dir, out, monkeypatch)
    convert(src, out, calib, sensitivity="activation", num_seqs=6, seq_len=64, device="cpu")
    assert _planes(out).read_bytes() == _planes(ap_dir).read_bytes()
    with pytest.raises(AssertionError, match="calibration ran"):  # other settings: a different key
        convert(src, out, calib, sensitivity="activation", num_seqs=5, seq_len=64, device="cpu")
    retok = tmp_path / "retokenized"  # the same weights with another tokenizer.json: other token ids, another key
    shutil.copytree(src, retok)
    (retok / "tokenizer.json").write_text((src / "tokenizer.json").read_text() + "\n")
    with pytest.raises(AssertionError, match="calibration ran"):
        convert(retok, out, calib, sensitivity="activation", num_seqs=6, seq_len=64, device="cpu")


def test_reconverting_into_a_used_directory_leaves_nothing_of_the_old_one(converted, tmp_path):
    """A conversion into a directory that holds another checkpoint: one killed before it finished leaves the old
    checkpoint whole (its manifest over its own planes and dense weights, never new planes beside old dense weights);
    one that finishes leaves nothing of the old one: not its planes and dense weights, not a killed write's
    temporary files, not a file the new source lacks (its chat template); and a damaged calibration cache is computed
    again rather than failing every later conversion."""
    src, ap_dir, calib = converted
    reused = tmp_path / "reused"
    shutil.copytree(ap_dir, reused)
    plain = tmp_path / "plain"
    shutil.copytree(src, plain)
    (plain / "tokenizer_config.json").unlink()
    m = load_ap(reused).manifest
    before = sorted(p.name for p in reused.iterdir())
    killed = APWriter(reused, m["config"], m["family"], m["num_layers"], m["num_experts"], m["seed_bits"],
                      m["parent_bits"])
    killed._cleanup.detach()  # started, then killed before finish(): no cleanup runs
    killed._file.close()
    assert load_ap(reused, verify=True).manifest == m
    assert len(set(p.name for p in reused.iterdir()) - set(before)) == 1  # its temporary planes file
    cache = next(reused.glob("calib-activation-*.safetensors"))
    cache.write_bytes(cache.read_bytes()[:100])  # cut short
    convert(plain, reused, calib, sensitivity="activation", num_seqs=6, seq_len=64, device="cpu")
    assert not (reused / "tokenizer_config.json").exists()
    names = {f["name"] for f in load_ap(reused).manifest["files"]}
    assert sorted(p.name for p in reused.iterdir()) == sorted(names | {"manifest.msgpack", cache.name})
    assert "tokenizer_config.json" not in {f["name"] for f in load_ap(reused, verify=True).manifest["files"]}
    again, first = CalibStats.load(cache), CalibStats.load(next(ap_dir.glob("calib-activation-*.safetensors")))
    assert again.tokens == first.tokens and torch.equal(again.gate_up, first.gate_up)


def test_bad_convert_input_is_refused_before_the_model_loads(converted, tmp_path, monkeypatch):
    """Input that cannot convert fails before the model loads and calibrates (minutes for a large one), as a ValueError
    / CheckpointError / FileNotFoundError the CLI reports in one line. Before: an output directory equal to the source
    converted the whole model into it (planes.bin, dense.safetensors and the calibration cache beside the HF weights,
    its config.json rewritten) and then died in a SameFileError; an output path that is a file died in a
    FileExistsError after calibration; a missing tokenizer.json showed only after the model loaded."""
    from pagedweight.checkpoint import CheckpointError

    src, ap_dir, calib = converted

    def refuse(*args, **kwargs):
        raise AssertionError("the model loaded although the input is bad")

    monkeypatch.setattr("pagedweight.models.load_model", refuse)
    copy = tmp_path / "src"
    shutil.copytree(src, copy)
    before = {p.name: p.read_bytes() for p in copy.iterdir()}
    with pytest.raises(ValueError, match="output directory is the source directory"):
        convert(copy, tmp_path / "x" / ".." / "src", calib, sensitivity="activation", device="cpu")
    assert {p.name: p.read_bytes() for p in copy.iterdir()} == before  # nothing written into the source
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match="a_file: exists and is not a directory"):
        convert(src, tmp_path / "a_file", calib, sensitivity="activation", device="cpu")
    with pytest.raises(ValueError, match="already an AP checkpoint"):
        convert(ap_dir, tmp_path / "out", calib, sensitivity="activation", device="cpu")
    with pytest.raises(FileNotFoundError, match="calibration text"):
        convert(src, tmp_path / "out", tmp_path / "no.txt", sensitivity="activation", device="cpu")
    with pytest.raises(ValueError, match="seed_bits <= parent_bits"):
        convert(src, tmp_path / "out", calib, seed_bits=5, parent_bits=4, sensitivity="activation", device="cpu")
    (copy / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: file not found"):
        convert(copy, tmp_path / "out", calib, sensitivity="activation", device="cpu")
    assert not (tmp_path / "out").exists()


def test_calibration_key_ignores_stray_safetensors(converted, tmp_path, monkeypatch):
    """The calibration cache is keyed by the weight files the model loads from, not every *.safetensors beside them:
    a Mistral repository's consolidated*.safetensors (the same weights again, ~93 GB for Mixtral-8x7B) were hashed
    on every conversion, and a stray file changed the key."""
    src, ap_dir, calib = converted
    copy = tmp_path / "src"
    shutil.copytree(src, copy)
    (copy / "consolidated.safetensors").write_bytes(b"\0" * 64)  # not even readable: it must not be opened
    out = tmp_path / "out"
    _with_cached_calibration(ap_dir, out, monkeypatch)
    convert(copy, out, calib, sensitivity="activation", num_seqs=6, seq_len=64, device="cpu")
    assert _planes(out).read_bytes() == _planes(ap_dir).read_bytes()


def test_writer_syncs_every_file_before_the_manifest_vouches_for_them(tmp_path, monkeypatch):
    """The manifest renamed into place last makes a directory a checkpoint: the planes, the dense weights, the copied
    files, their renames into place and the manifest's own bytes reach the disk before that rename (and the rename
    after it). Without the syncs a crash or power cut could leave a manifest over planes of the right size but
    unwritten contents, which the engine (no checksums by default) would serve."""
    import os

    synced: set[int] = set()
    real_fsync, real_replace = os.fsync, os.replace
    at_rename: dict[str, bool] = {}

    def fsync(fd):
        synced.add(os.fstat(fd).st_ino)
        real_fsync(fd)

    def replace(a, b):
        assert os.stat(a).st_ino in synced  # every file is synced before it is renamed into place
        if Path(b).name == "manifest.msgpack":
            at_rename.update({p.name: p.stat().st_ino in synced for p in Path(a).parent.iterdir()})
            at_rename["directory"] = os.stat(Path(a).parent).st_ino in synced  # the files' renames
            synced.discard(os.stat(Path(a).parent).st_ino)
        real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    g = torch.Generator().manual_seed(0)
    writer = APWriter(tmp_path, {"model_type": "qwen2_moe"}, "qwen2_moe", 1, 1, 3, 4)
    for kind, (n, k) in (("gate_up", (8, 40)), ("down", (5, 4))):
        writer.add_block(0, 0, kind, quantize_blocks([torch.randn(n, k, generator=g)], [None], 3, 4)[0], k)
    writer.finish(np.ones((1, 1)), {"norm.weight": torch.ones(5)}, None)
    ap = load_ap(tmp_path)
    assert at_rename == {name: True for name in (ap.planes_file.name, ap.dense_file.name, "config.json",
                                                 "generation_config.json", "manifest.msgpack.tmp", "directory")}
    assert os.stat(tmp_path).st_ino in synced  # the directory again, after the manifest's rename
    assert ap.planes(1).shape == (4, 1, 5)


def test_a_block_that_cannot_quantize_is_named(tmp_path):
    """Weights beyond float16 (or NaN) stop the conversion with the layer, kind and experts they are in."""
    from pagedweight.convert import quantize_layer

    writer = APWriter(tmp_path, {}, "qwen2_moe", 2, 2, 3, 4)
    gate_up, down = torch.randn(2, 8, 6), torch.randn(2, 6, 4)
    down[1, 2, 3] = 9e4
    with pytest.raises(ValueError, match=r"layer 1 down of experts 0-1: a 3-bit centroid is beyond float16's range"):
        quantize_layer(writer, 1, gate_up, down, lambda e, kind: None, torch.device("cpu"))


def _write_small(d: Path, seed: int, experts: int = 1, config: dict | None = None, **patch) -> APWriter:
    """Write a 1-layer checkpoint of `experts` random experts into `d` (the seed picks the weights; `config` adds to
    its HF config)."""
    g = torch.Generator().manual_seed(seed)
    writer = APWriter(d, {"model_type": "qwen2_moe", **(config or {})}, "qwen2_moe", 1, experts, 3, 4)
    for e in range(experts):
        for kind, (n, k) in (("gate_up", (8, 40)), ("down", (5, 4))):
            writer.add_block(0, e, kind, quantize_blocks([torch.randn(n, k, generator=g)], [None], 3, 4)[0], k)
    writer.finish(np.full((1, experts), 1 / experts), {"norm.weight": torch.full((5,), float(seed))}, None)
    return writer


def _contents(ap) -> list[np.ndarray]:
    return [ap.planes(i).copy() for i in range(len(ap.blocks))] + \
        [ap.lut(i, b).copy() for i in range(len(ap.blocks)) for b in range(ap.seed_bits, ap.parent_bits + 1)]


def _assert_same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))


def test_a_mapped_checkpoint_keeps_its_planes_when_the_directory_is_rewritten(tmp_path):
    """A process that mapped a checkpoint (an engine, a page store being filled) reads its own planes after another
    conversion into the directory finished. Before, the writer truncated planes.bin in place and rewrote it: the
    mapping read the new planes under the old offsets (or died of SIGBUS where the new file was shorter)."""
    _write_small(tmp_path, seed=1)
    old = load_ap(tmp_path)
    want = _contents(old)
    _write_small(tmp_path, seed=2, experts=2)  # larger planes: the old code's mapping reads them, no SIGBUS
    _assert_same(_contents(old), want)
    new = load_ap(tmp_path)
    assert len(new.blocks) == 4 and new.planes_file != old.planes_file and not old.planes_file.exists()
    assert torch.equal(new.dense_state_dict()["norm.weight"], torch.full((5,), 2.0))
    with pytest.raises(APFormatError, match=r"dense-[0-9a-f]{16}\.safetensors: missing \(the checkpoint was "
                                            r"replaced by a later conversion"):
        old.dense_state_dict()  # opened by name: gone with the checkpoint it belonged to, not the new one's weights



def test_a_page_store_of_a_replaced_checkpoint_says_open_it_again(tmp_path):
    """An engine that opened a checkpoint before a later conversion into its directory, then builds its page store
    from the planes file (opened by name), is told the checkpoint was replaced, not a bare FileNotFoundError."""
    from pagedweight.runner import ap_weights

    _write_small(tmp_path / "ap", seed=1)
    old = load_ap(tmp_path / "ap")
    _write_small(tmp_path / "ap", seed=2, experts=2)
    with pytest.raises(APFormatError, match=r"planes-[0-9a-f]{16}\.bin: missing \(the checkpoint was replaced"):
        ap_weights(old, tmp_path / "store")
    assert ap_weights(load_ap(tmp_path / "ap"), tmp_path / "store2").store is not None  # opened again: it serves

def test_a_conversion_that_fails_midway_leaves_the_old_checkpoint(converted, tmp_path, monkeypatch):
    """A conversion into a checkpoint's directory that raises midway (here: from add_block) leaves the old checkpoint
    loadable and checksummed, byte for byte, and no temporary file behind once the writer it abandoned is gone.
    Before, the writer removed the old manifest and truncated planes.bin as it started."""
    import gc

    src, ap_dir, calib = converted
    reused = tmp_path / "reused"
    shutil.copytree(ap_dir, reused)  # its calibration cache too: no calibration runs
    before = {p.name: p.read_bytes() for p in reused.iterdir()}
    want = _contents(load_ap(reused))
    real, calls = APWriter.add_block, []

    def add_block(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        real(self, *args, **kwargs)

    monkeypatch.setattr(APWriter, "add_block", add_block)
    try:
        convert(src, reused, calib, sensitivity="activation", num_seqs=6, seq_len=64, device="cpu")
    except RuntimeError as exc:
        assert "injected" in str(exc)
    else:
        pytest.fail("the conversion did not fail")
    gc.collect()  # the abandoned writer (referenced by the traceback until now) removes its temporary file
    assert {p.name: p.read_bytes() for p in reused.iterdir()} == before
    _assert_same(_contents(load_ap(reused, verify=True)), want)


@pytest.mark.parametrize("where", ["dense weights", "manifest rename"])
def test_a_finish_that_fails_removes_its_files(tmp_path, monkeypatch, where):
    """finish() failing while it writes the dense weights, or at the very last step (the manifest's rename, after the
    new planes, dense weights and copied files were renamed in) leaves the directory as it was: the old checkpoint
    whole and checksummed, none of the new write's files. The new write's config differs (another model converted
    into the directory): before, a failed manifest rename left its config.json and generation_config.json under the
    old manifest, which then refused to load (config.json's size differs from the manifest's)."""
    import os

    import safetensors.torch

    _write_small(tmp_path, seed=1)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    want = _contents(load_ap(tmp_path))
    real_replace = os.replace

    def fail(*args, **kwargs):
        raise OSError("injected failure")

    def replace(a, b):
        (fail if Path(b).name == "manifest.msgpack" else real_replace)(a, b)

    if where == "dense weights":
        monkeypatch.setattr(safetensors.torch, "save_file", fail)
    else:
        monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="injected"):
        _write_small(tmp_path, seed=2, config={"eos_token_id": 7, "hidden_size": 5})
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    _assert_same(_contents(load_ap(tmp_path, verify=True)), want)


def test_an_interrupt_after_the_commit_keeps_the_new_checkpoint(tmp_path, monkeypatch):
    """Ctrl-C (or any exception) after the manifest's rename, in the directory sync that follows it: the new
    checkpoint is committed and stays whole. Before, finish() took it for a failed write and removed the new planes
    and dense weights that the manifest in place names: neither checkpoint loaded any more (and the next conversion's
    sweep removed the old one's files, which no manifest named)."""
    import pagedweight.apformat as apformat

    _write_small(tmp_path, seed=1)
    real, calls = apformat._fsync_dir, []

    def fsync_dir(path):
        real(path)
        calls.append(path)
        if len(calls) == 2:  # the sync after the manifest's rename
            raise KeyboardInterrupt

    monkeypatch.setattr(apformat, "_fsync_dir", fsync_dir)
    with pytest.raises(KeyboardInterrupt):
        _write_small(tmp_path, seed=2, experts=2)
    monkeypatch.setattr(apformat, "_fsync_dir", real)
    ap = load_ap(tmp_path, verify=True)
    assert len(ap.blocks) == 4 and torch.equal(ap.dense_state_dict()["norm.weight"], torch.full((5,), 2.0))
    assert not list(tmp_path.glob(".pw-*"))
    _write_small(tmp_path, seed=3)  # the next conversion removes the superseded files as usual
    assert sorted(p.name for p in tmp_path.glob("planes*")) == [load_ap(tmp_path).planes_file.name]


def test_a_killed_writers_temporary_files_go_when_the_next_writer_starts(tmp_path):
    """A conversion killed mid-write (OOM killer, SIGKILL: no finalizer runs) leaves its hidden temporary planes file,
    up to the checkpoint's size. The next writer in the directory removes it as it starts, so a retry needs no room
    for it. Before, it stayed until a later conversion committed: a retry that failed too (out of disk space, say)
    left it, and further ones added theirs beside it."""
    block = quantize_blocks([torch.randn(8, 40)], [None], 3, 4)[0]
    killed = APWriter(tmp_path, {}, "qwen2_moe", 1, 1, 3, 4)
    killed.add_block(0, 0, "gate_up", block, 40)
    killed._cleanup.detach()  # as if killed: its finalizer never runs
    killed._file.close()
    leftover = list(tmp_path.iterdir())
    assert len(leftover) == 1 and leftover[0].name.startswith(".pw-")
    retry = APWriter(tmp_path, {}, "qwen2_moe", 1, 1, 3, 4)
    assert not leftover[0].exists() and len(list(tmp_path.iterdir())) == 1
    retry.abort()
    assert list(tmp_path.iterdir()) == []


def test_an_unfinished_writer_removes_its_temporary_file(tmp_path):
    """A writer left without finish() removes its temporary planes file: abort(), leaving its `with` block by an
    exception, or when it is garbage-collected. The old code wrote planes.bin itself, left behind by each of them."""
    import gc

    block = quantize_blocks([torch.randn(8, 40)], [None], 3, 4)[0]
    writer = APWriter(tmp_path, {}, "qwen2_moe", 1, 1, 3, 4)
    writer.add_block(0, 0, "gate_up", block, 40)
    assert len(list(tmp_path.iterdir())) == 1
    writer.abort()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="already finished or aborted"):
        writer.finish(np.ones((1, 1)), {}, None)
    with pytest.raises(RuntimeError, match="stop"):
        with APWriter(tmp_path, {}, "qwen2_moe", 1, 1, 3, 4) as writer:
            writer.add_block(0, 0, "gate_up", block, 40)
            raise RuntimeError("stop")
    assert list(tmp_path.iterdir()) == []
    writer = APWriter(tmp_path, {}, "qwen2_moe", 1, 1, 3, 4)
    writer.add_block(0, 0, "gate_up", block, 40)
    del writer
    gc.collect()
    assert list(tmp_path.iterdir()) == []


def test_a_reader_before_the_commit_gets_the_whole_old_checkpoint(tmp_path, monkeypatch):
    """Up to the manifest's rename (the new planes and dense weights already in the directory, under names only the
    new manifest gives) a reader opens the old checkpoint, planes and dense weights, checksums and all; after it,
    the new one. With fixed names (planes.bin renamed in before the manifest) a reader in between would pair the old
    manifest with the new planes; a re-conversion of the same model has planes of the same size, so only the
    checksums (off in the engine) could tell. Before, the old manifest was gone as soon as the writer started."""
    import os

    _write_small(tmp_path, seed=1)
    want = _contents(load_ap(tmp_path))
    real_replace, seen = os.replace, []

    def replace(a, b):
        if Path(b).name == "manifest.msgpack":
            ap = load_ap(tmp_path, verify=True)
            seen.append(len(list(tmp_path.glob("planes*.bin"))))
            _assert_same(_contents(ap), want)
            assert torch.equal(ap.dense_state_dict()["norm.weight"], torch.full((5,), 1.0))
        real_replace(a, b)

    monkeypatch.setattr(os, "replace", replace)
    _write_small(tmp_path, seed=2)  # the same shapes: the same file sizes
    assert seen == [2]  # the old planes and the new beside them
    ap = load_ap(tmp_path, verify=True)
    assert torch.equal(ap.dense_state_dict()["norm.weight"], torch.full((5,), 2.0))
    assert not any(np.array_equal(a, b) for a, b in zip(_contents(ap), want) if a.size > 16)


def test_an_open_racing_a_commit_starts_over(tmp_path, monkeypatch):
    """A conversion that commits (and removes the superseded planes) after load_ap read the manifest but before it
    opened the planes: load_ap opens the new checkpoint whole rather than failing or pairing the two. Before, it
    refused the new planes.bin under the old manifest as truncated (or served it, had the sizes been equal)."""
    import pagedweight.apformat as apformat

    _write_small(tmp_path, seed=1)
    real_read = apformat.read_manifest
    calls = []

    def read_manifest(path):
        man = real_read(path)
        calls.append(1)
        if len(calls) == 1:
            _write_small(tmp_path, seed=2, experts=2)
        return man

    monkeypatch.setattr(apformat, "read_manifest", read_manifest)
    ap = load_ap(tmp_path, verify=True)
    assert len(calls) == 2 and len(ap.blocks) == 4
    monkeypatch.setattr(apformat, "read_manifest", real_read)
    _assert_same(_contents(ap), _contents(load_ap(tmp_path)))


def test_a_checkpoint_naming_planes_bin_loads_and_is_replaced_whole(tmp_path):
    """A checkpoint written before the planes and dense weights were named by their content (its manifest names
    planes.bin and dense.safetensors) loads as before; a conversion into its directory removes those files after
    its commit, and a process that mapped the old planes.bin keeps reading it."""
    import hashlib as hl

    _write_small(tmp_path, seed=1)
    ap = load_ap(tmp_path)
    want = _contents(ap)
    ap.planes_file.rename(tmp_path / "planes.bin")
    ap.dense_file.rename(tmp_path / "dense.safetensors")
    path = tmp_path / "manifest.msgpack"
    head = msgpack.unpackb(path.read_bytes())
    body = msgpack.unpackb(head["body"], raw=False, strict_map_key=False)
    for f, name in zip(body["files"], ("planes.bin", "dense.safetensors")):
        f["name"] = name
    del body["planes_file"], body["dense_file"]
    head["body"] = msgpack.packb(body, use_bin_type=True)
    head["blake2b"] = hl.blake2b(head["body"], digest_size=32).hexdigest()
    path.write_bytes(msgpack.packb(head, use_bin_type=True))
    old = load_ap(tmp_path, verify=True)
    assert old.planes_file.name == "planes.bin" and old.dense_file.name == "dense.safetensors"
    _assert_same(_contents(old), want)
    assert torch.equal(old.dense_state_dict()["norm.weight"], torch.full((5,), 1.0))
    _write_small(tmp_path, seed=2, experts=2)
    _assert_same(_contents(old), want)
    assert not (tmp_path / "planes.bin").exists() and not (tmp_path / "dense.safetensors").exists()
    assert len(load_ap(tmp_path, verify=True).blocks) == 4
