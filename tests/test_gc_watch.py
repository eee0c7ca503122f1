"""The process's garbage-collector hook (pagedweight/gc_watch.py): it counts and times every collection, once per
process however many engines share it, and LLM.stats() reports its totals."""
from __future__ import annotations

import gc

from pagedweight import gc_watch
from pagedweight.gc_watch import GcPauses


def test_the_hook_times_each_collection_by_generation():
    pauses = GcPauses(record=True)
    gc.callbacks.append(pauses)
    try:
        gc.collect(0)
        gc.collect()  # full
        gc.collect(1)
    finally:
        gc.callbacks.remove(pauses)
    gc.collect()  # after removal: not counted
    assert pauses.collections == [1, 1, 1] and [g for g, _ in pauses.pauses] == [0, 2, 1]
    assert all(s > 0 for _, s in pauses.pauses) and pauses.pause_s == [s for _, s in sorted(pauses.pauses)]
    assert pauses.stats() == {"gc_collections": [1, 1, 1], "gc_pause_s": pauses.pause_s}


def test_one_hook_per_process_and_the_engine_reports_it(model_dir):
    from pagedweight.engine import LLM

    llm = LLM(model_dir, max_num_seqs=2)
    assert llm.gc_pauses is gc_watch.watch() and gc.callbacks.count(llm.gc_pauses) == 1
    before = llm.stats()
    gc.collect()
    after = llm.stats()
    assert after["gc_collections"][2] == before["gc_collections"][2] + 1  # a full collection
    assert after["gc_pause_s"][2] > before["gc_pause_s"][2]
    llm.close()
