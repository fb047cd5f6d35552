"""What every subscription's dispatcher of one worker shares (a DeliveryContext): the endpoint
client, the attempt store, the dead-letter producers, and the worker's budgets of memory and
connections, sized from the container's limits."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from worker import telemetry
from worker.broker.deadletter import DeadLetterPublisher
from worker.core.attempts import AttemptStore
from worker.core.budgets import SharedBudget
from worker.core.delivery import Deliverer
from worker.core.dispatcher import DeliveryContext
from worker.core.metrics import Metrics
from worker.core.redis_batch import Pipeliner
from worker.endpoint.destinations import without_credentials
from worker.endpoint.oauth2 import OAuth2Tokens
from worker.endpoint.oidc import Tokens
from worker.endpoint.secrets import SecretStore
from worker.model.config import Settings
from worker.runtime import resources
from worker.runtime.supervisor import Supervisor

Cleanup = Callable[[str, Callable[[], Awaitable[Any]], float], None]


def delivery_context(s: Settings, pulsar: Any, pipeliner: Pipeliner, metrics: Metrics, secrets: SecretStore,
                     worker_id: str, supervisor: Supervisor, tokens: Tokens, log: Any,
                     cleanup: Cleanup) -> tuple[DeliveryContext, SharedBudget, DeadLetterPublisher]:
    """The context, the worker's held-bytes budget and its dead-letter publisher; `cleanup`
    registers what must be closed when the worker stops."""
    held_budget, held_from = resources.held_bytes_budget(s.max_held_bytes)
    files_soft, _ = resources.raise_open_files_limit()
    connections, connections_from = resources.connections_budget(s.destinations.max_connections, files_soft)
    log.info("budgets", max_held_bytes=held_budget, max_held_bytes_from=held_from,
             max_connections=connections, max_connections_from=connections_from)
    memory = SharedBudget(held_budget)
    metrics.max_held_bytes.set(held_budget)
    metrics.worker_held_bytes.set_function(lambda: memory.used)
    deliverer = Deliverer(s.destinations, max_connections=connections)
    cleanup("close the endpoint connections", deliverer.close, 5)
    dead_letters = DeadLetterPublisher(pulsar)
    cleanup("close dead-letter producers", dead_letters.close, 10)
    attempts = AttemptStore(pipeliner, s.redis, on_error=metrics.redis_errors.inc)
    cleanup("add the delivery log's last counts", attempts.close, 5)
    context = DeliveryContext(deliverer, attempts, dead_letters, metrics, secrets, worker_id, supervisor, tokens,
                              s.max_held_bytes_per_subscription, memory,
                              oauth2=OAuth2Tokens(secrets, deliverer.client))
    context.share.on_wait = metrics.fair_share_waits.inc
    context.tracer = telemetry.start(s.tracing, metrics)
    if context.tracer is not None:
        log.info("tracing", traces_url=without_credentials(s.tracing.traces_url or ""),
                 sampler="OTEL_TRACES_SAMPLER" if s.tracing.sampler_from_environment else
                 f"parent-based, {s.tracing.sample_ratio:g} of new traces", max_queue_size=s.tracing.max_queue_size)
        cleanup("send the last spans", context.tracer.close, 5)
    return context, memory, dead_letters
