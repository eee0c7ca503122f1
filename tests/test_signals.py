"""RouterStats' routing mass against DESIGN.md §2's definition when top-k weights do not sum to 1 per token
(Qwen1.5-MoE's norm_topk_prob=False): within a request m = sum_t sum_k r / sum_t sum_k r, and in a batch each
request's mass merges weighted by its KV blocks (merge_routing_mass), on the torch fold and on the fused kernel's
(cuda/layer_kernels.route_stats, under the CUDA simulator)."""
from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch

from helpers import child_fixture
from pagedweight.signals import RouterStats, merge_routing_mass, normalize_mass

L, E, K, D = 2, 6, 2, 8


def batch(tokens: list[int], topk_sums: list[float], seed: int = 0):
    """x [L, n, D], ids and weights [L, n, k] of a batch whose request q's tokens' top-k weights sum to about
    topk_sums[q], and each request's raw routing mass [R, L, E] (sum of its weights per expert)."""
    g = torch.Generator().manual_seed(seed)
    n = sum(tokens)
    x = torch.randn(L, n, D, generator=g)
    ids = torch.stack([torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]) for _ in range(L)])
    w = torch.rand(L, n, K, generator=g) + 0.5
    w = w / w.sum(-1, keepdim=True) * torch.tensor(np.repeat(topk_sums, tokens), dtype=torch.float32)[None, :, None]
    owner = np.repeat(np.arange(len(tokens)), tokens)
    per_request = np.zeros((len(tokens), L, E))
    for q in range(len(tokens)):
        np.add.at(per_request[q], (np.arange(L)[:, None, None], ids.numpy()[:, owner == q]), w.numpy()[:, owner == q])
    return x, ids, w, per_request


def observe(stats: RouterStats, stacked: bool, x, ids, w) -> None:
    if stacked:
        stats.observe_layers(list(range(L)), x, ids, w)
    else:
        for layer in range(L):
            stats(layer, x[layer], ids[layer], w[layer])
    stats.prefetch()


@pytest.mark.parametrize("stacked", [False, True], ids=["per-layer", "stacked"])
def test_batch_merges_each_requests_mass_by_kv_blocks_whatever_the_topk_sum(stacked):
    """Requests whose tokens' top-k weights sum to 0.2, 0.9 and 0.5: the window's routing mass (and the features'
    share) is their masses merged by KV blocks; weighting tokens by KV blocks over tokens weighed each request also by
    its top-k sum (the second request weighed 4.5x the first here, at equal KV blocks)."""
    tokens, blocks = [3, 1, 2], [4, 4, 2]
    x, ids, w, per_request = batch(tokens, [0.2, 0.9, 0.5])
    stats = RouterStats(L, E)
    stats.arm(tokens, blocks)
    observe(stats, stacked, x, ids, w)
    want = merge_routing_mass(per_request, blocks)
    np.testing.assert_allclose(stats.routing_mass(), want, rtol=1e-5)
    np.testing.assert_allclose(stats.features()[::2, 3].reshape(L, E), want, rtol=1e-5)


@pytest.mark.parametrize("stacked", [False, True], ids=["per-layer", "stacked"])
def test_one_request_and_normalised_topk_keep_their_mass(stacked):
    """One request: DESIGN's sum_t sum_k r over sum_t sum_k r, a token with larger top-k weights counting more.
    Top-k weights summing to 1 (Mixtral, Qwen3-MoE): the window's sums are those of tokens weighted by KV blocks over
    tokens, as before."""
    x, ids, w, per_request = batch([4], [0.3])
    w[:, 0] *= 3  # one token's top-k sum 0.9
    per_request = np.zeros((1, L, E))
    np.add.at(per_request[0], (np.arange(L)[:, None, None], ids.numpy()), w.numpy())
    stats = RouterStats(L, E)
    stats.arm([4], [5])
    observe(stats, stacked, x, ids, w)
    np.testing.assert_allclose(stats.routing_mass(), normalize_mass(per_request[0]), rtol=1e-5)

    tokens, blocks = [3, 1, 2], [4, 4, 2]
    x, ids, w, per_request = batch(tokens, [1.0, 1.0, 1.0], seed=1)
    stats.arm(tokens, blocks)
    observe(stats, stacked, x, ids, w)
    np.testing.assert_allclose(stats.mass, np.tensordot(np.asarray(blocks) / np.asarray(tokens), per_request, axes=1),
                               rtol=1e-5)


def test_tracked_requests_features_merge_by_kv_blocks_whatever_the_topk_sum():
    """With track_requests, the features' share is each request's mass so far merged by KV blocks (a prompt window,
    then a decode window): weighting a request by its KV blocks over its tokens weighed it also by its top-k sum."""
    requests = [object(), object()]
    stats = RouterStats(L, E)
    stats.track_requests(4, lambda: requests)
    x, ids, w, prompt = batch([3, 2], [0.2, 0.9])
    stats.arm([3, 2], [1, 1], requests)
    observe(stats, True, x, ids, w)
    np.testing.assert_allclose(stats.features()[::2, 3].reshape(L, E), merge_routing_mass(prompt, [1, 1]), rtol=1e-5)
    x, ids, w, decode = batch([1, 1], [0.3, 0.8], seed=2)
    stats.arm([1, 1], [2, 1], requests)
    observe(stats, True, x, ids, w)
    np.testing.assert_allclose(stats.features()[::2, 3].reshape(L, E), merge_routing_mass(prompt + decode, [2, 1]),
                               rtol=1e-5)


FUSED = textwrap.dedent(r"""
    import json
    import numpy as np
    import torch
    from pagedweight import signals
    from pagedweight.cuda import layer_kernels

    launches = []
    route_stats = layer_kernels.route_stats
    layer_kernels.route_stats = lambda *args: (launches.append(1), route_stats(*args))
    torch.manual_seed(0)
    torch.set_num_threads(1)
    L, E, k, D, n, layers = 3, 6, 2, 16, 5, [0, 2]
    x, ids = torch.randn(2, n, D), torch.stack([torch.stack([torch.randperm(E)[:k] for _ in range(n)]) for _ in layers])
    w = torch.rand(2, n, k) * torch.tensor([0.2, 0.2, 0.9, 0.5, 0.5])[None, :, None]  # 3 requests' top-k sums

    def run(fused, tracked, tokens, blocks):
        signals._fused_fold = lambda x, w: fused  # the simulator runs the kernel on the CPU
        stats, reqs = signals.RouterStats(L, E), [object() for _ in tokens]
        if tracked:
            stats.track_requests(4, lambda: reqs)
        stats.arm(tokens, blocks, reqs)
        stats.observe_layers(layers, x, ids, w)
        stats.prefetch()
        return np.concatenate([stats.mass.ravel(), stats.features().ravel()])

    out = {}
    for tracked, tokens, blocks in [(True, [2, 1, 2], [1, 3, 2]), (False, [2, 1, 2], [1, 3, 2]), (True, [5], [3])]:
        launches.clear()
        got = run(True, tracked, tokens, blocks)
        fused = len(launches)
        want = run(False, tracked, tokens, blocks)
        out[f"{tracked}/{len(tokens)}"] = [float(np.abs(got - want).max() / np.abs(want).max()), fused]
    print(json.dumps(out))
""")


fused = child_fixture(__name__, "fused", [FUSED], timeout=600, NUMBA_ENABLE_CUDASIM="1")


def test_fused_fold_matches_torch_fold_under_simulator(fused: dict):
    """observe_layers through layer_kernels.route_stats (the GPU path: the window's sums weighted per layer and
    token, the requests' rows unweighted, in one launch) gives the torch fold's mass and features, with and without
    tracked requests."""
    out = fused
    assert {case: launches for case, (_, launches) in out.items()} == {"True/3": 1, "False/3": 1, "True/1": 1}, out
    assert max(err for err, _ in out.values()) <= 1e-5, out
