"""The definitions of the subscriptions a worker serves from its own config file, published in Redis
so that every operator command finds them without that file (`subs get`, `dlq list`, `queue --state
dead`): a command given only the Redis URL found them served but could not read their definitions.

Each worker writes each of its config file's definitions under the subscription's hash tag
(`keys.config_definition_key`), as JSON with the worker that wrote it, every PUBLISH_EVERY seconds,
expiring after KEEP_SECONDS: a subscription removed from every worker's file disappears on its own.
A definition names its secrets by reference ({secret}, {env}, {file}), never by value; a command
that needs them (`dlq redrive` signs its requests) reads them where it runs.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import orjson

from worker.core import keys
from worker.model.subscriptions import Subscription
from worker.state.redis_client import AsyncClient

PUBLISH_EVERY = 60.0
KEEP_SECONDS = 300


class ConfigDefinitions:
    def __init__(self, client: AsyncClient, worker_id: str, static: Mapping[str, Subscription]) -> None:
        self.client = client
        self.worker_id = worker_id
        self.static = static
        self._at: float | None = None

    async def publish_if_due(self) -> None:
        now = time.monotonic()
        if not self.static or (self._at is not None and now - self._at < PUBLISH_EVERY):
            return
        async with self.client.pipeline(transaction=False) as pipe:
            for key, sub in self.static.items():
                record = {"definition": sub.definition, "worker": self.worker_id}
                # default=str: YAML can hold values JSON cannot (a date); shown as text, never a failed round
                pipe.set(keys.config_definition_key(key), orjson.dumps(record, default=str), ex=KEEP_SECONDS)
            await pipe.execute()
        self._at = now


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
