"""The subscriptions a worker serves: one dispatcher each, started (subscribing until the broker
answers; a suspect on trial through a Pulsar client of its own), replaced (a seek, a smaller
prefetch for large messages, the end of a trial) and stopped here. It is what the
fleet asks things of (`fleet.worker_protocol.ServingWorker`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from worker.broker import broker_admin
from worker.broker import consumer as pulsar_adapter
from worker.broker.prefetch import LargestMessages
from worker.core.budgets import LARGE_MESSAGE_BYTES, prefetch_bytes, prefetch_for, too_large
from worker.core.dispatcher import CLOSE_TIMEOUT, DeliveryContext, Dispatcher, Fence, Stats
from worker.core.messages import Envelope
from worker.fleet import ownership, seek
from worker.fleet.memory_watch import ThreadCpu, io_thread_id
from worker.fleet.seek import SeekTarget
from worker.model.config import Settings
from worker.model.subscriptions import State, Subscription
from worker.runtime import logs
from worker.runtime.aio import cancel_within
from worker.runtime.collector import Collector
from worker.runtime.errors import PushWorkerError
from worker.runtime.supervisor import log_task_failure
from worker.state.redis_client import AsyncClient

PARTITIONS_TTL = 300.0  # seconds a topic's partition count is used before it is looked up again


class Serving:
    """The table of served subscriptions. `on_served` is told each time a dispatcher starts."""

    def __init__(self, settings: Settings, delivery: DeliveryContext, pulsar: Any, pulsar_large: Any,
                 new_client: Callable[[], Any], redis: AsyncClient, largest: LargestMessages,
                 session: aiohttp.ClientSession, to_envelope: Callable[[Any], Envelope], stop: asyncio.Event,
                 on_served: Callable[[], None]) -> None:
        self.settings = settings
        self.delivery = delivery
        self.worker_id = delivery.worker_id
        self.metrics = delivery.metrics
        self.supervisor = delivery.supervisor
        self.pulsar = pulsar
        self.pulsar_large = pulsar_large  # a client of its own for subscriptions of large messages
        self.new_client = new_client  # a client of a trial's own
        self.redis = redis
        self.largest = largest
        self.session = session
        self.to_envelope = to_envelope
        self._stop = stop
        self.on_served = on_served
        self.log = logs.get(worker=self.worker_id)
        self.dispatchers: dict[str, Dispatcher] = {}
        self._starting: dict[str, asyncio.Task[None]] = {}
        self._starting_subs: dict[str, Subscription] = {}
        self._starting_leases: dict[str, Fence | None] = {}
        # Why a subscription's subscribe keeps failing (the broker's answer), for `subs list`: without
        # it a subscription the broker refuses (a missing namespace, a busy exclusive subscription)
        # showed only "Starting", for good.
        self.subscribe_failures: dict[str, str] = {}
        # Served, with no consumer of ours for now: the cursor moves (a seek), or the consumer is
        # replaced by one with a smaller prefetch (large messages).
        self._resubscribing: set[str] = set()
        self._largest: dict[str, int] = {}  # the largest message seen per subscription, if large
        self._on_large: set[str] = set()  # subscribed through `pulsar_large`
        self._carried_stats: dict[str, Stats] = {}  # a dispatcher's counters, to its replacement
        # Suspects on trial, each subscribed through a Pulsar client of its own whose I/O thread
        # (registered in `trial_threads`) the memory alarm can name (`fleet/memory_watch.py`).
        self._trial_clients: dict[str, Any] = {}
        self._on_trial: set[str] = set()
        self.trial_threads = ThreadCpu()
        self._draining: set[Dispatcher] = set()  # stopped serving, their requests under way finishing
        self._prefetch_budget = prefetch_bytes(settings.max_held_bytes_per_subscription)  # bytes, per subscription
        self._orphans: set[asyncio.Future[None]] = set()
        self.broker_answered = False  # a subscribe succeeded, or the broker refused one (it is reachable)
        self.collector = Collector()
        self._partitions: dict[str, tuple[int, float]] = {}  # topic -> (partitions, when looked up)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def serving(self) -> set[str]:
        """Keys with a dispatcher, a subscribe or a seek under way."""
        return set(self.dispatchers) | set(self._starting) | self._resubscribing

    @property
    def subscribing(self) -> bool:
        return bool(self._starting)

    def requests_under_way(self) -> int:
        return sum(d.endpoint_limit.in_use for d in (*self.dispatchers.values(), *self._draining))

    # -- start -------------------------------------------------------------------------------

    def add(self, sub: Subscription, lease: Fence | None = None, trial: bool = False) -> None:
        """Start serving a subscription (subscribing retries until the broker answers); `trial`: through
        a Pulsar client of its own, until `end_trial`."""
        if sub.key in self.dispatchers or sub.key in self._starting or sub.key in self._resubscribing or self.stopping:
            return
        if trial:
            self._on_trial.add(sub.key)
        task = asyncio.create_task(self._subscribe_and_run(sub, lease), name=f"subscribe {sub.key}")
        self._starting[sub.key] = task
        self._starting_subs[sub.key] = sub
        self._starting_leases[sub.key] = lease
        task.add_done_callback(functools.partial(self._forget_start, sub.key))
        task.add_done_callback(log_task_failure(self.supervisor, "subscribe"))  # the fleet tries again

    async def _subscribe_and_run(self, sub: Subscription, lease: Fence | None) -> None:
        remembered = sub.key not in self._largest  # else seen here (a consumer replaced for it)
        if remembered:
            self._largest[sub.key] = await self.largest.recall(sub.key)
        prefetch = self._prefetch_for(sub, self._largest[sub.key])
        if self._largest[sub.key] > self.settings.pulsar.max_message_bytes:
            self.log.info("large messages: prefetch sized to them", subscription=sub.key,
                          message_bytes=self._largest[sub.key], prefetch=prefetch)
        if self._largest[sub.key] >= LARGE_MESSAGE_BYTES:
            self.log.info("large messages: a connection of their own", subscription=sub.key,
                          message_bytes=self._largest[sub.key], remembered=remembered)
        consumer = await self._subscribe(sub, prefetch)
        dispatcher = Dispatcher(sub, consumer, self.to_envelope, self.delivery, lease, prefetch,
                                functools.partial(self._large_messages, sub.key),
                                stats=self._carried_stats.pop(sub.key, None),  # counted on by the same worker
                                error_after=self.settings.fleet.error_after_seconds)
        self.dispatchers[sub.key] = dispatcher
        dispatcher.start()
        self.on_served()
        if self.settings.pulsar.admin_url:
            # A spread subscription's other consumers are its other slots' holders, not stale ones.
            holders = functools.partial(ownership.holders, self.redis, self.settings.fleet.name, sub.key,
                                        sub.max_workers) if sub.max_workers > 1 else None
            self._spawn(broker_admin.evict_stale_consumers(self.session, self.settings.pulsar.admin_url, sub,
                                                           self.worker_id, self.log, self.metrics, holders),
                        f"evict {sub.key}", "evict")

    async def _subscribe(self, sub: Subscription, prefetch: int) -> pulsar_adapter.PulsarConsumer:
        delay = 0.5
        while True:
            large = self._largest.get(sub.key, 0) >= LARGE_MESSAGE_BYTES
            client = await self._trial_client(sub) if sub.key in self._on_trial else \
                self.pulsar_large if large else self.pulsar
            subscribing = asyncio.ensure_future(pulsar_adapter.subscribe(client, sub, self.worker_id,
                                                                         receiver_queue_size=prefetch))
            try:
                consumer = await asyncio.shield(subscribing)
                self.broker_answered = True
                if large:
                    self._on_large.add(sub.key)
                else:
                    self._on_large.discard(sub.key)
                return consumer
            except asyncio.CancelledError:
                # Cancelling does not stop the subscribe inside the client: close the consumer it
                # creates, or that orphan would take messages and never ack them.
                subscribing.add_done_callback(self._close_orphan)
                raise
            except Exception as e:
                self.broker_answered = self.broker_answered or pulsar_adapter.answered_by_broker(e)
                self.metrics.broker_errors.labels("subscribe").inc()
                said = pulsar_adapter.broker_error_text(e)
                self.subscribe_failures[sub.key] = said
                self.metrics.set_state(sub.tenant, sub.name, State.STARTING)  # what the alert reads
                self.log.warning("subscribe failed; retrying", subscription=sub.key, error=said, in_seconds=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def _trial_client(self, sub: Subscription) -> Any:
        """The client of `sub`'s trial, made on its first subscribe, its I/O thread registered under
        its key (a worker serves one slot of a subscription at most)."""
        client = self._trial_clients.get(sub.key)
        if client is None:
            client = self._trial_clients[sub.key] = self.new_client()
            tid = await io_thread_id(client, sub.topic, timeout=self.settings.pulsar.operation_timeout_seconds)
            self.trial_threads.register(tid, sub.key)
        return client

    def end_trial(self, key: str) -> None:
        """`key`'s trial is over: served through the shared client from now on (its consumer
        replaced as for large messages: requests under way finish, the rest is redelivered in order)."""
        if key not in self._on_trial:
            return
        self._spawn(self._move_off_trial(key), f"end trial {key}", "end trial")

    async def _move_off_trial(self, key: str) -> None:
        dispatcher = self.dispatchers.get(key)
        starting = self._starting_subs.get(key)
        if (dispatcher is None and starting is None) or key in self._resubscribing:
            await self._close_trial_client(key)  # stopped meanwhile, or a seek replaces the consumer anyway
            return
        # A subscribe that never went through (a stalled trial) is started again, through the shared client.
        sub, lease = (dispatcher.sub, dispatcher.lease) if dispatcher is not None else \
            (starting, self._starting_leases.get(key))
        assert sub is not None
        await self._serve_anew(key, sub, lease, dispatcher.stats if dispatcher is not None else None,
                               then=functools.partial(self._close_trial_client, key))

    async def _close_trial_client(self, key: str) -> None:
        self._on_trial.discard(key)
        self.trial_threads.forget(key)
        client = self._trial_clients.pop(key, None)
        if client is not None:
            with contextlib.suppress(Exception):  # closing a client of one consumer: nothing to lose
                await asyncio.wait_for(client.close(), timeout=5.0)

    async def started(self, key: str) -> Dispatcher | None:
        """The subscription's dispatcher, once a subscribe under way has ended (None if it failed)."""
        starting = self._starting.get(key)
        if starting is not None:
            await asyncio.wait({starting})  # never raises, whatever became of the subscribe
        return self.dispatchers.get(key)

    def _forget_start(self, key: str, task: asyncio.Task[None]) -> None:
        if self._starting.get(key) is task:  # a newer start of the same key is not ours to forget
            del self._starting[key]
            self._start_ended(key)

    def _start_ended(self, key: str) -> None:
        """A subscribe ended, served or given up (moved, paused, deleted): its failures are forgotten,
        and so is its Starting state unless a dispatcher now reports its own."""
        sub = self._starting_subs.pop(key, None)
        self._starting_leases.pop(key, None)
        if self.subscribe_failures.pop(key, None) is not None and sub is not None and key not in self.dispatchers:
            self.metrics.set_state(sub.tenant, sub.name, None)

    def _close_orphan(self, subscribing: asyncio.Future[Any]) -> None:
        if subscribing.cancelled() or subscribing.exception() is not None:
            return
        task = asyncio.ensure_future(asyncio.wait_for(subscribing.result().close(), timeout=5.0))
        self._orphans.add(task)
        task.add_done_callback(self._orphans.discard)

    def _spawn(self, work: Any, name: str, what: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._orphans.add(task)
        task.add_done_callback(self._orphans.discard)
        task.add_done_callback(log_task_failure(self.supervisor, what))

    async def broker_reachable(self) -> bool:
        """Whether the broker has answered at all. Until a subscribe has, a topic lookup of a
        subscription still subscribing: the client retries a refused subscribe until it times out,
        so the subscribe's error cannot tell a refusing broker from a dead one."""
        if self.broker_answered:
            return True
        topic = next((self._starting_subs[k].topic for k in self._starting if k in self._starting_subs), None)
        if topic is None:
            return False
        try:
            await asyncio.wait_for(self.pulsar.get_topic_partitions(topic), timeout=2)
        except Exception as e:
            self.broker_answered = pulsar_adapter.answered_by_broker(e)
        else:
            self.broker_answered = True
        return self.broker_answered

    async def partitions(self, topic: str) -> int:
        """How many partitions `topic` has (1 when it is not partitioned, or the broker does not say),
        looked up at most every PARTITIONS_TTL: a failover subscription spreads over at most that many."""
        known = self._partitions.get(topic)
        now = asyncio.get_running_loop().time()
        if known is not None and now - known[1] < PARTITIONS_TTL:
            return known[0]
        try:
            count = len(await asyncio.wait_for(self.pulsar.get_topic_partitions(topic), timeout=5))
        except Exception as e:
            self.metrics.broker_errors.labels("lookup").inc()
            self.log.warning("partition lookup failed", topic=topic, error=pulsar_adapter.broker_error_text(e))
            return known[0] if known is not None else 1
        self._partitions[topic] = (max(1, count), now)
        return max(1, count)

    # -- replace -----------------------------------------------------------------------------

    async def seek(self, key: str, target: SeekTarget) -> int:
        """Rewind or fast-forward a served subscription: stop its dispatcher (what it held goes back to
        the broker), move the cursor, forget the attempt counts, serve it again from the new position.
        Returns how many attempt records were forgotten."""
        dispatcher = await self.started(key)
        if dispatcher is None:
            raise PushWorkerError("the subscription is not being served here")
        sub, lease = dispatcher.sub, dispatcher.lease
        # Still served while it has no dispatcher: a fleet round must not start one now. A consumer
        # attached before the cursor moves keeps the messages it took, and would deliver them after
        # the seek with their counts forgotten.
        self._resubscribing.add(key)
        try:
            await self._stop_serving(key, grace=0)
            self.metrics.set_state(sub.tenant, sub.name, State.SEEKING)
            await seek.seek_with_own_consumer(self.pulsar, sub, target)
            return await seek.forget_attempts(self.redis, key)
        finally:
            if key in self._resubscribing:  # else stopped meanwhile (handed over, deleted, lease lost): stays so
                self._resubscribing.discard(key)
                self.add(sub, lease)

    def _prefetch_for(self, sub: Subscription, largest: int) -> int:
        return prefetch_for(sub.max_ack_pending, largest, self._prefetch_budget, self.settings.pulsar.max_message_bytes)

    def _large_messages(self, key: str, size: int) -> None:
        """The dispatcher of `key` took a large message: one too large for its consumer's prefetch,
        or the first of LARGE_MESSAGE_BYTES or more (its messages move to `pulsar_large`)."""
        dispatcher = self.dispatchers.get(key)
        if dispatcher is None or size <= self._largest.get(key, 0):
            return
        self._largest[key] = size
        moves = size >= LARGE_MESSAGE_BYTES and key not in self._on_large
        smaller = (size > too_large(dispatcher.prefetch, self._prefetch_budget)
                   and self._prefetch_for(dispatcher.sub, size) < dispatcher.prefetch)
        self._spawn(self._subscribe_again(key, size, smaller or moves), f"prefetch {key}", "prefetch")

    async def _subscribe_again(self, key: str, size: int, again: bool) -> None:
        """Remember the size for the next owner, then (`again`) replace the consumer by one whose
        prefetch fits, through the client for large messages: as a handover does, requests under
        way finish within the shutdown grace and the rest goes back to the broker, which redelivers
        it in order (attempt counts go on)."""
        await self.largest.remember(key, size)
        dispatcher = self.dispatchers.get(key)
        if not again or dispatcher is None or key in self._resubscribing:
            return  # nothing to gain, not served here any more, or a seek is replacing the consumer anyway
        await self._serve_anew(key, dispatcher.sub, dispatcher.lease, dispatcher.stats)

    async def _serve_anew(self, key: str, sub: Subscription, lease: Fence | None, stats: Stats | None,
                          then: Callable[[], Awaitable[None]] | None = None) -> None:
        """Replace a subscription's consumer: stop serving it (requests under way finish within the
        shutdown grace, the rest goes back to the broker, which redelivers it in order), run `then`,
        and serve it again with its counters, unless it was stopped meanwhile (handed over, deleted,
        lease lost)."""
        self._resubscribing.add(key)
        try:
            await self._stop_serving(key)
        finally:
            if then is not None:
                await then()
            if key in self._resubscribing:
                self._resubscribing.discard(key)
                if stats is not None:
                    self._carried_stats[key] = stats
                self.add(sub, lease)

    # -- stop --------------------------------------------------------------------------------

    async def remove(self, key: str, grace: float | None = None, unsubscribe: bool = False) -> None:
        """Stop serving a subscription; its unsettled messages go back to the broker (or, with
        `unsubscribe`, the broker subscription and its backlog are deleted)."""
        self._resubscribing.discard(key)  # a seek under way does not serve it again when it ends
        self._largest.pop(key, None)  # Redis remembers it for whoever serves it next
        self._on_large.discard(key)
        self._carried_stats.pop(key, None)
        try:
            await self._stop_serving(key, grace, unsubscribe)
        finally:
            await self._close_trial_client(key)

    async def _stop_serving(self, key: str, grace: float | None = None, unsubscribe: bool = False) -> None:
        starting = self._starting.pop(key, None)
        if starting is not None:
            if await cancel_within([starting], CLOSE_TIMEOUT):
                self.log.warning("subscribe did not end on cancel; stopping without it", subscription=key)
            self._start_ended(key)
        dispatcher = self.dispatchers.pop(key, None)
        if dispatcher is not None:
            self._draining.add(dispatcher)
            try:
                await dispatcher.stop(self.settings.shutdown_grace_seconds if grace is None else grace, unsubscribe)
            finally:
                self._draining.discard(dispatcher)
            topic = dispatcher.sub.dead_letter_topic
            if topic and all(d.sub.dead_letter_topic != topic for d in self.dispatchers.values()):
                await self.delivery.dead_letters.forget(topic)  # its producer is no longer needed here
            self.collector.soon()

    async def close(self, grace: float) -> None:
        """Stop serving everything: requests under way finish within `grace`, the rest goes back."""
        keys = list(self._starting) + list(self.dispatchers)
        await asyncio.gather(*(self.remove(k, grace) for k in keys), return_exceptions=True)
        if self._orphans:
            await asyncio.wait(set(self._orphans), timeout=5)
        self.collector.close()
