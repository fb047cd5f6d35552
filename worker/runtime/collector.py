"""The worker's garbage-collection policy: collector settings once started, and a full collection
soon after subscriptions are released."""

from __future__ import annotations

import asyncio
import gc

# Young objects collected per this many new ones (CPython's default is 700): a delivery allocates
# dozens of short-lived objects, and the collector's passes cost about a fifth of a delivery's CPU
# at the default (measured A/B in `make bench`).
GC_THRESHOLD = (20_000, 50, 100)
# See Collector: the first collection a second after a release, then at most one a minute (each
# scans every object the worker has made since it started: 35-93 ms with 1,000 subscriptions).
COLLECT_AFTER_RELEASE_SECONDS = 1.0
COLLECT_INTERVAL_SECONDS = 60.0


def tune_for_serving() -> None:
    """Once started: what exists now (modules, config, clients) lives as long as the process, so the
    collector stops rescanning it (gc.freeze), and young collections run less often."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)


class Collector:
    """A full collection after subscriptions were released: one for a burst of them, at most one a
    minute. A dispatcher, its consumer and its tasks refer to each other, and once they have lived a
    while only a full collection frees them, which `GC_THRESHOLD` starts after about 100 million
    allocations: a quiet worker whose subscriptions came and went grew by about 30 KiB for each
    (measured: 100 released a round, 6 rounds, 88 -> 105 MiB). Not sooner than a minute apart:
    releasing 500 of 1,000 subscriptions one by one cost a collection of 35-93 ms every second."""

    def __init__(self) -> None:
        self._timer: asyncio.TimerHandle | None = None
        self._collected_at = -COLLECT_INTERVAL_SECONDS  # loop time of the last collection
        self._closed = False

    def soon(self) -> None:
        if self._timer is None and not self._closed:
            loop = asyncio.get_running_loop()
            when = max(loop.time() + COLLECT_AFTER_RELEASE_SECONDS, self._collected_at + COLLECT_INTERVAL_SECONDS)
            self._timer = loop.call_at(when, self._collect)

    def _collect(self) -> None:
        self._timer = None
        self._collected_at = asyncio.get_running_loop().time()
        gc.collect()

    def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
