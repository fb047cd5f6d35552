"""A subscription bigger than one worker: how many workers serve it, and each one's share.

A subscription with `max_workers: N > 1` is served by between 1 and N workers, each holding one of
its slots (`leases.unit`) with a lease of its own and one consumer of the same Pulsar subscription.
How many of the N serve it (its width, `pw:{key}:workers`) is decided by the holder of its slot 0
from the backlog it reads: one more while the backlog exceeds `fleet.backlog_per_worker` per serving
worker (one a backlog reading), one fewer once it has stayed below what one worker fewer is for
during `fleet.spread_quiet_seconds` (the band between the two is the hysteresis). Every worker reads
the widths each round, so all compute the same slots.

What the subscription's definition bounds as a total stays a total: each slot serves a share of
`max_ack_pending`, `max_concurrency` and the rate limit (`share`), so an endpoint served by four
workers is not asked for four times as much.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Mapping
from typing import Any, Protocol

from redis.exceptions import ResponseError

from worker.core import keys
from worker.core.flow import MAX_PAUSE
from worker.core.redis_batch import Pipeliner
from worker.fleet.ownership import holders
from worker.fleet.worker_protocol import ServingWorker
from worker.model.subscriptions import RateLimit, Subscription
from worker.state.redis_client import AsyncClient


class Pausable(Protocol):
    """A served subscription's side of a shared pause (the dispatcher)."""

    def paused_for(self) -> float: ...  # seconds new requests still wait for a Retry-After

    def pause(self, seconds: float) -> None: ...


def share(sub: Subscription, slot: int, width: int) -> Subscription:
    """The definition slot `slot` of `width` serves: the totals split so that the slots add up to
    them (the first slots take the remainder; every slot at least one)."""
    if width <= 1:
        return sub

    def part(total: int) -> int:
        return max(1, total // width + (1 if slot < total % width else 0))

    limit = sub.rate_limit
    if limit is not None:
        limit = RateLimit(limit.messages_per_second / width, max(1.0, limit.burst / width))
    return dataclasses.replace(
        sub, max_ack_pending=part(sub.max_ack_pending), rate_limit=limit,
        max_concurrency=None if sub.max_concurrency is None else part(sub.max_concurrency))


def next_width(width: int, backlog: float, per_worker: float, limit: int, low_since: float | None, now: float,
               quiet_seconds: float) -> tuple[int, float | None]:
    """The width after one backlog reading, and since when the backlog has been low (None: it is not).
    Up by one while the backlog exceeds `per_worker` a serving worker; down by one once it has stayed
    below what one worker fewer is for during `quiet_seconds`; within `limit` always."""
    if width > limit:
        return limit, None
    if backlog > per_worker * width:
        return min(width + 1, limit), None
    if width > 1 and backlog < per_worker * (width - 1):
        if low_since is None:
            return width, now
        if now - low_since >= quiet_seconds:
            return width - 1, now  # the next step down waits another quiet period
        return width, low_since
    return width, None


class Spread:
    """The widths of the fleet's spread subscriptions, read every round; and, for those whose slot 0
    this worker holds, the decision (written to Redis)."""

    def __init__(self, batch: Pipeliner, per_worker: float, quiet_seconds: float) -> None:
        self.batch = batch
        self.per_worker, self.quiet_seconds = per_worker, quiet_seconds
        self.stored: dict[str, int] = {}  # key -> width as read from Redis (spread subscriptions only)
        self._low_since: dict[str, float] = {}
        self._last_reading: dict[str, float] = {}  # key -> when the last reading it decided on was taken

    async def read(self, subscriptions: Mapping[str, Subscription]) -> list[str]:
        """Read the width of every spread subscription; returns what was unreadable (ignored: width 1)."""
        spread = sorted(k for k, s in subscriptions.items() if s.max_workers > 1)
        values = await asyncio.gather(*(self.batch.submit("GET", keys.workers_key(k)) for k in spread),
                                      return_exceptions=True)
        stored, unreadable = {}, []
        for key, value in zip(spread, values, strict=True):
            if isinstance(value, BaseException) and not isinstance(value, ResponseError):
                raise value  # Redis did not answer: the round failed
            try:
                stored[key] = int(value) if value is not None else 1
            except (ValueError, TypeError):
                # Garbage (or a key of another type): served by one worker until slot 0's holder writes it again.
                unreadable.append(key)
                stored[key] = 1
        self.stored = stored
        for gone in set(self._last_reading) - set(stored):
            self._low_since.pop(gone, None)
            del self._last_reading[gone]
        return unreadable

    def width(self, sub: Subscription, members: int) -> int:
        """How many workers serve `sub` now: as decided, within its max_workers and the fleet's size."""
        return max(1, min(self.stored.get(sub.key, 1), sub.max_workers, members))

    async def decide(self, sub: Subscription, reading: tuple[float, float] | None, limit: int) -> int | None:
        """For the holder of `sub`'s slot 0: the next width from a backlog `reading` (value, when read),
        each reading once (a worker added needs a reading's time to show in the backlog); written to
        Redis when it changes. Returns the new width, or None when unchanged."""
        if reading is None or reading[1] == self._last_reading.get(sub.key):
            return None
        backlog, self._last_reading[sub.key] = reading
        width = max(1, min(self.stored.get(sub.key, 1), sub.max_workers))
        new, low_since = next_width(width, backlog, self.per_worker, limit, self._low_since.get(sub.key),
                                    time.monotonic(), self.quiet_seconds)
        if low_since is None:
            self._low_since.pop(sub.key, None)
        else:
            self._low_since[sub.key] = low_since
        if new == self.stored.get(sub.key, 1):
            return None
        await self.batch.submit("SET", keys.workers_key(sub.key), new)
        self.stored[sub.key] = new
        return new


def partitions_limit(sub: Subscription, partitions: int | None) -> int:
    """The most workers that can share `sub`'s work: failover gives each partition to one consumer
    (a non-partitioned topic has one), exclusive one consumer; shared and key-shared any."""
    if sub.type == "exclusive":
        return 1
    if sub.type == "failover":
        return max(1, partitions or 1)
    return sub.max_workers


class SharedPauses:
    """A `Retry-After` one worker of a spread subscription gets holds its other workers too (the
    endpoint as a whole is asked to wait): the worker that got it says so in Redis (a key that
    expires with the pause), and each worker of the subscription applies what it finds there,
    within a round."""

    def __init__(self, batch: Pipeliner) -> None:
        self.batch = batch
        self._said: dict[str, float] = {}  # key -> until when (monotonic) its Retry-After was shared

    async def exchange(self, served: Mapping[str, Pausable]) -> None:
        """One round for the spread subscriptions this worker serves (by key)."""
        if not served:
            return
        now = time.monotonic()
        said = []
        for key, dispatcher in served.items():
            own = dispatcher.paused_for()
            if own > 0.05 and self._said.get(key, 0.0) < now + own - 0.05:
                self._said[key] = now + own
                said.append((key, self.batch.submit("SET", keys.endpoint_pause_key(key), 1, "PX", int(own * 1000))))
        found = await asyncio.gather(*(self.batch.submit("PTTL", keys.endpoint_pause_key(key)) for key in served),
                                     return_exceptions=True)
        for (key, _), result in zip(said, await asyncio.gather(*(f for _, f in said), return_exceptions=True),
                                    strict=True):
            if isinstance(result, BaseException):
                self._said.pop(key, None)  # said again next round
        for dispatcher, ttl in zip(served.values(), found, strict=True):
            # No worker says a pause longer than MAX_PAUSE: a longer one is garbage, not a Retry-After.
            if isinstance(ttl, int) and 0 < ttl <= MAX_PAUSE * 1000:
                dispatcher.pause(ttl / 1000)
        for key in [k for k, until in self._said.items() if until < now]:
            del self._said[key]


NARROW_WAIT = 60.0  # seconds a seek waits for a spread subscription's other workers to let go


class Spreading:
    """A worker's round work for the spread subscriptions (max_workers > 1): their widths read
    (`read`), then, after the leases are settled, one call (`settle`) decides the widths of those
    whose slot 0 it holds, exports them, and shares Retry-After pauses among a subscription's
    workers. `narrow` serves one alone while it seeks."""

    def __init__(self, client: AsyncClient, batch: Pipeliner, per_worker: float, quiet_seconds: float,
                 worker: ServingWorker, fleet: str, channel: str, wake: asyncio.Event, log: Any) -> None:
        self.client, self.worker, self.channel, self.wake, self.log = client, worker, channel, wake, log
        self.fleet = fleet
        self.spread = Spread(batch, per_worker, quiet_seconds)
        self.pauses = SharedPauses(batch)
        self.widths: dict[str, int] = {}  # spread subscriptions: how many workers serve each
        self._reported: dict[str, int] = {}  # as exported in pushworker_subscription_workers
        self.narrowed: set[str] = set()  # held to one worker while it seeks them

    async def read(self, subscriptions: Mapping[str, Subscription]) -> list[str]:
        """Read every spread subscription's width; what was unreadable (served by one meanwhile)."""
        return await self.spread.read(subscriptions)

    def assign_widths(self, subscriptions: Mapping[str, Subscription], members: int) -> dict[str, int]:
        self.widths = {k: self.spread.width(sub, members) for k, sub in subscriptions.items() if sub.max_workers > 1}
        return self.widths

    async def settle(self, first_slots: list[str], subscriptions: Mapping[str, Subscription], members: int,
                     backlogs: Mapping[str, tuple[float, float]]) -> None:
        """Decide the widths of the spread subscriptions whose slot 0 this worker holds (`first_slots`),
        export them, and exchange the Retry-After pauses of those it serves."""
        self._report(first_slots)
        for key in first_slots:
            if key in self.narrowed:
                continue
            sub = subscriptions[key]
            partitions = await self.worker.partitions(sub.topic) if sub.type == "failover" else None
            limit = min(partitions_limit(sub, partitions), sub.max_workers, max(1, members))
            width = await self.spread.decide(sub, backlogs.get(key), limit)
            if width is not None:
                self.log.info("subscription spread", subscription=key, workers=width, backlog=backlogs[key][0])
                self.wake.set()  # take the new slots (or let one go) now, not next round
        await self.pauses.exchange({k: d for k in self.widths if (d := self.worker.dispatchers.get(k)) is not None})

    def _report(self, first_slots: list[str]) -> None:
        """`pushworker_subscription_workers` of the spread subscriptions whose slot 0 this worker holds."""
        for key in set(self._reported) - set(first_slots):
            del self._reported[key]
            with contextlib.suppress(KeyError):
                self.worker.metrics.workers.remove(*key.split("/", 1))
        for key in first_slots:
            if self._reported.get(key) != self.widths[key]:
                self._reported[key] = self.widths[key]
                self.worker.metrics.workers.labels(*key.split("/", 1)).set(self.widths[key])

    async def narrow(self, key: str, slots: int, me: str) -> None:
        """Before a spread subscription's seek: serve it with this worker alone (width 1), and wait
        until the holders of its other slots have drained and let go, since a consumer still
        attached would deliver what it holds from the old position with its counts forgotten."""
        self.narrowed.add(key)
        await self.client.set(keys.workers_key(key), 1)
        self.spread.stored[key] = 1
        await self.client.publish(self.channel, b"members")  # the others let go now, not next round
        deadline = time.monotonic() + NARROW_WAIT
        while await holders(self.client, self.fleet, key, slots) - {me} and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.2)
