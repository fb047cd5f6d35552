"""What bounds the admin listener, so that no caller (or crowd of them) can take it over.

- A connection must send a whole request head within `HEADER_SECONDS` and may stay idle between
  requests as long (aiohttp's keep-alive timer runs from the connection's start), and a request's
  body must arrive within as long again (read before anything else: server.read_body_within):
  slow clients hold no descriptor for long.
- At most `MAX_CONNECTIONS` connections at once; one more is answered 503 and closed.
- Each caller (a token's or JWT's subject) gets `CALLER_RATE` requests a second (bursts of
  `CALLER_BURST`) and `CALLER_CONCURRENCY` at once; past either, 429 with Retry-After.
- Each caller's delivery-log searches read at most `SEARCH_RATE` entries a second, one search at a
  time (`SearchBudget`): a search past its share answers what it found and where to go on.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from aiohttp import web

HEADER_SECONDS = 10.0
MAX_CONNECTIONS = 256
CALLER_RATE = 50.0
CALLER_BURST = 100
CALLER_CONCURRENCY = 8
_FORGET_AFTER = 1000  # callers remembered before idle ones are forgotten

BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"


class TooMany(Exception):
    """A caller past its rate or its concurrency: 429, `retry_after` seconds."""

    def __init__(self, limit: str, retry_after: float) -> None:
        super().__init__(f"too many requests ({limit}): retry after {math.ceil(retry_after)} s")
        self.limit = limit
        self.retry_after = max(1, math.ceil(retry_after))


@dataclass
class _Caller:
    tokens: float
    at: float
    in_flight: int = 0


class _Buckets:
    """A token bucket per caller, filled at `rate` a second up to `burst`."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float]) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self.callers: dict[str, _Caller] = {}

    def refilled(self, caller: str) -> _Caller:
        """`caller`'s bucket, filled for the time since it was last seen (a new caller's is full)."""
        now = self.clock()
        state = self.callers.get(caller)
        if state is None:
            if len(self.callers) >= _FORGET_AFTER:
                self._forget_idle(now)
            state = self.callers[caller] = _Caller(tokens=float(self.burst), at=now)
        state.tokens = min(float(self.burst), state.tokens + (now - state.at) * self.rate)
        state.at = now
        return state

    def _forget_idle(self, now: float) -> None:
        """Callers with nothing under way and a full bucket are as if new: forgotten, so the table stays small."""
        for name in [n for n, c in self.callers.items()
                     if c.in_flight == 0 and c.tokens + (now - c.at) * self.rate >= self.burst]:
            del self.callers[name]


class CallerLimits(_Buckets):
    """A token bucket and a concurrency cap per caller."""

    def __init__(self, rate: float = CALLER_RATE, burst: int = CALLER_BURST, concurrency: int = CALLER_CONCURRENCY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(rate, burst, clock)
        self.concurrency = concurrency

    @contextmanager
    def admit(self, caller: str) -> Iterator[None]:
        state = self.refilled(caller)
        if state.in_flight >= self.concurrency:
            raise TooMany("concurrency", 1.0)
        if state.tokens < 1.0:
            raise TooMany("rate", (1.0 - state.tokens) / self.rate)
        state.tokens -= 1.0
        state.in_flight += 1
        try:
            yield
        finally:
            state.in_flight -= 1


SEARCH_RATE = 10_000  # delivery-log entries a caller's searches may read a second...
SEARCH_BURST = 10_000  # ...and at once; one search reads at most delivery_log.SCAN_BUDGET of them


@dataclass
class SearchShare:
    entries: int  # what the search may read
    read: int = 0  # what it read (the rest goes back to the caller's bucket)


class SearchBudget(_Buckets):
    """What a caller's delivery-log searches may read: a bucket of entries per caller (a search that
    matched nothing read 5,000, and one viewer's 8 at once took the admin process's core), and one
    search of a caller's at a time. `take` gives a search its share of entries, or TooMany."""

    def __init__(self, rate: float = SEARCH_RATE, burst: int = SEARCH_BURST,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(rate, burst, clock)

    @contextmanager
    def take(self, caller: str, most: int, least: int) -> Iterator[SearchShare]:
        """A search's share: up to `most` entries, taken now; what it did not read (`share.read`, set
        by the search) goes back when it ends. TooMany when fewer than `least` are left, or a search
        of the caller's is under way."""
        state = self.refilled(caller)
        if state.in_flight:
            raise TooMany("log search under way", 1.0)
        if state.tokens < least:
            raise TooMany("log search budget", (least - state.tokens) / self.rate)
        share = SearchShare(int(min(most, state.tokens)))
        state.tokens -= share.entries
        state.in_flight += 1
        try:
            yield share
        finally:
            state.tokens += max(0, share.entries - share.read)
            state.in_flight -= 1


class _Busy(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(BUSY)
        transport.close()


class CappedRunner(web.AppRunner):
    """An AppRunner whose sites accept at most `max_connections` connections at once."""

    def __init__(self, app: web.Application, max_connections: int, on_busy: Callable[[], None], **kwargs: Any) -> None:
        # A body left unread (a 408, a 413) is drained at most a second before the connection closes
        # (aiohttp's default, 10 s, let a trickling sender hold it that much longer).
        super().__init__(app, keepalive_timeout=HEADER_SECONDS, lingering_time=1.0, **kwargs)
        self.max_connections = max_connections
        self.on_busy = on_busy

    @property
    def server(self) -> Any:  # the sites' protocol factory
        inner = super().server
        if inner is None:
            return None

        def factory() -> asyncio.Protocol:
            if len(inner.connections) >= self.max_connections:
                self.on_busy()
                return _Busy()
            return inner()

        return factory
