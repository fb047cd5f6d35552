"""Flow control: the `max_ack_pending` window, the adaptive per-endpoint concurrency limit and a
subscription's rate limit (the budgets of held bytes and connections are in `budgets`)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable

from worker.core.delivery import Outcome, Result


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
    """Signals that the endpoint has too much: 429, 503, timeouts, connection errors. Other 4xx and
    5xx are weighed by how often they come (`refused`)."""
    if outcome.result in (Result.TIMEOUT, Result.CONNECTION_ERROR):
        return True
    return outcome.status in (429, 503)


def refused(outcome: Outcome) -> bool:
    """Any other 4xx or 5xx: a bad message (one the endpoint cannot take) when it is the odd one out;
    a struggling endpoint, or a project whose every message is refused, when most answers are like
    this. Either way the window shrinks then: a burst of 4xx with a wide window and no backoff sent
    5,000 requests a second, and starved every other project of the worker."""
    return outcome.status is not None and outcome.status >= 400 and not overloaded(outcome)


FAILED_SHARE = 0.3  # recent share of refused answers above which they count as overload
SHARE_WEIGHT = 0.05  # weight of each answer in that share (about the last 20-40 answers)
HUNG_AFTER_LATENCIES = 8  # a request under way this many typical answers long counts as overload...
HUNG_AFTER_FLOOR = 1.0  # ...and at least this many seconds
LATENCY_WEIGHT = 0.1  # weight of each acked answer's latency in the typical latency
MAX_PAUSE = 60.0  # seconds a Retry-After holds new requests at most


class AdaptiveLimit(_Slots):
    """TCP-like concurrency control for one endpoint.

    Slow start: the window grows by one per success until the threshold, then by 1/window
    (about one per round of requests). On overload it halves, at most once per `cooldown`,
    so a burst of failures from one bad moment does not collapse it to one. Other 4xx and 5xx
    answers count as overload only while they are a large share of recent answers: an endpoint
    that refuses one message in ten is not slowed for the other nine. A `Retry-After`
    on 429/503 also pauses new requests to the endpoint until it has passed.

    A request under way far longer than answers take (`HUNG_AFTER_LATENCIES` typical latencies, at
    least `HUNG_AFTER_FLOOR`) counts as overload once, when the next request would start: a window
    learns only from answers, so an endpoint that hung after growing it to 3,004 kept it there
    while 2,015 sockets hung for their 600 s deadline.
    """

    def __init__(self, ceiling: int, initial: int = 4, cooldown: float = 0.2,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.ceiling = max(1, ceiling)
        self.initial = initial
        self._slow_start()
        self.cooldown = cooldown
        self._last_cut = 0.0
        self._paused_until = 0.0
        self._latency: float | None = None  # typical latency of acked answers
        self._tickets = itertools.count()
        self._under_way: set[int] = set()  # tickets of the requests under way
        self._unjudged: deque[tuple[int, float]] = deque()  # under way (or since released), not yet counted as hung
        super().__init__(self.size)

    @property
    def size(self) -> int:
        return max(1, min(int(self.window), self.ceiling))

    @property
    def in_use(self) -> int:
        return self.used

    async def acquire(self) -> int:
        """Wait for a slot, and for a `Retry-After` pause to pass; returns the request's ticket, for
        `release`. A pause that began while it waited for the slot is waited out too (the slot is
        given back meanwhile): the requests queued for slots would all have gone out during it."""
        while True:
            pause = self._paused_until - self.clock()
            if pause > 0:
                await asyncio.sleep(pause)
                continue
            self._notice_hung(self.clock())
            await self._take()
            if self._paused_until <= self.clock():
                break
            self._give()
        ticket = next(self._tickets)
        self._under_way.add(ticket)
        self._unjudged.append((ticket, self.clock()))
        return ticket

    def release(self, outcome: Outcome | None, ticket: int | None = None) -> None:
        if ticket is not None:
            self._under_way.discard(ticket)
        if outcome is not None:
            self._learn(outcome)
            self.limit = self.size
        self._give()

    def hung_after(self) -> float:
        return max(HUNG_AFTER_FLOOR, HUNG_AFTER_LATENCIES * (self._latency or 0.0))

    def _notice_hung(self, now: float) -> None:
        """Count the oldest request under way as overload if it has hung (each request once)."""
        while self._unjudged and self._unjudged[0][0] not in self._under_way:
            self._unjudged.popleft()  # answered meanwhile
        if self._unjudged and now - self._unjudged[0][1] > self.hung_after() and self._cut(now):
            self._unjudged.popleft()
            self.limit = self.size

    def paused_for(self) -> float:
        """Seconds new requests still wait for a `Retry-After` (0 when none)."""
        return max(0.0, self._paused_until - self.clock())

    def pause(self, seconds: float) -> None:
        """Hold new requests for `seconds` (at most MAX_PAUSE): a `Retry-After`, this worker's or one
        another worker of the subscription got."""
        self._paused_until = max(self._paused_until, self.clock() + min(seconds, MAX_PAUSE))

    def _slow_start(self) -> None:
        """The initial window, no threshold below the ceiling, no failures remembered."""
        self.window = float(min(self.initial, self.ceiling))
        self.threshold = float(self.ceiling)
        self._error_share = 0.0

    def restart(self) -> None:
        """Slow start again from the initial window (an endpoint back after an outage)."""
        self._slow_start()
        self.limit = self.size

    def set_ceiling(self, ceiling: int) -> None:
        self.ceiling = max(1, ceiling)
        self.window = min(self.window, float(self.ceiling))
        self.limit = self.size
        self._wake()

    def _learn(self, outcome: Outcome) -> None:
        failed = refused(outcome)
        self._error_share += SHARE_WEIGHT * ((1.0 if failed else 0.0) - self._error_share)
        if outcome.acked:
            step = 1.0 if self.window < self.threshold else 1.0 / self.window
            self.window = min(float(self.ceiling), self.window + step)
            typical = self._latency
            change = 0.0 if typical is None else LATENCY_WEIGHT * (outcome.latency - typical)
            self._latency = outcome.latency if typical is None else typical + change
            return
        if not (overloaded(outcome) or (failed and self._error_share > FAILED_SHARE)):
            return
        now = self.clock()
        self._cut(now)
        if outcome.retry_after:
            self.pause(outcome.retry_after)

    def _cut(self, now: float) -> bool:
        """Halve the window, unless it was cut less than `cooldown` ago; whether it was."""
        if now - self._last_cut < self.cooldown:
            return False
        self.threshold = max(1.0, self.window / 2)
        self.window = self.threshold
        self._last_cut = now
        return True


class RateLimit:
    """A token bucket (`deliver.push.rate_limit`): `burst` requests at once, then `per_second`; the
    requests started over any `t` seconds stay within `per_second * t + burst`. Waiters are served
    in turn. `per_second` 0: no limit."""

    def __init__(self, per_second: float = 0.0, burst: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.per_second = per_second
        self.burst = burst
        self.tokens = burst
        self.updated = clock()
        self._turn = asyncio.Lock()

    def set(self, per_second: float, burst: float) -> None:
        """A live edit: what was earned at the old rate is kept, up to the new burst."""
        self._refill(self.clock())
        self.per_second, self.burst = per_second, burst
        self.tokens = min(self.tokens, burst)

    def _refill(self, now: float) -> None:
        if self.per_second > 0:
            self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.per_second)
        self.updated = now

    def wait_seconds(self) -> float:
        """How long until a request could go now (0.0: at once, or no limit); takes nothing."""
        if self.per_second <= 0:
            return 0.0
        self._refill(self.clock())
        return max(0.0, (1.0 - self.tokens) / self.per_second)

    async def take(self) -> float:
        """Wait for the next request's turn; returns the seconds waited (0.0: none)."""
        if self.per_second <= 0:
            return 0.0
        started, waited = self.clock(), False
        async with self._turn:
            while self.per_second > 0:  # an edit may lift the limit meanwhile
                self._refill(self.clock())
                if self.tokens >= 1.0:
                    self.tokens -= 1.0
                    break
                waited = True
                await asyncio.sleep((1.0 - self.tokens) / self.per_second)
        return self.clock() - started if waited else 0.0
