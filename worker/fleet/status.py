"""Status reports for `subs list`: each owner writes its subscriptions' state and counters."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from worker import keys
from worker.redis_client import AsyncClient

if TYPE_CHECKING:
    from worker.service import Worker

STATUS_EVERY = 5.0  # seconds between status refreshes for `subs list`
STATUS_REFRESH = 30.0  # an unchanged status is rewritten this often (it expires after 3x this)


class StatusReports:
    """Writes the status of the subscriptions a worker holds: on ownership changes, else every
    STATUS_EVERY seconds, and then only those whose status changed (or every STATUS_REFRESH, before
    it expires): with a thousand idle subscriptions, rewriting every status was most of the idle CPU."""

    def __init__(self, worker: Worker, client: AsyncClient, lease_ttl_ms: int) -> None:
        self.worker, self.client = worker, client
        self.expire_ms = int(max(lease_ttl_ms * 3, STATUS_REFRESH * 3000))
        self._held: frozenset[str] = frozenset()
        self._at = 0.0
        self._sent: dict[str, tuple[float, dict[str, str | int]]] = {}

    async def publish(self, leases: Mapping[str, Any]) -> None:
        held = frozenset(leases)
        now = time.monotonic()
        if not held or (held == self._held and now - self._at < STATUS_EVERY):
            return
        self._held, self._at = held, now
        async with self.client.pipeline(transaction=False) as pipe:
            for key in held:
                fields = self._fields(key)
                sent = self._sent.get(key)
                if sent is not None and sent[1] == fields and now - sent[0] < STATUS_REFRESH:
                    continue
                self._sent[key] = (now, fields)
                pipe.delete(keys.status_key(key))  # stale fields go, and so does a key of the wrong type
                pipe.hset(keys.status_key(key), mapping={**fields, "updated_ms": int(time.time() * 1000)})  # type: ignore[dict-item]
                pipe.pexpire(keys.status_key(key), self.expire_ms)
            for key in [k for k in self._sent if k not in held]:
                del self._sent[key]
            if len(pipe):
                await pipe.execute()

    def _fields(self, key: str) -> dict[str, str | int]:
        dispatcher = self.worker.dispatchers.get(key)
        fields: dict[str, str | int] = {"owner": self.worker.worker_id, "state": "Starting"}
        if dispatcher is not None:
            s = dispatcher.stats
            fields.update(state=str(dispatcher.state), reason=dispatcher.state_reason, acked=s.acked,
                          retried=s.retried, dead_lettered=s.dead_lettered, dropped=s.dropped,
                          unsettled=dispatcher.unsettled)
        return fields
