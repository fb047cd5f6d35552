"""Leases: which worker serves a subscription, fenced on the worker's own clock, and the balanced
assignment every worker computes alike.

A subscription is served only while its lease (`pw:{sub}:lease`, the owner's id with an expiry)
is held. The lease is fenced on the worker's monotonic clock: it stops delivering `margin` before
the lease could have expired in Redis, so a paused or partitioned worker has stopped before anyone
else can start.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import hashlib
import time
from collections.abc import AsyncIterator, Iterable, Mapping

from worker.core import keys
from worker.core.redis_batch import BatchScript
from worker.runtime.errors import InfrastructureError
from worker.state.redis_client import AsyncClient

# The renewal of leases, many in one call (`redis_batch`; `hold` renews one): ARGV the holder and the
# TTL (ms); a lease key per operation; 1 renewed, 0 not ours (any more).
RENEW = BatchScript("""
local out = {}
for i = 1, #KEYS do
  if redis.pcall('GET', KEYS[i]) == ARGV[1] then out[i] = redis.call('PEXPIRE', KEYS[i], ARGV[2]) else out[i] = 0 end
end
return out
""", width=1)
RELEASE = """
if redis.pcall('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# Every lease carries an expiry. A lease key without one is garbage that would block the
# subscription forever: it gets the lease TTL, so it lapses like a dead owner's.
ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
if redis.call('PTTL', KEYS[1]) == -1 then redis.call('PEXPIRE', KEYS[1], ARGV[2]); return -1 end
return 0
"""


def _weight(member: str, unit: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{member}\0{unit}".encode(), digest_size=8).digest(), "big")


# A unit of assignment is one slot of a subscription: slot 0 is spelt as the subscription's key (so
# a fleet whose subscriptions all have one slot assigns exactly as before slots existed, and the
# previous release's workers agree with this one's), slot i > 0 as `<key>#<i>` ('#' is in no key).
def unit(sub_key: str, slot: int) -> str:
    return f"{sub_key}#{slot}" if slot else sub_key


def unit_parts(name: str) -> tuple[str, int]:
    """(subscription key, slot) of a unit."""
    key, _, slot = name.partition("#")
    return key, int(slot) if slot else 0


def units(widths: Mapping[str, int]) -> list[str]:
    """Every slot of every subscription: `widths` maps a key to how many workers serve it now."""
    return [unit(key, slot) for key, width in widths.items() for slot in range(max(1, width))]


def assign(unit_names: Iterable[str], members: Iterable[str]) -> dict[str, str]:
    """Rendezvous hashing with bounded loads: each unit goes to its highest-ranked member that has
    fewer than ceil(U/M) and holds no other slot of the same subscription (two slots on one worker
    would be one consumer's work done twice over). Every worker computes the same answer; spread is
    even (within one); a join or leave moves about 1/N of the units. A slot no member can take (more
    slots than members) is left out; one only over-full members could take goes over the bound."""
    ranked_members = sorted(set(members))
    names = sorted(set(unit_names))
    if not ranked_members:
        return {}
    cap = -(-len(names) // len(ranked_members))
    load = dict.fromkeys(ranked_members, 0)
    holding: dict[str, set[str]] = {}  # subscription key -> members holding one of its slots
    out: dict[str, str] = {}
    for name in names:
        taken = holding.setdefault(unit_parts(name)[0], set())
        eligible = sorted((m for m in ranked_members if m not in taken), key=lambda m: _weight(m, name), reverse=True)
        chosen = next((m for m in eligible if load[m] < cap), eligible[0] if eligible else None)
        if chosen is not None:
            out[name] = chosen
            load[chosen] += 1
            taken.add(chosen)
    return out


# Layout 2 assigns buckets of subscriptions, not each one (`assign_buckets`): a worker's work on a
# change of members grows with the buckets and its own subscriptions, not with the fleet's.
BUCKETS = 4096
VNODES = 32  # points a member has on the ring


@functools.lru_cache(maxsize=1 << 18)
def bucket_of(key: str) -> int:
    """The bucket of a subscription's slot 0 (its key), fixed for ever."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") % BUCKETS


@functools.lru_cache(maxsize=1)
def _bucket_points() -> tuple[int, ...]:
    return tuple(_weight("bucket", str(b)) for b in range(BUCKETS))


@functools.lru_cache(maxsize=4)
def _ring(members: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    ring = sorted((_weight(m, f"vnode {v}"), m) for m in members for v in range(VNODES))
    return tuple(p for p, _ in ring), tuple(m for _, m in ring)


def assign_buckets(sizes: Mapping[int, int], members: Iterable[str]) -> dict[int, str]:
    """Consistent hashing with bounded loads, over buckets weighed by the subscriptions they hold:
    each bucket, in order, goes to the first member clockwise of it on a ring (VNODES points a
    member) whose load stays within ceil(subscriptions / members); one that fits nowhere goes to the
    least loaded. Every worker computes the same; loads differ by less than a bucket's size (one
    subscription while buckets hold at most one); a join or leave moves about 1/N of the buckets.
    Cost: about BUCKETS steps, whatever the number of subscriptions."""
    ranked = tuple(sorted(set(members)))
    if not ranked:
        return {}
    points, owners = _ring(ranked)
    bucket_points = _bucket_points()
    cap = -(-sum(sizes.values()) // len(ranked))
    load = dict.fromkeys(ranked, 0)
    out: dict[int, str] = {}
    for bucket in sorted(sizes):
        size = sizes[bucket]
        start, chosen, full = bisect.bisect(points, bucket_points[bucket]), None, set()
        for i in range(len(owners)):
            member = owners[(start + i) % len(owners)]
            if load[member] + size <= cap:
                chosen = member
                break
            full.add(member)
            if len(full) == len(ranked):
                break
        if chosen is None:
            chosen = min(ranked, key=lambda m: (load[m], m))
        out[bucket] = chosen
        load[chosen] += size
    return out


def assign_slots(widths: Mapping[str, int], first: Mapping[str, str], members: Iterable[str]) -> dict[str, str]:
    """The slots past the first of spread subscriptions (`widths`: key to how many serve it; `first`:
    who holds each one's slot 0): each to its highest-ranked member holding no other slot of it. A
    slot no member can take is left out."""
    ranked = sorted(set(members))
    out: dict[str, str] = {}
    for key, width in sorted(widths.items()):
        taken = {first[key]} if key in first else set()
        for slot in range(1, width):
            name = unit(key, slot)
            eligible = [m for m in ranked if m not in taken]
            if eligible:
                out[name] = max(eligible, key=lambda m: _weight(m, name))
                taken.add(out[name])
    return out


class Lease:
    """A held lease; `valid()` is the fencing check made before every delivery attempt."""

    def __init__(self, ttl: float, margin: float) -> None:
        self.ttl, self.margin = ttl, margin
        self.valid_until = 0.0
        self.renewal = asyncio.Event()  # set at the next renewal (then replaced): a fenced dispatcher's wake-up

    def renewed(self, sent_at: float) -> None:
        # Counted from when the renew was *sent*: Redis set its expiry later than that.
        self.valid_until = sent_at + self.ttl - self.margin
        self.renewal.set()
        self.renewal = asyncio.Event()

    def valid(self) -> bool:
        return time.monotonic() < self.valid_until

    def due(self, now: float) -> bool:
        """Renew once less than half the lease is left: every ~ttl/3 instead of every heartbeat
        (with a thousand subscriptions, renewing each second was most of an idle worker's CPU)."""
        return self.valid_until - now < self.ttl / 2


class LeaseLost(InfrastructureError):
    """A lease held with `hold` could not be renewed in time."""


@contextlib.asynccontextmanager
async def hold(client: AsyncClient, sub_key: str, holder: str, ttl_seconds: float) -> AsyncIterator[bool]:
    """Hold a subscription's lease as `holder` for the duration of the block, as a worker would
    (renewed every third of `ttl_seconds`), so no worker starts serving it meanwhile. Yields False,
    holding nothing, when someone holds it already; raises LeaseLost at the end of the block when a
    renewal failed."""
    lease, ttl_ms = keys.lease_key(sub_key), int(ttl_seconds * 1000)
    if await client.eval(ACQUIRE, 1, lease, holder, ttl_ms) != 1:
        yield False
        return

    async def renew() -> None:
        while True:
            if await client.eval(RENEW.source, 1, lease, holder, ttl_ms) != [1]:
                return
            await asyncio.sleep(ttl_seconds / 3)

    renewing = asyncio.create_task(renew(), name=f"hold {sub_key}")
    try:
        yield True
    finally:
        lost = renewing.done()  # it ends on its own only when a renewal failed
        renewing.cancel()
        await asyncio.gather(renewing, return_exceptions=True)
        with contextlib.suppress(Exception):
            await client.eval(RELEASE, 1, lease, holder)
    if lost:
        raise LeaseLost(f"{sub_key}: the lease this command held could not be renewed, so a worker may have "
                        "started on the subscription meanwhile; run the command again")
