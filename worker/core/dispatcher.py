"""One dispatcher per owned subscription: consumer -> ordering -> delivery -> outcome -> settle.

Ordering is one mechanism for all four types: each message gets a *lane*. Messages of one lane are
handled one after another (the next is not sent before the previous is acked or dead-lettered);
lanes run in parallel. shared: every message its own lane. key-shared: a lane per key. exclusive
and failover: a single lane. `max_ack_pending` bounds messages taken from the broker and not yet
settled, including those waiting for a retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import ssl
import time
import traceback
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from worker import logs
from worker.aio import cancel_within, wait_any, wait_event
from worker.breaker import Breaker
from worker.client_tls import ClientCertificates
from worker.config import DEFAULT_MAX_HELD_BYTES
from worker.core.attempts import AttemptRecord
from worker.core.backoff import retry_delay
from worker.core.batches import Forming, Item
from worker.core.budgets import ByteBudget, SharedBudget
from worker.core.delivery import Outcome, Result
from worker.core.endpoint_health import ERROR_AFTER_SECONDS, EndpointHealth
from worker.core.flow import AdaptiveLimit, RateLimit, Window
from worker.core.history import attempt_entry, event_entry
from worker.core.messages import (
    Envelope,
    PushRequest,
    batch_id,
    build_batch_request,
    build_request,
    format_message_id,
    memory_per_payload_byte,
    rfc3339,
)
from worker.core.metrics import Metrics
from worker.core.recent import RecentDeliveries
from worker.core.signing import SecretStore, SecretUnavailable, auth_headers
from worker.deadletter import DeadLetterPublisher, dead_letter_properties, failing_publishes
from worker.oauth2 import OAuth2Tokens
from worker.oidc import Tokens
from worker.prefetch import MAX_PREFETCH, prefetch_bytes, too_large
from worker.subscriptions import BatchPolicy, State, Subscription
from worker.supervisor import Supervisor

# A renewal wakes fenced messages (`Fence.renewal`); the recheck only bounds the harm of a missed wake-up.
FENCE_RECHECK_SECONDS = 5.0

IDLE_RECHECK_SECONDS = 600.0  # a batch former with nothing to batch waits for a message, not a timer
_SINGLE_LANE = "\x00total-order"
INTAKE_PER_TURN = 32  # messages taken from the client in one turn of the loop
CLOSE_TIMEOUT = 5.0  # seconds a broker close may take before shutdown goes on without it


class ConsumerLike(Protocol):
    """What the dispatcher needs of a Pulsar consumer (`consumer.PulsarConsumer` fits)."""

    async def receive(self) -> Any: ...
    def receive_ready(self) -> Any | None: ...  # a message already at hand, or None: never waits
    async def acknowledge(self, message: Any) -> None: ...
    async def negative_acknowledge(self, message: Any) -> None: ...  # the broker redelivers it after a delay
    async def unsubscribe(self) -> None: ...
    async def close(self) -> None: ...


class Fence(Protocol):
    """What the dispatcher needs of its lease (`fleet.leases.Lease` fits): no attempt unless `valid()`."""

    renewal: asyncio.Event  # set when the lease is next renewed

    def valid(self) -> bool: ...


@dataclass
class Stats:
    """Per-dispatcher counters, for summaries (the demo, `subs list`)."""

    acked: int = 0
    retried: int = 0
    dead_lettered: int = 0
    dropped: int = 0
    filtered: int = 0
    recent: RecentDeliveries = field(default_factory=RecentDeliveries)  # the operator API's last minutes

    @property
    def settled(self) -> int:
        """Messages done with: delivered, dead-lettered, dropped or filtered."""
        return self.acked + self.dead_lettered + self.dropped + self.filtered


def lane_of(sub: Subscription, env: Envelope) -> str | None:
    """The ordering lane of a message, or None when it may go in parallel with everything."""
    if sub.type in ("exclusive", "failover"):
        return _SINGLE_LANE
    if sub.type == "key-shared" and env.ordering_key is not None:
        return env.ordering_key
    return None


class Endpoints(Protocol):
    """What a dispatcher sends through: `delivery.Deliverer` (a protocol, so that the compiled
    dispatcher also runs on the in-memory parts of `make bench --section dispatcher`)."""

    async def attempt(self, url: str, request: PushRequest, deadline: float, credentials: bool = False,
                      owner: str = "", tls: ssl.SSLContext | None = None) -> Outcome: ...


class AttemptLog(Protocol):
    """Where a dispatcher counts and records attempts: `attempts.AttemptStore`."""

    async def begin(self, subscription_key: str, message_id: str, probe: bool = False) -> AttemptRecord: ...

    async def begin_all(self, subscription_key: str, message_ids: list[str],
                        probe: bool = False) -> list[AttemptRecord]: ...

    def failing_reason(self, subscription_key: str) -> str: ...

    async def settled(self, subscription_key: str, message_id: str) -> bool: ...

    async def unsent(self, subscription_key: str, message_ids: list[str]) -> None: ...

    def record(self, subscription_key: str, message_id: str, entries: list[dict[str, Any]],
               settled: bool, last_status: str = "", acked_first_time: bool = False,
               lazy: bool = False) -> Awaitable[None]: ...

    def record_all(self, subscription_key: str, messages: list[tuple[str, list[dict[str, Any]], bool]],
                   settled: bool, last_status: str = "", lazy: bool = False) -> Awaitable[None]: ...


@dataclass
class DeliveryContext:
    """What every dispatcher of one worker shares."""

    deliverer: Endpoints
    attempts: AttemptLog
    dead_letters: DeadLetterPublisher
    metrics: Metrics
    secrets: SecretStore = field(default_factory=SecretStore)
    worker_id: str = ""
    supervisor: Supervisor = field(default_factory=Supervisor)
    tokens: Tokens | None = None  # OIDC tokens; made from `secrets` when not given
    max_held_bytes: int = DEFAULT_MAX_HELD_BYTES  # per subscription (`max_held_bytes_per_subscription`)
    memory: SharedBudget | None = None  # every subscription's held bytes together (`max_held_bytes`)
    certificates: ClientCertificates | None = None  # mutual TLS; made from `secrets` when not given
    oauth2: OAuth2Tokens | None = None  # OAuth 2.0 client credentials (fetched with the worker's client)

    def __post_init__(self) -> None:
        if self.tokens is None:
            self.tokens = Tokens(self.secrets)
        if self.certificates is None:
            self.certificates = ClientCertificates(self.secrets)


def _rate_of(sub: Subscription) -> tuple[float, float]:
    """The subscription's rate limit as (per second, burst); 0 per second: none."""
    limit = sub.rate_limit
    return (0.0, 1.0) if limit is None else (limit.messages_per_second, limit.burst)


def _raw_id(message: Any) -> str:
    try:
        mid = message.message_id()
        return format_message_id(mid)
    except Exception:
        return f"unreadable-{id(message)}"


def _raw_data(message: Any) -> bytes:
    try:
        return bytes(message.data() or b"")
    except Exception:
        return b""


@dataclass(frozen=True, slots=True)
class _Again:
    """A message to try again: after `retry_delay` seconds (a counted retry), or at once (None);
    `last_next`: its next attempt is its last."""

    retry_delay: float | None = None
    last_next: bool = False
    failed_at: float = 0.0  # when its attempt's failure was known (monotonic); 0.0: it made no request


AGAIN = _Again()
ONE_A_REQUEST = BatchPolicy(max_messages=1, max_wait_ms=0)  # what is still forming when batching is turned off


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
        self.sub = sub
        self.ctx = ctx
        self.lease = lease  # None: not fenced (a worker without a fleet)
        self.may_deliver: Callable[[], bool] = lease.valid if lease is not None else (lambda: True)
        self.health = EndpointHealth(error_after)
        self.breaker = Breaker(self.health, sub.breaker, self._breaker_changed)
        self._reported_state = State.ACTIVE
        self.consumer = consumer
        self.to_envelope = to_envelope
        self.deliverer = ctx.deliverer
        self.attempts = ctx.attempts
        self.dead_letters = ctx.dead_letters
        self.metrics = ctx.metrics
        self.m = ctx.metrics.for_subscription(sub.tenant, sub.name)
        self.stats = stats or Stats()  # a replaced dispatcher's counters go on in its replacement
        self.window = Window(sub.max_ack_pending)
        self.held = ByteBudget(ctx.max_held_bytes, ctx.memory)  # its own bound, and its share of the worker's
        # Memory a message costs per payload byte; fixed for this dispatcher, so what a message gives
        # back is what it took even if the subscription's format changes meanwhile.
        self._held_per_byte = memory_per_payload_byte(sub)
        # A message above this size tells `on_large_message` (once per size): the consumer's
        # prefetch holds too many bytes of such messages and is to be made smaller.
        self.on_large_message = on_large_message
        self.prefetch = prefetch
        shrinkable = on_large_message is not None and prefetch > 1
        self._too_large = too_large(prefetch, prefetch_bytes(ctx.max_held_bytes)) if shrinkable else 1 << 62
        self._reserved = 0  # 1 while the receive loop holds a slot for a message not yet received
        self.endpoint_limit = AdaptiveLimit(sub.concurrency)
        self.rate = RateLimit(*_rate_of(sub))
        self._lanes: dict[str, deque[tuple[Any, Envelope]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._active: dict[str, int] = {}  # message ids taken and not yet settled: their publish times
        self._stopping = asyncio.Event()
        self._receiver: asyncio.Task[None] | None = None
        self._fence_wait: asyncio.Task[None] | None = None  # the one wait fenced messages share
        self._forming = Forming()  # deliver.push.batch: messages admitted, not yet in a batch
        self._formed = asyncio.Event()  # set when `_forming` may have a batch to make
        self._former: asyncio.Task[None] | None = None  # makes the batches; started with the first one
        self._loop: asyncio.AbstractEventLoop | None = None
        self.log = logs.get(project=sub.tenant, subscription=sub.name)
        self.failure_log = logs.Throttled(self.log, self.m.log_lines_suppressed.inc)  # lines a message's fate writes
        self.dead_letter_failures = failing_publishes(self.log, self.m.broker_errors.labels("dead_letter").inc)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.m.owned.set(1)
        # Read when scraped, not written per message: exact, and free on the hot path.
        self.m.unsettled.set_function(lambda: self.unsettled)
        self.m.held_bytes.set_function(lambda: self.held.used)
        self.m.in_flight.set_function(lambda: self.endpoint_limit.in_use)
        self.m.endpoint_window.set_function(lambda: self.endpoint_limit.size)
        self._reported_state = self.state
        self.metrics.set_state(self.sub.tenant, self.sub.name, self.state)
        self._receiver = self.ctx.supervisor.spawn("receive", self._receive_loop)

    def update(self, sub: Subscription) -> None:
        """Apply an edit of mutable fields; a request under way keeps the values it started with."""
        self.sub = sub
        self.window.resize(sub.max_ack_pending)
        self.endpoint_limit.set_ceiling(sub.concurrency)
        self.rate.set(*_rate_of(sub))
        self.breaker.set_policy(sub.breaker)

    async def stop(self, grace: float, unsubscribe: bool = False) -> None:
        """Stop intake; let requests under way finish within `grace`; release the rest to the broker
        (or delete the broker subscription, with `unsubscribe`)."""
        self._stopping.set()
        # Closing the consumer below hands back what a receive loop that did not end still holds.
        if self._receiver is not None and await cancel_within([self._receiver], CLOSE_TIMEOUT):
            self.log.warning("receive loop did not end on cancel; stopping without it")
        if self._former is not None:
            await cancel_within([self._former], CLOSE_TIMEOUT)
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=grace)
            await cancel_within(pending, CLOSE_TIMEOUT)
        # Closing the consumer hands every unacked message back to the broker for redelivery.
        # Bounded: a close that the client never confirms must not hold up a shutdown.
        if unsubscribe:
            try:
                await asyncio.wait_for(self.consumer.unsubscribe(), timeout=CLOSE_TIMEOUT)
            except Exception as e:  # the consumer is still closed below; the broker keeps the subscription
                self.log.warning("broker subscription not deleted; it keeps its backlog until deleted",
                                 error=str(e) or type(e).__name__)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.consumer.close(), timeout=CLOSE_TIMEOUT)
        self.held.close()
        self.metrics.forget(self.sub.tenant, self.sub.name)

    @property
    def unsettled(self) -> int:
        """Messages taken and not yet settled: the window's used slots, less the one the receive loop
        holds while it waits for the next message (which does not exist yet)."""
        return self.window.used - self._reserved

    @property
    def oldest_unsettled_ms(self) -> int | None:
        """The publish time of the oldest message taken and not yet settled (None: none held)."""
        return min((at for at in self._active.values() if at > 0), default=None)

    @property
    def state(self) -> State:
        return State.SUSPENDED if self.breaker.is_open else self.health.state

    @property
    def state_reason(self) -> str:
        """Why the state is what it is (for `subs list`); empty when Active and nothing is failing."""
        reasons = (self._breaker_reason() or self.health.reason, self.attempts.failing_reason(self.sub.key),
                   self.dead_letter_failures.reason)
        return "; ".join(reason for reason in reasons if reason)

    def _breaker_reason(self) -> str:
        policy = self.breaker.policy
        if not self.breaker.is_open or policy is None:
            return ""
        return (f"breaker open since {rfc3339(int(self.breaker.opened_wall * 1000))}: every attempt failed for "
                f"{policy.open_after_seconds:g} s (last: {self.health.last_failure}); one probe every "
                f"{policy.probe_interval_seconds:g} s, nothing else sent or counted")

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

    def _breaker_changed(self) -> None:
        if self.breaker.is_open:
            self.log.warning("breaker open: the endpoint failed every attempt; probing", reason=self._breaker_reason())
        else:
            self.log.info("breaker closed: delivering again")
            self.endpoint_limit.restart()  # slow start: the endpoint just came back
        self._report_state()

    def _report_state(self) -> None:
        if self.state is not self._reported_state:
            self._reported_state = self.state
            self.metrics.set_state(self.sub.tenant, self.sub.name, self.state)

    async def _wait_until_may_deliver(self) -> bool:
        """True once this worker may deliver. While it may not (its lease could not be renewed in
        time: Redis slow or failing over), wait: a renewal lets the message go on, a lost lease stops
        the dispatcher (False). Waiting for the stop alone would strand the message when the renewal
        comes through after all. Every fenced message of the dispatcher shares one wait, woken by the
        renewal, not a poll: polls by many fenced subscriptions starve the lease renewals
        (docs/measurements/reliability.md#fenced-messages)."""
        while not self.may_deliver():
            if self._stopping.is_set():
                return False
            if self._fence_wait is None:
                assert self._loop is not None
                self._fence_wait = self._loop.create_task(self._await_renewal())
            await asyncio.shield(self._fence_wait)  # a waiter's cancellation must not end the others' wait
        return True

    async def _await_renewal(self) -> None:
        assert self.lease is not None  # only a lease fences
        try:
            while not self.may_deliver() and not self._stopping.is_set():
                await wait_any(self.lease.renewal, self._stopping, seconds=FENCE_RECHECK_SECONDS)
        finally:
            self._fence_wait = None

    # -- intake ------------------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        while not self._stopping.is_set():
            await self.window.acquire()
            self._reserved = 1
            try:
                message = await self.consumer.receive()
            except asyncio.CancelledError:
                self._reserved = 0
                self.window.release()
                raise
            except Exception as e:
                self._reserved = 0
                self.window.release()
                self.m.broker_errors.labels("receive").inc()
                self.log.warning("receive failed", error=type(e).__name__)
                await self._pause(1.0)
                continue
            self._reserved = 0
            env = self._read(message)
            if env.ack_handle is not None:  # let go of the client's copy now (an oversize payload)
                message, env.ack_handle = env.ack_handle, None
            if not self.held.try_take(self._held(env)):
                await self._take_bytes(env)
            self._admit(message, env)
            # What the client already holds is taken in the same turn: one wake-up per burst, not per
            # message; but at most INTAKE_PER_TURN before other subscriptions get the loop: a window
            # of 1,000 taken in one turn held everyone else's messages for its whole length (another
            # project's p99 183 ms during a burst; 114 ms with the yield: `make bench --section neighbours`).
            taken = 1
            while True:
                if taken % INTAKE_PER_TURN == 0:
                    await asyncio.sleep(0)
                if not self.window.try_acquire():
                    break
                taken += 1
                message = self.consumer.receive_ready()
                if message is None:
                    self.window.release()
                    break
                env = self._read(message)
                if env.ack_handle is not None:
                    message, env.ack_handle = env.ack_handle, None
                if not self.held.try_take(self._held(env)):
                    await self._take_bytes(env)
                self._admit(message, env)

    def _read(self, message: Any) -> Envelope:
        try:
            env = self.to_envelope(message)
        except Exception as e:  # a message we cannot even read is dead-lettered with the reason, never a crash
            env = Envelope(message_id=_raw_id(message), data=_raw_data(message), topic=self.sub.topic,
                           publish_time_ms=0, defect=f"unreadable message ({type(e).__name__})")
        if len(env.data) > self._too_large:
            self._too_large = len(env.data)
            assert self.on_large_message is not None
            self.on_large_message(len(env.data))
        return env

    def _held(self, env: Envelope) -> int:
        """The bytes of memory `env` counts for in the subscription's and the worker's budgets."""
        return int(len(env.data) * self._held_per_byte)

    async def _take_bytes(self, env: Envelope) -> None:
        """Wait until the subscription holds few enough bytes for this message. Stopped meanwhile,
        it was never admitted: its slot is freed and closing the consumer returns it."""
        try:
            await self.held.take(self._held(env))
        except asyncio.CancelledError:
            self.window.release()
            raise

    def _release(self, env: Envelope) -> None:
        """A message admitted is settled or handed back: its window slot and bytes are free."""
        self.window.release()
        self.held.give_back(self._held(env))

    def _admit(self, message: Any, env: Envelope) -> None:
        if env.message_id in self._active:
            # A redelivery (e.g. after a broker reconnect) of a message already in hand: the copy in
            # hand settles it; a second loop would send it twice at once.
            self._release(env)
            return
        self._active[env.message_id] = env.publish_time_ms
        lane = lane_of(self.sub, env)
        if self.sub.batch is not None or self._forming:  # still forming batches: a lane's order goes on there
            if lane is not None and lane in self._lanes:
                self._lanes[lane].append((message, env))  # behind its lane's message or batch under way
            else:
                self._forming.add((message, env), lane)
                self._form_soon()
        elif lane is None:
            self._spawn(self._settle_one(message, env))
        elif lane in self._lanes:  # behind the lane's message under way: it goes when that one settles
            self._lanes[lane].append((message, env))
        else:
            self._lanes[lane] = deque()
            self._spawn(self._settle_one(message, env, lane))

    def _spawn(self, work: Awaitable[None]) -> None:
        # With the loop given, not looked up: Python 3.11 makes a getpid() system call per lookup,
        # 5-8 of them a message on the hot path (strace).
        task: asyncio.Task[None] = asyncio.ensure_future(work, loop=self._loop)
        self._tasks.add(task)  # keep a reference: the loop holds tasks weakly
        task.add_done_callback(self._tasks.discard)

    def _next_in_lane(self, lane: str) -> tuple[Any, Envelope] | None:
        """The lane's message under way has settled: its next one, or None when the lane is done."""
        queue = self._lanes[lane]
        if queue and not self._stopping.is_set():
            return queue.popleft()
        self._end_lane(lane)
        return None

    def _end_lane(self, lane: str) -> None:
        for _, env in self._lanes.pop(lane):  # stopping: released to the broker with the consumer
            self._active.pop(env.message_id, None)
            self._release(env)

    # -- batches (deliver.push.batch) --------------------------------------------------------

    def _form_soon(self) -> None:
        if self._former is None:
            self._former = self.ctx.supervisor.spawn("batches", self._form_batches)
        self._formed.set()

    async def _form_batches(self) -> None:
        """Make a batch when enough is waiting (`max_messages`, `max_bytes`), or when the oldest message
        has waited `max_wait_ms`; each batch is settled in a task of its own."""
        try:
            while not self._stopping.is_set():
                if not self._forming:
                    self._formed.clear()
                    await wait_any(self._formed, self._stopping, seconds=IDLE_RECHECK_SECONDS)
                    continue
                policy = self.sub.batch or ONE_A_REQUEST
                if self._forming.count < policy.max_messages and self._forming.bytes < policy.max_bytes:
                    # Not full: it closes at max_wait_ms, and not before the rate limit lets its request
                    # go; till then it keeps filling (closed first, batches of one or two waited for
                    # tokens while the backlog grew).
                    late = max(self._forming.oldest() + policy.max_wait_ms / 1000 - time.monotonic(),
                               self.rate.wait_seconds())
                    if late > 0:
                        self._formed.clear()
                        await wait_any(self._formed, self._stopping, seconds=late)
                        continue
                items, lanes = self._forming.take(policy.max_messages, policy.max_bytes)
                for lane, behind in lanes.items():
                    self._lanes[lane] = behind
                self._spawn(self._settle_batch(items, list(lanes)))
        finally:
            for _, env in self._forming.drain():  # stopping: released to the broker with the consumer
                self._active.pop(env.message_id, None)
                self._release(env)

    async def _settle_batch(self, items: list[Item], lanes: list[str]) -> None:
        """Settle a batch's messages; then what waits behind its lanes may be batched."""
        records: list[Awaitable[None]] = []
        unsettled = {env.message_id: (message, env) for message, env in items}
        try:
            await self._deliver_batch(items, records, unsettled)
        except asyncio.CancelledError:
            for lane in lanes:
                self._end_lane(lane)
            lanes = []
            raise
        except Exception as e:  # a failure of this batch's own (a bug): each message settles alone
            for message, env in list(unsettled.values()):
                record = await self._message_failed(message, env, e)
                if record is not None:
                    records.append(record)
        finally:
            for _, env in items:
                self._active.pop(env.message_id, None)
                self._release(env)
            for lane in lanes:
                if self._lanes[lane] and not self._stopping.is_set():
                    self._forming.lane_ready(lane, self._lanes.pop(lane))
                    self._form_soon()
                else:
                    self._end_lane(lane)
        if records:
            await asyncio.gather(*records)

    async def _deliver_batch(self, items: list[Item], records: list[Awaitable[None]],
                             unsettled: dict[str, Item]) -> None:
        """Deliver a batch's messages until each is acked, dead-lettered or dropped (settled ones leave
        `unsettled`; the records still to write go to `records`). Those that fail are tried again
        together after the retry delay of the most tried among them."""
        pending: list[Item] = []
        for message, env in items:
            if self._sendable(env):
                pending.append((message, env))
            else:
                record = await self._settle_unsent(message, env)
                del unsettled[env.message_id]
                if record is not None:
                    records.append(record)
        first_failed_at = 0.0
        while pending and not self._stopping.is_set():
            sub = self.sub
            if not (self.may_deliver() or await self._wait_until_may_deliver()):
                return
            oldest = min(env.publish_time_ms for _, env in pending)
            probe = await self.breaker.turn(oldest) if self.breaker.holds() else 0
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
        try:
            begun = await self.attempts.begin_all(sub.key, [env.message_id for _, env in pending], probe != 0)
            limit = sub.attempt_limit
            sending: list[tuple[Any, Envelope, AttemptRecord]] = []
            for (message, env), record in zip(pending, begun, strict=True):
                if self._needs_request(env, record, limit):
                    sending.append((message, env, record))
                else:
                    settled = await self._settle_without_request(message, env, sub, record)
                    del unsettled[env.message_id]
                    if settled is not None:
                        records.append(settled)
            if not sending:
                return [], None, False
            outcome = await self._attempt_batch(sub, sending, probe != 0)
            if outcome is None:  # held back right before sending (the breaker opened, the lease lapsed)
                if not probe:
                    await self.attempts.unsent(sub.key, [env.message_id for _, env, _ in sending])
                return [(message, env) for message, env, _ in sending], None, False
            if probe:
                self.breaker.probed(probe, outcome.acked)
            entries = []
            for _, _, record in sending:
                entry = attempt_entry(record.number, outcome, self.ctx.worker_id)
                entry["batch"] = len(sending)
                if probe:
                    entry["probe"] = True
                entries.append(entry)
            if outcome.acked:
                acked: list[tuple[str, list[dict[str, Any]], bool]] = []
                for (message, env, record), entry in zip(sending, entries, strict=True):
                    del unsettled[env.message_id]
                    if await self._ack_only(message, env):
                        acked.append((env.message_id, [entry], record.number == 1))
                    else:  # the broker will redeliver it; the counter stays so the numbering continues
                        await self.attempts.record(sub.key, env.message_id, [entry], settled=False,
                                                   last_status=outcome.last_status)
                # Nothing waits on them (the broker has the acks): they ride with the next round trip.
                records.append(self.attempts.record_all(sub.key, acked, settled=True, lazy=True))
                self.stats.acked += len(sending)
                self.m.acked.inc(len(sending))
                return [], None, False
            self.failure_log.info("batch delivery failed", messages=len(sending), status=outcome.last_status,
                                  detail=outcome.detail, latency=round(outcome.latency, 4), probe=probe != 0)
            await self.attempts.record_all(sub.key, [(env.message_id, [entry], False) for (_, env, _), entry
                                                     in zip(sending, entries, strict=True)],
                                           settled=False, last_status=outcome.last_status)
            if probe and not outcome.permanent:
                return [(message, env) for message, env, _ in sending], None, False
            again: list[Item] = []
            for message, env, record in sending:
                if (limit is not None and record.spent >= limit) or outcome.permanent:
                    settled = await self._give_up(message, env, sub, record.number, outcome.last_status, [])
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
                self.breaker.probed(probe, None)

    async def _attempt_batch(self, sub: Subscription, sending: list[tuple[Any, Envelope, AttemptRecord]],
                             probe: bool = False) -> Outcome | None:
        """One request carrying `sending` (one message and no batch in effect: the single-message form)."""
        if sub.batch is None and len(sending) == 1:
            _, env, record = sending[0]
            return await self._attempt(sub, env, record.number, probe)
        request = build_batch_request(sub, [(env, record.number) for _, env, record in sending])
        webhook_id = batch_id([env.message_id for _, env, _ in sending])
        return await self._request(sub, request, webhook_id, len(sending), probe)

    # -- one message -------------------------------------------------------------------------

    async def _settle_one(self, message: Any, env: Envelope, lane: str | None = None) -> None:
        """Settle the message; in a lane, then the messages queued behind it, one after another, in
        this same task. A task per lane and one per settled record cost key-shared, whose lanes are
        mostly one message long, about 4 us a message more than shared (`make bench --section
        dispatcher`): a lane with nothing waiting ends with its record written in its own task."""
        while True:
            record: Awaitable[None] | None = None
            try:
                record = await self._deliver_until_settled(message, env)
            except asyncio.CancelledError:
                if lane is not None:
                    self._end_lane(lane)
                raise
            except Exception as e:  # a failure of this message's own (a bug, an overflow): it settles it
                record = await self._message_failed(message, env, e)
            finally:
                self._active.pop(env.message_id, None)
                self._release(env)
            # Settled once the broker has the ack: the slot is free; the Redis record follows (in the
            # background when the lane's next message is waiting, so that it goes at once).
            following = self._next_in_lane(lane) if lane is not None else None
            if following is None:
                if record is not None:
                    await record
                return
            if record is not None:
                self._spawn(record)
            message, env = following

    def _sendable(self, env: Envelope) -> bool:
        """Whether `env` is to be sent at all; else `_settle_unsent` settles it."""
        return env.defect is None and (self.sub.filter is None or self.sub.filter.matches(env.attributes))

    async def _settle_unsent(self, message: Any, env: Envelope) -> Awaitable[None] | None:
        """Settle a message no request is made for: dead-lettered with its defect, or filtered out."""
        if not (self.may_deliver() or await self._wait_until_may_deliver()):
            return None
        if env.defect is not None:  # no request could carry it faithfully: dead-letter it with the reason
            if await self.attempts.settled(self.sub.key, env.message_id):  # a copy handed out again: done already
                await self._ack_only(message, env)
                self.m.settled_redeliveries.inc()
                return None
            self.failure_log.error("undeliverable message", message_id=env.message_id, defect=env.defect)
            return await self._give_up(message, env, self.sub, 0, env.defect_status,
                                       [event_entry("unreadable", self.ctx.worker_id, detail=env.defect)])
        # Not for this subscription (filters are immutable): acked without a request, recorded.
        self.m.filtered.inc()
        self.stats.filtered += 1
        # Kept like a first-time ack (redis.acked_history_ttl_seconds): a filter may skip most of a topic.
        return await self._ack(message, env, self.sub, [event_entry("filtered", self.ctx.worker_id)],
                               acked_first_time=True)

    async def _hold_for_retry(self, delay: float, messages: int = 1) -> None:
        """Wait `delay` before the next attempt of `messages` (counted retries), or until the stop."""
        self.stats.retried += messages
        self.m.retries.inc(messages)
        self.m.held_for_retry.inc(messages)
        try:
            await self._pause(delay)
        finally:
            self.m.held_for_retry.dec(messages)

    async def _deliver_until_settled(self, message: Any, env: Envelope) -> Awaitable[None] | None:
        """Deliver until acked, dead-lettered or dropped; returns the settled record still to write."""
        if not self._sendable(env):
            return await self._settle_unsent(message, env)
        first_failed_at = 0.0
        while not self._stopping.is_set():
            sub = self.sub  # an edit applies from the next attempt on
            if not (self.may_deliver() or await self._wait_until_may_deliver()):
                return None
            # An open breaker holds every message back, uncounted, but for its probe (numbered like any
            # attempt, so numbers never repeat; never using up max_deliver).
            probe = await self.breaker.turn(env.publish_time_ms) if self.breaker.holds() else 0
            step = await self._try_once(message, env, sub, probe)
            if not isinstance(step, _Again):
                return step
            first_failed_at = first_failed_at or step.failed_at
            if step.retry_delay is not None:
                await self._hold_for_retry(step.retry_delay)
            if step.last_next:
                await self._await_breaker_decision(first_failed_at)
        return None

    async def _await_breaker_decision(self, since: float) -> None:
        """Before a message's last attempt: while every attempt to the endpoint has failed since this
        message's first failed (`since`: the endpoint, not the message, is failing) and the breaker has
        not decided,
        wait for it. It opens: the message waits its turn uncounted, not dead-lettered. Something is
        acked meanwhile: the last attempt goes as usual. Without it, an endpoint that goes down had
        every message of its breaker's first minutes dead-lettered before the breaker opened."""
        while not self._stopping.is_set():
            wait = self.breaker.undecided(since)
            if wait <= 0:
                self.breaker.holds()  # its time may have come: it opens now, not at the next attempt
                return
            await self.breaker.decision(self._stopping, wait)

    async def _try_once(self, message: Any, env: Envelope, sub: Subscription,
                        probe: int) -> Awaitable[None] | _Again | None:
        """One attempt (the breaker's `probe` of that id, or 0: not one): settled (the record still to
        write, or None) or to be tried again (after a retry delay, or at once)."""
        try:
            record = await self.attempts.begin(sub.key, env.message_id, probe != 0)
            limit = sub.attempt_limit
            if not self._needs_request(env, record, limit):
                return await self._settle_without_request(message, env, sub, record)
            outcome = await self._attempt(sub, env, record.number, probe != 0)
            answered_at = time.monotonic()
            if outcome is None:  # held back right before sending (the breaker opened, the lease lapsed)
                if not probe:
                    await self.attempts.unsent(sub.key, [env.message_id])  # uses up no attempt
                return AGAIN  # the breaker's turn, or `_wait_until_may_deliver`, waits
            if probe:
                self.breaker.probed(probe, outcome.acked)
            entry = attempt_entry(record.number, outcome, self.ctx.worker_id)
            if probe:
                entry["probe"] = True
            if outcome.acked:
                settled = await self._ack(message, env, sub, [entry], acked_first_time=record.number == 1)
                self.stats.acked += 1
                self.m.acked.inc()
                self.log.debug("delivered", message_id=env.message_id, attempt=record.number,
                               status=outcome.status, latency=round(outcome.latency, 4))
                return settled
            self.failure_log.info("delivery failed", message_id=env.message_id, attempt=record.number,
                                  status=outcome.last_status, detail=outcome.detail, latency=round(outcome.latency, 4),
                                  probe=probe != 0)
            # Recorded before a dead-letter publish too: if that is cut short (a crash, a stop while the
            # topic refuses), the next owner's dead letter carries this attempt's status, not "unknown".
            await self.attempts.record(sub.key, env.message_id, [entry], settled=False, last_status=outcome.last_status)
            if probe and not outcome.permanent:
                return AGAIN  # the breaker paces the next try; a probe uses up no attempt
            # A message no request can carry goes now, probe or not: else, the oldest, it would be
            # every probe, and the breaker would never close.
            if (limit is not None and record.spent >= limit) or outcome.permanent:
                return await self._give_up(message, env, sub, record.number, outcome.last_status, [])
            return _Again(retry_delay(sub.retry, record.number, outcome.retry_after),
                          last_next=limit is not None and record.spent + 1 >= limit, failed_at=answered_at)
        finally:
            if probe:  # answered already, this does nothing; else no request was made
                self.breaker.probed(probe, None)

    def _needs_request(self, env: Envelope, record: AttemptRecord, limit: int | None) -> bool:
        """Whether the attempt just begun (`record`) is to be made; else `_settle_without_request`."""
        if record.corrupt:
            self.log.warning("attempt record was unreadable; started over", message_id=env.message_id,
                             attempt=record.number)
        return not (record.settled or record.discard or record.unrepresentable
                    or (limit is not None and record.spent > limit))

    async def _settle_without_request(self, message: Any, env: Envelope, sub: Subscription,
                                      record: AttemptRecord) -> Awaitable[None] | None:
        """A message settled already, discarded, or out of attempts before this one: no request."""
        if record.settled:  # a copy redelivered because its ack was lost: settled already
            await self._ack_only(message, env)
            self.m.settled_redeliveries.inc()
            return None
        if record.discard:  # `push-worker discard`: settled without delivery, and recorded
            self.log.info("discarded by an operator", message_id=env.message_id)
            return await self._ack(message, env, sub, [event_entry("discarded", self.ctx.worker_id)],
                                   record_first=True)
        if record.unrepresentable:  # no attempt number can follow the stored count: settled, loudly
            self.m.message_failures.inc()
            reason = f"worker_error: the stored attempt count cannot be represented ({record.last_status})"
            self.failure_log.error("attempt count out of range; the message is settled", message_id=env.message_id,
                                   error=reason)
            return await self._give_up(message, dataclasses.replace(env, defect=reason), sub, 0, "worker_error",
                                       [event_entry("worker-error", self.ctx.worker_id, detail=reason)])
        # Exhausted in an earlier life (crash before the dead-letter was confirmed): no new request.
        return await self._give_up(message, env, sub, record.number - 1, record.last_status or "unknown", [])

    async def _attempt(self, sub: Subscription, env: Envelope, attempt: int, probe: bool = False) -> Outcome | None:
        """One request, or None when it was held back while it waited for its turn (`_request`)."""
        return await self._request(sub, build_request(sub, env, attempt), env.message_id, probe=probe)

    async def _request(self, sub: Subscription, request: PushRequest, webhook_id: str,
                       messages: int = 1, probe: bool = False) -> Outcome | None:
        """Send `request` (carrying `messages`; `webhook_id`: its id when signed) once the rate limit
        and the endpoint's window allow; None when it may not go any more: the lease was lost, or the
        breaker opened meanwhile and this is no probe (requests queued for the rate limit went out
        after it had opened)."""
        if request.omitted_attributes:
            self.m.attributes_omitted.inc(request.omitted_attributes)
        # The rate limit before a concurrency slot: a request waiting for its turn holds no slot.
        waited = await self.rate.take()
        if waited:
            self.m.rate_limited_seconds.inc(waited)
        ticket = await self.endpoint_limit.acquire()
        # Checked again right before the request: Redis may have been slow, the breaker may have opened.
        if not self.may_deliver() or (self.breaker.is_open and not probe):
            self.endpoint_limit.release(None, ticket)
            return None
        try:
            outcome = await self._send(sub, webhook_id, request)
        except BaseException:
            self.endpoint_limit.release(None, ticket)
            raise
        self.endpoint_limit.release(outcome, ticket)
        self.health.record(outcome.acked, outcome.last_status)
        if outcome.acked:
            self.breaker.acked()
        self.stats.recent.record(outcome, messages)
        self._report_state()  # Error comes with time, so compare with what was reported
        self.m.delivery(outcome.label).inc(messages)
        self.m.delivery_seconds.observe(outcome.latency)
        return outcome

    async def _send(self, sub: Subscription, webhook_id: str, request: PushRequest) -> Outcome:
        outcome = await self._send_once(sub, webhook_id, request)
        if outcome.status == 401 and sub.oauth2 is not None and self.ctx.oauth2 is not None:
            # The token was refused (revoked, or expired early): once more with a new one, at once.
            self.ctx.oauth2.refused(sub.oauth2)
            outcome = await self._send_once(sub, webhook_id, request)
        return outcome

    async def _send_once(self, sub: Subscription, webhook_id: str, request: PushRequest) -> Outcome:
        tls = None
        try:  # signed at send time, so webhook-timestamp is the moment of this attempt
            extra = auth_headers(self.ctx.secrets, sub.signing_secrets, sub.bearer_token, webhook_id, request.body)
            if sub.oidc is not None:
                assert self.ctx.tokens is not None
                extra["Authorization"] = "Bearer " + self.ctx.tokens.token(sub.oidc, sub.tenant, sub.name, sub.url)
            if sub.oauth2 is not None:
                if self.ctx.oauth2 is None:
                    raise SecretUnavailable("deliver.push.oauth2: this worker fetches no OAuth 2.0 tokens")
                extra["Authorization"] = "Bearer " + await self.ctx.oauth2.token(sub.oauth2, sub.tenant)
            if sub.tls is not None:
                assert self.ctx.certificates is not None
                tls = self.ctx.certificates.context(sub.tls.client_certificate, sub.tls.client_key)
        except SecretUnavailable as e:
            return Outcome(Result.NOT_SENT, detail=str(e))
        if extra:
            request = PushRequest({**request.headers, **extra}, request.body, request.omitted_attributes)
        return await self.deliverer.attempt(sub.url, request, float(sub.ack_deadline_seconds), bool(extra),
                                            sub.tenant, tls)

    async def _ack(self, message: Any, env: Envelope, sub: Subscription, history: list[dict[str, Any]],
                   acked_first_time: bool = False, record_first: bool = False) -> Awaitable[None] | None:
        """Ack to the broker and mark the message settled in Redis. Returns the record still to write,
        or None when it was written already or the ack failed.

        `record_first` (dead letters, discards) writes the settled marker before the ack: a copy
        redelivered because the ack was lost then finds it and is acked without being dead-lettered
        twice. Deliveries ack first, so their slot is free a Redis round trip sooner; a crash between
        the two leaves the counter, and a redelivered copy goes on with the next attempt number."""
        if record_first:
            await self.attempts.record(sub.key, env.message_id, history, settled=True)
            await self._ack_only(message, env)
            return None
        if not await self._ack_only(message, env):
            # The broker will redeliver; the counter stays so the numbering continues.
            await self.attempts.record(sub.key, env.message_id, history, settled=False,
                                       last_status=history[-1].get("status", "") if history else "")
            return None
        # Nothing waits on it (the slot is free, the broker has the ack): it rides with the next round trip.
        return self.attempts.record(sub.key, env.message_id, history, settled=True, acked_first_time=acked_first_time,
                                    lazy=True)

    async def _ack_only(self, message: Any, env: Envelope) -> bool:
        try:
            await self.consumer.acknowledge(message)
        except Exception as e:
            self.m.broker_errors.labels("ack").inc()
            self.log.warning("ack failed", message_id=env.message_id, error=type(e).__name__)
            return False
        return True

    async def _give_up(self, message: Any, env: Envelope, sub: Subscription, attempts: int, last_status: str,
                       history: list[dict[str, Any]]) -> Awaitable[None] | None:
        about = {"message_id": env.message_id, "attempts": attempts, "last_status": last_status}
        if sub.dead_letter_topic:
            props = dead_letter_properties(env, sub.topic, sub.name, attempts, last_status)
            topic = sub.dead_letter_topic
            failed = functools.partial(self.dead_letter_failures.failed, dead_letter_topic=topic)
            if not await self.dead_letters.publish(topic, env, props, stop=self._stopping, on_failure=failed):
                return None  # stopping: released unacked; spent attempts make the next owner dead-letter it
            self.dead_letter_failures.succeeded(dead_letter_topic=topic)
            self.stats.dead_lettered += 1
            self.m.dead_lettered.inc()
            self.failure_log.warning("dead-lettered", dead_letter_topic=topic, **about)
            # attempt and status too: `push-worker history` shows the settled summary (this entry) in columns
            history = [*history, event_entry("dead-lettered", self.ctx.worker_id, topic=topic,
                                             attempt=attempts, status=last_status)]
        else:
            self.stats.dropped += 1
            self.m.dropped.inc()
            self.failure_log.warning("dropped after last attempt", **about)
            history = [*history, event_entry("dropped", self.ctx.worker_id, attempt=attempts, status=last_status)]
        return await self._ack(message, env, sub, history, record_first=True)

    async def _message_failed(self, message: Any, env: Envelope, error: Exception) -> Awaitable[None] | None:
        """Settle a message whose handling raised, without taking anything else down: it never counts
        toward the worker's health (the next owner would fail on it the same way, and the next).
        Dead-lettered with the reason where the subscription has a dead-letter topic; else handed
        back to the broker, which redelivers it after its delay (never dropped for a bug of ours)."""
        self.m.message_failures.inc()
        reason = f"worker_error: {type(error).__name__}: {error}"[:300]
        self.failure_log.error("handling a message failed; it is settled alone", message_id=env.message_id,
                               error=reason, traceback="".join(traceback.format_exception(error))[-2000:])
        try:
            if self.sub.dead_letter_topic and (self.may_deliver() or await self._wait_until_may_deliver()):
                failed_env = dataclasses.replace(env, defect=reason)
                return await self._give_up(message, failed_env, self.sub, 0, "worker_error",
                                           [event_entry("worker-error", self.ctx.worker_id, detail=reason)])
        except asyncio.CancelledError:
            raise
        except Exception as again:  # the message goes back to the broker below
            self.failure_log.error("dead-lettering the failed message failed too", message_id=env.message_id,
                                   error=f"{type(again).__name__}: {again}"[:300])
        with contextlib.suppress(Exception):
            await self.consumer.negative_acknowledge(message)
        return None

    async def _pause(self, seconds: float) -> None:
        """Sleep, but wake at once when the dispatcher stops."""
        await wait_event(self._stopping, seconds)
