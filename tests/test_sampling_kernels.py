"""The nucleus cut kernel (cuda/sampling_kernels.py) against its sort-based torch twin, and the sampler with it
against the sampler's sort: the same kept tokens (rows with a top-k among them), so with the same seeds the same
draws.

The kernel runs under the CUDA simulator in a child process (NUMBA_ENABLE_CUDASIM must be set before numba.cuda is
imported); a second child compiles it to sm_90 PTX with the argument types the launcher builds. With
PAGEDWEIGHT_TEST_DEVICE=cuda the same comparisons run on the GPU at a real vocabulary (151,936).

The twin computes each token's mass with torch's float32 exp where the kernel calls CUDA's (or, under the simulator,
Python's double exp rounded to float32): they may differ by an ulp, which moves a cut only if the running mass lands
within such an ulp of the target, not on these inputs (the comparison is exact, and it fails if it ever happens).
"""
from __future__ import annotations

import dataclasses
import os
import re
import textwrap

import pytest

from helpers import COMPILE_RECORDED, KERNEL_RECORDER, child_fixture

DEVICE = os.environ.get("PAGEDWEIGHT_TEST_DEVICE", "cpu")

COMPARE = textwrap.dedent(r"""
    import torch
    from pagedweight import sampling
    from pagedweight.cuda import sampling_kernels as sk
    from pagedweight.cuda.reference import top_p_cut_reference
    from pagedweight.sampling import SamplingParams, sample_rows

    def rows(device, R, V, seed):
        # spreads from flat (most of the vocabulary in the nucleus) to peaked (a few tokens), masked tokens (min-p),
        # a block of ties at the top, a row whose top is its only finite logit, and one with nothing finite
        g = torch.Generator().manual_seed(seed)
        spread = torch.tensor([0.05, 0.5, 1.0, 2.0, 4.0, 8.0, 1.0, 1.0, 1.0, 3.0])[torch.arange(R) % 10]
        x = torch.randn(R, V, generator=g) * spread[:, None]
        x[1, ::3] = float("-inf")
        x[6, : V // 10] = 4.0
        x[7] = float("-inf")
        x[7, V // 2] = 0.5
        # two adjacent floats of equal mass (exp(-1.5e-8) is 1.0 in float32) and top_p 0.5: the running mass meets
        # the target exactly at the first, which alone is kept (their keys part in the last byte, mid-chunk)
        x[4] = float("-inf")
        x[4, 5] = 0.2
        x[4, 9] = torch.nextafter(x[4, 5], torch.tensor(-1.0))
        if R > 8:
            x[8] = float("-inf")
        p = torch.tensor([0.9, 0.5, 0.95, 0.1, 0.9, 0.999, 0.3, 0.9, 0.9, 1e-4])[torch.arange(R) % 10]
        p[4] = 0.5
        p[R - 1] = 1.0  # keeps everything
        return x.to(device), p.to(device)

    def kept_mass(x, cut):
        # float64 probabilities: the nucleus's mass, and its mass without the tokens tied at the cut
        prob = torch.softmax(x.double(), dim=-1)
        keep = x >= cut[:, None]
        above = x > cut[:, None]
        return (prob * keep).sum(-1), (prob * above).sum(-1)

    def compare(device, R, V, seed, draws):
        x, p = rows(device, R, V, seed)
        cut = sk.top_p_cut(x, p)
        want = top_p_cut_reference(x, p)
        finite = torch.isfinite(x).any(-1)
        inside, strictly = kept_mass(x, cut)
        ok = finite & (p < 1.0)
        # the same with 3 candidates held: rows whose cut's fine bin holds more read the row in place
        out = dict(equal=bool(torch.equal(cut, want)), cut=cut.tolist(), want=want.tolist(),
                   in_place=bool(torch.equal(sk.top_p_cut(x, p, cap=3), want)),
                   # the nucleus holds top_p of the mass, and would not without its lowest logit's tokens
                   holds=bool((inside[ok] >= p[ok].double() - 1e-6).all()),
                   minimal=bool((strictly[ok] < p[ok].double() + 1e-6).all()),
                   all_kept=bool((cut[~ok] == float("-inf")).all()), dtype=str(cut.dtype), shape=list(cut.shape))
        # the sampler, seeded rows: the kernel's path against the sort's (the same noise over the same kept tokens),
        # but for rows 6 and 8, whose cut falls in a block of ties (the kernel keeps all of them, the sort some);
        # every third row also has a top-k (on the kernel's path a threshold, the k-th largest logit)
        untied = torch.tensor([i not in (6, 8) for i in range(R)], device=x.device)
        same = 0
        for s in range(draws):
            params = [SamplingParams(temperature=1.0, top_p=float(q), top_k=50 if i % 3 == 0 else 0,
                                     seed=s * 100 + i) for i, q in enumerate(p.tolist())]
            logits = x.clone()
            logits[8:9] = 0.0  # every row needs a finite logit to sample
            gens = lambda: [sampling.make_generator(q.seed, logits.device) for q in params]
            with_kernel = sample_rows(logits, params, gens(), nucleus_kernel=True)
            with_sort = sample_rows(logits, params, gens(), nucleus_kernel=False)
            same += int(torch.equal(with_kernel[untied], with_sort[untied]))
        out["draws_equal"] = [same, draws]
        return out
""")

SIM_CHILD = COMPARE + textwrap.dedent(r"""
    import json, sys
    torch.set_num_threads(1)
    # V = 700: three rounds of a 64-thread block's 4 loads, the last one partial
    # the sampler's draws on one seed's rows (each kernel call is ~10 s under the simulator); one seed a child (SEED)
    seed = SEED
    json.dump({f"sim/{seed}": compare("cpu", 10, 700, seed, draws=2 if seed == 0 else 0)}, sys.stdout)
""")

COMPILE_CHILD = COMPARE + textwrap.dedent(r"""
    import numba
    torch.set_num_threads(1)
    from unittest import mock
    kernels = sk
    sigs = {name: [] for name in ("_fine_hist_kernel", "_gather_kernel", "_cut_kernel")}

    %(recorder)s

    from pagedweight.cuda import launcher as lm
    with mock.patch.multiple(sk, SIMULATOR=True, **{name: Recorder(name) for name in sigs}), \
            mock.patch.multiple(lm, SIMULATOR=True, _dev=lambda t: t.detach().numpy()):
        x, p = rows("cpu", 10, 300, 0)
        sk.top_p_cut(x, p)
""") % {"recorder": KERNEL_RECORDER} + COMPILE_RECORDED


def check(r: dict) -> None:
    assert r["equal"] and r["in_place"], (r["cut"], r["want"])
    assert r["holds"] and r["minimal"] and r["all_kept"], r
    assert r["dtype"] == "torch.float32" and r["shape"] == [len(r["want"])]
    assert r["draws_equal"][0] == r["draws_equal"][1], r["draws_equal"]  # [0, 0] where none were drawn


sim = child_fixture(__name__, "sim", [f"SEED = {seed}\n" + SIM_CHILD for seed in (0, 1)], timeout=900,
                    NUMBA_ENABLE_CUDASIM="1")


@pytest.mark.parametrize("seed", [0, 1])
def test_nucleus_cut_matches_its_twin_under_simulator(sim: dict, seed: int) -> None:
    r = sim[f"sim/{seed}"]
    check(r)
    # top_p 1 keeps all; a lone finite logit; the exact meeting keeps 0.2 alone, not its neighbour below
    assert r["want"][-1] == float("-inf") and r["want"][7] == 0.5 and r["want"][4] > 0.19999999, r["want"]


def test_twin_keeps_what_the_sorted_rule_keeps() -> None:
    """The twin's cut against the sampler's own sorted rule (a token stays while the mass before it is below top_p),
    on rows without ties: the same kept tokens."""
    import torch

    from pagedweight.cuda.reference import top_p_cut_reference

    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 500, generator=g) * torch.linspace(0.1, 6.0, 64)[:, None]
    p = torch.rand(64, generator=g).clamp(0.01, 0.99)
    values, _ = x.sort(dim=-1, descending=True)
    prob = torch.softmax(values.double(), dim=-1)
    kept = (prob.cumsum(-1) - prob) < p[:, None].double()
    sorted_cut = values.masked_fill(~kept, float("inf")).amin(dim=-1)
    assert torch.equal(top_p_cut_reference(x, p), sorted_cut)


def test_sampler_on_the_kernels_path_draws_what_the_sort_draws(monkeypatch) -> None:
    """The sampler's nucleus-cut path (top-k as a threshold, the cut, the mask) with the twin standing in for the
    kernel, on the CPU: rows mixing top-k and top-p, top-p alone, top-k alone, min-p, and neither draw, seeded, what
    the sort draws; the path is taken only while some row lacks a top-k and none is wider than the threshold's."""
    import torch

    from pagedweight import sampling
    from pagedweight.cuda import reference, sampling_kernels

    calls = []
    monkeypatch.setattr(sampling_kernels, "top_p_cut", lambda x, p: calls.append(len(p)) or
                        reference.top_p_cut_reference(x, p))
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(12, 3000, generator=g) * torch.linspace(0.3, 5.0, 12)[:, None]
    fields = [dict(top_k=40, top_p=0.9), dict(top_p=0.8), dict(top_k=7), dict(), dict(top_k=1000, top_p=0.5),
              dict(min_p=0.1, top_p=0.95)]
    params = [sampling.SamplingParams(temperature=1.0, seed=i, **fields[i % len(fields)]) for i in range(12)]

    def draws(kernel: bool, ps: list) -> list[int]:
        return [sampling.sample_rows(logits, ps, [sampling.make_generator(p.seed + 100 * s, "cpu") for p in ps],
                                     nucleus_kernel=kernel).tolist() for s in range(20)]

    assert draws(True, params) == draws(False, params) and calls == [12] * 20
    for wide in ([dataclasses.replace(p, top_k=p.top_k and 1025) for p in params],  # a top-k past the threshold's
                 [dataclasses.replace(p, top_k=p.top_k or 9) for p in params]):  # every row with a top-k
        calls.clear()
        assert draws(True, wide) == draws(False, wide) and not calls
    # the threshold's columns are priced: fewer rows a chunk than plain top-p, more than the sort
    vocab = 151936
    price = [sampling._chunk_rows(vocab, [sampling.SamplingParams(temperature=1.0, top_p=0.9, top_k=k),
                                          sampling.SamplingParams(temperature=1.0, top_p=0.9)], False, False, True)
             for k in (0, 1024, 1025)]
    assert price[0] > price[1] > price[2], price


compiled = child_fixture(__name__, "compiled", [COMPILE_CHILD], timeout=600, NUMBA_ENABLE_CUDASIM="0")


def test_nucleus_cut_compiles_to_sm90_ptx(compiled: dict) -> None:
    assert sorted(compiled) == ["_cut_kernel", "_fine_hist_kernel", "_gather_kernel"], sorted(compiled)
    for name, runs in compiled.items():
        (r,) = runs
        assert r["target"] == ["sm_90"] and r["resty"] == "none" and len(r["entries"]) == 1, r
        assert re.search(rf"16sampling_kernels{len(name)}{name}B", r["entries"][0]), r


def test_nucleus_cut_refuses_what_it_cannot_take() -> None:
    import torch

    from pagedweight.cuda import sampling_kernels as sk

    with pytest.raises(ValueError, match="float32 logits"):
        sk.top_p_cut(torch.zeros(2, 8, dtype=torch.float16), torch.ones(2))


@pytest.mark.skipif(DEVICE != "cuda", reason="the kernel on the GPU: PAGEDWEIGHT_TEST_DEVICE=cuda (run on the H200)")
@pytest.mark.parametrize("rows", [10, 32])
def test_nucleus_cut_matches_its_twin_on_gpu(rows: int) -> None:
    ns: dict = {}
    exec(COMPARE, ns)
    check(ns["compare"]("cuda", rows, 151936, 0, draws=4))
