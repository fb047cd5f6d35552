"""The lease as a dispatcher sees it: no attempt unless this worker still owns the subscription."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from worker.core.context import Fence
from worker.runtime.aio import wait_any

# A renewal wakes fenced messages (`Fence.renewal`); the recheck only bounds the harm of a missed wake-up.
FENCE_RECHECK_SECONDS = 5.0


def _always() -> bool:
    return True


class Fencing:
    """Whether this worker may deliver now, and the wait until it may again."""

    def __init__(self, lease: Fence | None, stopping: asyncio.Event) -> None:
        self.lease = lease  # None: not fenced (a worker without a fleet)
        self.may_deliver: Callable[[], bool] = lease.valid if lease is not None else _always
        self._stopping = stopping
        self._wait: asyncio.Task[None] | None = None  # the one wait fenced messages share

    async def wait(self) -> bool:
        """True once this worker may deliver. While it may not (its lease could not be renewed in
        time: Redis slow or failing over), wait: a renewal lets the message go on, a lost lease stops
        the dispatcher (False). Waiting for the stop alone would strand the message when the renewal
        comes through after all. Every fenced message of the dispatcher shares one wait, woken by the
        renewal, not a poll: polls by many fenced subscriptions starve the lease renewals
        (docs/measurements/reliability.md#fenced-messages)."""
        while not self.may_deliver():
            if self._stopping.is_set():
                return False
            if self._wait is None:
                self._wait = asyncio.get_running_loop().create_task(self._await_renewal())
            await asyncio.shield(self._wait)  # a waiter's cancellation must not end the others' wait
        return True

    async def _await_renewal(self) -> None:
        assert self.lease is not None  # only a lease fences
        try:
            while not self.may_deliver() and not self._stopping.is_set():
                await wait_any(self.lease.renewal, self._stopping, seconds=FENCE_RECHECK_SECONDS)
        finally:
            self._wait = None
