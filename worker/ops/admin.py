"""Operator commands against a fleet's Redis: `push-worker subs apply|delete|list|get|pause|resume`
and `push-worker show`.

Human-friendly tables by default, `--json` for scripts. Where to connect: `--redis-url` (or
`--service-url` for the broker), else $PUSH_WORKER_REDIS_URL / $PUSH_WORKER_PULSAR_URL, else the
config's `redis.url` / `pulsar.service_url`, else the URLs a worker on the embedded default recorded
in its `state_dir`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from redis.exceptions import ResponseError

from worker.broker.embedded import recorded_endpoints
from worker.core import attempts, keys, recent
from worker.core.messages import rfc3339
from worker.fleet import layout, quarantine
from worker.fleet.admission import admit_for
from worker.fleet.ownership import holders, owners
from worker.fleet.published import published
from worker.fleet.registry import Registry, clear_state
from worker.fleet.seek import SeekTarget, seek_by_command
from worker.model.config import (
    PULSAR_SCHEMES,
    REDIS_SCHEMES,
    PulsarSettings,
    Settings,
    check_url,
    load_settings,
    parse_settings,
    read_yaml,
)
from worker.model.filters import MIXED
from worker.model.subscriptions import MAX_WORKERS, State, Subscription, is_push, parse_subscription, valid_key
from worker.ops.render import Output, people_yaml, table
from worker.runtime.errors import ConfigError, NotFound, PushWorkerError, UsageError
from worker.state.redis_client import AsyncClient, connect, safe_text


@dataclass(frozen=True)
class Target:
    """Where an operator command connects, and the config it was given (for static subscriptions)."""

    settings: Settings
    redis_url: str | None = field(default=None, repr=False)
    pulsar_url: str | None = None
    configured: bool = False  # `settings` are a worker's config (--config), not the defaults
    # The broker's Prometheus page when no pulsar.admin_url or metrics_url is configured (an embedded broker's)
    pulsar_metrics_url: str | None = None

    @property
    def fleet(self) -> str:
        return self.settings.fleet.name

    def redis(self, command: str) -> AsyncClient:
        """A client for the fleet's Redis: --redis-url (or the config's redis.url), or the cluster
        or Sentinels the config names."""
        options: dict[str, Any] = {"socket_connect_timeout": 5, "socket_timeout": 10}
        if self.settings.redis.mode != "standalone" and not self.redis_url:
            return connect(self.settings.redis, **options)
        if not self.redis_url:
            raise ConfigError(command, "--redis-url", "is required (or --config with redis.url, "
                              "$PUSH_WORKER_REDIS_URL, or a running embedded worker's state_dir)")
        return connect(self.settings.redis, _flag_url(self.redis_url, REDIS_SCHEMES, command, "--redis-url"), **options)

    def pulsar(self, command: str) -> str:
        if not self.pulsar_url:
            raise ConfigError(command, "--service-url", "is required (or --config with pulsar.service_url, "
                              "$PUSH_WORKER_PULSAR_URL, or a running embedded worker's state_dir)")
        return _flag_url(self.pulsar_url, PULSAR_SCHEMES, command, "--service-url")


def _flag_url(value: str, schemes: tuple[str, ...], command: str, flag: str) -> str:
    """A URL given as a command's argument (the config's and the environment's were checked at load):
    a broken one is said as an argument (exit code 2 all the same)."""
    try:
        return check_url(value, schemes, command, flag)
    except ConfigError as e:
        raise UsageError(e.where, e.field, e.rule) from None


def locate(config: str | None, redis_url: str | None = None, pulsar_url: str | None = None) -> Target:
    """Connection URLs for an operator command (the config already applies the environment)."""
    settings = load_settings(config) if config else parse_settings({})
    redis_url = redis_url or settings.redis.url
    pulsar_url = pulsar_url or settings.pulsar.service_url
    if not redis_url or not pulsar_url:
        endpoints = recorded_endpoints(Path(settings.state_dir))
        if settings.redis.mode == "standalone":  # a cluster or Sentinels are named by the config
            redis_url = redis_url or endpoints.get("redis_url")
        pulsar_url = pulsar_url or endpoints.get("pulsar_url")
        metrics_url = endpoints.get("pulsar_metrics_url") if pulsar_url == endpoints.get("pulsar_url") else None
    else:
        metrics_url = None
    return Target(settings, redis_url, pulsar_url, configured=config is not None, pulsar_metrics_url=metrics_url)


def _load_definitions(path: str) -> list[Any]:
    data = read_yaml(path, "subs apply")
    if isinstance(data, dict) and "subscriptions" in data:
        data = data["subscriptions"]
    return data if isinstance(data, list) else [data]


def _time(entry: dict[str, Any]) -> str:
    try:
        return rfc3339(int(entry.get("at_ms", 0)))
    except (ValueError, TypeError, OverflowError, OSError):
        return "?"


def _entries(raw: list[bytes | str]) -> list[dict[str, Any]]:
    """History entries read from Redis; one that is not a JSON object shows as `unreadable`."""
    out: list[dict[str, Any]] = []
    for item in raw:
        try:
            entry = json.loads(item)
        except ValueError:
            entry = None
        if not isinstance(entry, dict):
            entry = {"event": "unreadable", "detail": safe_text(item)[:80]}
        entry.setdefault("at_ms", 0)
        entry.setdefault("message_id", "?")
        out.append(entry)
    return out


def _what(entry: dict[str, Any]) -> str:
    """An attempt's result (ack, nack, timeout, ...) or an event's name (dead-lettered, discarded, ...)."""
    return str(entry.get("result") or entry.get("event", ""))


def _status(entry: dict[str, Any]) -> str:
    """An attempt's status, or where a dead-letter event sent the message."""
    return str(entry.get("status", entry.get("topic", "")))


def _health(reports: list[dict[str, str]]) -> dict[str, Any]:
    """What the serving workers report beyond counters (fleet/status.py): the broker's backlog, the
    age of the oldest message in hand, and their last minutes of attempts added up (core/recent.py)."""
    backlogs = [attempts.counter(r["backlog"]) for r in reports if "backlog" in r]
    oldest = [attempts.counter(r["oldest_unsettled_ms"]) for r in reports if "oldest_unsettled_ms" in r]
    summaries = []
    for report in reports:
        try:
            summaries.append(json.loads(report.get("recent", "")))
        except ValueError:
            continue  # none yet (an earlier version's report) or garbage; merge leaves out what does not add up
    now_ms = time.time() * 1000
    return {"backlog": max(backlogs) if backlogs else None,
            "oldest_unacked_age_seconds": round(max(0.0, now_ms - min(oldest)) / 1000, 1) if oldest else None,
            "recent": recent.merge(summaries)}


def _max_workers(definition: dict[str, Any]) -> int:
    """The slots whose holders serve a subscription, from its definition (garbage: one)."""
    value = definition.get("max_workers", 1)
    return value if isinstance(value, int) and 1 <= value <= MAX_WORKERS else 1


def _config_definition(sub: Subscription) -> dict[str, Any]:
    """A config file's subscription as that file says it (secrets are references there, never values)."""
    if sub.definition is not None:
        return dict(sub.definition)
    return {"type": sub.type, "max_workers": sub.max_workers}


def _not_in_registry(name: str) -> NotFound:
    """For a subscription served but whose definition is nowhere to read: a worker serves it from its
    own config file and has not published it (it runs an earlier version), and this command was not
    given that file."""
    return NotFound(f"{name}: its definition is not in the registry and no worker has published it: pass "
                    "--config with the worker.yaml that defines it")


def _endpoint_host(definition: dict[str, Any]) -> str:
    """The host a definition pushes to ("" when it names none a URL parser reads)."""
    deliver = definition.get("deliver")
    push = deliver.get("push") if isinstance(deliver, dict) else None
    url = push.get("url") if isinstance(push, dict) else None
    try:
        return (urlsplit(url).hostname or "") if isinstance(url, str) else ""
    except ValueError:
        return ""


class Admin:
    """The `subs` and `show` commands; each returns the text to print."""

    def __init__(self, target: Target, command: str) -> None:
        self.client = target.redis(command)  # `command` names the command in a missing-URL error
        self.static = {s.key: s for s in target.settings.subscriptions}
        # With the worker's config, entries are checked as its workers check them (its destination
        # policy, its OIDC setting); without it, by the definitions' own rules.
        self.registry = Registry(self.client, target.fleet, self.static,
                                 admit_for(target.settings) if target.configured else None,
                                 target.settings.fleet.max_subscriptions_per_project if target.configured else None)
        self.lease_seconds = target.settings.fleet.lease_seconds
        self.fleet = target.fleet
        self._layout_claimed = False

    async def writable(self) -> None:
        """Before each write: Redis holds no layout newer than this release's (fleet/layout.py), read
        each time (a running admin process must not keep what it read at its first write)."""
        if not self._layout_claimed:
            await layout.claim(self.client)
            self._layout_claimed = True
        else:
            await layout.writable(self.client)

    async def existing(self, name: str) -> str:
        """The key of a subscription in the registry, the given config, or served by a worker (a
        subscription from a worker's own config file); or a clear error."""
        # A bare name may be a config subscription a worker serves: find its key.
        served = await self._served() if "/" not in name else set()
        paused = await self.registry.paused()
        key = await self.registry.resolve(name, also=set(self.static) | served | paused)
        if key in self.static or key in paused or await self.client.hexists(self.registry.hash, key):
            return key
        if await self.client.exists(keys.lease_key(key), keys.holder_key(key), keys.status_key(key),
                                    keys.config_definition_key(key)):
            return key
        raise NotFound(f"{name}: no such subscription (not in the registry, the given config, "
                       "or served by a worker)")

    async def _served(self) -> set[str]:
        """The keys of the subscriptions some worker (or seek command) holds a lease or record of."""
        served: set[str] = set()
        for pattern in (keys.lease_key("*"), keys.holder_key("*")):
            async for found in self.client.scan_iter(match=pattern, count=1000):
                key = keys.subscription_of(safe_text(found))
                if valid_key(key):  # anything else is garbage, not a subscription
                    served.add(key)
        return served

    async def definition(self, name: str) -> Subscription:
        """A subscription's definition: from the given config, the registry, or as the worker serving
        it from its own config file publishes it (fleet/published.py)."""
        key = await self.existing(name)
        sub = self.static.get(key)
        if sub is not None:
            return sub
        definitions = await self.registry.definitions()
        if key not in definitions:
            own = await published(self.client, key)
            if own is None:
                raise _not_in_registry(name)
            return parse_subscription(own, key, trusted=True, stored=True)
        if not is_push(definitions[key]):
            raise ConfigError("registry", name, "is not a push subscription")
        return self.registry.check(definitions[key], key)

    async def seek(self, name: str, target: SeekTarget, pulsar: PulsarSettings, wait: float = 60.0) -> Output:
        """Move the subscription's cursor (through the worker serving it, or directly when none does)
        and reset its attempt counts."""
        await self.writable()
        key = await self.existing(name)
        await self.registry.refuse_if_expired(key, "seek")
        result = await seek_by_command(self.client, self.fleet, self.registry.channel, key, target,
                                       lambda: self.definition(name), pulsar, self.lease_seconds, wait)
        if result.get("status") != "done":
            tries = result.get("tries", 1)
            raise PushWorkerError(f"{key}: the seek failed on worker {result.get('worker')} after {tries} tries: "
                                  f"{result.get('error')}; the cursor did not move. Check the broker's health, "
                                  "then run the command again")
        out = {"subscription": key, "result": "sought", "to": target.describe(), "by": result["worker"],
               "attempt_counters_reset": result.get("forgotten_attempts", 0)}
        return Output(out, f"{key}: sought to {target.describe()} by {out['by']}; "
                           f"{out['attempt_counters_reset']} attempt counter(s) reset")

    async def queue(self, name: str, state: str, limit: int) -> Output:
        """Messages of one subscription in flight (first attempt under way) or retrying (failed at
        least once, waiting or being retried), from their attempt records. (`dead`: see dlq.)"""
        key = await self.existing(name)
        rows: list[dict[str, Any]] = []
        def wanted(record: attempts.StoredRecord) -> bool:
            return not (record.discard or record.settled) and record.retrying == (state == "retrying")

        for message_id, record in await attempts.records(self.client, key, wanted, limit):
            rows.append({"message_id": message_id, "attempts": record.attempts, "last_status": record.last_status})
        rows.sort(key=lambda r: r["message_id"])
        data = {"subscription": key, "state": state, "messages": rows}
        if not rows:
            return Output(data, f"{key}: no {state} messages")
        return Output(data, f"{key}: {len(rows)} {state} message(s)\n" + table(rows, list(rows[0])))

    async def history(self, name: str, limit: int) -> Output:
        """Recently settled messages of one subscription, newest first: how each ended."""
        key = await self.existing(name)
        entries = _entries(await self.client.lrange(keys.settled_key(key), 0, limit - 1))
        data = {"subscription": key, "messages": entries}
        if not entries:
            return Output(data, f"{key}: nothing settled recently")
        rows = [{"time": _time(e), "message_id": e["message_id"],
                 "outcome": {"ack": "delivered"}.get(_what(e), _what(e)), "attempts": e.get("attempt", ""),
                 "status": _status(e), "worker": e.get("worker", "")} for e in entries]
        return Output(data, table(rows, list(rows[0])))

    async def discard(self, message_id: str, name: str, wait: float) -> Output:
        """Settle one message the fleet has tried without delivering it: the worker holding it acks
        it at its next attempt and records `discarded` in its history. A message the subscription's
        state does not know (never tried: still in the backlog; or settled longer ago than
        `redis.settled_ttl_seconds`) is NotFound: marking it would say "will be discarded" of a
        message that may never come, and leave a record behind for a week."""
        await self.writable()
        key = await self.existing(name)
        await self.registry.refuse_if_expired(key, "discard")
        marked = await attempts.mark_discard(self.client, key, message_id)
        if marked == -1:
            raise NotFound(f"{key}: no message {message_id} known (never tried, or settled longer ago than "
                           "redis.settled_ttl_seconds): nothing to discard; `purge` or `subs seek` skip "
                           "messages still in the backlog")
        if not marked:
            return Output({"subscription": key, "message_id": message_id, "result": "already_settled"},
                          f"{key}: {message_id} was already settled (acked, dead-lettered or discarded): "
                          "nothing to discard")
        deadline = time.monotonic() + wait
        done = False
        while not done and time.monotonic() < deadline:
            # Once settled, the worker turns the record into a settled marker (it expires later).
            done = await attempts.is_settled(self.client, key, message_id)
            if not done:
                await asyncio.sleep(0.2)
        result = {"subscription": key, "message_id": message_id, "result": "discarded" if done else "pending"}
        if done:
            return Output(result, f"{key}: {message_id} discarded")
        return Output(result, f"{key}: {message_id} will be discarded when a worker next tries it (it is waiting "
                              "for a retry)")

    async def purge(self, name: str, pulsar: PulsarSettings) -> Output:
        """Skip the whole backlog: the cursor moves to the latest message; attempt counts reset."""
        sought = (await self.seek(name, SeekTarget("latest"), pulsar)).data
        return Output({**sought, "result": "purged"},
                      f"{sought['subscription']}: purged (backlog skipped) by {sought['by']}; "
                      f"{sought['attempt_counters_reset']} attempt counter(s) reset")

    async def pause(self, name: str, paused: bool, wait: float) -> Output:
        """Pause or resume; a pause returns once no worker delivers for it any more (up to `wait` s)."""
        await self.writable()
        key = await self.existing(name)
        await self.registry.refuse_if_expired(key, "pause" if paused else "resume")
        suspended = not paused and await self._state(key) == State.SUSPENDED
        changed = await self.registry.set_paused(key, paused)
        if not paused:
            await self.registry.mark_resumed(key)  # closes an open breaker too
        what = ("paused" if paused else "resumed") if changed else \
            ("already paused" if paused else "breaker closed" if suspended else "not paused")
        owner = ""
        if paused:
            deadline = time.monotonic() + wait
            # Every slot's holder drains its requests under way, then releases its lease.
            while (owner := ",".join(sorted(await holders(self.client, self.fleet, key, MAX_WORKERS)))) and \
                    time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.2)
        result = {"subscription": key, "result": what, "still_draining": owner or None}
        tail = f" (worker {result['still_draining']} is still draining)" if owner else ""
        return Output(result, f"{key}: {what}{tail}")

    async def show(self, message_id: str, name: str) -> Output:
        """A message's delivery attempts in one subscription, oldest first."""
        key = await self.existing(name)
        raw = await attempts.stored_history(self.client, key, message_id)
        pending = await attempts.pending_attempts(self.client, key, message_id)
        entries = _entries(raw)
        if not entries and pending is None:
            raise NotFound(f"no attempt history for message {message_id} in {key} (kept for "
                           "redis.history_ttl_seconds; ids look like ledger:entry:partition:batch)")
        data = {"subscription": key, "message_id": message_id, "history": entries,
                "attempts_in_progress": pending}
        rows = [{"time": _time(e), "attempt": e.get("attempt", ""), "result": _what(e),
                 "status": _status(e), "latency_ms": e.get("latency_ms", ""), "worker": e.get("worker", ""),
                 "detail": e.get("detail") or e.get("answer", "")} for e in entries]
        out = f"message {message_id} in {key}\n" + table(rows, list(rows[0]) if rows else ["time"])
        if pending is not None:
            out += f"\nnot settled yet: {pending} attempt(s) counted so far"
        return Output(data, out)

    async def close(self) -> None:
        await self.client.aclose()

    async def apply(self, path: str) -> Output:
        """Validate everything before writing anything, and write atomically: a bad file changes nothing."""
        await self.writable()
        definitions = _load_definitions(path)
        await self.refuse_workers_own(definitions)
        results = [{"subscription": sub.key, "result": what}
                   for sub, what in await self.registry.apply_all(definitions)]
        return Output(results, "\n".join(f"{r['subscription']}: {r['result']}" for r in results))

    async def refuse_workers_own(self, definitions: list[Any]) -> None:
        """A subscription a worker serves from its own config file is read-only to the registry's
        commands: a registry entry would not take its place (workers keep the file's), only confuse."""
        for data in definitions:
            try:
                key = parse_subscription(data).key
            except ConfigError:
                continue  # apply_all says what is wrong with it
            if key not in self.static and await published(self.client, key) is not None:
                raise ConfigError(f"subscription {key!r}", "name", "is a subscription of a worker's config file "
                                  "(read-only here): change it in that file")

    async def delete(self, name: str | None, topic: str | None = None) -> Output:
        """Delete one subscription, or (`topic`) every subscription of a deleted topic; their owners
        stop within a second or two and their Redis state is cleared."""
        await self.writable()
        if topic is not None:
            deleted = await self.registry.delete_topic(topic)
        else:
            assert name is not None
            key = await self.registry.resolve(name)
            if not await self.registry.delete(key):
                if await published(self.client, key) is not None:
                    raise ConfigError(f"subscription {key!r}", "name", "is a subscription of a worker's config "
                                      "file (read-only here): remove it from that file")
                raise NotFound(f"{name}: no such subscription")
            deleted = [key]
        for key in deleted:  # the owner clears it too; this covers subscriptions no worker held
            await clear_state(self.client, key)
        return Output([{"subscription": k, "result": "deleted"} for k in deleted],
                      "\n".join(f"{k}: deleted" for k in deleted) or f"no subscriptions of {topic}")

    async def _state(self, key: str) -> str:
        """The state its owner last reported ("" when none)."""
        try:
            return safe_text(await self.client.hget(keys.status_key(key), "state") or b"")
        except ResponseError:  # a status key of the wrong type
            return ""

    async def _status(self, key: str, slot: int) -> dict[str, str]:
        try:
            report = await self.client.hgetall(keys.status_key(key, slot))
        except ResponseError:  # a status key of the wrong type: no status to show
            return {}
        return {safe_text(k): safe_text(v) for k, v in report.items()}

    async def _row(self, key: str, definition: dict[str, Any],
                   held_back: dict[str, tuple[str, str]]) -> dict[str, Any]:
        """The subscription's state and counters, as the workers serving its slots report them: every
        one of them in `owner`, the counters summed, the state and reason of its slot 0."""
        slots = _max_workers(definition)
        holders = await owners(self.client, self.fleet, key, slots)
        status = await self._status(key, 0)
        reports = [status] + [await self._status(key, slot) for slot in range(1, slots) if holders[slot]]
        project, _, name = key.partition("/")
        serving = [h for h in holders if h]
        # A status outlives its writer (it is refreshed every few minutes): without a live owner of
        # slot 0 the subscription is Unowned, whatever the last status said.
        state, reason = held_back.get(key) or ((status.get("state") or "Starting", status.get("reason", ""))
                                               if holders[0] else ("Unowned", ""))
        return {
            "project": project, "name": name, "type": definition.get("type", "shared"),
            "endpoint": _endpoint_host(definition),
            "owner": ",".join(serving) or "-",
            "state": state, "reason": reason,
            **{field: sum(attempts.counter(report.get(field)) for report in reports)
               for field in ("acked", "retried", "dead_lettered", "unsettled")},
            **_health(reports),
        }

    async def _held_back(self) -> dict[str, tuple[str, str]]:
        """Keys no worker serves on purpose, with their state and why (a quarantine's record)."""
        records = await self.registry.quarantined()
        out = {key: (str(State.QUARANTINED), quarantine.describe(quarantine.parse_record(records[key])))
               if key in records else (str(State.PAUSED), "") for key in await self.registry.paused()}
        out.update(dict.fromkeys(await self.registry.expired(), (str(State.EXPIRED), "")))
        return out

    async def list(self) -> Output:
        """Every subscription of the registry, the given config, and the workers' own config files
        (`source`: registry, config, worker), with its status; an invalid registry entry is a row in
        state `Invalid` with the reason. Of a worker's own, the type is not known here (`-`)."""
        entries: dict[tuple[str, str], Any] = {(k, "worker"): {"type": "-"}
                                               for k in await self._served() | await self.registry.paused()}
        registry = await self.registry.entries()
        for key in set(registry) | set(self.static):  # a worker's own is known better now
            entries.pop((key, "worker"), None)
        for key, source in [k for k in entries if k[1] == "worker"]:  # as its worker publishes it
            own = await published(self.client, key)
            if own is not None:
                entries[(key, source)] = own
        entries.update({(k, "config"): _config_definition(s) for k, s in self.static.items()})
        # A registry entry that shadows a config subscription is a row of its own: Invalid, with why.
        entries.update({(k, "registry"): e if isinstance(e, str) else e[0] for k, e in registry.items()})
        held_back = await self._held_back()
        rows = []
        for (key, source), entry in sorted(entries.items()):
            if isinstance(entry, str):
                project, _, name = key.partition("/")
                rows.append({"project": project, "name": name, "type": "-", "owner": "-", "state": "Invalid",
                             "reason": entry, "acked": 0, "retried": 0, "dead_lettered": 0, "unsettled": 0,
                             "source": source})
            else:
                rows.append({**await self._row(key, entry, held_back), "source": source})
        if not rows:
            return Output(rows, "no subscriptions in the registry, the given config, or served by a worker")
        return Output(rows, table(rows, ["project", "name", "type", "owner", "state", "reason", "acked", "retried",
                                         "dead_lettered", "unsettled", "source"]))

    async def get(self, name: str) -> Output:
        """A subscription's definition and status, wherever it is defined: the registry, the given
        config file or a worker's own (as it publishes it); `status.source` says which. A config
        file's definition names its secrets by reference, as the registry's does."""
        key = await self.existing(name)
        definitions = await self.registry.definitions()
        out: dict[str, Any]
        own = None if key in definitions or key in self.static else await published(self.client, key)
        if key in definitions:
            definition, out = definitions[key], {"definition": definitions[key]}
        elif key in self.static:  # as the given config file says it (secrets by reference): read-only here
            definition = _config_definition(self.static[key])
            out = {"definition": definition, "source": "config"}
        elif own is not None:  # a worker's own, as it publishes it: read-only here
            definition, out = own, {"definition": own, "source": "worker"}
        else:
            raise _not_in_registry(name)
        source = out.pop("source", "registry")
        stored = self.static.get(key) or self._stored_subscription(key, definition)
        if stored is not None and stored.rate_limit is not None:  # as applied: the burst's default included
            out["rate_limit"] = {"messages_per_second": stored.rate_limit.messages_per_second,
                                 "burst": stored.rate_limit.burst}
        if stored is not None:  # as applied: on by default
            out["breaker"] = "off" if stored.breaker is None else dataclasses.asdict(stored.breaker)
        if stored is not None and stored.batch is not None:  # as applied: the defaults included
            out["batch"] = dataclasses.asdict(stored.batch)
        # One `source`, in the status as in `list`'s rows: where the definition lives.
        out["status"] = {**await self._row(key, definition, await self._held_back()), "source": source}
        stored = None if own is not None else stored
        if stored is not None and stored.filter is not None and stored.filter.mixed_at is not None:
            # Stored before such filters were refused: it keeps its reading, which Google's differs from.
            out["warnings"] = [f"filter: {MIXED.format(stored.filter.mixed_at)} (it reads NOT, then AND, "
                               "then OR here; Google's emulator reads OR before AND)"]
        return Output(out, people_yaml(out))

    def _stored_subscription(self, key: str, definition: dict[str, Any]) -> Subscription | None:
        try:
            return self.registry.check(definition, key, stored=True)
        except ConfigError:
            return None
