"""Bit-plane packing: exact layout against a per-bit reference, round trip and the prefix property."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedweight.bitplanes import dequantize, num_words, pack_planes, unpack_planes

torch.set_num_threads(1)

shapes = st.tuples(st.integers(1, 9), st.integers(1, 130), st.integers(1, 8), st.integers(0, 2**31 - 1))


def _random_idx(n: int, k: int, p: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 1 << p, (n, k), dtype=np.uint8))


def _reference_planes(idx: np.ndarray, p_bits: int) -> np.ndarray:
    """SPEC layout written out bit by bit: bit j of planes[p, w, n] = bit (P-1-p) of idx[n, 32w + j]."""
    n, k = idx.shape
    out = np.zeros((p_bits, num_words(k), n), dtype=np.uint64)
    for p in range(p_bits):
        for col in range(k):
            bit = (idx[:, col].astype(np.uint64) >> np.uint64(p_bits - 1 - p)) & np.uint64(1)
            out[p, col // 32] |= bit << np.uint64(col % 32)
    return out.astype(np.uint32)


@settings(max_examples=40, deadline=None)
@given(shapes)
def test_layout_matches_bitwise_reference(shape):
    n, k, p, seed = shape
    idx = _random_idx(n, k, p, seed)
    planes = pack_planes(idx, p)
    assert planes.dtype == torch.uint32 and tuple(planes.shape) == (p, num_words(k), n)
    np.testing.assert_array_equal(planes.numpy(), _reference_planes(idx.numpy(), p))


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_round_trip_and_prefix_property(shape):
    n, k, p, seed = shape
    idx = _random_idx(n, k, p, seed)
    planes = pack_planes(idx, p)
    assert torch.equal(unpack_planes(planes, k), idx)
    for b in range(1, p + 1):
        expect = idx >> (p - b)
        assert torch.equal(unpack_planes(planes, k, b), expect)
        assert torch.equal(unpack_planes(planes[:b].clone(), k, b), expect)  # only the prefix is needed


def test_full_words_and_top_bit():
    """K a multiple of 32 and every bit set: the sign bit of a 32-bit word must survive."""
    idx = torch.full((3, 64), 255, dtype=torch.uint8)
    planes = pack_planes(idx, 8)
    assert int(planes.view(torch.int32)[0, 0, 0]) == -1
    assert torch.equal(unpack_planes(planes.numpy(), 64), idx)  # numpy views (the checkpoint map) work too


@settings(max_examples=25, deadline=None)
@given(shapes)
def test_dequantize_reads_lut_by_prefix(shape):
    n, k, p, seed = shape
    idx = _random_idx(n, k, p, seed)
    planes = pack_planes(idx, p)
    rng = np.random.default_rng(seed + 1)
    for b in range(1, p + 1):
        lut = torch.from_numpy(rng.standard_normal((1 << b, n)).astype(np.float16))
        got = dequantize(planes, lut, b, k)
        ib = (idx.numpy() >> (p - b)).astype(np.int64)
        expect = lut.numpy().astype(np.float32)[ib, np.arange(n)[:, None]]
        np.testing.assert_array_equal(got.numpy(), expect)
