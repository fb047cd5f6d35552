"""The worker's own HTTP listener: /metrics for Prometheus, /healthz (alive), /readyz (serving), and
the OIDC issuer's public keys (/.well-known/jwks.json, /.well-known/openid-configuration)."""

from __future__ import annotations

import os
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics

from worker.runtime.errors import StartupError

ReadyCheck = Callable[[], Awaitable[tuple[bool, str]]]


class Exposed(Protocol):
    """Metrics on a registry of their own (a worker's, or the admin process's)."""

    registry: CollectorRegistry

AliveCheck = Callable[[], tuple[bool, str]]


async def listen(runner: web.AppRunner, host: str, port: int, section: str, hint: str,
                 ssl_context: ssl.SSLContext | None = None) -> int:
    """Serve `runner` on host:port; the port bound (0 asks for any free one). A port that cannot be
    had is a StartupError naming the config `section` and what to do (`hint`)."""
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    try:
        await site.start()
    except OSError as e:
        why = os.strerror(e.errno) if e.errno else str(e)
        raise StartupError(f"{section}: cannot listen on {host}:{port} ({why}): {hint}") from None
    sockets = getattr(site._server, "sockets", None) or []
    return int(sockets[0].getsockname()[1]) if sockets else port


class PublishedKeys(Protocol):
    """The fleet's OIDC issuer, as the world may see it (`endpoint.oidc.Tokens` fits)."""

    def jwks(self) -> dict[str, Any]: ...
    def discovery(self) -> dict[str, Any] | None: ...  # the discovery document; None: no issuer


class StatusServer:
    """Serves metrics and probes; `port` is the bound port (useful when configured as 0)."""

    def __init__(self, host: str, port: int, metrics: Exposed, ready: ReadyCheck,
                 alive: AliveCheck | None = None, tokens: PublishedKeys | None = None) -> None:
        self.host, self.port = host, port
        self.metrics = metrics
        self.ready = ready
        self.alive = alive or (lambda: (True, "ok"))
        self.tokens = tokens
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/.well-known/jwks.json", self._jwks)
        app.router.add_get("/.well-known/openid-configuration", self._openid_configuration)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        try:
            self.port = await listen(self._runner, self.host, self.port,
                                     "http", "choose http.port or $PUSH_WORKER_HTTP_PORT (0: any free port)")
        except StartupError:
            await self.close()
            raise

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _metrics(self, request: web.Request) -> web.Response:
        # OpenMetrics to a scraper that asks for it (Prometheus does): the one format with exemplars,
        # which link a latency observation to its trace.
        if "application/openmetrics-text" in request.headers.get("Accept", ""):
            return web.Response(body=openmetrics.generate_latest(self.metrics.registry),  # type: ignore[no-untyped-call]
                                headers={"Content-Type": openmetrics.CONTENT_TYPE_LATEST})
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, _: web.Request) -> web.Response:
        ok, reason = self.alive()
        return web.json_response({"status": "ok" if ok else "failing", "reason": reason}, status=200 if ok else 503)

    async def _readyz(self, _: web.Request) -> web.Response:
        ok, reason = await self.ready()
        return web.json_response({"ready": ok, "reason": reason}, status=200 if ok else 503)

    async def _jwks(self, _: web.Request) -> web.Response:
        """The fleet's OIDC public keys (the worker setting `oidc`; none without it)."""
        if self.tokens is None:
            return web.json_response({"keys": []})
        return web.json_response(self.tokens.jwks(), headers={"Cache-Control": "max-age=300"})

    async def _openid_configuration(self, _: web.Request) -> web.Response:
        """The discovery document of the fleet's issuer, whose keys this worker serves."""
        document = self.tokens.discovery() if self.tokens is not None else None
        if document is None:
            return web.json_response({"error": "no OIDC issuer is configured (the worker setting oidc)"}, status=404)
        return web.json_response(document)
