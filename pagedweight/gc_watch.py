"""Python's cyclic garbage collector as the engine sees it: collections and their pauses, by generation.

A collection holds the GIL, so it stops the engine's step loop along with every other thread of the process; a full
(generation 2) one walks every tracked object: 148.6 ms once the bundled model's engine is built, on a 2-core CPU
(measured, `gc_pauses-cpu-2c-20261207-s59-plain.json`). `watch()` installs one `gc.callbacks` hook per process;
`LLM.stats()` reports its totals and actors/metrics.py exports them by generation, so a decode stall the collector
caused shows as such on the dashboard instead of as an unexplained inter-token tail. The counts are the process's,
whichever thread allocated what triggered them (in a Serve replica: the engine loop and the event loop relaying
HTTP; `gc_pauses --http` measures one, `gc_pauses-cpu-2c-20261207-s60-http.json`).
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field


@dataclass
class GcPauses:
    """Collections and their summed pause seconds, per generation (index 0-2); every (generation, seconds) pause too
    when `record` (benchmarks)."""

    record: bool = False
    collections: list[int] = field(default_factory=lambda: [0, 0, 0])
    pause_s: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    pauses: list[tuple[int, float]] = field(default_factory=list)
    _started: float = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        """The gc.callbacks hook: runs in the collecting thread, before ("start") and after ("stop")."""
        if phase == "start":
            self._started = time.perf_counter()
            return
        g, s = info["generation"], time.perf_counter() - self._started
        self.collections[g] += 1
        self.pause_s[g] += s
        if self.record:
            self.pauses.append((g, s))

    def stats(self) -> dict:
        """The totals `LLM.stats()` carries, by generation (measured wall time of each collection, this process)."""
        return {"gc_collections": list(self.collections), "gc_pause_s": list(self.pause_s)}


_WATCH: GcPauses | None = None


def watch() -> GcPauses:
    """The process's hook, installed on the first call (every engine of the process shares it)."""
    global _WATCH
    if _WATCH is None:
        _WATCH = GcPauses()
        gc.callbacks.append(_WATCH)
    return _WATCH
