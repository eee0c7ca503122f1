"""The fused layer kernels (cuda/layer_kernels.py) against the model's own torch ops, and a whole model with them on
against the same model without them.

The kernels run under the CUDA simulator in a child process (NUMBA_ENABLE_CUDASIM must be set before numba.cuda is
imported); a second child compiles them to sm_90 PTX with the argument types the launchers build. With
PAGEDWEIGHT_TEST_DEVICE=cuda the same comparisons run on the GPU.

What "equal" means here: ops that only multiply and add (RoPE, the residual add) round where torch rounds, so their
fp16 results are bit-identical; SiLU, sigmoid and softmax call exp, and the norm and softmax sum in another order, so
those may differ by an fp16 ulp on a few elements. In fp32 the GPU also contracts a * b + c into one FMA, so results
are compared to within 1e-6 of the largest value.
"""
from __future__ import annotations

import os
import re
import textwrap

import pytest

from helpers import COMPILE_RECORDED, KERNEL_RECORDER, child_fixture

DEVICE = os.environ.get("PAGEDWEIGHT_TEST_DEVICE", "cpu")

# Builds every kernel's inputs and compares the kernel with the torch ops it replaces; `compare(device)` returns a
# dict of metrics per case. Inputs are views like the model's: qkv and the router logits are slices of one
# projection's output (strided rows).
COMPARE = textwrap.dedent(r"""
    import torch
    import torch.nn.functional as F
    from pagedweight.cuda import layer_kernels as lk
    from pagedweight.models.layers import MoEBlock, RMSNorm, apply_rope, rope_cos_sin

    def ulps(got, want):
        # largest difference in units of the dtype's last place at want's magnitude (0 = bit-identical)
        got, want = got.float(), want.float()
        eps = torch.finfo(torch.float16).eps if want.dtype == torch.float16 else torch.finfo(torch.float32).eps
        scale = want.abs().clamp_min(torch.finfo(torch.float16).tiny) * eps
        return float(((got - want).abs() / scale).max())

    def stats(got, want):
        return dict(dtype=str(got.dtype) == str(want.dtype), shape=tuple(got.shape) == tuple(want.shape),
                    exact=float((got == want).float().mean()), ulps=ulps(got, want),
                    rel=float((got.float() - want.float()).abs().max() / want.float().abs().max()))

    def compare(device, dtype_name, seed):
        g = torch.Generator().manual_seed(seed)
        dt = getattr(torch, dtype_name)
        r = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dt)
        out = {}
        B, T, D, H, Hkv, hd, E, k = 2, 3, 160, 4, 2, 16, 60, 4
        norm = RMSNorm(D, 1e-6).to(device=device, dtype=dt)
        with torch.no_grad():
            norm.weight.copy_(r(D))
        x, res = r(B, T, D), r(B, T, D)
        out["rms_norm"] = stats(lk.rms_norm(x, norm.weight, norm.eps), norm(x))
        h, y = lk.rms_norm(x, norm.weight, norm.eps, res)
        h_want, y_want = norm(x, residual=res)
        out["add_rms_norm_sum"] = stats(h, h_want)
        out["add_rms_norm"] = stats(y, y_want)
        wide = r(B, T, (H + 2 * Hkv) * hd + 5)  # a projection's output with more columns after qkv
        qkv = wide[..., :(H + 2 * Hkv) * hd]
        pos = torch.randint(0, 500, (B, T), generator=g).to(device)
        cos, sin = rope_cos_sin(pos, hd, 10000.0, dt)
        q, kk = lk.rope(qkv, cos, sin, H, Hkv)
        q_in, k_in, _ = qkv.split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
        out["rope_q"] = stats(q, apply_rope(q_in.view(B, T, H, hd).transpose(1, 2), cos, sin))
        out["rope_k"] = stats(kk, apply_rope(k_in.view(B, T, Hkv, hd).transpose(1, 2), cos, sin))
        out["rope_contiguous"] = q.is_contiguous() and kk.is_contiguous()
        # the K/V write in the same launch (a paged cache's kv_store): token i's k and v into pool rows dst[:, i]
        N = B * T
        pool = r(2 * N + 3, Hkv, hd)
        dst = torch.randperm(2 * N + 3, generator=g)[:2 * N].view(2, N).to(device)
        v_tok = qkv[..., (H + Hkv) * hd:].reshape(N, Hkv, hd)
        want = pool.clone()
        want[dst[0]], want[dst[1]] = kk.transpose(1, 2).reshape(N, Hkv, hd), v_tok
        qs, none = lk.rope(qkv, cos, sin, H, Hkv, None, (pool, dst, None))
        out["rope_store_q"], out["rope_store_kv"] = stats(qs, q), stats(pool, want)
        out["rope_store_no_k"] = none is None
        # Qwen3's per-head q/k norm folded into the same launch, against RMSNorm per head then RoPE
        qn, kn = RMSNorm(hd, 1e-6).to(device=device, dtype=dt), RMSNorm(hd, 1e-6).to(device=device, dtype=dt)
        with torch.no_grad():
            qn.weight.copy_(r(hd)), kn.weight.copy_(r(hd))
        q, kk = lk.rope(qkv, cos, sin, H, Hkv, (qn.weight, kn.weight, qn.eps))
        out["rope_norm_q"] = stats(q, apply_rope(qn(q_in.view(B, T, H, hd)).transpose(1, 2), cos, sin))
        out["rope_norm_k"] = stats(kk, apply_rope(kn(k_in.view(B, T, Hkv, hd)).transpose(1, 2), cos, sin))
        # with the norm, and a decode step's padding row: the last token writes token 0's K/V into token 0's rows
        src = torch.arange(N, device=device)
        src[-1] = 0
        dst[:, -1] = dst[:, 0]
        pool = r(2 * N + 3, Hkv, hd)
        want = pool.clone()
        want[dst[0]], want[dst[1]] = kk.transpose(1, 2).reshape(N, Hkv, hd)[src], v_tok[src]
        qs, _ = lk.rope(qkv, cos, sin, H, Hkv, (qn.weight, kn.weight, qn.eps), (pool, dst, src))
        out["rope_store_norm_q"], out["rope_store_src_kv"] = stats(qs, q), stats(pool, want)
        # router logits as a slice of the fused input projection; distinct values, so the top-k is unambiguous
        proj = r(3, 2 * 24 + E + 1)
        vals = (torch.randperm(E * 3, generator=g).float() / 40 - 3).view(3, E).to(device=device, dtype=dt)
        proj[:, 48:48 + E] = vals
        logits = proj[:, 48:48 + E]
        for renorm in (False, True):
            block = MoEBlock.__new__(MoEBlock)
            block.top_k, block.norm_topk_prob, block.kernels = k, renorm, None
            ids_want, w_want = block.route(logits)
            ids, w = lk.route_topk(logits, k, renorm)
            out[f"route_ids_{renorm}"] = ids.dtype == torch.int64 and torch.equal(ids, ids_want)
            out[f"route_weights_{renorm}"] = float((w - w_want).abs().max() / w_want.abs().max())
        tie = torch.zeros(1, E, device=device, dtype=dt)
        tie[0, [7, 3, 50]] = 1.0  # three equal largest: the lower experts first, then the rest in order
        out["route_ties"] = lk.route_topk(tie, 5, False)[0].tolist()
        # NaN logits (a NaN hidden state) rank last: every row still names k distinct experts below E (the MoE kernels
        # index by them), the NaN ones with weight 0; a row of NaN only, too
        nan = torch.randn(2, E, generator=g).to(device=device, dtype=dt)
        nan[0, [1, 5, 9]] = float("nan")
        nan[1] = float("nan")
        ids, w = lk.route_topk(nan, 4, False)
        out["route_nan"] = [sorted(set(r)) == sorted(r) and all(0 <= i < E for i in r) for r in ids.tolist()]
        out["route_nan_clean"] = not set(ids[0].tolist()) & {1, 5, 9}
        # the router's GEMV fused with the top-k against the gate's F.linear, then route: logits well apart (x's last
        # column is 1, the weights' last column distinct offsets 0.1 apart, the rest a sum of standard deviation 0.01),
        # so that an ulp of the dot product moves no pick; 2,100 columns take two passes of the kernel's loads
        # (the renormalisation both ways, one per case, few experts, seed 0 only: the simulator runs each block's 128
        # threads in Python, ~0.5 s a block)
        for n_r, d_r, e_r, renorm in ((2, D, 12, False), (1, 2100, 6, True)) if seed == 0 else ():
            xg = r(n_r, d_r)
            xg[:, -1] = 1
            wg = (torch.rand(e_r, d_r, generator=g) * 2 - 1).to(device=device, dtype=dt) * (0.017 / d_r ** 0.5)
            wg[:, -1] = (torch.randperm(e_r, generator=g) * 0.1).to(device=device, dtype=dt)
            block = MoEBlock.__new__(MoEBlock)
            block.top_k, block.norm_topk_prob, block.kernels = k, renorm, None
            ids_want, w_want = block.route(F.linear(xg, wg))
            ids, w = lk.router_topk(xg, wg, k, renorm)
            out[f"router_ids_{d_r}"] = ids.dtype == torch.int64 and torch.equal(ids, ids_want)
            out[f"router_weights_{d_r}"] = float((w - w_want).abs().max() / w_want.abs().max())
        gate_up = proj[:, :48]  # the shared expert's gate and up, F = 24
        out["swiglu"] = stats(lk.swiglu(gate_up), F.silu(gate_up[:, :24]) * gate_up[:, 24:])
        xs, routed, shared = r(3, D), r(3, D), r(3, D)
        gate = proj[:, -1:]
        summed = lk.shared_expert_out(xs, routed, gate, shared)
        out["shared_expert_out"] = stats(summed, xs + (routed + torch.sigmoid(gate) * shared))
        # the same sum and the next norm in one launch: the two kernels' values (fp16: bit for bit)
        h, y = lk.moe_out_norm(xs, routed, gate, shared, norm.weight, norm.eps)
        out["moe_out_norm_sum"] = stats(h, summed)
        out["moe_out_norm"] = stats(y, lk.rms_norm(summed, norm.weight, norm.eps))
        # routing statistics of 3 of 4 layers in one launch, against RouterStats' torch fold of the same step
        import numpy as np
        from pagedweight.signals import RouterStats
        L, n, layers = 4, 5, [0, 2, 3]
        xr, ids = r(3, n, D), torch.randint(0, E, (3, n, k), generator=g).to(device)
        wr = torch.rand(3, n, k, generator=g).to(device=device, dtype=dt)
        tw = torch.rand(n, generator=g) + 0.5
        for weighted in (False, True):
            ref = RouterStats(L, E)
            ref.token_weights = tw if weighted else None
            ref.observe_layers(layers, xr.cpu(), ids.cpu(), wr.cpu())
            want = torch.from_numpy(np.stack([ref.mass, ref.norm_sum, ref.norm2_sum, ref.norm_max])).reshape(4, -1)
            acc = torch.zeros(4, L * E, device=device)
            lk.route_stats(xr, ids, wr, torch.tensor(layers, device=device) * E, tw.to(device) if weighted else None,
                           acc)
            out[f"route_stats_{weighted}"] = float((acc.cpu().double() - want).abs().max() / want.abs().max())
        # a weight per layer and token [L', n] (RouterStats' per-request scale): as the weights times it
        tw2 = torch.rand(3, n, generator=g) + 0.5
        ref = RouterStats(L, E)
        ref.observe_layers(layers, xr.cpu(), ids.cpu(), wr.cpu().float() * tw2[:, :, None])
        want = torch.from_numpy(np.stack([ref.mass, ref.norm_sum, ref.norm2_sum, ref.norm_max])).reshape(4, -1)
        acc = torch.zeros(4, L * E, device=device)
        lk.route_stats(xr, ids, wr, torch.tensor(layers, device=device) * E, tw2.to(device), acc)
        out["route_stats_per_layer"] = float((acc.cpu().double() - want).abs().max() / want.abs().max())
        # and each token's unweighted sums into its request's row (RouterStats.track_requests), 3 requests in 2 rows
        # beside the row of untracked tokens, against the torch fold
        ref = RouterStats(L, E)
        ref.track_requests(2, lambda: [])
        reqs = [object(), object(), object()]
        ref.arm([2, 1, 2], [1, 3, 2], reqs)
        ref.observe_layers(layers, xr.cpu(), ids.cpu(), wr.cpu())
        acc, req = torch.zeros(4, L * E, device=device), torch.zeros(4, 3 * L * E, device=device)
        lk.route_stats(xr, ids, wr, torch.tensor(layers, device=device) * E, ref.token_weights.to(device), acc,
                       ref._token_rows.to(device), req)
        want = ref._req.double()
        out["route_stats_rows"] = float((req.cpu().double() - want).abs().max() / want.abs().max())
        out["route_stats_rows_used"] = int((want[0].view(3, -1).sum(1) > 0).sum())
        return out

    def model_pair(device, dtype_name, family="qwen2_moe"):
        # a whole tiny model with the kernels on, against the same model off: Qwen1.5-like (shared expert, qkv bias)
        # or Qwen3-like (per-head q/k norm, grouped heads, no shared expert)
        from pagedweight.models import ModelConfig, build_model
        qwen3 = family == "qwen3_moe"
        cfg = ModelConfig(family=family, vocab_size=64, hidden_size=32, moe_intermediate_size=16,
                          num_hidden_layers=2, num_experts=8, top_k=2, norm_topk_prob=qwen3, num_attention_heads=4,
                          num_key_value_heads=2 if qwen3 else 4, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-6,
                          max_position_embeddings=128, shared_expert_intermediate_size=0 if qwen3 else 24,
                          qkv_bias=not qwen3, qk_norm="head" if qwen3 else "none", bos_token_id=1, eos_token_ids=(2,))
        model = build_model(cfg, seed=0, std=0.2).to(device=device, dtype=getattr(torch, dtype_name)).eval()
        model.fuse_projections()
        ids = torch.randint(0, 64, (2, 3), generator=torch.Generator().manual_seed(1)).to(device)
        fused, moe_out_norm = [], lk.moe_out_norm
        lk.moe_out_norm = lambda *a: fused.append(1) or moe_out_norm(*a)  # where a block's output meets a norm
        with torch.no_grad():
            want = model(ids)
            on = model.use_layer_kernels()
            used = sorted({type(m).__name__ for m in model.modules() if m.__dict__.get("kernels") is not None})
            got = model(ids)
        lk.moe_out_norm = moe_out_norm
        return dict(on=on, used=used, max_err=float((got - want).abs().max()), scale=float(want.abs().max()),
                    argmax=torch.equal(got.argmax(-1), want.argmax(-1)), fused=len(fused))
""")

# The whole-model check wires the kernels into each family once, in one dtype each: the per-kernel comparisons cover
# both dtypes' numerics. Under the simulator a model pair takes ~2 minutes, a comparison ~1: one child per dtype, run
# side by side.
MODEL_CASES = {"float16": "qwen2_moe", "float32": "qwen3_moe"}
SIM_CHILD = COMPARE + textwrap.dedent(r"""
    import json, sys
    torch.set_num_threads(1)
    dt, fam = %r, %r
    out = {f"{dt}/{seed}": compare("cpu", dt, seed) for seed in (0, 1)}
    out[f"model/{fam}/{dt}"] = model_pair("cpu", dt, fam)
    json.dump(out, sys.stdout)
""")

COMPILE_CHILD = COMPARE + textwrap.dedent(r"""
    import numba
    torch.set_num_threads(1)
    from unittest import mock
    kernels = lk

    sigs = {name: [] for name in ["_rms_norm_kernel", "_rope_kernel", "_topk_kernel", "_router_kernel",
                                  "_swiglu_kernel", "_shared_out_kernel", "_moe_out_norm_kernel",
                                  "_route_stats_kernel"]}

    %(recorder)s

    # the launchers' own argument types (numpy views stand in for device arrays: numba.typeof agrees); the kernels
    # are stand-ins, so compare() only records (its comparisons are meaningless here)
    from pagedweight.cuda import launcher as lm
    with mock.patch.multiple(lk, **{name: Recorder(name) for name in sigs}), \
            mock.patch.multiple(lm, SIMULATOR=True, _dev=lambda t: t.detach().numpy()):  # `launch` through Numba
        for dt in ("float16", "float32"):
            compare("cpu", dt, 0)
""") % {"recorder": KERNEL_RECORDER} + COMPILE_RECORDED

ELEMENTWISE = ("rms_norm", "add_rms_norm", "swiglu", "shared_expert_out", "rope_norm_q", "rope_norm_k")
BIT_EXACT = ("add_rms_norm_sum", "rope_q", "rope_k", "moe_out_norm_sum", "moe_out_norm",
             "rope_store_q", "rope_store_kv", "rope_store_norm_q", "rope_store_src_kv")  # the store's: against its own


sim = child_fixture(__name__, "sim", [SIM_CHILD % case for case in MODEL_CASES.items()], timeout=1200,
                    NUMBA_ENABLE_CUDASIM="1")


def check_case(r: dict, dtype: str, seed: int) -> None:
    for name in BIT_EXACT + ELEMENTWISE:
        assert r[name]["dtype"] and r[name]["shape"], (name, r[name])
        if dtype == "float32":  # the GPU contracts a * b + c into one FMA (one rounding where torch has two)
            assert r[name]["rel"] <= 1e-6, (name, r[name])
        elif name in BIT_EXACT:  # multiply and add only: rounded where torch rounds
            assert r[name]["exact"] == 1.0, (name, r[name])
        else:  # exp, or a sum in another order: an fp16 ulp at most, on few elements
            assert r[name]["ulps"] <= 1.0 and r[name]["exact"] >= 0.95, (name, r[name])
    assert r["rope_contiguous"] and r["rope_store_no_k"]
    for renorm in (False, True):
        assert r[f"route_ids_{renorm}"], r
        assert r[f"route_weights_{renorm}"] <= 1e-6, r  # float32 weights: a float32 ulp or two
    assert r["route_ties"][0] == [3, 7, 50, 0, 1], r["route_ties"]
    assert r["route_nan"] == [True, True] and r["route_nan_clean"], r["route_nan"]
    router = [key for key in r if key.startswith("router_ids_")]
    assert len(router) == (2 if seed == 0 else 0), sorted(r)
    for key in router:
        assert r[key], (key, r)
        # a logit an ulp of the dtype apart from F.linear's moves a weight by as much (fp16 ulps near 1: 1e-3)
        assert r[key.replace("ids", "weights")] <= (4e-3 if dtype == "float16" else 1e-5), (key, r)
    for weighted in (False, True):  # float32 sums in another order: an ulp or two of the largest
        assert r[f"route_stats_{weighted}"] <= 1e-6, r
    assert r["route_stats_rows"] <= 1e-6 and r["route_stats_rows_used"] == 3, r
    assert r["route_stats_per_layer"] <= 1e-6, r


@pytest.mark.parametrize("case", ["float16/0", "float16/1", "float32/0", "float32/1"])
def test_kernels_match_torch_under_simulator(sim: dict, case: str) -> None:
    dtype, seed = case.split("/")
    check_case(sim[case], dtype, int(seed))


@pytest.mark.parametrize("dtype, family", MODEL_CASES.items())
def test_model_with_kernels_matches_without_under_simulator(sim: dict, dtype: str, family: str) -> None:
    r = sim[f"model/{family}/{dtype}"]
    want = ["Attention", "MLP", "MoEBlock", "RMSNorm"] if family == "qwen2_moe" else ["Attention", "MoEBlock", "RMSNorm"]
    assert r["on"] and r["used"] == want, r  # Qwen3's attention too: its per-head q/k norm runs in RoPE's kernel
    # layer 0's shared-expert output added in layer 1's input norm (the last layer's before the final norm, apart)
    assert r["fused"] == (1 if family == "qwen2_moe" else 0), r
    assert r["argmax"], r
    assert r["max_err"] <= (2e-2 if dtype == "float16" else 1e-4) * max(1.0, r["scale"]), r


compiled = child_fixture(__name__, "compiled", [COMPILE_CHILD], timeout=900, NUMBA_ENABLE_CUDASIM="0")


def test_kernels_compile_to_sm90_ptx(compiled: dict) -> None:
    for name, runs in compiled.items():
        assert len(runs) >= 2, f"{name}: launched with {len(runs)} signatures, want fp16 and fp32"
        for r in runs:
            assert r["target"] == ["sm_90"] and r["resty"] == "none" and len(r["entries"]) == 1, r
            assert re.search(rf"13layer_kernels{len(name)}{name}B", r["entries"][0]), r


def test_model_without_cuda_keeps_torch_ops() -> None:
    """On the CPU (no simulator) use_layer_kernels declines and nothing changes."""
    from pagedweight.models import build_model
    from test_checkpoint import tiny_config

    model = build_model(tiny_config(), seed=0)
    assert model.use_layer_kernels() is False
    assert all(m.__dict__.get("kernels") is None for m in model.modules())


@pytest.mark.skipif(DEVICE != "cuda", reason="the kernels on the GPU: PAGEDWEIGHT_TEST_DEVICE=cuda (run on the H200)")
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_kernels_match_torch_on_gpu(dtype: str) -> None:
    ns: dict = {}
    exec(COMPARE, ns)
    check_case(ns["compare"]("cuda", dtype, 0), dtype, 0)
    for family in ("qwen2_moe", "qwen3_moe"):
        r = ns["model_pair"]("cuda", dtype, family)
        assert r["on"] and r["argmax"] and r["fused"] == (1 if family == "qwen2_moe" else 0), (family, r)
        assert r["max_err"] <= (2e-2 if dtype == "float16" else 1e-4) * max(1.0, r["scale"]), (family, r)


def test_importing_the_kernels_keeps_inspect_working() -> None:
    """cuda/_compat.py imports NVIDIA's `cuda` namespace package, whose __file__ is None under Python 3.11: a module
    like that makes inspect.getmodule raise while it walks sys.modules, and torch calls it (a CPU SDPA after this
    import failed with TypeError). The import must leave inspect working."""
    import inspect

    import pagedweight.cuda.layer_kernels  # noqa: F401

    assert inspect.getmodule(None, "/nonexistent/file.py") is None
