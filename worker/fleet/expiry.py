"""Expiry (state Expired), as the platform docs describe it: the owner watches the broker's backlog;
once it has stayed at or above `expire_backlog` for `expire_after_seconds` (the docs: 10,000
messages for an hour), the subscription becomes Expired: it is in the fleet's `...:expired` set,
nobody serves it, its broker subscription and Redis state are deleted, and only deletion is allowed.
"""

from __future__ import annotations

import time

from worker.core import keys
from worker.redis_client import AsyncClient


class ExpiryWatch:
    """Turns backlog readings into the Expired decision, with the clock kept in Redis so the hour
    survives ownership changes."""

    def __init__(self, client: AsyncClient, expire_backlog: int, expire_after_seconds: float) -> None:
        self.client = client
        self.expire_backlog = expire_backlog
        self.expire_after_ms = int(expire_after_seconds * 1000)

    async def observe(self, backlogs: dict[str, float]) -> list[str]:
        """Record one reading per subscription (one round trip for all); returns those that expired."""
        now = int(time.time() * 1000)
        over = [k for k, v in backlogs.items() if v >= self.expire_backlog]
        async with self.client.pipeline(transaction=False) as pipe:
            for key, value in backlogs.items():
                if value < self.expire_backlog:
                    pipe.delete(keys.over_since_key(key))
            for key in over:
                pipe.set(keys.over_since_key(key), now, nx=True, ex=max(60, self.expire_after_ms // 1000 * 2))
                pipe.get(keys.over_since_key(key))
            results = await pipe.execute()
        since = results[len(backlogs) - len(over):][1::2]
        return [k for k, s in zip(over, since, strict=True) if now - int(s or now) >= self.expire_after_ms]
