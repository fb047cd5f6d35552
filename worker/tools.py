"""Small helpers: publish a message (operators), serve a local endpoint (demo, soak)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pulsar
from aiohttp import web

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
        return format_message_id(mid.ledger_id(), mid.entry_id(), mid.partition(), mid.batch_index())
    finally:
        client.close()


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def serve_local(path: str, handler: Handler) -> tuple[web.AppRunner, int]:
    """A real HTTP endpoint on a free loopback port answering POST `path`; (runner to clean up, port)."""
    app = web.Application()
    app.router.add_post(path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
