"""Flow control: the `max_ack_pending` window and the adaptive per-endpoint concurrency limit."""

from __future__ import annotations

import asyncio
import time

from worker.delivery import Outcome, Result


class Window:
    """A counting limit whose size can change while permits are held (for live edits)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._changed = asyncio.Condition()

    async def acquire(self) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.used < self.limit)
            self.used += 1

    async def release(self) -> None:
        async with self._changed:
            self.used -= 1
            self._changed.notify(1)

    async def resize(self, limit: int) -> None:
        async with self._changed:
            self.limit = limit
            self._changed.notify_all()


def overloaded(outcome: Outcome) -> bool:
    """Signals that the endpoint has too much: 429, 5xx, timeouts, connection errors.
    Other 4xx say the message is wrong, not that the endpoint is busy."""
    if outcome.result in (Result.TIMEOUT, Result.CONNECTION_ERROR):
        return True
    return outcome.status is not None and (outcome.status == 429 or outcome.status >= 500)


class AdaptiveLimit:
    """TCP-like concurrency control for one endpoint.

    Slow start: the window grows by one per success until the threshold, then by 1/window
    (about one per round of requests). On overload it halves, at most once per `cooldown`,
    so a burst of failures from one bad moment does not collapse it to one. A `Retry-After`
    on 429/503 also pauses new requests to the endpoint until it has passed.
    """

    def __init__(self, ceiling: int, initial: int = 4, cooldown: float = 0.2) -> None:
        self.ceiling = max(1, ceiling)
        self.window = float(min(initial, self.ceiling))
        self.threshold = float(self.ceiling)
        self.cooldown = cooldown
        self.in_use = 0
        self._last_cut = 0.0
        self._paused_until = 0.0
        self._changed = asyncio.Condition()

    @property
    def size(self) -> int:
        return max(1, int(self.window))

    async def acquire(self) -> None:
        while True:
            pause = self._paused_until - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)
                continue
            async with self._changed:
                if self.in_use < min(self.size, self.ceiling):
                    self.in_use += 1
                    return
                await self._changed.wait()

    async def release(self, outcome: Outcome | None) -> None:
        async with self._changed:
            self.in_use -= 1
            if outcome is not None:
                self._learn(outcome)
            # Wake only as many waiters as there are free slots: with hundreds of messages queued
            # on a failing endpoint, waking all of them on every release costs O(n^2) CPU.
            self._changed.notify(max(0, min(self.size, self.ceiling) - self.in_use))

    async def set_ceiling(self, ceiling: int) -> None:
        async with self._changed:
            self.ceiling = max(1, ceiling)
            self.window = min(self.window, float(self.ceiling))
            self._changed.notify_all()

    def _learn(self, outcome: Outcome) -> None:
        now = time.monotonic()
        if overloaded(outcome):
            if now - self._last_cut >= self.cooldown:
                self.threshold = max(1.0, self.window / 2)
                self.window = self.threshold
                self._last_cut = now
            if outcome.retry_after:
                self._paused_until = max(self._paused_until, now + min(outcome.retry_after, 60.0))
        elif outcome.acked:
            step = 1.0 if self.window < self.threshold else 1.0 / self.window
            self.window = min(float(self.ceiling), self.window + step)
