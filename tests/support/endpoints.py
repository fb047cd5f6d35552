"""Real HTTP endpoints for tests: aiohttp servers on free loopback ports that record what they receive."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Received:
    """One request as the endpoint saw it."""

    headers: dict[str, str]
    body: bytes
    at: float
    status: int | None = None  # what the endpoint answered, once it has
    path: str = ""  # the request's path

    @property
    def acked(self) -> bool:
        return self.status is not None and (self.status == 102 or 200 <= self.status < 300)

    @property
    def body_payload(self) -> bytes:
        """The message payload, whichever content mode carried it."""
        if self.headers.get("Content-Type") == "application/json":
            import base64
            import json

            return base64.b64decode(json.loads(self.body)["message"]["data"])
        return self.body


@dataclass
class Endpoint:
    """A real aiohttp server. `behaviour(request_record) -> web.Response` decides each answer."""

    url: str = ""
    requests: list[Received] = field(default_factory=list)
    behaviour: Callable[[Received], Awaitable[web.StreamResponse] | web.StreamResponse] | None = None

    def by_id(self) -> dict[str, list[Received]]:
        out: dict[str, list[Received]] = {}
        for r in self.requests:
            out.setdefault(r.headers["Pubsub-Message-Id"], []).append(r)
        return out


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def serve(path: str, handler: Handler, method: str = "POST",
                host: str = "127.0.0.1") -> tuple[web.AppRunner, str]:
    """A real aiohttp server on a free loopback port (of `host`) answering `method` (`*`: any) on
    `path`; returns (runner, url)."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route(method, path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://{host}:{port}{path.replace('{tail:.*}', 'push')}"


async def catcher(host: str) -> tuple[web.AppRunner, str, list[Received]]:
    """A listener on `host` (any loopback address) that records whatever reaches it: a leak, in a
    test where nothing should; returns (runner, url, what it received)."""
    got: list[Received] = []

    async def handle(request: web.Request) -> web.Response:
        got.append(Received(dict(request.headers), await request.read(), time.monotonic(), 204))
        return web.Response(status=204)

    runner, url = await serve("/{tail:.*}", handle, "*", host)
    return runner, url, got


class ConcurrencyProbe:
    """An endpoint behaviour that answers 204 after `seconds` and records the most requests it held at once."""

    def __init__(self, seconds: float = 0.05) -> None:
        self.seconds = seconds
        self.current = 0
        self.peak = 0

    async def __call__(self, received: Received) -> web.Response:
        self.current += 1
        self.peak = max(self.peak, self.current)
        try:
            await asyncio.sleep(self.seconds)
        finally:
            self.current -= 1
        return web.Response(status=204)
