"""The paged decode attention kernel (cuda/attention_kernels.py) against its torch twin, and the twin against SDPA.

The kernel runs under the CUDA simulator in a child process (NUMBA_ENABLE_CUDASIM must be set before numba.cuda is
imported); a second child compiles it to sm_90 PTX with the argument types the launcher builds. With
PAGEDWEIGHT_TEST_DEVICE=cuda the same comparison runs on the GPU, with a pool view of the engine's strides.
"""
from __future__ import annotations

import os
import re
import textwrap

import pytest
import torch
import torch.nn.functional as F

from helpers import COMPILE_RECORDED, KERNEL_RECORDER, child_fixture
from pagedweight.cuda.reference import paged_decode_attention_reference

DEVICE = os.environ.get("PAGEDWEIGHT_TEST_DEVICE", "cpu")

# (B, H, Hkv, head_dim, block_size, M table blocks, dtype): GQA and MHA; head dims below THREADS (threads share a dim),
# at it, and above it (two dims per thread); one key only, a chunk boundary, several splits; 2, 3 and 8 query heads per
# KV head
CASES = [(2, 4, 2, 64, 16, 12, "float16"), (3, 2, 1, 16, 4, 40, "float32"), (1, 2, 2, 160, 8, 3, "float16"),
         (2, 2, 2, 128, 16, 17, "float16"), (2, 6, 2, 32, 8, 10, "float16"), (1, 16, 2, 64, 16, 9, "float32"),
         (2, 4, 2, 160, 8, 3, "float16")]

BUILD = textwrap.dedent(r"""
    import torch

    def build(B, H, Hkv, hd, bs, M, dtype, seed, device="cpu"):
        # a pool in the engine's layout: rows of more bytes than one layer's K/V, so the view is strided; rows own
        # disjoint random blocks; lengths random in [1, M * bs] (row 0: exactly 1 key, row 1: the whole table);
        # the keys past a row's length are NaN, which the kernel must never read
        g = torch.Generator().manual_seed(seed)
        dtype = getattr(torch, dtype)
        blocks, layer = B * M + 3, 2 * bs * Hkv * hd
        rows = torch.randn(blocks, layer + 8, generator=g).to(dtype)
        view = lambda r: r[:, :layer].view(blocks, 2, bs, Hkv, hd)
        tables = torch.randperm(blocks, generator=g)[:B * M].view(B, M)
        lengths = torch.randint(1, M * bs + 1, (B,), generator=g)
        lengths[0] = 1
        if B > 1:
            lengths[1] = M * bs
        clean = view(rows).clone()
        for b in range(B):
            for pos in range(int(lengths[b]), M * bs):
                view(rows)[tables[b, pos // bs], :, pos % bs] = float("nan")
        q = torch.randn(B, H, hd, generator=g).to(dtype)
        return tuple(t.to(device) for t in (q, view(rows.to(device)), clean, tables, lengths))

    def store_case(device):
        # store_kv against the torch path it replaces (stack, gather by source row, index_copy_ into the pool's token
        # rows [R, Hkv, hd]): 3 rows, the last a padding row that rewrites row 0's values into row 0's rows; v a
        # strided view, as in the model
        from pagedweight.cuda.attention_kernels import store_kv
        g = torch.Generator().manual_seed(8)
        rows = torch.randn(20, 2, 16, generator=g).half().to(device)
        before, want = rows.clone(), rows.clone()
        k = torch.randn(3, 2, 1, 16, generator=g).half().to(device)
        v = torch.randn(3, 1, 2 * 16 + 3, generator=g).half().to(device)[..., 3:].view(3, 1, 2, 16).transpose(1, 2)
        dst, src = (torch.tensor(a, device=device) for a in ([[17, 2, 17], [5, 9, 5]], [0, 1, 0]))
        want.index_copy_(0, dst.view(-1), torch.stack((k[:, :, 0], v[:, :, 0]))[:, src].flatten(0, 1))
        store_kv(k, v, rows, dst, src)
        return dict(equal=torch.equal(rows, want), touched=int((rows != before).sum()))
""")

# follows BUILD in the child, formatted with the cases and the child's part
SIM_CHILD = textwrap.dedent(r"""
    import json, sys
    torch.set_num_threads(1)
    from pagedweight.cuda.attention_kernels import paged_decode_attention
    from pagedweight.cuda.reference import paged_decode_attention_reference
    out = {}
    for i, case in enumerate(%(cases)r):
        if i %% 2 != %(part)d:  # the other child's case
            continue
        q, kv, clean, tables, lengths = build(*case, seed=i)
        hd = case[3]
        got = paged_decode_attention(q, kv, tables, lengths, hd ** -0.5)  # kv: the strided view of pool rows
        want = paged_decode_attention_reference(q, clean, tables, lengths, hd ** -0.5)
        out[f"case{i}"] = dict(dtype_ok=got.dtype == q.dtype, shape_ok=tuple(got.shape) == tuple(q.shape),
                               finite=bool(torch.isfinite(got).all()),
                               max_err=float((got.float() - want.float()).abs().max()))
    if %(part)d == 1:
        out["store_kv"] = store_case("cpu")
        from pagedweight.cuda import attention_kernels as ak
        out["supports"] = [ak.supports(torch.float16, 128, ak.MAX_KEYS), ak.supports(torch.float32, 64, 8192),
                           ak.supports(torch.float16, 128, ak.MAX_KEYS + 1), ak.supports(torch.bfloat16, 128, 8192),
                           ak.supports(torch.float16, 72, 8192), ak.supports(torch.float16, 2 * ak.MAX_HEAD_DIM, 8192)]
    json.dump(out, sys.stdout)
""")

COMPILE_CHILD = BUILD + textwrap.dedent(r"""
    import numba
    torch.set_num_threads(1)
    from unittest import mock
    from pagedweight.cuda import attention_kernels as kernels

    sigs = {"_split_kernel": [], "_split_wide1_kernel": [], "_split_wide2_kernel": [], "_combine_kernel": [],
            "_store_kernel": []}

    %(recorder)s

    # the launchers' own argument types (numpy views stand in for device arrays: numba.typeof agrees)
    from pagedweight.cuda import launcher as lm
    with mock.patch.multiple(kernels, **{name: Recorder(name) for name in sigs}), \
            mock.patch.multiple(lm, SIMULATOR=True, _dev=lambda t: t.detach().numpy()):  # `launch` through Numba
        for i, case in enumerate(%(cases)r):
            q, kv, _, tables, lengths = build(*case, seed=i)
            kernels.paged_decode_attention(q, kv, tables, lengths, case[3] ** -0.5)
        store_case("cpu")
""") % {"cases": CASES, "recorder": KERNEL_RECORDER} + COMPILE_RECORDED


def tol(dtype: str) -> float:
    return 2e-3 if dtype == "float16" else 1e-5


# the even cases and the odd ones (with store_kv) in two children side by side
sim = child_fixture(__name__, "sim", [BUILD + SIM_CHILD % {"cases": CASES, "part": part} for part in (0, 1)],
                    timeout=900, NUMBA_ENABLE_CUDASIM="1")


@pytest.mark.parametrize("i", range(len(CASES)))
def test_kernel_matches_twin_under_simulator(sim: dict, i: int) -> None:
    r = sim[f"case{i}"]
    assert r["dtype_ok"] and r["shape_ok"], r
    assert r["finite"], r  # it never read the NaN keys past a row's length
    assert r["max_err"] <= tol(CASES[i][-1]), r


def test_store_kv_writes_what_the_torch_path_writes(sim: dict) -> None:
    """Two distinct slots get both K and V (2 rows x 2 (k|v) x 2 heads x 16 dims); the padding row rewrites row 0's."""
    assert sim["store_kv"] == {"equal": True, "touched": 128}, sim["store_kv"]


def test_supports_names_what_the_kernel_takes(sim: dict) -> None:
    """fp16/fp32, head dims that are multiples of SUB up to MAX_HEAD_DIM, rows up to MAX_KEYS keys; else the torch
    path (the engine asks once, with the model's longest context)."""
    assert sim["supports"] == [True, True, False, False, False, False]


compiled = child_fixture(__name__, "compiled", [COMPILE_CHILD], timeout=600, NUMBA_ENABLE_CUDASIM="0")


def test_kernels_compile_to_sm90_ptx(compiled: dict) -> None:
    for name, runs in compiled.items():
        assert runs, f"{name}: the launcher never launched it"
        for r in runs:
            assert r["target"] == ["sm_90"] and r["resty"] == "none" and len(r["entries"]) == 1, r
            assert re.search(rf"17attention_kernels{len(name)}{name}B", r["entries"][0]), r


# (dtype, head dim, the view's first element, row length) -> (kernel, its pool argument's dtype, row length in it)
SPLIT_PICKS = [((torch.float16, 128, 0, 1032), ("_split_wide2_kernel", torch.int64, 258)),
               ((torch.float16, 64, 4, 1032), ("_split_wide1_kernel", torch.int64, 258)),
               ((torch.float16, 128, 2, 1032), ("_split_kernel", torch.float16, 1032)),  # not on a word
               ((torch.float16, 128, 0, 1030), ("_split_kernel", torch.float16, 1030)),  # rows not whole words
               ((torch.float32, 128, 0, 1032), ("_split_kernel", torch.float32, 1032)),
               ((torch.float16, 160, 0, 1032), ("_split_kernel", torch.float16, 1032)),
               ((torch.float16, 256, 0, 1032), ("_split_kernel", torch.float16, 1032))]


@pytest.mark.parametrize("case, want", SPLIT_PICKS)
def test_split_for_takes_the_wide_kernel_where_whole_words_hold_fp16_heads_of_64_or_128(case, want) -> None:
    """The wide kernels read fp16 K/V as 8-byte words: head dims 64 and 128, rows and the view's start in whole words
    (CASES 0 and 3 run them under the simulator and on the GPU, the others `_split_kernel`)."""
    from pagedweight.cuda import attention_kernels as ak

    dtype, hd, offset, row_len = case
    flat = torch.zeros(offset + 4 * row_len, dtype=dtype)[offset:]
    kernel, arg, n = ak.split_for(dtype, hd, flat, row_len)
    assert (kernel.py_func.__name__, arg.dtype, n) == want
    assert arg.data_ptr() == flat.data_ptr() and arg.numel() * arg.element_size() == flat.numel() * flat.element_size()


@pytest.mark.parametrize("i", range(len(CASES)))
def test_twin_matches_sdpa_on_gathered_keys(i: int) -> None:
    """The twin against torch's SDPA over each row's gathered keys under a length mask (the torch decode path)."""
    ns: dict = {}
    exec(BUILD, ns)
    B, H, Hkv, hd, bs, M, dtype = CASES[i]
    q, _, clean, tables, lengths = ns["build"](*CASES[i], seed=i)
    want = paged_decode_attention_reference(q, clean, tables, lengths, hd ** -0.5).float()
    keys = clean[tables].float()  # [B, M, 2, bs, Hkv, hd]
    k, v = (keys[:, :, j].reshape(B, M * bs, Hkv, hd).transpose(1, 2) for j in (0, 1))
    mask = (torch.arange(M * bs)[None, :] < lengths[:, None])[:, None, None, :]
    got = F.scaled_dot_product_attention(q.float()[:, :, None], k, v, attn_mask=mask, scale=hd ** -0.5,
                                         enable_gqa=H != Hkv)[:, :, 0]
    torch.testing.assert_close(got.to(q.dtype).float(), want, rtol=0, atol=tol(dtype))


@pytest.mark.parametrize("i", range(len(CASES)))
def test_twin_never_reads_past_a_rows_length(i: int) -> None:
    """The twin on the pool whose keys past each row's length are NaN gives what it gives on the clean pool, as the
    kernel does (it multiplied the masked values by 0: 0 x NaN)."""
    ns: dict = {}
    exec(BUILD, ns)
    hd = CASES[i][3]
    q, kv, clean, tables, lengths = ns["build"](*CASES[i], seed=i)
    got = paged_decode_attention_reference(q, kv, tables, lengths, hd ** -0.5)
    torch.testing.assert_close(got, paged_decode_attention_reference(q, clean, tables, lengths, hd ** -0.5),
                               rtol=0, atol=0)


@pytest.mark.parametrize("i", range(len(CASES)))
def test_gathered_decode_attention_in_slices_matches_the_twin(i: int, monkeypatch) -> None:
    """The engine's torch decode path (kv_cache.gathered_decode_attention: rows gathered whole, SDPA under the length
    mask) against the twin, whole and with GATHER_BYTES so small that every row is a slice of its own."""
    from pagedweight import kv_cache

    ns: dict = {}
    exec(BUILD, ns)
    B, H, Hkv, hd, bs, M, dtype = CASES[i]
    q, _, clean, tables, lengths = ns["build"](*CASES[i], seed=i)
    want = paged_decode_attention_reference(q, clean, tables, lengths, hd ** -0.5).float()
    mask = (torch.arange(M * bs)[None, :] < lengths[:, None])[:, None, None, :]
    calls, sdpa = [], kv_cache.sdpa
    monkeypatch.setattr(kv_cache, "sdpa", lambda q, *a: calls.append(q.shape[0]) or sdpa(q, *a))
    for limit in (kv_cache.GATHER_BYTES, 1):
        monkeypatch.setattr(kv_cache, "GATHER_BYTES", limit)
        got = kv_cache.gathered_decode_attention(q[:, :, None], clean, tables, mask, hd ** -0.5)[:, :, 0]
        torch.testing.assert_close(got.float(), want, rtol=0, atol=tol(dtype))
    assert calls == [B] + [1] * B  # whole, then a slice per row


@pytest.mark.skipif(DEVICE != "cuda", reason="the kernel on the GPU: PAGEDWEIGHT_TEST_DEVICE=cuda (run on the H200)")
def test_store_kv_on_gpu() -> None:
    ns: dict = {}
    exec(BUILD, ns)
    assert ns["store_case"]("cuda") == {"equal": True, "touched": 128}


@pytest.mark.skipif(DEVICE != "cuda", reason="the kernel on the GPU: PAGEDWEIGHT_TEST_DEVICE=cuda (run on the H200)")
@pytest.mark.parametrize("i", range(len(CASES)))
def test_kernel_matches_twin_on_gpu(i: int) -> None:
    from pagedweight.cuda.attention_kernels import paged_decode_attention

    ns: dict = {}
    exec(BUILD, ns)
    hd, dtype = CASES[i][3], CASES[i][-1]
    q, kv, clean, tables, lengths = ns["build"](*CASES[i], seed=i, device="cuda")
    assert not kv.is_contiguous()  # the engine's pool view
    got = paged_decode_attention(q, kv, tables, lengths, hd ** -0.5)
    want = paged_decode_attention_reference(q, clean, tables, lengths, hd ** -0.5)
    assert torch.isfinite(got).all()
    assert (got.float() - want.float()).abs().max().item() <= tol(dtype)
