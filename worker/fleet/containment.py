"""The fleet's side of containing a message that kills its worker (the records, scripts and trials
are quarantine.py's): one suspect at a time on trial, the memory alarm while it is, the holder
record's marks, and the quarantine of a subscription its worker died on, on trial, out of memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from worker.core import keys
from worker.fleet import quarantine
from worker.fleet.leases import unit_parts
from worker.fleet.quarantine import MemoryAlarm, Taken, Trials
from worker.fleet.registry import Registry
from worker.fleet.worker_protocol import ServingWorker
from worker.runtime import resources
from worker.runtime.supervisor import log_task_failure
from worker.state.redis_client import REDIS_DOWN, AsyncClient


class Containment:
    def __init__(self, client: AsyncClient, registry: Registry, worker: ServingWorker, trial_seconds: float,
                 instance: str, log: Any) -> None:
        self.client, self.registry, self.worker = client, registry, worker
        self.trial_seconds = trial_seconds
        self.instance = instance
        self.log = log
        # Subscriptions taken from a holder that died with them, started one at a time, and the
        # memory alarm that runs while one is on trial (with a memory limit to measure against).
        self.trials = Trials(trial_seconds)
        self.memory_limit = resources.memory_limit()[0] if trial_seconds > 0 else None
        self._alarm: MemoryAlarm | None = None
        self._marks: set[asyncio.Task[None]] = set()

    @property
    def on(self) -> bool:
        return self.trial_seconds > 0

    def start(self) -> None:
        if self.memory_limit is not None:
            self._alarm = MemoryAlarm(self.memory_limit, asyncio.get_running_loop(), self._memory_alarm)

    def close(self) -> None:
        if self._alarm is not None:
            self._alarm.close()

    def holds_back(self, name: str) -> bool:
        """Whether `name` waits for its trial (a suspect not yet tried)."""
        return self.trials.holds_back(name)

    def suspect(self, name: str, died: str) -> None:
        self.trials.suspect(name, died)

    def suspected(self, name: str) -> bool:
        return self.trials.suspected(name)

    async def advance(self) -> None:
        """End the trial whose time is over; start the next suspect's (its holder record says so
        before its consumer exists: a death from here on is laid at its door)."""
        now = time.monotonic()
        current = self.trials.current
        if current and unit_parts(current)[0] in self.worker.dispatchers:
            self.trials.serving(now)
        if self.trials.over(now):
            served = bool(self.trials.started_at)
            await self._mark_trial(current, False)
            self.trials.end()
            self.log.info("trial over: served alone without a death" if served else
                          "trial over: its subscribe did not go through; the next suspect's begins",
                          subscription=unit_parts(current)[0])
        name = self.trials.next()
        if name:
            await self._mark_trial(name, True)
            self.trials.begin(name, now)
            self.log.info("on trial: its last holder died holding it; served alone for a while",
                          subscription=unit_parts(name)[0], seconds=self.trial_seconds)

    async def _mark_trial(self, name: str, on: bool) -> None:
        await self._mark(name, "trial", "1" if on else "0")
        if self._alarm is not None:  # the alarm runs while a subscription is on trial, and only then
            (self._alarm.arm if on else self._alarm.disarm)()

    async def _mark(self, name: str, field: str, value: str) -> None:
        key, slot = unit_parts(name)
        await self.client.eval(quarantine.MARK, 1, keys.holder_key(key, slot), self.instance, field, value)

    def _memory_alarm(self) -> None:
        """Memory past the alarm while a subscription is on trial: an OOM kill is likely on its way.
        Said in its holder record, so that the next holder knows what this worker died of."""
        name = self.trials.current
        if not name:
            return
        self.log.error("memory alarm while a subscription is on trial: it is quarantined if this worker dies",
                       subscription=unit_parts(name)[0], limit=self.memory_limit)
        task = asyncio.create_task(self._mark(name, "memory", "1"), name=f"memory alarm {name}")
        self._marks.add(task)
        task.add_done_callback(self._marks.discard)
        task.add_done_callback(log_task_failure(self.worker.supervisor, "memory alarm"))

    def untry(self, name: str) -> None:
        """`name` is held here no more: no trial, no alarm for it."""
        if self.trials.current == name and self._alarm is not None:
            self._alarm.disarm()
        self.trials.drop(name)

    async def quarantine(self, name: str, taken: Taken, me: str) -> None:
        """The holder before this worker died while `name` was on trial there, alone: its message
        kills whoever serves it. Quarantined (paused, with why), and the lease let go."""
        key, slot = unit_parts(name)
        reason = (f"its worker ran out of memory and died while serving it on trial, alone, after an earlier "
                  f"holder had died with it (last: {taken.previous_worker or 'a worker'}); a message of it "
                  "may inflate past the pod's memory: subs resume tries it again")
        await self.registry.quarantine(key, quarantine.record(reason, taken.previous_instance, taken.previous_worker))
        with contextlib.suppress(*REDIS_DOWN):
            await self.client.eval(quarantine.QUARANTINE_HOLDER, 2, keys.lease_key(key, slot),
                                   keys.holder_key(key, slot), me, quarantine.QUARANTINED_HOLDER_TTL_MS)
        self.log.error("subscription quarantined: a worker died twice while serving it", subscription=key,
                       died=taken.previous_worker)

    async def lift_own(self, quarantined: dict[str, bytes], paused: set[str]) -> None:
        """A quarantine that names this very process as the one that died is a mistake: its lease
        lapsed while it was alive (cut off from Redis, or paused), so it resumes the subscription."""
        for key, raw in list(quarantined.items()):
            if quarantine.parse_record(raw).get("instance") == self.instance:
                await self.registry.set_paused(key, False)
                paused.discard(key)
                del quarantined[key]
                self.log.warning("quarantine lifted: the worker it names as dead is this one, alive",
                                 subscription=key)
