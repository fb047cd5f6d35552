"""Dead-letter publishing: a message that exhausted its attempts is republished, confirmed by the
broker, before the original is acked. One cached producer per dead-letter topic."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pulsar
import pulsar.asyncio as pulsar_async
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential_jitter

from worker.broker.consumer import broker_error_text
from worker.core.messages import Envelope
from worker.runtime.aio import wait_event
from worker.runtime.failing import Failing

BrokerError = (pulsar_async.PulsarException, OSError, asyncio.TimeoutError)
# A durable subscription the fleet keeps on every dead-letter topic: it retains dead letters even when
# nothing else subscribes (a topic without subscriptions keeps no backlog), and it is the cursor
# `push-worker dlq list|show|redrive` works on.
DLQ_CURSOR = "push-worker-dlq"


async def subscribe_cursor(client: pulsar_async.Client, topic: str, queue: int = 1,
                           consumer_name: str | None = None) -> pulsar_async.Consumer:
    """A consumer on the fleet's cursor of a dead-letter topic (always Shared: one type per cursor)."""
    kwargs: dict[str, object] = {"consumer_name": consumer_name} if consumer_name else {}
    return await client.subscribe(topic, DLQ_CURSOR, consumer_type=pulsar.ConsumerType.Shared,
                                  initial_position=pulsar.InitialPosition.Earliest, receiver_queue_size=queue,
                                  **kwargs)


async def ensure_cursor(client: pulsar_async.Client, topic: str) -> None:
    """Create the fleet's cursor on a dead-letter topic (a no-op when it exists)."""
    consumer = await subscribe_cursor(client, topic)
    await asyncio.wait_for(consumer.close(), timeout=5.0)


class DeadLetterPublisher:
    """Publishes to dead-letter topics; `publish` returns only once the broker confirmed."""

    def __init__(self, client: pulsar_async.Client) -> None:
        self.client = client
        self._producers: dict[str, pulsar_async.Producer] = {}
        self._lock = asyncio.Lock()
        # One publish in flight per topic: a broker that dies after storing a publish but before
        # confirming it gets that publish again from the client when it is back (no deduplication
        # on pulsar-lite, nor on Apache Pulsar unless enabled). Measured on pulsar-lite: 17-41 of 60
        # dead letters doubled with publishes in parallel; one at a time bounds it to one per crash.
        self._in_flight: dict[str, asyncio.Lock] = {}

    async def _producer(self, topic: str) -> pulsar_async.Producer:
        async with self._lock:
            producer = self._producers.get(topic)
            if producer is None:
                await ensure_cursor(self.client, topic)
                # Compressed (zstd): a payload that came compressed and inflates past any request's
                # size (a "bomb" of a few KiB that inflates to hundreds of MiB) is stored about as small
                # as it came, not inflated. Chunking: a message still over the broker's size limit came
                # in chunks and must go out so (without it the broker refuses it, MessageTooBig, for
                # ever); smaller ones go whole.
                producer = await self.client.create_producer(topic, batching_enabled=False, chunking_enabled=True,
                                                             compression_type=pulsar.CompressionType.ZSTD)
                self._producers[topic] = producer
            return producer

    async def publish(self, dl_topic: str, env: Envelope, properties: dict[str, str],
                      on_failure: Callable[[BaseException], None] | None = None,
                      stop: asyncio.Event | None = None) -> bool:
        """Publish until confirmed (True), retrying broker errors and telling `on_failure` of each.
        False when `stop` was set while a retry waited: the original stays unacked, the broker
        redelivers it, and since its attempts are spent its next owner dead-letters it unsent."""
        stopping = stop or asyncio.Event()

        async def pause(seconds: float) -> None:  # cut short by the stop
            await wait_event(stopping, seconds)

        def failed(state: RetryCallState) -> None:
            error = state.outcome.exception() if state.outcome is not None else None
            if on_failure is not None and error is not None:
                on_failure(error)

        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(BrokerError),
                stop=lambda _: stopping.is_set(),
                wait=wait_exponential_jitter(multiplier=0.2, max=5.0),
                sleep=pause,
                before_sleep=failed,
                reraise=True,
            ):
                if stopping.is_set() and attempt.retry_state.attempt_number > 1:
                    return False  # woken from the wait by the stop: no further try
                with attempt:
                    producer = await self._producer(dl_topic)
                    kwargs: dict[str, object] = {"properties": properties}
                    if env.ordering_key is not None:
                        kwargs["partition_key"] = env.ordering_key
                    async with self._in_flight.setdefault(dl_topic, asyncio.Lock()):
                        await producer.send(env.data, **kwargs)
        except BrokerError:
            if stopping.is_set():
                return False
            raise
        return True

    async def forget(self, topic: str) -> None:
        """Close and drop the producer of a topic no longer used."""
        async with self._lock:
            producer = self._producers.pop(topic, None)
            self._in_flight.pop(topic, None)
        if producer is not None:
            # Bounded: a close the client never confirms must not hold up a shutdown.
            await asyncio.gather(asyncio.wait_for(producer.close(), timeout=5.0), return_exceptions=True)

    @staticmethod
    def failures(log: Any, count: Callable[[], None]) -> Failing:
        """A tracker of one subscription's failing publishes (`failing_publishes`)."""
        return failing_publishes(log, count)

    async def close(self) -> None:
        for topic in list(self._producers):
            await self.forget(topic)


def failing_publishes(log: Any, count: Callable[[], None]) -> Failing:
    """One subscription's dead-letter publishes while they fail (a dead-letter topic whose namespace
    does not exist, a missing permission, a broker outage): exhausted messages pile up unacked."""
    return Failing(log, "dead-letter publish", "exhausted messages wait unacked", count, broker_error_text)
