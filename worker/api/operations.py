"""The operator actions on one project's subscriptions, as the API and the console ask for them.

There is one implementation of each action: the CLI's (ops/admin.py, ops/dlq.py). This layer only
scopes them: a caller names a project it may see (else NotFound: another project's subscriptions
are never confirmed to exist) and a subscription by its name in that project, never a key.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pulsar import asyncio as pulsar_async

from worker.api.limits import SearchBudget
from worker.api.shared_reads import SharedReads
from worker.broker import consumer as pulsar_adapter
from worker.core.messages import Envelope, build_request
from worker.core.recent import OUTCOMES
from worker.fleet.seek import SeekTarget
from worker.model.config import Settings
from worker.model.subscriptions import NAME_PATTERN, NAME_RULE, PROJECT_PATTERN, Subscription, parse_subscription
from worker.ops import delivery_log, replay
from worker.ops.admin import Admin, Target
from worker.ops.delivery_log import LogQuery
from worker.ops.dlq import DeadLetters, Selection
from worker.runtime.errors import ConfigError, NotFound, PushWorkerError

MESSAGE_STATES = ("inflight", "retrying", "dead")
MAX_DATA_CHARS = 1 << 20  # of a dead letter's payload in an answer (text, or base64 of binary)
NO_SUCH_PROJECT = "no such project"


class Conflict(PushWorkerError):
    """The subscription exists already (create) or is not the registry's to change."""


def merged(current: Any, patch: Any) -> Any:
    """The platform's PATCH: fields left out keep their value, nested objects merge field by field,
    null removes a field, and `dead_letter: {topic: ""}` clears the dead-letter topic."""
    if not isinstance(patch, dict) or not isinstance(current, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(current)
    for name, value in patch.items():
        if value is None or (name == "dead_letter" and isinstance(value, dict) and value.get("topic") == ""):
            out.pop(name, None)
        else:
            out[name] = merged(out.get(name), value)
    return out


class Operations:
    """Every action of one fleet, scoped by project; `admin` and `dlq` are the CLI's layer."""

    def __init__(self, settings: Settings, redis_url: str, pulsar_url: str) -> None:
        target = Target(settings, redis_url, pulsar_url, configured=True)
        self.admin = Admin(target, "admin")
        self.dlq = DeadLetters(target, shared=True)
        self.shared_reads = SharedReads()
        self.reads_under_way = SharedReads(ttl=0)  # messages read back: shared while read, never kept
        self.searches = SearchBudget()
        self.pulsar = dataclasses.replace(settings.pulsar, service_url=pulsar_url)
        self.secrets_dir = str(settings.secrets_dir) if settings.secrets_dir else ""
        self.log_seconds = settings.redis.delivery_log_seconds
        self.settings = settings
        self._reader: pulsar_async.Client | None = None

    async def close(self) -> None:
        if self._reader is not None:
            reader, self._reader = self._reader, None
            await asyncio.wait_for(reader.close(), timeout=5.0)
        await self.dlq.close()
        await self.admin.close()

    def _broker(self) -> pulsar_async.Client:
        """One Pulsar client for reading messages back, kept until `close()`."""
        if self._reader is None:
            self._reader = pulsar_adapter.make_client(self.pulsar, self.pulsar.service_url or "", operator=True)
        return self._reader

    @staticmethod
    def check_project(project: str) -> None:
        if not PROJECT_PATTERN.fullmatch(project):
            raise NotFound(NO_SUCH_PROJECT)

    @classmethod
    def key(cls, project: str, name: str) -> str:
        cls.check_project(project)
        if not NAME_PATTERN.fullmatch(name):
            raise NotFound(f"{name}: no such subscription")
        return f"{project}/{name}"

    async def existing(self, project: str, name: str) -> str:
        return await self.admin.existing(self.key(project, name))

    # -- reading ------------------------------------------------------------------------------

    async def _fleet(self) -> list[dict[str, Any]]:
        """Every subscription's row (`subs list`), read once a second at most (shared_reads.py)."""
        async def load() -> list[dict[str, Any]]:
            return list((await self.admin.list()).data)
        rows: list[dict[str, Any]] = await self.shared_reads.get("list", load)
        return rows

    async def projects(self) -> list[str]:
        return sorted({row["project"] for row in await self._fleet()})

    async def subscriptions(self, project: str) -> list[dict[str, Any]]:
        self.check_project(project)
        return [_summary(row) for row in await self._fleet() if row["project"] == project]

    async def subscription(self, project: str, name: str) -> dict[str, Any]:
        key = self.key(project, name)

        async def load() -> dict[str, Any]:
            return dict((await self.admin.get(await self.admin.existing(key))).data)
        data: dict[str, Any] = await self.shared_reads.get("get " + key, load)
        out = {k: v for k, v in data.items() if k != "status"}
        return {"project": project, "name": name, **out, "status": _summary(data["status"])}

    async def messages(self, project: str, name: str, state: str, limit: int) -> list[dict[str, Any]]:
        key = await self.existing(project, name)
        if state == "dead":
            return list((await self.dlq.list(self.admin, key, limit)).data["messages"])
        return list((await self.admin.queue(key, state, limit)).data["messages"])

    async def recent(self, project: str, name: str, limit: int) -> list[dict[str, Any]]:
        """Recently settled messages, newest first (`push-worker history`)."""
        key = await self.existing(project, name)
        return list((await self.admin.history(key, limit)).data["messages"])

    async def message(self, project: str, name: str, message_id: str, answers: bool) -> dict[str, Any]:
        """One message's attempts; `answers`: with the endpoint's answers (operators only, see
        `_answers`)."""
        key = await self.existing(project, name)
        data = (await self.admin.show(message_id, key)).data
        times = [int(e["at_ms"]) for e in data["history"] if isinstance(e.get("at_ms"), int)]
        # The log's entries of this message: its history says when to look (a narrow range read).
        logged = await delivery_log.of_message(self.admin.client, key, message_id, min(times) - 1000,
                                               max(times) + 1000) if times else []
        out = {"message_id": message_id, "history": _answers(data["history"], answers),
               "attempts_in_progress": data["attempts_in_progress"], "log": _headers(logged, answers)}
        # The payload is the project's own data: its viewers see it, as they see dead letters'
        # (docs/security.md); headers and answers, which may echo a credential, are for operators.
        try:
            read = await self._read_back(key, message_id)
        except PushWorkerError as e:
            out["payload"] = {"unavailable": str(e)}
        else:
            out["payload"] = replay.payload_view(read["data"])
            out.update({k: v for k, v in read.items() if k not in ("data", "subscription")})
            attempts = [e["attempt"] for e in data["history"] if isinstance(e.get("attempt"), int)]
            out["sent"] = _as_sent(read["subscription"], message_id, read, max(attempts, default=1))
        return out

    async def payload(self, project: str, name: str, message_id: str) -> bytes:
        """The whole payload, read back from the broker."""
        key = await self.existing(project, name)
        data: bytes = (await self._read_back(key, message_id))["data"]
        return data

    async def _read_back(self, key: str, message_id: str) -> dict[str, Any]:
        """A message read back from the broker, once however many callers ask at the same moment (16
        downloads of one 4 MiB payload made 16 readers, and one of them timed out)."""
        async def load() -> dict[str, Any]:
            sub = await self.admin.definition(key)  # with the message: a page reads the definitions once
            message = await replay.read(self._broker(), sub.topic, message_id)
            return {"data": message.data() or b"", "attributes": dict(message.properties()),
                    "ordering_key": message.partition_key() or None,
                    "publish_time_ms": message.publish_timestamp(), "subscription": sub}
        read: dict[str, Any] = await self.reads_under_way.get(f"{key} {message_id}", load)
        return read

    async def replay(self, project: str, name: str, message_id: str) -> dict[str, Any]:
        """One more request for a settled message (ops/replay.py), numbered after its last attempt."""
        key = await self.existing(project, name)
        await self.admin.writable()

        async def history() -> tuple[list[dict[str, Any]], int | None]:
            try:
                data = (await self.admin.show(message_id, key)).data
            except NotFound:
                return [], None  # never attempted, or its records are gone (older than the history's TTL)
            return data["history"], data["attempts_in_progress"]
        return await replay.replay(self.settings, self.pulsar, self.admin.client, await self.admin.definition(key),
                                   message_id, history, self._broker())

    async def log(self, project: str, name: str, query: LogQuery, headers: bool, caller: str) -> dict[str, Any]:
        """A page of the delivery log's search, newest first; `headers`: both ways, and the answers
        (operators only, as `_answers`); within `caller`'s share of reads (limits.SearchBudget)."""
        key = await self.existing(project, name)
        with self.searches.take(caller, delivery_log.SCAN_BUDGET, delivery_log.CHUNK) as share:
            page = await delivery_log.search(self.admin.client, key, query, self.log_seconds, share.entries)
            share.read = page["scanned"]
        return {**page, "entries": _headers(page["entries"], headers), "kept_seconds": self.log_seconds}

    async def log_hours(self, project: str, name: str) -> dict[str, Any]:
        key = await self.existing(project, name)
        return {"hours": await delivery_log.hourly(self.admin.client, key, self.log_seconds),
                "kept_seconds": self.log_seconds}

    async def dead_letter(self, project: str, name: str, message_id: str, limit: int, answers: bool) -> dict[str, Any]:
        key = await self.existing(project, name)
        data = dict((await self.dlq.show(self.admin, key, message_id, limit)).data)
        text = data.get("data") or ""
        # An answer is bounded: a payload of tens of MiB is not one to read in a page or a JSON body.
        return {**data, "data": text[:MAX_DATA_CHARS], "data_truncated": len(text) > MAX_DATA_CHARS,
                "history": _answers(data.get("history") or [], answers)}

    # -- changing -----------------------------------------------------------------------------

    async def create(self, project: str, definition: Any) -> dict[str, Any]:
        name = self._name_in(project, definition)
        key = self.key(project, name)
        try:
            await self.admin.existing(key)
        except NotFound:
            pass
        else:
            raise Conflict(f"{name}: exists already (PATCH it, or delete it first)")
        await self._apply(project, definition)
        return await self.subscription(project, name)

    async def patch(self, project: str, name: str, patch: Any) -> dict[str, Any]:
        if not isinstance(patch, dict):
            raise ConfigError(f"subscription {name!r}", "body", "must be a JSON object of the fields to change")
        key = await self.existing(project, name)
        definitions = await self.admin.registry.definitions()
        if key not in definitions:
            raise Conflict(f"{name}: served from a worker's config file (read-only here): change it in that file")
        await self._apply(project, merged(definitions[key], {**patch, "name": name}))
        return await self.subscription(project, name)

    async def _apply(self, project: str, definition: dict[str, Any]) -> None:
        await self.check(project, definition)
        await self.admin.writable()
        await self.admin.registry.apply_all([definition])
        self.shared_reads.clear()

    async def check(self, project: str, definition: Any, editing: str | None = None) -> None:
        """What creating (or, `editing`, replacing) a definition would check, without writing: the
        console's preview says the same as the save would."""
        name = self._name_in(project, definition)
        if editing is not None and name != editing:
            raise ConfigError(f"subscription {editing!r}", "name", "cannot change: create a new subscription instead")
        # The topic decides the project: it must be this one, checked before anything that could
        # depend on another project's subscriptions (their config-file ones, say): no oracle.
        sub = parse_subscription(definition)
        if sub.tenant != project:
            raise ConfigError(f"subscription {sub.name!r}", "topic", f"must be in project {project}'s tenant")
        self.admin.registry.check(definition)
        await self.admin.refuse_workers_own([definition])
        if editing is not None:  # what the save refuses, the review refuses (an immutable field changed)
            await self.admin.registry.check_change(definition)

    async def replace(self, project: str, name: str, definition: Any) -> dict[str, Any]:
        """The whole definition of a registry subscription replaced (the console's edit)."""
        key = await self.existing(project, name)
        if key not in await self.admin.registry.definitions():
            raise Conflict(f"{name}: served from a worker's config file (read-only here): change it in that file")
        await self.check(project, definition, editing=name)
        await self._apply(project, definition)
        return await self.subscription(project, name)

    def _changed(self, answer: Any) -> dict[str, Any]:
        """An action's answer; what the reads shared until now showed has changed with it."""
        self.shared_reads.clear()
        return dict(answer)

    def _name_in(self, project: str, definition: Any) -> str:
        if not isinstance(definition, dict) or not isinstance(definition.get("name"), str):
            raise ConfigError("subscription", "name", "is required (the subscription's name in the project)")
        if not NAME_PATTERN.fullmatch(definition["name"]):
            raise ConfigError("subscription", "name", NAME_RULE)
        return str(definition["name"])

    async def delete(self, project: str, name: str) -> dict[str, Any]:
        key = await self.existing(project, name)
        if not await self.admin.client.hexists(self.admin.registry.hash, key):
            raise Conflict(f"{name}: served from a worker's config file (read-only here): remove it from that file")
        return self._changed((await self.admin.delete(key)).data[0])

    async def pause(self, project: str, name: str, paused: bool, wait: float) -> dict[str, Any]:
        key = await self.existing(project, name)
        return self._changed((await self.admin.pause(key, paused, wait)).data)

    async def seek(self, project: str, name: str, to: SeekTarget) -> dict[str, Any]:
        key = await self.existing(project, name)
        return self._changed((await self.admin.seek(key, to, self.pulsar)).data)

    async def purge(self, project: str, name: str) -> dict[str, Any]:
        key = await self.existing(project, name)
        return self._changed((await self.admin.purge(key, self.pulsar)).data)

    async def discard(self, project: str, name: str, message_id: str, wait: float) -> dict[str, Any]:
        key = await self.existing(project, name)
        return self._changed((await self.admin.discard(message_id, key, wait)).data)

    async def redrive(self, project: str, name: str, *, message_id: str | None, selection: Selection,
                      max_messages: int | None, rate: float) -> dict[str, Any]:
        key = await self.existing(project, name)
        out = await self.dlq.redrive(self.admin, key, rate, max_messages, concurrency=8, progress=lambda _: None,
                                     message_id=message_id, selection=selection)
        return self._changed(out.data)


ANSWER_HIDDEN = "(shown to operators only)"


def _answers(history: list[dict[str, Any]], shown: bool) -> list[dict[str, Any]]:
    """An endpoint's answers are shown to the project's operators only: an answer may echo the
    request's credential in a form no redaction foresaw, and a viewer must never read one."""
    if shown:
        return history
    return [{**e, "answer": ANSWER_HIDDEN} if "answer" in e else e for e in history]


def without_query_values(url: str) -> str:
    """A URL with its query's values hidden: a push URL may carry a credential there (`?token=`, as
    Google Pub/Sub's docs suggest for verifying pushes), which a project's viewers must not read."""
    parts = urlsplit(url)
    if not parts.query:
        return url
    hidden = "&".join(f"{name}=[redacted]" if sep else name
                      for name, sep, _ in (pair.partition("=") for pair in parts.query.split("&")))
    return urlunsplit(parts._replace(query=hidden))


def for_viewer(sub: dict[str, Any]) -> dict[str, Any]:
    """A subscription's answer as a viewer reads it: its push URL's query values hidden."""
    definition = sub.get("definition")
    if not isinstance(definition, dict):
        return sub
    shown = copy.deepcopy(definition)
    push = (shown.get("deliver") or {}).get("push")
    if isinstance(push, dict) and isinstance(push.get("url"), str):
        push["url"] = without_query_values(push["url"])
    return {**sub, "definition": shown}


def _as_sent(sub: Subscription, message_id: str, read: dict[str, Any], attempt: int) -> dict[str, Any]:
    """The request body of the message's last attempt as the worker builds it (the wrapper, the
    CloudEvent, or the payload itself), with its content type; a batch subscription sends the
    message as one entry of a batch's body, said instead."""
    if sub.batch is not None:
        return {"attempt": attempt, "content": sub.content, "batch": True}
    envelope = Envelope(message_id, read["data"], sub.topic, read["publish_time_ms"] or 0, read["attributes"],
                        read["ordering_key"])
    request = build_request(sub, envelope, attempt)
    return {"attempt": attempt, "content": sub.content, "batch": False,
            "content_type": request.headers.get("Content-Type", ""), "body": replay.payload_view(request.body)}


def _headers(entries: list[dict[str, Any]], shown: bool) -> list[dict[str, Any]]:
    """Log entries for a viewer: without the headers and the answer (see `_answers`)."""
    if shown:
        return entries
    return [{**e, "request_headers": {}, "response_headers": {}, "answer": ANSWER_HIDDEN if e.get("answer") else ""}
            for e in entries]


def _summary(row: dict[str, Any]) -> dict[str, Any]:
    """A `subs list` row as the API gives it: the serving workers as a list, the outcome shares."""
    recent = row.get("recent") or {}
    outcomes = recent.get("outcomes") or {}
    attempts = sum(outcomes.values())
    delivered = recent.get("delivered") or []
    window = recent.get("window_seconds") or 300
    return {
        "project": row["project"], "name": row["name"], "type": row["type"], "state": row["state"],
        "endpoint": row.get("endpoint", ""),
        "reason": row.get("reason", ""), "source": row.get("source", "registry"),
        "workers": [] if row.get("owner", "-") == "-" else row["owner"].split(","),
        "backlog": row.get("backlog"), "oldest_unacked_age_seconds": row.get("oldest_unacked_age_seconds"),
        "delivery_rate": round(sum(delivered) / window, 2),
        "delivered_per_step": delivered, "step_seconds": recent.get("step_seconds", 10),
        "attempts_recent": attempts,
        "outcome_shares": {k: round(outcomes.get(k, 0) / attempts, 4) if attempts else 0.0 for k in OUTCOMES},
        "p95_latency_ms": recent.get("p95_latency_ms"), "last_error": recent.get("last_error"),
        "counters": {k: row.get(k, 0) for k in ("acked", "retried", "dead_lettered", "unsettled")},
    }
