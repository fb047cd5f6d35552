"""The operator API, `/v1/...`: JSON over HTTP, described by `/v1/openapi.json` (openapi.yaml).

Authentication is a bearer token in the Authorization header, never a cookie: a page of another
site cannot make a browser send one, so the API needs no CSRF defence of its own (the console's
forms have theirs, console.py). A project the caller has no role on answers 404, exactly as a
project that does not exist: the API never confirms that another project's subscriptions exist.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from functools import cache
from importlib import resources
from typing import Any

import yaml
from aiohttp import web

from worker.api.auth import Principal
from worker.api.operations import MESSAGE_STATES, NO_SUCH_PROJECT, Operations, for_viewer
from worker.core.messages import parse_message_id
from worker.fleet.seek import SeekTarget
from worker.ops.delivery_log import MAX_LIMIT as LOG_MAX_LIMIT
from worker.ops.delivery_log import STATUS_CLASSES, LogQuery
from worker.ops.dlq import Selection
from worker.runtime import logs
from worker.runtime.errors import ConfigError, NotFound, UsageError
from worker.runtime.fields import parse_moment

ACTIONS = ("pause", "resume", "seek", "purge", "redrive", "discard")
MAX_LIMIT = 1000
MAX_WAIT_SECONDS = 120.0
MAX_REDRIVE_RATE = 1000.0
MESSAGE_ID_MAX = 200

PRINCIPAL = web.RequestKey("principal", Principal)  # who is asking (server.py sets it)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Forbidden(Exception):
    """The caller sees the project but its role does not allow the action: 403."""


@cache
def openapi_document() -> dict[str, Any]:
    text = resources.files("worker.api").joinpath("openapi.yaml").read_text("utf-8")
    return dict(yaml.safe_load(text))


def audit(principal: Principal, project: str, action: str, target: str, result: str) -> None:
    """One line per change (or attempted change), for whoever keeps the audit trail."""
    logs.get("push-worker.audit").info("audit", subject=principal.subject, via=principal.via, project=project,
                                       action=action, target=target, result=result)


class LimitedAudit:
    """Requests refused for a caller's rate or concurrency (429), audited one line a second per caller
    at most, with how many it stands for: a flood must not flood the log, nor go unseen."""

    FORGET_AFTER = 1000  # callers remembered; past it the table starts over (a line more at worst)

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.callers: dict[str, tuple[float, int]] = {}  # caller -> (next line's time, refusals unsaid)

    def limited(self, principal: Principal, limit: str, route: str) -> None:
        now = self.clock()
        next_at, unsaid = self.callers.get(principal.caller, (0.0, 0))
        unsaid += 1
        if now < next_at:
            self.callers[principal.caller] = (next_at, unsaid)
            return
        if len(self.callers) >= self.FORGET_AFTER:
            self.callers.clear()
        self.callers[principal.caller] = (now + 1.0, 0)
        logs.get("push-worker.audit").info("audit", subject=principal.subject, via=principal.via, project="-",
                                           action=route, target="-", result=f"refused: 429 ({limit})",
                                           refusals=unsaid)


class FailedLogins:
    """Failed console logins, one audit line a second at most (with how many it stands for): a
    guessing script must not flood the log, nor go unseen."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.next_at = 0.0
        self.unsaid = 0

    def failed(self, peer: str) -> None:
        self.unsaid += 1
        now = self.clock()
        if now < self.next_at:
            return
        self.next_at = now + 1.0
        logs.get("push-worker.audit").info("audit", subject="-", project="-", action="console login", target=peer,
                                           result="refused: not a valid token", failures=self.unsaid)
        self.unsaid = 0


def principal_of(request: web.Request) -> Principal:
    return request[PRINCIPAL]


def project_seen(request: web.Request) -> tuple[Principal, str]:
    """The caller and the path's project, which it must have a role on (else: not found)."""
    principal = principal_of(request)
    project = request.match_info["project"]
    if not principal.grants.sees(project):
        raise NotFound(NO_SUCH_PROJECT)
    return principal, project


def may_act(principal: Principal, project: str) -> None:
    if not principal.grants.acts_on(project):
        raise Forbidden(f"your role on {project} is viewer: it reads, it does not act")


def _int(request: web.Request, name: str, default: int, high: int = MAX_LIMIT) -> int:
    return _int_of(request.query, name, default, high)


def _int_of(query: Any, name: str, default: int, high: int = MAX_LIMIT) -> int:
    text = query.get(name) or None  # an empty form field: the default
    if text is None:
        return default
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= high:  # ASCII: '²' is a digit too
        raise UsageError("query", name, f"must be a whole number from 1 to {high}")
    return int(text)


def stream_id(text: str) -> bool:
    """Whether `text` is a Redis stream entry id (`ms-seq`, each below 2^64, in ASCII digits):
    anything else made Redis refuse the read, said as Redis not answering."""
    match = re.fullmatch(r"([0-9]{1,20})-([0-9]{1,20})", text)
    return match is not None and all(int(part) < 1 << 64 for part in match.groups())


def _message_id(request: web.Request) -> str:
    value = request.match_info["message_id"]
    if parse_message_id(value) is None:
        raise NotFound("no such message (ids look like ledger:entry:partition:batch)")
    return value


async def _body(request: web.Request) -> dict[str, Any]:
    if not request.body_exists:
        return {}
    if request.content_type != "application/json":
        raise UsageError("body", "Content-Type", "must be application/json")
    try:
        data = json.loads(await request.read())
    except ValueError:
        raise UsageError("body", "JSON", "is not valid JSON") from None
    except RecursionError:
        raise UsageError("body", "JSON", "is nested too deep") from None
    if not isinstance(data, dict):
        raise UsageError("body", "JSON", "must be an object")
    return data


def payload_download(data: bytes, message_id: str) -> web.Response:
    """A payload as a file to save (never shown inline: it is the project's data, not a page)."""
    return web.Response(body=data, content_type="application/octet-stream", headers={
        "Content-Disposition": f'attachment; filename="{re.sub(r"[^0-9A-Za-z-]", "_", message_id)}.bin"'})


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, dumps=lambda d: json.dumps(d, default=str))


def moment_of(value: Any, name: str) -> int:
    try:
        return parse_moment(str(value))
    except ValueError as e:
        raise UsageError("body", name, str(e)) from None


def seek_target(value: Any) -> SeekTarget:
    if value in ("earliest", "latest"):
        return SeekTarget(str(value))
    if not isinstance(value, str | int) or isinstance(value, bool):
        raise UsageError("body", "to", "must be earliest, latest, or an RFC 3339 time")
    return SeekTarget(moment_of(value, "to"))


def selection_of(body: dict[str, Any]) -> Selection:
    statuses = body.get("status") or []
    if isinstance(statuses, str):
        statuses = [statuses]
    if not isinstance(statuses, list) or not all(isinstance(s, str) and s for s in statuses):
        raise UsageError("body", "status", "must be a list like [\"5xx\", \"timeout\"]")
    return Selection(moment_of(body["since"], "since") if body.get("since") is not None else None,
                     moment_of(body["until"], "until") if body.get("until") is not None else None,
                     tuple(statuses))


def log_query(query: Any) -> LogQuery:
    """A delivery log search from query parameters (the API's and the console's form alike)."""
    def text(name: str, longest: int) -> str:
        value = str(query.get(name, "")).strip()
        if len(value) > longest or not value.isprintable():
            raise UsageError("query", name, f"must be printable text of at most {longest} characters")
        return value

    def moment(name: str) -> int | None:
        value = text(name, 64)
        if not value:
            return None
        try:
            return parse_moment(value)
        except ValueError as e:
            raise UsageError("query", name, str(e)) from None

    status = text("status", 32)
    if status and status not in STATUS_CLASSES and not (len(status) == 3 and status.isdigit()):
        raise UsageError("query", "status", f"must be one of {', '.join(STATUS_CLASSES)}, or a status like 503")
    cursor = text("cursor", 48)
    if cursor and not stream_id(cursor):
        raise UsageError("query", "cursor", "must be a next_cursor a search answered")
    return LogQuery(message_id=text("message_id", MESSAGE_ID_MAX), since_ms=moment("since"), until_ms=moment("until"),
                    status=status, min_attempt=_int_of(query, "min_attempt", 1, 1_000_000),
                    ordering_key=text("ordering_key", 256), limit=_int_of(query, "limit", 50, LOG_MAX_LIMIT),
                    cursor=cursor)


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise UsageError("body", name, f"must be a number from {low:g} to {high:g}")
    return float(value)


class Api:
    """The `/v1` handlers; each one checks the caller's role, then asks `Operations`."""

    def __init__(self, ops: Operations) -> None:
        self.ops = ops

    def add_routes(self, app: web.Application) -> None:
        sub = "/v1/projects/{project}/subscriptions/{name}"
        app.router.add_get("/v1/openapi.json", self.openapi)
        app.router.add_get("/v1/me", self.me)
        app.router.add_get("/v1/projects", self.projects)
        app.router.add_get("/v1/projects/{project}/subscriptions", self.list)
        app.router.add_post("/v1/projects/{project}/subscriptions", self.create)
        app.router.add_get(sub, self.get)
        app.router.add_patch(sub, self.patch)
        app.router.add_delete(sub, self.delete)
        app.router.add_get(sub + "/messages", self.messages)
        app.router.add_get(sub + "/messages/{message_id}", self.message)
        app.router.add_get(sub + "/messages/{message_id}/payload", self.payload)
        app.router.add_post(sub + "/messages/{message_id}/replay", self.replay)
        app.router.add_get(sub + "/history", self.history)
        app.router.add_get(sub + "/log", self.log)
        app.router.add_get(sub + "/log/hours", self.log_hours)
        app.router.add_get(sub + "/dead-letters/{message_id}", self.dead_letter)
        for action in ACTIONS:
            app.router.add_post(f"{sub}/{action}", self.act)

    async def openapi(self, _: web.Request) -> web.Response:
        return json_response(openapi_document())

    async def me(self, request: web.Request) -> web.Response:
        principal = principal_of(request)
        return json_response({"subject": principal.subject, "roles": principal.grants.describe()})

    async def projects(self, request: web.Request) -> web.Response:
        return json_response({"projects": await visible_projects(self.ops, principal_of(request))})

    async def list(self, request: web.Request) -> web.Response:
        _, project = project_seen(request)
        return json_response({"project": project, "subscriptions": await self.ops.subscriptions(project)})

    async def get(self, request: web.Request) -> web.Response:
        principal, project = project_seen(request)
        sub = await self.ops.subscription(project, request.match_info["name"])
        return json_response(sub if principal.grants.acts_on(project) else for_viewer(sub))

    async def create(self, request: web.Request) -> web.Response:
        principal, project = project_seen(request)
        may_act(principal, project)
        body = await _body(request)
        name = str(body.get("name", ""))
        with audited(principal, project, "create", name):
            return json_response(await self.ops.create(project, body), status=201)

    async def patch(self, request: web.Request) -> web.Response:
        principal, project = project_seen(request)
        name = request.match_info["name"]
        may_act(principal, project)
        body = await _body(request)
        with audited(principal, project, "patch", name):
            return json_response(await self.ops.patch(project, name, body))

    async def delete(self, request: web.Request) -> web.Response:
        principal, project = project_seen(request)
        name = request.match_info["name"]
        may_act(principal, project)
        with audited(principal, project, "delete", name):
            return json_response(await self.ops.delete(project, name))

    async def messages(self, request: web.Request) -> web.Response:
        _, project = project_seen(request)
        state = request.query.get("state", "retrying")
        if state not in MESSAGE_STATES:
            raise UsageError("query", "state", f"must be one of {', '.join(MESSAGE_STATES)}")
        limit = _int(request, "limit", 100)
        messages = await self.ops.messages(project, request.match_info["name"], state, limit)
        return json_response({"state": state, "messages": messages})

    async def message(self, request: web.Request) -> web.Response:
        principal, project = project_seen(request)
        return json_response(await self.ops.message(project, request.match_info["name"], _message_id(request),
                                                    answers=principal.grants.acts_on(project)))

    async def payload(self, request: web.Request) -> web.Response:
        """The whole payload as bytes (the project's viewers too, as for dead letters: docs/security.md)."""
        _, project = project_seen(request)
        message_id = _message_id(request)
        return payload_download(await self.ops.payload(project, request.match_info["name"], message_id), message_id)

    async def replay(self, request: web.Request) -> web.Response:
        principal, project = project_seen(request)
        name = request.match_info["name"]
        may_act(principal, project)
        message_id = _message_id(request)
        with audited(principal, project, "replay", f"{name} {message_id}"):
            return json_response(await self.ops.replay(project, name, message_id))

    async def history(self, request: web.Request) -> web.Response:
        _, project = project_seen(request)
        limit = _int(request, "limit", 50)
        return json_response({"messages": await self.ops.recent(project, request.match_info["name"], limit)})

    async def log(self, request: web.Request) -> web.Response:
        principal, project = project_seen(request)
        return json_response(await self.ops.log(project, request.match_info["name"], log_query(request.query),
                                                headers=principal.grants.acts_on(project), caller=principal.caller))

    async def log_hours(self, request: web.Request) -> web.Response:
        _, project = project_seen(request)
        return json_response(await self.ops.log_hours(project, request.match_info["name"]))

    async def dead_letter(self, request: web.Request) -> web.Response:
        principal, project = project_seen(request)
        limit = _int(request, "limit", 1000)
        return json_response(await self.ops.dead_letter(project, request.match_info["name"], _message_id(request),
                                                        limit, answers=principal.grants.acts_on(project)))

    async def act(self, request: web.Request) -> web.Response:
        principal, project = project_seen(request)
        name = request.match_info["name"]
        action = request.path.rsplit("/", 1)[1]
        may_act(principal, project)
        body = await _body(request)
        with audited(principal, project, action, name):
            return json_response(await perform(self.ops, project, name, action, body))


async def perform(ops: Operations, project: str, name: str, action: str, body: dict[str, Any]) -> dict[str, Any]:
    """One action on a subscription, with its arguments from a JSON body or a console form."""
    if action in ("pause", "resume"):
        wait = _number(body, "wait_seconds", 30.0, 0.0, MAX_WAIT_SECONDS)
        return await ops.pause(project, name, action == "pause", wait)
    if action == "purge":
        return await ops.purge(project, name)
    if action == "seek":
        if "to" not in body:
            raise UsageError("body", "to", "is required: earliest, latest, or an RFC 3339 time")
        return await ops.seek(project, name, seek_target(body["to"]))
    message_id = body.get("message_id") or None
    if message_id is not None and (not isinstance(message_id, str) or parse_message_id(message_id) is None):
        raise UsageError("body", "message_id", "must be a message id (ledger:entry:partition:batch)")
    if action == "replay":
        if message_id is None:
            raise UsageError("body", "message_id", "is required: the settled message to send again")
        return await ops.replay(project, name, message_id)
    if action == "discard":
        if message_id is None:
            raise UsageError("body", "message_id", "is required: the message to settle without delivery")
        return await ops.discard(project, name, message_id, _number(body, "wait_seconds", 10.0, 0.0,
                                                                    MAX_WAIT_SECONDS))
    max_messages = body.get("max_messages")
    if max_messages is not None and (not isinstance(max_messages, int) or isinstance(max_messages, bool)
                                     or max_messages < 1):
        raise UsageError("body", "max_messages", "must be a whole number of at least 1")
    return await ops.redrive(project, name, message_id=message_id, selection=selection_of(body),
                             max_messages=max_messages, rate=_number(body, "rate", 10.0, 0.1, MAX_REDRIVE_RATE))


async def visible_projects(ops: Operations, principal: Principal) -> list[str]:
    """The projects the caller has a role on (an admin: every project with a subscription)."""
    projects = set(principal.grants.projects)
    if principal.grants.admin:
        projects |= set(await ops.projects())
    return sorted(projects)


@contextlib.contextmanager
def audited(principal: Principal, project: str, action: str, target: str) -> Iterator[None]:
    """Writes the audit line of a change once it is known how it ended."""
    try:
        yield
    except Exception as error:
        shown = str(error) if isinstance(error, NotFound | ConfigError) else type(error).__name__
        audit(principal, project, action, target, result=f"refused: {shown}"[:300])
        error.audited = True  # type: ignore[attr-defined]  # the listener writes no second line for it
        raise
    audit(principal, project, action, target, result="ok")
