"""Static-shape decode steps (runner.DecodeGraphs): the code a CUDA graph captures, against the packed eager step.

On the CPU the static path runs eagerly. With PAGEDWEIGHT_TEST_DEVICE=cuda the same tests capture and replay
whole-step graphs (and check that they replayed), so width changes, LUT-class changes and pool relocation of KV
pages and weight runs between replays are checked there against engines that never captured anything
(`cuda_graphs=False`).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.decode_inputs import Tables, stand_in

from pagedweight.engine import LLM
from pagedweight.host_copy import HostCopy
from pagedweight.models.model import MoEForCausalLM
from pagedweight.runner import (CAPTURE_ATTEMPTS, APExperts, CaptureGate, DecodeGraphs, ModelRunner, decode_batch_sizes,
                                lut_width)
from pagedweight.sampling import SamplingParams
from pagedweight.sequence import Sequence
from helpers import budget_with

torch.set_num_threads(1)

DEVICE = os.environ.get("PAGEDWEIGHT_TEST_DEVICE", "cpu")
BUNDLED = Path(__file__).resolve().parents[1] / "models" / "pw-tiny-moe"
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\ndef main(argv):\n    args = parse(argv)", "class Stack:",
           "for i in range(10):\n    print(i)", "x = 1", "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):"]
TOL = dict(rtol=1e-4, atol=1e-4) if DEVICE == "cpu" else dict(rtol=3e-2, atol=3e-2)  # fp16 and atomics on CUDA


def static_decode(llm: LLM, max_num_seqs: int = 4) -> DecodeGraphs:
    """Give llm a runner whose decode steps take the static path (graphs on CUDA, eager on the CPU)."""
    llm.runner.close()
    llm.runner = ModelRunner(llm.model, llm.kv, llm.device, max_num_seqs=max_num_seqs,
                             max_model_len=llm.max_model_len, layer_kernels=llm.options.layer_kernels,
                             packed_layer_kernels=llm.options.packed_layer_kernels)
    return llm.runner.decode


def log_logits(llm: LLM) -> list[tuple[list[str], torch.Tensor]]:
    """Every step's sampled request ids and logits (copied: a replayed graph's logits are overwritten next step)."""
    log, run = [], llm.runner.run

    def logged(batch):
        seqs, logits, prompt = run(batch)
        log.append(([s.request_id for s in seqs], logits.float().cpu().clone()))
        return seqs, logits, prompt
    llm.runner.run = logged
    return log


def follow_reference(ref: LLM, llm: LLM) -> None:
    """llm samples the tokens ref sampled in the same step, after checking that its own choice differs only at a
    near tie (within TOL of ref's token's logit). Exact on the CPU; on CUDA, fp16 and the kernels' atomic sums
    (nondeterministic order) can flip a near tie, after which the two runs would no longer be comparable."""
    sampled: list[list[int]] = []
    ref_pick, llm_pick = ref.sampler.pick, llm.sampler.pick

    def ref_sampler(logits, params, generators, *rest):
        sampled.append(ref_pick(logits, params, generators, *rest).tolist())
        return HostCopy(torch.tensor(sampled[-1], dtype=torch.long))

    def llm_sampler(logits, params, generators, *rest):
        own, want = llm_pick(logits, params, generators, *rest).tolist(), sampled[-1]
        for row, (a, b) in enumerate(zip(own, want)):
            if a != b:
                top, theirs = float(logits[row, a]), float(logits[row, b])
                assert top - theirs <= TOL["atol"] + TOL["rtol"] * abs(top), (row, a, b, top, theirs)
        return HostCopy(torch.tensor(want, dtype=torch.long))
    ref.sampler.pick, llm.sampler.pick = ref_sampler, llm_sampler


def lockstep(ref: LLM, llm: LLM, prompts: list[str], params: list[SamplingParams], between=None) -> dict[str, list]:
    """Serve the same requests on both engines a step at a time (between(step) runs on both before each step);
    every step's logits agree, and so do the tokens (llm follows ref's at a near tie). Returns request id ->
    tokens."""
    logs = log_logits(ref), log_logits(llm)
    follow_reference(ref, llm)
    for prompt, p in zip(prompts, params):
        assert ref.add_request(prompt, p) == llm.add_request(prompt, p)
    done: dict[str, list] = {}
    step = 0
    while ref.has_unfinished():
        if between is not None:
            for engine in (ref, llm):
                between(engine, step)
        outs = ref.step()
        assert [(o.request_id, o.token_ids) for o in llm.step()] == [(o.request_id, o.token_ids) for o in outs]
        done.update({o.request_id: o.token_ids for o in outs if o.finished})
        step += 1
    assert not llm.has_unfinished()
    assert len(logs[0]) == len(logs[1])
    for (ids_a, a), (ids_b, b) in zip(*logs):
        assert ids_a == ids_b
        torch.testing.assert_close(b, a, **TOL)
    return done


def check_used(decode: DecodeGraphs, replays_at_least: int = 1) -> None:
    """The static path ran: eagerly on the CPU, replayed from graphs on CUDA."""
    if DEVICE == "cuda":
        assert decode.stats.captured > 0 and decode.stats.replayed >= replays_at_least, decode.stats
    else:
        assert decode.stats.eager > 0 and decode.stats.captured == decode.stats.replayed == 0, decode.stats


def test_decode_batch_sizes():
    assert decode_batch_sizes(1) == [1]
    assert decode_batch_sizes(4) == [1, 2, 4]
    assert decode_batch_sizes(6) == [1, 2, 4, 6]
    assert decode_batch_sizes(32) == [1, 2, 4, 8, 16, 32]


def test_capture_gate_first_sight_per_family():
    """A shape's first sight runs eagerly unless a shape of its family ran before; failed captures still bound it."""
    gate = CaptureGate()
    assert not gate.allows((1, 2), family=1) and gate.allows((1, 2), family=1)  # first sight, then capture
    assert gate.allows((1, 4), family=1)  # a new shape of a family that ran: at once
    assert not gate.allows((2, 2), family=2) and not gate.allows("other") and gate.allows("other")
    for _ in range(CAPTURE_ATTEMPTS):
        gate.failed((1, 8))
    assert not gate.allows((1, 8), family=1) and gate.allows((1, 16), family=1)


def test_longer_tables_capture_at_first_sight():
    """One request decoding across block buckets 2, 4, 8, 16 (graph keys of one batch size under the same LUT
    classes): on CUDA only its first decode step runs eagerly (kernels compile outside any capture), and each longer
    bucket is captured at its first step (session 50: two slow steps per bucket before, an eager one and the
    capture). Logits and tokens as an engine without graphs."""
    kw = dict(device=DEVICE, block_size=4, max_num_batched_tokens=16)
    ref, llm = LLM(BUNDLED, cuda_graphs=False, **kw), LLM(BUNDLED, **kw)
    decode = static_decode(llm, max_num_seqs=4)
    prompt = "x = 1"
    assert len(llm.tokenizer.encode(prompt)) <= 8  # two blocks at most: every bucket from 2 (or 1) to 16 is crossed
    lockstep(ref, llm, [prompt], [SamplingParams(max_tokens=50, ignore_eos=True)])
    steps = decode.stats.eager + decode.stats.replayed  # a captured step replays its graph
    assert steps == 49 and decode.stats.capture_failures == 0, decode.stats
    if DEVICE == "cuda":
        assert decode.stats.eager == 1 and decode.stats.captured == len(decode._graphs) >= 4, decode.stats
    else:
        assert decode.stats.eager == steps, decode.stats


def test_warm_up_runs_every_batch_size_and_leaves_nothing():
    """DecodeGraphs.warm_up (an engine's start on CUDA): one step of every batch size for a stand-in request, whose
    families the capture gate then knows; no router observer sees them, the stand-in's KV block and table slot are
    free again, and the engine then serves as one that never warmed up."""
    kw = dict(device=DEVICE, block_size=4, max_num_batched_tokens=16)
    ref, llm = LLM(BUNDLED, cuda_graphs=False, **kw), LLM(BUNDLED, **kw)
    decode = static_decode(llm, max_num_seqs=4)
    free, slots, seen = llm.kv.num_free_blocks, sorted(decode._free_slots), []
    llm.model.set_router_observer(lambda *args: seen.append(args))
    assert decode.warm_up() == len(decode.batch_sizes) == decode.stats.warmed == 3
    luts = frozenset(decode._lut_classes())
    assert decode._gate.families == {(rows, luts) for rows in (1, 2, 4)} and not seen
    assert llm.kv.num_free_blocks == free and sorted(decode._free_slots) == slots and not decode._slots
    llm.model.set_router_observer(None)
    lockstep(ref, llm, PROMPTS[:3], [SamplingParams(max_tokens=6, ignore_eos=True)] * 3)
    if DEVICE == "cuda":  # every size's first step was captured at once
        assert decode.stats.eager == 0 and decode.stats.captured > 0, decode.stats



@pytest.mark.parametrize("method", ["observe_layers", "prefetch"])
def test_a_failing_routing_fold_ends_its_step_s_requests_not_the_engine(ap_dir, monkeypatch, method):
    """A decode step's routing fold and its statistics' copy run once its sampling is queued (`DecodeGraphs.observe`
    and `RouterStats.prefetch`, outside the forward): if either raises, the step's requests end with an error, as
    after a failed forward, and the engine serves on."""
    from pagedweight.signals import RouterStats

    llm = LLM(ap_dir, device=DEVICE, block_size=16, page_store_dir=str(ap_dir / "store"), observe_every=2)
    static_decode(llm)
    llm.add_request(PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True))
    llm.step()  # step 0: prefill, observed
    llm.step()

    def broken(self, *args):
        raise RuntimeError(f"{method} failed")

    monkeypatch.setattr(RouterStats, method, broken)
    outs = llm.step()  # step 2: decode, observed
    assert [o.finish_reason for o in outs] == ["error"] and f"{method} failed" in outs[0].error
    assert not llm.has_unfinished() and llm.runner.decode.stats.eager + llm.runner.decode.stats.replayed == 2
    monkeypatch.undo()
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_a_failing_sampling_still_hands_its_step_s_router_records_over(ap_dir, monkeypatch):
    """The router records belong to the step that ran them: when its sampling raises, the step's fold still runs
    (not at the next decode step, whose window they would join), and its requests end with an error."""
    from pagedweight.sampling import Sampler
    from pagedweight.signals import RouterStats

    llm = LLM(ap_dir, device=DEVICE, block_size=16, page_store_dir=str(ap_dir / "store"), observe_every=2)
    static_decode(llm)
    llm.add_request(PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True))
    llm.step()  # step 0: prefill, observed
    llm.step()
    folded = []
    fold = RouterStats.observe_layers

    def broken(*args, **kwargs):
        raise RuntimeError("sampling failed")

    def spy(self, *args):
        folded.append(llm.num_steps)
        return fold(self, *args)

    monkeypatch.setattr(Sampler, "pick", broken)
    monkeypatch.setattr(RouterStats, "observe_layers", spy)
    outs = llm.step()  # step 2: decode, observed
    assert [o.finish_reason for o in outs] == ["error"] and "sampling failed" in outs[0].error
    assert folded == [2]


def test_an_observed_decode_step_queues_its_sampling_before_its_routing_statistics(ap_dir, monkeypatch):
    """A token read waits for all the stream holds before the token copy: so an observed decode step queues its
    sampling and token copy first, then the routing fold (`observe_layers`) and the statistics' merge and copy
    (`prefetch`), then reads the tokens (on CUDA, tests/test_engine.py holds each of the two up with a sleep)."""
    from pagedweight.host_copy import HostCopy
    from pagedweight.sampling import Sampler
    from pagedweight.signals import RouterStats

    llm = LLM(ap_dir, device=DEVICE, block_size=16, page_store_dir=str(ap_dir / "store"), observe_every=2)
    static_decode(llm)
    order = []
    for cls, name in ((Sampler, "pick"), (RouterStats, "observe_layers"), (RouterStats, "prefetch"),
                      (HostCopy, "tolist")):
        def spy(*args, _method=getattr(cls, name), _name=name, **kwargs):
            order.append(_name)
            return _method(*args, **kwargs)
        monkeypatch.setattr(cls, name, spy)
    llm.add_request(PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True))
    llm.step()  # step 0: prefill, observed (its layers fold during the forward)
    llm.step()
    order.clear()
    llm.step()  # step 2: decode, observed
    assert order == ["pick", "observe_layers", "prefetch", "tolist"]
    order.clear()
    llm.step()  # step 3: nothing observed
    assert order == ["pick", "tolist"]

def test_padded_decode_equals_packed_steps():
    """Batches of 1..5 sequences with ragged prompts (different context lengths and block-table lengths, prefill
    chunks beside decodes), padded to 1/2/4 rows; 5 sequences exceed the largest bucket and run packed until one
    finishes. Router observers see exactly the real rows; pages never written (unused slots, padding) stay unread
    or finite."""
    kw = dict(device=DEVICE, block_size=4, max_num_batched_tokens=16)
    ref, llm = LLM(BUNDLED, cuda_graphs=False, **kw), LLM(BUNDLED, **kw)
    decode = static_decode(llm, max_num_seqs=4)
    llm.pool.data.fill_(255)  # NaN in every free page: masked keys are read, so blocks must be zeroed when given out
    seen = {}  # per engine: rows observed per layer, routing weight per (layer, expert)
    for engine in (ref, llm):
        cfg = engine.config
        rows, mass = seen[id(engine)] = np.zeros(cfg.num_hidden_layers), np.zeros((cfg.num_hidden_layers,
                                                                                    cfg.num_experts))

        def observe(layer, x, ids, weights, rows=rows, mass=mass):
            rows[layer] += x.shape[0]
            np.add.at(mass[layer], ids.cpu().numpy().ravel(), weights.float().cpu().numpy().ravel())
        engine.model.set_router_observer(observe)
    for n in (1, 2, 3, 5):
        params = [SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True) for i in range(n)]
        done = lockstep(ref, llm, PROMPTS[:n], params)
        assert sorted(len(t) for t in done.values()) == [p.max_tokens for p in params]
    check_used(decode)
    (rows, mass), (rows_ref, mass_ref) = seen[id(llm)], seen[id(ref)]
    assert np.array_equal(rows, rows_ref)
    if DEVICE == "cpu":  # fp16 on CUDA: a near tie may route a token elsewhere; the rows must still match
        np.testing.assert_allclose(mass, mass_ref, rtol=1e-4, atol=1e-5)
    assert llm.kv.num_free_blocks == ref.kv.num_free_blocks == llm.stats()["kv_total_blocks"]


def test_device_tables_follow_the_kv_cache():
    """The block tables kept on the device between steps (one slot row per request) equal the kv cache's host tables,
    padded with the first block, after every static step: through preemption (blocks freed and given again under a
    small KV budget), prefill chunks beside decodes, and more requests than slots (slots reassigned). Tokens and
    logits equal the packed steps'."""
    probe = LLM(BUNDLED, device=DEVICE, block_size=4)
    budget = probe.weights_outside_bytes + 40 * probe.kv.block_bytes  # 6 requests of 40-60 tokens need ~75 blocks
    kw = dict(device=DEVICE, block_size=4, max_num_batched_tokens=16)
    ref, llm = LLM(BUNDLED, budget, cuda_graphs=False, **kw), LLM(BUNDLED, budget, **kw)
    decode = static_decode(llm, max_num_seqs=4)
    run, placed, rewritten = decode.run, set(), []
    write = decode._write_slots

    def checked(seqs):
        logits = run(seqs)
        for seq in seqs:
            tables = llm.kv.block_tables(seq)
            row = decode._kv_tables[decode._slots[seq.request_id].index].cpu().numpy()
            assert np.array_equal(row[:, :tables.shape[1]], tables), seq.request_id
            assert (row[:, tables.shape[1]:] == tables[:, :1]).all(), seq.request_id
            placed.add(seq.request_id)
        return logits
    decode.run = checked
    decode._write_slots = lambda rows: (rewritten.append(len(rows)), write(rows))
    params = [SamplingParams(max_tokens=30 + 4 * i, ignore_eos=True) for i in range(6)]
    lockstep(ref, llm, PROMPTS, params)
    check_used(decode, replays_at_least=10)
    assert llm.stats()["preemptions"] > 0 and ref.stats()["preemptions"] == llm.stats()["preemptions"]
    assert len(placed) == 6 > decode._kv_tables.shape[0]
    # slots are written whole only when taken or changed otherwise than by one decoded block
    assert sum(rewritten) < decode.stats.eager + decode.stats.replayed, (rewritten, decode.stats)


REQUESTS, LAYERS = 6, 3
GROW = st.tuples(st.just("grow"), st.integers(0, REQUESTS - 1), st.sampled_from([1, 1, 1, 2, 3]))  # mostly decoding
STEP = st.tuples(st.just("step"), st.lists(st.integers(0, REQUESTS - 1), min_size=1, max_size=4, unique=True))
OPS = st.one_of(GROW, GROW, STEP, STEP, STEP, st.tuples(st.just("free"), st.integers(0, REQUESTS - 1)),
                st.tuples(st.just("relocate")))


@settings(max_examples=150, deadline=None)
@given(st.lists(OPS, min_size=10, max_size=60))
def test_slot_tables_under_random_operations(ops):
    """The device-resident block tables against the kv cache's host tables, under random sequences of requests
    growing by one or several blocks, freed and given new blocks under the same id (preemption), pool relocation,
    and steps over any subset of up to 4 of 6 requests (4 slots: taken and reassigned). Every step's gathered
    tables, what attention reads, hold each row's blocks and then its first block; padding rows repeat row 0."""
    kv = Tables(LAYERS, block_size=4, device=torch.device("cpu"))
    decode = DecodeGraphs(stand_in(LAYERS), kv, decode_batch_sizes(4), max_blocks=16, capture=False)
    seqs = [Sequence(f"r{i}", [1], SamplingParams(max_tokens=1)) for i in range(REQUESTS)]
    for seq in seqs:
        kv.grow(seq, kv.block_size)
    steps = []

    def forward(inputs, blocks):
        steps.append(decode._step_tables(inputs, blocks).numpy().copy())
        return torch.zeros(inputs.shape[0], 1), []
    decode._forward = forward
    for op in ops:
        if op[0] == "grow" and len(seqs[op[1]].block_table) + op[2] <= decode.max_blocks:
            seq = seqs[op[1]]
            kv.grow(seq, (len(seq.block_table) + op[2]) * kv.block_size)
        elif op[0] == "free":
            kv._tables.pop(seqs[op[1]].request_id, None)  # as PagedKVCache.free
            seqs[op[1]].block_table = []
        elif op[0] == "relocate":  # as PagedKVCache._relocated: every page moves, every host table is dropped
            kv.block_pages = {lid: [next(kv._pages) for _ in pages] for lid, pages in kv.block_pages.items()}
            kv._tables.clear()
        elif op[0] == "step":
            batch = [seqs[i] for i in op[1] if seqs[i].block_table]
            if not batch:
                continue
            decode.run(batch)
            tables = steps[-1]
            for row, seq in enumerate(batch):
                want = np.array([kv.block_pages[b] for b in seq.block_table]).T
                assert np.array_equal(tables[row, :, :want.shape[1]], want), (op, row)
                assert (tables[row, :, want.shape[1]:] == want[:, :1]).all(), (op, row)
            assert (tables[len(batch):] == tables[0]).all()
    assert len(decode._slots) <= decode._kv_tables.shape[0] == 4


def test_layer_kernels_on_only_in_static_decode_steps(monkeypatch):
    """With packed_layer_kernels off, each static decode forward (what a CUDA graph captures) turns the model's fused
    layer kernels on (they stay off where the device does not take them: the CPU) and off again after it; packed steps
    (prefill, mixed) never turn them on."""
    llm = LLM(BUNDLED, device=DEVICE, block_size=4, max_num_batched_tokens=16, packed_layer_kernels=False)
    decode = static_decode(llm)
    calls, use = [], llm.model.use_layer_kernels

    def recorded(on=True):
        calls.append(on)
        return use(on)
    monkeypatch.setattr(llm.model, "use_layer_kernels", recorded)
    llm.generate(PROMPTS[:3], SamplingParams(max_tokens=5, ignore_eos=True))
    forwards = decode.stats.eager + decode.stats.captured
    assert forwards > 0 and calls == [True, False] * forwards
    assert not any("kernels" in vars(m) for m in llm.model.modules())


def test_packed_layer_kernels_turn_on_once_per_runner(monkeypatch):
    """With packed_layer_kernels the runner turns the model's fused layer kernels on once, at its start, and no step
    turns them on or off (each turn walks the model's modules, ~0.5 ms of host time); closing the runner turns them
    off. (The CPU takes no kernels: here the device is made to say it does, so the model still runs torch's ops.)"""
    calls, use = [], MoEForCausalLM.use_layer_kernels

    def recorded(self, on=True):
        calls.append(on)
        use(self, on)
        return on
    monkeypatch.setattr(MoEForCausalLM, "use_layer_kernels", recorded)
    llm = LLM(BUNDLED, device=DEVICE, block_size=4, max_num_batched_tokens=16, packed_layer_kernels=True)
    decode = static_decode(llm)
    assert calls == [True, False, True]  # the engine's runner on, closed (off); static_decode's runner on
    llm.generate(PROMPTS[:3], SamplingParams(max_tokens=5, ignore_eos=True))
    assert decode.stats.eager + decode.stats.captured > 0 and calls == [True, False, True]
    llm.runner.close()
    assert calls == [True, False, True, False]


def _set_widths(llm: LLM, blocks: list[int], bits: int) -> None:
    """Commit `bits` for `blocks` now (between steps), as the mover does at a step boundary."""
    for i in blocks:
        assert llm.mover.request(i, bits)
    if llm.device.type == "cuda":
        torch.cuda.synchronize(llm.device)
    llm.mover.boundary()
    assert (llm.committed_widths()[blocks] == bits).all()


def test_width_changes_between_steps(ap_dir):
    """Widths change between decode steps: within a LUT class (tables only) and across classes, 8 -> 7 -> 8 and
    8 -> 4 -> 8 (a new graph on CUDA). Same logits and tokens as the packed step with the same commits, and each
    layer's kernel calls get the class of its widest block (on the CPU the torch twin raises on a width above it)."""
    kw = dict(device=DEVICE, block_size=4, bits=8, paging=False, reload_bytes_per_step=0,
              page_store_dir=str(ap_dir / "store"))
    ref, llm = LLM(ap_dir, cuda_graphs=False, **kw), LLM(ap_dir, **kw)
    decode = static_decode(llm)
    classes = set()  # (layer, lut_width) of every MoE kernel call the engine made (not graph replays)
    for m in llm.model.modules():
        if isinstance(m, APExperts):
            m.fn = lambda *args, fn=m.fn, layer=m.layer: (classes.add((layer, args[-1])), fn(*args))[1]
    per_layer = 2 * llm.config.num_experts
    layer0, layer1 = list(range(per_layer)), list(range(per_layer, 2 * per_layer))
    changes = {4: (layer0[::2], 6), 6: (layer1, 4), 8: (layer0, 5), 10: (layer0, 8), 12: (layer1[::3], 8)}

    def between(engine, step):
        if step in changes:
            _set_widths(engine, *changes[step])
        if engine is llm:  # the graphs' LUT classes, cached by commit count, follow every commit
            widest = engine.table.host_q.numpy().reshape(engine.config.num_hidden_layers, -1).max(axis=1)
            assert decode._lut_classes() == tuple(lut_width(int(w)) for w in widest), step
    params = [SamplingParams(max_tokens=14, ignore_eos=True)] * 3
    lockstep(ref, llm, PROMPTS[:3], params, between)
    check_used(decode, replays_at_least=4)
    assert {(0, 8), (0, 7), (1, 8), (1, 4)} <= classes and not {(0, 4), (1, 7)} & classes, classes
    if DEVICE == "cuda":  # layer 0 went 8 -> 7 -> 8, layer 1 8 -> 4 -> 8: graphs of each class set were captured
        assert decode.stats.captured >= 3
    llm.table.check()


def _relocate_everything(llm: LLM) -> None:
    """Move every live KV page and plane 0 of every expert block (read at every width) to other pool pages, the way
    pool compaction does between steps, then poison the old pages: NaN for KV, all-ones plane words for weights."""
    pool, table, cache = llm.pool, llm.table, llm.kv
    live = sorted(p for pages in cache.block_pages.values() for p in pages)
    dst = pool.alloc_kv_blocks(len(live))
    pool.free_kv_blocks(dst)
    before = {lid: list(pages) for lid, pages in cache.block_pages.items()}
    pool._move_kv_pages(np.array(live), np.array(sorted(dst)))
    assert all(set(cache.block_pages[lid]).isdisjoint(pages) for lid, pages in before.items())
    rows = pool.kv_blocks_view()
    rows[torch.tensor(live, device=rows.device)] = 255
    for i, row in enumerate(table.rows):
        old, n = row.planes[0].page, table.slot_pages(i, "plane", 0)
        new = pool.alloc_run(n)
        pool.free_run(new)
        pool._move_weight_runs({old: new})
        assert row.planes[0].page == new
        pool.page_view(old, pool.bytes_of(n)).fill_(255)
    pool.check()
    table.check()


def test_relocation_between_steps(ap_dir):
    """After graphs were captured (CUDA), every KV page and a plane of every block move and their old pages are
    poisoned: the following steps read the new places (the tables), so the tokens stay those of an engine whose
    pages never moved."""
    kw = dict(device=DEVICE, block_size=64, bits=6, paging=False, page_store_dir=str(ap_dir / "store"))
    ref, llm = LLM(ap_dir, cuda_graphs=False, **kw), LLM(ap_dir, **kw)
    decode = static_decode(llm)
    moved = []

    def between(engine, step):
        if engine is llm and step == 5:
            moved.append(decode.stats.replayed)
            _relocate_everything(llm)
    lockstep(ref, llm, PROMPTS[:4], [SamplingParams(max_tokens=12, ignore_eos=True)] * 4, between)
    assert llm.pool.relocated_pages > 0 and llm.pool.relocated_weight_runs == len(llm.table.rows)
    check_used(decode, replays_at_least=5)
    if DEVICE == "cuda":  # one block per sequence, one batch size: the one graph was captured before the moves
        assert decode.stats.captured == 1 and moved[0] > 0


def test_paging_under_pressure(ap_dir):
    """The paging loop (tests/test_engine.py's pressure scenario) with static decode steps: widths drop under KV
    pressure and come back once it is gone, and the planner sees the routing statistics of the real rows. On the CPU everything equals
    the packed run; on CUDA, where commits wait for copies (timing), it finishes every request with graphs replayed."""
    store = str(ap_dir / "store")
    probe = LLM(ap_dir, device=DEVICE, block_size=16, page_store_dir=store)
    budget = budget_with(probe, 8)
    runs = []
    for static in (False, True):
        llm = LLM(ap_dir, budget, DEVICE, block_size=16, max_num_batched_tokens=16, page_store_dir=store,
                  cuda_graphs=static)
        decode = static_decode(llm) if static else None
        outs = llm.generate(PROMPTS[:4], SamplingParams(max_tokens=96, ignore_eos=True), use_tqdm=False)
        assert all(o.finish_reason == "length" and o.completion_tokens == 96 for o in outs)
        for _ in range(100):  # pressure gone: the idle engine reloads (as a server's loop does)
            if not llm.step_idle():
                break
        st = llm.stats()
        assert st["offload_triggers"] > 0 and st["reload_triggers"] > 0
        assert (llm.committed_widths() == llm.planner.home).all(), "the widths did not come back"
        runs.append(([o.token_ids for o in outs], llm.routing_mass()))
        llm.table.check()
    check_used(decode, replays_at_least=20)
    if DEVICE == "cpu":
        assert runs[1][0] == runs[0][0]
        np.testing.assert_allclose(runs[1][1], runs[0][1], rtol=1e-5, atol=1e-7)


@pytest.fixture
def failing_capture(monkeypatch) -> dict[str, list]:
    """torch's capture faked for the CPU: each capture switches to a side stream, runs its body, then fails as an
    invalidated capture does (leaving the side stream current, as torch's does). Records each capture's (pool, mode),
    each pool whose recording the fallback ended, and the current stream after each capture; new pools are (0, 100),
    (0, 101), ..."""
    import contextlib
    import itertools

    from pagedweight import runner

    log: dict[str, list] = {"captures": [], "ended": [], "streams": []}
    stream = ["caller's"]
    handles = ((0, i) for i in itertools.count(100))

    @contextlib.contextmanager
    def failing_graph(graph, pool=None, capture_error_mode="global"):
        log["captures"].append((pool, capture_error_mode))
        stream[0] = "capture side stream"
        yield
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    def capture_step(fn):
        def wrapped(*args):
            out = fn(*args)
            log["streams"].append(stream[0])
            return out
        return wrapped

    class FakeGraph:
        def pool(self):
            return (0, 7)

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", failing_graph)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda device, pool: log["ended"].append(pool),
                        raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream[0])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: stream.__setitem__(0, s))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(handles))
    monkeypatch.setattr(runner, "capture", capture_step(runner.capture))
    return log


@pytest.mark.skipif(DEVICE == "cuda", reason="a faked capture; on CUDA the real one: the test below")
def test_failed_capture_runs_the_step_eagerly(failing_capture):
    """A capture that fails costs its step the graph, not its requests: the step runs eagerly with the logits and
    tokens of an engine without graphs, after CAPTURE_ATTEMPTS failures that step shape is not captured again, and
    each failure ends the caching allocator's recording into the graph's pool."""
    from pagedweight import runner

    kw = dict(device=DEVICE, block_size=4, max_num_batched_tokens=16)
    ref, llm = LLM(BUNDLED, cuda_graphs=False, **kw), LLM(BUNDLED, **kw)
    decode = static_decode(llm, max_num_seqs=4)
    decode.capture = True
    params = [SamplingParams(max_tokens=14, ignore_eos=True) for _ in range(2)]
    done = lockstep(ref, llm, PROMPTS[:2], params)
    assert sorted(len(t) for t in done.values()) == [14, 14]
    failures, captures = decode._gate.failures, failing_capture["captures"]
    assert decode.stats.captured == decode.stats.replayed == 0, decode.stats
    assert decode.stats.capture_failures == len(captures) == sum(failures.values()) > 0, (decode.stats, failures)
    assert max(failures.values()) == runner.CAPTURE_ATTEMPTS, failures
    assert set(captures) == {(None, "thread_local")}  # the CPU runner has no pool: the graph's own one is ended
    assert failing_capture["ended"] == [(0, 7)] * len(captures)
    assert failing_capture["streams"] == ["caller's"] * len(captures)


@pytest.mark.skipif(DEVICE == "cuda", reason="a faked capture")
def test_failed_moe_capture_runs_the_call_eagerly(ap_dir, failing_capture):
    """A layer's own MoE graphs (calls outside a whole-step graph): a failed capture runs the call eagerly with the
    same output, CAPTURE_ATTEMPTS times per shape, then that shape is no longer captured."""
    from pagedweight import runner

    llm = LLM(ap_dir, device=DEVICE, bits=8, paging=False, page_store_dir=str(ap_dir / "store"))
    experts = next(m for m in llm.model.modules() if isinstance(m, APExperts))
    experts.graph_pool = runner.GraphPool((0, 3))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, llm.config.hidden_size, generator=g)
    ids = torch.randint(0, llm.config.num_experts, (3, llm.config.top_k), generator=g)
    weights = torch.rand(3, llm.config.top_k, generator=g)
    want = experts._call(x, ids, weights, lut_width(8))
    for _ in range(5):  # first sight, two failed captures, then eager without trying
        torch.testing.assert_close(experts(x, ids, weights), want, rtol=0, atol=0)
    # each failure ends the recording into its pool and gives the layers a fresh pool (torch refuses the old one)
    assert runner.CAPTURE_ATTEMPTS == 2 and not experts._graphs
    assert failing_capture["captures"] == [((0, 3), "thread_local"), ((0, 100), "thread_local")]
    assert failing_capture["ended"] == [(0, 3), (0, 100)] and experts.graph_pool.handle == (0, 101)
    assert failing_capture["streams"] == ["caller's"] * 2


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs: PAGEDWEIGHT_TEST_DEVICE=cuda (run on the H200)")
def test_failed_capture_runs_the_step_eagerly_on_gpu(monkeypatch):
    """A real capture failure (a device synchronize inside the first capture, which the driver refuses and which
    invalidates the capture): that step runs eagerly, the context stays usable, later steps capture and replay, and
    every step's logits and tokens match an engine without graphs."""
    kw = dict(device=DEVICE, block_size=4, max_num_batched_tokens=16)
    ref, llm = LLM(BUNDLED, cuda_graphs=False, **kw), LLM(BUNDLED, **kw)
    decode = static_decode(llm, max_num_seqs=4)
    forward, broken = decode._forward, []

    def forward_breaking_first_capture(inputs, blocks):
        if torch.cuda.is_current_stream_capturing() and not broken:
            broken.append(True)
            torch.cuda.synchronize()  # not permitted while capturing
        return forward(inputs, blocks)

    monkeypatch.setattr(decode, "_forward", forward_breaking_first_capture)
    params = [SamplingParams(max_tokens=14, ignore_eos=True) for _ in range(2)]
    done = lockstep(ref, llm, PROMPTS[:2], params)
    assert sorted(len(t) for t in done.values()) == [14, 14]
    assert broken and decode.stats.capture_failures == 1, decode.stats
    assert torch.cuda.current_stream() == torch.cuda.default_stream()  # torch's graph context left its side stream
    check_used(decode)


@pytest.mark.skipif(DEVICE != "cuda", reason="the fused layer kernels run on CUDA only: PAGEDWEIGHT_TEST_DEVICE=cuda")
def test_prefill_with_layer_kernels_matches_torch_ops_on_gpu():
    """Packed prefill steps with the fused layer kernels (packed_layer_kernels: norms, RoPE, routing, shared expert)
    give the logits of torch's ops: two engines, kernels kept on and off, each step's sampled rows within fp16's
    tolerance."""
    logs = []
    for kernels in (True, False):
        llm = LLM(BUNDLED, device=DEVICE, block_size=4, max_num_batched_tokens=32, packed_layer_kernels=kernels)
        assert any("kernels" in vars(m) for m in llm.model.modules()) == kernels
        logs.append(log_logits(llm))
        llm.generate(PROMPTS, SamplingParams(max_tokens=1))
        llm.close()
    on, off = logs
    assert len(on) == len(off) > 1
    for (ids_on, a), (ids_off, b) in zip(on, off):
        assert ids_on == ids_off and a.shape == b.shape
        torch.testing.assert_close(a, b, **TOL)
