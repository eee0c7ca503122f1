"""AP checkpoint directory: write it block by block, read it back zero-copy.

Layout of a directory:
  manifest.msgpack  {"format", "version", "body": msgpack bytes, "blake2b": hex of body}; the body holds the HF
                    config, family, seed/parent bits, block list with byte offsets, tables (s_i^b, raw M_i^b,
                    routing mass), planner knobs, residual heads (version 2), calibration info and every other
                    file with size + blake2b.
  planes.bin        every plane and LUT at a 4096-byte-aligned offset (memory-mappable and pinnable in place).
  dense.safetensors non-expert weights under the model's state-dict names.
  config.json, generation_config.json, tokenizer.json, and tokenizer_config.json and chat_template.jinja where the
                    source has them (copied from the source).
Every inconsistency found on load raises APFormatError naming the file.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import msgpack
import numpy as np
import torch

from pagedweight.bitplanes import dequantize, lut_bytes, num_words, plane_bytes
from pagedweight.quantize import QuantizedBlock
from pagedweight.signals import ResidualHeads

FORMAT = "pagedweight-ap"
# 1: session 1 (no residual heads: the planner runs on the global estimate). 2: + "residual_heads" (None or the
# trained prompt residual heads' arrays). Every version listed in READABLE loads; anything else is refused.
VERSION = 2
READABLE = (1, 2)
ALIGN = 4096
KINDS = ("gate_up", "down")
MANIFEST = "manifest.msgpack"
PLANES = "planes.bin"
DENSE = "dense.safetensors"
# copied from the source when it has them (config.json is rewritten); the last two carry the chat template
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


class APFormatError(ValueError):
    """A damaged, truncated, mismatched or unsupported AP checkpoint file (the message names the file).

    A ValueError, so the CLI reports it as bad input."""

    def __init__(self, path: str | Path, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path = Path(path)


def _pack_array(a: np.ndarray) -> dict[str, Any]:
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": a.tobytes()}


def _unpack_array(d: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(d["data"], dtype=np.dtype(d["dtype"])).reshape(d["shape"])


def _blake2b_file(path: Path) -> str:
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    """Flush a written file (or a directory's entries) to the disk: a manifest renamed into place must not outlive,
    after a crash or power cut, the data it vouches for (sizes would match; the engine verifies no checksums)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def block_bytes(plane_nbytes: int, lut_nbytes: int, b: int, page_bytes: int = 1) -> int:
    """M_i^b as allocated: b whole-page plane runs plus one LUT_b run (page_bytes=1 gives raw bytes)."""
    def pages(nbytes: int) -> int:
        return -(-nbytes // page_bytes) * page_bytes

    return b * pages(plane_nbytes) + pages(lut_nbytes)


@dataclass
class BlockEntry:
    """Where one block's planes and LUTs lie in planes.bin."""

    layer: int
    expert: int
    kind: str
    n: int  # rows (outputs)
    k: int  # columns (inputs)
    plane_offsets: list[int]  # byte offset of plane p, p < P
    lut_offsets: list[int]  # byte offset of LUT_b at index b (-1 below the seed width)

    @property
    def words(self) -> int:
        return num_words(self.k)

    @property
    def plane_bytes(self) -> int:
        return plane_bytes(self.n, self.k)


class APWriter:
    """Streams quantized blocks into planes.bin (hashing as it writes), then writes everything else in finish()."""

    def __init__(self, out_dir: str | Path, hf_config: dict[str, Any], family: str, num_layers: int,
                 num_experts: int, seed_bits: int, parent_bits: int) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        # an earlier checkpoint in this directory stops being one now: a conversion cut short must not leave its
        # manifest vouching for new planes beside old dense weights (the engine does not verify checksums by default)
        (self.dir / MANIFEST).unlink(missing_ok=True)
        self.hf_config, self.family = hf_config, family
        self.num_layers, self.num_experts = num_layers, num_experts
        self.seed_bits, self.parent_bits = seed_bits, parent_bits
        n_blocks = num_layers * num_experts * 2
        self.entries: list[BlockEntry | None] = [None] * n_blocks
        self.sensitivity = np.zeros((n_blocks, parent_bits + 1), dtype=np.float64)
        self._file: BinaryIO = open(self.dir / PLANES, "wb")
        self._hash = hashlib.blake2b(digest_size=32)
        self._pos = 0

    def _write_aligned(self, data: np.ndarray) -> int:
        pad = -self._pos % ALIGN
        raw = b"\0" * pad + np.ascontiguousarray(data).tobytes()
        self._file.write(raw)
        self._hash.update(raw)
        offset = self._pos + pad
        self._pos += len(raw)
        return offset

    def add_block(self, layer: int, expert: int, kind: str, block: QuantizedBlock, k: int) -> None:
        """Append one block; `k` is its column count (planes hold ceil(k/32) words per row)."""
        p_count, words, n = block.planes.shape
        if p_count != self.parent_bits or words != num_words(k):
            raise ValueError(f"block ({layer}, {expert}, {kind}) planes {tuple(block.planes.shape)} "
                             f"do not match P={self.parent_bits}, K={k}")
        plane_offs = [self._write_aligned(block.planes[p].numpy()) for p in range(p_count)]
        lut_offs = [-1] * (self.parent_bits + 1)
        for b in range(self.seed_bits, self.parent_bits + 1):
            lut_offs[b] = self._write_aligned(block.luts[b].numpy().astype(np.float16, copy=False))
        i = (layer * self.num_experts + expert) * 2 + KINDS.index(kind)
        self.entries[i] = BlockEntry(layer, expert, kind, n, k, plane_offs, lut_offs)
        self.sensitivity[i] = block.sensitivity.numpy()

    def finish(self, routing_mass: np.ndarray, dense_state: dict[str, torch.Tensor], source_dir: str | Path | None,
               planner_knobs: dict[str, Any] | None = None, calibration: dict[str, Any] | None = None,
               residual_heads: ResidualHeads | None = None) -> Path:
        """Write dense weights, copied files and the manifest; returns the manifest path."""
        from safetensors.torch import save_file

        missing = [i for i, e in enumerate(self.entries) if e is None]
        if missing:
            raise ValueError(f"{len(missing)} blocks were never added (first flat index {missing[0]})")
        tail = b"\0" * (-self._pos % ALIGN)  # the file ends on a page, so the last run maps whole
        self._file.write(tail)
        self._hash.update(tail)
        self._pos += len(tail)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        files = [{"name": PLANES, "size": self._pos, "blake2b": self._hash.hexdigest()}]

        save_file({k: v.detach().cpu().clone() for k, v in dense_state.items()}, str(self.dir / DENSE))
        (self.dir / "config.json").write_text(json.dumps(self.hf_config, indent=1) + "\n")
        for name in COPIED[1:]:
            src = Path(source_dir) / name if source_dir else None
            if src is not None and src.exists():
                shutil.copyfile(src, self.dir / name)
            elif name == "generation_config.json":
                gen = {k: self.hf_config[k] for k in ("bos_token_id", "eos_token_id") if k in self.hf_config}
                (self.dir / name).write_text(json.dumps(gen, indent=1) + "\n")
            else:  # an earlier conversion's copy (another model's chat template) is not this model's
                (self.dir / name).unlink(missing_ok=True)
        for name in (DENSE, *COPIED):
            if (self.dir / name).exists():
                path = self.dir / name
                _fsync(path)
                files.append({"name": name, "size": path.stat().st_size, "blake2b": _blake2b_file(path)})

        entries = [e for e in self.entries if e is not None]
        raw = np.zeros_like(self.sensitivity, dtype=np.int64)
        for i, e in enumerate(entries):
            for b in range(self.seed_bits, self.parent_bits + 1):
                raw[i, b] = block_bytes(e.plane_bytes, lut_bytes(e.n, b), b)
        body = {
            "family": self.family, "config": self.hf_config,
            "num_layers": self.num_layers, "num_experts": self.num_experts,
            "seed_bits": self.seed_bits, "parent_bits": self.parent_bits, "alignment": ALIGN,
            "blocks": [{"layer": e.layer, "expert": e.expert, "kind": e.kind, "n": e.n, "k": e.k,
                        "plane_offsets": e.plane_offsets, "lut_offsets": e.lut_offsets} for e in entries],
            "tables": {"sensitivity": _pack_array(self.sensitivity), "raw_bytes": _pack_array(raw),
                       "routing_mass": _pack_array(np.asarray(routing_mass, dtype=np.float64))},
            "planner_knobs": planner_knobs or {}, "calibration": calibration or {}, "files": files,
            "residual_heads": None if residual_heads is None else _pack_heads(residual_heads, len(entries),
                                                                              self.parent_bits),
        }
        packed = msgpack.packb(body, use_bin_type=True)
        head = {"format": FORMAT, "version": VERSION, "body": packed,
                "blake2b": hashlib.blake2b(packed, digest_size=32).hexdigest()}
        path, tmp = self.dir / MANIFEST, self.dir / (MANIFEST + ".tmp")
        tmp.write_bytes(msgpack.packb(head, use_bin_type=True))
        _fsync(tmp)
        os.replace(tmp, path)  # last: a directory with a manifest is a whole checkpoint
        try:
            _fsync(self.dir)  # the rename itself
        except OSError:  # some file systems (network, FUSE) cannot sync a directory: the files are synced
            pass
        return path


@dataclass
class APCheckpoint:
    """A loaded AP checkpoint: manifest tables in memory, planes.bin memory-mapped read-only."""

    dir: Path
    manifest: dict[str, Any]
    blocks: list[BlockEntry]
    sensitivity: np.ndarray  # float64 [n_blocks, P+1]: s_i^b (index b; entries < seed unused)
    raw_bytes: np.ndarray  # int64 [n_blocks, P+1]: M_i^b in raw bytes (index b; entries < seed unused)
    routing_mass: np.ndarray  # float64 [L, E]
    _map: np.memmap = field(repr=False)

    @property
    def planes_file(self) -> Path:
        return self.dir / PLANES

    @property
    def seed_bits(self) -> int:
        return int(self.manifest["seed_bits"])

    @property
    def parent_bits(self) -> int:
        return int(self.manifest["parent_bits"])

    @property
    def planner_knobs(self) -> dict[str, Any]:
        return self.manifest["planner_knobs"]

    @property
    def residual_heads(self) -> ResidualHeads | None:
        """The trained prompt residual heads (None: a version-1 checkpoint, or converted without them)."""
        return heads_from_manifest(self.manifest, self.dir / MANIFEST)

    @property
    def hf_config(self) -> dict[str, Any]:
        return self.manifest["config"]

    @property
    def config(self):  # -> pagedweight.models.ModelConfig
        from pagedweight.models import FAMILIES

        return FAMILIES[self.manifest["family"]].from_hf(self.hf_config)

    def plane_offset(self, i: int, p: int) -> int:
        """Byte offset of plane p of block i in planes.bin."""
        return self.blocks[i].plane_offsets[p]

    def lut_offset(self, i: int, b: int) -> int:
        """Byte offset of LUT_b of block i in planes.bin."""
        if not self.seed_bits <= b <= self.parent_bits:
            raise ValueError(f"width {b} outside [{self.seed_bits}, {self.parent_bits}]")
        return self.blocks[i].lut_offsets[b]

    def plane(self, i: int, p: int) -> np.ndarray:
        """Zero-copy uint32 [W, N] view of plane p of block i."""
        e = self.blocks[i]
        off = e.plane_offsets[p]
        return self._map[off:off + e.plane_bytes].view(np.uint32).reshape(e.words, e.n)

    def planes(self, i: int, b: int | None = None) -> np.ndarray:
        """uint32 [b, W, N] copy of the first b planes of block i (a prefix; the reference path)."""
        return np.stack([self.plane(i, p) for p in range(self.parent_bits if b is None else b)])

    def lut(self, i: int, b: int) -> np.ndarray:
        """Zero-copy float16 [2^b, N] view of LUT_b of block i."""
        e = self.blocks[i]
        off = self.lut_offset(i, b)
        return self._map[off:off + lut_bytes(e.n, b)].view(np.float16).reshape(1 << b, e.n)

    def block_bytes(self, i: int, b: int, page_bytes: int = 1) -> int:
        """M_i^b as allocated with `page_bytes` pages (1 = raw bytes, the stored table)."""
        e = self.blocks[i]
        return block_bytes(e.plane_bytes, lut_bytes(e.n, b), b, page_bytes)

    def dequantized(self, i: int, b: int) -> torch.Tensor:
        """float32 [N, K] weight of block i at width b (bitplanes.dequantize on the stored planes)."""
        return dequantize(self.planes(i, b), self.lut(i, b), b, self.blocks[i].k)

    def dense_state_dict(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        path = self.dir / DENSE
        try:
            return load_file(str(path))
        except Exception as exc:  # safetensors raises its own error types for damaged headers
            raise APFormatError(path, f"cannot read dense weights ({exc})") from exc


def read_manifest(path: str | Path) -> dict[str, Any]:
    """Decode and check manifest.msgpack (format, version, body checksum)."""
    path = Path(path)
    try:
        head = msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=False)
    except FileNotFoundError:
        raise APFormatError(path, "missing") from None
    except (ValueError, TypeError, msgpack.UnpackException, msgpack.ExtraData) as exc:  # TypeError: a map key
        # that cannot be hashed (a damaged byte can make an array or map of one)
        raise APFormatError(path, f"not a valid msgpack manifest (corrupted or truncated: {exc})") from exc
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise APFormatError(path, f"not a {FORMAT} manifest")
    if head.get("version") not in READABLE:
        raise APFormatError(path, f"manifest version {head.get('version')!r} is not supported: this build reads "
                                  f"versions {', '.join(map(str, READABLE))} (convert the model again with it)")
    body = head.get("body")
    if not isinstance(body, bytes) or hashlib.blake2b(body, digest_size=32).hexdigest() != head.get("blake2b"):
        raise APFormatError(path, "checksum mismatch in the manifest body")
    return msgpack.unpackb(body, raw=False, strict_map_key=False)


def _pack_heads(heads: ResidualHeads, n_blocks: int, parent_bits: int) -> dict[str, Any]:
    if heads.parent_bits != parent_bits or heads.feat_mean.shape not in ((n_blocks, heads.feat_scale.size),
                                                                          heads.feat_scale.shape):
        raise ValueError(f"residual heads for P={heads.parent_bits}, feat_mean {heads.feat_mean.shape} do not fit "
                         f"{n_blocks} blocks at P={parent_bits}")
    return {k: _pack_array(v) for k, v in heads.to_dict().items()}


def heads_from_manifest(manifest: dict[str, Any], path: str | Path) -> ResidualHeads | None:
    """The residual heads of a decoded manifest body (`path` names the file in errors)."""
    packed = manifest.get("residual_heads")
    if packed is None:
        return None
    try:
        heads = ResidualHeads.from_dict({k: _unpack_array(v) for k, v in packed.items()})
    except (KeyError, TypeError, ValueError) as exc:
        raise APFormatError(path, f"bad residual heads ({exc})") from exc
    n_blocks = len(manifest["blocks"])
    if heads.parent_bits != manifest["parent_bits"] or heads.feat_mean.ndim == 2 and len(heads.feat_mean) != n_blocks:
        raise APFormatError(path, f"residual heads for P={heads.parent_bits} and {len(heads.feat_mean)} blocks, "
                                  f"the checkpoint has P={manifest['parent_bits']} and {n_blocks} blocks")
    return heads


def load_ap(ap_dir: str | Path, verify: bool = True) -> APCheckpoint:
    """Open an AP checkpoint; sizes are always checked, blake2b checksums too when `verify`."""
    ap_dir = Path(ap_dir)
    man = read_manifest(ap_dir / MANIFEST)
    try:
        listed = [(str(f["name"]), int(f["size"]), f["blake2b"]) for f in man["files"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise APFormatError(ap_dir / MANIFEST, f"bad manifest body ({type(exc).__name__}: {exc})") from exc
    for name, expect, digest in listed:
        path = ap_dir / name
        if not path.exists():
            raise APFormatError(path, "missing")
        size = path.stat().st_size
        if size != expect:
            raise APFormatError(path, f"size {size} bytes, manifest says {expect} (truncated or replaced)")
        if verify and _blake2b_file(path) != digest:
            raise APFormatError(path, "checksum mismatch (blake2b differs from the manifest)")
    planes_path = ap_dir / PLANES
    try:
        blocks = [BlockEntry(b["layer"], b["expert"], b["kind"], b["n"], b["k"], b["plane_offsets"],
                             b["lut_offsets"]) for b in man["blocks"]]
        tables = {k: _unpack_array(man["tables"][k]) for k in ("sensitivity", "raw_bytes", "routing_mass")}
        _check_layout(man, blocks, tables, planes_path.stat().st_size)
    except (KeyError, TypeError, ValueError) as exc:  # a self-consistent manifest of another layout or writer
        raise APFormatError(ap_dir / MANIFEST, f"bad manifest body ({type(exc).__name__}: {exc})") from exc
    mm = np.memmap(planes_path, dtype=np.uint8, mode="r") if planes_path.stat().st_size else np.zeros(0, np.uint8)
    return APCheckpoint(ap_dir, man, blocks, tables["sensitivity"], tables["raw_bytes"], tables["routing_mass"], mm)


def _check_layout(man: dict[str, Any], blocks: list[BlockEntry], tables: dict[str, np.ndarray], size: int) -> None:
    """The manifest's blocks are every (layer, expert, kind) once, in the writer's order, their planes and LUTs lie
    inside planes.bin, and its tables have a row per block (a ValueError naming the first that does not)."""
    L, E, seed, P = (int(man[k]) for k in ("num_layers", "num_experts", "seed_bits", "parent_bits"))
    if len(blocks) != L * E * 2:
        raise ValueError(f"{len(blocks)} blocks for {L} layers of {E} experts (want {L * E * 2})")
    for i, e in enumerate(blocks):
        if (e.layer * E + e.expert) * 2 + KINDS.index(e.kind) != i:
            raise ValueError(f"block {i} is layer {e.layer} expert {e.expert} {e.kind}, out of order")
        if len(e.plane_offsets) != P or len(e.lut_offsets) != P + 1:
            raise ValueError(f"block {i}: {len(e.plane_offsets)} planes and {len(e.lut_offsets)} LUT offsets at P={P}")
        ends = [o + e.plane_bytes for o in e.plane_offsets] + \
            [e.lut_offsets[b] + lut_bytes(e.n, b) for b in range(seed, P + 1)]
        if min(e.plane_offsets + e.lut_offsets[seed:], default=0) < 0 or max(ends, default=0) > size:
            raise ValueError(f"block {i}: planes or LUTs beyond planes.bin's {size} bytes")
    for name, shape in (("sensitivity", (L * E * 2, P + 1)), ("raw_bytes", (L * E * 2, P + 1)),
                        ("routing_mass", (L, E))):
        if tables[name].shape != shape:
            raise ValueError(f"table {name} of shape {tables[name].shape}, want {shape}")


def load_ap_model(ap_dir: str | Path, widths: int | np.ndarray | list[int], verify: bool = True):
    """Dense float32 model whose expert blocks are dequantize(planes, LUT_b) at each block's width.

    `widths` is one width for every block or an int array [n_blocks] indexed by flat block index.
    """
    from pagedweight.models import MoEForCausalLM

    ap = load_ap(ap_dir, verify=verify)
    n_blocks = len(ap.blocks)
    w = np.full(n_blocks, widths, dtype=np.int64) if np.isscalar(widths) else np.asarray(widths, dtype=np.int64)
    if w.shape != (n_blocks,) or w.min() < ap.seed_bits or w.max() > ap.parent_bits:
        raise ValueError(f"widths must be in [{ap.seed_bits}, {ap.parent_bits}] for {n_blocks} blocks")
    cfg = ap.config
    state = {k: v.float() for k, v in ap.dense_state_dict().items()}
    E, Fi, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    for l in range(cfg.num_hidden_layers):
        state[f"layers.{l}.mlp.experts.gate_up"] = torch.empty(E, 2 * Fi, D)
        state[f"layers.{l}.mlp.experts.down"] = torch.empty(E, D, Fi)
    for i, e in enumerate(ap.blocks):
        state[f"layers.{e.layer}.mlp.experts.{e.kind}"][e.expert] = ap.dequantized(i, int(w[i]))
    if cfg.tie_word_embeddings and "embed_tokens.weight" in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    with torch.device("meta"):
        model = MoEForCausalLM(cfg)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise APFormatError(ap.dir / DENSE, f"dense weights do not fit the model ({exc})") from exc
    model.tie_weights()
    return model.eval()
