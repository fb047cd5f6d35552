"""Settlement: how a message leaves the worker. Acked (delivered, filtered out, discarded, or settled
already), dead-lettered or dropped after its last attempt, or handed back to the broker; and the
record of it in Redis, in the order that keeps a lost ack from settling it twice."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import traceback
from collections.abc import Awaitable
from typing import Any

from worker.core.attempts import AttemptRecord
from worker.core.context import ConsumerLike, Shared
from worker.core.fencing import Fencing
from worker.core.history import REPLAY_DELIVERER, REPLAY_FAILED, event_entry
from worker.core.messages import Envelope, dead_letter_properties
from worker.model.subscriptions import Subscription

Record = Awaitable[None] | None  # the settled record still to write (None: written, or nothing to write)


class Settlement:
    """Settles one subscription's messages. Each call returns the record still to write."""

    def __init__(self, shared: Shared, consumer: ConsumerLike, fencing: Fencing) -> None:
        self._shared = shared
        self._consumer = consumer
        self._fencing = fencing
        self._attempts = shared.ctx.attempts
        self._worker_id = shared.ctx.worker_id
        count = shared.m.broker_errors.labels("dead_letter").inc
        self.dead_letter_failures = shared.ctx.dead_letters.failures(shared.log, count)

    def sendable(self, env: Envelope) -> bool:
        """Whether `env` is to be sent at all; else `unsent` settles it."""
        sub = self._shared.sub
        return env.defect is None and (sub.filter is None or sub.filter.matches(env.attributes))

    async def unsent(self, message: Any, env: Envelope) -> Record:
        """Settle a message no request is made for: dead-lettered with its defect, or filtered out."""
        if not (self._fencing.may_deliver() or await self._fencing.wait()):
            return None
        shared = self._shared
        sub = shared.sub
        if env.defect is not None:  # no request could carry it faithfully: dead-letter it with the reason
            if await self._attempts.settled(sub.key, env.message_id):  # a copy handed out again: done already
                await self.ack_only(message, env)
                shared.m.settled_redeliveries.inc()
                return None
            shared.failure_log.error("undeliverable message", message_id=env.message_id, defect=env.defect)
            return await self.give_up(message, env, sub, 0, env.defect_status,
                                      [event_entry("unreadable", self._worker_id, detail=env.defect)])
        # Not for this subscription (filters are immutable): acked without a request, recorded.
        shared.m.filtered.inc()
        shared.stats.filtered += 1
        # Kept like a first-time ack (redis.acked_history_ttl_seconds): a filter may skip most of a topic.
        return await self.ack(message, env, sub, [event_entry("filtered", self._worker_id)], acked_first_time=True)

    def needs_request(self, env: Envelope, record: AttemptRecord, limit: int | None) -> bool:
        """Whether the attempt just begun (`record`) is to be made; else `without_request`."""
        if record.corrupt:
            self._shared.log.warning("attempt record was unreadable; started over", message_id=env.message_id,
                                     attempt=record.number)
        return not (record.settled or record.discard or record.unrepresentable
                    or (limit is not None and record.spent > limit))

    async def without_request(self, message: Any, env: Envelope, sub: Subscription, record: AttemptRecord) -> Record:
        """A message settled already, discarded, or out of attempts before this one: no request."""
        shared = self._shared
        if record.settled:  # a copy redelivered because its ack was lost: settled already
            await self.ack_only(message, env)
            shared.m.settled_redeliveries.inc()
            return None
        if record.discard:  # `push-worker discard`: settled without delivery, and recorded
            shared.log.info("discarded by an operator", message_id=env.message_id)
            return await self.ack(message, env, sub, [event_entry("discarded", self._worker_id)], record_first=True)
        if record.unrepresentable:  # no attempt number can follow the stored count: settled, loudly
            shared.m.message_failures.inc()
            reason = f"worker_error: the stored attempt count cannot be represented ({record.last_status})"
            shared.failure_log.error("attempt count out of range; the message is settled",
                                     message_id=env.message_id, error=reason)
            return await self.give_up(message, dataclasses.replace(env, defect=reason), sub, 0, "worker_error",
                                      [event_entry("worker-error", self._worker_id, detail=reason)])
        # Exhausted in an earlier life (crash before the dead-letter was confirmed): no new request.
        return await self.give_up(message, env, sub, record.number - 1, record.last_status or "unknown", [])

    async def ack(self, message: Any, env: Envelope, sub: Subscription, history: list[dict[str, Any]],
                  acked_first_time: bool = False, record_first: bool = False) -> Record:
        """Ack to the broker and mark the message settled in Redis. Returns the record still to write,
        or None when it was written already or the ack failed.

        `record_first` (dead letters, discards) writes the settled marker before the ack: a copy
        redelivered because the ack was lost then finds it and is acked without being dead-lettered
        twice. Deliveries ack first, so their slot is free a Redis round trip sooner; a crash between
        the two leaves the counter, and a redelivered copy goes on with the next attempt number."""
        if record_first:
            await self._attempts.record(sub.key, env.message_id, history, settled=True)
            await self.ack_only(message, env)
            return None
        if not await self.ack_only(message, env):
            # The broker will redeliver; the counter stays so the numbering continues.
            await self._attempts.record(sub.key, env.message_id, history, settled=False,
                                        last_status=history[-1].get("status", "") if history else "")
            return None
        # Nothing waits on it (the slot is free, the broker has the ack): it rides with the next round trip.
        return self._attempts.record(sub.key, env.message_id, history, settled=True,
                                     acked_first_time=acked_first_time, lazy=True)

    async def ack_only(self, message: Any, env: Envelope) -> bool:
        try:
            await self._consumer.acknowledge(message)
        except Exception as e:
            self._shared.m.broker_errors.labels("ack").inc()
            self._shared.log.warning("ack failed", message_id=env.message_id, error=type(e).__name__)
            return False
        return True

    async def give_up(self, message: Any, env: Envelope, sub: Subscription, attempts: int, last_status: str,
                      history: list[dict[str, Any]], after: Any = None) -> Record:
        """Dead-letter the message (the broker confirms before the ack), or drop it without a topic.
        A worker that traces gives the publish a span of its own, a child of the attempt's that gave
        up (`after`), or of the message's context."""
        shared = self._shared
        about = {"message_id": env.message_id, "attempts": attempts, "last_status": last_status}
        if sub.dead_letter_topic:
            props = dead_letter_properties(env, sub.topic, sub.name, attempts, last_status)
            topic = sub.dead_letter_topic
            failed = functools.partial(self.dead_letter_failures.failed, dead_letter_topic=topic)
            tracer = shared.ctx.tracer
            span = tracer.dead_letter(sub, env, topic, attempts, last_status, after) if tracer is not None else None
            confirmed = await shared.ctx.dead_letters.publish(topic, env, props, stop=shared.stopping,
                                                              on_failure=failed)
            if tracer is not None:
                tracer.published(span, confirmed)
            if not confirmed:
                return None  # stopping: released unacked; spent attempts make the next owner dead-letter it
            self.dead_letter_failures.succeeded(dead_letter_topic=topic)
            shared.stats.dead_lettered += 1
            shared.m.dead_lettered.inc()
            shared.failure_log.warning("dead-lettered", dead_letter_topic=topic, **about)
            # attempt and status too: `push-worker history` shows the settled summary (this entry) in columns
            history = [*history, event_entry("dead-lettered", self._worker_id, topic=topic,
                                             attempt=attempts, status=last_status)]
        elif self._worker_id == REPLAY_DELIVERER:  # an operator's replay that failed: settled as it was
            shared.failure_log.warning("replay failed", **about)
            history = [*history, event_entry(REPLAY_FAILED, self._worker_id, attempt=attempts, status=last_status)]
        else:
            shared.stats.dropped += 1
            shared.m.dropped.inc()
            shared.failure_log.warning("dropped after last attempt", **about)
            history = [*history, event_entry("dropped", self._worker_id, attempt=attempts, status=last_status)]
        return await self.ack(message, env, sub, history, record_first=True)

    async def failed(self, message: Any, env: Envelope, error: Exception) -> Record:
        """Settle a message whose handling raised, without taking anything else down: it never counts
        toward the worker's health (the next owner would fail on it the same way, and the next).
        Dead-lettered with the reason where the subscription has a dead-letter topic; else handed
        back to the broker, which redelivers it after its delay (never dropped for a bug of ours)."""
        shared = self._shared
        shared.m.message_failures.inc()
        reason = f"worker_error: {type(error).__name__}: {error}"[:300]
        shared.failure_log.error("handling a message failed; it is settled alone", message_id=env.message_id,
                                 error=reason, traceback="".join(traceback.format_exception(error))[-2000:])
        sub = shared.sub
        try:
            if sub.dead_letter_topic and (self._fencing.may_deliver() or await self._fencing.wait()):
                failed_env = dataclasses.replace(env, defect=reason)
                return await self.give_up(message, failed_env, sub, 0, "worker_error",
                                          [event_entry("worker-error", self._worker_id, detail=reason)])
        except asyncio.CancelledError:
            raise
        except Exception as again:  # the message goes back to the broker below
            shared.failure_log.error("dead-lettering the failed message failed too", message_id=env.message_id,
                                     error=f"{type(again).__name__}: {again}"[:300])
        with contextlib.suppress(Exception):
            await self._consumer.negative_acknowledge(message)
        return None
