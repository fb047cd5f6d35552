"""A settled message read back from the broker by its id: its payload for the console, and a replay
(one more request to the endpoint, numbered after the message's last attempt).

The broker is the source: a message is read back while the topic's retention keeps it, which is
how long the platform promises to keep messages; the delivery log keeps no payloads (its memory is
per attempt, docs/sizing.md). Past the retention, reading answers NotFound and says so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pulsar
from pulsar import asyncio as pulsar_async

from worker.core import attempts, keys, pulsar_messages
from worker.core.dispatcher import Dispatcher
from worker.core.history import REPLAY_DELIVERER, REPLAY_FAILED
from worker.core.messages import parse_message_id
from worker.model.config import PulsarSettings, Settings
from worker.model.subscriptions import Subscription
from worker.ops.delivering import check_credentials, operator_delivery
from worker.runtime.errors import NotFound, PushWorkerError
from worker.state.redis_client import AsyncClient

READ_SECONDS = 10.0
PREVIEW_BYTES = 64 * 1024  # of a payload, shown in a page; the rest is downloaded
SETTLED_EVENTS = ("ack", "dead-lettered", "discarded", "dropped", REPLAY_FAILED)
# Release a replay's hold (KEYS[1]) if it is still this replay's (ARGV[1]).
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class StillDelivering(PushWorkerError):
    """The message is not settled, or a replay of it is under way: a replay would race that delivery."""


class DeadLetter(PushWorkerError):
    """The message is a dead letter: a redrive delivers it and settles its dead-letter copy; a replay
    would leave that copy for a later redrive to deliver again."""


def replayable(message_id: str, history: list[dict[str, Any]], pending: int | None) -> int:
    """The last attempt number of a message that may be replayed now; StillDelivering when it is not
    settled (never attempted, an attempt under way, retrying), DeadLetter when it is a dead letter."""
    number, settled = last_attempt(history)
    if pending is not None:
        raise StillDelivering(f"{message_id}: still being delivered ({pending} attempt(s) so far): replay it once "
                              "it is settled")
    if not history:
        raise StillDelivering(f"{message_id}: no settled delivery on record (never attempted yet, or its history "
                              "expired): a replay sends only a settled message")
    if not settled:
        raise StillDelivering(f"{message_id}: still being delivered (attempt {number} so far): replay it once it is "
                              "settled")
    if history[-1].get("event") == "dead-lettered":
        raise DeadLetter(f"{message_id}: a dead letter: redrive it (dlq redrive NAME --message-id ID, or Redrive in "
                         "the console), which also settles its dead-letter copy")
    return number


def message_id_of(text: str) -> pulsar.MessageId:
    """`ledger:entry:partition:batch`, the form the fleet shows, as the client's id."""
    parsed = parse_message_id(text)
    if parsed is None:
        raise NotFound(f"{text[:80]}: not a message id (they look like ledger:entry:partition:batch)")
    ledger, entry, partition, batch = parsed
    return pulsar.MessageId(partition, ledger, entry, batch)


class ReadTooSlow(PushWorkerError):
    """The broker holds the message but did not hand it over in time (a busy broker, large messages
    read at once): said as such (503), never as a message that does not exist."""


async def read(client: pulsar_async.Client, topic: str, message_id: str) -> pulsar.Message:
    """The message of `topic` with this id, from the broker; NotFound once retention took it."""
    wanted = message_id_of(message_id)
    partition = int(message_id.split(":")[2])
    source = f"{topic}-partition-{partition}" if partition >= 0 else topic
    reader = await client.create_reader(source, wanted, start_message_id_inclusive=True, receiver_queue_size=1)
    try:
        try:
            message = await asyncio.wait_for(reader.read_next(), READ_SECONDS)
        except TimeoutError:
            # Nothing at or after the id: gone (or never was). Something there: the broker was slow.
            if await asyncio.wait_for(reader.has_message_available(), READ_SECONDS):
                raise ReadTooSlow(f"{message_id}: the broker did not hand it back within {READ_SECONDS:g} s: "
                                  "try again") from None
            raise NotFound(f"{message_id}: not in {topic} any more (its retention passed) or never was") from None
    finally:
        await asyncio.wait_for(reader.close(), 5.0)
    if pulsar_messages.message_id_of(message) != message_id:
        raise NotFound(f"{message_id}: not in {topic} any more (its retention passed) or never was")
    return message


def payload_view(data: bytes) -> dict[str, Any]:
    """A payload as a page shows it: JSON pretty-printed, other text as it is, binary as hex; the
    first PREVIEW_BYTES (the download link has it all)."""
    shown = data[:PREVIEW_BYTES]
    view: dict[str, Any] = {"size": len(data), "truncated": len(data) > PREVIEW_BYTES}
    try:
        text = shown.decode("utf-8")
    except UnicodeDecodeError:
        if view["truncated"]:  # a multi-byte character cut at the preview's end is still text
            try:
                text = shown[:-3].decode("utf-8") + shown[-3:].decode("utf-8", "ignore")
            except UnicodeDecodeError:
                return {**view, "encoding": "hex", "text": shown.hex(" ", 1)}
        else:
            return {**view, "encoding": "hex", "text": shown.hex(" ", 1)}
    if not view["truncated"]:
        try:
            return {**view, "encoding": "json", "text": json.dumps(json.loads(text), indent=2, ensure_ascii=False)}
        except ValueError:
            pass
    return {**view, "encoding": "utf-8", "text": text}


def last_attempt(history: list[dict[str, Any]]) -> tuple[int, bool]:
    """The message's last attempt number, and whether its history ends settled."""
    numbers = [int(e["attempt"]) for e in history if isinstance(e.get("attempt"), int)]
    ends = history[-1] if history else {}
    settled = ends.get("result") == "ack" or ends.get("event") in SETTLED_EVENTS
    return (max(numbers) if numbers else 0), settled


class OneMessage:
    """A dispatcher's source holding one message read back from the broker (acks go nowhere: the
    message was settled on the subscription before)."""

    def __init__(self, message: pulsar.Message) -> None:
        self.message = message
        self.given = False
        self.settled = asyncio.Event()  # acked: delivered, or dropped after its one attempt

    async def receive(self) -> pulsar.Message:
        if not self.given:
            self.given = True
            return self.message
        await asyncio.Event().wait()  # nothing more; the replay stops the dispatcher
        raise AssertionError("unreachable")  # pragma: no cover

    def receive_ready(self) -> None:
        return None

    async def acknowledge(self, message: Any) -> None:
        self.settled.set()

    async def negative_acknowledge(self, message: Any) -> None:
        return None

    async def unsubscribe(self) -> None:
        raise NotImplementedError("a replay never deletes the subscription")

    async def close(self) -> None:
        return None


History = Callable[[], Awaitable[tuple[list[dict[str, Any]], int | None]]]


async def replay(settings: Settings, pulsar_settings: PulsarSettings, redis: AsyncClient, sub: Subscription,
                 message_id: str, history: History, client: pulsar_async.Client | None = None) -> dict[str, Any]:
    """One more request for a settled message, numbered after its last attempt (its record is set
    to that number first, so the dispatcher counts on from it); not retried, never dead-lettered.
    One replay of a message at a time (a hold in Redis, taken before its history is read), so attempt
    numbers only go up whatever runs at once. `history` reads the message's (entries, attempts
    pending); `client`: the caller's Pulsar client (the admin process shares one)."""
    check_credentials(settings, sub, "replay")
    hold, token = keys.replay_key(sub.key, message_id), uuid.uuid4().hex
    hold_ms = int((sub.ack_deadline_seconds + 2 * READ_SECONDS + settings.shutdown_grace_seconds) * 1000)
    if not await redis.set(hold, token, nx=True, px=hold_ms):
        raise StillDelivering(f"{message_id}: a replay of it is under way: one at a time")
    try:
        async with operator_delivery(settings, pulsar_settings, redis, REPLAY_DELIVERER, client) as delivery:
            message = await read(delivery.client, sub.topic, message_id)  # an id the topic does not hold: 404
            number = replayable(message_id, *await history())
            # One attempt and no dead letter: a replay that fails says so (REPLAY_FAILED), leaving it settled.
            once = dataclasses.replace(sub, max_deliver=number + 1, dead_letter_topic=None, type="shared")
            await attempts.forget(redis, sub.key, message_id)
            await attempts.set_count(redis, sub.key, message_id, number, delivery.layout)
            source = OneMessage(message)
            dispatcher = Dispatcher(once, source, pulsar_messages.to_envelope, delivery.ctx)
            dispatcher.start()
            try:
                await asyncio.wait_for(source.settled.wait(), sub.ack_deadline_seconds + READ_SECONDS)
            finally:
                await dispatcher.stop(grace=settings.shutdown_grace_seconds)
    finally:
        await redis.eval(RELEASE, 1, hold, token)
    delivered = dispatcher.stats.acked == 1
    return {"subscription": sub.key, "message_id": message_id, "attempt": number + 1,
            "result": "delivered" if delivered else "failed"}
