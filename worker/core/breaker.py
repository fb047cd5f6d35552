"""A subscription's breaker (`deliver.push.breaker`): when every attempt has failed for
`open_after_seconds`, it opens (state Suspended). Then no message is tried but one probe, the
oldest message waiting, every `probe_interval_seconds`; the others wait unacked and their attempts
are not counted, so an endpoint that is down sends nothing to the dead-letter topic. The first
probe that is acked closes it; so does `push-worker subs resume`.

Without it, an endpoint down for an hour saw every message of that hour tried `max_deliver` times
and dead-lettered, and someone had to redrive them all."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable

from worker.core.endpoint_health import ERROR_MIN_FAILURES, EndpointHealth
from worker.model.subscriptions import BreakerPolicy
from worker.runtime.aio import wait_any


class Breaker:
    """Closed, or open since `opened_at`. Failures are the endpoint health's (one streak of failed
    attempts, `EndpointHealth`): the breaker only decides when that streak holds messages back."""

    def __init__(self, health: EndpointHealth, policy: BreakerPolicy | None,
                 on_change: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.monotonic) -> None:
        self.health = health
        self.policy = policy
        self.on_change = on_change  # opened or closed: the state to report changed
        self.clock = clock
        self.opened_at: float | None = None  # monotonic
        self.opened_wall: float = 0.0  # epoch seconds, for people
        self._waiting: list[tuple[int, int, asyncio.Future[int]]] = []  # (publish time, arrival, waiter)
        self._arrivals = itertools.count(1)  # also each probe's id
        self._probing = 0  # the id of the probe under way, 0: none
        self._probe_due = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._changed = asyncio.Event()  # set (then replaced) when it opens or closes, or an attempt is acked
        self._deciding = 0  # messages waiting in `decision`

    def _change(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def acked(self) -> None:
        """An attempt was acked: the failing streak is over; who waits for a decision goes on (asked
        after every ack: nothing is done while nobody waits)."""
        if self._deciding:
            self._change()

    async def decision(self, stop: asyncio.Event, seconds: float) -> None:
        """Wait up to `seconds` for the breaker to open or close, an ack, or `stop`."""
        self._deciding += 1
        try:
            await wait_any(self._changed, stop, seconds=seconds)
        finally:
            self._deciding -= 1

    def undecided(self, since: float) -> float:
        """Seconds until the breaker decides about a failing streak that began by `since` (monotonic):
        every attempt since then failed, enough of them to open it, and it has not opened yet. 0.0: there
        is nothing to wait for (it is off or open, something was acked since, or too few failed)."""
        policy, health = self.policy, self.health
        if policy is None or self.opened_at is not None or health.failures_in_row < ERROR_MIN_FAILURES \
                or health.failing_since > since:
            return 0.0
        return max(0.0, health.failing_since + policy.open_after_seconds - self.clock())

    @property
    def is_open(self) -> bool:
        return self.opened_at is not None

    def holds(self) -> bool:
        """Whether the next attempt must wait its turn (cheap: asked before every attempt)."""
        if self.opened_at is not None:
            return True
        if self.policy is None or self.health.failures_in_row < ERROR_MIN_FAILURES:
            return False
        if self.clock() - self.health.failing_since < self.policy.open_after_seconds:
            return False
        self._open()
        return True

    def _open(self) -> None:
        assert self.policy is not None
        self.opened_at, self.opened_wall = self.clock(), time.time()
        self._probe_due = self.opened_at + self.policy.probe_interval_seconds
        self.on_change()
        self._change()

    async def turn(self, publish_time_ms: int) -> int:
        """Wait while the breaker is open. Not 0: this message is the probe of that id (report it
        with `probed`); 0: the breaker closed, go on as usual."""
        if self.opened_at is None:
            return 0
        waiter: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (publish_time_ms, next(self._arrivals), waiter))
        self._schedule()
        return await waiter

    def probed(self, probe: int, acked: bool | None) -> None:
        """Probe `probe`'s answer: acked closes the breaker; failed makes the next probe due an
        interval later; None (no request was made: the message was settled already) passes the turn
        on at once. Only the first answer of the probe under way counts (a later one is ignored)."""
        if probe != self._probing:
            return
        self._probing = 0
        if acked:
            self.close()
            return
        if acked is None:
            self._schedule()
            return
        if self.opened_at is not None and self.policy is not None:
            self._probe_due = self.clock() + self.policy.probe_interval_seconds
            self._schedule()

    def close(self) -> None:
        """Closed (a probe was acked, or by hand): every waiting message goes on; failures count from
        zero again."""
        if self.opened_at is None:
            return
        self.opened_at = None
        self._probing = 0
        self.health.reset()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiting, self._waiting = self._waiting, []
        for _, _, waiter in waiting:
            if not waiter.done():
                waiter.set_result(0)
        self.on_change()
        self._change()

    def set_policy(self, policy: BreakerPolicy | None) -> None:
        """A live edit; `off` closes an open breaker."""
        self.policy = policy
        if policy is None:
            self.close()

    def _schedule(self) -> None:
        if self._probing or self._timer is not None or self.opened_at is None:
            return
        delay = max(0.0, self._probe_due - self.clock())
        self._timer = asyncio.get_running_loop().call_later(delay, self._probe_now)

    def _probe_now(self) -> None:
        """Hand the probe to the oldest message waiting (a cancelled waiter left: the next)."""
        self._timer = None
        while self._waiting:
            _, _, waiter = heapq.heappop(self._waiting)
            if not waiter.done():
                self._probing = next(self._arrivals)
                waiter.set_result(self._probing)
                return
        # Nobody waits: the next message to arrive is sent at once (the probe is due).
