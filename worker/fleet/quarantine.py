"""Containment of a message that kills the worker serving it (a compressed or chunked "bomb" the Pulsar
client inflates before the worker sees it, or anything else that takes the process down).

A worker cannot see such a message coming: it dies inside the client. What the fleet can see is how a
lease ends, and what the dead worker said before it died. Each lease has a holder record
(`keys.holder_key`: the holding process's instance, whether the subscription is on trial there, and
whether the memory alarm named it), written when the lease is taken and deleted when it is released.
A lease taken over with the previous holder's record still there was not released: that holder died
(an OOM kill, kill -9, a crash) or was cut off. Whether that death is laid at its subscriptions' door
depends on the *memory evidence* it left (`Evidence`; `memory_watch.py`): a worker whose memory
passes the alarm says so in a record of its own, naming the subscription on trial that inflates, if
one does. No evidence (kill -9, a lost node, a liveness kill, a crash): the next holder serves at once.

With evidence that names none of them, the dead worker's subscriptions are *suspects*: the next holder
puts each on trial for `fleet.trial_seconds`, `fleet.trials_at_once` at a time, each on a Pulsar client
of its own, so that what inflates is named by its thread. A subscription whose holder died on trial
with the alarm naming it is the one that killed it: the worker that takes its lease next quarantines
it (state Quarantined: paused, with why and since; no consumer) instead of serving it. So a poison
message costs at most two deaths: the one that made its subscription a suspect, and the one on trial.
Evidence that names one subscription leaves the dead worker's others served at once. `subs resume`
tries a quarantined one again (alone on trial first). A quarantine whose holder turns out alive (its
lease lapsed while Redis was out of its reach) is lifted by that holder.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from worker.core.redis_batch import BatchScript
from worker.state.redis_client import safe_text

# A holder record lives this many lease periods past the holder's last renewal: long enough for the
# next holder to find it after a death (the lease lapses in one period; a worker restarted by the
# kubelet's back-off takes it in a few), short enough that a fleet started again after an outage does
# not take all its subscriptions for suspects.
HOLDER_TTL_LEASES = 6
# A trial whose subscribe has not gone through in this many trial periods (at least STALLED_SECONDS)
# ends: the next suspect's begins.
STALLED_TRIALS = 3
STALLED_SECONDS = 30.0

# Take the lease (KEYS[1]) as ARGV[1] for ARGV[2] ms and record this holder (KEYS[2]: ARGV[3] its
# instance; kept ARGV[4] ms). Returns {1, previous instance, previous worker, previous trial flag,
# previous memory alarm, previous suspect flag} when taken; {0} when someone holds it; {-1} for a
# lease without an expiry (garbage: it gets one, and lapses like a dead owner's). A holder record
# of the wrong type is garbage: no previous holder.
ACQUIRE_HOLDING = """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  if redis.call('PTTL', KEYS[1]) == -1 then redis.call('PEXPIRE', KEYS[1], ARGV[2]); return {-1} end
  return {0}
end
local previous = redis.pcall('HMGET', KEYS[2], 'instance', 'worker', 'trial', 'memory', 'suspect', 'incarnation',
                             'released')
if previous.err then
  redis.call('DEL', KEYS[2])
  previous = {}
end
-- A layout 2 owner (`ownership.py`: a worker that saw the switch a round earlier) keeps it.
if previous[6] and previous[7] ~= '1' and previous[1] ~= 'quarantined' then
  redis.call('DEL', KEYS[1])
  return {0}
end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'instance', ARGV[3], 'worker', ARGV[1], 'trial', '0')
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return {1, previous[1] or '', previous[2] or '', previous[3] or '', previous[4] or '', previous[5] or ''}
"""
# Renew leases (KEYS: a lease and its holder record per operation) held as ARGV[1] for ARGV[2] ms,
# and the holder records of this instance (ARGV[3]) for ARGV[4] ms; 1 renewed, 0 not ours (any more).
RENEW_HOLDING = BatchScript("""
local out = {}
for i = 1, #KEYS, 2 do
  if redis.pcall('GET', KEYS[i]) == ARGV[1] then
    out[#out + 1] = redis.call('PEXPIRE', KEYS[i], ARGV[2])
    if redis.pcall('HGET', KEYS[i + 1], 'instance') == ARGV[3] then redis.call('PEXPIRE', KEYS[i + 1], ARGV[4]) end
  else
    out[#out + 1] = 0
  end
end
return out
""", width=1)
# Release the lease (KEYS[1]) held as ARGV[1], and the holder record (KEYS[2]) if it is this instance's
# (ARGV[2]): a clean hand-over leaves nothing that makes the next holder suspicious. ARGV[3] '1': the
# subscription is still a suspect here (its trial not over): the record stays, off trial and marked
# `suspect`, so that the next holder tries it too (1.1.0's workers take any record left for a suspect).
RELEASE_HOLDING = """
if redis.pcall('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
if redis.pcall('HGET', KEYS[2], 'instance') == ARGV[2] then
  if ARGV[3] == '1' then redis.call('HSET', KEYS[2], 'trial', '0', 'memory', '0', 'suspect', '1')
  else redis.call('DEL', KEYS[2]) end
end
return 1
"""
# Quarantine: let the lease (KEYS[1]) go if held as ARGV[1], and leave a holder record (KEYS[2]) that no
# process owns, for ARGV[2] ms: whoever serves the subscription after `subs resume` takes it for a
# suspect and tries it alone first, so a message that still kills costs one death more, not two, and
# is never laid at another subscription's door while this one is served beside a trial.
QUARANTINE_HOLDER = """
if redis.pcall('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'instance', 'quarantined', 'worker', ARGV[1], 'trial', '0')
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
"""
QUARANTINED_HOLDER_TTL_MS = 30 * 24 * 3600 * 1000  # a resume within a month tries it alone first
QUARANTINED_INSTANCE = "quarantined"  # the instance QUARANTINE_HOLDER records: no process is

# Set a field (ARGV[2]: `trial`, `memory`: the alarm named it) of the holder record (KEYS[1]) to
# ARGV[3] while the record is this instance's (ARGV[1]).
MARK = """
if redis.pcall('HGET', KEYS[1], 'instance') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
return 1
"""


@dataclass(frozen=True, slots=True)
class Taken:
    """How a lease was taken: from nobody, from a holder that let go, or from one that did not."""

    previous_instance: str = ""
    previous_worker: str = ""
    previous_on_trial: bool = False
    previous_out_of_memory: bool = False  # the memory alarm named it while it was on trial there
    previous_suspect: bool = False  # handed over before its trial was over

    @classmethod
    def parse(cls, reply: list[Any]) -> Taken:
        _, instance, worker, trial, memory, *rest = (safe_text(part) if isinstance(part, bytes) else str(part)
                                                     for part in reply)
        return cls(instance, worker, trial == "1", memory == "1", rest[:1] == ["1"])

    def unreleased_by(self, instance: str) -> bool:
        """Whether another process held the lease and never released it."""
        return bool(self.previous_instance) and self.previous_instance != instance

    @property
    def quarantined_before(self) -> bool:
        """Resumed after a quarantine (the record `QUARANTINE_HOLDER` leaves): tried alone first."""
        return self.previous_instance == QUARANTINED_INSTANCE


@dataclass(frozen=True, slots=True)
class Evidence:
    """What a worker said of its memory before it died (`keys.fleet_key(fleet, "memory:<instance>")`):
    the alarm went off, naming the unit on trial whose client inflated ('' when it was none of them)."""

    named: str = ""

    @classmethod
    def parse(cls, raw: Any) -> Evidence | None:
        if raw is None:
            return None
        try:
            value = orjson.loads(raw)
        except (TypeError, ValueError):
            return cls()  # garbage: the alarm went off, nothing named (the safe reading)
        named = value.get("named") if isinstance(value, dict) else None
        return cls(named if isinstance(named, str) else "")

    def dump(self, worker: str) -> bytes:
        return orjson.dumps({"named": self.named, "worker": worker, "at_ms": int(time.time() * 1000)})


SERVE, SUSPECT, QUARANTINE = "serve", "suspect", "quarantine"


def verdict(name: str, taken: Taken, evidence: Evidence | None) -> str:
    """What the next holder of unit `name` does, taken over from a holder that never released it:
    QUARANTINE (its holder died on trial with the alarm naming it), SUSPECT (on trial first), or
    SERVE (at once: no memory evidence, or evidence naming another subscription)."""
    named = evidence is not None and evidence.named == name
    if taken.previous_on_trial and (taken.previous_out_of_memory or named):
        return QUARANTINE
    if taken.quarantined_before or taken.previous_suspect or named:
        return SUSPECT
    if evidence is None or evidence.named:
        return SERVE
    return SUSPECT  # the alarm went off and named nobody: any of its subscriptions may be the one


def record(reason: str, instance: str, worker: str) -> bytes:
    """A quarantine record (the value in `...:quarantined`): when, why, and which process died."""
    return orjson.dumps({"since_ms": int(time.time() * 1000), "reason": reason, "instance": instance,
                         "worker": worker})


def parse_record(raw: Any) -> dict[str, Any]:
    """A quarantine record as written by `record`; anything else (garbage) as a record without details."""
    try:
        value = orjson.loads(raw)
    except (TypeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def describe(record: dict[str, Any]) -> str:
    """A quarantine record as `subs list` and the API say it."""
    since = record.get("since_ms")
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since / 1000)) if isinstance(since, int) else "?"
    return f"quarantined since {when}: {str(record.get('reason') or 'no reason recorded')[:300]}"


@dataclass
class Trial:
    began_at: float  # monotonic time its trial began (its start was asked for)
    started_at: float = 0.0  # monotonic time its dispatcher was first seen serving; 0: not yet


@dataclass
class Trials:
    """This worker's suspects: the units (subscription slots) waiting for a trial, in the order they
    came, and those on trial now, at most `at_once` together."""

    seconds: float
    at_once: int = 1
    waiting: dict[str, float] = field(default_factory=dict)  # unit -> monotonic time it became a suspect
    on_trial: dict[str, Trial] = field(default_factory=dict)

    def suspect(self, name: str, now: float) -> None:
        self.waiting.setdefault(name, now)

    def holds_back(self, name: str) -> bool:
        """Whether `name` waits for its trial (it is not started yet)."""
        return name in self.waiting

    def next(self) -> list[str]:
        """The suspects to put on trial now (the longest waiting first)."""
        free = self.at_once - len(self.on_trial)
        return sorted(self.waiting, key=lambda n: (self.waiting[n], n))[:max(0, free)]

    def begin(self, name: str, now: float) -> float:
        """On trial from `now`; returns how long it waited for it."""
        waited = now - self.waiting.pop(name, now)
        self.on_trial[name] = Trial(now)
        return waited

    def serving(self, name: str, now: float) -> None:
        """Its dispatcher is serving: its trial time runs from now."""
        trial = self.on_trial.get(name)
        if trial is not None and not trial.started_at:
            trial.started_at = now

    def over(self, now: float) -> list[tuple[str, bool]]:
        """The trials whose time is up, each with whether it served (False: its subscribe did not go
        through in STALLED_TRIALS trial periods, at least STALLED_SECONDS; the broker refuses it, and
        the other suspects must not wait for it)."""
        stalled_after = max(STALLED_SECONDS, STALLED_TRIALS * self.seconds)
        return [(name, bool(t.started_at)) for name, t in sorted(self.on_trial.items())
                if (now - t.started_at >= self.seconds if t.started_at else now - t.began_at >= stalled_after)]

    def end(self, name: str) -> None:
        self.on_trial.pop(name, None)

    def on(self, name: str) -> bool:
        return name in self.on_trial

    def suspected(self, name: str) -> bool:
        """Whether `name` is a suspect here still: waiting, or on trial."""
        return name in self.waiting or name in self.on_trial

    def drop(self, name: str) -> None:
        """`name` is no longer held here (handed over, lost, deleted)."""
        self.waiting.pop(name, None)
        self.on_trial.pop(name, None)
