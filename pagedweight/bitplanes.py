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


# bit j of byte value v (little-endian words: byte m of word w holds columns 32w + 8m .. 32w + 8m + 7)
_BYTE_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).to(torch.uint8)  # [256, 8]


def unpack_planes(planes: torch.Tensor | np.ndarray, K: int, b: int | None = None) -> torch.Tensor:
    """Exact inverse of pack_planes on the prefix planes[:b]: returns the b-bit indices `uint8 [N, K]`.

    Only the first b planes are read, so a caller may pass just those (the resident prefix). Each byte of a plane
    becomes its 8 bits by a table lookup (int32 indices): shifting every word through 32 positions in int64 made
    `dequantize` 2.3-3.6x slower on the bundled model's blocks and 6.5-23x on Qwen1.5-MoE's, one CPU core
    (reference_speed-cpu-2c-20261205-s39.json), and the bundled model's CPU engine 1.9x slower.
    """
    planes = _as_tensor(planes)
    b = planes.shape[0] if b is None else b
    if not 1 <= b <= planes.shape[0] or planes.shape[1] != num_words(K):
        raise ValueError(f"unpack_planes: planes {tuple(planes.shape)} cannot give K={K} at b={b}")
    w, n = planes.shape[1], planes.shape[2]
    raw = planes[:b].view(torch.int32).transpose(1, 2).reshape(-1).view(torch.uint8)  # [b, N, W] words' bytes
    bits = _BYTE_BITS.to(planes.device).index_select(0, raw.int()).view(b, n, w * WORD_BITS)[:, :, :K]  # [b, N, K]
    idx = bits[0].clone()
    for p in range(1, b):  # plane 0 is the MSB
        idx <<= 1
        idx |= bits[p]
    return idx


def dequantize(planes: torch.Tensor | np.ndarray, lut_b: torch.Tensor | np.ndarray, b: int, K: int) -> torch.Tensor:
    """W_b[n, k] = lut_b[idx[n, k] >> (P - b), n] as float32 [N, K]; the one dequantizer every twin reuses."""
    lut_b = _as_tensor(lut_b)
    idx = unpack_planes(planes, K, b)
    n = idx.shape[0]
    if lut_b.shape[0] != 1 << b or lut_b.shape[1] != n:
        raise ValueError(f"dequantize: LUT {tuple(lut_b.shape)} does not match b={b}, N={n}")
    lut = lut_b.to(device=idx.device, dtype=torch.float32).t().reshape(-1)  # row n's entries at [n * 2^b, ...)
    rows = (torch.arange(n, dtype=torch.int32, device=idx.device) << b).unsqueeze(1)
    return lut.index_select(0, (idx.int() + rows).view(-1)).view(n, K)
