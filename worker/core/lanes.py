"""Ordering, one mechanism for all four subscription types: each message gets a *lane*. Messages of
one lane are handled one after another (the next is not sent before the previous is acked or
dead-lettered); lanes run in parallel. shared: every message its own lane (None). key-shared: a lane
per key. exclusive and failover: a single lane."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

from worker.core.messages import Envelope
from worker.model.subscriptions import Subscription

Item = tuple[Any, Envelope]  # a Pulsar message and what the worker read of it
_SINGLE_LANE = "\x00total-order"


def lane_of(sub: Subscription, env: Envelope) -> str | None:
    """The ordering lane of a message, or None when it may go in parallel with everything."""
    if sub.type in ("exclusive", "failover"):
        return _SINGLE_LANE
    if sub.type == "key-shared" and env.ordering_key is not None:
        return env.ordering_key
    return None


class Lanes:
    """The lanes with a message (or batch) under way, and what waits behind it, in order."""

    def __init__(self, release: Callable[[Envelope], None], stopping: asyncio.Event) -> None:
        self._queues: dict[str, deque[Item]] = {}
        self._release = release  # a message waiting here is handed back (stopping)
        self._stopping = stopping

    def busy(self, lane: str) -> bool:
        """Whether `lane` has a message under way (a new one waits behind it)."""
        return lane in self._queues

    def start(self, lane: str, behind: deque[Item] | None = None) -> None:
        """A message or batch of `lane` is under way; `behind`: what already waits for it."""
        self._queues[lane] = deque() if behind is None else behind

    def wait_behind(self, lane: str, item: Item) -> None:
        self._queues[lane].append(item)

    def next(self, lane: str) -> Item | None:
        """The lane's message under way has settled: its next one, or None when the lane is done."""
        queue = self._queues[lane]
        if queue and not self._stopping.is_set():
            return queue.popleft()
        self.end(lane)
        return None

    def waiting(self, lane: str) -> deque[Item] | None:
        """The lane's batch has settled: all that waits behind it, or None when the lane is done."""
        if self._queues[lane] and not self._stopping.is_set():
            return self._queues.pop(lane)
        self.end(lane)
        return None

    def end(self, lane: str) -> None:
        for _, env in self._queues.pop(lane):  # stopping: released to the broker with the consumer
            self._release(env)
