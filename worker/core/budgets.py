"""Budgets that bound what one subscription or project may hold, and what all of them hold together:
a subscription's held payload bytes (`max_held_bytes_per_subscription`), the worker's
(`max_held_bytes`), and the worker's open connections, shared by project (`max_connections`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

LENDABLE = 0.75  # borrowing beyond fair shares stops at this share of the total


class SharedBudget:
    """A budget every member draws on together, shared fairly: the payload bytes all subscriptions of
    a worker hold (`max_held_bytes`), the connections all projects open (`max_connections`).

    Each member may always hold one unit of use (one message, one connection), and up to its fair
    share (the total over the members); beyond that it borrows what the others leave unused. A
    quarter of the total is kept for members under their fair share (or still to come), and
    borrowing stops while such a member waits: lent use comes back as the borrower's messages
    settle and its connections close. Per-member bounds held one subscription; nothing held their sum (three
    projects' large messages took a worker to 1,226 MiB against a 1 GiB limit)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0
        self.members: set[ByteBudget] = set()
        self.waiting: set[ByteBudget] = set()  # members with a take waiting

    def fair_share(self) -> int:
        return self.total // max(1, len(self.members))

    def admits(self, member: ByteBudget, size: int) -> bool:
        if self.used + size > self.total:
            return False
        fair = self.fair_share()
        # Use may not come back soon (a hung endpoint holds its messages and sockets for its ack
        # deadline): a quarter of the total is kept for the members under their fair share, or
        # still to come, whatever one member alone could use.
        lendable = int(self.total * LENDABLE)
        if member.used + size <= min(fair, lendable):
            return True
        if self.used + size > lendable:
            return False
        return not any(m is not member and m.used < fair for m in self.waiting)

    def holds_back(self, member: ByteBudget) -> bool:
        """Whether `member` waits for room (its idle connections are then closed, not kept)."""
        return member in self.waiting

    def wake(self) -> None:
        """Room came back: the members waiting take it, the least served first."""
        for member in sorted(self.waiting, key=lambda m: m.used):
            member._wake()


class ByteBudget:
    """Payload bytes of the messages a subscription holds (taken from the broker, not settled):
    `max_ack_pending` counts messages, and a subscription of large ones took the worker's memory to
    its window times their size (150 messages of 4 MiB: 2 GiB, measured), enough to kill a pod, and
    then each next owner of the subscription. A message waits for room; one larger than the whole
    budget goes when nothing else is held. Waiters are served in turn. With a `pool`, the bytes
    also count against the worker's budget, shared fairly (`SharedBudget`)."""

    def __init__(self, limit: int, pool: SharedBudget | None = None) -> None:
        self.limit = limit
        self.used = 0
        self.pool = pool
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        if pool is not None:
            pool.members.add(self)

    def _fits(self, size: int) -> bool:
        if self.used == 0:
            return True
        if self.used + size > self.limit:
            return False
        return self.pool is None or self.pool.admits(self, size)

    def _add(self, size: int) -> None:
        self.used += size
        if self.pool is not None:
            self.pool.used += size

    def try_take(self, size: int) -> bool:
        """Take `size` bytes if they fit and nobody waits before; never waits."""
        if self._waiters or not self._fits(size):
            return False
        self._add(size)
        return True

    async def take(self, size: int) -> None:
        """Wait for `size` bytes, in turn."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((size, waiter))
        if self.pool is not None:
            self.pool.waiting.add(self)
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
        self._add(-size)
        self._wake()
        if self.pool is not None and self.pool.waiting:
            self.pool.wake()

    def _wake(self) -> None:
        while self._waiters:
            size, waiter = self._waiters[0]
            if waiter.done():  # cancelled: its task is leaving
                self._waiters.popleft()
                continue
            if not self._fits(size):
                return
            self._waiters.popleft()
            self._add(size)
            waiter.set_result(None)
        if self.pool is not None:
            self.pool.waiting.discard(self)

    def close(self) -> None:
        """Leave the pool (the subscription stopped): what it still held goes back to the others."""
        if self.pool is not None:
            self.pool.members.discard(self)
            self.pool.waiting.discard(self)
            self.pool.used -= self.used
            self.used = 0
            self.pool.wake()


# How many messages a subscription's consumer prefetches: broker/prefetch.py says why.
# A subscription that has carried a message this large subscribes through a Pulsar client of its
# own (its own connection and I/O thread): 4 MiB frames on the connection every other subscription
# shares queued their messages behind them (another project's p99 1,021x its own alone).
LARGE_MESSAGE_BYTES = 1 << 20
MAX_PREFETCH = 1000
SHARE_OF_HELD_BYTES = 2  # prefetched bytes stay under max_held_bytes_per_subscription / this


def prefetch_bytes(max_held_bytes: int) -> int:
    return max_held_bytes // SHARE_OF_HELD_BYTES


def default_prefetch(max_ack_pending: int) -> int:
    """The most a consumer prefetches, whatever the sizes: the window, at most MAX_PREFETCH."""
    return max(1, min(max_ack_pending, MAX_PREFETCH))


def prefetch_for(max_ack_pending: int, largest: int, budget: int, max_message_bytes: int) -> int:
    """The prefetch that holds at most `budget` bytes of messages of the broker's largest size, or of
    `largest` (the largest the subscription has carried; 0: unknown) if that is larger."""
    return max(1, min(default_prefetch(max_ack_pending), budget // max(largest, max_message_bytes, 1)))


def too_large(prefetch: int, budget: int) -> int:
    """The size above which a consumer of `prefetch` messages subscribes again with fewer: twice
    what would fit, so that sizes near the bound do not make a subscription subscribe over and over."""
    return 2 * budget // prefetch
