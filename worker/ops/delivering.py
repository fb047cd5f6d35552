"""Deliveries an operator starts (a redrive, a replay): the same dispatcher a worker runs, with the
subscription's credentials read from the worker's secrets.dir, outside any worker."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from pulsar import asyncio as pulsar_async

from worker import telemetry
from worker.broker import consumer as pulsar_adapter
from worker.broker.deadletter import DeadLetterPublisher
from worker.core.attempts import AttemptStore
from worker.core.context import DeliveryContext
from worker.core.delivery import Deliverer
from worker.core.metrics import Metrics
from worker.core.redis_batch import Pipeliner
from worker.endpoint.oidc import Tokens
from worker.fleet import layout
from worker.fleet.admission import check_secrets, secret_store
from worker.model.config import PulsarSettings, Settings
from worker.model.subscriptions import Subscription
from worker.runtime.errors import UsageError
from worker.state.redis_client import AsyncClient


def check_credentials(settings: Settings, sub: Subscription, command: str) -> None:
    """A request that cannot be signed would fail every message it carries: refused before any."""
    refs = [*sub.signing_secrets, sub.bearer_token, sub.oauth2.client_secret if sub.oauth2 else None]
    if settings.secrets_dir is None and any(ref is not None and ref.secret for ref in refs):
        raise UsageError(command, "--config", "is required for this subscription: it is delivered to its endpoint "
                         "with its credentials, read from the worker's secrets.dir (set in the worker.yaml)")
    check_secrets(sub, secret_store(settings))


@dataclasses.dataclass
class OperatorDelivery:
    ctx: DeliveryContext
    client: pulsar_async.Client  # the operator's Pulsar client (dead letters, reads)
    layout: int  # the Redis layout its attempt records follow


@asynccontextmanager
async def operator_delivery(settings: Settings, pulsar: PulsarSettings, redis: AsyncClient, worker_id: str,
                            shared: pulsar_async.Client | None = None) -> AsyncIterator[OperatorDelivery]:
    """A delivery context like a worker's (`worker_id` names the deliverer in the attempt log), on the
    caller's Pulsar client (`shared`, kept open: the admin process's one) or one of its own."""
    secrets = secret_store(settings)
    pipeliner = Pipeliner(redis)
    client = shared or pulsar_adapter.make_client(pulsar, pulsar.service_url or "", operator=True)
    deliverer = Deliverer(settings.destinations)
    store = AttemptStore(pipeliner, settings.redis)
    state = await layout.current(redis)
    # Read once: an operator's delivery is one message or a redrive, not a worker following a switch.
    store.set_layout(state.layout, state.layout_1_until(settings.redis.attempts_ttl_seconds))
    metrics = Metrics()
    ctx = DeliveryContext(deliverer, store, DeadLetterPublisher(client), metrics,
                          secrets, worker_id=worker_id, tokens=Tokens(secrets, settings.oidc),
                          max_held_bytes=settings.max_held_bytes_per_subscription,
                          tracer=telemetry.start(settings.tracing, metrics))  # a replay's attempts, traced too
    try:
        yield OperatorDelivery(ctx, client, state.layout)
    finally:
        if ctx.tracer is not None:
            await ctx.tracer.close()  # bounded: a collector that is down is not waited for
        await ctx.dead_letters.close()
        await ctx.attempts.close()
        if shared is None:
            await asyncio.wait_for(client.close(), timeout=5.0)
        await pipeliner.close()
        await deliverer.close()
