"""`push-worker publish`: one message, for trying things out."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import pulsar

from worker.broker.consumer import client_options
from worker.core.messages import format_message_id
from worker.model.config import PulsarSettings
from worker.runtime.errors import InfrastructureError, strip_userinfo

CONNECT_SECONDS = 3.0  # a broker that does not take a connection within this is said at once


def reachable(url: str, seconds: float) -> None:
    """Raise, naming the URL, unless the broker takes a TCP connection within `seconds`: the client
    keeps retrying a refused connection until its operation timeout, and then says only `Timeout`."""
    parts = urlsplit(url)
    port = parts.port or (6651 if parts.scheme == "pulsar+ssl" else 6650)
    try:
        socket.create_connection((parts.hostname or "localhost", port), timeout=seconds).close()
    except OSError as e:
        reason = "no answer" if isinstance(e, TimeoutError) else (e.strerror or type(e).__name__).lower()
        raise InfrastructureError(f"the broker failed: no connection to {strip_userinfo(url)} within {seconds:g} s "
                                  f"({reason}); check --service-url, pulsar.service_url or $PUSH_WORKER_PULSAR_URL "
                                  "and that the broker is running") from None


def publish(settings: PulsarSettings, url: str, topic: str, data: bytes, attributes: dict[str, str],
            key: str | None = None, timeout_seconds: int = 10, connect_seconds: float = CONNECT_SECONDS) -> str:
    """Publish one message and return its id in the contract's format. The client is the worker's
    (its token and TLS trust), with a short timeout."""
    reachable(url, connect_seconds)
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
