"""Bit-plane layout of one expert linear block (kernels read exactly this).

A block's parent indices `idx: uint8 [N, K]` (P bits each) become `planes: uint32 [P, W, N]`, W = ceil(K/32):
plane-major so that the b-bit weights are the prefix planes[:b]; word-major inside a plane so that a warp of
consecutive rows reads consecutive words (coalesced). Bit j (LSB = 0) of planes[p, w, n] is bit (P-1-p) of
idx[n, 32*w + j] (plane 0 = MSB); padding columns are index 0. The b-bit index is idx >> (P - b).
LUTs are `float16 [2^b, N]` (transposed, entry c of row n at [c, n]).
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

WORD_BITS = 32


def num_words(k: int) -> int:
    """32-bit words per row of one plane (the last one padded with zero indices)."""
    return (k + WORD_BITS - 1) // WORD_BITS


def plane_bytes(n: int, k: int) -> int:
    """Raw bytes of one plane of an [N, K] block."""
    return 4 * num_words(k) * n


def lut_bytes(n: int, b: int) -> int:
    """Raw bytes of the fp16 LUT of width b of an N-row block."""
    return 2 * (1 << b) * n


def _as_tensor(x: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Zero-copy torch view; read-only numpy views (the checkpoint's memory map) are only read here."""
    if isinstance(x, torch.Tensor):
        return x
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writ.*")
        return torch.from_numpy(np.asarray(x))


def pack_planes(idx: torch.Tensor | np.ndarray, P: int) -> torch.Tensor:
    """Pack parent indices `uint8 [N, K]` (values < 2^P) into `uint32 [P, W, N]` on idx's device."""
    idx = _as_tensor(idx)
    if idx.dim() != 2 or not 1 <= P <= 8:
        raise ValueError(f"pack_planes wants idx [N, K] and 1 <= P <= 8, got shape {tuple(idx.shape)}, P={P}")
    n, k = idx.shape
    w = num_words(k)
    padded = torch.zeros(n, w * WORD_BITS, dtype=torch.int64, device=idx.device)
    padded[:, :k] = idx.to(torch.int64)
    if k and int(padded.max()) >= (1 << P):
        raise ValueError(f"index {int(padded.max())} does not fit in {P} bits")
    padded = padded.view(n, w, WORD_BITS)
    weights = torch.arange(WORD_BITS, device=idx.device, dtype=torch.int64)
    words = torch.empty(P, w, n, dtype=torch.int32, device=idx.device)
    for p in range(P):  # one plane at a time keeps the int64 scratch at N*K*8 bytes
        plane = (((padded >> (P - 1 - p)) & 1) << weights).sum(-1)  # [N, W], values in [0, 2^32)
        words[p] = torch.where(plane >= 1 << 31, plane - (1 << 32), plane).t()
    return words.view(torch.uint32)


def unpack_planes(planes: torch.Tensor | np.ndarray, K: int, b: int | None = None) -> torch.Tensor:
    """Exact inverse of pack_planes on the prefix planes[:b]: returns the b-bit indices `uint8 [N, K]`.

    Only the first b planes are read, so a caller may pass just those (the resident prefix).
    """
    planes = _as_tensor(planes)
    b = planes.shape[0] if b is None else b
    if not 1 <= b <= planes.shape[0] or planes.shape[1] != num_words(K):
        raise ValueError(f"unpack_planes: planes {tuple(planes.shape)} cannot give K={K} at b={b}")
    bitpos = torch.arange(WORD_BITS, device=planes.device, dtype=torch.int64)
    n = planes.shape[2]
    idx = torch.zeros(n, K, dtype=torch.int64, device=planes.device)
    for p in range(b):  # int64 keeps the top bit of a word positive
        words = planes[p].view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [W, N]
        bits = ((words.t().unsqueeze(-1) >> bitpos) & 1).reshape(n, -1)[:, :K]  # [N, K]
        idx |= bits << (b - 1 - p)
    return idx.to(torch.uint8)


def dequantize(planes: torch.Tensor | np.ndarray, lut_b: torch.Tensor | np.ndarray, b: int, K: int) -> torch.Tensor:
    """W_b[n, k] = lut_b[idx[n, k] >> (P - b), n] as float32 [N, K]; the one dequantizer every twin reuses."""
    lut_b = _as_tensor(lut_b)
    idx = unpack_planes(planes, K, b).to(torch.int64)
    if lut_b.shape[0] != 1 << b or lut_b.shape[1] != idx.shape[0]:
        raise ValueError(f"dequantize: LUT {tuple(lut_b.shape)} does not match b={b}, N={idx.shape[0]}")
    lut = lut_b.to(device=idx.device, dtype=torch.float32).t()  # [N, 2^b]
    return torch.gather(lut, 1, idx)
