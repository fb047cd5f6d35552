"""`push-worker dlq list|show|redrive SUBSCRIPTION`: dead letters of one subscription.

All three work on the fleet's cursor on the dead-letter topic (`push-worker-dlq`, see deadletter.py);
only messages whose `pubsub.subscription` and `pubsub.original_topic` name this subscription are
touched, so a dead-letter topic shared by several subscriptions is safe.

`list` and `show` take messages from the cursor and release them unacked: they look, nothing moves.

`redrive` runs the regular dispatcher over the cursor: each dead letter goes to this subscription's
endpoint only (the original topic is not republished, so no other subscription sees it again), with
a fresh attempt count, signed like any delivery, at `--rate` messages a second. Delivered: the dead
letter is acked. Exhausted again: it is republished to the dead-letter topic (confirmed) and then
acked. So a redrive that is interrupted resumes where it stopped, and loses nothing. Dead letters
that arrive after the redrive started are left for the next one (it always ends).

`list` and `redrive` take a window (`--since`, `--until`: when the message was dead-lettered) and
last statuses (`--status 5xx`, `--status timeout`); what is outside them stays where it is.
`redrive --dry-run` counts what it would take, and moves nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pulsar
import pulsar.asyncio as pulsar_async
from aiolimiter import AsyncLimiter

from worker.broker import consumer as pulsar_adapter
from worker.broker.backlog import BacklogReader
from worker.broker.broker_admin import AdminError, make_session
from worker.broker.deadletter import DLQ_CURSOR, subscribe_cursor
from worker.core import attempts, pulsar_messages
from worker.core.dispatcher import Dispatcher
from worker.core.messages import Envelope, base64_text, rfc3339
from worker.model.config import PulsarSettings
from worker.model.subscriptions import Subscription
from worker.ops.admin import Admin, Target
from worker.ops.delivering import check_credentials, operator_delivery
from worker.ops.render import Output, inert, table
from worker.runtime import logs
from worker.runtime.errors import NotFound

QUIET_SECONDS = 2.0  # no message for this long: the cursor holds nothing more for us
DRY_RUN_LIMIT = 10_000_000  # a dry run counts up to this many (`--max-messages` fewer)


def named(message: pulsar.Message, message_id: str) -> bool:
    """Whether `message_id` names this dead letter: its own id, or its original's."""
    original = message.properties().get("pubsub.original_message_id")
    return message_id in (pulsar_messages.message_id_of(message), original)


def is_for(sub: Subscription, message: pulsar.Message) -> bool:
    props: dict[str, str] = message.properties()
    return props.get("pubsub.subscription") == sub.name and props.get("pubsub.original_topic") == sub.topic


@dataclasses.dataclass(frozen=True)
class Selection:
    """Which dead letters a command takes: dead-lettered within [since, until] (ms since the epoch,
    None: open), and with one of `statuses` as their last status (`4xx` a class of them; empty: any)."""

    since_ms: int | None = None
    until_ms: int | None = None
    statuses: tuple[str, ...] = ()

    def takes(self, message: pulsar.Message) -> bool:
        at = message.publish_timestamp()  # the dead letter's: when its last attempt failed for good
        if (self.since_ms is not None and at < self.since_ms) or (self.until_ms is not None and at > self.until_ms):
            return False
        return not self.statuses or _status_matches(message.properties().get("pubsub.last_status", ""),
                                                    self.statuses)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.since_ms is not None:
            out["since"] = rfc3339(self.since_ms)
        if self.until_ms is not None:
            out["until"] = rfc3339(self.until_ms)
        if self.statuses:
            out["status"] = list(self.statuses)
        return out


def _status_matches(status: str, wanted: tuple[str, ...]) -> bool:
    return status in wanted or (len(status) == 3 and status.isdigit() and f"{status[0]}xx" in wanted)


def original_envelope(sub: Subscription, message: pulsar.Message) -> Envelope:
    """The message as it was first delivered: original id (endpoints dedupe on it), time and attributes."""
    props = dict(message.properties())
    try:
        published = int(props.get("pubsub.original_publish_time", ""))
    except ValueError:
        published = message.publish_timestamp()
    attributes = {k: v for k, v in props.items() if not k.startswith("pubsub.")}
    # Still the ciphertext its producer encrypted: never sent, dead-lettered again with its context.
    encryption = props.get(pulsar_messages.ENCRYPTION_PROPERTY)
    if encryption is not None:
        attributes[pulsar_messages.ENCRYPTION_PROPERTY] = encryption
    return Envelope(
        message_id=props.get("pubsub.original_message_id") or pulsar_messages.message_id_of(message),
        data=message.data() or b"",
        topic=sub.topic,
        publish_time_ms=published,
        attributes=attributes,
        ordering_key=message.partition_key() or None,
        defect=pulsar_messages.ENCRYPTED if encryption is not None else None,
    )


class DeadLetterSource:
    """The cursor, seen by a dispatcher: only this subscription's dead letters from before `started_ms`,
    rate-limited; once the cursor runs dry it sets `exhausted` and hands out nothing more."""

    def __init__(self, consumer: pulsar_async.Consumer, sub: Subscription, rate: float, limit: int | None,
                 fresh_count: Callable[[str], Awaitable[Any]], message_id: str | None = None,
                 selection: Selection = Selection()) -> None:
        self.consumer, self.sub, self.selection = consumer, sub, selection
        self.message_id = message_id  # only this dead letter (its own id or its original's); the others stay
        self.fresh_count = fresh_count
        self.rate = AsyncLimiter(1, 1.0 / rate)  # one at a time, evenly spaced: no burst
        self.limit = limit
        self.started_ms = int(time.time() * 1000)
        self.taken = 0
        self.exhausted = asyncio.Event()

    async def receive(self) -> pulsar.Message:
        while not self.exhausted.is_set():
            if self.limit is not None and self.taken >= self.limit:
                break
            try:
                message = await asyncio.wait_for(self.consumer.receive(), QUIET_SECONDS)
            except TimeoutError:
                break
            if (is_for(self.sub, message) and message.publish_timestamp() <= self.started_ms
                    and self.selection.takes(message) and self._wanted(message)):
                await self.rate.acquire()
                # The original's record is a settled marker now: a redrive counts attempts afresh.
                await self.fresh_count(original_envelope(self.sub, message).message_id)
                self.taken += 1
                return message
            # someone else's, newer than this redrive, or not selected: left unacked, back to the cursor on close
        self.exhausted.set()
        await asyncio.Event().wait()  # nothing more; the redrive stops the dispatcher
        raise AssertionError("unreachable")  # pragma: no cover

    def _wanted(self, message: pulsar.Message) -> bool:
        return self.message_id is None or named(message, self.message_id)

    def receive_ready(self) -> None:
        return None  # every message goes through the filter and the rate limit in receive()

    async def negative_acknowledge(self, message: Any) -> None:
        await self.consumer.negative_acknowledge(message)

    async def acknowledge(self, message: Any) -> None:
        await self.consumer.acknowledge(message)

    async def unsubscribe(self) -> None:
        raise NotImplementedError("a redrive never deletes the dead-letter cursor")

    async def close(self) -> None:
        await self.consumer.close()


@dataclasses.dataclass
class Peek:
    """What one read of the cursor found: how many selected dead letters (`count`), every message
    it was handed (`seen`, anyone's), and how many the broker holds on the cursor beyond those
    (`unreturned`; None: unknown)."""

    count: int = 0
    seen: int = 0
    unreturned: int | None = None


def _unreturned_line(unreturned: int | None) -> str:
    if not unreturned:
        return ""
    return (f"\nthe broker holds {unreturned} more message(s) on the dead-letter cursor that it did not return: "
            "held by another consumer of the cursor (a redrive running?), or over pulsar-lite's flow limit "
            "(about 20 MiB a request); they may be this subscription's")


class DeadLetters:
    """The `dlq` commands for one fleet; each returns its Output.

    `shared`: one Pulsar client for every read, kept until `close()` (the admin process: a read
    per request must not open a client, with its threads, each time). Reads of one dead-letter
    topic take turns either way: two consumers on the one cursor would each get part of it."""

    def __init__(self, target: Target, shared: bool = False) -> None:
        self.target = target
        self.pulsar_settings = PulsarSettings(service_url=target.pulsar("dlq"),
                                              auth_token=target.settings.pulsar.auth_token,
                                              tls_trust_certs_file=target.settings.pulsar.tls_trust_certs_file,
                                              operation_timeout_seconds=15)
        self.shared = shared
        self._client: pulsar_async.Client | None = None
        self._turns: dict[str, asyncio.Lock] = {}  # per dead-letter topic (as many as subscriptions at most)

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await asyncio.wait_for(client.close(), timeout=5.0)

    async def subscription(self, admin: Admin, name: str) -> Subscription:
        sub = await admin.definition(name)
        if not sub.dead_letter_topic:
            raise NotFound(f"{name}: no dead letters: the subscription has no dead_letter.topic")
        return sub

    def _shared_client(self) -> pulsar_async.Client | None:
        """The one client of a shared DeadLetters (made on first use); None for a command's own."""
        if self.shared and self._client is None:
            self._client = pulsar_adapter.make_client(self.pulsar_settings, self.pulsar_settings.service_url or "",
                                                      operator=True)
        return self._client

    @asynccontextmanager
    async def _client_for_read(self) -> AsyncIterator[pulsar_async.Client]:
        client = self._shared_client()
        if client is not None:
            yield client
            return
        async with pulsar_adapter.open_client(self.pulsar_settings) as client:
            yield client

    @asynccontextmanager
    async def _cursor(self, sub: Subscription, queue: int = 1000) -> AsyncIterator[pulsar_async.Consumer]:
        assert sub.dead_letter_topic is not None
        turn = self._turns.setdefault(sub.dead_letter_topic, asyncio.Lock())
        async with turn, self._client_for_read() as client:
            consumer = await subscribe_cursor(client, sub.dead_letter_topic, queue, "push-worker-dlq-cli")
            try:
                yield consumer
            finally:
                await asyncio.wait_for(consumer.close(), timeout=5.0)

    async def _scan(self, sub: Subscription, limit: int, selection: Selection,
                    visit: Callable[[pulsar.Message], bool]) -> Peek:
        """`visit` each of up to `limit` of this subscription's selected dead letters, oldest first,
        until it returns True; all released on return (nothing is kept but what `visit` keeps)."""
        peek = Peek()
        async with self._cursor(sub) as consumer:
            while peek.count < limit:
                try:
                    message = await asyncio.wait_for(consumer.receive(), QUIET_SECONDS)
                except TimeoutError:
                    peek.unreturned = await self._unreturned(sub, peek.seen)
                    break
                peek.seen += 1
                if is_for(sub, message) and selection.takes(message):
                    peek.count += 1
                    if visit(message):
                        break
        return peek

    async def _unreturned(self, sub: Subscription, seen: int) -> int | None:
        """Messages on the cursor the broker did not hand out while it was read (pulsar-lite holds back
        what exceeds its flow limit, another consumer of the cursor holds what it took), from the
        broker's backlog; None when no broker stats are reachable (pulsar.admin_url, metrics_url)."""
        pulsar_settings = self.target.settings.pulsar
        metrics_url = pulsar_settings.metrics_url or self.target.pulsar_metrics_url
        if not (pulsar_settings.admin_url or metrics_url):
            return None
        assert sub.dead_letter_topic is not None
        async with make_session(pulsar_settings.auth_token, pulsar_settings.tls_trust_certs_file) as session:
            try:
                found = await BacklogReader(session, pulsar_settings.admin_url, metrics_url).read_cursors(
                    [(sub.dead_letter_topic, DLQ_CURSOR)])
            except (aiohttp.ClientError, TimeoutError, AdminError, ValueError):
                return None
        backlog = found.get((sub.dead_letter_topic, DLQ_CURSOR))
        return None if backlog is None else max(0, int(backlog) - seen)

    @staticmethod
    def _summary(message: pulsar.Message) -> dict[str, Any]:
        props = message.properties()
        return {"dead_letter_id": pulsar_messages.message_id_of(message),
                "message_id": props.get("pubsub.original_message_id", ""),
                "dead_lettered_at": rfc3339(message.publish_timestamp()),
                "attempts": props.get("pubsub.delivery_attempts", ""),
                "last_status": props.get("pubsub.last_status", ""), "bytes": len(message.data() or b"")}

    async def list(self, admin: Admin, name: str, limit: int, selection: Selection = Selection()) -> Output:
        sub = await self.subscription(admin, name)
        rows: list[dict[str, Any]] = []

        def keep(message: pulsar.Message) -> bool:
            rows.append(self._summary(message))  # a summary: no payload is kept
            return False

        peek = await self._scan(sub, limit, selection, keep)
        data = {"subscription": sub.key, "dead_letter_topic": sub.dead_letter_topic, **selection.describe(),
                "messages": rows, "unreturned": peek.unreturned}
        hidden = _unreturned_line(peek.unreturned)
        if not rows:
            found = "no dead letters returned" if peek.unreturned else "no dead letters"
            return Output(data, f"{sub.key}: {found} in {sub.dead_letter_topic}{hidden}")
        more = f"\n(first {limit} shown; --limit for more)" if len(rows) >= limit else ""
        return Output(data, f"{sub.key}: {len(rows)} dead letter(s) in {sub.dead_letter_topic}\n"
                            + table(rows, list(rows[0])) + more + hidden)

    async def show(self, admin: Admin, name: str, message_id: str, limit: int) -> Output:
        """One dead letter (by its own id or its original id), with payload and attempt history."""
        sub = await self.subscription(admin, name)
        found: list[pulsar.Message] = []

        def wanted(message: pulsar.Message) -> bool:
            if named(message, message_id):
                found.append(message)
                return True
            return False

        peek = await self._scan(sub, limit, Selection(), wanted)
        if not found:
            raise NotFound(f"no dead letter {message_id} for {sub.key} among the first {limit} (--limit to look "
                           "further)" + _unreturned_line(peek.unreturned).replace("\n", "; "))
        message = found[0]
        summary = self._summary(message)
        data = message.data() or b""
        try:
            text, encoding = data.decode("utf-8"), "utf-8"
        except UnicodeDecodeError:
            text, encoding = base64_text(data), "base64"
        out = {**summary, "attributes": dict(message.properties()), "data": text, "data_encoding": encoding,
               "ordering_key": message.partition_key() or None}
        try:
            history: Output | None = await admin.show(summary["message_id"], sub.key)
        except NotFound:
            history = None
        lines = [f"{k}: {inert(json.dumps(v) if isinstance(v, dict) else str(v))}" for k, v in out.items()
                 if v is not None]
        return Output({**out, "history": history.data["history"] if history else []},
                      "\n".join(lines) + ("\n\nattempts:\n" + history.text if history else ""))

    async def dry_run(self, admin: Admin, name: str, limit: int | None, selection: Selection,
                      message_id: str | None = None) -> Output:
        """What a redrive with the same selection (and `message_id`: that one dead letter) would take;
        nothing moves. An id no dead letter has is NotFound, as the redrive says."""
        sub = await self.subscription(admin, name)
        if message_id is None:
            peek = await self._scan(sub, limit or DRY_RUN_LIMIT, selection, lambda _: False)
            count = peek.count
        else:
            found: list[bool] = []

            def wanted(message: pulsar.Message) -> bool:
                if named(message, message_id):
                    found.append(True)
                return bool(found)
            peek = await self._scan(sub, DRY_RUN_LIMIT, selection, wanted)
            if not found:
                raise NotFound(f"no dead letter {message_id} for {sub.key} (by its own id or its original id)"
                               + _unreturned_line(peek.unreturned).replace("\n", "; "))
            count = 1
        result = {"subscription": sub.key, "would_redrive": count, **selection.describe(),
                  "unreturned": peek.unreturned, **({"message_id": message_id} if message_id else {})}
        return Output(result, f"{sub.key}: a redrive would take {count} dead letter(s); nothing was moved"
                              + _unreturned_line(peek.unreturned))

    async def redrive(self, admin: Admin, name: str, rate: float, limit: int | None, concurrency: int,
                      progress: Callable[[str], None], message_id: str | None = None,
                      selection: Selection = Selection()) -> Output:
        sub = await self.subscription(admin, name)
        # A request that cannot be signed would fail every redriven message (and dead-letter it again).
        check_credentials(self.target.settings, sub, "dlq redrive")
        await admin.writable()
        # Redelivery ignores the original ordering (the messages failed out of order already).
        sub = dataclasses.replace(sub, type="shared", max_ack_pending=concurrency)
        settings = self.target.settings
        dispatcher: Dispatcher | None = None
        started = time.monotonic()
        async with operator_delivery(settings, self.pulsar_settings, admin.client, "dlq-redrive",
                                     self._shared_client()) as delivery:
            try:
                assert sub.dead_letter_topic is not None
                consumer = await subscribe_cursor(delivery.client, sub.dead_letter_topic, max(concurrency, 10),
                                                  "push-worker-dlq-redrive")
                source = DeadLetterSource(consumer, sub, rate, 1 if message_id else limit,
                                          lambda original: attempts.forget(admin.client, sub.key, original),
                                          message_id=message_id, selection=selection)
                dispatcher = Dispatcher(sub, source, lambda m: original_envelope(sub, m), delivery.ctx)
                dispatcher.start()
                report = 0.0
                while not (source.exhausted.is_set() and dispatcher.stats.settled == source.taken):
                    await asyncio.sleep(0.1)
                    if time.monotonic() - report >= 1.0:
                        report = time.monotonic()
                        progress(_progress(sub, dispatcher, source, time.monotonic() - started))
                if message_id is not None and source.taken == 0:
                    raise NotFound(f"no dead letter {message_id} for {sub.key} (by its own id or its original id)")
                result = {"subscription": sub.key, **selection.describe(), "redriven": dispatcher.stats.acked,
                          "dead_lettered_again": dispatcher.stats.dead_lettered, "taken": source.taken,
                          "seconds": round(time.monotonic() - started, 1)}
            finally:
                if dispatcher is not None:
                    await dispatcher.stop(grace=settings.shutdown_grace_seconds)
        return Output(result, f"{sub.key}: redrive done: {result['redriven']} delivered, "
                              f"{result['dead_lettered_again']} dead-lettered again, in {result['seconds']}s")


def _progress(sub: Subscription, d: Dispatcher, source: DeadLetterSource, seconds: float) -> str:
    done = d.stats.settled
    return (f"{sub.key}: {done} redriven ({d.stats.acked} delivered, {d.stats.dead_lettered} dead-lettered again), "
            f"{source.taken - done} in progress, {done / max(seconds, 1e-9):.1f}/s")


def stderr_progress(line: str) -> None:
    """One write per line (print() writes the newline separately), so a log line written to stderr
    by another thread never lands in the middle of it."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


async def run(target: Target, action: str, name: str, **options: Any) -> Output:
    logs.configure("auto", "warning")  # stdout carries the result (JSON with --json); logs go to stderr
    admin = Admin(target, f"dlq {action}")
    dlq = DeadLetters(target)
    selection = Selection(options.get("since"), options.get("until"), tuple(options.get("status") or ()))
    try:
        if action == "list":
            return await dlq.list(admin, name, options["limit"], selection)
        if action == "show":
            return await dlq.show(admin, name, options["message_id"], options["limit"])
        if options.get("dry_run"):
            return await dlq.dry_run(admin, name, options.get("max_messages"), selection, options.get("message_id"))
        return await dlq.redrive(admin, name, options["rate"], options.get("max_messages"),
                                 options["concurrency"], stderr_progress, options.get("message_id"), selection)
    finally:
        await admin.close()


