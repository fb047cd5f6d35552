"""Delivery attempts counted in Redis, so numbering survives crashes and ownership changes, and each
message's attempt history (`push-worker show`), kept for a bounded time.

Each message costs two operations on the happy path: one before the first attempt (count it) and
one after (record the outcome, turn the counter into a settled marker). The marker outlives the
ack: the client groups acks for ~100 ms before the broker has them, so a worker killed in between
leaves the broker to redeliver a settled message; its copy finds the marker and is acked without
a request, instead of starting again at attempt 1. Both go through the `redis_batch.Pipeliner`:
the operations of one moment become one script call and one round trip. The record after an ack,
which nothing waits on, rides with the next round trip (or goes after 5 ms): at a steady trickle of
messages that is one round trip per message instead of two.

A message acked at its first attempt costs Redis five commands of its own: HSETNX and EXPIRE before
the request, XADD (the delivery log), HSET and EXPIRE after it (the marker keeps its history). What
a subscription's messages share (the settled list, the log's hourly counts and upkeep) is written
once a call or once a second (`log_upkeep`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from redis.exceptions import ResponseError
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential_jitter

from worker.core import attempt_records, keys
from worker.core.history import LOG_FIELDS, LOG_ONLY, log_counts, log_document, log_values
from worker.core.log_upkeep import LogUpkeep
from worker.core.redis_batch import LUA_CALL, LUA_SETTLED_LIST, BatchScript, Pipeliner
from worker.model.config import RedisSettings
from worker.runtime import logs
from worker.runtime.failing import Failing
from worker.state.redis_client import REDIS_DOWN, AsyncClient, describe, safe_text

# Per operation: one key. A message already settled (a copy the broker redelivered because its ack
# was lost) is reported as such and not counted. Else count the attempt and refresh the TTL; return
# the count, the status the previous attempt ended with, the state (0 deliver, 1 discarded by an
# operator, 2 settled already, 3 a stored count at or past MAX_COUNT), whether the record was corrupt
# and started over, and how many of the attempts were a breaker's probes (`probes`: numbered like any
# attempt, never using up max_deliver). Lua holds numbers as doubles: past 2^53 a count repeats, past
# 2^63 HINCRBY fails and the reply turns negative. Counts stop well before: a count this large cannot
# come from attempts (10^15 at ten a second is three million years), so it is garbage, said as state 3
# (the stored text in `last`) and never incremented: the dispatcher settles the message loudly.
_BEGIN = LUA_CALL + """
local out = {}
for i = 1, #KEYS do
  {fresh}
    local v = call('HMGET', KEYS[i], 'discard', 'last', 'n', 'settled', 'probes')
    local n, last, state, probes = tonumber(v[3]) or 0, '', 0, tonumber(v[5]) or 0
    if v[4] then
      state = 2
    elseif v[1] then
      state = 1
    elseif n >= MAX_COUNT or probes >= MAX_COUNT or n ~= n or probes ~= probes then
      state = 3
      last = 'n=' .. string.sub(v[3] or '', 1, 40) .. ' probes=' .. string.sub(v[5] or '', 1, 40)
      n, probes = 0, 0
    else
      {probe}
      n = call('HINCRBY', KEYS[i], 'n', 1)
      if n < 1 then
        corrupt[KEYS[i]] = true
        n = 1
        redis.call('HSET', KEYS[i], 'n', n)
      end
      redis.call('EXPIRE', KEYS[i], ARGV[1])
      last = string.sub(v[2] or '', 1, 64)
    end
    out[#out + 1] = n; out[#out + 1] = last; out[#out + 1] = state
    out[#out + 1] = corrupt[KEYS[i]] and 1 or 0; out[#out + 1] = probes
  end
end
return out
"""
# A first attempt, the common case, costs two commands: HSETNX creates the record (a message nothing
# has counted has no record: only an attempt creates one), EXPIRE bounds it. Any other message reads
# its whole record first.
_FRESH = """if call('HSETNX', KEYS[i], 'n', 1) == 1 then
    redis.call('EXPIRE', KEYS[i], ARGV[1])
    out[#out + 1] = 1; out[#out + 1] = ''; out[#out + 1] = 0
    out[#out + 1] = corrupt[KEYS[i]] and 1 or 0; out[#out + 1] = 0
  else"""
MAX_COUNT = 10**15  # below 2^53: every count under it is exact in Lua's doubles
_BEGIN = _BEGIN.replace("MAX_COUNT", str(MAX_COUNT))
BEGIN = BatchScript(_BEGIN.replace("{fresh}", _FRESH).replace("{probe}", ""), width=5)
# The same for a breaker's probe (`breaker.py`), counted as one: always the whole read.
BEGIN_PROBE = BatchScript(_BEGIN.replace("{fresh}", "do").replace(
    "{probe}", "probes = call('HINCRBY', KEYS[i], 'probes', 1)"), width=5)

# Shared: the settled list and the delivery log; the settled list's TTL, the history cap, the
# settled marker's TTL, the log's bound (entries), whether the settled list's TTL is due a refresh
# (once a minute a subscription: `_Upkeep`). Per operation: the counter and history keys; args
# settled ('1'/'0'), last status, settled summary, history TTL (0: not kept), whether the message was
# acked at its first attempt, the number of history entries, the entries, then the number of log
# entries and for each its LOG_FIELDS values. Settled at the first attempt: the counter becomes the
# settled marker and keeps the history in a field of its own ('h', a JSON list), for the longer of the
# two TTLs: one write for what took five. Settled later: the history is appended to its list (capped,
# with the TTL), the counter becomes a settled marker. Either way a redelivered copy is then acked
# without a request, and numbering never starts over; the message is listed among the settled (one
# LPUSH a call, trimmed with some slack). Not settled: remember how the attempt ended (for a
# dead-letter published after a crash). Each log entry goes to the stream (trimmed to the newest
# entries); its hourly counts are summed in the worker (`_Upkeep`).
RECORD = BatchScript((LUA_CALL + """
local list_ttl, cap, settled_ttl, log_max, refresh = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4], ARGV[5]
local names = {LOG_NAMES}
local a, summaries, out = 6, {}, {}
for k = 3, #KEYS, 2 do
  local settled, last, summary, history_ttl, first, count = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3],
    ARGV[a + 4], tonumber(ARGV[a + 5])
  a = a + 6
  local kept = ''
  if count > 0 and history_ttl ~= '0' then
    if settled == '1' and first == '1' then
      kept = '[' .. table.concat(ARGV, ',', a, a + count - 1) .. ']'
    else
      if call('RPUSH', KEYS[k + 1], unpack(ARGV, a, a + count - 1)) > cap then
        redis.call('LTRIM', KEYS[k + 1], -cap, -1)
      end
      redis.call('EXPIRE', KEYS[k + 1], history_ttl)
    end
  end
  a = a + count
  local logged = tonumber(ARGV[a])
  a = a + 1
  for j = 1, logged do
    local fields = {}
    for f = 1, #names do
      fields[#fields + 1] = names[f]
      fields[#fields + 1] = ARGV[a + f - 1]
    end
    call('XADD', KEYS[2], 'MAXLEN', '~', log_max, '*', unpack(fields))
    a = a + #names
  end
  if settled == '1' then
    if kept ~= '' then
      call('HSET', KEYS[k], 'settled', 1, 'h', kept)
      redis.call('EXPIRE', KEYS[k], math.max(settled_ttl, tonumber(history_ttl)))
    else
      call('HSET', KEYS[k], 'settled', 1)
      redis.call('EXPIRE', KEYS[k], settled_ttl)
    end
    summaries[#summaries + 1] = summary
  else
    call('HSET', KEYS[k], 'last', last)
  end
  out[#out + 1] = 1
end
""" + LUA_SETTLED_LIST + """
return out
""").replace("LOG_NAMES", ", ".join(f"'{name}'" for name in LOG_FIELDS)), width=1)

settings_default = RedisSettings()  # the buckets operators read: the default TTLs (a worker may keep more)
HISTORY_CAP = 100  # entries kept per message (the newest); the settled list keeps 10x as many messages
SETTLED_REFRESH_SECONDS = 60.0  # how often a subscription's settled list has its TTL refreshed


@dataclass(slots=True)  # one per attempt: see messages.Envelope
class AttemptRecord:
    """The attempt number just taken, and the status the previous attempt ended with ('' if none)."""

    number: int
    last_status: str
    discard: bool = False  # an operator asked to settle it without delivery
    settled: bool = False  # settled already: a redelivered copy, to ack without a request
    corrupt: bool = False  # the stored record was unreadable and started over
    probes: int = 0  # of the attempts numbered, those that were a breaker's probes
    unrepresentable: bool = False  # a stored count no attempt number can follow (`last_status` shows it)

    @property
    def spent(self) -> int:
        """Attempts that count against max_deliver: every one but the breaker's probes."""
        return max(0, self.number - self.probes)




def _begun(reply: list[Any]) -> AttemptRecord:
    """A BEGIN script's reply for one message."""
    n, last, state, corrupt, probes = reply
    last_status = last.decode(errors="replace") if isinstance(last, bytes) else str(last)
    return AttemptRecord(int(n), last_status, discard=state == 1, settled=state == 2, corrupt=bool(corrupt),
                         probes=int(probes), unrepresentable=state == 3)


class AttemptStore:
    """Attempt counters per (subscription, message). Retries Redis until it answers."""

    def __init__(self, pipeliner: Pipeliner, settings: RedisSettings, on_error: Callable[[], None] | None = None):
        self.pipeliner = pipeliner
        self.ttl_seconds = settings.attempts_ttl_seconds
        self.history_ttl_seconds = settings.history_ttl_seconds
        self.acked_history_ttl_seconds = settings.acked_history_ttl_seconds
        self.settled_ttl_seconds = settings.settled_ttl_seconds
        self.log_attempts = settings.delivery_log_attempts
        self.log_seconds = settings.delivery_log_seconds
        self._on_error = on_error or (lambda: None)
        self.log_upkeep = LogUpkeep(pipeliner, settings.delivery_log_seconds)
        self._settled_refreshed: dict[str, float] = {}
        # The layout's state (`set_layout`): layout 2 unless told otherwise (a Redis of its own).
        self.layout, self._layout_1_until = 2, 0.0
        self._switched = asyncio.Event()
        self._switched.set()
        kept = max(self.settled_ttl_seconds, self.acked_history_ttl_seconds)
        self._bucket_count = -(-kept // keys.ACKED_BUCKET_SECONDS) + 1
        self._bucket_expiring: dict[str, int] = {}  # the bucket whose TTL this process has set, a subscription
        # Subscriptions whose records Redis does not take (its outage, a Cluster shard down, a full
        # Redis, an ACL that leaves their keys out): said in their status and the log, not only counted.
        self._failing: dict[str, Failing] = {}

    def failing_reason(self, subscription_key: str) -> str:
        failing = self._failing.get(subscription_key)
        return failing.reason if failing is not None else ""

    def _failed(self, subscription_key: str, error: BaseException) -> None:
        failing = self._failing.get(subscription_key)
        if failing is None:
            failing = self._failing[subscription_key] = Failing(
                logs.get(subscription=subscription_key), "attempt store", "deliveries wait (no attempt without its "
                "record)", self._on_error, lambda e: f"{type(e).__name__}: {describe(e)}"[:200])
        failing.failed(error)

    def _succeeded(self, subscription_key: str) -> None:
        failing = self._failing.pop(subscription_key, None)
        if failing is not None:
            failing.succeeded()

    async def _call(self, subscription_key: str, queue: Callable[[], asyncio.Future[Any]]) -> Any:
        try:  # the common case, without building a retry controller
            result = await queue()
        except REDIS_DOWN as e:
            self._failed(subscription_key, e)
        else:
            if self._failing:
                self._succeeded(subscription_key)
            return result
        # No delivery proceeds without its attempt record: wait for Redis rather than guess.
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(REDIS_DOWN),
            wait=wait_exponential_jitter(multiplier=0.05, max=2.0),
            reraise=True,
        ):
            with attempt:
                try:
                    result = await queue()
                except REDIS_DOWN as e:
                    self._failed(subscription_key, e)
                    raise
                self._succeeded(subscription_key)
                return result
        raise AssertionError("unreachable")  # pragma: no cover

    # -- the layout ------------------------------------------------------------------------------

    def set_layout(self, layout: int, layout_1_until: float = 0.0, switching: bool = False) -> None:
        """The layout Redis holds (1 or 2); with 2, until when (unix time) layout 1's records are read
        beside it (`keys.layout_since_key`). `switching`: a switch to layout 2 is under way
        (`keys.layout_next_key`): no new attempt is counted until it ends."""
        self.layout, self._layout_1_until = layout, layout_1_until
        if switching and self._switched.is_set():
            self._switched.clear()
        elif not switching:
            self._switched.set()

    @property
    def switching(self) -> bool:
        return not self._switched.is_set()

    def _reads_layout_1(self) -> bool:
        return self._layout_1_until > 0 and time.time() < self._layout_1_until

    def _buckets(self, subscription_key: str) -> tuple[str, ...]:
        """The buckets of messages acked at their first attempt still kept, newest first."""
        newest = int(time.time()) // keys.ACKED_BUCKET_SECONDS
        return tuple(keys.acked_key(subscription_key, newest - i) for i in range(self._bucket_count))

    # -- counting ----------------------------------------------------------------------------------

    async def begin(self, subscription_key: str, message_id: str, probe: bool = False) -> AttemptRecord:
        """Record the next attempt before it is made (a breaker's `probe`: counted as one); returns its
        number (1, 2, ...)."""
        if not self._switched.is_set():
            await self._switched.wait()
        # Layout 2's first attempt: one plain command; anything counted before takes the script.
        if self.layout == 2 and not probe and not self._reads_layout_1() and await self._call(
                subscription_key, lambda: self._first(subscription_key, message_id)):
            return AttemptRecord(1, "")
        return _begun(await self._call(subscription_key, lambda: self._begin(subscription_key, message_id, probe)))

    async def begin_all(self, subscription_key: str, message_ids: list[str],
                        probe: bool = False) -> list[AttemptRecord]:
        """`begin` for a batch's messages: one script call, and no task per message."""
        if not self._switched.is_set():
            await self._switched.wait()
        records: list[AttemptRecord | None] = [None] * len(message_ids)
        if self.layout == 2 and not probe and not self._reads_layout_1():
            firsts = await self._call(subscription_key, lambda: asyncio.gather(
                *(self._first(subscription_key, message_id) for message_id in message_ids)))
            records = [AttemptRecord(1, "") if first else None for first in firsts]
        rest = [message_id for message_id, record in zip(message_ids, records, strict=True) if record is None]
        if rest:
            replies = iter(await self._call(subscription_key, lambda: asyncio.gather(
                *(self._begin(subscription_key, message_id, probe) for message_id in rest))))
            records = [record if record is not None else _begun(next(replies)) for record in records]
        return [record for record in records if record is not None]

    def _first(self, subscription_key: str, message_id: str) -> asyncio.Future[Any]:
        return self.pipeliner.submit("SET", keys.attempt_key(subscription_key, message_id), "1", "EX",
                                     self.settled_ttl_seconds, "NX")

    def _begin(self, subscription_key: str, message_id: str, probe: bool, peek: bool = False) -> asyncio.Future[Any]:
        if self.layout == 2:
            return self.pipeliner.operation(
                attempt_records.BEGIN, self._buckets(subscription_key),
                (self.ttl_seconds, self.settled_ttl_seconds, "1" if self._reads_layout_1() else "0",
                 self._bucket_count, "peek" if peek else "probe" if probe else "count"),
                (keys.attempt_key(subscription_key, message_id), keys.message_key(subscription_key, message_id)),
                (message_id,), subscription_key)
        return self.pipeliner.operation(BEGIN_PROBE if probe else BEGIN, (), (self.ttl_seconds,),
                                        (keys.message_key(subscription_key, message_id),), (), subscription_key)

    def record(self, subscription_key: str, message_id: str, entries: list[dict[str, Any]],
               settled: bool, last_status: str = "", acked_first_time: bool = False,
               lazy: bool = False) -> Awaitable[None]:
        """Append `entries` to the message's history (kept `acked_history_ttl_seconds` when it was
        `acked_first_time`, else `history_ttl_seconds`); then, `settled`, mark its counter settled
        (for `settled_ttl_seconds`) and list it among the settled messages (how it ended: the last
        entry); else remember `last_status`. `lazy`: nothing waits on it, it waits up to 5 ms for others to
        go with it in one script call (Pipeliner.operation)."""
        return self._call(subscription_key, lambda: self._record(subscription_key, message_id, entries, settled,
                                                                last_status, acked_first_time, lazy))

    def record_all(self, subscription_key: str, messages: list[tuple[str, list[dict[str, Any]], bool]],
                   settled: bool, last_status: str = "", lazy: bool = False) -> Awaitable[None]:
        """`record` for a batch's messages, each (message id, entries, acked_first_time): one script
        call, and no task per message."""
        return self._call(subscription_key, lambda: asyncio.gather(
            *(self._record(subscription_key, message_id, entries, settled, last_status, first_time, lazy)
              for message_id, entries, first_time in messages)))

    def _record(self, subscription_key: str, message_id: str, entries: list[dict[str, Any]], settled: bool,
                last_status: str, acked_first_time: bool, lazy: bool) -> asyncio.Future[Any]:
        layout_2 = self.layout == 2
        logged: list[str | bytes] = []
        if self.log_attempts:
            hour = int(time.time()) // 3600
            for entry in entries:
                if layout_2:
                    logged.append(log_document(message_id, entry))
                    counted = log_counts(entry)
                else:
                    values = log_values(message_id, entry)
                    logged += values[:-2]
                    counted = (str(values[-2]), int(values[-1])) if values[-2] else None
                if counted is not None:  # an attempt, not an event: counted in its hour
                    self.log_upkeep.count(subscription_key, hour, *counted)
        history = [{k: v for k, v in entry.items() if k not in LOG_ONLY} for entry in entries]
        summary = orjson.dumps({"message_id": message_id, **(history[-1] if history else {})}) if settled else b""
        history_ttl = self.acked_history_ttl_seconds if acked_first_time else self.history_ttl_seconds
        refresh = "1" if settled and self._settled_refresh_due(subscription_key) else "0"
        logged_count = len(entries) if self.log_attempts else 0
        if layout_2:
            how = ("a" if acked_first_time else "s") if settled else "f"
            number = max((int(e.get("attempt") or 0) for e in entries), default=0)
            bucket = int(time.time()) // keys.ACKED_BUCKET_SECONDS
            bucket_ttl = 0
            if how == "a" and self._bucket_expiring.get(subscription_key) != bucket:
                self._bucket_expiring[subscription_key] = bucket
                bucket_ttl = self._bucket_count * keys.ACKED_BUCKET_SECONDS
            recorded = self.pipeliner.operation(
                attempt_records.RECORD, (keys.settled_key(subscription_key), keys.log_key(subscription_key),
                                         keys.acked_key(subscription_key, bucket)),
                (self.history_ttl_seconds, HISTORY_CAP, self.settled_ttl_seconds, self.log_attempts, refresh,
                 bucket_ttl, self.ttl_seconds),
                (keys.attempt_key(subscription_key, message_id), keys.history_key(subscription_key, message_id)),
                (message_id, how, number, last_status, summary, history_ttl, len(history),
                 *(orjson.dumps(e) for e in history), logged_count, *logged),
                subscription_key, lazy)
            if bucket_ttl:  # a call that failed set no TTL: its retry (`_call`) must set it
                recorded.add_done_callback(lambda done: self._bucket_expiring.pop(subscription_key, None)
                                           if done.cancelled() or done.exception() is not None else None)
            return recorded
        op_args = ("1" if settled else "0", last_status, summary, history_ttl, "1" if acked_first_time else "0",
                   len(history), *(orjson.dumps(e) for e in history), logged_count, *logged)
        return self.pipeliner.operation(
            RECORD, (keys.settled_key(subscription_key), keys.log_key(subscription_key)),
            (self.history_ttl_seconds, HISTORY_CAP, self.settled_ttl_seconds, self.log_attempts, refresh),
            (keys.message_key(subscription_key, message_id), keys.history_key(subscription_key, message_id)),
            op_args, subscription_key, lazy)

    def _settled_refresh_due(self, subscription_key: str) -> bool:
        """Whether the settled list's TTL is due a refresh (once a minute a subscription)."""
        now = time.monotonic()
        if now - self._settled_refreshed.get(subscription_key, float("-inf")) < SETTLED_REFRESH_SECONDS:
            return False
        self._settled_refreshed[subscription_key] = now
        return True

    async def close(self) -> None:
        """Add the delivery log's counts still in the worker (before the pipeliner closes)."""
        await self.log_upkeep.close()

    async def unsent(self, subscription_key: str, message_ids: list[str]) -> None:
        """Attempts begun for `message_ids` that no request carried (an open breaker or a lost lease held
        them back after they were counted): their numbers stay used, but they use up no attempt of
        max_deliver (counted as the breaker's probes are)."""
        if self.layout == 2:
            await self._call(subscription_key, lambda: asyncio.gather(*(self.pipeliner.operation(
                attempt_records.UNSENT, (), (self.ttl_seconds,), (keys.attempt_key(subscription_key, message_id),), (),
                subscription_key) for message_id in message_ids)))
            return
        await self._call(subscription_key, lambda: asyncio.gather(*(self.pipeliner.submit(
            "HINCRBY", keys.message_key(subscription_key, message_id), "probes", 1) for message_id in message_ids)))

    async def settled(self, subscription_key: str, message_id: str) -> bool:
        """Whether the message was settled already (its settled marker is there), without counting an
        attempt: a message settled without a request checks this first, so that a copy the broker hands
        out again (a consumer replaced, an ack lost) is not dead-lettered a second time."""
        if self.layout == 2:
            return _begun(await self._call(subscription_key, lambda: self._begin(
                subscription_key, message_id, False, peek=True))).settled
        return bool(await self._call(subscription_key, lambda: self.pipeliner.submit(
            "HEXISTS", keys.message_key(subscription_key, message_id), "settled")))



# -- the attempt record as operators' commands read and mark it -------------------------------------

DISCARD_MARK_SECONDS = 7 * 24 * 3600  # a discard mark on a message that never comes back goes after a week

# A settled message's record is its settled marker: marking it would say "discarded" of a message
# that was delivered, and keep the marker for a week. Else mark it; a message that never comes back
# leaves nothing behind after the week.
_MARK_DISCARD = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('HEXISTS', KEYS[1], 'settled') == 1 then return 0 end
redis.call('HSET', KEYS[1], 'discard', 1)
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""


def counter(value: str | bytes | None) -> int:
    """A counter read from Redis (written by a worker, but Redis may hold anything)."""
    try:
        return int(value or 0)
    except ValueError:
        return 0


@dataclass(frozen=True)
class StoredRecord:
    """One message's attempt record (`keys.message_key`), as the scripts above keep it."""

    attempts: int  # `n`: attempts counted so far
    last_status: str  # `last`: the last failed attempt's status ("" before any failed)
    settled: bool  # `settled`: a settled marker (acked, dead-lettered or discarded)
    discard: bool  # `discard`: an operator asked to discard it

    @classmethod
    def parse(cls, raw: Mapping[Any, Any]) -> StoredRecord:
        fields = {safe_text(k): safe_text(v) for k, v in raw.items()}
        return cls(counter(fields.get("n")), fields.get("last", ""), "settled" in fields, "discard" in fields)

    @property
    def retrying(self) -> bool:
        return bool(self.last_status)


async def records(client: AsyncClient, sub_key: str, keep: Callable[[StoredRecord], bool],
                  limit: int) -> list[tuple[str, StoredRecord]]:
    """Up to `limit` attempt records of a subscription that `keep` keeps: (message id, record), of
    both layouts. A key of another type is skipped (the worker starts such a record over). Not an
    async generator: this module is compiled, and mypyc compiles none."""
    found: list[tuple[str, StoredRecord]] = []
    async for record_key in client.scan_iter(match=keys.message_pattern(sub_key), count=1000):
        try:
            record = StoredRecord.parse(await client.hgetall(record_key))
        except ResponseError:
            continue
        if keep(record):
            found.append((keys.message_id_of(safe_text(record_key)), record))
            if len(found) >= limit:
                return found
    batch: list[str] = []
    async for record_key in client.scan_iter(match=keys.attempt_pattern(sub_key), count=1000):
        batch.append(safe_text(record_key))
        if len(batch) >= 200:
            found += await _kept(client, sub_key, batch, keep, limit - len(found))
            batch = []
            if len(found) >= limit:
                return found
    return found + (await _kept(client, sub_key, batch, keep, limit - len(found)) if batch else [])


async def _kept(client: AsyncClient, sub_key: str, record_keys: list[str], keep: Callable[[StoredRecord], bool],
                limit: int) -> list[tuple[str, StoredRecord]]:
    """Layout 2 records as `records` reads them: peeked (a first attempt acked since is settled)."""
    ids = [keys.message_id_of(k) for k in record_keys]
    states = await _peek(client, sub_key, ids)
    found = [(message_id, record) for message_id, record in zip(ids, states, strict=True)
             if record is not None and keep(record)]
    return found[:limit]


async def _peek(client: AsyncClient, sub_key: str, message_ids: list[str]) -> list[StoredRecord | None]:
    """Layout 2 records of `message_ids` (None: no record), read as a worker's next attempt reads
    them, layout 1's records included, nothing written."""
    if not message_ids:
        return []
    kept = max(settings_default.settled_ttl_seconds, settings_default.acked_history_ttl_seconds)
    buckets = _bucket_keys(sub_key, kept)
    op_keys = [k for m in message_ids for k in (keys.attempt_key(sub_key, m), keys.message_key(sub_key, m))]
    reply = await client.eval(attempt_records.BEGIN.source, len(buckets) + len(op_keys), *buckets, *op_keys,
                              0, 0, "1", len(buckets), "peek", *message_ids)
    out: list[StoredRecord | None] = []
    for i in range(len(message_ids)):
        n, last, state, _, _ = reply[i * 5:(i + 1) * 5]
        last_text = safe_text(last)
        if int(n) == 0 and int(state) == 0 and not last_text:
            out.append(None)
            continue
        out.append(StoredRecord(int(n), last_text, int(state) == 2, int(state) == 1))
    return out


def _bucket_keys(sub_key: str, kept_seconds: int) -> list[str]:
    newest = int(time.time()) // keys.ACKED_BUCKET_SECONDS
    return [keys.acked_key(sub_key, newest - i) for i in range(-(-kept_seconds // keys.ACKED_BUCKET_SECONDS) + 1)]


async def stored_history(client: AsyncClient, sub_key: str, message_id: str) -> list[Any]:
    """A message's history entries as stored (JSON texts), oldest first: its list; for a message
    acked at its first attempt, layout 1's settled marker's own field or layout 2's bucket."""
    listed = await client.lrange(keys.history_key(sub_key, message_id), 0, -1)
    if listed:
        return list(listed)
    try:
        kept = await client.hget(keys.message_key(sub_key, message_id), "h")
        if not kept:
            kept_for = max(settings_default.settled_ttl_seconds, settings_default.acked_history_ttl_seconds)
            for bucket in _bucket_keys(sub_key, kept_for):
                kept = await client.hget(bucket, message_id)
                if kept:
                    break
        entries = orjson.loads(kept) if kept and kept != b"1" else []
    except (ResponseError, orjson.JSONDecodeError):
        return [b"not a list of entries"]  # shown as unreadable
    return [orjson.dumps(e) for e in entries] if isinstance(entries, list) else [b"not a list of entries"]


async def pending_attempts(client: AsyncClient, sub_key: str, message_id: str) -> int | None:
    """Attempts counted for a message not yet settled; None if it is settled or unknown."""
    (record,) = await _peek(client, sub_key, [message_id])
    if record is not None:
        return None if record.settled else record.attempts
    counted, settled = await client.hmget(keys.message_key(sub_key, message_id), ["n", "settled"])
    return None if settled is not None or counted is None else counter(counted)


async def mark_discard(client: AsyncClient, sub_key: str, message_id: str) -> int:
    """Mark a message to be discarded at its next attempt: 1 marked, 0 already settled, -1 unknown."""
    if await client.exists(keys.attempt_key(sub_key, message_id)):
        kept = max(settings_default.settled_ttl_seconds, settings_default.acked_history_ttl_seconds)
        buckets = _bucket_keys(sub_key, kept)
        return int(await client.eval(attempt_records.MARK_DISCARD, 1 + len(buckets),
                                     keys.attempt_key(sub_key, message_id), *buckets, message_id,
                                     DISCARD_MARK_SECONDS))
    return int(await client.eval(_MARK_DISCARD, 1, keys.message_key(sub_key, message_id), DISCARD_MARK_SECONDS))


async def is_settled(client: AsyncClient, sub_key: str, message_id: str) -> bool:
    (record,) = await _peek(client, sub_key, [message_id])
    if record is not None and record.settled:
        return True
    return (await client.hget(keys.message_key(sub_key, message_id), "settled")) is not None


async def forget(client: AsyncClient, sub_key: str, message_id: str) -> None:
    """Forget what the fleet knows of one message (a replay or a redrive delivers it again): its
    records of both layouts and its place among the messages acked at their first attempt."""
    kept = max(settings_default.settled_ttl_seconds, settings_default.acked_history_ttl_seconds)
    await client.delete(keys.message_key(sub_key, message_id), keys.attempt_key(sub_key, message_id))
    for bucket in _bucket_keys(sub_key, kept):
        await client.hdel(bucket, message_id)


async def set_count(client: AsyncClient, sub_key: str, message_id: str, number: int, layout: int) -> None:
    """Start a forgotten message's count at `number` (a replay continues its numbering), in `layout`."""
    if number and layout == 2:
        await client.set(keys.attempt_key(sub_key, message_id), f"{number},0,,", ex=DISCARD_MARK_SECONDS)
    elif number:
        await client.hset(keys.message_key(sub_key, message_id), "n", number)
        await client.expire(keys.message_key(sub_key, message_id), DISCARD_MARK_SECONDS)
