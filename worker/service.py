"""The worker's lifecycle: start (connections, embedded services) -> run -> drain -> close.

A `Worker` is an async context manager; `close()` is safe to call twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from redis.exceptions import AuthenticationError, ResponseError

from worker import broker_admin, compiled, embedded, logs, redis_client, resources
from worker import consumer as pulsar_adapter
from worker.admission import admit_for, secret_store
from worker.aio import cancel_within, wait_event
from worker.attempts import AttemptStore
from worker.backlog import BacklogReader
from worker.budgets import SharedBudget
from worker.config import Settings
from worker.deadletter import DeadLetterPublisher
from worker.delivery import Deliverer
from worker.dispatcher import CLOSE_TIMEOUT, DeliveryContext, Dispatcher, Fence, Stats
from worker.errors import PushWorkerError, StartupError, strip_userinfo
from worker.fleet import Fleet, lifecycle
from worker.fleet.lifecycle import ExpiryWatch, SeekTarget
from worker.http_server import StatusServer
from worker.metrics import Metrics
from worker.oidc import Tokens
from worker.prefetch import LargestMessages, prefetch_bytes, prefetch_for
from worker.redis_batch import Pipeliner
from worker.redis_client import REDIS_DOWN
from worker.subscriptions import State, Subscription
from worker.supervisor import Supervisor, log_task_failure

# See Worker._collect_soon: the first collection a second after a release, then at most one a minute
# (each scans every object the worker has made since it started: 35-93 ms with 1,000 subscriptions).
COLLECT_AFTER_RELEASE_SECONDS = 1.0
COLLECT_INTERVAL_SECONDS = 60.0
WAIT_LOG_SECONDS = 30.0  # how often a worker that waits for the broker says so
# Set in many clusters for egress; the worker's HTTP clients do not use them (said at start).
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
REDIS_START_PING_SECONDS = 5  # how long a start waits for each PING before it logs and tries again
EMBEDDED_CHECK_SECONDS = 1.0  # how soon an embedded broker or Redis that exited is started again


class Worker:
    """One worker process's delivery machinery."""

    def __init__(self, settings: Settings, worker_id: str | None = None) -> None:
        self.settings = settings
        self.worker_id = worker_id or os.environ.get("PUSH_WORKER_ID") or f"{socket.gethostname()}-{os.getpid()}"
        self.metrics = Metrics()
        self.secrets = secret_store(settings)
        self.log = logs.get(worker=self.worker_id)
        self.dispatchers: dict[str, Dispatcher] = {}
        self._starting: dict[str, asyncio.Task[None]] = {}
        self._starting_subs: dict[str, Subscription] = {}
        # Why a subscription's subscribe keeps failing (the broker's answer), for `subs list`: without
        # it a subscription the broker refuses (a missing namespace, a busy exclusive subscription)
        # showed only "Starting", for good.
        self.subscribe_failures: dict[str, str] = {}
        # Served, with no consumer of ours for now: the cursor moves (a seek), or the consumer is
        # replaced by one with a smaller prefetch (large messages).
        self._resubscribing: set[str] = set()
        self._largest: dict[str, int] = {}  # the largest message seen per subscription, if large
        self._carried_stats: dict[str, Stats] = {}  # a dispatcher's counters, to its replacement
        self._draining: set[Dispatcher] = set()  # stopped serving, their requests under way finishing
        self.largest: LargestMessages | None = None
        self._prefetch_budget = prefetch_bytes(settings.max_held_bytes_per_subscription)  # bytes, per subscription
        self._orphans: set[asyncio.Future[None]] = set()
        self._services: list[embedded.Service] = []
        self._stack = contextlib.AsyncExitStack()  # what start() started, released in reverse by close()
        self.supervisor = Supervisor(on_failure=lambda task: self.metrics.task_failures.labels(task).inc())
        self._stop = asyncio.Event()
        self._newly_served = asyncio.Event()  # a dispatcher started: read its backlog now
        self.broker_answered = False  # a subscribe succeeded, or the broker refused one (it is reachable)
        self._closed = False
        self.redis: redis_client.AsyncClient | None = None
        self.pulsar: Any = None
        self.pulsar_url = ""
        self.redis_url = ""
        self.fleet: Fleet | None = None
        self.status: StatusServer | None = None
        self._collect_timer: asyncio.TimerHandle | None = None
        self._collected_at = -COLLECT_INTERVAL_SECONDS  # loop time of the last collection

    async def __aenter__(self) -> Worker:
        try:
            await self.start()
        except BaseException:
            await self.close()  # a failed start releases what it started, embedded processes included
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- start -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start everything, in order; each part's cleanup is registered as it starts, so `close()`
        releases exactly what a start got to, in reverse. Waits (logging each retry) while Redis
        does not answer; the status server is up first, so /healthz answers and /readyz says why."""
        s = self.settings
        state_dir = s.state_dir
        self.pulsar_url = s.pulsar.service_url or ""
        self.redis_url = s.redis.url or ""
        metrics_url = s.pulsar.metrics_url
        self.tokens = Tokens(self.secrets, s.oidc)
        self.status = StatusServer(s.http.host, s.http.port, self.metrics, self.readiness, self.liveness, self.tokens)
        await self.status.start()
        self._cleanup("close the status server", self.status.close, 5)
        embedded_redis = not self.redis_url and s.redis.mode == "standalone"
        if not self.pulsar_url or embedded_redis:
            lock = embedded.lock_state_dir(state_dir)  # before anything there is touched
            self._stack.callback(os.close, lock)
            for left in await asyncio.to_thread(embedded.stop_left_running, state_dir):
                self.log.warning("stopped an embedded service that a killed worker left running", service=left)
        # Started from this thread, which lives as long as the worker: they die with it (die_with_parent).
        if not self.pulsar_url:
            service = embedded.start_pulsar(state_dir, die_with_parent=True, wait=False)
            self._cleanup_service(service)
            await asyncio.to_thread(service.wait_ready)
            self.pulsar_url = service.url
            metrics_url = metrics_url or service.metrics_url
            self.log.info("embedded broker started", url=service.url, state_dir=str(state_dir))
        if embedded_redis:
            service = embedded.start_redis(state_dir, die_with_parent=True, wait=False)
            self._cleanup_service(service)
            await asyncio.to_thread(service.wait_ready)
            self.redis_url = service.url
            self.log.info("embedded redis started", port=service.port)
        if self._services:
            embedded.record_endpoints(state_dir, embedded.service_urls(self._services), self._services)
            self.supervisor.spawn("embedded", self._keep_embedded_running)
        self.redis = redis_client.connect(s.redis, self.redis_url, socket_timeout=10, socket_connect_timeout=5,
                                          health_check_interval=15)
        self._cleanup("close Redis", self.redis.aclose, 5)
        self.pipeliner = Pipeliner(self.redis, on_round_trip=self.metrics.round_trip)
        self._cleanup("stop the Redis pipeliner", self.pipeliner.close, 5)
        self.attempts = AttemptStore(self.pipeliner, s.redis, on_error=self.metrics.redis_errors.inc)
        self.largest = LargestMessages(self.pipeliner, s.redis.attempts_ttl_seconds)
        self.pulsar = pulsar_adapter.make_client(s.pulsar, self.pulsar_url)
        # A subscribe still pending in the C++ client can hold close() for its operation timeout.
        self._cleanup("close the Pulsar client", self.pulsar.close, 5)
        self.session = broker_admin.make_session(s.pulsar.auth_token, s.pulsar.tls_trust_certs_file)
        self._cleanup("close the HTTP session", self.session.close, 5)
        if proxies := [name for name in PROXY_VARIABLES if os.environ.get(name)]:
            # Named, never their values (a proxy URL may carry a password). Connecting directly is
            # what the destination guard checks: a proxy would resolve and connect where it liked.
            self.log.warning("proxy settings are not used: push requests and the broker's admin API connect directly; "
                             "allow the worker's egress to the endpoints", variables=proxies)
        held_budget, held_from = resources.held_bytes_budget(s.max_held_bytes)
        files_soft, _ = resources.raise_open_files_limit()
        connections, connections_from = resources.connections_budget(s.destinations.max_connections, files_soft)
        self.log.info("budgets", max_held_bytes=held_budget, max_held_bytes_from=held_from,
                      max_connections=connections, max_connections_from=connections_from)
        self.memory = SharedBudget(held_budget)
        self.metrics.max_held_bytes.set(held_budget)
        self.metrics.worker_held_bytes.set_function(lambda: self.memory.used)
        self.deliverer = Deliverer(s.destinations, max_connections=connections)
        # A payload no request could carry is dead-lettered before its request is built (base64, JSON).
        self._to_envelope = functools.partial(pulsar_adapter.to_envelope,
                                              max_payload_bytes=s.destinations.max_request_bytes)
        self._cleanup("close the endpoint connections", self.deliverer.close, 5)
        self.dead_letters = DeadLetterPublisher(self.pulsar)
        self._cleanup("close dead-letter producers", self.dead_letters.close, 10)
        self.delivery = DeliveryContext(self.deliverer, self.attempts, self.dead_letters, self.metrics, self.secrets,
                                        self.worker_id, self.supervisor, self.tokens,
                                        s.max_held_bytes_per_subscription, self.memory)
        self.expiry = ExpiryWatch(self.redis, s.fleet.expire_backlog, s.fleet.expire_after_seconds)
        self.backlog = BacklogReader(self.session, s.pulsar.admin_url, metrics_url)
        if not await self._wait_for_redis():
            return  # stopped while waiting
        await self._warn_if_redis_evicts()
        self.fleet = Fleet(self, self.redis, s.fleet, s.subscriptions, admit_for(s))
        await self.fleet.start()
        self.metrics.backlog_source.set(1 if self.backlog.enabled else 0)
        if self.backlog.enabled:
            self.supervisor.spawn("backlog", self._report_backlog)
        else:
            self.log.warning("no backlog source: set pulsar.admin_url (or pulsar.metrics_url); without it there is "
                             "no pushworker_subscription_backlog, no expiry, and nothing for the HPA to scale on")
        self.supervisor.spawn("start", self._announce_start)

    async def _announce_start(self) -> None:
        """`worker started` once it is ready (in its fleet, the broker answering); until then, what it
        waits for, every WAIT_LOG_SECONDS: a broker that does not answer said as Redis is, not as the
        client's raw connection errors, and not after a `worker started` it contradicts."""
        assert self.fleet is not None and self.status is not None
        loop = asyncio.get_running_loop()
        said_at: float | None = None
        while not self._stop.is_set():
            ready, why = await self.readiness()
            if ready:
                self.log.info("worker started", fleet=self.settings.fleet.name, members=len(self.fleet.members),
                              owned=len(self.fleet.leases), http_port=self.status.port,
                              per_message_path=compiled.state())
                return
            if why.startswith("broker unreachable") and (said_at is None or loop.time() - said_at >= WAIT_LOG_SECONDS):
                self.log.warning(f"waiting for the broker at {strip_userinfo(self.pulsar_url)}", reason=why)
                said_at = loop.time()
            await wait_event(self._stop, 0.5)

    def _cleanup(self, step: str, close: Callable[[], Awaitable[Any]], limit: float) -> None:
        self._stack.push_async_callback(self._step, step, close, limit)

    def _cleanup_service(self, service: embedded.Service) -> None:
        self._services.append(service)
        self._stack.push_async_callback(asyncio.to_thread, service.stop)

    async def _keep_embedded_running(self) -> None:
        """The embedded broker and Redis are this worker's own: one that exits (killed, crashed, out
        of memory) is started again on its port with its data, or nothing would ever bring it back
        and the worker would wait for it for good. A start that fails raises: the supervisor tries
        again, and a service that cannot start turns readiness, then liveness, red."""
        while not self._stop.is_set():
            for service in self._services:
                if service.proc.poll() is None:
                    continue
                self.log.error("embedded service exited; starting it again", service=service.name,
                               exit_code=service.proc.returncode, log=str(service.log_path))
                service.respawn()  # from the loop's thread, like the first start: it dies with the worker
                embedded.record_endpoints(self.settings.state_dir, embedded.service_urls(self._services),
                                          self._services)
                await asyncio.to_thread(service.wait_ready)
                self.log.info("embedded service started again", service=service.name, url=service.url)
            await wait_event(self._stop, EMBEDDED_CHECK_SECONDS)

    async def _warn_if_redis_evicts(self) -> None:
        """Managed Redis services evict keys with a TTL by default (`volatile-lru`): an evicted attempt
        count restarts a message's numbering, an evicted lease lets a second worker take a
        subscription. Said at start; a Redis that does not answer INFO (an ACL) is not judged."""
        assert self.redis is not None
        try:
            evicting = await asyncio.wait_for(redis_client.evicting_masters(self.redis), REDIS_START_PING_SECONDS)
        except (*REDIS_DOWN, TimeoutError) as e:
            self.log.info("redis eviction policy not checked", error=redis_client.describe(e)[:200])
            return
        for address, policy in evicting.items():
            self.log.warning("redis evicts keys when full: an evicted attempt count restarts a message's numbering "
                             "and an evicted lease lets two workers serve a subscription; set maxmemory-policy "
                             "noeviction", maxmemory_policy=policy, redis=address)

    async def _wait_for_redis(self) -> bool:
        """Until Redis answers a PING: one log line per retry, with backoff. A refusal that no retry
        can mend (authentication) ends the start. False if a stop was asked for meanwhile."""
        assert self.redis is not None
        delay = 0.5
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self.redis.ping(), timeout=REDIS_START_PING_SECONDS)
                if delay > 0.5:
                    self.log.info("redis answers")
                return True
            except AuthenticationError as e:
                raise StartupError(f"redis refused the credentials of redis.url ({e}); check the password") from None
            except ResponseError as e:
                if "NOAUTH" in str(e) or "WRONGPASS" in str(e):
                    raise StartupError(f"redis refused the credentials of redis.url ({e}); check the password") \
                        from None
                self.log.warning("redis not ready; retrying", error=str(e)[:200], in_seconds=delay)
            except (*REDIS_DOWN, TimeoutError) as e:
                self.metrics.redis_errors.inc()
                said = (f"no answer within {REDIS_START_PING_SECONDS} s" if type(e) is TimeoutError
                        else redis_client.describe(e))
                self.log.warning("redis unreachable; retrying", error=f"{type(e).__name__}: {said}"[:300],
                                 in_seconds=delay)
            await wait_event(self._stop, delay)
            delay = min(delay * 2, 10.0)
        return False

    def add(self, sub: Subscription, lease: Fence | None = None) -> None:
        """Start serving a subscription (subscribing retries until the broker answers)."""
        if sub.key in self.dispatchers or sub.key in self._starting or sub.key in self._resubscribing or self.stopping:
            return
        task = asyncio.create_task(self._subscribe_and_run(sub, lease), name=f"subscribe {sub.key}")
        self._starting[sub.key] = task
        self._starting_subs[sub.key] = sub
        task.add_done_callback(functools.partial(self._forget_start, sub.key))
        task.add_done_callback(log_task_failure(self.supervisor, "subscribe"))  # the fleet tries again

    async def _subscribe_and_run(self, sub: Subscription, lease: Fence | None) -> None:
        if sub.key not in self._largest and self.largest is not None:
            self._largest[sub.key] = await self.largest.recall(sub.key)
        prefetch = self._prefetch_for(sub, self._largest.get(sub.key, 0))
        if self._largest.get(sub.key, 0) > self.settings.pulsar.max_message_bytes:
            self.log.info("large messages: prefetch sized to them", subscription=sub.key,
                          message_bytes=self._largest[sub.key], prefetch=prefetch)
        delay = 0.5
        while True:
            subscribing = asyncio.ensure_future(pulsar_adapter.subscribe(self.pulsar, sub, self.worker_id,
                                                                         receiver_queue_size=prefetch))
            try:
                consumer = await asyncio.shield(subscribing)
                self.broker_answered = True
                break
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
        dispatcher = Dispatcher(sub, consumer, self._to_envelope, self.delivery, lease, prefetch,
                                functools.partial(self._large_messages, sub.key))
        dispatcher.stats = self._carried_stats.pop(sub.key, dispatcher.stats)  # counted on by the same worker
        dispatcher.health.error_after = self.settings.fleet.error_after_seconds
        self.dispatchers[sub.key] = dispatcher
        dispatcher.start()
        self._newly_served.set()
        if self.fleet is not None:
            self.fleet.status.due()  # `subs list` says Active at the next round
        if self.settings.pulsar.admin_url:
            task = asyncio.create_task(self._evict_stale_consumers(sub), name=f"evict {sub.key}")
            self._orphans.add(task)
            task.add_done_callback(self._orphans.discard)
            task.add_done_callback(log_task_failure(self.supervisor, "evict"))

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
        # the seek with their counts forgotten (seen: a purged message delivered again, attempt 1).
        self._resubscribing.add(key)
        try:
            await self._stop_serving(key, grace=0)
            self.metrics.set_state(sub.tenant, sub.name, State.SEEKING)
            await lifecycle.seek_with_own_consumer(self.pulsar, sub, target)
            assert self.redis is not None
            return await lifecycle.forget_attempts(self.redis, key)
        finally:
            if key in self._resubscribing:  # else stopped meanwhile (handed over, deleted, lease lost): stays so
                self._resubscribing.discard(key)
                self.add(sub, lease)

    def _prefetch_for(self, sub: Subscription, largest: int) -> int:
        return prefetch_for(sub.max_ack_pending, largest, self._prefetch_budget, self.settings.pulsar.max_message_bytes)

    def _large_messages(self, key: str, size: int) -> None:
        """The dispatcher of `key` took a message too large for its consumer's prefetch."""
        dispatcher = self.dispatchers.get(key)
        if dispatcher is None or size <= self._largest.get(key, 0):
            return
        self._largest[key] = size
        smaller = self._prefetch_for(dispatcher.sub, size) < dispatcher.prefetch
        task = asyncio.create_task(self._subscribe_smaller(key, size, smaller), name=f"prefetch {key}")
        self._orphans.add(task)
        task.add_done_callback(self._orphans.discard)
        task.add_done_callback(log_task_failure(self.supervisor, "prefetch"))

    async def _subscribe_smaller(self, key: str, size: int, smaller: bool) -> None:
        """Remember the size for the next owner, then (if that makes it `smaller`) replace the
        consumer by one whose prefetch fits: as a handover does, requests under way finish within
        the shutdown grace and the rest goes back to the broker, which redelivers it in order
        (attempt counts go on)."""
        assert self.largest is not None
        await self.largest.remember(key, size)
        dispatcher = self.dispatchers.get(key)
        if not smaller or dispatcher is None or key in self._resubscribing:
            return  # nothing to gain, not served here any more, or a seek is replacing the consumer anyway
        sub, lease = dispatcher.sub, dispatcher.lease
        self._resubscribing.add(key)
        try:
            await self._stop_serving(key)
        finally:
            if key in self._resubscribing:  # else stopped meanwhile (handed over, deleted, lease lost)
                self._resubscribing.discard(key)
                self._carried_stats[key] = dispatcher.stats
                self.add(sub, lease)

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
        if self.subscribe_failures.pop(key, None) is not None and sub is not None and key not in self.dispatchers:
            self.metrics.set_state(sub.tenant, sub.name, None)

    @property
    def serving(self) -> set[str]:
        """Keys with a dispatcher, a subscribe or a seek under way."""
        return set(self.dispatchers) | set(self._starting) | self._resubscribing

    def _close_orphan(self, subscribing: asyncio.Future[Any]) -> None:
        if subscribing.cancelled() or subscribing.exception() is not None:
            return
        task = asyncio.ensure_future(asyncio.wait_for(subscribing.result().close(), timeout=5.0))
        self._orphans.add(task)
        task.add_done_callback(self._orphans.discard)

    async def _report_backlog(self) -> None:
        """Read the backlog of every owned subscription every interval; a subscription newly served
        is read within a second (not only at the next interval), so it has a figure from its start."""
        while True:
            self._newly_served.clear()
            try:
                owned = [d.sub for d in self.dispatchers.values()]
                backlogs = await self.backlog.read(owned)
                for key, value in backlogs.items():
                    dispatcher = self.dispatchers.get(key)
                    if dispatcher is not None:
                        self.metrics.backlog.labels(dispatcher.sub.tenant, dispatcher.sub.name).set(value)
                for key in await self.expiry.observe(backlogs):
                    if self.fleet is not None:
                        self.log.warning("subscription expired", subscription=key, backlog=backlogs[key])
                        await self.fleet.registry.expire(key)
            except Exception as e:  # the backlog is a report: its failure never stops delivery
                self.metrics.broker_errors.labels("backlog").inc()
                self.log.warning("backlog read failed", error=type(e).__name__,
                                 **({"detail": str(e)} if isinstance(e, broker_admin.AdminError) else {}))
            if await wait_event(self._newly_served, self.settings.pulsar.backlog_interval_seconds):
                await asyncio.sleep(1.0)  # starts come in bursts (a fleet change): one read for the burst

    async def remove(self, key: str, grace: float | None = None, unsubscribe: bool = False) -> None:
        """Stop serving a subscription; its unsettled messages go back to the broker (or, with
        `unsubscribe`, the broker subscription and its backlog are deleted)."""
        self._resubscribing.discard(key)  # a seek under way does not serve it again when it ends
        self._largest.pop(key, None)  # Redis remembers it for whoever serves it next
        self._carried_stats.pop(key, None)
        await self._stop_serving(key, grace, unsubscribe)

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
                await self.dead_letters.forget(topic)  # its producer is no longer needed here
            self._collect_soon()

    def _collect_soon(self) -> None:
        """A full collection after subscriptions were released: one for a burst of them, at most one
        a minute. A dispatcher, its consumer and its tasks refer to each other, and once they have
        lived a while only a full collection frees them, which the worker's collector settings
        (cli.worker) start after about 100 million allocations: a quiet worker whose subscriptions
        came and went grew by about 30 KiB for each (measured: 100 released a round, 6 rounds, 88 ->
        105 MiB). Not sooner than a minute apart: releasing 500 of 1,000 subscriptions one by one
        cost a collection of 35-93 ms every second while it lasted."""
        if self._collect_timer is None and not self._closed:
            loop = asyncio.get_running_loop()
            when = max(loop.time() + COLLECT_AFTER_RELEASE_SECONDS, self._collected_at + COLLECT_INTERVAL_SECONDS)
            self._collect_timer = loop.call_at(when, self._collect)

    def _collect(self) -> None:
        self._collect_timer = None
        self._collected_at = asyncio.get_running_loop().time()
        gc.collect()

    # -- run / stop ------------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def requests_under_way(self) -> int:
        return sum(d.endpoint_limit.in_use for d in (*self.dispatchers.values(), *self._draining))

    def request_stop(self) -> None:
        """Signal-safe: only sets a flag; the run loop does the draining."""
        self._stop.set()

    async def run_until_stopped(self) -> None:
        await self._stop.wait()

    async def _evict_stale_consumers(self, sub: Subscription) -> None:
        """Once this worker serves `sub`: a consumer of another worker still on it is a frozen one
        (broker_admin.py says why); unload the topic so its messages come back now, not when the
        broker's keepalive drops it. Best effort: a failure is logged and delivery goes on."""
        assert self.settings.pulsar.admin_url is not None and self.session is not None
        try:
            stale = await broker_admin.stale_consumers(self.session, self.settings.pulsar.admin_url, sub,
                                                       self.worker_id)
            if stale:
                self.log.warning("stale consumers on the broker; unloading the topic to reclaim their messages",
                                 subscription=sub.key, consumers=stale)
                await broker_admin.unload(self.session, self.settings.pulsar.admin_url, sub.topic)
        except (aiohttp.ClientError, TimeoutError, broker_admin.AdminError, ValueError) as e:
            self.metrics.broker_errors.labels("admin").inc()
            self.log.warning("stale consumer check failed", subscription=sub.key, error=f"{type(e).__name__}: {e}")

    async def readiness(self) -> tuple[bool, str]:
        if self._closed or self._stop.is_set():
            return False, "stopping"
        try:
            assert self.redis is not None
            await asyncio.wait_for(self.redis.ping(), timeout=2)
        except Exception:
            return False, "redis unreachable"
        # The worker is judged, not each subscription: one that can never subscribe (a topic the
        # broker refuses) must not hold a rolling update forever. Until the broker has answered at
        # all, though, nothing can be delivered.
        if self._starting and not self.broker_answered and not await self._broker_answers():
            # An authenticating broker drops a connection with a token it refuses, unanswered: to the
            # client that is the same timeout as a dead broker's, so the reason names both.
            token = " or refusing PUSH_WORKER_PULSAR_TOKEN" if self.settings.pulsar.auth_token else ""
            return False, f"broker unreachable{token}"
        if self.fleet is None or not self.fleet.members:
            why = self.fleet.round_error if self.fleet else ""
            return False, f"not yet in the fleet ({why})" if why else "not yet in the fleet"
        # Past a lease period every lease has lapsed: nothing is delivered, though Redis answers PING.
        if self.fleet.failing_for() > self.settings.fleet.lease_seconds:
            return False, f"fleet round failing for {self.fleet.failing_for():.0f} s ({self.fleet.round_error})"
        if twin := self.fleet.twin_reason():
            return False, twin
        failing = self.supervisor.not_ready()
        if failing:
            return False, failing
        return True, "ok"

    async def _broker_answers(self) -> bool:
        """A topic lookup of a subscription still subscribing: the client retries a refused subscribe
        until it times out, so the subscribe's error cannot tell a refusing broker from a dead one."""
        topic = next((sub.topic for sub in self._pending_subs()), None)
        if topic is None or self.pulsar is None:
            return False
        try:
            await asyncio.wait_for(self.pulsar.get_topic_partitions(topic), timeout=2)
        except Exception as e:
            self.broker_answered = pulsar_adapter.answered_by_broker(e)
        else:
            self.broker_answered = True
        return self.broker_answered

    def _pending_subs(self) -> list[Subscription]:
        return [self._starting_subs[k] for k in self._starting if k in self._starting_subs]

    def liveness(self) -> tuple[bool, str]:
        """Alive unless a background task has kept failing for a long time: then a restart may help."""
        failing = self.supervisor.not_alive()
        return (False, failing) if failing else (True, "ok")

    async def _step(self, name: str, work: Callable[[], Awaitable[Any]], limit: float) -> None:
        try:
            await asyncio.wait_for(work(), limit)
        except TimeoutError:
            self.log.warning("shutdown step timed out", step=name, seconds=limit)
        except Exception as e:
            self.log.warning("shutdown step failed", step=name, error=type(e).__name__)

    async def close(self) -> None:
        """Drain and release everything; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        grace = self.settings.shutdown_grace_seconds
        # Every step is bounded: a shutdown must end within the pod's grace period even when Redis,
        # the broker or a client library does not answer (and the log says which step did not).
        if self.fleet is not None:  # drains and releases leases so others take over at once
            await self._step("leave the fleet", self.fleet.leave, grace + 15)
        await self._step("stop background tasks", self.supervisor.close, 10)
        keys = list(self._starting) + list(self.dispatchers)
        await self._step("drain", lambda: asyncio.gather(*(self.remove(k, grace) for k in keys),
                                                         return_exceptions=True), grace + 10)
        if self._orphans:
            await asyncio.wait(set(self._orphans), timeout=5)
        self.log.info("drained")
        await self._stack.aclose()  # what start() started, in reverse
        if self._collect_timer is not None:
            self._collect_timer.cancel()
        self.log.info("worker stopped")
