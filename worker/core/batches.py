"""Messages waiting to be batched (`deliver.push.batch`): which may go in the next request, and when.

A message whose ordering lane has a batch under way waits in the dispatcher's lane queue, as in
single-message delivery; when that batch settles, the lane's queue comes back here, ready. Every
message here may go in the next batch: a lane's messages together and in order, so a batch keeps a
key's order within it, and the next batch of that key waits until this one is settled.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable

from worker.core.context import Shared
from worker.core.flow import RateLimit
from worker.core.lanes import Item, Lanes
from worker.core.messages import Envelope, batch_entry_bytes
from worker.model.subscriptions import BatchPolicy
from worker.runtime.aio import wait_any

IDLE_RECHECK_SECONDS = 600.0  # a batch former with nothing to batch waits for a message, not a timer
ONE_A_REQUEST = BatchPolicy(max_messages=1, max_wait_ms=0)  # what is still forming when batching is turned off
OVERDUE = float("-inf")  # the arrival of messages that already waited behind their lane's batch


class Forming:
    """Messages admitted and not yet in a batch: loose ones (no lane) and ready lanes (none of their
    messages is under way)."""

    def __init__(self) -> None:
        self._loose: deque[tuple[float, Item]] = deque()
        self._lanes: dict[str, tuple[float, deque[Item]]] = {}  # lane -> (when it became ready, its messages)
        self.count = 0
        self.bytes = 0  # batch_entry_bytes of everything here
        self._lanes_first = False  # alternates, so that neither loose messages nor lanes wait on the other

    def __bool__(self) -> bool:
        return self.count > 0

    def add(self, item: Item, lane: str | None) -> None:
        if lane is None:
            self._loose.append((time.monotonic(), item))
        elif lane in self._lanes:
            self._lanes[lane][1].append(item)
        else:
            self._lanes[lane] = (time.monotonic(), deque((item,)))
        self.count += 1
        self.bytes += batch_entry_bytes(item[1])

    def lane_ready(self, lane: str, items: deque[Item]) -> None:
        """The lane's batch settled: what queued behind it may go at once."""
        self._lanes[lane] = (OVERDUE, items)
        self.count += len(items)
        self.bytes += sum(batch_entry_bytes(env) for _, env in items)

    def oldest(self) -> float:
        """When the longest-waiting message here arrived (monotonic); OVERDUE for a lane that waited."""
        first_loose = self._loose[0][0] if self._loose else float("inf")
        first_lane = next(iter(self._lanes.values()))[0] if self._lanes else float("inf")
        return min(first_loose, first_lane)

    def take(self, max_messages: int, max_bytes: int) -> tuple[list[Item], dict[str, deque[Item]]]:
        """The next batch: at least one message, at most `max_messages`, and no more than `max_bytes`
        (estimated) unless a single message is larger; and for each lane it holds messages of, the
        lane's messages that did not fit (they wait behind the batch, in the dispatcher's lane queue)."""
        batch = _Batch(max_messages, max_bytes)
        self._lanes_first = not self._lanes_first
        if self._lanes_first:
            self._take_lanes(batch)
            self._take_loose(batch)
        else:
            self._take_loose(batch)
            self._take_lanes(batch)
        self.count -= len(batch.items)
        self.bytes -= batch.size
        return batch.items, batch.lanes

    def _take_loose(self, batch: _Batch) -> None:
        size = batch.room_for(self._loose[0][1][1]) if self._loose else None
        while size is not None:
            batch.add(self._loose.popleft()[1], size)
            size = batch.room_for(self._loose[0][1][1]) if self._loose else None

    def _take_lanes(self, batch: _Batch) -> None:
        while self._lanes:
            lane, (_, queue) = next(iter(self._lanes.items()))
            size = batch.room_for(queue[0][1])
            if size is None:
                return
            del self._lanes[lane]
            while size is not None:
                batch.add(queue.popleft(), size)
                size = batch.room_for(queue[0][1]) if queue else None
            batch.lanes[lane] = queue  # what did not fit waits behind the batch
            self.count -= len(queue)
            self.bytes -= sum(batch_entry_bytes(env) for _, env in queue)

    def drain(self) -> list[Item]:
        """Everything here (the dispatcher stops: released to the broker)."""
        items = [item for _, item in self._loose] + [item for _, queue in self._lanes.values() for item in queue]
        self._loose.clear()
        self._lanes.clear()
        self.count = self.bytes = 0
        return items


class _Batch:
    """A batch being taken: its messages, their estimated size, the lanes it holds, its bounds."""

    def __init__(self, max_messages: int, max_bytes: int) -> None:
        self.max_messages, self.max_bytes = max_messages, max_bytes
        self.items: list[Item] = []
        self.lanes: dict[str, deque[Item]] = {}
        self.size = 0

    def room_for(self, env: Envelope) -> int | None:
        """`env`'s size in the batch when it may join (the first message always may); else None."""
        size = batch_entry_bytes(env)
        if not self.items or (len(self.items) < self.max_messages and self.size + size <= self.max_bytes):
            return size
        return None

    def add(self, item: Item, size: int) -> None:
        self.items.append(item)
        self.size += size


class BatchFormer:
    """Makes the batches: when enough is waiting (`max_messages`, `max_bytes`), or when the oldest
    message has waited `max_wait_ms`; each goes to `deliver` with the lanes it holds (what did not fit
    waits behind it in `lanes`). Its task starts with the first message."""

    def __init__(self, shared: Shared, rate: RateLimit, lanes: Lanes, release: Callable[[Envelope], None],
                 deliver: Callable[[list[Item], list[str]], Awaitable[None]]) -> None:
        self._shared = shared
        self._rate = rate
        self._lanes = lanes
        self._release = release  # a message still forming is handed back (stopping)
        self._deliver = deliver
        self._forming = Forming()
        self._formed = asyncio.Event()  # set when `_forming` may have a batch to make
        self.task: asyncio.Task[None] | None = None

    def __bool__(self) -> bool:
        """Whether messages are still forming (batching may have been turned off meanwhile)."""
        return bool(self._forming)

    def add(self, item: Item, lane: str | None) -> None:
        self._forming.add(item, lane)
        self._form_soon()

    def lane_ready(self, lane: str, items: deque[Item]) -> None:
        """The lane's batch settled: what waited behind it may go in the next batch."""
        self._forming.lane_ready(lane, items)
        self._form_soon()

    def _form_soon(self) -> None:
        if self.task is None:
            self.task = self._shared.ctx.supervisor.spawn("batches", self._run)
        self._formed.set()

    async def _run(self) -> None:
        shared = self._shared
        stopping = shared.stopping
        try:
            while not stopping.is_set():
                if not self._forming:
                    self._formed.clear()
                    await wait_any(self._formed, stopping, seconds=IDLE_RECHECK_SECONDS)
                    continue
                policy = shared.sub.batch or ONE_A_REQUEST
                if self._forming.count < policy.max_messages and self._forming.bytes < policy.max_bytes:
                    # Not full: it closes at max_wait_ms, and not before the rate limit lets its request
                    # go; till then it keeps filling (closed first, batches of one or two waited for
                    # tokens while the backlog grew).
                    late = max(self._forming.oldest() + policy.max_wait_ms / 1000 - time.monotonic(),
                               self._rate.wait_seconds())
                    if late > 0:
                        self._formed.clear()
                        await wait_any(self._formed, stopping, seconds=late)
                        continue
                items, lanes = self._forming.take(policy.max_messages, policy.max_bytes)
                for lane, behind in lanes.items():
                    self._lanes.start(lane, behind)
                shared.spawn(self._deliver(items, list(lanes)))
        finally:
            for _, env in self._forming.drain():  # stopping: released to the broker with the consumer
                self._release(env)
