"""A plain synchronous Pulsar client for tests: publish and read topics."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import pulsar

from worker.core.messages import format_message_id


def quiet_logger() -> Any:
    return pulsar.ConsoleLogger(pulsar.LoggerLevel.Error)


class Client:
    """A plain synchronous Pulsar client for tests: publish and read topics."""

    def __init__(self, url: str) -> None:
        self.client = pulsar.Client(url, logger=quiet_logger(), operation_timeout_seconds=10)

    def publish(self, topic: str, payloads: list[bytes], properties: dict[str, str] | None = None,
                key: str | None = None) -> list[str]:
        producer = self.client.create_producer(topic, batching_enabled=False)
        ids = []
        for p in payloads:
            kwargs: dict[str, Any] = {"properties": properties or {}}
            if key is not None:
                kwargs["partition_key"] = key
            mid = producer.send(p, **kwargs)
            ids.append(format_message_id(mid))
        producer.close()
        return ids

    def watch(self, topic: str) -> pulsar.Consumer:
        """Subscribe before anything is published there, so nothing is missed."""
        return self.client.subscribe(topic, "inspector-" + uuid.uuid4().hex[:6],
                                     initial_position=pulsar.InitialPosition.Earliest)

    @staticmethod
    def drain(consumer: pulsar.Consumer, expected: int, timeout: float = 30.0) -> list[pulsar.Message]:
        return Client._read_until(consumer, lambda out: len(out) >= expected, timeout)

    @staticmethod
    def drain_originals(consumer: pulsar.Consumer, ids: set[str], timeout: float = 60.0) -> list[pulsar.Message]:
        """Read a dead-letter topic until every original id in `ids` was seen (duplicates allowed:
        a crash between the confirmed dead-letter publish and the ack republishes once more)."""
        seen: set[str] = set()

        def every_one(out: list[pulsar.Message]) -> bool:
            if out:
                seen.add(out[-1].properties().get("pubsub.original_message_id", ""))
            return ids <= seen

        return Client._read_until(consumer, every_one, timeout)

    @staticmethod
    def _read_until(consumer: pulsar.Consumer, enough: Callable[[list[pulsar.Message]], bool],
                    timeout: float) -> list[pulsar.Message]:
        """Receive and acknowledge until `enough` of what was read, or `timeout`."""
        out: list[pulsar.Message] = []
        deadline = time.monotonic() + timeout
        while not enough(out) and time.monotonic() < deadline:
            try:
                msg = consumer.receive(timeout_millis=200)
            except pulsar.Timeout:
                continue
            consumer.acknowledge(msg)
            out.append(msg)
        return out

    def close(self) -> None:
        self.client.close()
