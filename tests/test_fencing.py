"""Fencing inside the dispatcher: a lease lost just before a request means no request, no settle."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from tests.support.builders import make_sub
from tests.support.endpoints import Endpoint
from tests.support.helpers import assert_stays, eventually
from worker.broker.deadletter import DeadLetterPublisher
from worker.core.attempts import AttemptStore
from worker.core.delivery import Deliverer
from worker.core.dispatcher import DeliveryContext, Dispatcher
from worker.core.messages import Envelope
from worker.core.metrics import Metrics
from worker.core.redis_batch import Pipeliner
from worker.endpoint.destinations import DestinationPolicy
from worker.fleet.leases import Lease
from worker.model.config import RedisSettings


class OneMessage:
    """An in-memory consumer holding one message (the logic under test is the dispatcher's)."""

    def __init__(self) -> None:
        self.given = False
        self.acked: list[object] = []
        self.closed = False

    async def receive(self) -> object:
        if self.given:
            await asyncio.Event().wait()
        self.given = True
        return "message"

    def receive_ready(self) -> None:
        return None

    async def acknowledge(self, message: object) -> None:
        self.acked.append(message)

    async def close(self) -> None:
        self.closed = True


class ScriptedLease(Lease):
    """The worker's lease, not yet renewed (so not valid), the first answers of `valid()` scripted;
    counts how often it is checked."""

    def __init__(self, first_answers=()) -> None:
        super().__init__(ttl=10.0, margin=2.0)
        self.answers = iter(first_answers)
        self.checks = 0

    def valid(self) -> bool:
        self.checks += 1
        return next(self.answers, super().valid())


def run_one(redis_url: str, sub, topic: str, lease: Lease, consumer: OneMessage | None = None,
            message_id=lambda m: "1:2:-1:-1"):
    client = aioredis.Redis.from_url(redis_url)
    pipeliner = Pipeliner(client)
    deliverer = Deliverer(DestinationPolicy(allow_private=True))
    consumer = consumer or OneMessage()
    ctx = DeliveryContext(deliverer, AttemptStore(pipeliner, RedisSettings(attempts_ttl_seconds=3600)),
                          DeadLetterPublisher(None), Metrics())  # type: ignore[arg-type]
    dispatcher = Dispatcher(sub, consumer, lambda m: Envelope(message_id(m), b"x", topic, 0), ctx, lease)

    async def close() -> None:
        await pipeliner.close()
        await client.aclose()
        await deliverer.close()
    return dispatcher, consumer, close


@pytest.mark.parametrize("early_checks", [(), (True,)], ids=["before-counting", "right-before-the-request"])
async def test_a_lease_renewed_after_a_slow_moment_lets_the_waiting_message_go_on(
        redis_url, endpoint: Endpoint, topic, early_checks):
    # Renewals late (Redis failing over): the lease cannot be vouched for, then is renewed after all.
    # The message waits, then is delivered; it used to wait for a stop that never came (stranded).
    sub = make_sub(topic, endpoint.url)
    lease = ScriptedLease(early_checks)
    dispatcher, consumer, close = run_one(redis_url, sub, topic, lease)
    try:
        dispatcher.start()
        await eventually(lambda: consumer.given and dispatcher.unsettled >= 1, what="message taken")
        await assert_stays(lambda: not endpoint.requests, 0.3, "nothing sent while fenced")
        lease.renewed(time.monotonic())
        await eventually(lambda: consumer.acked == ["message"], what="delivered once the lease is renewed")
        assert len(endpoint.requests) == 1
    finally:
        await dispatcher.stop(grace=1)
        await close()


async def test_lease_lost_before_the_request_sends_and_settles_nothing(redis_url, endpoint: Endpoint, topic):
    # The last allowed attempt: on the old code a "lease lost" counted as a failed attempt and the
    # message was dropped (or dead-lettered) without ever being sent.
    sub = make_sub(topic, endpoint.url, max_deliver=1)
    lease = ScriptedLease([True])  # the lease holds for the first check, then is gone
    dispatcher, consumer, close = run_one(redis_url, sub, topic, lease)
    try:
        dispatcher.start()
        await eventually(lambda: consumer.given and dispatcher.unsettled >= 1, what="message taken")
        await assert_stays(lambda: not endpoint.requests and not consumer.acked, 0.3, "nothing sent or settled")
        await dispatcher.stop(grace=1)
        assert endpoint.requests == []
        assert consumer.acked == []  # left to the broker for the next owner
        assert (dispatcher.stats.dropped, dispatcher.stats.dead_lettered, dispatcher.stats.retried) == (0, 0, 0)
        assert consumer.closed
    finally:
        await close()


class Messages(OneMessage):
    """An in-memory consumer holding `count` messages, all at hand at once."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.left = list(range(count))

    async def receive(self) -> object:
        if not self.left:
            await asyncio.Event().wait()
        return self.left.pop(0)

    def receive_ready(self) -> object | None:  # type: ignore[override]
        return self.left.pop(0) if self.left else None


async def test_fenced_messages_wait_for_the_renewal_not_a_poll(redis_url, endpoint: Endpoint, topic):
    # A thousand subscriptions holding messages while Redis paused for 7 s: each message polling its
    # lease ten times a second starved the renewals, and the worker never recovered (0 deliveries,
    # a full core); one poll a subscription still took 30-77% of a core. The renewal wakes them now.
    count = 300
    sub = make_sub(topic, endpoint.url, max_ack_pending=count)
    lease = ScriptedLease()
    consumer = Messages(count)
    dispatcher, _, close = run_one(redis_url, sub, topic, lease, consumer, lambda m: f"{m}:1:-1:-1")
    try:
        dispatcher.start()
        await eventually(lambda: dispatcher.unsettled == count, what="every message taken")
        before = lease.checks
        await asyncio.sleep(1.0)  # a measuring window: how often the fenced messages look at the lease
        checks = lease.checks - before
        assert checks <= 2, f"{checks} lease checks in 1 s for {count} fenced messages"
        lease.renewed(time.monotonic())
        await eventually(lambda: len(consumer.acked) == count, what="all delivered once the lease is renewed")
        assert sorted(consumer.acked) == list(range(count)) and len(endpoint.requests) == count
    finally:
        await dispatcher.stop(grace=1)
        await close()


async def test_a_stop_wakes_fenced_messages_at_once(redis_url, endpoint: Endpoint, topic):
    # The lease was lost while messages waited for a renewal: the stop ends their wait (nothing
    # sent, nothing settled), it does not wait out the grace.
    count = 50
    sub = make_sub(topic, endpoint.url, max_ack_pending=count)
    consumer = Messages(count)
    dispatcher, _, close = run_one(redis_url, sub, topic, ScriptedLease(), consumer, lambda m: f"{m}:1:-1:-1")
    try:
        dispatcher.start()
        await eventually(lambda: dispatcher.unsettled == count, what="every message taken")
        started = time.monotonic()
        await dispatcher.stop(grace=4)
        assert time.monotonic() - started < 2.0, "fenced messages held the stop until its grace ran out"
        assert endpoint.requests == [] and consumer.acked == []
    finally:
        await close()
