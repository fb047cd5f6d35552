"""Containment of a message that kills the worker serving it (a compressed or chunked "bomb" the Pulsar
client inflates before the worker sees it, or anything else that takes the process down).

A worker cannot see such a message coming: it dies inside the client. What the fleet can see is how a
lease ends. Each lease has a holder record (`keys.holder_key`: the holding process's instance, and
whether the subscription is on trial there), written when the lease is taken and deleted when it is
released. A lease taken over with the previous holder's record still there was not released: that
holder died (an OOM kill, kill -9, a crash) or was cut off. Its subscriptions are *suspects*.

The next holder starts its suspects one at a time, each alone on trial for `fleet.trial_seconds`
(its record says `trial`), while everything else it serves starts at once. While one is on trial, a
thread watches the process's memory; past MEMORY_ALARM of the container's limit the record says
`memory` too (an OOM kill is under way: a few KiB that inflate to GiBs take a second or less). A
subscription whose holder died on trial there with its memory running out is the one that killed it:
the worker that takes its lease next quarantines it (state Quarantined: paused, with why and since; no
consumer) instead of serving it. So a poison message costs at most two deaths: the one that made its
subscription a suspect, and the one on trial. A death on trial without the memory alarm (kill -9, a
lost node, a crash of the worker's own) leaves the subscription a suspect, never quarantined; without
a memory limit nothing is quarantined. `subs resume` tries it again. A quarantine whose holder turns
out alive (its lease lapsed while Redis was out of its reach) is lifted by that holder.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
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

MEMORY_ALARM = 0.75  # of the container's memory limit: past it, while on trial, an OOM kill is coming
MEMORY_POLL_SECONDS = 0.01  # how often the process's memory is read while a subscription is on trial

# Take the lease (KEYS[1]) as ARGV[1] for ARGV[2] ms and record this holder (KEYS[2]: ARGV[3] its
# instance; kept ARGV[4] ms). Returns {1, previous instance, previous worker, previous trial flag,
# previous memory alarm} when taken; {0} when someone holds it; {-1} for a lease without an expiry
# (garbage: it gets one, and lapses like a dead owner's). A holder record of the wrong type is garbage:
# no previous holder.
ACQUIRE_HOLDING = """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  if redis.call('PTTL', KEYS[1]) == -1 then redis.call('PEXPIRE', KEYS[1], ARGV[2]); return {-1} end
  return {0}
end
local previous = redis.pcall('HMGET', KEYS[2], 'instance', 'worker', 'trial', 'memory')
if previous.err then
  redis.call('DEL', KEYS[2])
  previous = {}
end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'instance', ARGV[3], 'worker', ARGV[1], 'trial', '0')
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return {1, previous[1] or '', previous[2] or '', previous[3] or '', previous[4] or ''}
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
# subscription is still a suspect here (its trial not over): the record stays, off trial, so that the
# next holder tries it too.
RELEASE_HOLDING = """
if redis.pcall('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
if redis.pcall('HGET', KEYS[2], 'instance') == ARGV[2] then
  if ARGV[3] == '1' then redis.call('HSET', KEYS[2], 'trial', '0', 'memory', '0') else redis.call('DEL', KEYS[2]) end
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

# Set a field (ARGV[2]: `trial`, `memory`) of the holder record (KEYS[1]) to ARGV[3] while the record is
# this instance's (ARGV[1]).
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
    previous_out_of_memory: bool = False  # its memory alarm went off while it was on trial

    @classmethod
    def parse(cls, reply: list[Any]) -> Taken:
        _, instance, worker, trial, memory = (safe_text(part) if isinstance(part, bytes) else str(part)
                                              for part in reply)
        return cls(instance, worker, trial == "1", memory == "1")

    @property
    def killed_on_trial(self) -> bool:
        """The previous holder died on trial with this subscription, its memory running out."""
        return self.previous_on_trial and self.previous_out_of_memory

    def unreleased_by(self, instance: str) -> bool:
        """Whether another process held the lease and never released it."""
        return bool(self.previous_instance) and self.previous_instance != instance


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
class Trials:
    """This worker's suspects: the units (subscription slots) whose lease it took from a holder that
    never released it, waiting to be started one at a time; and the one on trial now."""

    seconds: float
    waiting: dict[str, str] = field(default_factory=dict)  # unit -> the worker that held it before
    current: str = ""
    began_at: float = 0.0  # monotonic time the current one's trial began (its start was asked for)
    started_at: float = 0.0  # monotonic time the current one's dispatcher was first seen serving; 0: not yet

    def suspect(self, name: str, previous_worker: str) -> None:
        self.waiting[name] = previous_worker

    def holds_back(self, name: str) -> bool:
        """Whether `name` waits for its trial (it is not started yet)."""
        return name in self.waiting

    def next(self) -> str:
        """The suspect to start now, or "" while one is on trial."""
        if self.current or not self.waiting:
            return ""
        return min(self.waiting)

    def begin(self, name: str, now: float) -> None:
        self.waiting.pop(name, None)
        self.current, self.began_at, self.started_at = name, now, 0.0

    def serving(self, now: float) -> None:
        """The current one's dispatcher is serving: its trial time runs from now."""
        if self.current and not self.started_at:
            self.started_at = now

    def over(self, now: float) -> bool:
        """The current trial's time is up; or its subscribe has not gone through in STALLED_TRIALS
        trial periods (the broker refuses it: nothing can reach a consumer that does not exist, and
        the other suspects must not wait for it)."""
        if not self.current:
            return False
        if self.started_at:
            return now - self.started_at >= self.seconds
        return now - self.began_at >= max(STALLED_SECONDS, STALLED_TRIALS * self.seconds)

    def end(self) -> str:
        name, self.current, self.began_at, self.started_at = self.current, "", 0.0, 0.0
        return name

    def suspected(self, name: str) -> bool:
        """Whether `name` is a suspect here still: waiting, or on trial."""
        return name in self.waiting or name == self.current

    def drop(self, name: str) -> None:
        """`name` is no longer held here (handed over, lost, deleted)."""
        self.waiting.pop(name, None)
        if self.current == name:
            self.end()


def _resident_bytes() -> int:
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class MemoryAlarm:
    """A thread that, while armed (a subscription on trial), reads the process's resident memory every
    MEMORY_POLL_SECONDS and calls `on_alarm` on the event loop once it passes MEMORY_ALARM of `limit`.
    Disarmed it sleeps: nothing is read. A thread, not a task: while the client inflates a bomb the
    event loop may be slow, and the alarm must go out before the OOM kill."""

    def __init__(self, limit: int, loop: asyncio.AbstractEventLoop, on_alarm: Callable[[], None],
                 read: Callable[[], int] = _resident_bytes) -> None:
        self.threshold = int(limit * MEMORY_ALARM)
        self._loop, self._on_alarm, self._read = loop, on_alarm, read
        self._armed = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name="memory alarm", daemon=True)
        self._thread.start()

    def arm(self) -> None:
        self._armed.set()

    def disarm(self) -> None:
        self._armed.clear()

    def close(self) -> None:
        self._closed = True
        self._armed.set()  # wakes the thread, which ends

    def _watch(self) -> None:
        while True:
            self._armed.wait()
            if self._closed:
                return
            if self._read() >= self.threshold:
                self._armed.clear()  # once per arming
                if not self._closed:
                    self._loop.call_soon_threadsafe(self._on_alarm)
                continue
            time.sleep(MEMORY_POLL_SECONDS)
