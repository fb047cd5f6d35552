"""Leases: which worker serves a subscription, fenced on the worker's own clock, and the balanced
assignment every worker computes alike.

A subscription is served only while its lease (`pw:{sub}:lease`, the owner's id with an expiry)
is held. The lease is fenced on the worker's monotonic clock: it stops delivering `margin` before
the lease could have expired in Redis, so a paused or partitioned worker has stopped before anyone
else can start.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable

RENEW = """
local holder = redis.pcall('GET', KEYS[1])
if holder == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
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


def _weight(member: str, sub_key: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{member}\0{sub_key}".encode(), digest_size=8).digest(), "big")


def assign(sub_keys: Iterable[str], members: Iterable[str]) -> dict[str, str]:
    """Rendezvous hashing with bounded loads: each subscription goes to its highest-ranked member
    that has fewer than ceil(S/M). Every worker computes the same answer; spread is even (within
    one); a join or leave moves about 1/N of the subscriptions."""
    ranked_members = sorted(set(members))
    keys_sorted = sorted(set(sub_keys))
    if not ranked_members:
        return {}
    cap = -(-len(keys_sorted) // len(ranked_members))
    load = dict.fromkeys(ranked_members, 0)
    out: dict[str, str] = {}
    for key in keys_sorted:
        for member in sorted(ranked_members, key=lambda m: _weight(m, key), reverse=True):
            if load[member] < cap:
                out[key] = member
                load[member] += 1
                break
    return out


class Lease:
    """A held lease; `valid()` is the fencing check made before every delivery attempt."""

    def __init__(self, ttl: float, margin: float) -> None:
        self.ttl, self.margin = ttl, margin
        self.valid_until = 0.0

    def renewed(self, sent_at: float) -> None:
        # Counted from when the renew was *sent*: Redis set its expiry later than that.
        self.valid_until = sent_at + self.ttl - self.margin

    def valid(self) -> bool:
        return time.monotonic() < self.valid_until

    def due(self, now: float) -> bool:
        """Renew once less than half the lease is left: every ~ttl/3 instead of every heartbeat
        (with a thousand subscriptions, renewing each second was most of an idle worker's CPU)."""
        return self.valid_until - now < self.ttl / 2
