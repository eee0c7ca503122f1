"""Progress of long loads and copies (a large checkpoint's weights, a page store's pages): a byte bar on a
terminal, two log lines elsewhere, nothing for small work."""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from loguru import logger
from tqdm import tqdm


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass


@contextmanager
def byte_progress(total: int, desc: str, min_bytes: int, source: str | os.PathLike = ""
                  ) -> Iterator[tqdm | _NoProgress]:
    """Progress of a long copy or load of `total` bytes: a tqdm bar on stderr that the caller `.update(nbytes)`s at its
    own granularity (per tensor, per few MiB: never per small record). Nothing at all below `min_bytes`.

    Off a terminal the bar stays silent (tqdm's disable=None): there it would print a line per refresh into Ray
    actors' and containers' logs. Loguru INFO lines say the size at the start and the seconds at the end instead."""
    if total < min_bytes:
        yield _NoProgress()
        return
    bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr, disable=None)
    quiet = bar.disable
    if quiet:
        # depth 2: past contextlib's __enter__/__exit__, so that the line names the caller (module, function)
        logger.opt(depth=2).info("{}: {:.2f} GB{}", desc, total / 1e9, f" from {source}" if source else "")
    t0 = time.perf_counter()
    try:
        yield bar
    finally:
        bar.close()
    if quiet:
        seconds = time.perf_counter() - t0
        logger.opt(depth=2).info("{}: {:.2f} GB in {:.1f} s ({:.2f} GB/s)", desc, total / 1e9, seconds,
                                 total / 1e9 / max(seconds, 1e-9))
