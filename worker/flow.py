"""Flow control: the `max_ack_pending` window, a subscription's budget of held bytes, and the
adaptive per-endpoint concurrency limit."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque

from worker.delivery import Outcome, Result


class _Slots:
    """Counting slots with a limit that may change while slots are held. `release` is synchronous
    (no lock needed on one event loop) and wakes only as many waiters as there are free slots."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def _take(self) -> None:
        while self.used >= self.limit:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake()  # pass on a wake-up this task can no longer use
                raise
        self.used += 1

    def _give(self) -> None:
        self.used -= 1
        self._wake()

    def _wake(self) -> None:
        free = self.limit - self.used
        while free > 0 and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                free -= 1


class Window(_Slots):
    """The `max_ack_pending` window: messages taken from the broker and not yet settled."""

    async def acquire(self) -> None:
        await self._take()

    def try_acquire(self) -> bool:
        """Take a slot if one is free and nobody is waiting for it; never waits."""
        if self.used < self.limit and not self._waiters:
            self.used += 1
            return True
        return False

    def release(self) -> None:
        self._give()

    def resize(self, limit: int) -> None:
        self.limit = limit
        self._wake()


def overloaded(outcome: Outcome) -> bool:
    """Signals that the endpoint has too much: 429, 503, timeouts, connection errors.
    Other 4xx say the message is wrong, not that the endpoint is busy; other 5xx are weighed by
    how often they come (`server_error`)."""
    if outcome.result in (Result.TIMEOUT, Result.CONNECTION_ERROR):
        return True
    return outcome.status in (429, 503)


def server_error(outcome: Outcome) -> bool:
    """500, 502, 504...: a struggling endpoint when most answers are like this, a bad message (one
    the endpoint cannot handle) when they are the odd one out."""
    return outcome.status is not None and outcome.status >= 500 and not overloaded(outcome)


SERVER_ERROR_SHARE = 0.3  # recent share of server errors above which they count as overload
SHARE_WEIGHT = 0.05  # weight of each answer in that share (about the last 20-40 answers)


class ByteBudget:
    """Payload bytes of the messages a subscription holds (taken from the broker, not settled):
    `max_ack_pending` counts messages, and a subscription of large ones took the worker's memory to
    its window times their size (150 messages of 4 MiB: 2 GiB, measured), enough to kill a pod, and
    then each next owner of the subscription. A message waits for room; one larger than the whole
    budget goes when nothing else is held. Waiters are served in turn."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def _fits(self, size: int) -> bool:
        return self.used == 0 or self.used + size <= self.limit

    def try_take(self, size: int) -> bool:
        """Take `size` bytes if they fit and nobody waits before; never waits."""
        if self._waiters or not self._fits(size):
            return False
        self.used += size
        return True

    async def take(self, size: int) -> None:
        """Wait for `size` bytes, in turn."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((size, waiter))
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.give_back(size)  # granted as it was cancelled
            else:
                with contextlib.suppress(ValueError):  # `_wake` may have dropped it already
                    self._waiters.remove((size, waiter))
                self._wake()  # those behind it may fit now
            raise

    def give_back(self, size: int) -> None:
        self.used -= size
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            size, waiter = self._waiters[0]
            if waiter.done():  # cancelled: its task is leaving
                self._waiters.popleft()
                continue
            if not self._fits(size):
                return
            self._waiters.popleft()
            self.used += size
            waiter.set_result(None)


class AdaptiveLimit(_Slots):
    """TCP-like concurrency control for one endpoint.

    Slow start: the window grows by one per success until the threshold, then by 1/window
    (about one per round of requests). On overload it halves, at most once per `cooldown`,
    so a burst of failures from one bad moment does not collapse it to one. Server errors other
    than 503 count as overload only while they are a large share of recent answers: an endpoint
    that fails one message in ten is not slowed for the other nine. A `Retry-After`
    on 429/503 also pauses new requests to the endpoint until it has passed.
    """

    def __init__(self, ceiling: int, initial: int = 4, cooldown: float = 0.2) -> None:
        self.ceiling = max(1, ceiling)
        self.window = float(min(initial, self.ceiling))
        self.threshold = float(self.ceiling)
        self.cooldown = cooldown
        self._last_cut = 0.0
        self._paused_until = 0.0
        self._error_share = 0.0
        super().__init__(self.size)

    @property
    def size(self) -> int:
        return max(1, min(int(self.window), self.ceiling))

    @property
    def in_use(self) -> int:
        return self.used

    async def acquire(self) -> None:
        pause = self._paused_until - time.monotonic()
        while pause > 0:
            await asyncio.sleep(pause)
            pause = self._paused_until - time.monotonic()
        await self._take()

    def release(self, outcome: Outcome | None) -> None:
        if outcome is not None:
            self._learn(outcome)
            self.limit = self.size
        self._give()

    def set_ceiling(self, ceiling: int) -> None:
        self.ceiling = max(1, ceiling)
        self.window = min(self.window, float(self.ceiling))
        self.limit = self.size
        self._wake()

    def _learn(self, outcome: Outcome) -> None:
        failed = server_error(outcome)
        self._error_share += SHARE_WEIGHT * ((1.0 if failed else 0.0) - self._error_share)
        if outcome.acked:
            step = 1.0 if self.window < self.threshold else 1.0 / self.window
            self.window = min(float(self.ceiling), self.window + step)
            return
        if not (overloaded(outcome) or (failed and self._error_share > SERVER_ERROR_SHARE)):
            return
        now = time.monotonic()
        if now - self._last_cut >= self.cooldown:
            self.threshold = max(1.0, self.window / 2)
            self.window = self.threshold
            self._last_cut = now
        if outcome.retry_after:
            self._paused_until = max(self._paused_until, now + min(outcome.retry_after, 60.0))
