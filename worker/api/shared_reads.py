"""Answers of the API's fleet-wide reads, shared for a moment.

A list of a project's subscriptions reads the whole fleet from Redis (every status, every counter),
and a crowd of viewers asks for it many times a second. Each read here is made once however many
callers ask at the same time, and its answer serves everyone for `TTL_SECONDS`: Redis sees at most
one read of each kind a second, whatever the load. An operator's change clears it at once.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Awaitable, Callable
from typing import Any

TTL_SECONDS = 1.0
MAX_KEPT = 1000


class SharedReads:
    def __init__(self, ttl: float = TTL_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl, self.clock = ttl, clock
        self._done: dict[str, tuple[float, Any]] = {}
        self._pending: dict[str, asyncio.Future[Any]] = {}

    async def get(self, key: str, load: Callable[[], Awaitable[Any]]) -> Any:
        """`load()`'s answer, made by this call, by one under way, or by one made less than `ttl` ago;
        a copy each (callers may change theirs)."""
        done = self._done.get(key)
        if done is not None and self.clock() - done[0] < self.ttl:
            return copy.deepcopy(done[1])
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = asyncio.ensure_future(load())
            pending.add_done_callback(lambda future: self._settle(key, future))
        # Shielded: one caller that gives up (its client went away) does not cancel the others' read.
        return copy.deepcopy(await asyncio.shield(pending))

    def _settle(self, key: str, future: asyncio.Future[Any]) -> None:
        if self._pending.get(key) is future:
            del self._pending[key]
        if future.cancelled() or future.exception() is not None or self.ttl <= 0:
            return  # a failure is no answer (the next caller reads again); ttl 0 shares only reads under way
        if len(self._done) >= MAX_KEPT:
            now = self.clock()
            self._done = {k: v for k, v in self._done.items() if now - v[0] < self.ttl}
        self._done[key] = (self.clock(), future.result())

    def clear(self) -> None:
        """After a change: the next read sees it."""
        self._done.clear()
