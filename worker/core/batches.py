"""Messages waiting to be batched (`deliver.push.batch`): which may go in the next request, and when.

A message whose ordering lane has a batch under way waits in the dispatcher's lane queue, as in
single-message delivery; when that batch settles, the lane's queue comes back here, ready. Every
message here may go in the next batch: a lane's messages together and in order, so a batch keeps a
key's order within it, and the next batch of that key waits until this one is settled.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from worker.core.messages import Envelope, batch_entry_bytes

Item = tuple[Any, Envelope]  # a Pulsar message and what the worker read of it
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
