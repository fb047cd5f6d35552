"""`push-worker publish`: one message, for trying things out."""

from __future__ import annotations

import pulsar

from worker.config import PulsarSettings
from worker.consumer import client_options
from worker.messages import format_message_id


def publish(settings: PulsarSettings, url: str, topic: str, data: bytes, attributes: dict[str, str],
            key: str | None = None, timeout_seconds: int = 10) -> str:
    """Publish one message and return its id in the contract's format. The client is the worker's
    (its token and TLS trust), with a short timeout."""
    options = client_options(settings, operator=True) | {"operation_timeout_seconds": timeout_seconds}
    client = pulsar.Client(url, **options)
    try:
        producer = client.create_producer(topic, batching_enabled=False)
        kwargs: dict[str, object] = {"properties": attributes}
        if key is not None:
            kwargs["partition_key"] = key
        mid = producer.send(data, **kwargs)
        return format_message_id(mid)
    finally:
        client.close()
