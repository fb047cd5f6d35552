"""Status reports for `subs list`: each owner writes its subscriptions' state and counters."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import orjson

from worker.core import keys
from worker.core.redis_batch import BATCH_LIMIT, BatchScript, Pipeliner
from worker.fleet.leases import unit_parts
from worker.fleet.worker_protocol import ServingWorker

STATUS_EVERY = 5.0  # seconds between status refreshes for `subs list`
# An unchanged status is rewritten this often (it expires after 3x this): at 30 s it was 0.13 command
# a second per idle subscription, at 300 s 0.013, more than everything else a subscription costs in
# layout 2. Who serves is read from the owner records (`ownership.owners`), not from a status that
# may be stale; a status is rewritten at once when it changes.
STATUS_REFRESH = 900.0

# Shared: the expiry (ms). Per operation: the status key; the number of field/value pairs' items,
# then the items. Stale fields go, and so does a key of the wrong type (DEL first).
WRITE = BatchScript("""
local a = 2
for i = 1, #KEYS do
  local n = tonumber(ARGV[a])
  redis.call('DEL', KEYS[i])
  redis.call('HSET', KEYS[i], unpack(ARGV, a + 1, a + n))
  redis.call('PEXPIRE', KEYS[i], ARGV[1])
  a = a + n + 1
end
return {}
""", width=0)


class StatusReports:
    """Writes the status of the subscriptions a worker holds: on ownership changes, else every
    STATUS_EVERY seconds, and then only those whose status changed (or every STATUS_REFRESH, before
    it expires): with a thousand idle subscriptions, rewriting every status was most of the idle CPU.
    The writes go as batched script calls: as a thousand separate commands they held the event loop
    for about 100 ms every STATUS_EVERY with a thousand busy subscriptions (every delivery waited)."""

    def __init__(self, worker: ServingWorker, batch: Pipeliner, lease_ttl_ms: int,
                 backlogs: Mapping[str, tuple[float, float]] | None = None) -> None:
        self.worker, self.batch = worker, batch
        self.backlogs = backlogs if backlogs is not None else {}  # the backlog readings, by key
        self.expire_ms = int(max(lease_ttl_ms * 3, STATUS_REFRESH * 3000))
        self._held: frozenset[str] = frozenset()
        self._at = 0.0
        self._sent: dict[str, tuple[float, dict[str, str | int]]] = {}

    async def publish(self, leases: Mapping[str, Any]) -> None:
        """`leases` by unit (`leases.unit`): each slot held has a status of its own."""
        held = frozenset(leases)
        now = time.monotonic()
        if not held or (held == self._held and now - self._at < STATUS_EVERY):
            return
        self._held, self._at = held, now
        updated_ms = int(time.time() * 1000)
        writes = []
        for key in held:
            fields = self._fields(key)
            sent = self._sent.get(key)
            if sent is not None and sent[1] == fields and now - sent[0] < STATUS_REFRESH:
                continue
            self._sent[key] = (now, fields)
            items = [x for pair in {**fields, "updated_ms": updated_ms}.items() for x in pair]
            writes.append(self.batch.operation(WRITE, (), (self.expire_ms,), (keys.status_key(*unit_parts(key)),),
                                               (len(items), *items), unit_parts(key)[0]))
            if len(writes) % BATCH_LIMIT == 0:
                await asyncio.sleep(0)  # deliveries go on between the batches
        for key in [k for k in self._sent if k not in held]:
            del self._sent[key]
        if writes:
            try:
                await asyncio.gather(*writes)
            except BaseException:
                self._sent.clear()  # what was not written goes again next time, changed or not
                raise

    def due(self) -> None:
        """Write at the next round, not STATUS_EVERY later: a subscription started serving (after a
        resume, a handover), so `subs list` shows it Active within a heartbeat, not Starting for 5 s."""
        self._at = 0.0

    def _fields(self, name: str) -> dict[str, str | int]:
        key = unit_parts(name)[0]
        dispatcher = self.worker.dispatchers.get(key)
        fields: dict[str, str | int] = {"owner": self.worker.worker_id, "state": "Starting"}
        if dispatcher is not None:
            s = dispatcher.stats
            fields.update(state=str(dispatcher.state), reason=dispatcher.state_reason, acked=s.acked,
                          retried=s.retried, dead_lettered=s.dead_lettered, dropped=s.dropped,
                          unsettled=dispatcher.unsettled)
            # For the operator API: the last minutes of attempts, the oldest message in hand, the backlog.
            fields["recent"] = orjson.dumps(s.recent.summary()).decode()
            if (oldest := dispatcher.oldest_unsettled_ms) is not None:
                fields["oldest_unsettled_ms"] = oldest
            if (reading := self.backlogs.get(key)) is not None:
                fields["backlog"] = int(reading[0])
        elif failing := self.worker.subscribe_failures.get(key):
            fields["reason"] = f"subscribe failing: {failing}"
        return fields
