"""`push-worker publish`: one message, for trying things out."""

from __future__ import annotations

import pulsar

from worker.consumer import quiet_logger
from worker.messages import format_message_id


def publish(url: str, topic: str, data: bytes, attributes: dict[str, str], key: str | None = None,
            timeout_seconds: int = 10) -> str:
    """Publish one message and return its id in the contract's format."""
    client = pulsar.Client(url, operation_timeout_seconds=timeout_seconds, logger=quiet_logger())
    try:
        producer = client.create_producer(topic, batching_enabled=False)
        kwargs: dict[str, object] = {"properties": attributes}
        if key is not None:
            kwargs["partition_key"] = key
        mid = producer.send(data, **kwargs)
        return format_message_id(mid)
    finally:
        client.close()
