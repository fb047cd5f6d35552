"""The backlog of every served subscription, read for the metric, the spreading and expiry; and
expiry (state Expired), as the platform docs describe it: the owner watches the broker's backlog;
once it has stayed at or above `expire_backlog` for `expire_after_seconds` (the docs: 10,000
messages for an hour), the subscription becomes Expired: it is in the fleet's `...:expired` set,
nobody serves it, its broker subscription and Redis state are deleted, and only deletion is allowed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from worker.broker.backlog import BacklogReader
from worker.broker.broker_admin import AdminError
from worker.core import keys
from worker.core.metrics import Metrics
from worker.runtime.aio import wait_event
from worker.state.redis_client import AsyncClient


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


class BacklogReport:
    """Reads the backlog of every served subscription every `interval`, for the metric and for expiry;
    a subscription newly served (`newly_served` set) is read within a second, not only at the next
    interval, so it has a figure from its start. Its failures never stop delivery."""

    def __init__(self, reader: BacklogReader, expiry: ExpiryWatch, served: Mapping[str, Any], metrics: Metrics,
                 expire: Callable[[str], Awaitable[Any]], interval: float, log: Any,
                 readings: dict[str, tuple[float, float]] | None = None) -> None:
        self.reader = reader
        self.expiry = expiry
        self.served = served  # key -> its dispatcher (with `.sub`)
        self.metrics = metrics
        self.expire = expire
        self.interval = interval
        self.log = log
        self.newly_served = asyncio.Event()
        # Every reading, (backlog, monotonic time), by key: how the fleet decides a spread subscription's width.
        self.readings: dict[str, tuple[float, float]] = {} if readings is None else readings

    async def run(self) -> None:
        while True:
            self.newly_served.clear()
            try:
                await self.read_once()
            except Exception as e:  # the backlog is a report: its failure never stops delivery
                self.metrics.broker_errors.labels("backlog").inc()
                self.log.warning("backlog read failed", error=type(e).__name__,
                                 **({"detail": str(e)} if isinstance(e, AdminError) else {}))
            if await wait_event(self.newly_served, self.interval):
                await asyncio.sleep(1.0)  # starts come in bursts (a fleet change): one read for the burst

    async def read_once(self) -> None:
        backlogs = await self.reader.read([d.sub for d in self.served.values()])
        read_at = time.monotonic()
        for key in [k for k in self.readings if k not in self.served]:
            del self.readings[key]
        for key, value in backlogs.items():
            self.readings[key] = (value, read_at)
            served = self.served.get(key)
            if served is not None:
                self.metrics.backlog.labels(served.sub.tenant, served.sub.name).set(value)
        for key in await self.expiry.observe(backlogs):
            self.log.warning("subscription expired", subscription=key, backlog=backlogs[key])
            await self.expire(key)
