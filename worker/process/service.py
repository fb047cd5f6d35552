"""The worker's lifecycle: start (connections, embedded services) -> run -> drain -> close.

A `Worker` builds its parts in order and releases them in reverse; what each part does lives in its
own module: serving the subscriptions (`serving`), the fleet (`fleet`), the backlog report
(`backlog`), the embedded services (`local_services`). `Worker` is an async context manager;
`close()` is safe to call twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from worker.api.beside import AdminBeside
from worker.broker import broker_admin
from worker.broker import consumer as pulsar_adapter
from worker.broker.backlog import BacklogReader
from worker.broker.broker_watch import BrokerWatch
from worker.broker.local_services import LocalServices
from worker.broker.prefetch import LargestMessages
from worker.core import pulsar_messages
from worker.core.attempts import AttemptStore
from worker.core.metrics import Metrics
from worker.core.redis_batch import Pipeliner
from worker.endpoint.oidc import Tokens
from worker.fleet import Fleet, layout
from worker.fleet.admission import admit_for, secret_store
from worker.fleet.expiry import BacklogReport, ExpiryWatch
from worker.model.config import Settings
from worker.process.delivery_setup import delivery_context
from worker.process.readiness import readiness
from worker.process.serving import Serving
from worker.runtime import compiled, logs, release
from worker.runtime.aio import wait_event
from worker.runtime.errors import strip_userinfo
from worker.runtime.http_server import StatusServer
from worker.runtime.supervisor import Supervisor
from worker.state import redis_client, redis_start

WAIT_LOG_SECONDS = 30.0  # how often a worker that waits for the broker says so
# Set in many clusters for egress; the worker's HTTP clients do not use them (said at start).
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


class Worker:
    """One worker process's delivery machinery."""

    def __init__(self, settings: Settings, worker_id: str | None = None, config_path: str | None = None,
                 own_process: bool = False) -> None:
        self.settings = settings
        self.config_path = config_path  # for the admin process beside an embedded worker
        # The process is this worker's (`push-worker run`): a newer layout in Redis ends it at once,
        # writing nothing more. In someone else's process (tests, the demo) the worker stops instead.
        self.own_process = own_process
        self.worker_id = worker_id or os.environ.get("PUSH_WORKER_ID") or f"{socket.gethostname()}-{os.getpid()}"
        self.metrics = Metrics()
        self.secrets = secret_store(settings)
        self.log = logs.get(worker=self.worker_id)
        self._stack = contextlib.AsyncExitStack()  # what start() started, released in reverse by close()
        self.supervisor = Supervisor(on_failure=lambda task: self.metrics.task_failures.labels(task).inc())
        self._stop = asyncio.Event()
        self._closed = False
        self.redis: redis_client.AsyncClient | None = None
        self.pulsar: Any = None
        self.pulsar_url = ""
        self.redis_url = ""
        self.served: Serving | None = None
        self.fleet: Fleet | None = None
        self.status: StatusServer | None = None
        self.backlog: BacklogReport | None = None
        self.admin: AdminBeside | None = None

    async def __aenter__(self) -> Worker:
        try:
            await self.start()
        except BaseException:
            await self.close()  # a failed start releases what it started, embedded processes included
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def dispatchers(self) -> dict[str, Any]:
        """The subscriptions served, by key (empty before the start got that far)."""
        return self.served.dispatchers if self.served is not None else {}

    # -- start -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start everything, in order; each part's cleanup is registered as it starts, so `close()`
        releases exactly what a start got to, in reverse. Waits (logging each retry) while Redis
        does not answer; the status server is up first, so /healthz answers and /readyz says why."""
        s = self.settings
        for line in s.deprecated:
            self.log.warning(line)
        self.tokens = Tokens(self.secrets, s.oidc)
        self.status = StatusServer(s.http.host, s.http.port, self.metrics, self.readiness, self.liveness, self.tokens)
        await self.status.start()
        self._cleanup("close the status server", self.status.close, 5)
        local = LocalServices(s.state_dir, self.log)
        await local.start(self._stack, pulsar=not s.pulsar.service_url,
                          redis=not s.redis.url and s.redis.mode == "standalone")
        if local.services:
            self.supervisor.spawn("embedded", functools.partial(local.keep_running, self._stop))
        self.pulsar_url = s.pulsar.service_url or local.pulsar_url or ""
        self.redis_url = s.redis.url or local.redis_url or ""
        self.redis = redis_client.connect(s.redis, self.redis_url, socket_timeout=10, socket_connect_timeout=5,
                                          health_check_interval=15)
        self._cleanup("close Redis", self.redis.aclose, 5)
        pipeliner = Pipeliner(self.redis, on_round_trip=self.metrics.round_trip)
        self._cleanup("stop the Redis pipeliner", pipeliner.close, 5)
        self.pulsar = pulsar_adapter.make_client(s.pulsar, self.pulsar_url)
        # A subscribe still pending in the C++ client can hold close() for its operation timeout.
        self._cleanup("close the Pulsar client", self.pulsar.close, 5)
        # Its own connection and I/O thread for subscriptions of large messages (serving.py).
        pulsar_large = pulsar_adapter.make_client(s.pulsar, self.pulsar_url)
        self._cleanup("close the Pulsar client of large messages", pulsar_large.close, 5)
        session = broker_admin.make_session(s.pulsar.auth_token, s.pulsar.tls_trust_certs_file)
        self._cleanup("close the HTTP session", session.close, 5)
        if proxies := [name for name in PROXY_VARIABLES if os.environ.get(name)]:
            # Named, never their values (a proxy URL may carry a password). Connecting directly is
            # what the destination guard checks: a proxy would resolve and connect where it liked.
            self.log.warning("proxy settings are not used: push requests and the broker's admin API connect directly; "
                             "allow the worker's egress to the endpoints", variables=proxies)
        self.delivery, self.memory, self.dead_letters = delivery_context(
            s, self.pulsar, pipeliner, self.metrics, self.secrets, self.worker_id, self.supervisor, self.tokens,
            self.log, self._cleanup)
        self.served = Serving(s, self.delivery, self.pulsar, pulsar_large,
                              functools.partial(pulsar_adapter.make_client, s.pulsar, self.pulsar_url), self.redis,
                              LargestMessages(pipeliner, s.redis.attempts_ttl_seconds), session,
                              # A payload no request could carry is dead-lettered before its request is built.
                              functools.partial(pulsar_messages.to_envelope,
                                                max_payload_bytes=s.destinations.max_request_bytes),
                              self._stop, self._served_one)
        reader = BacklogReader(session, s.pulsar.admin_url, s.pulsar.metrics_url or local.metrics_url)
        if s.admin is not None:
            self._admin_beside(local)
        if not await redis_start.wait_until_answering(self.redis, self._stop, self.log, self.metrics.redis_errors.inc):
            return  # stopped while waiting
        await redis_start.require_version(self.redis, self.log)
        await layout.claim(self.redis)  # before anything is written: a newer layout ends the start here
        layout_state = await layout.current(self.redis)
        self._follow_layout(layout_state)
        await redis_start.warn_if_evicting(self.redis, self.log)
        self.fleet = Fleet(self.served, self.redis, s.fleet, s.subscriptions, admit_for(s), self._refuse_layout,
                           self._follow_layout, layout_state)
        await self.fleet.start()
        self.metrics.backlog_source.set(1 if reader.enabled else 0)
        if reader.enabled:
            self.backlog = BacklogReport(reader, ExpiryWatch(self.redis, s.fleet.expire_backlog,
                                                             s.fleet.expire_after_seconds),
                                         self.served.dispatchers, self.metrics, self.fleet.registry.expire,
                                         s.pulsar.backlog_interval_seconds, self.log, readings=self.fleet.backlogs)
            self.supervisor.spawn("backlog", self.backlog.run)
        else:
            self.log.warning("no backlog source: set pulsar.admin_url (or pulsar.metrics_url); without it there is "
                             "no pushworker_subscription_backlog, no expiry, and nothing for the HPA to scale on")
        watch = BrokerWatch(self.pulsar, lambda: next((d.sub.topic for d in self.dispatchers.values()), ""),
                            s.fleet.broker_lost_after_seconds, self.fleet.step_out, self.fleet.step_in, self._stop)
        self.supervisor.spawn("broker-watch", watch.run)
        self.supervisor.spawn("start", self._announce_start)

    def _admin_beside(self, local: LocalServices) -> None:
        """The operator API and console run in a process of their own (`push-worker admin`): started
        here beside an embedded worker, on their own Deployment otherwise."""
        if not local.services or self.config_path is None:
            self.log.info("admin: is served by `push-worker admin --config FILE`, a process of its own; this "
                             "worker does not serve it")
            return
        urls = {"redis_url": local.redis_url or "", "pulsar_url": local.pulsar_url or ""}
        self.admin = AdminBeside(self.config_path, urls, self.log)
        self.supervisor.spawn("admin", self.admin.run)
        self._cleanup("stop the admin process", self.admin.close, 15)

    def _served_one(self) -> None:
        """A dispatcher started: `subs list` says Active at the next round, its backlog is read now."""
        if self.fleet is not None:
            self.fleet.status.due()
        if self.backlog is not None:
            self.backlog.newly_served.set()

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
                              per_message_path=compiled.state(), version=release.version(), commit=release.commit())
                return
            if why.startswith("broker unreachable") and (said_at is None or loop.time() - said_at >= WAIT_LOG_SECONDS):
                self.log.warning(f"waiting for the broker at {strip_userinfo(self.pulsar_url)}", reason=why)
                said_at = loop.time()
            await wait_event(self._stop, 0.5)

    def _follow_layout(self, state: layout.LayoutState) -> None:
        """The attempt records follow the layout Redis holds (read every fleet round)."""
        store = self.delivery.attempts
        assert isinstance(store, AttemptStore)
        before = (store.layout, store.switching)
        store.set_layout(state.layout, state.layout_1_until(self.settings.redis.attempts_ttl_seconds), state.switching)
        if before != (store.layout, store.switching):
            self.log.info("redis layout", layout=state.layout, switching=state.switching,
                          reads_layout_1=bool(state.since_ms))

    def _refuse_layout(self, why: str) -> None:
        """A newer release's layout appeared in Redis while this worker ran: it stops at once, as it
        would refuse to start, writing nothing more (no release, no drain: its leases lapse, and its
        unsettled messages go back to the broker with its connection)."""
        self.log.error("stopping: " + why)
        if not self.own_process:
            self.request_stop()
            return
        sys.stderr.write(f"push-worker: {why}\n")
        logging.shutdown()
        sys.stderr.flush()
        os._exit(1)

    def _cleanup(self, step: str, close: Callable[[], Awaitable[Any]], limit: float) -> None:
        self._stack.push_async_callback(self._step, step, close, limit)

    # -- run / stop ------------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def closed(self) -> bool:
        return self._closed

    def requests_under_way(self) -> int:
        return self.served.requests_under_way() if self.served is not None else 0

    def request_stop(self) -> None:
        """Signal-safe: only sets a flag; the run loop does the draining."""
        self._stop.set()

    async def run_until_stopped(self) -> None:
        await self._stop.wait()

    async def readiness(self) -> tuple[bool, str]:
        return await readiness(self)

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
        if self.served is not None:
            served = self.served
            await self._step("drain", lambda: served.close(grace), grace + 15)
        self.log.info("drained")
        await self._stack.aclose()  # what start() started, in reverse
        self.log.info("worker stopped")
