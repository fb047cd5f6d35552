"""The admin listener (`admin: {host, port}`): the operator API (`/v1`, routes.py) and the console
(`/console/`, console.py) on a listener of their own, never the probes' and metrics' one. Any
worker of the fleet answers alike: everything shown is read from Redis and the broker.

Every answer carries headers that keep a browser from running or framing anything of it elsewhere
(a strict Content-Security-Policy: no script at all, styles from this listener only), errors are
one line of JSON (or a page in the console) and never a traceback.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

import aiohttp
from aiohttp import web

from worker.api.auth import Authenticator, Unauthorized
from worker.api.console import Console
from worker.api.limits import HEADER_SECONDS, MAX_CONNECTIONS, CallerLimits, CappedRunner, TooMany
from worker.api.metrics import AdminMetrics
from worker.api.operations import Conflict, Operations
from worker.api.routes import PRINCIPAL, Api, Forbidden, Handler, LimitedAudit, audit
from worker.fleet.layout import LayoutTooNew
from worker.model.admin_settings import AdminSettings
from worker.model.config import Settings
from worker.ops.explain import explain
from worker.ops.replay import DeadLetter, ReadTooSlow, StillDelivering
from worker.runtime import logs
from worker.runtime.errors import ConfigError, NotFound, StartupError
from worker.runtime.http_server import listen

MAX_BODY_BYTES = 64 * 1024  # a definition is at most 16 KiB as JSON
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
                               "frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def answer_for(error: BaseException) -> tuple[int, str]:
    """The status and the one line a caller gets for `error`."""
    # ConfigError: a bad definition, argument or body
    for kind, status in ((Unauthorized, 401), (Forbidden, 403), (NotFound, 404), (Conflict, 409),
                         (StillDelivering, 409), (DeadLetter, 409), (LayoutTooNew, 409), (ConfigError, 400)):
        if isinstance(error, kind):
            return status, " ".join(str(error).split())[:300]
    if isinstance(error, ReadTooSlow):
        return 503, str(error)
    text = explain(error)[1]  # Redis or the broker failing: what failed and what to check
    return (500, text) if text.startswith("unexpected error") else (503, text)


def unavailable(text: str) -> str:
    """What a caller is told of a failing Redis or broker: which one, never where it is (hosts,
    ports and URLs stay in the admin process's log)."""
    what = "Redis" if text.startswith("redis") else "the broker" if "broker" in text else "a service"
    return f"{what} is not answering: try again shortly (the admin process's log has the details)"


class SlowBody(Exception):
    """A request body that did not arrive within the bound a request head has."""


async def read_body_within(request: web.Request, seconds: float) -> None:
    """Read the whole body now, within `seconds` (held by aiohttp for the handler's json()/post()): a
    body trickling in a byte at a time held its connection for as long as the sender liked."""
    if not request.body_exists:
        return
    try:
        await asyncio.wait_for(request.read(), seconds)
    except TimeoutError:
        raise SlowBody(f"the request body did not arrive within {seconds:g} s") from None


def bearer(request: web.Request) -> str:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


class AdminServer:
    def __init__(self, settings: AdminSettings, worker_settings: Settings, redis_url: str, pulsar_url: str,
                 metrics: AdminMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or AdminMetrics()
        self.ops = Operations(worker_settings, redis_url, pulsar_url)
        self.port = settings.port
        self.log = logs.get()
        self._runner: web.AppRunner | None = None
        self.limits = CallerLimits()
        self.limited_audit = LimitedAudit()
        self._session: aiohttp.ClientSession | None = None

    @property
    def tls(self) -> bool:
        return self.settings.tls_cert_file is not None

    async def start(self) -> None:
        # Its own session: the broker's (with the Pulsar token) must never go to the identity provider.
        self._session = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar())
        self.auth = Authenticator(self.settings, self._session)
        app = web.Application(middlewares=[self._guard], client_max_size=MAX_BODY_BYTES)
        Api(self.ops).add_routes(app)
        Console(self.ops, self.auth, secure_cookie=self.tls, on_failed_login=self.metrics.refused_anonymous.inc,
                grafana_url=self.settings.grafana_url, refresh_seconds=self.settings.refresh_seconds).add_routes(app)
        self._runner = CappedRunner(app, MAX_CONNECTIONS, self.metrics.limited.labels("connections").inc,
                                    access_log=None)
        await self._runner.setup()
        context = None
        if self.tls:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            try:
                context.load_cert_chain(str(self.settings.tls_cert_file), str(self.settings.tls_key_file))
            except (OSError, ssl.SSLError) as e:
                await self.close()
                raise StartupError(f"admin.tls: cannot load the certificate and key ({e})") from None
        try:
            self.port = await listen(self._runner, self.settings.host, self.settings.port, "admin",
                                     "choose admin.port (0: any free port)", context)
        except StartupError:
            await self.close()
            raise
        if not self.tls and self.settings.host not in ("127.0.0.1", "::1", "localhost"):
            self.log.warning("admin listener without TLS: tokens cross the network in clear unless a TLS proxy or "
                             "ingress sits in front (admin.tls)", host=self.settings.host, port=self.port)
        self.log.info("admin listener started", host=self.settings.host, port=self.port, tls=self.tls)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        await self.ops.close()

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            await read_body_within(request, HEADER_SECONDS)
            response = await self._authenticated(request, handler)
        except SlowBody as e:
            response = self._error(request, 408, str(e))
            response.force_close()  # the connection goes with it: a slow sender holds nothing
        except TooMany as e:
            self.metrics.limited.labels(e.limit).inc()
            if PRINCIPAL in request:
                self.limited_audit.limited(request[PRINCIPAL], e.limit, f"{request.method} {request.path}"[:200])
            response = self._error(request, 429, str(e))
            response.headers["Retry-After"] = str(e.retry_after)
        except web.HTTPRedirection as e:  # the console's redirects (after a form, to the login page)
            response = web.Response(status=e.status, headers={"Location": e.headers.get("Location", "/console/")})
        except web.HTTPException as e:  # aiohttp's own (404 of an unknown path, 405, 413): as JSON or a page
            response = self._error(request, e.status, e.reason)
            self._audit_refusal(request, e.status, e.reason)
        except Exception as e:
            status, text = answer_for(e)
            if not getattr(e, "audited", False):
                self._audit_refusal(request, status, text)
            if status == 500:
                self.log.exception("admin request failed", path=request.path)
                text = "internal error (the admin process's log has the details)"
            elif status == 503:
                self.log.warning("admin request failed", path=request.path, reason=text)
                text = unavailable(text)
            elif status == 401:  # counted, not logged: an anonymous flood must not flood the log
                self.metrics.refused_anonymous.inc()
                text = "a valid bearer token is required"
            response = self._error(request, status, text)
        self._without_paths(response)
        response.headers.update(SECURITY_HEADERS)
        self.metrics.requests.labels(f"{response.status // 100}xx").inc()
        return response

    def _without_paths(self, response: web.StreamResponse) -> None:
        """Where the process reads project secrets is none of a caller's business: a secret's error
        (in an answer, a status, an attempt's detail) names it `[secrets.dir]`."""
        where = self.ops.secrets_dir.encode()
        if where and isinstance(response, web.Response) and isinstance(response.body, bytes) \
                and where in response.body:
            response.body = response.body.replace(where, b"[secrets.dir]")

    @staticmethod
    def _audit_refusal(request: web.Request, status: int, text: str) -> None:
        """One audit line for a request refused to a known caller (its role, the project's scope, a
        stale form, another site's Origin, a bad body, no confirmation); anonymous ones are counted."""
        principal = request.get(PRINCIPAL)
        if principal is None or not 400 <= status < 500 or status == 429:
            return
        match = request.match_info
        route = match.route.resource.canonical if match.route.resource is not None else request.path
        audit(principal, match.get("project", "-"), f"{request.method} {route}"[:200], match.get("name", "-"),
              f"refused: {status} {text}"[:300])

    async def _authenticated(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if path == "/v1/openapi.json" or path.startswith("/console/static/") or path == "/console/login":
            return await handler(request)
        if path.startswith("/console"):
            token = request.cookies.get(Console.COOKIE, "")
            try:
                request[PRINCIPAL] = await self.auth.principal(token)
            except Unauthorized:
                raise web.HTTPFound("/console/login") from None
        else:
            request[PRINCIPAL] = await self.auth.principal(bearer(request))
        with self.limits.admit(request[PRINCIPAL].caller):
            return await handler(request)

    def _error(self, request: web.Request, status: int, text: str) -> web.StreamResponse:
        if request.path.startswith("/console"):
            return Console.error_page(status, text)
        codes = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "not_allowed",
                 408: "timeout", 409: "conflict", 413: "too_large", 429: "too_many_requests", 500: "internal",
                 503: "unavailable"}
        headers: dict[str, Any] = {"WWW-Authenticate": "Bearer"} if status == 401 else {}
        response = web.json_response({"error": {"code": codes.get(status, "error"), "message": text}},
                                     status=status)
        response.headers.update(headers)
        return response
