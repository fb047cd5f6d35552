"""One dispatcher per owned subscription: it wires the parts of a delivery and runs them.

    consumer -> intake -> lanes (ordering) -> [batch former] -> retrying -> sending -> settlement

`intake` takes messages within `max_ack_pending` and the held-bytes budgets; `lanes` keeps each
ordering lane to one message (or batch) under way; `batches` forms requests of many messages;
`retrying` makes each message's attempts until it settles, through `sending` (rate limit, endpoint
window, credentials); `settlement` acks, dead-letters or drops, and records it in Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from worker.core.batches import BatchFormer
from worker.core.breaker import Breaker
from worker.core.budgets import MAX_PREFETCH
from worker.core.context import ConsumerLike, DeliveryContext, Fence, Shared, Stats
from worker.core.endpoint_health import ERROR_AFTER_SECONDS, EndpointHealth
from worker.core.fencing import Fencing
from worker.core.intake import Intake
from worker.core.lanes import Item, Lanes, lane_of
from worker.core.messages import Envelope, rfc3339
from worker.core.retrying import Retrying
from worker.core.sending import Sender
from worker.core.settlement import Settlement
from worker.model.subscriptions import State, Subscription
from worker.runtime.aio import cancel_within

__all__ = ["CLOSE_TIMEOUT", "DeliveryContext", "Dispatcher", "Fence", "Stats", "lane_of"]

CLOSE_TIMEOUT = 5.0  # seconds a broker close may take before shutdown goes on without it


class Dispatcher:
    """Delivers one subscription's messages. `start()`, then `stop()`; `update()` applies live edits."""

    def __init__(
        self,
        sub: Subscription,
        consumer: ConsumerLike,
        to_envelope: Callable[[Any], Envelope],
        ctx: DeliveryContext,
        lease: Fence | None = None,
        prefetch: int = MAX_PREFETCH,
        on_large_message: Callable[[int], None] | None = None,
        stats: Stats | None = None,
        error_after: float = ERROR_AFTER_SECONDS,
    ) -> None:
        # A replaced dispatcher's counters go on in its replacement.
        self._shared = shared = Shared(sub, ctx, stats or Stats())
        self.stats = shared.stats
        self.ctx = ctx
        self.consumer = consumer
        self.lease = lease
        self.prefetch = prefetch
        self.health = EndpointHealth(error_after)
        self.breaker = Breaker(self.health, sub.breaker, self._breaker_changed)
        self._reported_state = State.ACTIVE
        self._fencing = Fencing(lease, shared.stopping)
        self.intake = Intake(shared, consumer, to_envelope, self._route, prefetch, on_large_message)
        self._lanes = Lanes(self.intake.settled, shared.stopping)
        self._sender = Sender(shared, self._fencing, self.breaker, self.health, self._report_state)
        self.endpoint_limit = self._sender.endpoint_limit
        self.rate = self._sender.rate
        self._settlement = Settlement(shared, consumer, self._fencing)
        self._retrying = Retrying(shared, self._fencing, self.breaker, self._sender, self._settlement)
        self._batches = BatchFormer(shared, self.rate, self._lanes, self.intake.settled, self._settle_batch)
        self._receiver: asyncio.Task[None] | None = None

    @property
    def sub(self) -> Subscription:
        return self._shared.sub

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        shared = self._shared
        shared.loop = asyncio.get_running_loop()
        m = shared.m
        m.owned.set(1)
        # Read when scraped, not written per message: exact, and free on the hot path.
        m.unsettled.set_function(lambda: self.unsettled)
        m.held_bytes.set_function(lambda: self.intake.held.used)
        m.in_flight.set_function(lambda: self.endpoint_limit.in_use)
        m.endpoint_window.set_function(lambda: self.endpoint_limit.size)
        self._reported_state = self.state
        self.ctx.metrics.set_state(self.sub.tenant, self.sub.name, self.state)
        self._receiver = self.ctx.supervisor.spawn("receive", self.intake.run)

    def update(self, sub: Subscription) -> None:
        """Apply an edit of mutable fields; a request under way keeps the values it started with."""
        self._shared.sub = sub
        self.intake.window.resize(sub.max_ack_pending)
        self._sender.update(sub)
        self.breaker.set_policy(sub.breaker)

    async def stop(self, grace: float, unsubscribe: bool = False) -> None:
        """Stop intake; let requests under way finish within `grace`; release the rest to the broker
        (or delete the broker subscription, with `unsubscribe`)."""
        shared = self._shared
        shared.stopping.set()
        # Closing the consumer below hands back what a receive loop that did not end still holds.
        if self._receiver is not None and await cancel_within([self._receiver], CLOSE_TIMEOUT):
            shared.log.warning("receive loop did not end on cancel; stopping without it")
        if self._batches.task is not None:
            await cancel_within([self._batches.task], CLOSE_TIMEOUT)
        if shared.tasks:
            _, pending = await asyncio.wait(set(shared.tasks), timeout=grace)
            await cancel_within(pending, CLOSE_TIMEOUT)
        # Closing the consumer hands every unacked message back to the broker for redelivery.
        # Bounded: a close that the client never confirms must not hold up a shutdown.
        if unsubscribe:
            try:
                await asyncio.wait_for(self.consumer.unsubscribe(), timeout=CLOSE_TIMEOUT)
            except Exception as e:  # the consumer is still closed below; the broker keeps the subscription
                shared.log.warning("broker subscription not deleted; it keeps its backlog until deleted",
                                   error=str(e) or type(e).__name__)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.consumer.close(), timeout=CLOSE_TIMEOUT)
        self.intake.held.close()
        self.ctx.metrics.forget(self.sub.tenant, self.sub.name)

    # -- what it shows -----------------------------------------------------------------------

    @property
    def unsettled(self) -> int:
        """Messages taken and not yet settled."""
        return self.intake.unsettled

    @property
    def oldest_unsettled_ms(self) -> int | None:
        """The publish time of the oldest message taken and not yet settled (None: none held)."""
        return self.intake.oldest_unsettled_ms

    @property
    def state(self) -> State:
        return State.SUSPENDED if self.breaker.is_open else self.health.state

    @property
    def state_reason(self) -> str:
        """Why the state is what it is (for `subs list`); empty when Active and nothing is failing."""
        reasons = (self._breaker_reason() or self.health.reason, self.ctx.attempts.failing_reason(self.sub.key),
                   self._settlement.dead_letter_failures.reason)
        return "; ".join(reason for reason in reasons if reason)

    def _breaker_reason(self) -> str:
        policy = self.breaker.policy
        if not self.breaker.is_open or policy is None:
            return ""
        return (f"breaker open since {rfc3339(int(self.breaker.opened_wall * 1000))}: every attempt failed for "
                f"{policy.open_after_seconds:g} s (last: {self.health.last_failure}); one probe every "
                f"{policy.probe_interval_seconds:g} s, nothing else sent or counted")

    def _breaker_changed(self) -> None:
        reason = self._breaker_reason()
        if self.breaker.is_open:
            self._shared.log.warning("breaker open: the endpoint failed every attempt; probing", reason=reason)
        else:
            self._shared.log.info("breaker closed: delivering again")
            self.endpoint_limit.restart()  # slow start: the endpoint just came back
        if self.ctx.tracer is not None:
            self.ctx.tracer.breaker(self.sub, self.breaker.is_open, reason or "a probe was acked")
        self._report_state()

    def _report_state(self) -> None:
        if self.state is not self._reported_state:
            self._reported_state = self.state
            self.ctx.metrics.set_state(self.sub.tenant, self.sub.name, self.state)

    # -- what the fleet tells it -------------------------------------------------------------

    def paused_for(self) -> float:
        """Seconds new requests to the endpoint still wait for a `Retry-After`."""
        return self.endpoint_limit.paused_for()

    def pause(self, seconds: float) -> None:
        """Hold new requests to the endpoint for `seconds`: another worker of the subscription got a
        `Retry-After` (the fleet passes it on)."""
        self.endpoint_limit.pause(seconds)

    def resume(self, resumed_at_ms: int) -> bool:
        """`subs resume` at `resumed_at_ms`: closes the breaker if it opened before then."""
        if not self.breaker.is_open or resumed_at_ms < self.breaker.opened_wall * 1000:
            return False
        self.breaker.close()
        return True

    # -- the flow: intake -> lanes -> delivery -----------------------------------------------

    def _route(self, message: Any, env: Envelope) -> None:
        """Where an admitted message goes: behind its lane's message under way, into a batch, or out."""
        lane = lane_of(self.sub, env)
        if lane is not None and self._lanes.busy(lane):  # it goes when the lane's message or batch settles
            self._lanes.wait_behind(lane, (message, env))
        elif self.sub.batch is not None or self._batches:  # still forming batches: a lane's order goes on there
            self._batches.add((message, env), lane)
        else:
            if lane is not None:
                self._lanes.start(lane)
            self._shared.spawn(self._settle_one(message, env, lane))

    async def _settle_one(self, message: Any, env: Envelope, lane: str | None = None) -> None:
        """Settle the message; in a lane, then the messages queued behind it, one after another, in
        this same task. A task per lane and one per settled record cost key-shared, whose lanes are
        mostly one message long, about 4 us a message more than shared (`make bench --section
        dispatcher`): a lane with nothing waiting ends with its record written in its own task."""
        while True:
            record: Awaitable[None] | None = None
            try:
                record = await self._retrying.message(message, env)
            except asyncio.CancelledError:
                if lane is not None:
                    self._lanes.end(lane)
                raise
            except Exception as e:  # a failure of this message's own (a bug, an overflow): it settles it
                record = await self._settlement.failed(message, env, e)
            finally:
                self.intake.settled(env)
            # Settled once the broker has the ack: the slot is free; the Redis record follows (in the
            # background when the lane's next message is waiting, so that it goes at once).
            following = self._lanes.next(lane) if lane is not None else None
            if following is None:
                if record is not None:
                    await record
                return
            if record is not None:
                self._shared.spawn(record)
            message, env = following

    async def _settle_batch(self, items: list[Item], lanes: list[str]) -> None:
        """Settle a batch's messages; then what waits behind its lanes may be batched."""
        records: list[Awaitable[None]] = []
        unsettled = {env.message_id: (message, env) for message, env in items}
        try:
            await self._retrying.batch(items, records, unsettled)
        except asyncio.CancelledError:
            for lane in lanes:
                self._lanes.end(lane)
            lanes = []
            raise
        except Exception as e:  # a failure of this batch's own (a bug): each message settles alone
            for message, env in list(unsettled.values()):
                record = await self._settlement.failed(message, env, e)
                if record is not None:
                    records.append(record)
        finally:
            for _, env in items:
                self.intake.settled(env)
            for lane in lanes:
                behind = self._lanes.waiting(lane)
                if behind is not None:
                    self._batches.lane_ready(lane, behind)
        if records:
            await asyncio.gather(*records)
