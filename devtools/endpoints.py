"""A real local HTTP endpoint for the demo and the soak."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

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
