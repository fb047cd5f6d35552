"""Pure logic: message ids, header safety, backoff, Retry-After, ack statuses, address policy, the
byte budget."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import random
from typing import Any

import pulsar
import pytest
from structlog.testing import capture_logs

from devtools.dispatcher_bench import _Attempts, _Backlog, _Endpoint
from worker.broker.deadletter import DeadLetterPublisher
from worker.core import dispatcher as dispatcher_module
from worker.core.backoff import retry_delay
from worker.core.budgets import ByteBudget, prefetch_for, too_large
from worker.core.delivery import is_ack_status, parse_retry_after
from worker.core.dispatcher import DeliveryContext, Dispatcher, lane_of
from worker.core.messages import Envelope, build_request, format_message_id, header_safe, rfc3339
from worker.core.metrics import Metrics
from worker.core.pulsar_messages import to_envelope
from worker.endpoint.destinations import DestinationPolicy
from worker.model.subscriptions import RetryPolicy, Subscription

pytestmark = pytest.mark.broker_independent


def sub(**kw) -> Subscription:
    return Subscription(name="s", topic="persistent://p-a/main/t", url="http://e/", **kw)


def test_message_id_format():
    assert format_message_id(pulsar.MessageId(-1, 12, 7, -1)) == "12:7:-1:-1"


def test_rfc3339():
    assert rfc3339(0) == "1970-01-01T00:00:00.000Z"
    assert rfc3339(1_700_000_000_123) == "2023-11-14T22:13:20.123Z"


@pytest.mark.parametrize(("name", "value", "ok"), [
    ("color", "blue", True), ("x-trace", "a b\tc", True), ("bad name", "x", False), ("k", "a\r\nB: c", False),
    ("k", "caf\u00e9", False), ("", "x", False), ("k", "x" * 5000, False), ("k:", "x", False)])
def test_header_safety(name, value, ok):
    assert header_safe(name, value) is ok


def test_raw_caps_attribute_headers_and_counts_the_rest():
    env = Envelope("1:1:-1:-1", b"x", "t", 0, {f"a{i}": "v" for i in range(100)})
    req = build_request(sub(content="raw"), env, 1)
    assert sum(k.startswith("Pubsub-Attr-") for k in req.headers) == 64
    assert req.omitted_attributes == 36


@pytest.mark.parametrize(("status", "ack"), [(102, True), (200, True), (204, True), (299, True), (100, False),
                                             (101, False), (300, False), (404, False), (500, False)])
def test_ack_statuses(status, ack):
    assert is_ack_status(status) is ack


def test_retry_after_parsing():
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == pytest.approx(10.0)


def test_backoff_grows_within_bounds_and_honours_retry_after_up_to_max():
    policy = RetryPolicy(1.0, 60.0)
    rng = random.Random(1)
    ceilings = []
    for attempt in range(1, 10):
        samples = [retry_delay(policy, attempt, rng=rng) for _ in range(200)]
        assert all(1.0 <= s <= 60.0 for s in samples)
        ceilings.append(max(samples))
    assert ceilings[0] <= 1.0 + 1e-9 and ceilings[3] > 4.0 and ceilings[-1] > 40.0
    assert retry_delay(policy, 1, retry_after=30, rng=rng) >= 30
    assert retry_delay(policy, 1, retry_after=3600, rng=rng) == 60.0


@pytest.mark.parametrize(("address", "allow_private", "refused"), [
    ("93.184.216.34", False, False), ("127.0.0.1", False, True), ("10.1.2.3", False, True),
    ("192.168.0.1", False, True), ("169.254.1.1", False, True), ("::1", False, True), ("fe80::1", False, True),
    ("::ffff:127.0.0.1", False, True), ("127.0.0.1", True, False), ("10.1.2.3", True, False),
    ("169.254.169.254", True, True), ("0.0.0.0", True, True), ("224.0.0.1", True, True)])
def test_address_policy(address, allow_private, refused):
    assert (DestinationPolicy(allow_private).refusal(address) is not None) is refused


def test_allow_cidrs_open_only_their_networks_and_never_metadata():
    policy = DestinationPolicy(allow_cidrs=(ipaddress.ip_network("10.20.0.0/16"), ipaddress.ip_network("fd00::/8"),
                                            ipaddress.ip_network("169.254.0.0/16")))
    assert policy.refusal("10.20.3.4") is None and policy.refusal("fd00::5") is None
    assert "private" in (policy.refusal("10.21.0.1") or "") and "private" in (policy.refusal("127.0.0.1") or "")
    assert "metadata" in (policy.refusal("169.254.169.254") or "")


def test_lanes_per_type():
    keyed = Envelope("1:1:-1:-1", b"", "t", 0, ordering_key="k")
    plain = Envelope("1:2:-1:-1", b"", "t", 0)
    assert lane_of(sub(type="shared"), keyed) is None
    assert lane_of(sub(type="key-shared"), keyed) == "k"
    assert lane_of(sub(type="key-shared"), plain) is None
    assert lane_of(sub(type="exclusive"), plain) == lane_of(sub(type="failover"), keyed) is not None


class _UndecodableMessage:
    """Stands in for a pulsar.Message whose key and properties are not UTF-8 (the Python client raises
    UnicodeDecodeError on reading them); a pure unit test of to_envelope's handling."""

    def message_id(self) -> Any:
        class Mid:
            def ledger_id(self) -> int: return 5
            def entry_id(self) -> int: return 6
            def partition(self) -> int: return -1
            def batch_index(self) -> int: return -1
        return Mid()

    def _bad(self) -> Any:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    ordering_key = partition_key = properties = _bad

    def data(self) -> bytes: return b"\xff\xfe"
    def topic_name(self) -> str: return "persistent://p-a/main/t"
    def publish_timestamp(self) -> int: return 1
    def encryption_context(self) -> None: return None  # not encrypted


def test_an_undecodable_key_or_attributes_become_a_defect_not_an_exception():
    env = to_envelope(_UndecodableMessage())  # type: ignore[arg-type]
    assert env.message_id == "5:6:-1:-1" and env.data == b"\xff\xfe"
    assert env.defect == "ordering key is not UTF-8; attributes are not UTF-8"


def test_failing_dead_letter_publishes_are_counted_each_logged_at_most_every_30_s_and_cleared():
    import structlog
    from structlog.testing import capture_logs

    from worker.broker.deadletter import failing_publishes

    counted: list[int] = []
    with capture_logs() as logged:
        failing = failing_publishes(structlog.get_logger(), lambda: counted.append(1))
        for _ in range(5):  # a burst of failures, well within 30 s
            failing.failed(pulsar.ProducerBusy("busy"), dead_letter_topic="persistent://p/n/dlq")
        assert failing.reason.startswith("dead-letter publish failing for 0 s (the broker answered ProducerBusy")
        failing.succeeded(dead_letter_topic="persistent://p/n/dlq")
        failing.failed(TimeoutError(), dead_letter_topic="persistent://p/n/dlq")  # a new spell: said again at once
    assert len(counted) == 6
    assert [(e["event"], e.get("failures")) for e in logged] == [
        ("dead-letter publish failing; exhausted messages wait unacked", 1),
        ("dead-letter publish works again", 5),
        ("dead-letter publish failing; exhausted messages wait unacked", 1)]
    assert failing.reason.endswith("(TimeoutError)")


async def test_byte_budget_serves_in_turn_lets_an_oversized_message_go_alone_and_survives_cancellation():
    budget = ByteBudget(100)
    assert budget.try_take(60) and not budget.try_take(60)  # over the limit
    large = asyncio.ensure_future(budget.take(500))  # larger than the whole budget: waits until nothing is held
    small = asyncio.ensure_future(budget.take(10))
    await asyncio.sleep(0)
    assert not budget.try_take(10)  # would fit, but waiters come first
    budget.give_back(60)
    await asyncio.sleep(0)
    assert large.done() and not small.done() and budget.used == 500
    budget.give_back(500)
    await small
    assert budget.used == 10
    # A waiter cancelled while waiting leaves room for the next; one granted as it was cancelled gives back.
    blocked = asyncio.ensure_future(budget.take(95))
    behind = asyncio.ensure_future(budget.take(5))
    await asyncio.sleep(0)
    blocked.cancel()
    await asyncio.gather(blocked, return_exceptions=True)
    await behind
    assert budget.used == 15
    granted = asyncio.ensure_future(budget.take(90))
    await asyncio.sleep(0)
    budget.give_back(15)  # grants it...
    granted.cancel()  # ...as it is cancelled
    await asyncio.gather(granted, return_exceptions=True)
    assert budget.used == 0
    # Room made after a waiter's cancellation but before its task left the queue: skipped, not granted.
    assert budget.try_take(10)
    leaving = asyncio.ensure_future(budget.take(95))
    await asyncio.sleep(0)
    leaving.cancel()
    budget.give_back(10)
    await asyncio.gather(leaving, return_exceptions=True)
    assert budget.used == 0 and budget.try_take(100)


def test_prefetch_holds_at_most_its_bytes_of_the_largest_messages_from_the_first_message_on():
    budget, largest_allowed = 32 << 20, 5 << 20
    # Sizes unknown: as many of the broker's largest messages as fit, not the window.
    assert prefetch_for(max_ack_pending=64, largest=0, budget=budget, max_message_bytes=largest_allowed) == 6
    assert prefetch_for(max_ack_pending=5000, largest=0, budget=budget, max_message_bytes=1024) == 1000  # at most 1,000
    assert prefetch_for(max_ack_pending=4, largest=0, budget=budget, max_message_bytes=1024) == 4  # the window
    # Messages seen smaller than the broker's largest change nothing; larger ones (compressed,
    # chunked) make it smaller, never below one.
    assert prefetch_for(max_ack_pending=64, largest=1024, budget=budget, max_message_bytes=largest_allowed) == 6
    assert prefetch_for(max_ack_pending=64, largest=16 << 20, budget=budget, max_message_bytes=largest_allowed) == 2
    assert prefetch_for(max_ack_pending=64, largest=1 << 30, budget=budget, max_message_bytes=largest_allowed) == 1
    # A consumer of 16 subscribes again for messages over twice what fits (2 MiB of 16 MiB), not at 1.5 MiB.
    assert too_large(16, 16 << 20) == 2 << 20


class _DeafToCancel(_Backlog):
    """A consumer whose receive does not end when cancelled (a client call that does not return),
    until the test lets it go."""

    def __init__(self) -> None:
        super().__init__(0)
        self.receiving, self.let_go = asyncio.Event(), asyncio.Event()

    async def receive(self) -> int:
        self.receiving.set()
        while not self.let_go.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await self.let_go.wait()
        return 0


async def test_a_receive_that_does_not_end_on_cancel_does_not_hold_a_stop(monkeypatch):
    """Every step of a stop is bounded; the wait for the receive loop was not (a stop seen to hang
    until the worker was killed)."""
    monkeypatch.setattr(dispatcher_module, "CLOSE_TIMEOUT", 0.2)
    consumer = _DeafToCancel()
    dispatcher = Dispatcher(sub(), consumer, lambda n: Envelope(str(n), b"x", "t", 0),
                            DeliveryContext(_Endpoint(), _Attempts(), DeadLetterPublisher(None), Metrics()))
    dispatcher.start()
    await consumer.receiving.wait()
    with capture_logs() as logged:
        stopping = asyncio.ensure_future(dispatcher.stop(1.0))
        ended, _ = await asyncio.wait({stopping}, timeout=10)
        consumer.let_go.set()
        await stopping
    assert ended, "the stop waited for the receive loop"
    assert "receive loop did not end on cancel; stopping without it" in [e["event"] for e in logged]


def test_a_redis_older_than_6_2_is_too_old_for_the_delivery_log():
    from worker.state.redis_start import too_old

    assert too_old("6.0.16") and too_old("5.0.14")
    assert not too_old("6.2.14") and not too_old("7.2.4") and not too_old("unknown")
