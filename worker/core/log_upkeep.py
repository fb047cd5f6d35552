"""The delivery log's hourly counts, summed in the worker and added to Redis once a second per
subscription (one script call for all of them), and the upkeep of a subscription's log keys (trim
by age, TTLs), once a minute: what a message used to pay for with four commands of its own.

A worker killed by SIGKILL loses the counts of its last second (the log's entries are written with
each attempt and are not lost); a worker that stops adds them before it closes its Redis connection.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable

from worker.core import keys
from worker.core.redis_batch import LUA_CALL, BatchScript, Pipeliner
from worker.runtime import logs
from worker.state.redis_client import REDIS_DOWN, describe

FLUSH_SECONDS = 1.0  # counts wait at most this long in the worker
UPKEEP_SECONDS = 60.0  # a subscription's log is trimmed by age and its TTLs refreshed this often

# Per operation: the log's hourly counts and the log; args: the time (ms), the log's window (s), the
# upkeep due ('0' none, '1' trim and TTLs, '2' also drop the counts of hours older than the log: once
# an hour), the number of counts, then each field and its increment.
LOG_COUNTS = BatchScript(LUA_CALL + """
local a, out = 1, {}
for k = 1, #KEYS, 2 do
  local now, log_seconds, upkeep, n = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), ARGV[a + 2], tonumber(ARGV[a + 3])
  a = a + 4
  -- No log, no counts: the subscription's state was cleared (deleted, expired) since they were made.
  local kept = redis.call('EXISTS', KEYS[k + 1]) == 1
  for j = 1, n do
    if kept then call('HINCRBY', KEYS[k], ARGV[a], ARGV[a + 1]) end
    a = a + 2
  end
  if kept and upkeep ~= '0' then
    call('XTRIM', KEYS[k + 1], 'MINID', '~', now - log_seconds * 1000)
    redis.call('EXPIRE', KEYS[k + 1], log_seconds)
    if upkeep == '2' then
      local oldest = math.floor(now / 3600000) - math.ceil(log_seconds / 3600)
      for _, field in ipairs(call('HKEYS', KEYS[k])) do
        local h = tonumber(string.match(field, '^(%d+):'))
        if h and h < oldest then redis.call('HDEL', KEYS[k], field) end
      end
    end
    redis.call('EXPIRE', KEYS[k], log_seconds)
  end
  out[#out + 1] = 1
end
return out
""", width=1)


class _Subscription:
    __slots__ = ("counts", "upkept_at", "upkept_hour")

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.upkept_at = float("-inf")
        self.upkept_hour = -1


class LogUpkeep:
    """Counts per subscription waiting for the next flush, and when each was last upkept."""

    def __init__(self, pipeliner: Pipeliner, log_seconds: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.pipeliner = pipeliner
        self.log_seconds = log_seconds
        self._clock = clock
        self._subs: dict[str, _Subscription] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._flushing: asyncio.Task[None] | None = None
        self._log = logs.get(component="delivery log")
        self._failed_at = 0.0  # when a failed flush was last logged: once a minute at most

    def count(self, subscription_key: str, hour: int, outcome_class: str, latency_bin: int) -> None:
        """One attempt of `hour` in its outcome class and latency bin."""
        sub = self._subs.get(subscription_key)
        if sub is None:
            sub = self._subs[subscription_key] = _Subscription()
        sub.counts[f"{hour}:{outcome_class}"] += 1
        sub.counts[f"{hour}:l{latency_bin}"] += 1
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(FLUSH_SECONDS, self._flush_soon)

    def _flush_soon(self) -> None:
        self._timer = None
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.ensure_future(self.flush())

    async def flush(self) -> None:
        """Add every count waiting to Redis (and upkeep the logs that are due); counts Redis did not
        take wait for the next flush."""
        now_ms, now = int(time.time() * 1000), self._clock()
        hour = now_ms // 3_600_000
        sent: list[tuple[str, _Subscription, Counter[str], asyncio.Future[object]]] = []
        for key, sub in list(self._subs.items()):
            if not sub.counts:
                del self._subs[key]  # nothing counted for a second: forgotten until the next count
                continue
            upkeep = "0"
            if now - sub.upkept_at >= UPKEEP_SECONDS:
                upkeep = "2" if sub.upkept_hour != hour else "1"
            counts, sub.counts = sub.counts, Counter()
            args = [now_ms, self.log_seconds, upkeep, len(counts), *(x for kv in counts.items() for x in kv)]
            future = self.pipeliner.operation(LOG_COUNTS, (), (), (keys.log_stats_key(key), keys.log_key(key)),
                                              args, key)
            sent.append((key, sub, counts, future))
            if upkeep != "0":
                sub.upkept_at, sub.upkept_hour = now, hour
        for key, sub, counts, future in sent:
            try:
                await future
            except REDIS_DOWN as e:  # kept for the next flush, said once a minute at most
                sub.counts.update(counts)
                sub.upkept_at = float("-inf")
                self._subs[key] = sub
                if now - self._failed_at >= 60:
                    self._failed_at = now
                    self._log.warning("log counts not added; kept for the next second",
                                      error=f"{type(e).__name__}: {describe(e)}"[:200])
        if any(sub.counts for sub in self._subs.values()) and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(FLUSH_SECONDS, self._flush_soon)

    async def close(self) -> None:
        """Add what is still counted (a stopping worker loses nothing of it)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._flushing is not None:
            await asyncio.gather(self._flushing, return_exceptions=True)
        await self.flush()
        if self._timer is not None:  # Redis did not take them: nothing more is tried
            self._timer.cancel()
            self._timer = None
