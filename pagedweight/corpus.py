"""Training / calibration / evaluation text built from what every machine already has.

No data set can be downloaded on these machines, so the corpus is Python source: the running
interpreter's standard library (PSF licence) plus, where more text is wanted, installed
site-packages whose distribution metadata declares a permissive licence (MIT / BSD / Apache / PSF,
nothing copyleft). Every file is assigned to a split by a hash of its *relative* path, so the same
file lands in the same split on every machine and Python version. The calibration and evaluation
slices are committed under data/ (stdlib files only, so they are PSF text); the training split is
rebuilt on whichever machine trains and never contains a path that hashes outside "train".
The prose slice (data/eval_prose.txt) is Python's own documentation topics (`pydoc_data.topics`),
a different domain for distribution-shift checks.
"""
from __future__ import annotations

import hashlib
import importlib.metadata as metadata
import json
import platform
import re
import sysconfig
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

SPLITS = ("train", "calib", "eval")
# Hash buckets out of 1000: calib and eval take 4% each of the path space, train the rest.
_BUCKETS = {"calib": range(0, 40), "eval": range(40, 80)}
MAX_FILE_BYTES = 400_000          # skip generated tables / giant test data files
SLICE_SEPARATOR = "\n\n\n"        # between files inside a committed slice
# the repository's data/ (source tree, editable install), else the copy a wheel installs as pagedweight/data
_HERE = Path(__file__).resolve().parent
DATA_DIR = _HERE.parent / "data" if (_HERE.parent / "data" / "calib.txt").is_file() else _HERE / "data"

_PERMISSIVE = re.compile(r"\b(MIT|BSD|0BSD|Apache|PSF|Python Software Foundation|ISC|Zlib|CNRI-Python|Unlicense|"
                         r"CC0|BSL-1\.0|Boost)\b", re.I)
_COPYLEFT = re.compile(r"(GPL|MPL|Mozilla|GNU|EPL|Eclipse|CDDL|EUPL|OSL|Commons Clause|SSPL|Proprietary)", re.I)


@dataclass(frozen=True)
class SourceFile:
    """One corpus file: `rel` is the machine-independent key ("stdlib/json/decoder.py")."""

    rel: str
    path: Path
    licence: str


def split_of(rel: str) -> str:
    """Deterministic split of a relative path (blake2b, so it is stable across machines and runs)."""
    bucket = int.from_bytes(hashlib.blake2b(rel.encode(), digest_size=8).digest(), "little") % 1000
    for name, rng in _BUCKETS.items():
        if bucket in rng:
            return name
    return "train"


def licence_of(dist: metadata.Distribution) -> str:
    """The licence words a distribution declares (expression, short licence field, classifiers)."""
    meta = dist.metadata
    parts = [meta.get("License-Expression") or ""]
    lic = (meta.get("License") or "").strip()
    if lic:
        parts.append(lic.splitlines()[0][:200])  # some dists paste the full text: its first line names it
    parts += [c.split("::")[-1].strip() for c in (meta.get_all("Classifier") or []) if c.startswith("License ::")]
    return " | ".join(p for p in parts if p)


def is_permissive(licence: str) -> bool:
    """Keep MIT/BSD/Apache/PSF-family text; reject anything naming a copyleft or unknown licence."""
    return bool(_PERMISSIVE.search(licence)) and not _COPYLEFT.search(licence)


def _readable(path: Path) -> bool:
    try:
        return path.is_file() and path.stat().st_size <= MAX_FILE_BYTES
    except OSError:
        return False


def stdlib_files() -> list[SourceFile]:
    """Every .py file of the running interpreter's stdlib, site-/dist-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in ("site-packages", "dist-packages") or not _readable(path):
            continue
        out.append(SourceFile("stdlib/" + rel.as_posix(), path, "PSF-2.0"))
    return out


def site_package_files() -> list[SourceFile]:
    """.py files of installed distributions whose metadata declares a permissive licence."""
    seen: set[str] = set()
    out = []
    dists = sorted(metadata.distributions(), key=lambda d: (d.metadata.get("Name") or "").lower())
    for dist in dists:
        licence = licence_of(dist)
        if not is_permissive(licence) or not dist.files:
            continue
        for f in dist.files:
            rel = "site-packages/" + f.as_posix()
            if not rel.endswith(".py") or rel in seen or "/../" in rel:
                continue
            path = Path(dist.locate_file(f))
            if _readable(path):
                seen.add(rel)
                out.append(SourceFile(rel, path, licence))
    return sorted(out, key=lambda s: s.rel)


def read_text(src: SourceFile) -> str | None:
    """File text, or None when it is not valid UTF-8 (the stdlib keeps a few deliberately broken files)."""
    try:
        return src.path.read_bytes().decode("utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def files_for(split: str, include_site_packages: bool = False, include_tests: bool = True) -> list[SourceFile]:
    """The files of one split. `include_tests=False` drops test packages (for the committed slices)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    files = stdlib_files() + (site_package_files() if include_site_packages else [])
    if not include_tests:
        files = [f for f in files if not _is_test(f.rel)]
    return [f for f in files if split_of(f.rel) == split]


def _is_test(rel: str) -> bool:
    parts = rel.split("/")
    return any(p in ("test", "tests", "idle_test") or p.startswith("test_") for p in parts)


def build_slice(split: str, max_bytes: int) -> tuple[str, list[str]]:
    """Committed-slice text: stdlib non-test files of `split` in path order, whole files, <= max_bytes of UTF-8."""
    chunks, rels, size = [], [], 0
    for src in files_for(split, include_site_packages=False, include_tests=False):
        text = read_text(src)
        if not text or not text.strip():
            continue
        add = len(text.encode()) + (len(SLICE_SEPARATOR) if chunks else 0)
        if size + add > max_bytes:
            continue  # a smaller later file may still fit; path order keeps it deterministic
        chunks.append(text)
        rels.append(src.rel)
        size += add
    return SLICE_SEPARATOR.join(chunks), rels


def prose_slice(max_bytes: int) -> str:
    """English prose from Python's own documentation (pydoc topics), topics in sorted order, <= max_bytes."""
    from pydoc_data.topics import topics

    chunks, size = [], 0
    for key in sorted(topics):
        text = topics[key].strip()
        add = len(text.encode()) + 2
        if size + add > max_bytes:
            break
        chunks.append(text)
        size += add
    return "\n\n".join(chunks) + "\n"


def training_documents(include_site_packages: bool, max_bytes: int | None = None,
                       max_package_share: float = 0.15) -> list[tuple[str, str]]:
    """(rel, text) for train-split files: the whole stdlib first, then site-packages, each in path-hash order.

    With `max_bytes`, the text stops there and no single site-packages top-level package takes more than
    `max_package_share` of it (transformers alone would otherwise be a pile of near-identical model files).
    """
    def order(src: SourceFile) -> tuple[bool, bytes]:
        digest = hashlib.blake2b(b"order:" + src.rel.encode(), digest_size=8).digest()
        return src.rel.startswith("site-packages/"), digest

    docs, size, per_pkg = [], 0, Counter()
    for src in sorted(files_for("train", include_site_packages=include_site_packages), key=order):
        pkg = src.rel.split("/")[1] if src.rel.startswith("site-packages/") else None
        if max_bytes is not None and pkg is not None and per_pkg[pkg] >= max_package_share * max_bytes:
            continue
        text = read_text(src)
        if not text or not text.strip():
            continue
        docs.append((src.rel, text))
        size += len(text)
        if pkg is not None:
            per_pkg[pkg] += len(text)
        if max_bytes is not None and size >= max_bytes:
            break
    return docs


def write_slices(data_dir: Path = DATA_DIR, max_bytes: int = 1_000_000) -> dict[str, list[str]]:
    """(Re)write data/calib.txt, data/eval.txt and data/eval_prose.txt; returns the files of each slice."""
    data_dir.mkdir(parents=True, exist_ok=True)
    manifest = {}
    for split in ("calib", "eval"):
        text, rels = build_slice(split, max_bytes)
        (data_dir / f"{split}.txt").write_text(text, encoding="utf-8")
        manifest[split] = rels
    (data_dir / "eval_prose.txt").write_text(prose_slice(max_bytes), encoding="utf-8")
    record = dict(python=platform.python_version(), max_bytes=max_bytes, separator=SLICE_SEPARATOR, **manifest)
    (data_dir / "slices.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return manifest


def slice_manifest(data_dir: Path = DATA_DIR) -> dict:
    """data/slices.json: the Python version the slices came from and the relative paths in each."""
    return json.loads((data_dir / "slices.json").read_text(encoding="utf-8"))


def load_slice(name: str, data_dir: Path = DATA_DIR) -> str:
    """A committed slice by name: "calib", "eval" or "eval_prose"."""
    return (data_dir / f"{name}.txt").read_text(encoding="utf-8")
