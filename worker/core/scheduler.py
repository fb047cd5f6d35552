"""A fair share of the event loop across projects: deficit round robin over the work a worker starts
(a message taken from the client, a request sent, a retry), so that one project's burst, retry
storm or large messages cannot keep another project's messages waiting behind its own.

Uncontended, a turn is granted at once: one project alone, or several that together start fewer
than `per_turn` units of work in a turn of the loop, pay a counter and no wait. Once two projects
have started work within CONTENTION_SECONDS of each other and the turn's units are used up, every
turn waits in its project's queue; once a turn of the loop, the queues are served round robin, each
project's deficit growing by QUANTUM a round and paying each unit's cost (1, more for large
messages), until `per_turn` units are granted. A project with nothing waiting keeps no deficit.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

PER_TURN = 32  # units of work started in one turn of the loop while projects contend
QUANTUM = 4  # a project's credit per round of the queues, in units
CONTENTION_SECONDS = 0.05  # two projects starting work this close together contend
LARGE_UNIT_BYTES = 64 << 10  # a message's cost: one unit, and one more per this many bytes


def cost_of(size: int) -> int:
    """The cost of starting work on a message of `size` bytes (a large one costs more turns)."""
    return 1 + size // LARGE_UNIT_BYTES


def _nothing() -> None:
    pass


class _Queue:
    """One project's waiting turns and its deficit."""

    __slots__ = ("deficit", "waiters")

    def __init__(self) -> None:
        self.waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        self.deficit = 0


class FairShare:
    """The worker's scheduler: `await turn(project, cost)` before starting a unit of work."""

    def __init__(self, per_turn: int = PER_TURN) -> None:
        self.per_turn = per_turn
        self._granted = 0  # units granted since the queues were last served
        self._queues: dict[str, _Queue] = {}  # projects with turns waiting, in round-robin order
        self._serving = False  # a turn of the loop is to serve the queues
        self._last_project = ""
        self._switched_at = float("-inf")  # when work last went to another project than before
        self.waited = 0  # turns that waited
        self.on_wait: Callable[[], None] = _nothing  # told of each (pushworker_fair_share_waits_total)

    def contended(self) -> bool:
        return time.monotonic() - self._switched_at < CONTENTION_SECONDS

    async def turn(self, project: str, cost: int = 1) -> None:
        if project != self._last_project:
            if self._last_project:
                self._switched_at = time.monotonic()
            self._last_project = project
        if not self._queues and (self._granted < self.per_turn or not self.contended()):
            self._granted += cost
            return
        queue = self._queues.get(project)
        if queue is None:
            queue = self._queues[project] = _Queue()
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue.waiters.append((cost, waiter))
        self.waited += 1
        self.on_wait()
        if not self._serving:
            self._serving = True
            asyncio.get_running_loop().call_soon(self._serve)
        try:
            await waiter
        except asyncio.CancelledError:
            if not waiter.done() or waiter.cancelled():
                self._forget(project, waiter)
            raise

    def _forget(self, project: str, waiter: asyncio.Future[None]) -> None:
        queue = self._queues.get(project)
        if queue is None:
            return
        for i, (_, queued) in enumerate(queue.waiters):
            if queued is waiter:
                del queue.waiters[i]
                break
        if not queue.waiters:
            del self._queues[project]

    def _serve(self) -> None:
        """Grant up to `per_turn` units, round robin over the projects with turns waiting."""
        self._granted = 0
        while self._queues and self._granted < self.per_turn:
            for project in list(self._queues):
                queue = self._queues[project]
                queue.deficit += QUANTUM
                while queue.waiters and queue.waiters[0][0] <= queue.deficit:
                    cost, waiter = queue.waiters.popleft()
                    queue.deficit -= cost
                    self._granted += cost
                    if not waiter.done():
                        waiter.set_result(None)
                if not queue.waiters:
                    del self._queues[project]  # its deficit goes with it: nothing is saved up
                else:  # to the back of the round robin
                    del self._queues[project]
                    self._queues[project] = queue
                if self._granted >= self.per_turn:
                    break
        if self._queues:
            asyncio.get_running_loop().call_soon(self._serve)
        else:
            self._serving = False
