"""What a dispatcher works with: the parts it is given (the protocols its collaborators fit), the
context every dispatcher of a worker shares, and the state the parts of one dispatcher share."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from worker.core.attempts import AttemptRecord
from worker.core.budgets import SharedBudget
from worker.core.delivery import Outcome
from worker.core.messages import Envelope, PushRequest
from worker.core.metrics import Metrics
from worker.core.recent import RecentDeliveries
from worker.core.scheduler import FairShare
from worker.endpoint.client_tls import ClientCertificates
from worker.endpoint.oauth2 import OAuth2Tokens
from worker.endpoint.oidc import Tokens
from worker.endpoint.secrets import SecretStore
from worker.model.config import DEFAULT_MAX_HELD_BYTES
from worker.model.subscriptions import Subscription
from worker.runtime import logs
from worker.runtime.aio import wait_event
from worker.runtime.failing import Failing
from worker.runtime.supervisor import Supervisor


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

    async def close(self) -> None: ...  # what is still summed in the worker goes to Redis


# What became of an attempt, as its span says (`Tracer.settled`).
ACKED, RETRIED, DEAD_LETTERED, DROPPED, STOPPED = "acked", "retried", "dead-lettered", "dropped", "stopped"


class Tracer(Protocol):
    """Where a dispatcher's spans come from (`telemetry.tracing.Tracer` fits); a worker that does not
    trace has none (`DeliveryContext.tracer` None), and its per-message path checks only that."""

    # The span of one request (None: not sampled) and the trace headers the request carries.
    def attempt(self, sub: Subscription, sending: Sequence[tuple[Envelope, int]],
                probe: bool) -> tuple[Any, dict[str, str]]: ...
    def answered(self, span: Any, outcome: Outcome) -> None: ...
    def exemplar(self, span: Any) -> dict[str, str] | None: ...
    def settled(self, span: Any, decision: str) -> None: ...  # ends the attempt's span: ACKED, RETRIED...
    def dead_letter(self, sub: Subscription, env: Envelope, topic: str, attempts: int, last_status: str,
                    after: Any) -> Any: ...
    def published(self, span: Any, confirmed: bool) -> None: ...
    def breaker(self, sub: Subscription, opened: bool, reason: str) -> None: ...
    async def close(self) -> None: ...


class DeadLetters(Protocol):
    """Where exhausted messages go (`broker.deadletter.DeadLetterPublisher` fits): published until the
    broker confirms, or until `stop`; each failure told to `on_failure`."""

    async def publish(self, dl_topic: str, env: Envelope, properties: dict[str, str],
                      on_failure: Callable[[BaseException], None] | None = None,
                      stop: asyncio.Event | None = None) -> bool: ...

    def failures(self, log: Any, count: Callable[[], None]) -> Failing: ...

    async def forget(self, topic: str) -> None: ...  # no subscription of the worker uses `topic` any more

    async def close(self) -> None: ...


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


@dataclass
class DeliveryContext:
    """What every dispatcher of one worker shares."""

    deliverer: Endpoints
    attempts: AttemptLog
    dead_letters: DeadLetters
    metrics: Metrics
    secrets: SecretStore = field(default_factory=SecretStore)
    worker_id: str = ""
    supervisor: Supervisor = field(default_factory=Supervisor)
    tokens: Tokens | None = None  # OIDC tokens; made from `secrets` when not given
    max_held_bytes: int = DEFAULT_MAX_HELD_BYTES  # per subscription (`max_held_bytes_per_subscription`)
    memory: SharedBudget | None = None  # every subscription's held bytes together (`max_held_bytes`)
    certificates: ClientCertificates | None = None  # mutual TLS; made from `secrets` when not given
    oauth2: OAuth2Tokens | None = None  # OAuth 2.0 client credentials (fetched with the worker's client)
    share: FairShare = field(default_factory=FairShare)  # the event loop's time, shared across projects
    tracer: Tracer | None = None  # OpenTelemetry spans (tracing configured), else none

    def __post_init__(self) -> None:
        if self.tokens is None:
            self.tokens = Tokens(self.secrets)
        if self.certificates is None:
            self.certificates = ClientCertificates(self.secrets)


class Shared:
    """What the parts of one dispatcher share: the subscription as last edited (an edit applies from
    a message's next attempt on), its counters, metrics and logs, its tasks, and its stop."""

    def __init__(self, sub: Subscription, ctx: DeliveryContext, stats: Stats) -> None:
        self.sub = sub
        self.ctx = ctx
        self.stats = stats
        self.m = ctx.metrics.for_subscription(sub.tenant, sub.name)
        self.log = logs.get(project=sub.tenant, subscription=sub.name)
        self.failure_log = logs.Throttled(self.log, self.m.log_lines_suppressed.inc)  # lines a message's fate writes
        self.stopping = asyncio.Event()
        self.tasks: set[asyncio.Task[None]] = set()
        self.loop: asyncio.AbstractEventLoop | None = None  # set by `start()`

    def spawn(self, work: Awaitable[None]) -> None:
        # With the loop given, not looked up: Python 3.11 makes a getpid() system call per lookup,
        # 5-8 of them a message on the hot path (strace).
        task: asyncio.Task[None] = asyncio.ensure_future(work, loop=self.loop)
        self.tasks.add(task)  # keep a reference: the loop holds tasks weakly
        task.add_done_callback(self.tasks.discard)

    async def pause(self, seconds: float) -> None:
        """Sleep, but wake at once when the dispatcher stops."""
        await wait_event(self.stopping, seconds)
