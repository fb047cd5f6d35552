"""What a worker knows of the registry, kept up to date at the cost of what changed.

Every registry write bumps `...:version` and adds an entry naming the keys it changed to the change
log `...:changes` (`Registry._execute_logged`). A worker that knows the registry as of version V
reads the log's entries after the last one it applied; when they account for every bump since V,
it reads only the keys they name (their definitions and whether they are paused or expired).
Otherwise (nothing read yet, a change by an earlier version of push-worker, which bumps the version
without a log entry, a log trimmed past this worker, or a key of the wrong type) it reads the whole
registry, as every change used to: one project updating one of a thousand 16 KiB definitions twice
a second made every worker read 16 MB twice a second.
"""

from __future__ import annotations

from typing import Any

import orjson
from redis.exceptions import ResponseError

from worker.fleet.registry import Entry, Registry
from worker.model.subscriptions import Subscription
from worker.state.redis_client import safe_text

FOLLOW_AT_MOST = 1000  # log entries read in one round; further behind, the whole registry is read


def _version(raw: Any) -> int | None:
    try:
        return int(raw) if raw is not None else 0
    except ValueError:
        return None


def _pairs(flat: Any) -> list[tuple[Any, Any]]:
    """A raw HGETALL reply as pairs (a dict where a reply callback already made one)."""
    if isinstance(flat, dict):
        return list(flat.items())
    return list(zip(flat[::2], flat[1::2], strict=True))


class RegistryFollower:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.client = registry.client
        self.version: int | None = None  # of what is known; None: read everything next time
        self.log_id = "0-0"  # the last change-log entry applied
        self.entries: dict[str, Entry] = {}  # by key, before the per-project limit
        self.paused: set[str] = set()
        self.expired: set[str] = set()
        self.quarantined: dict[str, bytes] = {}  # quarantine records by key (`fleet/quarantine.py`)
        self.full_reads = 0  # how often the whole registry was read
        self.unreadable: dict[str, str] = {}  # a set that could not be read at the last full read: why

    def subscriptions(self) -> tuple[dict[str, Subscription], dict[str, str]]:
        """The valid push subscriptions by key, and the invalid entries with the reason."""
        return self.registry.split(self.registry.limit_per_project(dict(self.entries)))

    async def refresh(self) -> None:
        """Bring what is known up to date. Raises ResponseError when the registry hash cannot be read
        (a key of the wrong type): what was known stays. A paused or expired set that cannot be read
        keeps what was read of it last (`unreadable` says why)."""
        if self.version is None or not await self._follow():
            await self._read_all()

    async def _read_all(self) -> None:
        r = self.registry
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.get(r.version_key)
            pipe.xrevrange(r.changes_key, "+", "-", count=1)
            pipe.hgetall(r.hash)
            # As raw commands: redis-py's Cluster transactions hand these commands' reply callbacks
            # an argument they do not take (redis-py 8.1).
            pipe.execute_command("SMEMBERS", r.paused_key)
            pipe.execute_command("SMEMBERS", r.expired_key)
            pipe.execute_command("HGETALL", r.quarantined_key)
            version, last, values, paused, expired, quarantined = await pipe.execute(raise_on_error=False)
        if isinstance(values, Exception):
            raise values
        self.entries = {safe_text(name): r.entry(name, value) for name, value in values.items()}
        self.unreadable = {}
        if isinstance(paused, Exception):
            self.unreadable["paused set"] = str(paused)
        else:
            self.paused = {safe_text(k) for k in paused}
        if isinstance(expired, Exception):
            self.unreadable["expired set"] = str(expired)
        else:
            self.expired = {safe_text(k) for k in expired}
        if isinstance(quarantined, Exception):
            self.unreadable["quarantine records"] = str(quarantined)
        else:  # a raw HGETALL: a flat list of field, value
            self.quarantined = {safe_text(k): v for k, v in _pairs(quarantined)}
        readable = not isinstance(last, Exception) and not isinstance(version, Exception)
        self.version = _version(version) if readable else None
        self.log_id = safe_text(last[0][0]) if readable and last else "0-0"
        self.full_reads += 1

    async def _follow(self) -> bool:
        """Apply the change log since what is known; False when it does not account for every change."""
        r = self.registry
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.get(r.version_key)
            pipe.xrange(r.changes_key, "(" + self.log_id, "+", count=FOLLOW_AT_MOST)
            try:
                raw_version, log = await pipe.execute()
            except ResponseError:
                return False
        version = _version(raw_version)
        if version is None or self.version is None:
            return False
        if version == self.version:
            return True
        if len(log) != version - self.version:  # also when the version went back (the keys were reset)
            return False
        changed: set[str] = set()
        try:
            for _, fields in log:
                changed.update(str(k) for k in orjson.loads(fields[b"keys"]))
        except (KeyError, TypeError, ValueError):  # an entry not of ours: read everything
            return False
        if changed and not await self._read_keys(sorted(changed)):
            return False
        self.version = version
        self.log_id = safe_text(log[-1][0])
        return True

    async def _read_keys(self, changed: list[str]) -> bool:
        """Read the definitions and states of `changed`; False (nothing applied) if a key cannot be read."""
        r = self.registry
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hmget(r.hash, changed)
            for key in changed:
                pipe.sismember(r.paused_key, key)
                pipe.sismember(r.expired_key, key)
            pipe.hmget(r.quarantined_key, changed)
            values, *members, records = await pipe.execute(raise_on_error=False)
        if any(isinstance(result, Exception) for result in (values, *members, records)):
            return False
        for i, (key, value) in enumerate(zip(changed, values, strict=True)):
            if value is None:
                self.entries.pop(key, None)
            else:
                self.entries[key] = r.entry(key, value)
            for held_back, member in ((self.paused, members[2 * i]), (self.expired, members[2 * i + 1])):
                if member:
                    held_back.add(key)
                else:
                    held_back.discard(key)
            if records[i] is None:
                self.quarantined.pop(key, None)
            else:
                self.quarantined[key] = records[i]
        return True
