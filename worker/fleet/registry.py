"""The live subscription registry in Redis, shared by a fleet.

Every entry is untrusted: the control plane writes it on behalf of a project. The field
`<project>/<name>` is authoritative: the definition must be that subscription of that project (its
name, its topics in that project's tenant), may name only that project's secrets, must pass the
worker's admission (`admission.admit`), and must not be a subscription of the operator's config
file. An entry that breaks any of these is Invalid with the reason, and nothing is served for it.

Layout (all under the fleet's hash tag): `pw:{fleet/<name>}:registry` hash of subscription key
(`tenant/name`) -> JSON definition; `...:version` counter bumped on every change, and `...:changes`
a stream with one entry per bump naming the keys it changed (so that a worker reads only those:
`registry_follower.py`); changes are also announced on the channel `...:events`. `...:paused` is
the set of paused subscription keys (config or registry ones): no worker serves them, and their
backlog waits in the broker; `...:quarantined` holds, for the paused ones a worker quarantined
(`fleet/quarantine.py`), when and why (a resume or a pause by hand clears it). Edits follow the
platform's PATCH rules: topic, type and start_from are immutable (and filter, as in Google's push
subscriptions).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import orjson
from redis.exceptions import ResponseError, WatchError

from worker.core import keys
from worker.model.subscriptions import Subscription, is_push, parse_subscription, valid_key
from worker.runtime.errors import ConfigError, NotFound
from worker.state.redis_client import AsyncClient, safe_text

Admit = Callable[[Subscription], None]  # a worker's admission: raises ConfigError

IMMUTABLE = ("topic", "type", "start_from", "filter")
RESUMED_TTL_SECONDS = 24 * 3600  # a resume is read within a heartbeat; kept longer only for operators
CHANGE_LOG_LENGTH = 10_000  # entries kept in the change log (about); a worker further behind reads everything
MAX_DEFINITION_BYTES = 16 * 1024  # a definition's JSON; sixty 1 MB entries slowed every project's deliveries
Entry = tuple[dict[str, Any], Subscription | None] | str  # a definition (and its subscription), or why not


def _defaults(data: dict[str, Any]) -> dict[str, Any]:
    return {"type": data.get("type", "shared"), "start_from": data.get("start_from", "all"), "topic": data.get("topic"),
            "filter": data.get("filter")}


def _change(sub: Subscription, current: bytes | str | None, data: dict[str, Any]) -> str:
    """What writing `data` over `current` would be: created, updated or unchanged; refuses
    changes to immutable fields."""
    if current is None:
        return "created"
    old = orjson.loads(current)
    if old == data:
        return "unchanged"
    for field in IMMUTABLE:
        if _defaults(old)[field] != _defaults(data)[field]:
            raise ConfigError(f"subscription {sub.name!r}", field,
                              "is immutable after creation (delete and recreate to change it)")
    return "updated"


def _topic_of(value: bytes | str) -> Any:
    try:
        data = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    return data.get("topic") if isinstance(data, dict) else None


async def clear_state(client: AsyncClient, key: str) -> int:
    """Delete every Redis key of one subscription (attempt counters, histories, status, lease). A key
    that is not a subscription's (garbage in the registry, `fleet/...`) has no state: nothing is deleted."""
    if not valid_key(key):
        return 0
    return await delete_matching(client, keys.pattern(key))


async def delete_matching(client: AsyncClient, pattern: str) -> int:
    """Delete the keys matching a SCAN pattern, in batches."""
    removed = 0
    batch: list[bytes] = []
    async for name in client.scan_iter(match=pattern, count=1000):
        batch.append(name)
        if len(batch) >= 500:
            removed += await client.delete(*batch)
            batch = []
    if batch:
        removed += await client.delete(*batch)
    return removed


def bound_to_field(sub: Subscription, field: str) -> None:
    """A registry entry defines exactly the subscription its field names: the control plane wrote the
    field for that project, so a definition of another project's subscription (or name) is refused."""
    if not valid_key(field):
        raise ConfigError(f"registry field {field[:200]!r}", "field",
                          "must be <project>/<name>, with the project's tenant p-<short> and a subscription name")
    if sub.key != field:
        raise ConfigError(f"registry field {field!r}", "definition",
                          f"defines {sub.key} (a registry entry may define only the subscription its field names, "
                          "with its topics in that project's tenant)")


class Registry:
    """Read and write subscription definitions of one fleet. `static`: the keys of the operator's
    config-file subscriptions (a registry entry never shadows one); `admit`: the worker's own checks
    (its destination policy and OIDC setting), when known."""

    def __init__(self, client: AsyncClient, fleet: str, static: Iterable[str] = (), admit: Admit | None = None,
                 max_per_project: int | None = None) -> None:
        self.client = client
        self.fleet = fleet
        self.static = frozenset(static)
        self.admit = admit
        self.max_per_project = max_per_project
        self._parsed: dict[tuple[bytes | str, bytes | str], Entry] = {}  # (field, value) as last read -> its entry
        self.hash = keys.fleet_key(fleet, "registry")
        self.version_key = keys.fleet_key(fleet, "version")
        self.changes_key = keys.fleet_key(fleet, "changes")
        self.channel = keys.fleet_key(fleet, "events")
        self.paused_key = keys.fleet_key(fleet, "paused")
        self.expired_key = keys.fleet_key(fleet, "expired")
        self.quarantined_key = keys.fleet_key(fleet, "quarantined")

    async def version(self) -> int:
        return int(await self.client.get(self.version_key) or 0)

    async def snapshot(self) -> dict[str, Subscription]:
        """Every valid push definition; an entry that no longer validates is skipped, not fatal."""
        return (await self.read())[0]

    async def read(self) -> tuple[dict[str, Subscription], dict[str, str]]:
        """Every valid push definition by key, and every invalid entry with the reason it is ignored."""
        return self.split(await self.entries())

    async def entries(self) -> dict[str, Entry]:
        """Each entry by key: its definition and, for push ones, the subscription; or, for an entry
        that cannot be used, why (an entry is untrusted input: invalid JSON or UTF-8, not a mapping,
        over the size limit, a definition that no longer validates, one too many of its project).
        An entry is parsed again only when its value changed: a registry change costs the work of
        what changed (5,000 entries with long filters took 2.75 s to parse, on every change)."""
        out: dict[str, Entry] = {}
        cache: dict[tuple[bytes | str, bytes | str], Entry] = {}
        for name, value in (await self.client.hgetall(self.hash)).items():
            known = self._parsed.get((name, value))
            out[safe_text(name)] = cache[(name, value)] = known if known is not None else self.entry(name, value)
        self._parsed = cache
        return self.limit_per_project(out)

    @staticmethod
    def split(entries: dict[str, Entry]) -> tuple[dict[str, Subscription], dict[str, str]]:
        """The valid push subscriptions by key, and the invalid entries with the reason."""
        valid: dict[str, Subscription] = {}
        invalid: dict[str, str] = {}
        for key, entry in entries.items():
            if isinstance(entry, str):
                invalid[key] = entry
            elif entry[1] is not None:
                valid[entry[1].key] = entry[1]
        return valid, invalid

    def entry(self, name: bytes | str, value: bytes | str) -> Entry:
        key = safe_text(name)
        if len(value) > MAX_DEFINITION_BYTES:
            return f"definition: is {len(value)} bytes (at most {MAX_DEFINITION_BYTES})"
        try:
            data = orjson.loads(value)
            if not isinstance(data, dict):
                raise ConfigError("", "definition", "must be a JSON object")
            return data, self.check(data, key, stored=True) if is_push(data) else None
        except ConfigError as e:
            return str(e)
        except (orjson.JSONDecodeError, ValueError, TypeError) as e:
            return f"not a JSON definition ({type(e).__name__}: {e})"[:300]

    def limit_per_project(self, entries: dict[str, Entry]) -> dict[str, Entry]:
        """A project's push entries beyond `max_per_project` (in key order) are Invalid (in place)."""
        if self.max_per_project is None:
            return entries
        counts: dict[str, int] = {}
        for key in sorted(entries):
            entry = entries[key]
            if isinstance(entry, str) or entry[1] is None:
                continue
            project = entry[1].tenant
            counts[project] = counts.get(project, 0) + 1
            if counts[project] > self.max_per_project:
                entries[key] = (f"subscription {key!r}: project {project} has more than {self.max_per_project} "
                                "push subscriptions (fleet.max_subscriptions_per_project)")
        return entries

    def check(self, data: Any, field: str | None = None, where: str = "", stored: bool = False) -> Subscription:
        """The subscription an entry defines, if it may: its own rules, bound to its `field` (None:
        about to be written at its own key), not a config-file subscription, admitted by the worker;
        else ConfigError. `stored`: an entry read back (written under older rules, maybe)."""
        sub = parse_subscription(data, where, stored=stored)
        if field is not None:
            bound_to_field(sub, field)
        if sub.key in self.static:
            raise ConfigError(f"subscription {sub.key!r}", "name",
                              "is a subscription of the workers' config file: the registry cannot define it again "
                              "(the config's definition keeps serving)")
        if self.admit is not None:
            self.admit(sub)
        return sub

    async def definitions(self) -> dict[str, dict[str, Any]]:
        """The usable definitions by key (invalid entries left out: see `entries`)."""
        return {k: e[0] for k, e in (await self.entries()).items() if not isinstance(e, str)}

    async def apply(self, data: Any) -> tuple[Subscription, str]:
        """Create or edit one subscription; returns it and `created`, `updated` or `unchanged`."""
        [result] = await self.apply_all([data])
        return result

    async def check_change(self, data: Any) -> str:
        """What `apply_all` would make of one definition over what is stored (created, updated or
        unchanged), refusing what it would refuse (an immutable field changed, an Expired one); writes
        nothing: the console's review says what its save will."""
        sub = self.check(data)
        if sub.key in {safe_text(k) for k in await self.client.smembers(self.expired_key)}:
            raise ConfigError(f"subscription {sub.name!r}", "state", "is Expired: only deletion is allowed")
        return _change(sub, await self.client.hget(self.hash, sub.key), data)

    async def apply_all(self, definitions: list[Any]) -> list[tuple[Subscription, str]]:
        """Create or edit subscriptions, all or nothing: every definition is validated, and checked
        against what is stored (immutable fields), before one atomic write of all of them."""
        subs = [self.check(d, where=f"definition {i}") for i, d in enumerate(definitions)]
        seen: set[str] = set()
        for sub, data in zip(subs, definitions, strict=True):
            if sub.key in seen:
                raise ConfigError(f"subscription {sub.name!r}", "name", "is defined twice in this batch")
            seen.add(sub.key)
            if len(orjson.dumps(data)) > MAX_DEFINITION_BYTES:
                raise ConfigError(f"subscription {sub.name!r}", "definition",
                                  f"is over {MAX_DEFINITION_BYTES} bytes as JSON")
        async with self.client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(self.hash)
                    results = []
                    expired = {safe_text(k) for k in await pipe.smembers(self.expired_key)}
                    if self.max_per_project is not None:
                        self._refuse_over_limit(subs, {safe_text(k) for k in await pipe.hkeys(self.hash)})
                    for sub, data in zip(subs, definitions, strict=True):
                        if sub.key in expired:
                            raise ConfigError(f"subscription {sub.name!r}", "state",
                                              "is Expired: only deletion is allowed")
                        current = await pipe.hget(self.hash, sub.key)
                        results.append((sub, _change(sub, current, data)))
                    changed = [(sub, data) for (sub, what), data in zip(results, definitions, strict=True)
                               if what != "unchanged"]
                    if not changed:
                        return results
                    pipe.multi()  # type: ignore[no-untyped-call]
                    for sub, data in changed:
                        pipe.hset(self.hash, sub.key, orjson.dumps(data))
                    await self._execute_logged(pipe, [sub.key for sub, _ in changed])
                    await self._announce(b"registry")
                    return results
                except WatchError:
                    continue

    def _refuse_over_limit(self, subs: list[Subscription], stored: set[str]) -> None:
        assert self.max_per_project is not None
        after = stored | {sub.key for sub in subs}
        for sub in subs:
            count = sum(1 for key in after if key.split("/", 1)[0] == sub.tenant)
            if sub.key not in stored and count > self.max_per_project:
                raise ConfigError(f"subscription {sub.name!r}", "name",
                                  f"would be one of {count} subscriptions of project {sub.tenant}: at most "
                                  f"{self.max_per_project} (fleet.max_subscriptions_per_project)")

    async def _execute_logged(self, pipe: Any, changed: list[str]) -> list[Any]:
        """Execute a transaction of registry writes with the version bump and its change-log entry;
        returns the writes' results. A change log that cannot be written (a key of the wrong type)
        does not fail the change: without its entry workers read the whole registry, as they do
        after a change by an earlier version of push-worker, which bumps the version alone."""
        pipe.incr(self.version_key)
        pipe.xadd(self.changes_key, {"keys": orjson.dumps(changed)}, maxlen=CHANGE_LOG_LENGTH, approximate=True)
        results = await pipe.execute(raise_on_error=False)
        for result in results[:-1]:
            if isinstance(result, Exception):
                raise result
        return list(results[:-2])

    async def _announce(self, what: bytes) -> None:
        """Tell the workers after the change is written (not inside the transaction: Redis Cluster
        refuses PUBLISH there). A lost announcement costs up to five heartbeats: workers also read the
        version every fifth."""
        await self.client.publish(self.channel, what)

    async def paused(self) -> set[str]:
        return {safe_text(k) for k in await self.client.smembers(self.paused_key)}

    async def expired(self) -> set[str]:
        return {safe_text(k) for k in await self.client.smembers(self.expired_key)}

    async def expire(self, key: str) -> None:
        """Mark a subscription Expired: nobody serves it any more; only deletion is allowed."""
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.sadd(self.expired_key, key)
            await self._execute_logged(pipe, [key])
            await self._announce(b"expired")

    async def refuse_if_expired(self, key: str, what: str) -> None:
        if await self.client.sismember(self.expired_key, key):
            raise ConfigError(f"subscription {key!r}", "state", f"is Expired: only deletion is allowed (not {what})")

    async def set_paused(self, key: str, paused: bool) -> bool:
        """Pause or resume one subscription by hand (a quarantine ends either way: resumed, it is tried
        again; paused, it stays paused for the operator's reason); False when it already was in that
        state and not quarantined."""
        async with self.client.pipeline(transaction=True) as pipe:
            if paused:
                pipe.sadd(self.paused_key, key)
            else:
                pipe.srem(self.paused_key, key)
            pipe.hdel(self.quarantined_key, key)
            changed, lifted = await self._execute_logged(pipe, [key])
            await self._announce(b"paused")
        return bool(changed or lifted)

    async def quarantine(self, key: str, record: bytes) -> None:
        """Quarantine a subscription whose message killed its workers: paused (so every worker, the
        previous release's too, holds it back) with the record of when and why."""
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.sadd(self.paused_key, key)
            pipe.hset(self.quarantined_key, key, record)
            await self._execute_logged(pipe, [key])
            await self._announce(b"paused")

    async def quarantined(self) -> dict[str, bytes]:
        """The quarantine records by key (only a paused key is shown quarantined); none when the key
        holds garbage of another type (the subscriptions are then shown Paused)."""
        try:
            records = await self.client.hgetall(self.quarantined_key)
        except ResponseError:
            return {}
        return {safe_text(k): v if isinstance(v, bytes) else v.encode() for k, v in records.items()}

    async def mark_resumed(self, key: str) -> None:
        """`subs resume`: the worker serving `key` closes its breaker if it opened before now."""
        await self.client.set(keys.resumed_key(key), int(time.time() * 1000), ex=RESUMED_TTL_SECONDS)
        await self._announce(b"resumed")

    async def delete_topic(self, topic: str) -> list[str]:
        """What the control plane does when a topic is deleted: delete every subscription of it, at once."""
        async with self.client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(self.hash)
                    raw = await pipe.hgetall(self.hash)
                    doomed = sorted(safe_text(k) for k, v in raw.items() if _topic_of(v) == topic)
                    if not doomed:
                        return []
                    pipe.multi()  # type: ignore[no-untyped-call]
                    pipe.hdel(self.hash, *doomed)
                    pipe.srem(self.paused_key, *doomed)
                    pipe.srem(self.expired_key, *doomed)
                    pipe.hdel(self.quarantined_key, *doomed)
                    await self._execute_logged(pipe, doomed)
                    await self._announce(b"registry")
                    return doomed
                except WatchError:
                    continue

    async def delete(self, key: str) -> bool:
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hdel(self.hash, key)
            pipe.srem(self.paused_key, key)
            pipe.srem(self.expired_key, key)
            pipe.hdel(self.quarantined_key, key)
            removed, _, was_expired, _ = await self._execute_logged(pipe, [key])
            await self._announce(b"registry")
        return bool(removed or was_expired)

    async def resolve(self, name: str, also: Iterable[str] = ()) -> str:
        """`tenant/name` as given, or the one key whose name is `name` (in the registry or `also`)."""
        if "/" in name:
            return name
        keys = {safe_text(k) for k in await self.client.hkeys(self.hash)} | set(also)
        # A field of any other shape (written by hand, or by a bug) is shown invalid by `subs list`; never a match.
        matches = [k for k in keys if valid_key(k) and k.split("/", 1)[1] == name]
        if not matches:
            raise NotFound(f"{name}: no such subscription")
        if len(matches) > 1:
            raise ConfigError("registry", name, f"is ambiguous; name the project: {', '.join(sorted(matches))}")
        return matches[0]
