"""What bounds the admin listener, so that no caller (or crowd of them) can take it over.

- A connection must send a whole request head within `HEADER_SECONDS` and may stay idle between
  requests as long (aiohttp's keep-alive timer runs from the connection's start): slow clients
  hold no descriptor for long.
- At most `MAX_CONNECTIONS` connections at once; one more is answered 503 and closed.
- Each caller (a token's or JWT's subject) gets `CALLER_RATE` requests a second (bursts of
  `CALLER_BURST`) and `CALLER_CONCURRENCY` at once; past either, 429 with Retry-After.
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


class CallerLimits:
    """A token bucket and a concurrency cap per caller."""

    def __init__(self, rate: float = CALLER_RATE, burst: int = CALLER_BURST, concurrency: int = CALLER_CONCURRENCY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.concurrency, self.clock = rate, burst, concurrency, clock
        self.callers: dict[str, _Caller] = {}

    @contextmanager
    def admit(self, caller: str) -> Iterator[None]:
        now = self.clock()
        state = self.callers.get(caller)
        if state is None:
            if len(self.callers) >= _FORGET_AFTER:
                self._forget_idle(now)
            state = self.callers[caller] = _Caller(tokens=float(self.burst), at=now)
        state.tokens = min(float(self.burst), state.tokens + (now - state.at) * self.rate)
        state.at = now
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

    def _forget_idle(self, now: float) -> None:
        """Callers with nothing under way and a full bucket are as if new: forgotten, so the table stays small."""
        for name in [n for n, c in self.callers.items()
                     if c.in_flight == 0 and c.tokens + (now - c.at) * self.rate >= self.burst]:
            del self.callers[name]


class _Busy(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(BUSY)
        transport.close()


class CappedRunner(web.AppRunner):
    """An AppRunner whose sites accept at most `max_connections` connections at once."""

    def __init__(self, app: web.Application, max_connections: int, on_busy: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(app, keepalive_timeout=HEADER_SECONDS, **kwargs)
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
