"""The corpus: deterministic path-hash splits, licence filter, committed slices disjoint from training."""
from __future__ import annotations

import platform
from collections import Counter

import pytest

from pagedweight import corpus


def test_split_is_deterministic_and_proportioned():
    rels = [f"stdlib/pkg{i // 50}/mod{i}.py" for i in range(20_000)]
    first = [corpus.split_of(r) for r in rels]
    assert first == [corpus.split_of(r) for r in rels]
    counts = Counter(first)
    # 4% / 4% / 92% of the hash space; binomial sd at n=20000 is ~0.14 percentage points
    assert abs(counts["calib"] / len(rels) - 0.04) < 0.008
    assert abs(counts["eval"] / len(rels) - 0.04) < 0.008
    assert counts["train"] + counts["calib"] + counts["eval"] == len(rels)


def test_split_known_values():
    # pinned so that a change of hash or buckets (which would silently move files between splits) fails here
    manifest = corpus.slice_manifest()
    assert corpus.split_of(manifest["calib"][0]) == "calib"
    assert corpus.split_of(manifest["eval"][0]) == "eval"
    assert corpus.split_of("stdlib/os.py") == "train"


@pytest.mark.parametrize("licence, ok", [
    ("MIT", True), ("BSD-3-Clause", True), ("Apache 2.0", True), ("PSF-2.0", True),
    ("Apache-2.0 OR BSD-2-Clause", True), ("MIT License | MIT License", True),
    ("MPL-2.0 AND MIT", False), ("GPLv2", False), ("LGPL-3.0-or-later", False),
    ("Mozilla Public License 2.0 (MPL 2.0)", False), ("", False), ("Proprietary", False),
])
def test_licence_filter(licence, ok):
    assert corpus.is_permissive(licence) is ok


def test_site_packages_are_permissive_only():
    files = corpus.site_package_files()
    assert files, "the venv has permissive packages (numpy, torch, ...)"
    assert all(corpus.is_permissive(f.licence) for f in files)
    names = {f.rel.split("/")[1] for f in files}
    assert "numpy" in names and "torch" in names
    assert "hypothesis" not in names and "certifi" not in names  # MPL-2.0


def test_committed_slices_are_small_disjoint_and_hash_consistent():
    manifest = corpus.slice_manifest()
    calib, ev = set(manifest["calib"]), set(manifest["eval"])
    assert calib and ev and not calib & ev
    assert all(corpus.split_of(r) == "calib" for r in calib)
    assert all(corpus.split_of(r) == "eval" for r in ev)
    for name in ("calib", "eval", "eval_prose"):
        text = corpus.load_slice(name)
        assert 100_000 < len(text.encode()) <= manifest["max_bytes"]
    assert "def " in corpus.load_slice("eval") and "import " in corpus.load_slice("calib")
    prose = corpus.load_slice("eval_prose")
    assert prose.count(" the ") > 1000 and "def " not in prose[:2000]


def test_training_split_excludes_committed_slices():
    manifest = corpus.slice_manifest()
    held_out = set(manifest["calib"]) | set(manifest["eval"])
    train_rels = {rel for rel, _ in corpus.training_documents(include_site_packages=False)}
    assert len(train_rels) > 1000
    assert not train_rels & held_out
    assert all(corpus.split_of(r) == "train" for r in train_rels)


def test_training_cap_is_a_uniform_sample():
    docs = corpus.training_documents(include_site_packages=False, max_bytes=2_000_000)
    size = sum(len(t) for _, t in docs)
    assert 2_000_000 <= size < 2_000_000 + corpus.MAX_FILE_BYTES
    top = Counter(rel.split("/")[1] for rel, _ in docs)
    assert len(top) > 20  # not just the alphabetically first packages


@pytest.mark.skipif(platform.python_version() != corpus.slice_manifest()["python"],
                    reason="committed slices were cut from another Python version's stdlib")
def test_slices_rebuild_identically(tmp_path):
    manifest = corpus.write_slices(tmp_path)
    for name in ("calib", "eval", "eval_prose"):
        assert (tmp_path / f"{name}.txt").read_text() == corpus.load_slice(name)
    assert manifest["calib"] == corpus.slice_manifest()["calib"]
