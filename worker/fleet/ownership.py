"""Ownership in layout 2: a worker's entry in the fleet's live set is its only lease; each
subscription slot has an owner record, written when it changes hands and at no other time.

Layout 1 (every release to 1.1.0) renews a lease per subscription: with a hundred thousand of them
that is most of what Redis does. In layout 2 a worker proves it is alive once a second for all it
owns (its entry in `alive`, a sorted set scored by expiry in Redis server time like `members`), and
serves a slot while that proof is fresh on its own monotonic clock: the fence of layout 1's lease,
one per worker instead of one per subscription.

The entry is the worker's incarnation: its process instance and how often its entry lapsed (a
worker paused or cut off longer than the lease is someone else when it comes back, and so is a
process restarted under the same id). The owner record is layout 1's holder record
(`keys.holder_key`: `instance`, `worker`, `trial`, `memory`, `suspect`) with the owner's
`incarnation` and `since` (Redis time it was taken). Taking it (`ACQUIRE`) succeeds when it is free,
released, quarantined or the taker's own, else only when its owner is dead. Liveness lives in another
Cluster slot, so the taker passes its view (the live incarnations it read, and when): an owner
missing from the view, recorded before it, is dead (its entry lapsed, so it stopped serving on its
own clock); a record newer than the view may be a worker the view missed, and waits for the next.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from redis.exceptions import ResponseError

from worker.core import keys
from worker.core.redis_batch import BatchScript
from worker.state.redis_client import AsyncClient, safe_text

# An owner record lasts this long without being refreshed; its owner refreshes it every
# OWNER_REFRESH_SECONDS. A record outlives its owner only when nobody may take it (the subscription
# was deleted while its owner died): it then goes on its own.
OWNER_TTL_MS = 24 * 3600 * 1000
OWNER_REFRESH_SECONDS = 6 * 3600.0

# Take slots: KEYS a slot's layout 1 lease and its owner record per operation. ARGV: 1 the worker id,
# 2 its instance, 3 its incarnation, 4 the record's TTL (ms), 5 the lease TTL (ms), 6 the view's time
# less a margin for the clocks of Cluster nodes (Redis ms), 7.. the live incarnations of the view.
# Six values an operation: a layout 1 lease held by another (a worker before the switch, a seek
# command) refuses, {0}; one without an expiry gets one ({-1}, as in layout 1); taken, {1, previous
# instance, worker, trial, memory, suspect} (`quarantine.Taken`). The taker's own layout 1 lease
# becomes its record (the switch).
ACQUIRE = BatchScript("""
local live = {}
for i = 7, #ARGV do live[ARGV[i]] = true end
local t = redis.call('TIME')
local now = string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
local function take(lease_key, record_key)
  local lease = redis.pcall('GET', lease_key)
  if type(lease) == 'string' and lease ~= ARGV[1] then
    if redis.call('PTTL', lease_key) == -1 then redis.call('PEXPIRE', lease_key, ARGV[5]); return {-1} end
    return {0}
  end
  local ours = lease == ARGV[1]
  local rec = redis.pcall('HMGET', record_key, 'instance', 'worker', 'trial', 'memory', 'suspect', 'incarnation',
                          'since', 'released')
  if rec.err then redis.call('DEL', record_key); rec = {} end
  local incarnation = rec[6]
  if incarnation and not ours and incarnation ~= ARGV[3] and rec[8] ~= '1' and rec[1] ~= 'quarantined' and
      (live[incarnation] or (tonumber(rec[7]) or 0) > tonumber(ARGV[6])) then
    return {0}
  end
  if ours then redis.call('DEL', lease_key) end
  redis.call('DEL', record_key)
  redis.call('HSET', record_key, 'instance', ARGV[2], 'worker', ARGV[1], 'trial', '0', 'incarnation', ARGV[3],
             'since', now)
  redis.call('PEXPIRE', record_key, ARGV[4])
  return {1, rec[1] or '', rec[2] or '', rec[3] or '', rec[4] or '', rec[5] or ''}
end
local out = {}
for i = 1, #KEYS, 2 do
  local r = take(KEYS[i], KEYS[i + 1])
  for j = 1, 6 do out[#out + 1] = r[j] or '' end
end
return out
""", width=6)
# Release slots: KEYS a slot's lease and record per operation, ARGV[1] the worker id, ARGV[2] its
# incarnation, then per operation '1' while the subscription is still a suspect here (its trial not
# over: the record stays, released and marked `suspect`, so that the next owner tries it too). One
# value an operation: 1 released, 0 not ours.
RELEASE = BatchScript("""
local out = {}
for i = 1, #KEYS, 2 do
  if redis.pcall('GET', KEYS[i]) == ARGV[1] then redis.call('DEL', KEYS[i]) end
  if redis.pcall('HGET', KEYS[i + 1], 'incarnation') ~= ARGV[2] then
    out[#out + 1] = 0
  else
    if ARGV[2 + (i + 1) / 2] == '1' then
      redis.call('HSET', KEYS[i + 1], 'trial', '0', 'memory', '0', 'suspect', '1', 'released', '1')
    else
      redis.call('DEL', KEYS[i + 1])
    end
    out[#out + 1] = 1
  end
end
return out
""", width=1)
# Refresh the records (one a key) of ARGV[1] (an incarnation) for ARGV[2] ms: 1, or 0 not ours.
REFRESH = BatchScript("""
local out = {}
for i = 1, #KEYS do
  if redis.pcall('HGET', KEYS[i], 'incarnation') == ARGV[1] then out[i] = redis.call('PEXPIRE', KEYS[i], ARGV[2])
  else out[i] = 0 end
end
return out
""", width=1)


def owner_of(lease: Any, record: Sequence[Any], alive: set[str]) -> str:
    """Who serves a slot by what Redis holds: its layout 1 lease's holder, else the worker its owner
    record names while that incarnation is alive (`record`: HMGET worker, incarnation, released); ''."""
    if isinstance(lease, bytes) and lease:
        return safe_text(lease)
    if not record:
        return ""
    worker, incarnation, released = (safe_text(v) if isinstance(v, bytes) else "" for v in record)
    return worker if incarnation in alive and released != "1" else ""


def alive_key(fleet: str) -> str:
    return keys.fleet_key(fleet, "alive")


async def alive(client: AsyncClient, fleet: str, incarnations: set[str]) -> set[str]:
    """Which of `incarnations` have a live entry (expiry in the future by Redis time)."""
    if not incarnations:
        return set()
    names = sorted(incarnations)
    seconds, micros = await client.time()
    now_ms = seconds * 1000 + micros // 1000
    scores = await client.zmscore(alive_key(fleet), names)
    return {n for n, score in zip(names, scores, strict=True) if score is not None and score > now_ms}


async def record_owners(client: AsyncClient, fleet: str, sub_key: str, slots: int) -> list[str]:
    """The live worker each of the first `slots` owner records names ('' none: free, released, or its
    owner dead)."""
    read = await asyncio.gather(*(client.hmget(keys.holder_key(sub_key, slot), ["worker", "incarnation", "released"])
                                  for slot in range(slots)), return_exceptions=True)
    for result in read:
        if isinstance(result, BaseException) and not isinstance(result, ResponseError):
            raise result
    records = [r if isinstance(r, list) else [None] * 3 for r in read]  # a key of the wrong type: garbage, nobody
    live = await alive(client, fleet, {safe_text(r[1]) for r in records if isinstance(r[1], bytes)})
    return [owner_of(None, record, live) for record in records]


async def owners(client: AsyncClient, fleet: str, sub_key: str, slots: int) -> list[str]:
    """Who serves each of the subscription's first `slots` slots ('' nobody), in either layout: a
    layout 1 lease's holder (a worker, or a seek command), else the live owner its record names."""
    leases = await client.mget([keys.lease_key(sub_key, slot) for slot in range(slots)])  # one hash tag
    named = await record_owners(client, fleet, sub_key, slots)
    return [owner_of(lease, (), set()) or record for lease, record in zip(leases, named, strict=True)]


async def holders(client: AsyncClient, fleet: str, sub_key: str, slots: int) -> set[str]:
    """The workers (or a seek command) serving one of the subscription's first `slots` slots."""
    return {owner for owner in await owners(client, fleet, sub_key, slots) if owner}


def owners_now(client: Any, fleet: str, sub_keys: Sequence[str], slots: int = 1) -> dict[str, list[str]]:
    """`owners` for many subscriptions from a synchronous client (tools and tests), in one pipeline."""
    pipe = client.pipeline()
    for key in sub_keys:
        for slot in range(slots):
            pipe.get(keys.lease_key(key, slot))
            pipe.hmget(keys.holder_key(key, slot), ["worker", "incarnation", "released"])
    read = pipe.execute(raise_on_error=False)
    seconds, micros = client.time()
    now_ms = seconds * 1000 + micros // 1000
    expiries = dict(client.zrange(alive_key(fleet), 0, -1, withscores=True))
    live = {safe_text(name) for name, score in expiries.items() if score > now_ms}
    out: dict[str, list[str]] = {}
    for i, key in enumerate(sub_keys):
        pairs = read[i * 2 * slots:(i + 1) * 2 * slots]
        out[key] = [owner_of(lease if not isinstance(lease, Exception) else None,
                             record if isinstance(record, list) else (), live)
                    for lease, record in zip(pairs[::2], pairs[1::2], strict=True)]
    return out
