"""The definitions of the subscriptions a worker serves from its own config file, published in Redis
so that every operator command finds them without that file (`subs get`, `dlq list`, `queue --state
dead`): a command given only the Redis URL found them served but could not read their definitions.

The worker a config file's subscription is assigned to writes its definition under the
subscription's hash tag (`keys.config_definition_key`), as JSON with the worker that wrote it, when
it is assigned there and every PUBLISH_EVERY seconds after, expiring after KEEP_SECONDS: a
subscription removed from every worker's file disappears on its own. One writer a subscription:
every worker writing every definition cost Redis subscriptions x workers writes.
A definition names its secrets by reference ({secret}, {env}, {file}), never by value; a command
that needs them (`dlq redrive` signs its requests) reads them where it runs.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from typing import Any

import orjson

from worker.core import keys
from worker.model.subscriptions import Subscription
from worker.state.redis_client import AsyncClient

PUBLISH_EVERY = 1200.0
KEEP_SECONDS = 3600


class ConfigDefinitions:
    def __init__(self, client: AsyncClient, worker_id: str, static: Mapping[str, Subscription]) -> None:
        self.client = client
        self.worker_id = worker_id
        self.static = static
        self._at: dict[str, float] = {}  # key -> when its definition was written

    async def publish_if_due(self, assigned: Collection[str]) -> None:
        """Write the definitions of the config file's subscriptions `assigned` here that are due."""
        if not self.static:
            return
        now = time.monotonic()
        due = [key for key in assigned
               if key in self.static and now - self._at.get(key, -PUBLISH_EVERY) >= PUBLISH_EVERY]
        if not due:
            return
        async with self.client.pipeline(transaction=False) as pipe:
            for key in due:
                record = {"definition": self.static[key].definition, "worker": self.worker_id}
                # default=str: YAML can hold values JSON cannot (a date); shown as text, never a failed round
                pipe.set(keys.config_definition_key(key), orjson.dumps(record, default=str), ex=KEEP_SECONDS)
            await pipe.execute()
        self._at = {key: at for key, at in self._at.items() if key in assigned}
        self._at.update(dict.fromkeys(due, now))


async def published(client: AsyncClient, key: str) -> dict[str, Any] | None:
    """The definition a worker publishes for `key`, or None (none, expired, or unreadable)."""
    raw = await client.get(keys.config_definition_key(key))
    if raw is None:
        return None
    try:
        record = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    definition = record.get("definition") if isinstance(record, dict) else None
    return definition if isinstance(definition, dict) else None
