"""The web console, `/console/`: server-rendered pages over the same operations as the API.

No JavaScript at all (the Content-Security-Policy forbids it), no build chain, nothing from a CDN:
tables sort by links, the delivery rate's sparkline is an inline SVG, and every action goes through
a confirmation page. Templates (templates/) are Jinja2 with autoescaping: whatever a project wrote
(names, definitions, an endpoint's answer) is shown as text, never markup.

Login takes a token (a JWT or a static token, as the API does) and keeps it in a cookie that is
HttpOnly, SameSite=Strict, scoped to /console (and Secure behind admin.tls). Every form that
changes something carries a CSRF value derived from that token, which a page of another site
cannot read, and a request whose Origin is another site is refused.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import hmac
import time
from collections.abc import Callable
from importlib import resources
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import jinja2
import markupsafe
import yaml
from aiohttp import web

from worker.api.auth import Authenticator, Principal, Unauthorized
from worker.api.charts import charts
from worker.api.operations import Operations, for_viewer
from worker.api.routes import (
    PRINCIPAL,
    FailedLogins,
    Forbidden,
    audit,
    audited,
    log_query,
    may_act,
    payload_download,
    perform,
    project_seen,
    visible_projects,
)
from worker.core.messages import rfc3339
from worker.model.config import parse_yaml
from worker.ops.delivery_log import STATUS_CLASSES
from worker.ops.render import inert
from worker.runtime.errors import ConfigError, NotFound, PushWorkerError

COOKIE = "pw_console"
COOKIE_SECONDS = 8 * 3600
NOTICE_COOKIE = "pw_notice"  # an action's outcome, shown once on the page it leads to
FORM_FIELDS = ("to", "message_id", "since", "until", "status")  # an action's arguments, from its page to its form
ACTIONS = {"pause": "Pause", "resume": "Resume", "seek": "Seek", "redrive": "Redrive", "replay": "Replay"}
SORTABLE = ("name", "state", "workers", "backlog", "oldest_unacked_age_seconds", "delivery_rate", "p95_latency_ms",
            "errors", "dead_lettered")
ANSWER_SHOWN = 256  # bytes of an endpoint's answer on the message page (the attempt log keeps no more)
MAX_DEFINITION_CHARS = 16 * 1024  # as the API's body (MAX_BODY_BYTES is the whole form's)
SEARCH_FIELDS = ("message_id", "since", "until", "status", "min_attempt", "ordering_key")

def _shown(value: Any) -> Any:
    """Every value a page prints: control, bidi and invisible characters escaped (render.inert)."""
    if isinstance(value, markupsafe.Markup):  # the templates' own markup (a macro's output)
        return value
    return inert(value, keep_lines=True) if isinstance(value, str) else value


def _url_part(value: Any) -> str:
    """A path segment or query from data: everything but unreserved characters encoded, `/` too,
    so an id like `../confirm/pause` stays one segment and never points at another page."""
    if isinstance(value, dict):
        return urlencode({str(k): str(v) for k, v in value.items()}, quote_via=quote)
    return quote(str(value), safe="")


_env = jinja2.Environment(loader=jinja2.PackageLoader("worker.api", "templates"), autoescape=True, finalize=_shown)
_env.filters["urlencode"] = _url_part


def _time(ms: Any) -> str:
    try:
        return rfc3339(int(ms))
    except (TypeError, ValueError, OverflowError, OSError):
        return "?"


_env.filters["rfc3339"] = _time


def csrf_value(token: str) -> str:
    """Derived from the session's token: a page of another site knows neither."""
    return hashlib.sha256(b"push-worker console csrf\0" + token.encode()).hexdigest()


def sparkline(points: list[int], width: int = 120, height: int = 24) -> str:
    """An SVG polyline's points for the delivery rate (newest right)."""
    if not points:
        return ""
    top = max(max(points), 1)
    step = width / max(len(points) - 1, 1)
    return " ".join(f"{i * step:.1f},{height - 1 - (p / top) * (height - 2):.1f}" for i, p in enumerate(points))


def _errors(row: dict[str, Any]) -> float:
    shares = row["outcome_shares"]
    return float(1 - shares.get("2xx", 0.0)) if row["attempts_recent"] else 0.0


def _sort_key(column: str) -> Any:
    def key(row: dict[str, Any]) -> Any:
        if column == "errors":
            return _errors(row)
        if column == "workers":
            return len(row["workers"])
        if column == "dead_lettered":
            return row["counters"]["dead_lettered"]
        value = row.get(column)
        return (value is None, value if value is not None else 0)
    return key


def redirect(location: str) -> web.Response:
    """After a form: the browser GETs the page (a reload does not post the form again)."""
    return web.Response(status=303, headers={"Location": location})


def render(template: str, http_status: int = 200, **context: Any) -> web.Response:
    body = _env.get_template(template).render(**context)
    return web.Response(text=body, status=http_status, content_type="text/html", charset="utf-8")


class Console:
    COOKIE = COOKIE

    def __init__(self, ops: Operations, auth: Authenticator, secure_cookie: bool,
                 on_failed_login: Callable[[], None] = lambda: None, grafana_url: str = "",
                 refresh_seconds: int = 15) -> None:
        self.ops = ops
        self.grafana_url = grafana_url
        self.refresh_seconds = refresh_seconds  # live pages reload with a meta refresh: no script
        self.auth = auth
        self.secure_cookie = secure_cookie
        self.failed_logins = FailedLogins()
        self.on_failed_login = on_failed_login

    def add_routes(self, app: web.Application) -> None:
        base = "/console/projects/{project}/subscriptions/{name}"
        app.router.add_get("/console/static/console.css", self.stylesheet)
        app.router.add_get("/console/login", self.login_page)
        app.router.add_post("/console/login", self.login)
        app.router.add_post("/console/logout", self.logout)
        app.router.add_get("/console/", self.index)
        app.router.add_get("/console", self.index)
        app.router.add_get("/console/projects/{project}", self.project)
        app.router.add_get("/console/projects/{project}/new", self.new)
        app.router.add_post("/console/projects/{project}/new", self.save_new)
        app.router.add_get("/console/endpoints/{host}", self.endpoint)
        app.router.add_get(base + "/edit", self.edit)
        app.router.add_post(base + "/edit", self.save_edit)
        app.router.add_get(base, self.subscription)
        app.router.add_get(base + "/messages/{message_id}", self.message)
        app.router.add_get(base + "/messages/{message_id}/payload", self.payload)
        app.router.add_get(base + "/log", self.log)
        app.router.add_get(base + "/confirm/{action}", self.confirm)
        app.router.add_post(base + "/{action}", self.act)

    @staticmethod
    def error_page(status: int, text: str) -> web.Response:
        return render("error.html", http_status=status, status_code=status, text=text, principal=None)

    async def stylesheet(self, _: web.Request) -> web.Response:
        css = resources.files("worker.api").joinpath("static/console.css").read_text("utf-8")
        return web.Response(text=css, content_type="text/css")

    # -- session ------------------------------------------------------------------------------

    async def login_page(self, _: web.Request) -> web.Response:
        return render("login.html", principal=None, failed=False)

    async def login(self, request: web.Request) -> web.StreamResponse:
        _same_origin(request)
        form = await request.post()
        token = str(form.get("token", "")).strip()
        try:
            principal = await self.auth.principal(token)
        except Unauthorized:
            self.on_failed_login()
            self.failed_logins.failed(request.remote or "-")
            return render("login.html", http_status=401, principal=None, failed=True)
        response = redirect("/console/")
        # The session ends with the token: never later than a JWT's exp, 8 h at most.
        lifetime = COOKIE_SECONDS if principal.expires_at is None else \
            max(0, min(COOKIE_SECONDS, int(principal.expires_at - time.time())))
        response.set_cookie(COOKIE, token, max_age=lifetime, path="/console", httponly=True,
                            samesite="Strict", secure=self.secure_cookie)
        audit(principal, "-", "console login", "-", "ok")
        return response

    async def logout(self, request: web.Request) -> web.StreamResponse:
        await self._checked_form(request)
        response = redirect("/console/login")
        response.del_cookie(COOKIE, path="/console")
        return response

    async def _checked_form(self, request: web.Request) -> dict[str, str]:
        """A state-changing form: from this site, with the session's CSRF value."""
        _same_origin(request)
        form = {k: str(v) for k, v in (await request.post()).items()}
        principal: Principal = request[PRINCIPAL]
        if not hmac.compare_digest(form.get("csrf", ""), csrf_value(principal.token)):
            raise Forbidden("the form is stale or not from this console: reload the page and try again")
        return form

    # -- pages --------------------------------------------------------------------------------

    def _page(self, request: web.Request, template: str, **context: Any) -> web.Response:
        principal: Principal = request[PRINCIPAL]
        return render(template, principal=principal, csrf=csrf_value(principal.token), **context)

    async def index(self, request: web.Request) -> web.StreamResponse:
        projects = await visible_projects(self.ops, request[PRINCIPAL])
        if len(projects) == 1:
            return redirect(f"/console/projects/{quote(projects[0])}")
        rows = []
        for project in projects:  # each project's totals: where to look first
            subs = await self.ops.subscriptions(project)
            rows.append({"name": project, "subscriptions": len(subs),
                         "failing": sum(1 for sub in subs if _errors(sub) > 0),
                         "dead_lettered": sum(sub["counters"]["dead_lettered"] for sub in subs)})
        return self._page(request, "index.html", projects=rows)

    def _project(self, request: web.Request) -> str:
        return project_seen(request)[1]

    async def project(self, request: web.Request) -> web.Response:
        project = self._project(request)
        rows = await self.ops.subscriptions(project)
        column = request.query.get("sort", "name")
        column = column if column in SORTABLE else "name"
        descending = request.query.get("order") == "desc"
        rows.sort(key=_sort_key(column), reverse=descending)
        for row in rows:
            row["errors"] = _errors(row)
            row["spark"] = sparkline(row["delivered_per_step"])
        return self._page(request, "project.html", project=project, rows=rows, column=column,
                          descending=descending, sortable=SORTABLE,
                          can_act=request[PRINCIPAL].grants.acts_on(project))

    async def subscription(self, request: web.Request) -> web.Response:
        project = self._project(request)
        name = request.match_info["name"]
        sub = await self.ops.subscription(project, name)
        if not request[PRINCIPAL].grants.acts_on(project):
            sub = for_viewer(sub)
        retrying = await self.ops.messages(project, name, "retrying", 50)
        settled = await self.ops.recent(project, name, 20)
        dead: list[dict[str, Any]] | None
        dead_note = ""
        try:
            dead = await self.ops.messages(project, name, "dead", 50)
        except NotFound as e:
            dead, dead_note = None, str(e)
        except PushWorkerError as e:  # the broker is not answering: the rest of the page still helps
            dead, dead_note = None, f"dead letters unavailable: {e}"
        definition = yaml.safe_dump(sub.get("definition"), sort_keys=False) if sub.get("definition") else ""
        hours = await self.ops.log_hours(project, name)
        page = self._page(request, "subscription.html", project=project, name=name, sub=sub,
                          status=sub["status"], definition=definition, retrying=retrying, settled=settled,
                          dead=dead, dead_note=dead_note, notice=request.cookies.get(NOTICE_COOKIE, ""),
                          spark=sparkline(sub["status"]["delivered_per_step"]),
                          can_act=request[PRINCIPAL].grants.acts_on(project),
                          live=request.query.get("live") != "0" and self.refresh_seconds > 0,
                          live_seconds=self.refresh_seconds,
                          charts=charts(hours["hours"]), kept=_duration(hours["kept_seconds"]),
                          status_classes=STATUS_CLASSES, grafana=self.grafana_link(project, name))
        if NOTICE_COOKIE in request.cookies:
            page.del_cookie(NOTICE_COOKIE, path="/console")  # shown once
        return page

    async def message(self, request: web.Request) -> web.Response:
        project = self._project(request)
        name = request.match_info["name"]
        message_id = request.match_info["message_id"]
        data = await self.ops.message(project, name, message_id, answers=request[PRINCIPAL].grants.acts_on(project))
        for entry in data["history"]:
            answer = entry.get("answer")
            if isinstance(answer, str):
                entry["answer"] = answer[:ANSWER_SHOWN]
        page = self._page(request, "message.html", project=project, name=name, message=data,
                          outcome=outcome_of(data), can_act=request[PRINCIPAL].grants.acts_on(project),
                          notice=request.cookies.get(NOTICE_COOKIE, ""))
        if NOTICE_COOKIE in request.cookies:
            page.del_cookie(NOTICE_COOKIE, path="/console")  # shown once
        return page

    async def payload(self, request: web.Request) -> web.Response:
        """The download link of a message page: the payload's bytes (as the API gives them)."""
        project = self._project(request)
        message_id = request.match_info["message_id"]
        return payload_download(await self.ops.payload(project, request.match_info["name"], message_id), message_id)

    async def log(self, request: web.Request) -> web.Response:
        """The delivery log's search: the subscription page's form, a page of results, newest first."""
        project = self._project(request)
        name = request.match_info["name"]
        query = log_query(request.query)
        page = await self.ops.log(project, name, query, headers=request[PRINCIPAL].grants.acts_on(project),
                                  caller=request[PRINCIPAL].caller)
        form = {k: request.query.get(k, "") for k in SEARCH_FIELDS}
        more = {k: v for k, v in form.items() if v} | ({"cursor": page["next_cursor"]} if page["next_cursor"] else {})
        return self._page(request, "log.html", project=project, name=name, page=page, query=query, form=form,
                          more=more, status_classes=STATUS_CLASSES)

    def grafana_link(self, project: str, name: str) -> str:
        """The Grafana dashboard with this subscription chosen (admin.grafana_url; "" without it)."""
        base = self.grafana_url
        if not base:
            return ""
        return f"{base.rstrip('/')}/d/push-worker-subscription/push-worker-subscription?" + urlencode(
            {"var-project": project, "var-subscription": name}, quote_via=quote)

    async def endpoint(self, request: web.Request) -> web.Response:
        """Every subscription the caller sees that pushes to one host, with its health."""
        host = request.match_info["host"].lower()
        rows = []
        for project in await visible_projects(self.ops, request[PRINCIPAL]):
            rows += [row for row in await self.ops.subscriptions(project) if row.get("endpoint") == host]
        for row in rows:
            row["errors"] = _errors(row)
        attempts = sum(row["attempts_recent"] for row in rows)
        failed = sum(row["errors"] * row["attempts_recent"] for row in rows) / attempts if attempts else 0.0
        worst = max((row["p95_latency_ms"] for row in rows if row["p95_latency_ms"] is not None), default=None)
        return self._page(request, "endpoint.html", host=host, rows=rows, attempts=attempts, failed=failed,
                          worst_p95=worst, live_seconds=self.refresh_seconds)

    # -- creating and editing: a form, the diff, then the save ---------------------------------

    async def new(self, request: web.Request) -> web.Response:
        project = self._project(request)
        may_act(request[PRINCIPAL], project)
        # Empty fields: their placeholders say what goes where (values would be saved by a careless Create).
        return self._editor(request, project, None, dict.fromkeys(EDITED_FIELDS, ""))

    async def edit(self, request: web.Request) -> web.Response:
        project = self._project(request)
        name = request.match_info["name"]
        may_act(request[PRINCIPAL], project)
        return self._editor(request, project, name, form_of(await self._current(project, name)))

    async def _current(self, project: str, name: str) -> dict[str, Any]:
        sub = await self.ops.subscription(project, name)
        definition = sub.get("definition")
        if not isinstance(definition, dict) or sub["status"].get("source") != "registry":
            raise Forbidden(f"{name} is defined in a worker's config file: change it there")
        return definition

    def _editor(self, request: web.Request, project: str, name: str | None, fields: dict[str, str],
                error: str = "", diff: list[str] | None = None, status: int = 200) -> web.Response:
        base = f"/console/projects/{quote(project, safe='')}"
        action = f"{base}/new" if name is None else f"{base}/subscriptions/{quote(name, safe='')}/edit"
        page = self._page(request, "edit.html", project=project, name=name or "", creating=name is None,
                          fields=fields, error=error, diff=diff, action=action,
                          cancel=base if name is None else f"{base}/subscriptions/{quote(name, safe='')}")
        page.set_status(status)
        return page

    async def save_new(self, request: web.Request) -> web.StreamResponse:
        return await self._save(request, self._project(request), None)

    async def save_edit(self, request: web.Request) -> web.StreamResponse:
        return await self._save(request, self._project(request), request.match_info["name"])

    async def _save(self, request: web.Request, project: str, name: str | None) -> web.StreamResponse:
        """A posted definition: back to the form with the first broken rule, or the diff to confirm,
        or (confirmed) saved through the API's operation, audited as the API audits it."""
        principal = request[PRINCIPAL]
        may_act(principal, project)
        form = await self._checked_form(request)
        # A browser sends a textarea's lines ended by CRLF (and a hidden field's again): one ending.
        fields = {k: form.get(k, "").replace("\r\n", "\n").replace("\r", "\n") for k in EDITED_FIELDS}
        if name is not None:
            fields["name"] = name  # shown, never changed
        if form.get("back") == "yes":
            return self._editor(request, project, name, fields)
        # Both sides in one key order: the diff shows what changes, not how each was written.
        current = _dump(await self._current(project, name), ordered=True) if name is not None else ""
        try:
            definition = definition_of(fields)
            await self.ops.check(project, definition, editing=name)
        except (ConfigError, NotFound) as e:  # NotFound: another project's topic says no more than that
            return self._editor(request, project, name, fields, error=" ".join(str(e).split()), status=400)
        if form.get("confirmed") != "yes":
            diff = list(difflib.unified_diff(current.splitlines(), _dump(definition, ordered=True).splitlines(),
                                             "saved", "yours", lineterm="", n=3))[2:]
            return self._editor(request, project, name, fields, diff=diff)
        target = str(definition["name"])
        with audited(principal, project, "create" if name is None else "edit", target):
            if name is None:
                await self.ops.create(project, definition)
            else:
                await self.ops.replace(project, name, definition)
        response = redirect(f"/console/projects/{quote(project, safe='')}/subscriptions/{quote(target, safe='')}")
        response.set_cookie(NOTICE_COOKIE, "created" if name is None else "saved", max_age=60, path="/console",
                            httponly=True, samesite="Strict", secure=self.secure_cookie)
        return response

    def _action(self, request: web.Request) -> tuple[str, str, str]:
        """The project, subscription and action of an action's page or form, which the caller may do."""
        project = self._project(request)
        action = request.match_info["action"]
        if action not in ACTIONS:
            raise NotFound("no such action")
        may_act(request[PRINCIPAL], project)
        return project, request.match_info["name"], action

    async def confirm(self, request: web.Request) -> web.Response:
        project, name, action = self._action(request)
        await self.ops.existing(project, name)
        fields = {k: v for k, v in request.query.items() if k in FORM_FIELDS}
        return self._page(request, "confirm.html", project=project, name=name, action=action,
                          label=ACTIONS[action], fields=fields)

    async def act(self, request: web.Request) -> web.StreamResponse:
        project, name, action = self._action(request)
        principal = request[PRINCIPAL]
        form = await self._checked_form(request)
        if form.get("confirmed") != "yes":
            raise ConfigError("form", "confirmed", "the action was not confirmed")
        body: dict[str, Any] = {k: v for k, v in form.items() if k in FORM_FIELDS and k != "status" and v}
        if form.get("status"):
            body["status"] = [s.strip() for s in form["status"].split(",") if s.strip()]
        with audited(principal, project, action, name):
            outcome = await perform(self.ops, project, name, action, body)
        # The outcome goes to the next page in a short-lived cookie, never in the URL: a link of
        # someone else's cannot make the console show an official-looking notice.
        # Back where it acted: a message's page after its replay or redrive, else the subscription's.
        here = f"/console/projects/{quote(project, safe='')}/subscriptions/{quote(name, safe='')}"
        message_id = body.get("message_id") if action in ("replay", "redrive") else None
        response = redirect(f"{here}/messages/{quote(message_id, safe='')}" if message_id else here)
        response.set_cookie(NOTICE_COOKIE, _notice(action, outcome), max_age=60, path="/console", httponly=True,
                            samesite="Strict", secure=self.secure_cookie)
        return response


# The form's fields: the settings most edits touch, each a field of its own, and the rest as YAML.
EDITED_FIELDS = ("name", "topic", "url", "ack_deadline_seconds", "max_deliver", "dead_letter_topic", "more")


def outcome_of(message: dict[str, Any]) -> tuple[str, str]:
    """A message's final outcome in one line, and its colour class: what a message page says first."""
    history = message["history"]
    if message.get("attempts_in_progress") is not None:
        return "pending", f"Not settled yet: {message['attempts_in_progress']} attempt(s) so far"
    if not history:
        return "other", "No attempt recorded"
    last = history[-1]
    attempts = max([e["attempt"] for e in history if isinstance(e.get("attempt"), int)], default=0)
    status = f" · last status {last['status']}" if last.get("status") else ""
    when = f" · {rfc3339(last['at_ms'])}" if isinstance(last.get("at_ms"), int) else ""
    event = last.get("event")
    if event is None and last.get("result") == "ack":
        answered = f" · status {last['status']}" if last.get("status") else ""
        return "ok", f"Delivered at attempt {last.get('attempt', attempts)}{answered}{when}"
    said = {"dead-lettered": ("bad", f"Dead-lettered after {attempts} attempt(s){status} · to {last.get('topic', '')}"),
            "dropped": ("bad", f"Dropped after {attempts} attempt(s){status}"),
            "replay-failed": ("bad", f"A replay failed (attempt {attempts}){status}"),
            "discarded": ("other", "Discarded by an operator: never delivered"),
            "filtered": ("other", "Filtered out: never sent"),
            "unreadable": ("bad", "Unreadable: dead-lettered unsent")}
    cls, text = said.get(str(event), ("other", f"{event or last.get('result')}{status}"))
    return cls, text + when


def _dump(definition: Any, ordered: bool = False) -> str:
    return yaml.safe_dump(definition, sort_keys=ordered, allow_unicode=True)


def form_of(definition: dict[str, Any]) -> dict[str, str]:
    """A definition as the form shows it: its usual settings in fields, the rest as YAML."""
    rest = copy.deepcopy(definition)
    push = (rest.get("deliver") or {}).get("push") or {}
    fields = {"name": str(rest.pop("name", "")), "topic": str(rest.pop("topic", "")), "url": str(push.pop("url", "")),
              "ack_deadline_seconds": str(rest.pop("ack_deadline_seconds", "")),
              "max_deliver": str(rest.pop("max_deliver", "")),
              "dead_letter_topic": str((rest.pop("dead_letter", None) or {}).get("topic", ""))}
    if rest.get("deliver") == {"mode": "push", "push": {}}:
        rest.pop("deliver")
    return {**fields, "more": _dump(rest) if rest else ""}


def definition_of(fields: dict[str, str]) -> Any:
    """The form's fields as a definition (the YAML of the rest, the fields over it), or a
    ConfigError naming what is wrong; the API's rules judge it next."""
    rest = _yaml_of(fields.get("more", "")) or {}
    if not isinstance(rest, dict):
        raise ConfigError("definition", "more settings", "must be a YAML mapping of settings")
    definition: dict[str, Any] = {**rest, "name": fields["name"].strip(), "topic": fields["topic"].strip()}
    for number in ("ack_deadline_seconds", "max_deliver"):
        text = fields.get(number, "").strip()
        if text:
            if not text.lstrip("-").isdigit():
                raise ConfigError("definition", number, "must be a whole number")
            definition[number] = int(text)
    deliver = definition.setdefault("deliver", {"mode": "push"})
    if not isinstance(deliver, dict) or not isinstance(deliver.setdefault("push", {}), dict):
        raise ConfigError("definition", "deliver", "must be a mapping with push: {url: ...}")
    deliver.setdefault("mode", "push")
    deliver["push"]["url"] = fields.get("url", "").strip()
    if fields.get("dead_letter_topic", "").strip():
        definition["dead_letter"] = {"topic": fields["dead_letter_topic"].strip()}
    return definition


def _yaml_of(text: str) -> Any:
    """The form's YAML, or a ConfigError naming what is wrong with it."""
    if len(text) > MAX_DEFINITION_CHARS:
        raise ConfigError("definition", "YAML", f"is over {MAX_DEFINITION_CHARS} characters")
    try:  # an alias repeats a node without its size showing: a few lines could stand for millions
        aliased = any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(text))
    except (yaml.YAMLError, RecursionError):
        aliased = False  # parse_yaml says what is wrong
    if aliased:
        raise ConfigError("definition", "YAML", "anchors and aliases (*name) are not taken here: write it out")
    return parse_yaml(text, "definition", "YAML")


def _duration(seconds: int) -> str:
    if seconds % 86400 == 0:
        return f"{seconds // 86400} day(s)"
    return f"{seconds // 3600} hour(s)" if seconds % 3600 == 0 else f"{seconds} s"


def _notice(action: str, outcome: dict[str, Any]) -> str:
    if action == "replay":
        return f"replayed {outcome.get('message_id', '')} as attempt {outcome.get('attempt')}: {outcome.get('result')}"
    if action == "redrive":
        return (f"redrive done: {outcome.get('redriven', 0)} delivered, "
                f"{outcome.get('dead_lettered_again', 0)} dead-lettered again")
    if action == "seek":
        return f"sought to {outcome.get('to', '')}"
    return str(outcome.get("result", action))


def _same_origin(request: web.Request) -> None:
    """A form posted from another site (its Origin names it) is refused."""
    origin = request.headers.get("Origin")
    if origin is not None and origin != "null" and urlsplit(origin).netloc != request.host:
        raise Forbidden("the request came from another site")
    if origin == "null":
        raise Forbidden("the request came from another site")
