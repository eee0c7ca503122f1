"""AP checkpoint directory: write it block by block, read it back zero-copy.

Layout of a directory:
  manifest.msgpack  {"format", "version", "body": msgpack bytes, "blake2b": hex of body}; the body holds the HF
                    config, family, seed/parent bits, block list with byte offsets, tables (s_i^b, raw M_i^b,
                    routing mass), planner knobs, residual heads (version 2), calibration info and every other
                    file with size + blake2b.
  planes-<id>.bin   every plane and LUT at a 4096-byte-aligned offset (memory-mappable and pinnable in place).
  dense-<id>.safetensors non-expert weights under the model's state-dict names.
                    <id>: the first 16 hex digits of the file's blake2b; the manifest names both files ("planes_file",
                    "dense_file"). Checkpoints written before name them planes.bin and dense.safetensors (no keys).
  config.json, generation_config.json, tokenizer.json, and tokenizer_config.json and chat_template.jinja where the
                    source has them (copied from the source).
Every inconsistency found on load raises APFormatError naming the file.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import weakref
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
PLANES = "planes.bin"  # the planes file of a checkpoint whose manifest names none (written before "planes_file")
DENSE = "dense.safetensors"  # likewise the dense weights ("dense_file")
# copied from the source when it has them (config.json is rewritten); the last two carry the chat template
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


REPLACED = "the checkpoint was replaced by a later conversion into its directory since it was opened: open it again"


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


def _fsync_dir(path: Path) -> None:
    """Sync a directory's entries (renames into it); some file systems (network, FUSE) cannot: their files are
    synced."""
    try:
        _fsync(path)
    except OSError:
        pass


def _is_data_file(name: str) -> bool:
    """A planes or dense weights file of some write (this layout or the one before)."""
    return name in (PLANES, DENSE) or name.startswith("planes-") and name.endswith(".bin") or \
        name.startswith("dense-") and name.endswith(".safetensors")


_TMP_PREFIX, _TMP_SUFFIX = ".pw-", ".tmp"  # a writer's temporary files: .pw-<token>-<name>.tmp


def _discard(file: BinaryIO, paths: list[Path], restore: list[tuple[Path, Path]]) -> None:
    """Close an unfinished write's planes file, put back the copied files it replaced (`restore`: (saved copy,
    name)) and remove its files (the writer's finalizer: holds no writer)."""
    file.close()
    for saved, path in restore:
        try:
            os.replace(saved, path)
        except OSError:
            pass
    for path in paths:
        path.unlink(missing_ok=True)


def block_bytes(plane_nbytes: int, lut_nbytes: int, b: int, page_bytes: int = 1) -> int:
    """M_i^b as allocated: b whole-page plane runs plus one LUT_b run (page_bytes=1 gives raw bytes)."""
    def pages(nbytes: int) -> int:
        return -(-nbytes // page_bytes) * page_bytes

    return b * pages(plane_nbytes) + pages(lut_nbytes)


@dataclass
class BlockEntry:
    """Where one block's planes and LUTs lie in the planes file."""

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
    """Streams quantized blocks into a temporary planes file (hashing as it writes), then writes everything else in
    finish().

    Re-converting into a directory that holds a checkpoint commits at one point, the manifest's rename. The planes
    and dense weights go to files named by their content (planes-<id>.bin, dense-<id>.safetensors) that only the new
    manifest names; everything is written under temporary names (.pw-*.tmp) and renamed into place in finish(), just
    before the manifest. So a process that mapped the old planes keeps reading them (the old file is unlinked after
    the commit, never truncated or rewritten); a conversion that fails or is killed before the commit leaves the old
    checkpoint whole and loadable; and no reader pairs one manifest with another write's planes or dense weights (with
    fixed names, a reader between the planes' and the manifest's renames would: a re-conversion of the same model
    has planes of the same size, and the engine verifies no checksums). The copied files keep their fixed names
    (tokenizers read them): they are renamed in right before the manifest, a window of a few renames (a finish()
    that fails there puts the old ones back; a kill there leaves the old manifest over new copied files).
    Until then the directory holds both checkpoints' planes (twice the disk of one, at the peak). After the commit,
    data files no manifest names (the superseded ones, a killed write's) and stale .pw-*.tmp files are removed, the
    latter also when a writer starts: one writer at a time per directory. A process that has the removed planes
    open or mapped keeps reading them on a local file system; on NFS only processes of the node that removed them
    do (other nodes' reads fail with a stale file handle), so re-convert there while no other node's engine is
    starting from the directory (a started engine reads its node's page store, not the checkpoint).

    A write that does not finish removes what it wrote: `abort()`, leaving a `with` block unfinished, a finish()
    that fails, or else when the writer is garbage-collected (or the interpreter exits).
    """

    def __init__(self, out_dir: str | Path, hf_config: dict[str, Any], family: str, num_layers: int,
                 num_experts: int, seed_bits: int, parent_bits: int) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.hf_config, self.family = hf_config, family
        self.num_layers, self.num_experts = num_layers, num_experts
        self.seed_bits, self.parent_bits = seed_bits, parent_bits
        n_blocks = num_layers * num_experts * 2
        self.entries: list[BlockEntry | None] = [None] * n_blocks
        self.sensitivity = np.zeros((n_blocks, parent_bits + 1), dtype=np.float64)
        # a killed write's temporary files (its planes: up to the whole checkpoint's size) go now, not only after
        # this write's commit: one writer at a time per directory
        for p in self.dir.glob(f"{_TMP_PREFIX}*{_TMP_SUFFIX}"):
            p.unlink(missing_ok=True)
        self._token = secrets.token_hex(6)
        self._owned: list[Path] = []  # removed unless finished: temporary files, data files placed before the commit
        self._restore: list[tuple[Path, Path]] = []  # (saved copy, name): old copied files, put back unless committed
        self._manifest_ino: int | None = None  # the new manifest's inode: it is in place once the commit happened
        self._file: BinaryIO = open(self._tmp("planes.bin"), "wb")
        self._cleanup = weakref.finalize(self, _discard, self._file, self._owned, self._restore)
        self._hash = hashlib.blake2b(digest_size=32)
        self._pos = 0

    def __enter__(self) -> APWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()  # after finish(): nothing left to remove

    def abort(self) -> None:
        """Give up an unfinished write: close and remove its files (the directory's checkpoint stays as it was)."""
        self._cleanup()

    def _tmp(self, name: str) -> Path:
        path = self.dir / f"{_TMP_PREFIX}{self._token}-{name}{_TMP_SUFFIX}"
        self._owned.append(path)
        return path

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
        """Write dense weights, copied files and the manifest, then commit them; returns the manifest path.

        A finish() that fails removes this write's files: the directory keeps its previous checkpoint."""
        if not self._cleanup.alive:
            raise ValueError(f"{self.dir}: this write was already finished or aborted")
        try:
            path, names = self._finish(routing_mass, dense_state, source_dir, planner_knobs, calibration,
                                       residual_heads)
        except BaseException:
            if self._committed():  # e.g. Ctrl-C in the directory sync after the manifest's rename: the new
                # checkpoint stands, its files stay (only temporary ones go)
                self._owned[:] = [p for p in self._owned if p.name.startswith(_TMP_PREFIX)]
                self._restore.clear()
            self.abort()
            raise
        self._owned.clear()  # committed: nothing of it is removed any more
        self._restore.clear()
        self._cleanup()
        self._sweep(names)
        return path

    def _finish(self, routing_mass: np.ndarray, dense_state: dict[str, torch.Tensor], source_dir: str | Path | None,
                planner_knobs: dict[str, Any] | None, calibration: dict[str, Any] | None,
                residual_heads: ResidualHeads | None) -> tuple[Path, set[str]]:
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
        planes_hash = self._hash.hexdigest()
        planes_name = f"planes-{planes_hash[:16]}.bin"
        staged = [(planes_name, Path(self._file.name))]  # (final name, temporary file)
        files = [{"name": planes_name, "size": self._pos, "blake2b": planes_hash}]

        tmp = self._tmp(DENSE)
        save_file({k: v.detach().cpu().clone() for k, v in dense_state.items()}, str(tmp))
        dense_hash = _blake2b_file(tmp)
        dense_name = f"dense-{dense_hash[:16]}.safetensors"
        staged.append((dense_name, tmp))
        files.append({"name": dense_name, "size": tmp.stat().st_size, "blake2b": dense_hash})
        for name in COPIED:
            src = Path(source_dir) / name if source_dir else None
            tmp = self._tmp(name)
            if name == "config.json":
                tmp.write_text(json.dumps(self.hf_config, indent=1) + "\n")
            elif src is not None and src.exists():
                shutil.copyfile(src, tmp)
            elif name == "generation_config.json":
                gen = {k: self.hf_config[k] for k in ("bos_token_id", "eos_token_id") if k in self.hf_config}
                tmp.write_text(json.dumps(gen, indent=1) + "\n")
            else:  # an earlier conversion's copy (another model's chat template) goes after the commit
                continue
            staged.append((name, tmp))
            files.append({"name": name, "size": tmp.stat().st_size, "blake2b": _blake2b_file(tmp)})
        for _, tmp in staged[1:]:
            _fsync(tmp)

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
            "planes_file": planes_name, "dense_file": dense_name,
            "residual_heads": None if residual_heads is None else _pack_heads(residual_heads, len(entries),
                                                                              self.parent_bits),
        }
        packed = msgpack.packb(body, use_bin_type=True)
        head = {"format": FORMAT, "version": VERSION, "body": packed,
                "blake2b": hashlib.blake2b(packed, digest_size=32).hexdigest()}
        path, tmp = self.dir / MANIFEST, self.dir / (MANIFEST + ".tmp")
        self._owned.append(tmp)
        tmp.write_bytes(msgpack.packb(head, use_bin_type=True))
        _fsync(tmp)
        self._manifest_ino = os.stat(tmp).st_ino
        for name, staged_tmp in staged:
            dst = self.dir / name
            if not dst.exists():  # removed if the commit fails (no manifest names it yet)
                self._owned.append(dst)
            elif not _is_data_file(name):  # a copied file the old manifest vouches for (size, blake2b): kept aside
                saved = self._tmp(name + ".old")  # and put back if the commit fails
                shutil.copyfile(dst, saved)
                self._restore.append((saved, dst))
            # (an existing data file is content-named: the same bytes)
            os.replace(staged_tmp, dst)
        _fsync_dir(self.dir)  # the files' renames reach the disk before the manifest's
        os.replace(tmp, path)  # the commit: a directory with a manifest is a whole checkpoint
        _fsync_dir(self.dir)  # the rename itself
        return path, {f["name"] for f in files}

    def _committed(self) -> bool:
        """Whether this write's manifest was renamed into place."""
        try:
            return self._manifest_ino is not None and os.stat(self.dir / MANIFEST).st_ino == self._manifest_ino
        except OSError:
            return False

    def _sweep(self, keep: set[str]) -> None:
        """After the commit: remove the data files the manifest (naming `keep`) does not name (the superseded
        checkpoint's, a killed write's), copied files this conversion did not write, and leftover temporary files.
        A process that mapped a removed file keeps its pages."""
        for p in self.dir.iterdir():
            stale = p.name.startswith(_TMP_PREFIX) and p.name.endswith(_TMP_SUFFIX) or p.name in COPIED or \
                _is_data_file(p.name)
            if stale and p.name not in keep and p.is_file():
                try:
                    p.unlink()
                except OSError:  # gone meanwhile, or not ours to remove: the checkpoint is whole either way
                    pass


@dataclass
class APCheckpoint:
    """A loaded AP checkpoint: manifest tables in memory, its planes file memory-mapped read-only.

    The mapping stays valid when a later conversion into the directory replaces the checkpoint; the dense weights
    and `planes_file` are opened by name, so after such a replacement they are missing (APFormatError /
    FileNotFoundError): open the checkpoint again."""

    dir: Path
    manifest: dict[str, Any]
    blocks: list[BlockEntry]
    sensitivity: np.ndarray  # float64 [n_blocks, P+1]: s_i^b (index b; entries < seed unused)
    raw_bytes: np.ndarray  # int64 [n_blocks, P+1]: M_i^b in raw bytes (index b; entries < seed unused)
    routing_mass: np.ndarray  # float64 [L, E]
    _map: np.memmap = field(repr=False)

    @property
    def planes_file(self) -> Path:
        return self.dir / self.manifest.get("planes_file", PLANES)

    @property
    def dense_file(self) -> Path:
        return self.dir / self.manifest.get("dense_file", DENSE)

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
        """Byte offset of plane p of block i in the planes file."""
        return self.blocks[i].plane_offsets[p]

    def lut_offset(self, i: int, b: int) -> int:
        """Byte offset of LUT_b of block i in the planes file."""
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

        path = self.dense_file
        try:
            return load_file(str(path))
        except Exception as exc:  # safetensors raises its own error types for damaged headers
            if not path.exists():
                raise APFormatError(path, f"missing ({REPLACED})") from exc
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


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def load_ap(ap_dir: str | Path, verify: bool = True) -> APCheckpoint:
    """Open an AP checkpoint; sizes are always checked, blake2b checksums too when `verify`.

    A conversion that commits into the directory while this opens it (its manifest renamed in, the files it
    superseded removed) makes the open start over from the new manifest: the files read are always the ones the
    manifest read names."""
    ap_dir = Path(ap_dir)
    for attempt in range(3):
        stamp = _stamp(ap_dir / MANIFEST)
        try:
            return _load_ap(ap_dir, verify)
        except APFormatError:
            if attempt == 2 or _stamp(ap_dir / MANIFEST) in (stamp, None):
                raise
    raise AssertionError("unreachable")


def _load_ap(ap_dir: Path, verify: bool) -> APCheckpoint:
    man = read_manifest(ap_dir / MANIFEST)
    try:
        listed = [(str(f["name"]), int(f["size"]), f["blake2b"]) for f in man["files"]]
        planes_name = man.get("planes_file", PLANES)
        for key, name in (("planes_file", planes_name), ("dense_file", man.get("dense_file", DENSE))):
            if name not in {n for n, _, _ in listed}:
                raise ValueError(f"{key} {name!r} is not among its files")
    except (KeyError, TypeError, ValueError) as exc:
        raise APFormatError(ap_dir / MANIFEST, f"bad manifest body ({type(exc).__name__}: {exc})") from exc
    for name, expect, digest in listed:
        path = ap_dir / name
        try:
            size = path.stat().st_size
            if size != expect:
                raise APFormatError(path, f"size {size} bytes, manifest says {expect} (truncated or replaced)")
            if verify and _blake2b_file(path) != digest:
                raise APFormatError(path, "checksum mismatch (blake2b differs from the manifest)")
        except FileNotFoundError:
            raise APFormatError(path, "missing") from None
    planes_path = ap_dir / planes_name
    try:
        blocks = [BlockEntry(b["layer"], b["expert"], b["kind"], b["n"], b["k"], b["plane_offsets"],
                             b["lut_offsets"]) for b in man["blocks"]]
        tables = {k: _unpack_array(man["tables"][k]) for k in ("sensitivity", "raw_bytes", "routing_mass")}
        size = next(expect for name, expect, _ in listed if name == planes_name)
        _check_layout(man, blocks, tables, size, planes_name)
    except (KeyError, TypeError, ValueError) as exc:  # a self-consistent manifest of another layout or writer
        raise APFormatError(ap_dir / MANIFEST, f"bad manifest body ({type(exc).__name__}: {exc})") from exc
    try:
        mm = np.memmap(planes_path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    except FileNotFoundError:  # removed since it was checked: a later conversion committed (load_ap starts over)
        raise APFormatError(planes_path, f"missing ({REPLACED})") from None
    if len(mm) != size:  # replaced under its name since it was checked
        raise APFormatError(planes_path, f"size {len(mm)} bytes, manifest says {size} (truncated or replaced)")
    return APCheckpoint(ap_dir, man, blocks, tables["sensitivity"], tables["raw_bytes"], tables["routing_mass"], mm)


def _check_layout(man: dict[str, Any], blocks: list[BlockEntry], tables: dict[str, np.ndarray], size: int,
                  planes_name: str = PLANES) -> None:
    """The manifest's blocks are every (layer, expert, kind) once, in the writer's order, their planes and LUTs lie
    inside the planes file (`size` bytes), and its tables have a row per block (a ValueError naming the first that
    does not)."""
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
            raise ValueError(f"block {i}: planes or LUTs beyond {planes_name}'s {size} bytes")
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
        raise APFormatError(ap.dense_file, f"dense weights do not fit the model ({exc})") from exc
    model.tie_weights()
    return model.eval()
