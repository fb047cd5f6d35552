"""Delivery attempts counted in Redis, so numbering survives crashes and ownership changes, and each
message's attempt history (`push-worker show`), kept for a bounded time.

The happy path costs two commands per message (one script call before the first attempt, one
after it that records the outcome and forgets the counter). Calls made in the same moment by many
deliveries share one pipelined round trip: a flusher sends whatever has queued up while the
previous round trip was in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential_jitter

from worker import keys

# Count the attempt and refresh the TTL in one step; return the count and the last recorded status.
_BEGIN = """
if redis.call('HGET', KEYS[1], 'discard') then return {redis.call('HGET', KEYS[1], 'n') or 0, '', 1} end
local n = redis.call('HINCRBY', KEYS[1], 'n', 1)
redis.call('EXPIRE', KEYS[1], ARGV[1])
return {n, redis.call('HGET', KEYS[1], 'last') or '', 0}
"""

# Append history entries (capped, with a TTL); then, settled: forget the counter and add the message
# to the subscription's settled list; else remember how the attempt ended (for a dead-letter
# published after a crash).
_RECORD = """
for i = 6, #ARGV do redis.call('RPUSH', KEYS[2], ARGV[i]) end
redis.call('LTRIM', KEYS[2], -tonumber(ARGV[4]), -1)
redis.call('EXPIRE', KEYS[2], ARGV[3])
if ARGV[1] == '1' then
  redis.call('DEL', KEYS[1])
  redis.call('LPUSH', KEYS[3], ARGV[5])
  redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[4]) * 10 - 1)
  redis.call('EXPIRE', KEYS[3], ARGV[3])
else
  redis.call('HSET', KEYS[1], 'last', ARGV[2])
end
return 1
"""
HISTORY_CAP = 100  # entries kept per message (the newest); the settled list keeps 10x as many messages

Queued = tuple[Callable[[Any], None], "asyncio.Future[Any]"]


@dataclass(frozen=True)
class AttemptRecord:
    """The attempt number just taken, and the status the previous attempt ended with ('' if none)."""

    number: int
    last_status: str
    discard: bool = False  # an operator asked to settle it without delivery


class Pipeliner:
    """Coalesces Redis commands issued concurrently into one pipeline round trip."""

    def __init__(self, client: aioredis.Redis, on_round_trip: Callable[[int], None] | None = None) -> None:
        self.client = client
        self._on_round_trip = on_round_trip or (lambda _: None)
        self._queue: list[Queued] = []
        self._flusher: asyncio.Task[None] | None = None

    def submit(self, add: Callable[[Any], None]) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append((add, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return future

    async def _flush(self) -> None:
        while self._queue:
            batch, self._queue = self._queue, []
            pipe = self.client.pipeline(transaction=False)
            for add, _ in batch:
                add(pipe)
            try:
                results = await pipe.execute(raise_on_error=False)
            except (RedisError, OSError) as e:
                results = [e] * len(batch)
            except asyncio.CancelledError:
                for _, future in batch:
                    future.cancel()
                raise
            self._on_round_trip(len(batch))
            for (_, future), result in zip(batch, results, strict=True):
                if future.done():
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)

    async def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            await asyncio.gather(self._flusher, return_exceptions=True)


class AttemptStore:
    """Attempt counters per (subscription, message). Retries Redis until it answers."""

    def __init__(self, pipeliner: Pipeliner, ttl_seconds: int, on_error: Callable[[], None] | None = None,
                 history_ttl_seconds: int = 3 * 24 * 3600):
        self.pipeliner = pipeliner
        self.ttl_seconds = ttl_seconds
        self.history_ttl_seconds = history_ttl_seconds
        self._on_error = on_error or (lambda: None)

    async def _call(self, add: Callable[[Any], None]) -> Any:
        try:  # the common case, without building a retry controller
            return await self.pipeliner.submit(add)
        except (RedisError, OSError):
            self._on_error()
        # No delivery proceeds without its attempt record: wait for Redis rather than guess.
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type((RedisError, OSError)),
            wait=wait_exponential_jitter(multiplier=0.05, max=2.0),
            reraise=True,
        ):
            with attempt:
                try:
                    return await self.pipeliner.submit(add)
                except (RedisError, OSError):
                    self._on_error()
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def begin(self, subscription_key: str, message_id: str) -> AttemptRecord:
        """Record the next attempt before it is made; returns its number (1, 2, ...)."""
        key = keys.message_key(subscription_key, message_id)
        n, last, discard = await self._call(lambda p: p.eval(_BEGIN, 1, key, self.ttl_seconds))
        return AttemptRecord(int(n), last.decode() if isinstance(last, bytes) else str(last), bool(int(discard)))

    async def record(self, subscription_key: str, message_id: str, entries: list[dict[str, Any]],
                     settled: bool, last_status: str = "") -> None:
        """Append `entries` to the message's history; then, `settled`, forget its counter and list it
        among the settled messages (how it ended: the last entry); else remember `last_status`.
        One round trip."""
        keys_ = (keys.message_key(subscription_key, message_id), keys.history_key(subscription_key, message_id),
                 keys.settled_key(subscription_key))
        summary = {"message_id": message_id, **(entries[-1] if entries else {})} if settled else {}
        args = ["1" if settled else "0", last_status, self.history_ttl_seconds, HISTORY_CAP, orjson.dumps(summary),
                *(orjson.dumps(e) for e in entries)]
        await self._call(lambda p: p.eval(_RECORD, 3, *keys_, *args))

    async def history(self, subscription_key: str, message_id: str) -> list[dict[str, Any]]:
        """The message's recorded history, oldest first."""
        raw = await self._call(lambda p: p.lrange(keys.history_key(subscription_key, message_id), 0, -1))
        return [orjson.loads(entry) for entry in raw]
