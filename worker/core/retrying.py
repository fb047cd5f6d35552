"""The attempts of a message, or of a batch, until it settles: each one counted in Redis before its
request, answered, recorded, and then acked, tried again after the retry delay, or given up. An open
breaker holds the attempts back, uncounted, but for its probe."""

from __future__ import annotations

import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from worker.core.attempts import AttemptRecord
from worker.core.backoff import retry_delay
from worker.core.breaker import Breaker
from worker.core.context import ACKED, DEAD_LETTERED, DROPPED, RETRIED, Shared
from worker.core.delivery import Outcome
from worker.core.fencing import Fencing
from worker.core.history import attempt_entry
from worker.core.lanes import Item
from worker.core.messages import Envelope
from worker.core.sending import Sender
from worker.core.settlement import Record, Settlement
from worker.model.subscriptions import Subscription


@dataclass(frozen=True, slots=True)
class _Again:
    """A message to try again: after `retry_delay` seconds (a counted retry), or at once (None);
    `last_next`: its next attempt is its last."""

    retry_delay: float | None = None
    last_next: bool = False
    failed_at: float = 0.0  # when its attempt's failure was known (monotonic); 0.0: it made no request


AGAIN = _Again()


class Retrying:
    """Tries one subscription's messages and batches until each is settled."""

    def __init__(self, shared: Shared, fencing: Fencing, breaker: Breaker, sender: Sender,
                 settlement: Settlement) -> None:
        self._shared = shared
        self._fencing = fencing
        self._breaker = breaker
        self._sender = sender
        self._settlement = settlement
        self._attempts = shared.ctx.attempts
        self._worker_id = shared.ctx.worker_id

    # -- one message -------------------------------------------------------------------------

    async def message(self, message: Any, env: Envelope) -> Record:
        """Deliver until acked, dead-lettered or dropped; returns the settled record still to write."""
        if not self._settlement.sendable(env):
            return await self._settlement.unsent(message, env)
        shared = self._shared
        first_failed_at = 0.0
        while not shared.stopping.is_set():
            sub = shared.sub  # an edit applies from the next attempt on
            if not (self._fencing.may_deliver() or await self._fencing.wait()):
                return None
            # An open breaker holds every message back, uncounted, but for its probe (numbered like any
            # attempt, so numbers never repeat; never using up max_deliver).
            probe = await self._breaker.turn(env.publish_time_ms) if self._breaker.holds() else 0
            step = await self._try_once(message, env, sub, probe)
            if not isinstance(step, _Again):
                return step
            first_failed_at = first_failed_at or step.failed_at
            if step.retry_delay is not None:
                await self._hold_for_retry(step.retry_delay)
            if step.last_next:
                await self._await_breaker_decision(first_failed_at)
        return None

    async def _try_once(self, message: Any, env: Envelope, sub: Subscription, probe: int) -> Record | _Again:
        """One attempt (the breaker's `probe` of that id, or 0: not one): settled (the record still to
        write, or None) or to be tried again (after a retry delay, or at once)."""
        shared = self._shared
        settlement = self._settlement
        try:
            record = await self._attempts.begin(sub.key, env.message_id, probe != 0)
            limit = sub.attempt_limit
            if not settlement.needs_request(env, record, limit):
                return await settlement.without_request(message, env, sub, record)
            outcome = await self._sender.message(sub, env, record.number, probe != 0)
            answered_at = time.monotonic()
            if outcome is None:  # held back right before sending (the breaker opened, the lease lapsed)
                if not probe:
                    await self._attempts.unsent(sub.key, [env.message_id])  # uses up no attempt
                return AGAIN  # the breaker's turn, or `Fencing.wait`, waits
            if probe:
                self._breaker.probed(probe, outcome.acked)
            entry = attempt_entry(record.number, outcome, self._worker_id, env.ordering_key or "")
            if probe:
                entry["probe"] = True
            if outcome.acked:
                self._traced(outcome, ACKED)
                settled = await settlement.ack(message, env, sub, [entry], acked_first_time=record.number == 1)
                shared.stats.acked += 1
                shared.m.acked.inc()
                shared.log.debug("delivered", message_id=env.message_id, attempt=record.number,
                                 status=outcome.status, latency=round(outcome.latency, 4))
                return settled
            shared.failure_log.info("delivery failed", message_id=env.message_id, attempt=record.number,
                                    status=outcome.last_status, detail=outcome.detail,
                                    latency=round(outcome.latency, 4), probe=probe != 0)
            # Recorded before a dead-letter publish too: if that is cut short (a crash, a stop while the
            # topic refuses), the next owner's dead letter carries this attempt's status, not "unknown".
            await self._attempts.record(sub.key, env.message_id, [entry], settled=False,
                                        last_status=outcome.last_status)
            if probe and not outcome.permanent:
                self._traced(outcome, RETRIED)
                return AGAIN  # the breaker paces the next try; a probe uses up no attempt
            # A message no request can carry goes now, probe or not: else, the oldest, it would be
            # every probe, and the breaker would never close.
            if (limit is not None and record.spent >= limit) or outcome.permanent:
                self._traced(outcome, DEAD_LETTERED if sub.dead_letter_topic else DROPPED)
                return await settlement.give_up(message, env, sub, record.number, outcome.last_status, [],
                                                after=outcome.span)
            self._traced(outcome, RETRIED)
            return _Again(retry_delay(sub.retry, record.number, outcome.retry_after),
                          last_next=limit is not None and record.spent + 1 >= limit, failed_at=answered_at)
        finally:
            if probe:  # answered already, this does nothing; else no request was made
                self._breaker.probed(probe, None)

    # -- a batch (deliver.push.batch) --------------------------------------------------------

    async def batch(self, items: list[Item], records: list[Awaitable[None]], unsettled: dict[str, Item]) -> None:
        """Deliver a batch's messages until each is acked, dead-lettered or dropped (settled ones leave
        `unsettled`; the records still to write go to `records`). Those that fail are tried again
        together after the retry delay of the most tried among them."""
        pending: list[Item] = []
        for message, env in items:
            if self._settlement.sendable(env):
                pending.append((message, env))
            else:
                record = await self._settlement.unsent(message, env)
                del unsettled[env.message_id]
                if record is not None:
                    records.append(record)
        shared = self._shared
        first_failed_at = 0.0
        while pending and not shared.stopping.is_set():
            sub = shared.sub
            if not (self._fencing.may_deliver() or await self._fencing.wait()):
                return
            oldest = min(env.publish_time_ms for _, env in pending)
            probe = await self._breaker.turn(oldest) if self._breaker.holds() else 0
            pending, delay, last_next = await self._try_batch_once(pending, sub, probe, records, unsettled)
            if pending and delay is not None:
                first_failed_at = first_failed_at or time.monotonic()
                await self._hold_for_retry(delay, len(pending))
            if pending and last_next:
                await self._await_breaker_decision(first_failed_at)

    async def _try_batch_once(self, pending: list[Item], sub: Subscription, probe: int,
                              records: list[Awaitable[None]],
                              unsettled: dict[str, Item]) -> tuple[list[Item], float | None, bool]:
        """One request for the batch's `pending` messages (one attempt each): those still to try, the
        delay before they are (None: at once), and whether one of them is then at its last attempt."""
        shared = self._shared
        settlement = self._settlement
        try:
            begun = await self._attempts.begin_all(sub.key, [env.message_id for _, env in pending], probe != 0)
            limit = sub.attempt_limit
            sending: list[tuple[Any, Envelope, AttemptRecord]] = []
            for (message, env), record in zip(pending, begun, strict=True):
                if settlement.needs_request(env, record, limit):
                    sending.append((message, env, record))
                else:
                    settled = await settlement.without_request(message, env, sub, record)
                    del unsettled[env.message_id]
                    if settled is not None:
                        records.append(settled)
            if not sending:
                return [], None, False
            outcome = await self._sender.batch(sub, sending, probe != 0)
            if outcome is None:  # held back right before sending (the breaker opened, the lease lapsed)
                if not probe:
                    await self._attempts.unsent(sub.key, [env.message_id for _, env, _ in sending])
                return [(message, env) for message, env, _ in sending], None, False
            if probe:
                self._breaker.probed(probe, outcome.acked)
            entries = []
            for _, env, record in sending:
                entry = attempt_entry(record.number, outcome, self._worker_id, env.ordering_key or "")
                entry["batch"] = len(sending)
                if probe:
                    entry["probe"] = True
                entries.append(entry)
            if outcome.acked:
                self._traced(outcome, ACKED)
                acked: list[tuple[str, list[dict[str, Any]], bool]] = []
                for (message, env, record), entry in zip(sending, entries, strict=True):
                    del unsettled[env.message_id]
                    if await settlement.ack_only(message, env):
                        acked.append((env.message_id, [entry], record.number == 1))
                    else:  # the broker will redeliver it; the counter stays so the numbering continues
                        await self._attempts.record(sub.key, env.message_id, [entry], settled=False,
                                                    last_status=outcome.last_status)
                # Nothing waits on them (the broker has the acks): they ride with the next round trip.
                records.append(self._attempts.record_all(sub.key, acked, settled=True, lazy=True))
                shared.stats.acked += len(sending)
                shared.m.acked.inc(len(sending))
                return [], None, False
            shared.failure_log.info("batch delivery failed", messages=len(sending), status=outcome.last_status,
                                    detail=outcome.detail, latency=round(outcome.latency, 4), probe=probe != 0)
            await self._attempts.record_all(sub.key, [(env.message_id, [entry], False) for (_, env, _), entry
                                                      in zip(sending, entries, strict=True)],
                                            settled=False, last_status=outcome.last_status)
            if probe and not outcome.permanent:
                self._traced(outcome, RETRIED)
                return [(message, env) for message, env, _ in sending], None, False
            giving_up = [(limit is not None and record.spent >= limit) or outcome.permanent
                         for _, _, record in sending]
            given_up = DEAD_LETTERED if sub.dead_letter_topic else DROPPED
            self._traced(outcome, given_up if all(giving_up) else RETRIED)
            again: list[Item] = []
            for (message, env, record), gives_up in zip(sending, giving_up, strict=True):
                if gives_up:
                    settled = await settlement.give_up(message, env, sub, record.number, outcome.last_status, [],
                                                       after=outcome.span)
                    del unsettled[env.message_id]
                    if settled is not None:
                        records.append(settled)
                else:
                    again.append((message, env))
            most = max(record.number for _, _, record in sending)
            # The breaker decides before any of them spends its last attempt (`_await_breaker_decision`).
            last_next = limit is not None and any(
                record.spent + 1 >= limit for _, env, record in sending if env.message_id in unsettled)
            return again, retry_delay(sub.retry, most, outcome.retry_after), last_next
        finally:
            if probe:  # answered already, this does nothing; else no request was made
                self._breaker.probed(probe, None)

    def _traced(self, outcome: Outcome, decision: str) -> None:
        """Ends the attempt's span (a worker that traces) with what became of it."""
        tracer = self._shared.ctx.tracer
        if tracer is not None and outcome.span is not None:
            tracer.settled(outcome.span, decision)

    # -- between attempts --------------------------------------------------------------------

    async def _hold_for_retry(self, delay: float, messages: int = 1) -> None:
        """Wait `delay` before the next attempt of `messages` (counted retries), or until the stop."""
        shared = self._shared
        shared.stats.retried += messages
        shared.m.retries.inc(messages)
        shared.m.held_for_retry.inc(messages)
        try:
            await shared.pause(delay)
        finally:
            shared.m.held_for_retry.dec(messages)

    async def _await_breaker_decision(self, since: float) -> None:
        """Before a message's last attempt: while every attempt to the endpoint has failed since this
        message's first failed (`since`: the endpoint, not the message, is failing) and the breaker has
        not decided, wait for it. It opens: the message waits its turn uncounted, not dead-lettered.
        Something is acked meanwhile: the last attempt goes as usual. Without it, an endpoint that goes
        down had every message of its breaker's first minutes dead-lettered before the breaker opened."""
        stopping = self._shared.stopping
        while not stopping.is_set():
            wait = self._breaker.undecided(since)
            if wait <= 0:
                self._breaker.holds()  # its time may have come: it opens now, not at the next attempt
                return
            await self._breaker.decision(stopping, wait)
