"""Engine (issue 8 item 4, on CPU): sampling, continuous batching, paged KV, preemption, abort, and the paging loop.

Oracles: transformers' generate on the same checkpoint (dense path), our own model at uniform 8 bits through
`load_ap_model` (AP path), and the same requests served one at a time (batching, preemption).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import types
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
import transformers

from pagedweight import kv_cache
from pagedweight.apformat import load_ap_model
from pagedweight.engine import LLM, RequestOutput, serving_reserve
from pagedweight.page_store import PageStore
from pagedweight.pool import parse_budget
from pagedweight.run import add_parser, run
from pagedweight.generate import generate
from pagedweight import sampling
from pagedweight.sampling import Sampler, SamplingParams, make_generator, sample_rows
from pagedweight.scheduler import Scheduler
from pagedweight.sequence import Sequence
from helpers import budget_with
from test_planner import EveryStepPlanner, same_plans

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
# The any-precision scenario also runs on a GPU (fused kernel, fp16): PAGEDWEIGHT_TEST_DEVICE=cuda. There the
# oracle is the static uniform-width engine on the same device; the float32 model oracle is CPU-only.
DEVICE = os.environ.get("PAGEDWEIGHT_TEST_DEVICE", "cpu")
BUNDLED = ROOT / "models" / "pw-tiny-moe"
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\ndef main(argv):", "class Stack:",
           "for i in range(10):"]


@pytest.fixture(scope="module")
def hf_dir():
    """The bundled model (HF dir) and transformers' own model loaded from it in float32."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(BUNDLED, dtype=torch.float32).eval()
    return BUNDLED, ref


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def step_all(llm: LLM, prompts: list, params: list[SamplingParams]) -> list[list]:
    """Every RequestOutput of each request, stepping the engine until all have finished; in prompt order."""
    ids = [llm.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    outs: dict[str, list] = {i: [] for i in ids}
    while llm.has_unfinished():
        for out in llm.step():
            outs[out.request_id].append(out)
    return [outs[i] for i in ids]


# ---------------------------------------------------------------- sampling
def test_sampling_params_validate():
    SamplingParams().validate()
    for bad in (dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2),
                dict(seed=-3), dict(stop=[""]), dict(max_tokens=2.5), dict(output_kind="partial"), dict(logprobs=-1),
                dict(logprobs=21), dict(logprobs=True), dict(logprobs=1.0), dict(prompt_logprobs=-1),
                dict(prompt_logprobs=21), dict(prompt_logprobs=False), dict(presence_penalty=2.5),
                dict(frequency_penalty=-3), dict(presence_penalty=True), dict(logit_bias={-1: 1.0}),
                dict(logit_bias={1: 101}), dict(logit_bias={1: float("nan")}), dict(logit_bias={"1": 1.0}),
                dict(logit_bias={t: 1.0 for t in range(301)}), dict(logit_bias=[(1, 1.0)]), dict(min_p=-0.1),
                dict(min_p=1.5), dict(min_p=True), dict(stop_token_ids=[-1]), dict(stop_token_ids=3),
                dict(stop_token_ids=[True]), dict(min_tokens=-1), dict(min_tokens=17), dict(min_tokens=1.0),
                dict(repetition_penalty=0.0), dict(repetition_penalty=11.0), dict(repetition_penalty="1"),
                dict(temperature=float("inf")), dict(temperature=True), dict(top_p=True), dict(seed=2**64)):
        with pytest.raises(ValueError):
            SamplingParams(**bad).validate()
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(temperature=1.0, top_k=-1).validate().top_k == 0  # vLLM's spelling of off
    # vLLM's temperature rules: below 1e-5 greedy; a small one is taken as 0.01, where dividing by it would overflow
    # the logits to inf and pick the first token with a positive logit
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=1e-3).greedy
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0]] * 64)
    tiny = [SamplingParams(temperature=t, seed=i).validate() for i, t in enumerate([1e-39, 1e-3] * 32)]
    gens = [make_generator(p.seed, torch.device("cpu")) for p in tiny]
    assert (sample_rows(logits, tiny, gens) == 1).all()


def test_a_reused_params_object_samples_with_its_current_bias(hf_dir):
    """A request takes its own copy of the params: the caller's object, given a new logit_bias for the next request,
    does not sample with the bias arrays cached for the last one."""
    llm = LLM(hf_dir[0])
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=0, logit_bias={5: 100.0})
    assert list(llm.stream(PROMPTS[0], params))[-1].token_ids == [5, 5, 5]
    params.logit_bias = {7: 100.0}
    assert list(llm.stream(PROMPTS[0], params))[-1].token_ids == [7, 7, 7]


def test_a_request_keeps_its_params_when_the_callers_lists_change(hf_dir):
    """add_request copies the params' lists and dict too: a logit_bias entry or stop string added to the caller's
    object afterwards neither reaches the request (a token id past the vocabulary failed its whole step, the other
    requests of the step with it) nor changes where it stops."""
    llm = LLM(hf_dir[0])
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=0, logit_bias={5: 100.0}, stop=["zzz"],
                            ignore_eos=True)
    other = llm.add_request(PROMPTS[1], greedy(4))
    mine = llm.add_request(PROMPTS[0], params)
    params.logit_bias[10**6] = 1.0
    params.stop.append(llm.tokenizer.decode([5]))
    outs = {}
    while llm.has_unfinished():
        outs.update((o.request_id, o) for o in llm.step())
    assert outs[other].finish_reason == "length" and outs[mine].finish_reason == "length"
    assert outs[mine].token_ids == [5] * 4


def test_generate_and_streams_hand_back_other_requests_outputs(hf_dir):
    """Two streams read together both run to their end with their whole text; a request added before a generate
    call that finishes inside it is returned by the next step; a single prompt (text or token ids) is one
    request."""
    llm = LLM(hf_dir[0])
    want = [o.text for o in llm.generate(PROMPTS[:2], [greedy(8), greedy(4)], use_tqdm=False)]
    a, b = llm.stream(PROMPTS[0], greedy(8)), llm.stream(PROMPTS[1], greedy(4))
    last = {}
    for pair in itertools.zip_longest(a, b):
        for i, out in enumerate(pair):
            if out is not None:
                last[i] = out
    assert last[0].finished and last[1].finished and [last[0].text, last[1].text] == want
    early = llm.add_request(PROMPTS[1], greedy(4))
    assert [o.text for o in llm.generate([PROMPTS[0]], greedy(8), use_tqdm=False)] == want[:1]
    later = llm.step()  # every output of it, in order (cumulative: one a step)
    assert {o.request_id for o in later} == {early} and len(later) == 4
    assert [o.finished for o in later] == [False] * 3 + [True] and later[-1].text == want[1]
    assert not llm.has_unfinished()
    assert len(llm.generate(PROMPTS[0], greedy(2), use_tqdm=False)) == 1
    ids = llm.tokenizer.encode(PROMPTS[0])
    assert llm.generate(ids, greedy(2), use_tqdm=False)[0].prompt_token_ids == ids


def test_stop_strings_need_detokenization(hf_dir):
    llm = LLM(hf_dir[0], detokenize=False)
    with pytest.raises(ValueError, match="detokenize"):
        llm.add_request([1, 2, 3], SamplingParams(stop=["x"]))


def test_nucleus_drop_keeps_the_tail_at_top_p_one():
    """A float32 running sum from the top reaches 1.0 before a long flat tail: the rule is read from the tail, so
    top_p 1 keeps every token and a top_p below 1 keeps what the float64 rule keeps."""
    from pagedweight.sampling import nucleus_drop

    torch.manual_seed(0)
    logits = torch.cat([torch.tensor([17.0]), torch.randn(151_935) * 0.01]).sort(descending=True).values  # tail 0.6 %
    rows = logits.expand(3, -1).contiguous()
    top_p = torch.tensor([[1.0], [0.999], [0.9995]])
    drop = nucleus_drop(rows, top_p)
    assert not drop[0].any()
    probs = torch.softmax(logits.double(), -1)
    for i in (1, 2):
        exact = (probs.cumsum(0) - probs) >= top_p[i].double()
        assert 0 < int(exact.sum()) < len(probs) - 1000
        assert int((drop[i] != exact).sum()) <= 50, int((drop[i] != exact).sum())  # float32 at the cut (a sum from the top: 9,568)


def reference_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a sampled row must follow, per row in vocabulary order: softmax(row / T) over the tokens
    transformers' MinPLogitsWarper keeps (vLLM applies min-p first), then over the top-k tokens, renormalised, then
    the smallest prefix of it (sorted) whose mass reaches top_p, renormalised."""
    x = row.double() / p.temperature
    if p.min_p > 0.0:
        from transformers.generation.logits_process import MinPLogitsWarper

        x = MinPLogitsWarper(p.min_p)(None, x[None])[0]
    if 0 < p.top_k < x.numel():
        x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
    probs = torch.softmax(x, -1)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        drop = (sorted_p.cumsum(0) - sorted_p) >= p.top_p
        probs = probs.index_fill(0, order[drop], 0.0)
    return probs / probs.sum()


def test_sampler_follows_the_filtered_distribution():
    """On PAGEDWEIGHT_TEST_DEVICE (the H200: CUDA's sort, topk and RNG, and top-p alone through the nucleus cut
    kernel)."""
    torch.manual_seed(0)
    n, row = 4000, torch.randn(40) * 2
    rows = row.to(DEVICE).expand(n, -1)
    cases = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=5),
             SamplingParams(temperature=1.3, top_p=0.6), SamplingParams(temperature=0.9, top_k=12, top_p=0.8),
             SamplingParams(temperature=1.0, top_k=40, top_p=0.999), SamplingParams(temperature=1.0, min_p=0.1),
             SamplingParams(temperature=0.8, min_p=0.05, top_p=0.9)]
    for p in cases:
        draws = sample_rows(rows, [p] * n, [None] * n, nucleus_kernel=DEVICE == "cuda").cpu().numpy()
        want = reference_probs(row, p).numpy()
        freq = np.bincount(draws, minlength=row.numel()) / n
        assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(want)), p  # never a filtered-out token
        assert np.abs(freq - want).max() < 0.035, (p, np.abs(freq - want).max())
        assert p.min_p == 0.0 or (want == 0).any(), "min-p filtered nothing here: the case tests nothing"
    # rows of other parameters in one call each follow their own distribution
    mixed = [cases[i % len(cases)] for i in range(n)]
    draws = sample_rows(rows, mixed, [None] * n, nucleus_kernel=DEVICE == "cuda").cpu().numpy()
    for i, p in enumerate(cases):
        freq = np.bincount(draws[i::len(cases)], minlength=row.numel()) / (n // len(cases))
        assert np.abs(freq - reference_probs(row, p).numpy()).max() < 0.07, p


def test_sampler_batches_greedy_seeded_and_chunked_rows(monkeypatch):
    torch.manual_seed(0)
    logits = torch.randn(6, 50).to(DEVICE)
    sampler = Sampler()
    top = logits.argmax(-1).tolist()
    assert sampler(logits, [SamplingParams()] * 6, [None] * 6) == top
    assert sampler(logits, [SamplingParams(temperature=1.0, top_k=1)] * 6, [None] * 6) == top
    # a seeded request draws the same tokens whatever else is in the batch, greedy rows stay argmax beside it
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    gen_a, gen_b = make_generator(7, DEVICE), make_generator(7, DEVICE)
    alone = [sampler(logits[1:2], [p], [gen_a])[0] for _ in range(20)]
    mixed = [sampler(logits[:3], [SamplingParams(temperature=1.0, seed=1), p, SamplingParams()],
                     [make_generator(1, DEVICE), gen_b, None]) for _ in range(20)]
    assert alone == [m[1] for m in mixed] and len(set(alone)) > 1
    assert all(m[2] == top[2] for m in mixed)
    # rows sampled in chunks (the temporaries' bound) draw what one batch draws
    params = [SamplingParams(temperature=1.0 + 0.1 * i, top_k=3 * i, seed=i) for i in range(6)]
    params[2] = SamplingParams()

    def gens() -> list[torch.Generator]:
        return [make_generator(i, DEVICE) for i in range(6)]

    whole = sampler(logits, params, gens())
    monkeypatch.setattr(sampling, "SAMPLE_CHUNK_BYTES", 2 * sampling.FILTERED_BYTES_PER_ENTRY * 50)  # 2 rows
    assert sampler(logits, params, gens()) == whole
    params[2] = SamplingParams(temperature=0.5, seed=2)
    whole = sampling.sample_rows(logits, params, gens()).tolist()
    assert sampler(logits, params, gens()) == whole


def test_min_tokens_masks_the_stop_tokens_until_reached():
    """A row short of its min_tokens never picks EOS or its stop_token_ids (greedy or sampled); at min_tokens it may;
    ignore_eos leaves EOS alone (it stops nothing then)."""
    logits = torch.zeros(4, 12).to(DEVICE)
    logits[:, 5], logits[:, 7], logits[:, 2] = 9.0, 10.0, 1.0  # the stop id 5 and EOS 7 lead by far
    sampler, eos = Sampler(), {7}
    short, done = np.array([4]), np.array([4, 4, 4])
    greedy_p = SamplingParams(min_tokens=3, stop_token_ids=[5])
    hot = SamplingParams(min_tokens=3, stop_token_ids=[5], temperature=1.0)
    no_eos = SamplingParams(min_tokens=3, stop_token_ids=[5], ignore_eos=True)
    params = [greedy_p, hot, greedy_p, no_eos]
    for _ in range(20):
        picks = sampler(logits, params, [None] * 4, [short, short, done, short], eos)
        assert picks[0] == 2 and picks[1] not in (5, 7) and picks[2] == 7 and picks[3] == 7, picks


# ---------------------------------------------------------------- scheduler (no model)
class CountingKV:
    """BlockSpace over a count of free blocks (what the scheduler sees of PagedKVCache)."""

    def __init__(self, free: int, block_size: int = 4) -> None:
        self.num_free_blocks, self.block_size = free, block_size

    def blocks_needed(self, seq: Sequence, n: int) -> int:
        return max(0, -(-(seq.num_computed_tokens + n) // self.block_size) - len(seq.block_table))

    def tokens_fit(self, seq: Sequence) -> int:
        return (len(seq.block_table) + self.num_free_blocks) * self.block_size - seq.num_computed_tokens

    def allocate(self, seq: Sequence, n: int) -> None:
        k = self.blocks_needed(seq, n)
        self.num_free_blocks -= k
        seq.block_table += [0] * k

    def free(self, seq: Sequence) -> None:
        self.num_free_blocks += len(seq.block_table)
        seq.block_table = []

    def share_prefix(self, seq: Sequence) -> int | None:
        return None

    def shared_blocks(self, seq: Sequence) -> int:
        return 0


def _seq(rid: str, prompt: int, max_tokens: int) -> Sequence:
    return Sequence(rid, list(range(prompt)), SamplingParams(max_tokens=max_tokens))


def _ran(batch) -> None:
    """What the engine does after a step: the scheduled tokens are computed; a finished prompt samples one."""
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
        if seq.num_uncomputed_tokens == 0:
            seq.append_token(1, 0.0)


def test_adjust_logits_matches_a_per_token_reference():
    """Logit bias added, frequency x count and presence x occurrence subtracted, per row and token, with per-row
    values and with one value every row shares (no device copy)."""
    gen = torch.Generator().manual_seed(0)
    history = [np.array([1, 1, 4, 9, 1]), None, np.array([2, 2, 2]), np.array([5]), np.array([], dtype=np.int64)]
    for params in ([SamplingParams(presence_penalty=0.5, frequency_penalty=0.3),
                    SamplingParams(logit_bias={3: 5.0, 7: -100}),
                    SamplingParams(frequency_penalty=-1.0, logit_bias={2: 1.5, 49: 0.25}), SamplingParams(),
                    SamplingParams(presence_penalty=-2.0)],
                   [SamplingParams(presence_penalty=0.7, frequency_penalty=0.2)] * 5):
        x = torch.randn(5, 50, generator=gen)
        want, x = x.clone(), x.to(DEVICE)
        for row, (p, h) in enumerate(zip(params, history)):
            for t, v in (p.logit_bias or {}).items():
                want[row, t] += v
            if p.penalized and h is not None:
                for t in set(h.tolist()):
                    want[row, t] -= p.frequency_penalty * h.tolist().count(t) + p.presence_penalty
        sampling.adjust_logits(x, params, history)
        assert torch.allclose(x.cpu(), want, atol=1e-6)


def test_sampler_adjusts_only_its_rows_and_keeps_the_logits():
    """Adjusted rows (greedy or sampled) pick from their adjusted logits; the other rows pick as without them, and
    the logits the engine reads log-probabilities from afterwards are unchanged."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 40, generator=gen).to(DEVICE)
    before = logits.clone()
    top = logits.argmax(dim=-1)
    params = [SamplingParams(), SamplingParams(logit_bias={5: 100.0}),
              SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.7, seed=2, logit_bias={9: 100.0}),
              SamplingParams(frequency_penalty=2.0), SamplingParams(temperature=1.0, seed=8, top_k=5)]
    history = [None, None, None, None, np.array([int(top[4])] * 50), None]
    gens = [make_generator(p.seed, DEVICE) for p in params]
    tokens = Sampler()(logits, params, gens, history)
    assert torch.equal(logits, before)
    assert tokens[0] == top[0] and tokens[1] == 5 and tokens[3] == 9 and tokens[4] != top[4]
    alone = Sampler()(logits[[2, 5]], [params[2], params[5]], [make_generator(3, DEVICE), make_generator(8, DEVICE)])
    assert [tokens[2], tokens[5]] == alone  # seeded rows draw the same beside adjusted rows


def test_blocks_demand_counts_what_requests_will_still_need():
    kv = CountingKV(free=100)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=14)
    a, b, c = _seq("a", 10, 3), _seq("b", 9, 10), _seq("c", 3, 1)
    for s in (a, b, c):
        sched.add(s)
    # a: 10 + 3 - 1 = 12 tokens of K/V -> 3 blocks; b: capped by max_model_len, 14 - 1 = 13 -> 4; c has no seat
    assert sched.blocks_demand() == 3 + 4
    batch = sched.schedule()  # a: 8 tokens (2 blocks), budget spent
    assert batch.seqs == [a] and kv.num_free_blocks == 98
    _ran(batch)
    assert sched.blocks_demand() == 1 + 4  # free - demand did not move: the planner has nothing new to do
    while True:
        _ran(sched.schedule())
        if a.num_completion_tokens == 3:  # the engine finishes a here (max_tokens)
            break
        assert kv.num_free_blocks - sched.blocks_demand() == 100 - 7
    assert len(a.block_table) == 3  # it never held more than its demand said


def test_prefill_waits_instead_of_preempting_for_a_block_taken_this_step():
    kv = CountingKV(free=3)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16)
    a, b = _seq("a", 6, 4), _seq("b", 8, 4)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.num_new_tokens == [6, 4] and kv.num_free_blocks == 0  # b's chunk shrank to the last block
    _ran(batch)
    batch = sched.schedule()  # a decodes inside its block; b finds none: it waits and keeps its KV
    assert batch.seqs == [a] and not batch.preempted and sched.num_preemptions == 0
    assert b.num_computed_tokens == 4 and len(b.block_table) == 1 and b in sched.running


# ---------------------------------------------------------------- dense path
def test_dense_greedy_matches_transformers(hf_dir):
    path, ref = hf_dir
    llm = LLM(path, block_size=4, max_num_batched_tokens=16)  # chunked prefill + batching + several blocks
    outs = llm.generate(PROMPTS, greedy(16), use_tqdm=False)
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        want = ref.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, ids.shape[1]:]
        assert out.token_ids == want.tolist()
        assert out.finish_reason == "length" and out.finished
        assert out.text == llm.tokenizer.decode(out.token_ids)
    assert llm.stats()["kv_free_blocks"] == llm.stats()["kv_total_blocks"]


def test_lone_sequence_chunked_prefill_matches_transformers(hf_dir):
    """One request alone, its prompt in 4-token chunks: every chunk after the first attends through the causal mask
    aligned to the end that attention builds on the device (a lone sequence's step carries no mask)."""
    path, ref = hf_dir
    llm = LLM(path, block_size=4, max_num_batched_tokens=4)
    out = llm.generate([PROMPTS[1]], greedy(8), use_tqdm=False)[0]
    assert len(out.prompt_token_ids) > 3 * 4  # several chunks, each after the first over a longer context
    ids = torch.tensor([out.prompt_token_ids])
    want = ref.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
    assert out.token_ids == want.tolist()


def test_batching_equals_one_at_a_time(hf_dir):
    path, _ = hf_dir
    params = [greedy(12), SamplingParams(max_tokens=10, temperature=0.9, top_k=20, seed=5, ignore_eos=True),
              greedy(7), SamplingParams(max_tokens=12, temperature=1.2, top_p=0.8, seed=11, ignore_eos=True)]
    llm = LLM(path, block_size=4, max_num_batched_tokens=8)
    together = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.num_steps < sum(o.completion_tokens for o in together)  # they really shared steps
    for prompt, p, out in zip(PROMPTS, params, together):
        alone = LLM(path, block_size=16, max_num_batched_tokens=64).generate([prompt], p, use_tqdm=False)[0]
        assert out.token_ids == alone.token_ids and len(out.token_ids) == p.max_tokens


def test_preemption_recomputes_without_changing_outputs(hf_dir):
    path, _ = hf_dir
    free = LLM(path, block_size=4).generate(PROMPTS, greedy(24, prompt_logprobs=1), use_tqdm=False)
    # 12 KV blocks of 4 tokens (4 layers x 4 KiB each): the four requests (up to ~40 tokens) cannot all fit
    tiny = LLM(path, block_size=4, kv_cache_bytes=12 * 4 * 4096, max_num_batched_tokens=16)
    assert tiny.stats()["kv_total_blocks"] == 12
    outs = tiny.generate(PROMPTS, greedy(24, prompt_logprobs=1), use_tqdm=False)
    assert tiny.stats()["preemptions"] > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in free]
    for out, ref in zip(outs, free):  # a recomputed prompt is not scored twice
        assert len(out.prompt_logprobs) == len(ref.prompt_logprobs) == out.prompt_tokens
        assert all(a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
                   for a, b in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:]))
    assert tiny.stats()["kv_free_blocks"] == 12


def test_prefix_sharing_keeps_outputs_and_shares_blocks(hf_dir):
    """Requests that share a system prompt with a running one start after its computed blocks and generate what
    they generate without sharing (greedy and seeded sampling); the shared blocks are held once and all come back."""
    path, _ = hf_dir
    system = "You are a careful assistant. Answer in one line of Python.\n"
    prompts = [system + q for q in ("Reverse a list.", "Sum a list.", "Reverse a list.")]
    params = [greedy(12), greedy(12), SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)]

    def serve(prefix_caching: bool) -> tuple[list[RequestOutput], LLM, list[int]]:
        llm = LLM(path, block_size=4, max_num_batched_tokens=8, prefix_caching=prefix_caching)
        first = llm.add_request(prompts[0], params[0])
        while not llm._requests[first].num_completion_tokens:  # its prompt is computed
            llm.step()
        ids = [first] + [llm.add_request(p, sp) for p, sp in zip(prompts[1:], params[1:])]
        outs, shared = {}, []
        while llm.has_unfinished():
            for out in llm.step():
                outs[out.request_id] = out
            held = sum(len(s.block_table) for s in llm.scheduler.running)
            shared.append(held - llm.kv.num_used_blocks)
        assert llm.kv.num_free_blocks == llm.stats()["kv_total_blocks"]
        return [outs[i] for i in ids], llm, shared

    plain, plain_llm, plain_shared = serve(False)
    outs, llm, shared = serve(True)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    cached = [o.num_cached_tokens for o in outs]
    assert cached[0] == 0 and all(c >= 8 and c % 4 == 0 for c in cached[1:])  # the system prompt's full blocks
    assert cached[2] > cached[1]  # the repeated question shares its blocks too
    stats = llm.stats()
    assert stats["prefix_hit_tokens"] == sum(cached)
    assert stats["prefix_query_tokens"] == sum(o.prompt_tokens for o in outs)  # each looked once, as it started
    assert max(shared) >= cached[1] // 4 and max(plain_shared) == 0 and plain_llm.stats()["prefix_hit_tokens"] == 0
    assert llm.num_steps < plain_llm.num_steps  # fewer prompt tokens to compute
    # the conversation's next turn, after every request ended: the first turn's blocks were kept, counted free
    assert stats["kv_cached_blocks"] > 0 and stats["kv_free_blocks"] == stats["kv_total_blocks"]
    asked = llm.tokenizer.encode(prompts[0])
    turn = asked + outs[0].token_ids + llm.tokenizer.encode(" Now sort it.")
    again = [llm.generate([turn], greedy(8), use_tqdm=False)[0] for llm in (llm, plain_llm)]
    assert again[0].token_ids == again[1].token_ids and again[1].num_cached_tokens == 0
    # every full block of the first turn's K/V: its prompt and 11 of its 12 tokens (the last is never computed)
    assert again[0].num_cached_tokens == (len(asked) + 11) // 4 * 4
    kept = llm.kv.num_cached_blocks
    assert kept > 0 and llm.reset_prefix_cache() == kept and llm.kv.num_cached_blocks == 0
    assert llm.generate([turn], greedy(8), use_tqdm=False)[0].num_cached_tokens == 0


def test_abort_frees_blocks_at_once(hf_dir):
    path, _ = hf_dir
    llm = LLM(path, block_size=4)
    ids = [llm.add_request(p, greedy(20)) for p in PROMPTS]
    for _ in range(4):
        llm.step()
    victim = llm._requests[ids[1]]
    held, before = len(victim.block_table), llm.kv.num_free_blocks
    assert held > 0
    assert llm.abort(ids[1])
    assert llm.kv.num_free_blocks == before + held
    assert not llm.abort(ids[1])
    finished = {}
    while llm.has_unfinished():
        finished.update({o.request_id: o for o in llm.step() if o.finished})
    assert finished[ids[1]].finish_reason == "abort"
    assert all(finished[i].finish_reason == "length" for i in ids if i != ids[1])
    assert llm.kv.num_free_blocks == llm.stats()["kv_total_blocks"]


def test_stop_strings_eos_stream_and_errors(hf_dir):
    path, _ = hf_dir
    llm = LLM(path)
    full = llm.generate([PROMPTS[0]], greedy(16), use_tqdm=False)[0]
    stop = full.text[5:8]
    cut = llm.generate([PROMPTS[0]], greedy(16, stop=[stop]), use_tqdm=False)[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.find(stop)]
    llm.eos_token_ids = {full.token_ids[3]}
    eos = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=16), use_tqdm=False)[0]
    first = full.token_ids.index(full.token_ids[3])
    assert eos.finish_reason == "stop" and eos.token_ids == full.token_ids[:first + 1]
    llm.eos_token_ids = set()
    # vLLM's stop_token_ids end the request as EOS does, even with ignore_eos (that covers the model's EOS alone)
    by_id = llm.generate([PROMPTS[0]], greedy(16, stop_token_ids=[full.token_ids[3]]), use_tqdm=False)[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == full.token_ids[:first + 1]
    # min_tokens: the stop token is never sampled before it (the greedy text takes the next best there), and then
    # it may end the request; the stop string too waits for it
    stop_id = full.token_ids[3]
    held = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=16, stop_token_ids=[stop_id], min_tokens=first + 3),
                        use_tqdm=False)[0]
    assert stop_id not in held.token_ids[:first + 3] and held.token_ids[:first] == full.token_ids[:first]
    assert len(held.token_ids) >= first + 3 and (held.finish_reason == "length" or held.token_ids[-1] == stop_id)
    # a second stop id that `held` first generates past min_tokens ends the request there
    j = next(j for j in range(first + 3, len(held.token_ids)) if held.token_ids[j] not in held.token_ids[:j])
    free = llm.generate([PROMPTS[0]], greedy(16, stop_token_ids=[stop_id, held.token_ids[j]], min_tokens=first + 3),
                        use_tqdm=False)[0]
    assert free.finish_reason == "stop" and free.token_ids == held.token_ids[:j + 1]
    late = llm.generate([PROMPTS[0]], greedy(16, stop=[stop], min_tokens=16), use_tqdm=False)[0]
    assert late.finish_reason == "length" and late.text == full.text
    chunks = list(llm.stream(PROMPTS[0], greedy(16)))
    assert "".join(c.delta_text for c in chunks) == full.text and chunks[-1].finished
    assert [c.finished for c in chunks].count(True) == 1
    # a stream holds back a tail that begins a stop string: a stop string that starts one character before the
    # fourth step's text ends and ends with the sixth's is never streamed in part; one that never completes is
    # streamed whole once the request ends; cumulative texts only grow
    ends = [len(c.text) for c in chunks]
    spanning = full.text[ends[3] - 1:ends[5]]
    for stop, want in ((spanning, full.text[:full.text.find(spanning)]), (spanning + "\x00", full.text)):
        for kind in ("delta", "cumulative"):
            outs = list(llm.stream(PROMPTS[0], greedy(16, stop=[stop], output_kind=kind)))
            assert "".join(o.delta_text for o in outs) == outs[-1].text == want, (stop, kind)
            assert all(b.text.startswith(a.text) for a, b in itertools.pairwise(outs))
    # every output of a request carries one prompt list (no copy per step); changing it changes no later output
    assert all(c.prompt_token_ids is chunks[0].prompt_token_ids for c in chunks)
    assert chunks[0].prompt_token_ids == full.prompt_token_ids
    mutated = llm.stream(PROMPTS[0], greedy(16))
    first = next(mutated)
    first.prompt_token_ids.append(-1)
    assert [c.token_ids for c in [first, *mutated]][-1] == full.token_ids
    # the last token ends inside a UTF-8 character (token 3520 is a space and a lead byte), so its text is held
    # back until the request ends; the stop string in it still cuts it then
    held = llm.generate([PROMPTS[0]], greedy(1, stop=[" "], logit_bias={3520: 100.0}), use_tqdm=False)[0]
    assert held.token_ids == [3520] and held.text == "" and held.finish_reason == "stop"
    # a bad prompt among several: the ones added before it do not run on unread
    with pytest.raises(ValueError):
        llm.generate([PROMPTS[0], ""], greedy(4), use_tqdm=False)
    assert not llm.has_unfinished()
    too_long = llm.generate([[1] * 1100], greedy(4), use_tqdm=False)[0]
    assert too_long.finish_reason == "error" and "max_model_len" in too_long.error
    with pytest.raises(ValueError):
        llm.add_request("x", SamplingParams(top_p=0.0))
    with pytest.raises(ValueError):
        llm.add_request([10**6])


def test_activation_reserve_is_taken_from_the_pool(hf_dir):
    """`activation_reserve` leaves the budget the same and the pool that much smaller, whole pages; stats() counts it
    in the bytes the budget covers. It needs a budget, and a budget it leaves without one KV block is refused."""
    path, _ = hf_dir
    probe = LLM(path, block_size=4)
    outside, page = probe.weights_outside_bytes, probe.page_bytes
    budget, reserve = outside + 40 * page + 123, 7 * page + 5
    plain = LLM(path, budget, block_size=4)
    kept = LLM(path, budget, block_size=4, activation_reserve=reserve)
    assert plain.pool.capacity_pages == 40 and kept.pool.capacity_pages == 33  # 33 pages + 118 B: 33 whole
    assert kept.stats()["budget_bytes"] == outside + 33 * page + reserve <= budget
    assert plain.stats()["budget_bytes"] == outside + 40 * page
    assert kept.generate([PROMPTS[0]], greedy(4), use_tqdm=False)[0].token_ids == \
        plain.generate([PROMPTS[0]], greedy(4), use_tqdm=False)[0].token_ids
    with pytest.raises(ValueError, match="activation_reserve"):
        LLM(path, block_size=4, activation_reserve=page)  # no budget to take it from
    with pytest.raises(ValueError, match="activation_reserve"):
        LLM(path, budget, block_size=4, activation_reserve=40 * page)  # leaves no KV block
    with pytest.raises(ValueError, match="activation_reserve"):
        LLM(path, budget, block_size=4, activation_reserve=-1)


def test_auto_activation_reserve_profiles_then_rebuilds(hf_dir, ap_dir, monkeypatch):
    """activation_reserve="auto" builds a profile engine (the pool its steps need, at most half the room), runs its
    largest steps and releases it before the real build: afterwards the engine is the one a plain build gives (on
    this device nothing to measure: reserve 0, the same pool, widths and tokens), its step counter starts at 0, the
    model carries one LM-head hook, and the experts read the new pool. "auto" needs a budget; any other string is
    refused."""
    path, _ = hf_dir
    probe = LLM(path, block_size=4)
    budget = probe.weights_outside_bytes + 64 * probe.page_bytes
    for src, extra in ((path, {}), (ap_dir, dict(page_store_dir=str(ap_dir / "store")))):
        if extra:
            ap_probe = LLM(ap_dir, block_size=4, **extra)
            budget = (ap_probe.weights_outside_bytes + ap_probe.stats()["resident_weight_bytes"]
                      + ap_probe.pool.bytes_of(ap_probe.pool.reserve_pages) + 12 * ap_probe.kv.block_bytes)
        plain = LLM(src, budget, block_size=4, max_num_batched_tokens=16, **extra)
        auto = LLM(src, budget, block_size=4, max_num_batched_tokens=16, activation_reserve="auto", **extra)
        assert auto.options.activation_reserve == 0 and auto.num_steps == 0 and not auto._requests
        assert auto.pool.capacity_pages == plain.pool.capacity_pages
        assert auto.stats()["budget_bytes"] == plain.stats()["budget_bytes"]
        assert len(auto.model.norm._forward_hooks) == 1
        if extra:
            assert np.array_equal(auto.committed_widths(), plain.committed_widths())
            assert all(layer.mlp.experts.pool is auto.pool for layer in auto.model.layers)
        want = [o.token_ids for o in plain.generate(PROMPTS, greedy(8), use_tqdm=False)]
        assert [o.token_ids for o in auto.generate(PROMPTS, greedy(8), use_tqdm=False)] == want
    with pytest.raises(ValueError, match="activation_reserve"):
        LLM(path, block_size=4, activation_reserve="auto")  # no budget
    with pytest.raises(ValueError, match="activation_reserve"):
        LLM(path, budget, block_size=4, activation_reserve="plenty")
    monkeypatch.setattr(LLM, "_profile_reserve", lambda self, room, weights: room)  # a gap as large as the room
    with pytest.raises(ValueError, match="measured at start-up.*activation_reserve=0"):
        LLM(path, budget, block_size=4, activation_reserve="auto")
    # reserves that leave KV blocks but not the mover's reserve, or not the experts: the same way out
    lut = ap_probe.pool.bytes_of(ap_probe.pool.reserve_pages)
    for left, what in ((2 * ap_probe.kv.block_bytes, "mover's reserve"),
                       (lut + 2 * ap_probe.kv.block_bytes, "experts at 3 bits")):
        monkeypatch.setattr(LLM, "_profile_reserve", lambda self, room, weights: room - left)
        with pytest.raises(ValueError, match=f"too small: .*{what}.*activation_reserve of .*measured at start-up"):
            LLM(ap_dir, budget, block_size=4, activation_reserve="auto", **extra)
        with pytest.raises(ValueError, match=f"{what}.*B( of pool, \\d+ B available)?$"):  # given as bytes: no hint
            LLM(ap_dir, budget, block_size=4,
                activation_reserve=budget - ap_probe.weights_outside_bytes - left, **extra)


def test_auto_profile_reaches_the_widest_decode_at_the_longest_table(monkeypatch):
    """The profile's steps include a pure decode step of min(max_num_seqs, max_num_batched_tokens) rows whose longest
    block table is the longest max_model_len allows (a decode graph pads every row to it: its largest gather), and
    a prefill step of max_num_batched_tokens tokens whose every token is scored with the most alternatives (the
    LM head's prompt chunks); with the budget's room (first) or with the pool those steps
    need (second: far less than half of a large room, which leaves the gap more of the budget at start-up)."""
    from pagedweight import runner

    steps, pools, scored = [], [], []
    run, build = runner.ModelRunner.run, LLM._build

    def recorded(self, batch):
        steps.append((len(batch.seqs), all(n == 1 for n in batch.num_new_tokens),
                      max(len(seq.block_table) for seq in batch.seqs), batch.num_tokens))
        out = run(self, batch)
        if out[2] is not None:
            scored.append((len(out[2].hidden), out[2].spans[0][0].params.prompt_logprobs))
        return out

    def built(self, pool_bytes, weights):
        pools.append(pool_bytes)
        return build(self, pool_bytes, weights)

    monkeypatch.setattr(runner.ModelRunner, "run", recorded)
    monkeypatch.setattr(LLM, "_build", built)
    probe = LLM(BUNDLED, block_size=16)
    longest = -(-probe.max_model_len // 16)
    # 176 blocks: half the room (88) is less than the steps need (a 64-block row and 7 one-block shorts, the shorts
    # twice over, in whole 2 MiB), so the profile gets half; 2,000: it gets what its steps need
    for blocks in (176, 2000):
        steps.clear(), pools.clear(), scored.clear()
        LLM(BUNDLED, probe.weights_outside_bytes + blocks * probe.kv.block_bytes, block_size=16, max_num_seqs=8,
            max_num_batched_tokens=64, activation_reserve="auto")
        widest = max((rows, table) for rows, decode, table, _ in steps if decode)
        assert widest == (8, longest), (blocks, widest)
        assert max(tokens for *_, tokens in steps) == 64
        assert max(scored) == (64, sampling.MAX_LOGPROBS)
        profile_blocks = pools[0] // probe.kv.block_bytes
        assert (profile_blocks == blocks // 2) if blocks == 176 else (longest < profile_blocks < blocks // 8), pools


@pytest.mark.skipif(DEVICE != "cuda", reason="measures the CUDA allocator: PAGEDWEIGHT_TEST_DEVICE=cuda (on the H200)")
def test_auto_activation_reserve_is_measured_on_gpu(ap_dir):
    """On CUDA the profile measures a gap (its decode graphs' pool at least): the reserve is > 0, the pool that much
    smaller than a plain build's (in whole 2 MiB: its allocator segment stays within the budget), serving grows the
    allocator by no more than the reserve, and the engine serves the tokens an engine given that reserve as bytes
    serves; building it (the profile) stays within the budget. Static widths: with paging, when a reload's copies
    finish decides the step it commits at, so two GPU engines' widths, and tokens, may differ.
    The budget leaves 512 MiB beside the weights and KV: alone in a process the profile measured 76 MiB on the H200
    (64 of them cuBLAS's two workspaces, default and capture stream), so 64 MiB of room was too little; its widest
    decode at the longest table then took it to 228 MiB at 32 sequences (the gather path's padded K/V of 32 x 1,024
    tokens), so 8 here (session 21)."""
    extra = dict(device=DEVICE, block_size=16, max_num_batched_tokens=64, max_num_seqs=8, bits=6, paging=False,
                 page_store_dir=str(ap_dir / "store"))
    probe = LLM(ap_dir, **extra)
    budget = budget_with(probe, 64) + (512 << 20)
    plain = LLM(ap_dir, budget, **extra)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_reserved()
    auto = LLM(ap_dir, budget, activation_reserve="auto", **extra)
    assert torch.cuda.max_memory_reserved() - before <= budget  # the profile too stays within the budget
    reserve = auto.options.activation_reserve
    assert reserve > 0 and reserve % (2 << 20) == 0
    room = budget - auto.weights_outside_bytes - reserve  # the pool's segment in whole 2 MiB, within the budget
    assert auto.pool.capacity_pages == room // (2 << 20) * (2 << 20) // plain.page_bytes
    assert plain.pool.capacity_pages == (budget - plain.weights_outside_bytes) // plain.page_bytes
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_reserved()
    got = [o.token_ids for o in auto.generate(PROMPTS, greedy(12), use_tqdm=False)]
    assert torch.cuda.max_memory_reserved() - before <= reserve
    given = LLM(ap_dir, budget, activation_reserve=reserve, **extra)
    assert [o.token_ids for o in given.generate(PROMPTS, greedy(12), use_tqdm=False)] == got


def test_output_kinds_carry_the_same_tokens(hf_dir):
    """Per step, "cumulative" outputs carry every token so far, "delta" ones only the new tokens (joined: the same
    tokens), "final_only" requests one output at the end; every output counts the tokens generated so far. With
    detokenizing on, the text is the same under each kind. generate() keeps returning whole outputs."""
    path, _ = hf_dir
    llm = LLM(path, block_size=4, max_num_batched_tokens=8)
    kinds = ("cumulative", "delta", "final_only")
    params = [SamplingParams(max_tokens=n, ignore_eos=True, output_kind=k) for n, k in zip((12, 9, 7), kinds)]
    want = llm.generate(PROMPTS[:3], [greedy(p.max_tokens) for p in params], use_tqdm=False)
    cumulative, delta, final = step_all(llm, PROMPTS, params)
    assert [o.completion_tokens for o in cumulative] == [len(o.token_ids) for o in cumulative]
    assert cumulative[-1].token_ids == want[0].token_ids and cumulative[-1].text == want[0].text
    assert len(delta) == 9 and all(len(o.token_ids) == 1 for o in delta)  # one token a step once prefilled
    assert [t for o in delta for t in o.token_ids] == want[1].token_ids
    assert [o.completion_tokens for o in delta] == list(range(1, 10))
    assert "".join(o.delta_text for o in delta) == delta[-1].text == want[1].text
    assert len(final) == 1 and final[0].finished and final[0].token_ids == want[2].token_ids
    assert final[0].completion_tokens == 7 and final[0].delta_text == final[0].text == want[2].text
    whole = llm.generate(PROMPTS[1:3], [params[1], params[2]], use_tqdm=False)
    assert [o.token_ids for o in whole] == [want[1].token_ids, want[2].token_ids]
    assert [p.output_kind for p in params] == list(kinds)  # generate() changed none of the caller's params


def test_logprobs_match_transformers(hf_dir):
    """Each generated token reports its log-probability and those of the n most likely tokens under the model's
    distribution (transformers' log_softmax over the same prefix), in whole and delta outputs alike; a sampled
    request reports its draw's, before temperature."""
    path, ref = hf_dir
    llm = LLM(path, block_size=4, max_num_batched_tokens=8)
    params = [greedy(6, logprobs=3), greedy(5, logprobs=0, output_kind="delta"), greedy(4),
              SamplingParams(max_tokens=5, temperature=1.5, top_k=20, seed=3, ignore_eos=True, logprobs=2)]
    whole, deltas, plain, sampled = step_all(llm, PROMPTS, params)
    assert all(o.logprobs is None for o in plain)
    assert [len(o.logprobs) for o in deltas] == [len(o.token_ids) for o in deltas] == [1] * 5
    for out, n in ((whole[-1], 3), (deltas[-1], 0), (sampled[-1], 2)):
        tokens = [t for o in (deltas if out is deltas[-1] else [out]) for t in o.token_ids]
        logprobs = [e for o in (deltas if out is deltas[-1] else [out]) for e in o.logprobs]
        prompt = out.prompt_token_ids
        with torch.no_grad():
            want = torch.log_softmax(ref(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1], dim=-1)
        assert len(logprobs) == len(tokens)
        for step, (tok, entry) in enumerate(zip(tokens, logprobs)):
            top = torch.topk(want[step], n).indices.tolist()
            assert set(entry) == {tok, *top}
            for t, v in entry.items():
                assert abs(v - want[step, t].item()) < 1e-4, (step, t)
            if out is not sampled[-1]:
                assert entry[tok] == max(entry.values())  # greedy: its own token is the most likely


class OpenAIPenalties(transformers.LogitsProcessor):
    """The reference: the OpenAI API's penalties over the generated tokens and its logit bias, row by row."""

    def __init__(self, prompt_len: int, params: SamplingParams) -> None:
        self.prompt_len, self.params = prompt_len, params

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        p = self.params
        for row in range(scores.shape[0]):
            counts = torch.bincount(input_ids[row, self.prompt_len:], minlength=scores.shape[1]).to(scores.dtype)
            scores[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(scores.dtype)
            for t, v in (p.logit_bias or {}).items():
                scores[row, t] += v
        return scores


def test_penalties_and_logit_bias_match_transformers(hf_dir):
    """Greedy requests with presence / frequency penalties and a logit bias, batched with plain ones, generate what
    transformers' greedy generate does under the same adjustments; a seeded sampled request with penalties draws the
    same tokens alone and batched."""
    path, ref = hf_dir
    llm = LLM(path, block_size=4, max_num_batched_tokens=16)
    plain = llm.generate(PROMPTS, greedy(16), use_tqdm=False)
    banned = plain[3].token_ids[0]  # its first pick, biased out
    cases = [greedy(16, frequency_penalty=1.5), greedy(16, presence_penalty=2.0, frequency_penalty=-0.5), greedy(16),
             greedy(16, logit_bias={banned: -100.0, 100: 6.0}, presence_penalty=0.7)]
    outs = llm.generate(PROMPTS, cases, use_tqdm=False)
    for out, params in zip(outs, cases):
        ids = torch.tensor([out.prompt_token_ids])
        want = ref.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                            logits_processor=transformers.LogitsProcessorList([OpenAIPenalties(ids.shape[1], params)]))
        assert out.token_ids == want[0, ids.shape[1]:].tolist(), params
    assert outs[2].token_ids == plain[2].token_ids
    assert all(o.token_ids != p.token_ids for o, p in zip(outs[:2] + outs[3:], plain[:2] + plain[3:]))
    # the repetition penalty over the prompt's and the generated tokens, as transformers' processor applies it (and
    # before the OpenAI penalties, vLLM's order), batched with a plain row
    repeat = [greedy(16, repetition_penalty=1.6), greedy(16, repetition_penalty=1.3, presence_penalty=0.5),
              greedy(16), greedy(16, repetition_penalty=0.7)]
    outs = llm.generate(PROMPTS, repeat, use_tqdm=False)
    for out, params in zip(outs, repeat):
        ids = torch.tensor([out.prompt_token_ids])
        steps = [transformers.RepetitionPenaltyLogitsProcessor(params.repetition_penalty),
                 OpenAIPenalties(ids.shape[1], params)]
        want = ref.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                            logits_processor=transformers.LogitsProcessorList(steps))
        assert out.token_ids == want[0, ids.shape[1]:].tolist(), params
    assert outs[0].token_ids != plain[0].token_ids and outs[3].token_ids != plain[3].token_ids
    sampled = SamplingParams(max_tokens=10, temperature=1.0, seed=4, frequency_penalty=1.0, ignore_eos=True)
    alone = llm.generate(PROMPTS[:1], sampled, use_tqdm=False)[0]
    batched = llm.generate(PROMPTS, [sampled] + cases[1:], use_tqdm=False)[0]
    assert alone.token_ids == batched.token_ids


def test_prompt_logprobs_match_transformers(hf_dir):
    """Prompt tokens after the first report their log-probability and those of the n most likely tokens under the
    model's distribution (transformers' log_softmax over the same prefix), across prefill chunks of 8 tokens; with
    output_kind "delta" only the first output carries them; requests that do not ask get None."""
    path, ref = hf_dir
    llm = LLM(path, block_size=4, max_num_batched_tokens=8)
    params = [greedy(3, prompt_logprobs=2), greedy(3, prompt_logprobs=0, output_kind="delta"), greedy(2),
              SamplingParams(max_tokens=3, temperature=1.2, seed=5, prompt_logprobs=3, logprobs=1)]
    whole, deltas, plain, sampled = step_all(llm, PROMPTS, params)
    assert all(o.prompt_logprobs is None for o in plain + deltas[1:])
    assert max(o.prompt_tokens for o in (whole[-1], deltas[0], sampled[-1])) > 8  # some prompts took two chunks
    for out, n in ((whole[-1], 2), (deltas[0], 0), (sampled[-1], 3)):
        prompt, got = out.prompt_token_ids, out.prompt_logprobs
        with torch.no_grad():
            want = torch.log_softmax(ref(torch.tensor([prompt])).logits[0], dim=-1)
        assert len(got) == len(prompt) and got[0] is None
        for pos, (tok, entry) in enumerate(zip(prompt[1:], got[1:])):
            assert set(entry) == {tok, *torch.topk(want[pos], n).indices.tolist()}
            assert all(abs(v - want[pos, t].item()) < 1e-4 for t, v in entry.items()), pos
    assert len(sampled[-1].logprobs) == len(sampled[-1].token_ids) == 3


def test_prompt_logprobs_chunk_the_lm_head(hf_dir, monkeypatch):
    """The LM head over scored prompt rows runs a chunk at a time within SAMPLE_CHUNK_BYTES, with the values of
    one whole pass."""
    path, _ = hf_dir
    llm = LLM(path, block_size=4)
    want = llm.generate(PROMPTS[1:2], greedy(1, prompt_logprobs=1), use_tqdm=False)[0]
    rows = []  # the prompt path calls the head on [rows, H]; the forward's own call is [1, rows, H]
    hook = llm.model.lm_head.register_forward_pre_hook(lambda _, x: rows.append(len(x[0])) if x[0].dim() == 2 else None)
    per_entry = 2 * 4 + 1  # float32 logits and _pick's temporary, and a byte to spare
    monkeypatch.setattr(sampling, "SAMPLE_CHUNK_BYTES", 2 * per_entry * llm.config.vocab_size)  # two rows a chunk
    try:
        got = llm.generate(PROMPTS[1:2], greedy(1, prompt_logprobs=1), use_tqdm=False)[0]
    finally:
        hook.remove()
    scored = want.prompt_tokens - 1
    assert scored > 2 and rows == [2] * (scored // 2) + [1] * (scored % 2)
    assert all(a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-5 for t in a)
               for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]))


# ---------------------------------------------------------------- any-precision path and paging
def test_prefill_gemm_warm_up_walks_the_engines_layers(ap_dir):
    """`runner.warm_prefill_gemms` (run at engine start on CUDA) finds the prefill buffers the layers' experts share
    and runs every group GEMM shape through them, then gives them back; experts without such buffers (the torch
    twin, as on this CPU) run none. Here layer 0's experts are given the CUDA path's buffers."""
    import functools

    from pagedweight.cuda import moe_kernels as mk
    from pagedweight.cuda import prefill as pf
    from pagedweight.models.layers import row_bucket
    from pagedweight.runner import warm_prefill_gemms

    llm = LLM(ap_dir, device="cpu", block_size=4, max_num_batched_tokens=32, page_store_dir=str(ap_dir / "store"))
    assert llm.options.prefill_warm_up and warm_prefill_gemms(llm.model, llm.dtype) == 0
    buffers = pf.PrefillBuffers(32)
    experts = llm.model.layers[0].mlp.experts
    experts.fn = functools.partial(mk.moe_forward, buffers=buffers)
    cfg = llm.model.config
    D, F, E, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k
    G = min(pf.prefill_group(D, F), pf.GROUPED_MAX, E)
    bound = min(int((1 + pf.PAD_SLACK) * 32 * k), 32 * E)
    want = sum(1 for n in range(1, G + 1) for w in np.unique(row_bucket(np.arange(1, 33))) if n * w <= bound)
    assert warm_prefill_gemms(llm.model, llm.dtype) == want > 0 and buffers.data is None
    llm.close()


def test_ap_no_pressure_8bit_equals_uniform_8bit(ap_dir):
    llm = LLM(ap_dir, device=DEVICE, block_size=4, page_store_dir=str(ap_dir / "store"))  # all 8-bit + KV
    outs = llm.generate(PROMPTS, greedy(12), use_tqdm=False)
    if DEVICE == "cpu":
        ref_model = load_ap_model(ap_dir, 8, verify=False)
        for out in outs:
            assert out.token_ids == generate(ref_model, [out.prompt_token_ids], greedy(12))[0]
    st = llm.stats()
    assert [h[8] for h in st["committed_width_hist"]] == [32] * 4  # 16 experts x 2 blocks per layer, all 8 bits
    assert st["offload_triggers"] == 0 and st["bytes_offloaded"] == 0
    static = LLM(ap_dir, device=DEVICE, block_size=4, bits=8, paging=False, page_store_dir=str(ap_dir / "store"))
    assert [o.token_ids for o in static.generate(PROMPTS, greedy(12), use_tqdm=False)] == [o.token_ids for o in outs]
    llm.table.check()


def test_prompt_logprobs_equal_generated_logprobs(ap_dir):
    """Teacher forcing: the log-probabilities that generated tokens reported (decode steps: on CUDA the decode graphs
    and kernels) are those the same tokens report as a prompt (prefill: the LM head on the kept hidden rows). On
    CUDA, fp16 and the kernels' atomic sums allow 0.05 and may reorder near ties among the alternatives."""
    llm = LLM(ap_dir, device=DEVICE, block_size=4, page_store_dir=str(ap_dir / "store"))
    first = llm.generate(PROMPTS[:2], greedy(8, logprobs=2), use_tqdm=False)
    again = llm.generate([o.prompt_token_ids + o.token_ids[:-1] for o in first], greedy(1, prompt_logprobs=2),
                         use_tqdm=False)
    tol = 1e-4 if DEVICE == "cpu" else 5e-2
    for a, b in zip(first, again):
        assert len(b.prompt_logprobs) == a.prompt_tokens + 7
        for tok, generated, scored in zip(a.token_ids, a.logprobs, b.prompt_logprobs[a.prompt_tokens:]):
            assert abs(generated[tok] - scored[tok]) < tol
            if DEVICE == "cpu":
                assert generated.keys() == scored.keys()
                assert all(abs(generated[t] - scored[t]) < tol for t in generated)


def test_reference_experts_are_installed_by_the_build(ap_dir):
    """expert_impl="reference" gives every layer the kernel's torch twin from the first build on (an "auto" reserve's
    profile then measures the twin, not a kernel it never runs; the Serve/Ray engine actor used to swap it in after
    the build), turns CUDA graphs off (the twin reads routing on the host) and, where "auto" is the twin too (the
    CPU), serves the same tokens. Other values are refused."""
    from pagedweight.cuda.reference import moe_forward_reference
    from pagedweight.runner import APExperts, moe_function

    store = str(ap_dir / "store")
    twin = LLM(ap_dir, device=DEVICE, block_size=4, page_store_dir=store, expert_impl="reference")
    assert twin.options.cuda_graphs is False
    experts = [m for m in twin.model.modules() if isinstance(m, APExperts)]
    assert len(experts) == 4 and all(m.fn is moe_forward_reference for m in experts)
    assert moe_function(torch.device("cuda"), reference=True) is moe_forward_reference  # no CUDA needed to pick it
    if DEVICE == "cpu":
        auto = LLM(ap_dir, device=DEVICE, block_size=4, page_store_dir=store)
        assert [o.token_ids for o in twin.generate(PROMPTS, greedy(8), use_tqdm=False)] == \
            [o.token_ids for o in auto.generate(PROMPTS, greedy(8), use_tqdm=False)]
    with pytest.raises(ValueError, match="expert_impl 'fast'"):
        LLM(ap_dir, device=DEVICE, block_size=4, page_store_dir=store, expert_impl="fast")


@pytest.mark.skipif(DEVICE != "cuda", reason="the allocator's segments: PAGEDWEIGHT_TEST_DEVICE=cuda (run on the H200)")
@pytest.mark.parametrize("limit", [None, 1])  # device to device; through host memory (no second copy fits)
def test_packed_weights_on_gpu(hf_dir, limit):
    """Both ways `pack_weights` copies on CUDA leave every weight a view of one device allocation, which has a
    caching-allocator segment of its own of exactly the bytes it returns (what the engine counts), and the logits
    bit for bit what they were (the engine packs its model this way before sizing the pool)."""
    from pagedweight.models import load_model

    model = load_model(hf_dir[0], dtype=torch.float16, device=DEVICE)
    model.fuse_projections()
    ids = torch.randint(3, model.config.vocab_size, (2, 11), device=DEVICE)
    with torch.no_grad():
        before = model(ids)
        got = model.pack_weights(limit)
        after = model(ids)
    params = list(model.parameters())
    base = params[0].untyped_storage().data_ptr()
    assert all(p.is_cuda and p.untyped_storage().data_ptr() == base for p in params)
    assert got == model.packed_bytes("cuda") == params[0].untyped_storage().nbytes()
    segment = [s for s in torch.cuda.memory_snapshot() if s["address"] <= base < s["address"] + s["total_size"]]
    assert len(segment) == 1 and segment[0]["address"] == base and segment[0]["total_size"] == got, segment
    assert torch.equal(after, before)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU: PAGEDWEIGHT_TEST_DEVICE=cuda (run on the H200)")
def test_cuda_graph_decode_equals_eager(ap_dir):
    """Decode-only steps replayed from whole-step CUDA graphs (runner.DecodeGraphs) and the MoE launches of mixed
    steps replayed from per-layer graphs (16-token budget: prefill chunks beside decodes) give the tokens of eager
    launches, and both kinds of graph were replayed."""
    from pagedweight.runner import APExperts

    kw = dict(device=DEVICE, block_size=4, bits=6, paging=False, max_num_batched_tokens=16,
              page_store_dir=str(ap_dir / "store"))
    eager = LLM(ap_dir, cuda_graphs=False, **kw)
    ref = [o.token_ids for o in eager.generate(PROMPTS, greedy(12), use_tqdm=False)]
    graphed = LLM(ap_dir, **kw)
    assert [o.token_ids for o in graphed.generate(PROMPTS, greedy(12), use_tqdm=False)] == ref
    decode = graphed.runner.decode
    assert decode is not None, "the engine builds its ModelRunner without max_num_seqs: no whole-step graphs"
    assert decode.stats.captured > 0 and decode.stats.replayed > decode.stats.captured, decode.stats
    experts = [m for m in graphed.model.modules() if isinstance(m, APExperts)]
    assert experts and all(m._graphs for m in experts)
    assert eager.runner.decode is None
    assert not any(m._graphs for m in eager.model.modules() if isinstance(m, APExperts))


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_packed_steps_decode_rows_read_keys_in_place(monkeypatch, kv_heads):
    """With query and KV heads one to one or grouped two to one, the one-token rows of packed steps (beside prefill
    chunks under a 16-token budget; without graphs decode-only steps are packed too) attend through the paged kernel,
    never the gathered copy, and generate the tokens of an engine that gathers (fp32). On CUDA the engine picks the
    kernel itself; on the CPU its torch twin stands in, which checks the rows' wiring."""
    from pagedweight.cuda.reference import paged_decode_attention_reference
    from pagedweight.kv_cache import PagedKVCache
    from pagedweight.models import ModelConfig, build_model

    cfg = ModelConfig(family="olmoe", vocab_size=96, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                      num_experts=4, top_k=2, norm_topk_prob=False, num_attention_heads=4,
                      num_key_value_heads=kv_heads, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                      max_position_embeddings=128, qk_norm="full", bos_token_id=1, eos_token_ids=(2,))
    prompts = [torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (21, 7, 34, 12)]
    calls = {"kernel": 0, "gathered": 0, "mixed_steps": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    def recorded_prepare(self, seqs, num_new_tokens):
        prepare(self, seqs, num_new_tokens)
        calls["mixed_steps"] += bool(self.layout.chunks and self.layout.decode is not None)

    prepare = PagedKVCache.prepare
    monkeypatch.setattr(PagedKVCache, "prepare", recorded_prepare)
    monkeypatch.setattr(kv_cache, "gathered_decode_attention", counted("gathered", kv_cache.gathered_decode_attention))
    tokens, seen = {}, {}
    for use in (True, False):
        llm = LLM.from_parts(build_model(cfg, seed=0, std=0.3).to(DEVICE), None, device=DEVICE, dtype="float32",
                             detokenize=False, cuda_graphs=False, block_size=4, max_num_batched_tokens=16,
                             decode_attention_kernel=use)
        if use:
            assert (llm.kv._kernels is not None) == (DEVICE == "cuda")
            fn = llm.kv._kernels.paged_decode_attention if DEVICE == "cuda" else paged_decode_attention_reference
            llm.kv._kernels = types.SimpleNamespace(paged_decode_attention=counted("kernel", fn))
        tokens[use] = [o.token_ids for o in llm.generate(prompts, greedy(12), use_tqdm=False)]
        seen[use] = dict(calls)
        calls.update(kernel=0, gathered=0, mixed_steps=0)
    assert seen[True]["kernel"] > 0 and seen[True]["gathered"] == 0 and seen[True]["mixed_steps"] > 0, seen
    assert seen[False]["kernel"] == 0 and seen[False]["gathered"] > 0, seen
    assert tokens[True] == tokens[False]


def _mean_width(llm: LLM) -> float:
    widths = llm.committed_widths()  # cached between commits: must still be every row's q
    assert widths.tolist() == [row.q for row in llm.table.rows] and not widths.flags.writeable
    return float(widths.mean())


def _shadow_planner(llm: LLM) -> tuple[EveryStepPlanner, list[str], Callable[[], None]]:
    """Run the every-step reference planner beside the engine's on the same inputs at every boundary; returns it,
    the list of disagreements it fills, and the function that detaches it."""
    live = llm.planner
    ref = EveryStepPlanner(live.tables, live.knobs, live.desired, heads=live.heads, home_widths=live.home,
                           narrow_width=live.narrow_width)
    ref.routing.mass = live.routing.mass.copy()
    step, observe, mismatches = live.step, live.observe, []

    def both_step(kv, committed):
        got, want = step(kv, committed), ref.step(kv, committed)
        if not same_plans(got, want) or not np.array_equal(live.desired, ref.desired):
            mismatches.append(f"step {llm.num_steps}: {got} != {want}")
        return got

    def both_observe(step_mass=None, features=None):
        observe(step_mass, features)
        ref.observe(step_mass, features)

    def detach() -> None:
        del live.step, live.observe

    live.step, live.observe = both_step, both_observe
    return ref, mismatches, detach


def _pressure_run(ap_dir, dtype: str | None):
    """Four 96-token requests in a budget of 8-bit experts + the mover's reserve + 8 KV blocks (they need ~28).
    The every-step reference planner shadows the engine's (`_shadow_planner`)."""
    store = str(ap_dir / "store")
    probe = LLM(ap_dir, device=DEVICE, block_size=16, page_store_dir=store, dtype=dtype)
    weights_8 = probe.stats()["resident_weight_bytes"]
    budget = (probe.weights_outside_bytes + weights_8 + probe.pool.bytes_of(probe.pool.reserve_pages)
              + 8 * probe.kv.block_bytes)
    # no cap on reload starts (tested on its own below) and a reload window of one step: reloads beside the running
    # requests fragment the pool the way the GPU run did, so this scenario also covers weight-run relocation
    llm = LLM(ap_dir, budget, DEVICE, block_size=16, max_num_batched_tokens=16, page_store_dir=store, dtype=dtype,
              reload_starts_per_step=0, planner_knobs={"reload_dwell_steps": 1})
    start = _mean_width(llm)
    ref, mismatches, detach = _shadow_planner(llm)
    for p in PROMPTS:
        llm.add_request(p, greedy(96))
    widths, used, done = [], [], {}
    while llm.has_unfinished():
        done.update({o.request_id: o for o in llm.step() if o.finished})
        widths.append(_mean_width(llm))
        used.append(llm.kv.num_used_blocks)
        llm.table.check()
    during = llm.stats()
    # pressure gone: the idle loop reloads. Reloads are paced per step (a GPU step is short, so its byte cap is
    # small): step until the mover is idle, within a bound that a stuck reload would hit.
    for _ in range(400):
        llm.step()
        if llm.mover.idle() and _mean_width(llm) == 8.0:
            break
    detach()
    return llm, start, widths, used, done, during, (ref, mismatches)


@pytest.fixture(scope="module")
def pressure_run(ap_dir):
    return _pressure_run(ap_dir, None)


@pytest.fixture(scope="module")
def pressure_run_fp16(ap_dir, request):
    """The same run with float16 KV on CPU: KV pages are half as large, so LUT_8 runs span up to 16 pages. (On a GPU
    the default run is already float16.)"""
    if DEVICE != "cpu":
        return request.getfixturevalue("pressure_run")
    return _pressure_run(ap_dir, "float16")


def test_pressure_drops_widths_and_generation_continues(pressure_run):
    llm, start, widths, used, done, during, _ = pressure_run
    assert start == 8.0
    assert min(widths) < 8.0, "KV pressure never lowered the widths"
    assert max(used) > 2 * 8, "the KV cache never grew into the bytes the weights gave up"
    assert len(done) == 4 and all(o.finish_reason == "length" and o.completion_tokens == 96 for o in done.values())
    assert during["offload_triggers"] > 0 and during["bytes_offloaded"] > 0
    # planned ahead for what the requests will still need: one release when they arrive, not one per prefill chunk
    # (the loop that planned for the next step only wrote 19 here), and it covered the work: no preemption
    assert during["offload_triggers"] <= 2 and during["preemptions"] == 0
    st = llm.stats()
    assert st["reload_triggers"] > 0 and st["bytes_reloaded"] > 0
    assert (llm.planner.desired == 8).all(), "the planner did not ask for the full widths back"
    llm.table.check()


@pytest.mark.parametrize("run", ["pressure_run", "pressure_run_fp16"])
def test_widths_return_after_pressure(run, request):
    llm = request.getfixturevalue(run)[0]
    assert _mean_width(llm) == 8.0
    assert llm.mover.idle() and llm.pool.free_pages >= llm.pool.reserve_pages
    llm.table.check()
    pool, store = llm.pool, llm.mover.store
    for i, row in enumerate(llm.table.rows):  # every plane and LUT the kernels read equals the store's bytes
        for p in range(row.q):
            got = pool.page_view(row.planes[p].page, row.spec.plane_bytes)
            assert torch.equal(got.cpu(), store.tensor(i, "plane", p)), f"block {i} plane {p} differs from the store"
        got = pool.page_view(row.luts[row.q].page, row.spec.lut_bytes[row.q])
        assert torch.equal(got.cpu(), store.tensor(i, "lut", row.q)), f"block {i} LUT differs from the store"
    if DEVICE == "cpu":  # the finished requests' published blocks were kept, and the reloads took pages from them
        during = request.getfixturevalue(run)[5]
        assert llm.stats()["kv_reclaimed_blocks"] > during["kv_reclaimed_blocks"], "the reloads reclaimed no kept block"
    if run == "pressure_run_fp16" and DEVICE == "cpu":  # the free pages left between weight runs were too short
        assert llm.stats()["weight_relocations"] > 0, "the run no longer needs weight relocation"


def test_a_request_arriving_while_blocks_are_retained_takes_weight_bytes_not_them(ap_dir):
    """prefix_retention_s: the planner keeps retained kept blocks as it keeps the admitted work's blocks, so a new
    request arriving meanwhile is given room by lowering widths rather than by evicting them, and a later turn of an
    earlier request still finds its whole context computed (without retention the allocation evicts it)."""
    store = str(ap_dir / "store")
    probe = LLM(ap_dir, device=DEVICE, block_size=16, page_store_dir=store)
    budget = budget_with(probe, 8)
    found = {}
    for retention in (0.0, 30.0):
        llm = LLM(ap_dir, budget, DEVICE, block_size=16, max_num_batched_tokens=16, page_store_dir=store,
                  planner_knobs={"reload_dwell_steps": 1}, prefix_retention_s=retention)
        llm.kv._clock = lambda: 0.0
        first = llm.generate(PROMPTS[0], greedy(64), use_tqdm=False)[0]
        kept, width = llm.kv.num_cached_blocks, _mean_width(llm)
        assert kept == (len(first.prompt_token_ids) + 63) // 16 and llm.kv.num_retained_blocks == kept * (retention > 0)
        other = llm.generate(PROMPTS[1:], greedy(96), use_tqdm=False)  # needs more blocks than the free ones
        assert all(o.finish_reason == "length" for o in other)
        turn = llm.generate(first.prompt_token_ids + first.token_ids + [11], greedy(2), use_tqdm=False)[0]
        found[retention] = turn.num_cached_tokens
        if retention:
            assert llm.stats()["kv_evicted_blocks"] == 0 and _mean_width(llm) < width
        llm.table.check()
    assert found[0.0] < kept * 16 == found[30.0], found


def test_a_chat_s_next_turn_over_its_retained_history_moves_no_weight(ap_dir):
    """The next turn of a conversation whose history is retained: the planner counts that history once (retained,
    not also in the turn's demand), so where the turn fits beside it the widths stay put, as without retention
    (counted twice, it was released for and reloaded the step after the turn started)."""
    store = str(ap_dir / "store")
    probe = LLM(ap_dir, device=DEVICE, block_size=16, page_store_dir=store)
    budget = budget_with(probe, 18)
    for retention in (0.0, 30.0):
        llm = LLM(ap_dir, budget, DEVICE, block_size=16, max_num_batched_tokens=16, page_store_dir=store,
                  prefix_retention_s=retention)
        llm.kv._clock = lambda: 0.0
        first = llm.generate(PROMPTS[0], greedy(160), use_tqdm=False)[0]
        kept = llm.kv.num_cached_blocks
        assert kept == 10 and llm.kv.num_retained_blocks == kept * (retention > 0) and _mean_width(llm) == 8.0
        turn = llm.generate(first.prompt_token_ids + first.token_ids + [11], greedy(8), use_tqdm=False)[0]
        st = llm.stats()
        assert turn.num_cached_tokens == kept * 16 and _mean_width(llm) == 8.0, retention
        assert st["offload_triggers"] == st["reload_triggers"] == 0, (retention, st)


def test_retained_prefix_blocks_outlast_the_idle_reload_until_their_retention_ends(ap_dir):
    """prefix_retention_s: after the pressure run's requests end, the idle engine's reloads leave the kept blocks
    released within the retention (a later turn would find them) and widths stay down by their bytes; once the
    retention has passed, the reloads take them and the widths come home."""
    store = str(ap_dir / "store")
    probe = LLM(ap_dir, device=DEVICE, block_size=16, page_store_dir=store)
    budget = budget_with(probe, 8)
    llm = LLM(ap_dir, budget, DEVICE, block_size=16, max_num_batched_tokens=16, page_store_dir=store,
              reload_starts_per_step=0, planner_knobs={"reload_dwell_steps": 1}, prefix_retention_s=30.0)
    now = [0.0]
    llm.kv._clock = lambda: now[0]
    assert all(o.finish_reason == "length" for o in llm.generate(PROMPTS, greedy(96), use_tqdm=False))
    kept = llm.kv.num_cached_blocks
    assert kept > 0 and llm.kv.num_retained_blocks == kept and _mean_width(llm) < 8.0
    now[0] = 29.0
    for _ in range(200):
        if not llm.step_idle():
            break
    st = llm.stats()
    assert st["kv_cached_blocks"] == st["kv_retained_blocks"] == kept and st["kv_reclaimed_blocks"] == 0
    assert _mean_width(llm) < 8.0, "the reloads took the retained blocks' bytes"
    with pytest.raises(ValueError, match="prefix_retention_s"):
        LLM(ap_dir, device=DEVICE, page_store_dir=store, prefix_retention_s=-1.0)
    now[0] = 31.0
    for _ in range(200):
        if not llm.step_idle():
            break
    st = llm.stats()
    assert st["kv_retained_blocks"] == 0 and st["kv_reclaimed_blocks"] > 0 and _mean_width(llm) == 8.0
    llm.table.check()


@pytest.mark.parametrize("run", ["pressure_run", "pressure_run_fp16"])
def test_lazy_refresh_decides_as_refreshing_every_step(run, request):
    """The engine's planner, refreshing its standing plan only when its inputs change, wrote the same plans at the
    same steps as the every-step reference fed the same inputs, and recomputed less."""
    llm, *_, (ref, mismatches) = request.getfixturevalue(run)
    assert not mismatches, mismatches[:3]
    live = llm.planner.counters
    assert ref.counters["release"] == live["release"] > 0 and ref.counters["reload"] == live["reload"] > 0
    assert live["queue_hit"] >= ref.counters["queue_hit"]
    assert live["refresh"] < ref.counters["refresh"], (live, ref.counters)


def test_idle_engine_restores_widths_at_once(ap_dir):
    """Once no request is left, step_idle clears the reload window and reloads: the widths come back within a few
    boundaries, not reload_dwell_steps steps later (an idle server takes no steps)."""
    store = str(ap_dir / "store")
    probe = LLM(ap_dir, device=DEVICE, block_size=16, page_store_dir=store)
    budget = budget_with(probe, 8)
    llm = LLM(ap_dir, budget, DEVICE, block_size=16, max_num_batched_tokens=16, page_store_dir=store)
    assert llm.step_idle() is False and llm.stats()["reload_triggers"] == 0  # nothing lowered: nothing to do
    # static widths have no planner: nothing to do either (the engine actor would otherwise never sleep)
    assert LLM(ap_dir, device=DEVICE, bits=4, paging=False, page_store_dir=store).step_idle() is False
    llm.generate(PROMPTS, greedy(24), use_tqdm=False)
    assert _mean_width(llm) < 8.0 and llm.stats()["reload_triggers"] == 0, "the scenario no longer lowers widths"
    llm.add_request(PROMPTS[0], greedy(4))
    assert llm.step_idle() is False and _mean_width(llm) < 8.0  # a request waits: not idle
    llm.abort(llm.scheduler.waiting[0].request_id)
    assert llm.step_idle() is False  # its aborted output is still to be handed out
    assert [o.finish_reason for o in llm.step()] == ["abort"]
    calls = 1
    while llm.step_idle():
        calls += 1
        assert calls < 100, "the idle boundaries never settled"
    assert _mean_width(llm) == 8.0 and llm.stats()["reload_triggers"] > 0
    assert llm.mover.idle()
    llm.table.check()


def test_idle_reloads_come_in_slices(ap_dir):
    """step_idle(max_s=...) returns once max_s has passed, having started at least one reload: a server's idle loop
    lets an arriving request in between slices (the engine actor's lock) instead of after the whole reload, and the
    slices together bring the widths back as one unbounded call does; reloads refused with none under way end the
    call (False) rather than keep the caller spinning."""
    store = str(ap_dir / "store")
    probe = LLM(ap_dir, device=DEVICE, block_size=16, page_store_dir=store)
    llm = LLM(ap_dir, budget_with(probe, 8), DEVICE, block_size=16, max_num_batched_tokens=16, page_store_dir=store,
              reload_starts_per_step=1)
    # eight requests: with four, float16 KV on CUDA (half the bytes a block) lowered only 2 blocks (H100, session 49)
    llm.generate(PROMPTS * 2, greedy(24), use_tqdm=False)
    lowered = int((llm.committed_widths() < 8).sum())
    assert lowered > 2, "the scenario no longer lowers widths"
    before = llm.paging.move_requests
    assert llm.step_idle(max_s=0.0) is True  # one boundary, one reload started: work remains
    assert llm.paging.move_requests - before == 1
    # reloads refused with no move under way (no room): the call says there is nothing to do until memory changes
    # instead of True after 64 refused boundaries (the actor would call again every few ms, refused each time)
    request, widths = llm.mover.request, llm.committed_widths()
    llm.mover.request = lambda i, bits, **kw: False if "keep_free_pages" in kw else request(i, bits, **kw)
    refusals = llm.paging.move_refusals
    assert llm.step_idle() is False
    assert llm.paging.move_refusals - refusals == 1 and np.array_equal(llm.committed_widths(), widths)
    llm.mover.request = request
    # a request arriving between slices: its first step starts no more reloads than a busy step does (it counted
    # as idle while waiting, and started every reload the slices had left)
    reloads = []

    def counted(i: int, bits: int, **kw) -> bool:  # a reload passes keep_free_pages, an offload does not
        if "keep_free_pages" in kw:
            reloads.append(i)
        return request(i, bits, **kw)

    llm.mover.request = counted
    llm.add_request(PROMPTS[1], greedy(4))
    llm.step()
    assert len(reloads) == llm.options.reload_starts_per_step < lowered - 1
    while llm.has_unfinished():
        llm.step()
    llm.mover.request = request
    calls = 1
    while llm.step_idle(max_s=0.0):
        calls += 1
        assert calls < 20 * lowered, "the idle slices never settled"
    assert _mean_width(llm) == 8.0 and llm.mover.idle()
    assert [o.text for o in llm.generate(PROMPTS[:1], greedy(8), use_tqdm=False)] == [
        o.text for o in probe.generate(PROMPTS[:1], greedy(8), use_tqdm=False)]
    llm.table.check()


def test_settled_boundaries_overlap_the_forward_paged_or_not(ap_dir, pressure_run):
    """Decode steps whose boundary has nothing to do run it beside the forward: the paged engine once its widths
    are settled, and a static-width engine (no planner) on every step after the first."""
    llm = pressure_run[0]
    assert 0 < llm.paging.overlapped_boundaries < llm.num_steps  # not while requests waited or moves ran
    static = LLM(ap_dir, device=DEVICE, bits=4, paging=False, block_size=16, page_store_dir=str(ap_dir / "store"))
    static.generate(PROMPTS[:2], greedy(8), use_tqdm=False)
    assert static.paging.overlapped_boundaries == static.num_steps - 1


def test_reload_starts_per_step_are_capped_while_requests_run(ap_dir):
    """With requests running, at most `reload_starts_per_step` reloads start per boundary, and each starts beside
    its step's forward (widths climbing, KV to spare: the boundary runs after the launch); with nothing running
    the cap is off and the widths come all the way back."""
    store = str(ap_dir / "store")
    probe = LLM(ap_dir, device=DEVICE, block_size=16, page_store_dir=store)
    budget = budget_with(probe, 8)
    # a one-step reload window and a small hysteresis: the KV the short requests give back is reloaded at once
    llm = LLM(ap_dir, budget, DEVICE, block_size=16, max_num_batched_tokens=16, page_store_dir=store,
              reload_starts_per_step=1, planner_knobs={"reload_dwell_steps": 1, "hysteresis_blocks": 1})
    starts: dict[int, int] = {}
    before_launch: list[int] = []  # steps where a reload started before the forward while requests ran
    request, run = llm.mover.request, llm.runner.run
    launched = {"step": -1}

    def counted(i: int, b: int, keep_free_pages: int = 0, relocate: bool = True) -> bool:
        reload = b > llm.table.rows[i].q
        ok = request(i, b, keep_free_pages, relocate)
        if ok and reload and llm.scheduler.running:
            starts[llm.num_steps] = starts.get(llm.num_steps, 0) + 1
            if launched["step"] != llm.num_steps:
                before_launch.append(llm.num_steps)
        return ok

    def marked_run(batch):
        launched["step"] = llm.num_steps
        return run(batch)

    llm.mover.request, llm.runner.run = counted, marked_run
    # two short requests end early: their KV comes back while the long ones still run, so reloads start then
    for p, n in zip(PROMPTS, (8, 8, 96, 96)):
        llm.add_request(p, greedy(n))
    while llm.has_unfinished():
        llm.step()
    assert starts, "no reload started while requests ran: the scenario no longer tests the cap"
    assert max(starts.values()) == 1, starts
    assert not before_launch, f"reloads started before the launch at steps {before_launch} (of {sorted(starts)})"
    for _ in range(400):
        llm.step()
        if llm.mover.idle() and _mean_width(llm) == 8.0:
            break
    assert _mean_width(llm) == 8.0
    llm.table.check()


def test_move_requests_follow_the_planner(ap_dir):
    """_request_moves between boundaries: every offload starts, a move the planner changed its mind on is
    cancelled and retargeted, one it dropped is cancelled, and reloads start in block order until one is refused
    (here: it would take the KV blocks the admitted requests need)."""
    llm = LLM(ap_dir, device=DEVICE, block_size=16, page_store_dir=str(ap_dir / "store"))
    committed = llm.committed_widths()
    n = len(committed)
    want = committed.copy()
    want[:6] = committed[:6] - 2
    llm.planner.desired = want.copy()
    llm._request_moves(committed, 0)
    assert {i for i in range(n) if llm.mover.pending(i)} == set(range(6))
    assert llm._requested == {i: int(want[i]) for i in range(6)}
    want[0], want[1] = committed[0] - 1, committed[1]  # retarget block 0, drop block 1's move
    llm.planner.desired = want.copy()
    llm._request_moves(committed, 0)
    assert llm._requested == {0: int(want[0]), **{i: int(want[i]) for i in range(2, 6)}}
    assert llm.table.rows[0].d == want[0] and llm.table.rows[1].d == committed[1]
    llm.mover.boundary()  # the CPU's copies are done: everything requested commits
    committed = llm.committed_widths()
    assert np.array_equal(committed, want)
    back = want.copy()
    back[:6] = llm.table.parent_bits
    llm.planner.desired = back
    keep = llm.pool.free_pages - llm.pool.reserve_pages - 1  # room for no reload's pages
    llm._request_moves(committed, llm.pool.bytes_of(keep))
    assert not any(llm.mover.pending(i) for i in range(n)) and llm.paging.move_refusals == 1
    assert llm.paging.offload_refusals == 0  # a reload's refusal
    llm._request_moves(committed, 0)
    assert {i for i in range(n) if llm.mover.pending(i)} == {0, 2, 3, 4, 5}  # block 1 never moved
    llm.mover.boundary()
    assert np.array_equal(llm.committed_widths(), back)
    llm.table.check()


def test_compactions_for_reloads_are_rationed_while_requests_run(ap_dir):
    """While requests run, a reload may compact the pool once per `compact_every_steps` steps (a compaction scans the
    pool on the host); idle, every reload may."""
    llm = LLM(ap_dir, device=DEVICE, block_size=16, page_store_dir=str(ap_dir / "store"), compact_every_steps=3)
    home = llm.committed_widths()
    low = home.copy()
    low[:4] -= 2
    llm.planner.desired = low
    llm._request_moves(home, 0)
    llm.mover.boundary()
    committed = llm.committed_widths()
    assert np.array_equal(committed, low)
    llm.planner.desired = home  # reloads wanted
    calls = []

    def request(i, b, keep_free_pages=0, relocate=True):
        calls.append(relocate)
        llm.pool.relocations += relocate  # as if the reload needed a compaction
        return False  # and was refused anyway: it stays wanted
    llm.mover.request = request
    llm.scheduler.running.append(object())  # a request runs (only its presence counts here)
    for step in range(7):
        llm.num_steps = step
        llm._request_moves(committed, 0)
    assert calls == [True, False, False, True, False, False, True]
    llm.scheduler.running.clear()
    calls.clear()
    for step in range(7, 10):
        llm.num_steps = step
        llm._request_moves(committed, 0)
    assert calls == [True, True, True]


def test_routing_read_lands_one_step_later(ap_dir):
    """An observed step's routing statistics reach the planner during the next step (their host copy was queued
    right behind the observed step's forward), or at the next routing_mass() call."""
    llm = LLM(ap_dir, device=DEVICE, block_size=16, page_store_dir=str(ap_dir / "store"), observe_every=2)
    mass = llm.planner.routing.mass.copy()
    llm.add_request(PROMPTS[0], greedy(6))
    llm.step()  # step 0 is observed: its statistics wait
    assert llm._routing_unread and np.array_equal(llm.planner.routing.mass, mass)
    llm.step()  # step 1 reads them while it runs, and observes nothing itself
    assert not llm._routing_unread and not np.array_equal(llm.planner.routing.mass, mass)
    mass = llm.planner.routing.mass.copy()
    llm.step()  # step 2 observed
    assert llm._routing_unread
    got = llm.routing_mass()
    assert not llm._routing_unread and not np.array_equal(got, mass)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA streams: PAGEDWEIGHT_TEST_DEVICE=cuda (run on the H200)")
@pytest.mark.parametrize("held", ["observe_layers", "prefetch"])
@pytest.mark.parametrize("step", [2, 4])
def test_an_observed_step_s_token_read_does_not_wait_for_its_routing_fold(ap_dir, monkeypatch, held, step):
    """The observed step's routing fold (`observe_layers`) and its merge and host copy (`prefetch`) are queued
    behind its token copy: held up on the device (a sleep queued before either), they leave the step's token read
    alone, so the step returns while the forward's stream still runs them; the next step reads the statistics.
    Step 0 is the prefill (observed), step 2 the first observed decode step (its fold builds what later ones reuse:
    the layers' offsets, copied without a wait), step 4 a later one."""
    from pagedweight.signals import RouterStats

    llm = LLM(ap_dir, device=DEVICE, block_size=16, page_store_dir=str(ap_dir / "store"), observe_every=2)
    llm.add_request(PROMPTS[0], greedy(8))
    for _ in range(step):
        llm.step()
    mass = llm.planner.routing.mass.copy()
    method = getattr(RouterStats, held)

    def slow(self, *args):
        torch.cuda._sleep(500_000_000)  # ~0.25 s of the forward's stream before the method's device work
        method(self, *args)

    monkeypatch.setattr(RouterStats, held, slow)
    outs = llm.step()  # an observed decode step
    still_running = not torch.cuda.current_stream(llm.device).query()
    torch.cuda.synchronize(llm.device)
    assert still_running, "the step waited for its routing statistics' device work"
    assert len(outs) == 1 and outs[0].completion_tokens == step + 1 and llm._routing_unread
    llm.step()
    assert not llm._routing_unread and not np.array_equal(llm.planner.routing.mass, mass)


def test_residual_heads_see_each_requests_tokens_so_far(ap_dir, monkeypatch):
    """The planner's features (what the residual heads read) describe every token the request's observed steps
    computed, its prompt and each decoded token, as the heads were fitted on whole sequences: with one request,
    those of a plain RouterStats that saw every one of those steps (one request: its merge weight scales every sum
    alike, so the features are the same)."""
    from pagedweight.signals import RouterStats

    llm = LLM(ap_dir, device=DEVICE, block_size=16, page_store_dir=str(ap_dir / "store"), observe_every=2)
    assert llm.planner.heads is not None
    ref = RouterStats(llm.config.num_hidden_layers, llm.config.num_experts)
    call, layers = RouterStats.__call__, RouterStats.observe_layers

    def tee(method):
        def observe(self, *args):
            if self is llm.router_stats and self.active:
                method(ref, *args)
            method(self, *args)
        return observe

    monkeypatch.setattr(RouterStats, "__call__", tee(call))
    monkeypatch.setattr(RouterStats, "observe_layers", tee(layers))
    seen, observe = [], llm.planner.observe
    llm.planner.observe = lambda mass, phi: (seen.append((phi.copy(), ref.features())), observe(mass, phi))
    llm.generate([PROMPTS[1]], greedy(12), use_tqdm=False)
    assert len(seen) >= 5
    for phi, want in seen:
        np.testing.assert_allclose(phi, want, rtol=1e-5, atol=1e-7)
    assert (seen[-1][0][:, 2] > seen[1][0][:, 2]).any()  # a max |x| over more tokens than the last step's


def test_router_observer_stays_installed_and_folds_only_observed_steps(ap_dir):
    """The engine installs its RouterStats once and only arms it for observed steps: before a step's launch it
    writes no observer (24 writes a step cost host time there), and an unobserved step's forward folds nothing.
    An observer someone else replaced (a direct forward of the model sets None) is installed again at the next step."""
    # without CUDA graphs: a decode graph's capture installs its recording observer once per shape (on the GPU, the
    # first decode step), which is not the per-step write this counts
    llm = LLM(ap_dir, device=DEVICE, block_size=16, page_store_dir=str(ap_dir / "store"), observe_every=2,
              cuda_graphs=False)
    stats = llm.router_stats
    llm.add_request(PROMPTS[0], greedy(8))
    llm.step()  # observed (step 0): installs and arms
    assert all(layer.mlp.observer is stats for layer in llm.model.layers) and not stats.active
    writes = []
    install = llm.model.set_router_observer
    llm.model.set_router_observer = lambda fn: (writes.append(fn), install(fn))
    llm.step()  # step 1 reads step 0's window while it runs and observes nothing
    assert not stats._ids and stats._acc is None and stats._copy is None
    llm.step()  # step 2 observed: a new window of its own tokens only
    assert writes == [] and llm._routing_unread and stats.mass.sum() > 0
    install(None)  # what a direct forward of the model does (calibration, planner_quality)
    llm.step()
    assert writes == [stats] and llm.model.layers[-1].mlp.observer is stats


def test_preempts_when_even_the_largest_release_is_short(ap_dir):
    probe = LLM(ap_dir, device=DEVICE, block_size=4, bits=3, paging=False, page_store_dir=str(ap_dir / "store"))
    weights_3 = probe.stats()["resident_weight_bytes"]
    outside, kv_block = probe.weights_outside_bytes, probe.kv.block_bytes
    reserve = probe.pool.bytes_of(probe.pool.reserve_pages)
    budget = outside + weights_3 + reserve + 24 * kv_block  # even at 3 bits only 24 blocks: 4 x 15 needed
    llm = LLM(ap_dir, budget, DEVICE, block_size=4, bits=3, max_num_batched_tokens=16,
              page_store_dir=str(ap_dir / "store"))
    st = llm.stats()  # what the budget covers (computed), whole pages of the pool: at most one page short of it
    assert st["budget_bytes"] == outside + llm.pool.bytes_of(llm.pool.capacity_pages)
    assert budget - llm.page_bytes < st["budget_bytes"] <= budget
    if DEVICE == "cuda":  # measured for the whole process (the probe's engine is alive too)
        assert st["device_peak_reserved_bytes"] >= st["device_reserved_bytes"] >= st["budget_bytes"]
    else:
        assert st["device_reserved_bytes"] is None and st["device_peak_reserved_bytes"] is None
    ref = LLM(ap_dir, device=DEVICE, block_size=4, bits=3, paging=False, page_store_dir=str(ap_dir / "store"))
    outs = llm.generate(PROMPTS, greedy(40), use_tqdm=False)
    assert llm.stats()["preemptions"] > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref.generate(PROMPTS, greedy(40), use_tqdm=False)]


def test_run_command(ap_dir, tmp_path, capsys, monkeypatch):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\n" + '{"prompt": "class Node:"}\n')
    args = parser.parse_args(["run", "--model", str(ap_dir), "--prompts", str(prompts), "--max-tokens", "4",
                              "--device", "cpu", "--page-store-dir", str(ap_dir / "store"), "--show", "1"])
    assert run(args) == 0
    out = capsys.readouterr().out
    assert "requests 2 (length 2)" in out and "tokens/s" in out and "KV blocks" in out and "expert widths" in out
    assert "MiB under the budget" in out and "0.0 MiB of activation reserve)" in out  # CPU: the default is 0
    summary = tmp_path / "summary.json"
    auto = parser.parse_args(["run", "--model", str(ap_dir), "--prompts", str(prompts), "--max-tokens", "4",
                              "--device", "cpu", "--page-store-dir", str(ap_dir / "store"), "--show", "0",
                              "--gpu-memory-budget", "256MiB", "--activation-reserve", "auto",
                              "--summary-json", str(summary)])
    assert run(auto) == 0
    out = capsys.readouterr().out
    assert "requests 2 (length 2)" in out and "MiB of activation reserve, measured at start-up" in out
    assert "budget 256.0 MiB (268,435,456 B)" in out
    fig = json.loads(summary.read_text())  # the printed figures, as numbers
    assert fig["gpu_memory_budget"] == 256 << 20 >= fig["budget_bytes"] > 255 << 20 and fig["reserve_measured"] and fig["activation_reserve_bytes"] == 0
    assert fig["requests"] == 2 and fig["finish_reasons"] == {"length": 2} and fig["generated_tokens"] == 8
    assert fig["kv_free_blocks_min"] <= fig["kv_free_blocks_at_start"] <= fig["kv_total_blocks"]
    assert fig["mean_width_start"] == fig["mean_width_idle"] > 0 and fig["device_peak_reserved_bytes"] is None
    assert f"generated 8 in {fig['elapsed_s']:.2f} s" in out
    # the default page store (RAM, in /dev/shm) goes with the run unless kept; a given directory stays
    from pagedweight.apformat import load_ap
    from pagedweight.runner import planes_id

    default_store = Path(f"/dev/shm/pagedweight-{planes_id(load_ap(ap_dir))}")
    brief = ["run", "--model", str(ap_dir), "--num-prompts", "1", "--max-tokens", "1", "--device", "cpu", "--show", "0"]
    assert run(parser.parse_args(brief + ["--keep-page-store"])) == 0 and default_store.is_dir()
    # a store the run found (another engine's of the node, or one kept) stays: engines may map it; one it wrote goes
    assert run(parser.parse_args(brief)) == 0 and default_store.is_dir()
    PageStore.destroy(default_store)
    assert run(parser.parse_args(brief)) == 0 and not default_store.exists()
    assert (ap_dir / "store").is_dir()
    capsys.readouterr()
    # a request that fails says why (on stderr and in the summary), and the run's exit code says it failed
    long = tmp_path / "long.txt"
    long.write_text("def add(a, b):\n" + "x = 1; " * 2000 + "\n")
    failing = parser.parse_args(["run", "--model", str(ap_dir), "--prompts", str(long), "--max-tokens", "2",
                                 "--device", "cpu", "--page-store-dir", str(ap_dir / "store"), "--show", "0",
                                 "--summary-json", str(summary)])
    assert run(failing) == 1
    err = capsys.readouterr().err
    assert "request 1 failed: " in err and "max_model_len" in err
    assert list(json.loads(summary.read_text())["errors"]) == ["1"]
    with pytest.raises(ValueError, match="--activation-reserve"):
        run(parser.parse_args(["run", "--model", str(ap_dir), "--num-prompts", "1", "--activation-reserve", "0.5"]))
    # bad budgets and devices are refused before the HF model is converted (seconds to minutes), not after
    hf = ["run", "--model", str(ROOT / "models" / "pw-tiny-moe"), "--num-prompts", "1",
          "--cache-dir", str(tmp_path / "cache")]
    bad = [(["--gpu-memory-budget", "0"], "positive"), (["--gpu-memory-budget", "1.5"], r"in \(0, 1\]"),
           (["--device", "tpu9"], "device 'tpu9'")]
    if not torch.cuda.is_available():
        bad.append((["--device", "cuda"], "CUDA is not available"))
    for extra, match in bad:
        with pytest.raises(ValueError, match=match):
            run(parser.parse_args(hf + extra))
    assert not (tmp_path / "cache").exists()
    # a CUDA device other than the current one: the engine's streams and kernel launches are the current device's
    from pagedweight.engine import check_device

    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "current_device", lambda: 0)
        assert check_device("cuda") == torch.device("cuda") and check_device("cuda:0") == torch.device("cuda:0")
        with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES=1 and device 'cuda'"):
            check_device("cuda:1")
    assert serving_reserve(2 << 30, "cuda:0") == "auto"  # the entry points' default: the budget bounds it all
    assert serving_reserve(None, "cuda") == serving_reserve(2 << 30, "cpu") == 0
    assert parse_budget("2GiB") == 2 << 30 and parse_budget("0.5") == 0.5 and parse_budget("1000") == 1000
    with pytest.raises(ValueError):
        parse_budget("lots")
    assert parse_budget("0", "--activation-reserve", allow_zero=True) == 0  # a reserve may be 0, a budget not
    for text in ("0", "0MiB", "0.0", "1.01"):
        with pytest.raises(ValueError, match="--gpu-memory-budget"):
            parse_budget(text)


# ---------------------------------------------------------------- host overhead of a step
SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::_unique2", "aten::unique_consecutive",
            "aten::unique_dim", "aten::masked_select"}


@pytest.fixture
def host_reads(monkeypatch):
    """Counts Python-level reads of tensor data (.item/.tolist/.cpu/.numpy) from here on."""
    from collections import Counter

    counts = Counter()
    for name in ("item", "tolist", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(t, *a, _name=name, _original=original, **kw):
            counts[_name] += 1
            return _original(t, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts


def test_decode_step_reads_the_device_once(hf_dir, host_reads):
    """Batch-1 decode with the experts' accelerator dispatch: no syncing op in the layers, and the one host read
    of the step is the sampled token."""
    from torch.profiler import ProfilerActivity, profile

    llm = LLM(hf_dir[0], block_size=4)
    for layer in llm.model.layers:
        layer.mlp.experts.gather_max_pairs = llm.config.num_experts
    llm.add_request(PROMPTS[0], greedy(8))
    for _ in range(3):
        llm.step()
    host_reads.clear()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        outs = llm.step()
    assert len(outs) == 1 and outs[0].completion_tokens == 4
    names = [e.name for e in prof.events()]
    assert not SYNC_OPS & set(names)
    assert sum(host_reads.values()) == 1, host_reads
    # the packed step is one row through the model: one attention call per layer
    assert names.count("aten::scaled_dot_product_attention") == llm.config.num_hidden_layers
    while llm.has_unfinished():
        outs += llm.step()
    grouped = LLM(hf_dir[0], block_size=4).generate([PROMPTS[0]], greedy(8), use_tqdm=False)[0]
    assert outs[-1].token_ids == grouped.token_ids  # both expert formulations generate the same tokens


def test_router_stats_read_back_once(host_reads):
    """The observer queues device work per layer; the first read of the statistics is the one host copy."""
    from pagedweight.signals import RouterStats

    L, E = 3, 6
    stats = RouterStats(L, E)
    torch.manual_seed(0)
    want = np.zeros((L, E))
    inputs = []
    for layer in range(L):
        w, ids = torch.softmax(torch.randn(4, E), -1).topk(2)
        np.add.at(want[layer], ids.flatten().tolist(), w.flatten().tolist())
        inputs.append((layer, torch.randn(4, 8), ids, w))
    host_reads.clear()  # the reference above read its own tensors
    for args in inputs:
        stats(*args)
    assert sum(host_reads.values()) == 0
    mass = stats.mass
    reads = sum(host_reads.values())
    assert reads == 2  # acc.cpu().numpy()
    assert np.allclose(mass, want, rtol=1e-6)
    stats.features()
    assert sum(host_reads.values()) == reads


def test_routing_mass_accessors(pressure_run, hf_dir):
    llm = pressure_run[0]
    L, E = llm.config.num_hidden_layers, llm.config.num_experts
    before = llm.routing_mass()
    assert before.shape == (L, E) and np.allclose(before.sum(axis=1), 1.0)
    mass = np.arange(L * E, dtype=np.float64).reshape(L, E)
    mass[1] = 0.0
    try:
        llm.set_routing_mass(mass)
        got = llm.routing_mass()
        assert np.allclose(got[0], mass[0] / mass[0].sum()) and np.allclose(got[1], 1.0 / E)
        got[0] = 0.0
        assert llm.routing_mass()[0].sum() == pytest.approx(1.0)  # a copy, not the planner's array
        with pytest.raises(ValueError):
            llm.set_routing_mass(mass[:1])
    finally:
        llm.set_routing_mass(before)
    assert np.allclose(llm.routing_mass(), before)
    with pytest.raises(RuntimeError):
        LLM(hf_dir[0]).routing_mass()


def test_queue_time_ends_at_the_first_step_a_request_gets(hf_dir):
    """RequestOutput.queued_s: arrival to the first step the scheduler gave the request. With one slot the second
    request waits for the whole first one: its queue time covers at least the first's steps; the first waits for
    nothing."""
    import time

    llm = LLM(hf_dir[0], max_num_seqs=1, detokenize=False)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    llm.add_request([1, 2, 3, 4, 5], params, request_id="a")
    llm.add_request([6, 7, 8], params, request_id="b")
    added = time.perf_counter()
    first: dict[str, float | None] = {}
    a_done = None
    while llm.has_unfinished():
        for out in llm.step():
            t = time.perf_counter()
            if out.completion_tokens and out.request_id not in first:
                first[out.request_id] = out.queued_s
            if out.request_id == "a" and out.finished:
                a_done = t
    qa, qb = first["a"], first["b"]
    assert qa is not None and 0 <= qa < qb
    assert qb >= a_done - added  # b's first step came after a's last one (b arrived before `added`)


def test_converted_cache_follows_the_source(tmp_path, monkeypatch):
    """`pagedweight run` on a HF dir converts into a cache entry named by the source's fingerprint: a retrained
    model (a file with another size or time), another calibration text or other planner defaults get a new entry
    instead of the stale planes of the old one."""
    import shutil

    from pagedweight.convert import source_fingerprint

    src = tmp_path / "pw-tiny-moe"
    shutil.copytree(BUNDLED, src)
    first = source_fingerprint(src)
    assert source_fingerprint(src) == first
    weights = src / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert source_fingerprint(src) != first
    # and another calibration text, or other planner defaults (the manifest records them), another entry too
    calib = tmp_path / "calib.txt"
    calib.write_text("one text")
    with_text = source_fingerprint(src, calib)
    assert with_text != source_fingerprint(src)
    calib.write_text("another text")
    assert source_fingerprint(src, calib) != with_text
    from dataclasses import replace

    from pagedweight import knobs

    defaults = knobs.PlannerKnobs
    monkeypatch.setattr(knobs, "PlannerKnobs", lambda: replace(defaults(), trigger_blocks=defaults().trigger_blocks + 1))
    assert source_fingerprint(src, calib) != with_text

    monkeypatch.undo()
    # and the dtype the automatic conversion calibrates in
    from pagedweight import convert

    monkeypatch.setattr(convert, "AUTO_CONVERT_DTYPE", "float32")
    assert source_fingerprint(src, calib) != with_text


def test_the_automatic_conversion_calibrates_in_the_checkpoint_s_dtype(tmp_path, monkeypatch):
    """`pagedweight run` / `serve` on a HF model convert it in its own dtype (the bundled model's bfloat16): in
    float32 a Qwen1.5-MoE conversion needs more than an H100 holds."""
    from pagedweight import convert

    calls = []

    def fake(src, out, calib, **kw):
        calls.append(kw)
        (Path(out) / "manifest.msgpack").parent.mkdir(parents=True, exist_ok=True)
        (Path(out) / "manifest.msgpack").write_bytes(b"")

    monkeypatch.setattr(convert, "convert", fake)
    out = convert.ap_checkpoint_for(BUNDLED, tmp_path / "cache", "cpu")
    assert calls == [{"sensitivity": "fisher", "device": "cpu", "dtype": "auto"}] and out.parent == tmp_path / "cache"
    assert convert.ap_checkpoint_for(BUNDLED, tmp_path / "cache", "cpu") == out and len(calls) == 1  # cached


def test_the_automatic_conversion_takes_activation_statistics_where_fisher_s_do_not_fit(tmp_path, monkeypatch):
    """On a GPU whose free memory cannot hold the model and its Fisher sums (computed from the parameter counts) the
    automatic conversion calibrates with activation statistics, in a cache entry of its own; where they fit, Fisher."""
    from pagedweight import convert
    from pagedweight.checkpoint import read_config

    cfg = read_config(BUNDLED)
    need = convert.conversion_device_bytes(cfg, cfg.dtype, "fisher")
    from pagedweight.models import build_model

    experts = sum(p.numel() for layer in build_model(cfg).layers for p in layer.mlp.experts.parameters())
    assert need == convert.conversion_device_bytes(cfg, cfg.dtype, "activation") + 4 * experts
    calls = []

    def fake(src, out, calib, **kw):
        calls.append(kw["sensitivity"])
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "manifest.msgpack").write_bytes(b"")

    monkeypatch.setattr(convert, "convert", fake)
    monkeypatch.setattr(convert, "release_cached", lambda device: None)
    outs = []
    for free, cache in ((int(need * 1.2), "a"), (int(need * 1.1), "b")):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None, free=free: (free, 2 * free))
        outs.append(convert.ap_checkpoint_for(BUNDLED, tmp_path / cache, "cuda"))
    assert calls == ["fisher", "activation"] and outs[0].name != outs[1].name
    # a converted entry, either kind, is used without asking the GPU
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: pytest.fail("asked the GPU"))
    assert [convert.ap_checkpoint_for(BUNDLED, tmp_path / c, "cuda") for c in "ab"] == outs and len(calls) == 2


def test_the_first_token_s_text_is_what_it_adds_to_the_prompt():
    """A SentencePiece-style decoder (Mixtral's) strips the leading space of a text that starts with it: the first
    generated token is decoded after the prompt's last tokens (vLLM's offsets), so "The capital is" + " the fox"
    streams " the fox", not "the fox"; the byte-level case is unchanged."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from pagedweight.tokenizer import TextTokenizer

    vocab = {"<unk>": 0, "▁The": 1, "▁capital": 2, "▁is": 3, "▁the": 4, "▁fox": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    engine = types.SimpleNamespace(tokenizer=TextTokenizer(tok, None, ()))
    prompt = tok.encode("The capital is").ids
    assert prompt == [1, 2, 3] and tok.decode([4, 5]) == "the fox"
    seq = Sequence("r", prompt, SamplingParams(max_tokens=4))
    pieces = []
    for t in (4, 5):
        seq.append_token(t, 0.0)
        before = seq.text
        LLM._extend_text(engine, seq)
        pieces.append(seq.text[len(before):])
    assert pieces == [" the", " fox"] and seq.text == tok.decode(prompt + [4, 5])[len(tok.decode(prompt)):]


def test_logprob_token_strings_join_into_the_text_with_a_sentencepiece_decoder():
    """The API's per-token strings are what each token adds to the text: with a decoder that strips a leading space
    ("▁the" alone decodes to "the") they used to lose their spaces, and joined they no longer gave the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from pagedweight.actors.openai_app import token_logprobs
    from pagedweight.tokenizer import TextTokenizer

    vocab = {"<unk>": 0, "▁The": 1, "▁capital": 2, "▁is": 3, "▁the": 4, "▁fox": 5, "▁a": 6, "a": 7}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    wire = token_logprobs(TextTokenizer(tok, None, ()), [4, 5], [{4: -0.1, 5: -2.0}, {5: -0.2, 4: -1.5}], 2)
    assert [w["token"] for w in wire] == [" the", " fox"] and [w["top"][1][0] for w in wire] == [" fox", " the"]
    assert wire[0]["bytes"] == list(b" the")


def test_decode_rows_are_bounded_by_the_served_length(hf_dir):
    """The decode attention kernel's limit is checked against the longest row the engine serves (max_model_len),
    not the model's positions: a 128K-position model served at 8K kept the gather + SDPA path."""
    llm = LLM(hf_dir[0], max_model_len=64, block_size=16)
    assert llm.kv.max_keys == 64 + 16
    assert LLM(hf_dir[0], block_size=16).kv.max_keys == llm.config.max_position_embeddings + 16


def test_a_prompt_scored_again_fits_where_it_fit_the_first_time():
    """A perplexity window scored twice in a cache of 12 blocks (the window needs 9): the second pass found the
    first's blocks kept, computed copies beside them (a scoring request reads its own K/V) and held both to its
    end, and failed with 33 of 36 prompt scores. Both passes now finish with every score, and equal ones."""
    llm = LLM(BUNDLED, block_size=4, kv_cache_bytes=12 * 4 * 4096, max_num_batched_tokens=16, detokenize=False)
    window = [(7 * i + 11) % 500 + 3 for i in range(36)]  # 9 blocks
    params = sampling.SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    outs = [llm.generate([window], params, use_tqdm=False)[0] for _ in range(2)]
    for out in outs:
        assert out.finish_reason == "length" and out.error is None and len(out.prompt_logprobs) == 36
    assert outs[0].prompt_logprobs == outs[1].prompt_logprobs
