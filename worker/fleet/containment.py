"""The fleet's side of containing a message that kills its worker (the records, scripts and trials
are quarantine.py's; the memory alarm and what it names, memory_watch.py's): the evidence a worker
leaves before it dies, what the next holder makes of it, suspects on trial `trials_at_once` at a
time, and the quarantine of the subscription a worker died on, named by its alarm.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from worker.core import keys
from worker.fleet import quarantine
from worker.fleet.leases import unit_parts
from worker.fleet.memory_watch import MemoryWatch, ThreadCpu
from worker.fleet.quarantine import Evidence, Taken, Trials
from worker.fleet.registry import Registry
from worker.fleet.worker_protocol import ServingWorker
from worker.runtime import resources
from worker.runtime.supervisor import log_task_failure
from worker.state.redis_client import REDIS_DOWN, AsyncClient

EVIDENCE_CACHE = 1024  # dead instances whose evidence is remembered (each looked up once)
# ...but "none" only this long: a lease that lapsed while its holder lived (a slow handover) says
# nothing of how that holder dies later, and a death's evidence must be seen when it comes.
NO_EVIDENCE_SECONDS = 1.0


class Containment:
    def __init__(self, client: AsyncClient, registry: Registry, worker: ServingWorker, trial_seconds: float,
                 trials_at_once: int, instance: str, fleet: str, evidence_ttl_ms: int, log: Any) -> None:
        self.client, self.registry, self.worker = client, registry, worker
        self.trial_seconds = trial_seconds
        self.instance = instance
        self.fleet = fleet
        self.evidence_ttl_ms = evidence_ttl_ms
        self.log = log
        self.memory_limit = resources.memory_limit()[0] if trial_seconds > 0 else None
        # What the alarm names is the thread that inflates: where threads' CPU cannot be read, one
        # trial at a time, and the alarm names the one on trial.
        self.cpu: ThreadCpu = worker.trial_threads
        self.trials = Trials(trial_seconds, trials_at_once if self.cpu.available else 1)
        self._watch: MemoryWatch | None = None
        self._alarm_named = ""  # what the alarm under way named ('' none, or no alarm)
        self._evidence_written_at = 0.0
        self._evidence: dict[str, tuple[float, Evidence | None]] = {}  # (read at, what it said) by instance
        self._marks: set[asyncio.Task[None]] = set()

    @property
    def on(self) -> bool:
        return self.trial_seconds > 0

    def start(self) -> None:
        if self.memory_limit is not None:
            self._watch = MemoryWatch(self.memory_limit, asyncio.get_running_loop(), self._memory_alarm,
                                      self._memory_clear, self.cpu)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()

    # -- what the next holder makes of a lease taken over ---------------------------------------

    async def verdict(self, name: str, taken: Taken) -> str:
        """`quarantine.verdict` for a lease taken over from a holder that never released it, with the
        evidence that holder left (read once per dead instance)."""
        instance, now = taken.previous_instance, time.monotonic()
        known = self._evidence.get(instance)
        if known is None or (known[1] is None and now - known[0] > NO_EVIDENCE_SECONDS):
            if len(self._evidence) >= EVIDENCE_CACHE:
                self._evidence.clear()
            raw = await self.client.get(self._evidence_key(instance))
            known = self._evidence[instance] = (now, Evidence.parse(raw))
        return quarantine.verdict(name, taken, known[1])

    def _evidence_key(self, instance: str) -> str:
        return keys.fleet_key(self.fleet, f"memory:{instance}")

    # -- trials -----------------------------------------------------------------------------------

    def holds_back(self, name: str) -> bool:
        """Whether `name` waits for its trial (a suspect not yet tried)."""
        return self.trials.holds_back(name)

    def on_trial(self, name: str) -> bool:
        return self.trials.on(name)

    def suspect(self, name: str) -> None:
        self.trials.suspect(name, time.monotonic())

    def suspected(self, name: str) -> bool:
        return self.trials.suspected(name)

    async def advance(self) -> None:
        """End the trials whose time is over (their subscriptions move to the shared client); put the
        next suspects on trial (each holder record says so before its consumer exists: a death from
        here on that the alarm lays at its door is its own)."""
        if not self.on:
            return
        now = time.monotonic()
        for name in list(self.trials.on_trial):
            if unit_parts(name)[0] in self.worker.dispatchers:
                self.trials.serving(name, now)
        for name, served in self.trials.over(now):
            await self._mark(name, "trial", "0")
            self.trials.end(name)
            self.worker.end_trial(unit_parts(name)[0])
            self.worker.metrics.trials.labels("passed" if served else "stalled").inc()
            self.log.info("trial over: served without a death" if served else
                          "trial over: its subscribe did not go through", subscription=unit_parts(name)[0])
        for name in self.trials.next():
            await self._mark(name, "trial", "1")
            self.worker.metrics.trial_wait_seconds.observe(self.trials.begin(name, now))
            self.log.info("on trial: its last holder died with its memory alarm raised; served on a client of its "
                          "own for a while", subscription=unit_parts(name)[0], seconds=self.trial_seconds)
        if self._watch is not None and self._watch.high and now - self._evidence_written_at > \
                self.evidence_ttl_ms / 2000:
            await self._write_evidence(self._alarm_named)  # still high: the evidence must outlive the process

    def untry(self, name: str) -> None:
        """`name` is held here no more: no trial for it."""
        if self.trials.on(name):
            self.worker.metrics.trials.labels("ended").inc()
        self.trials.drop(name)

    async def _mark(self, name: str, field: str, value: str) -> None:
        key, slot = unit_parts(name)
        await self.client.eval(quarantine.MARK, 1, keys.holder_key(key, slot), self.instance, field, value)

    # -- the memory alarm ----------------------------------------------------------------------------

    def _memory_alarm(self, inflating: str) -> None:
        """Memory past the alarm: an OOM kill is likely on its way. Said in Redis at once, so that the
        next holders know what this worker died of; with what inflates (`inflating`: the key of the
        subscription on trial whose client's thread inflates, or ''), its holder record marked too."""
        if not self.cpu.available and len(self.trials.on_trial) == 1:
            named = next(iter(self.trials.on_trial))  # one trial at a time: the one on trial
        else:  # its trial may have ended meanwhile
            named = next((u for u in self.trials.on_trial if inflating and unit_parts(u)[0] == inflating), "")
        self._alarm_named = named
        self.log.error("memory alarm: an OOM kill may be on its way", limit=self.memory_limit,
                       **({"inflating": unit_parts(named)[0]} if named else {"inflating": "no subscription on trial"}))
        self._spawn(self._write_evidence(named), "memory alarm")
        if named:
            self._spawn(self._mark(named, "memory", "1"), "memory alarm")

    def _memory_clear(self) -> None:
        """Back below the alarm: the evidence goes (a later death is not laid at anyone's door)."""
        named, self._alarm_named = self._alarm_named, ""
        self.log.info("memory back below the alarm")
        self._spawn(self.client.delete(self._evidence_key(self.instance)), "memory alarm over")
        if named and self.trials.on(named):
            self._spawn(self._mark(named, "memory", "0"), "memory alarm over")

    async def _write_evidence(self, named: str) -> None:
        self._evidence_written_at = time.monotonic()
        await self.client.set(self._evidence_key(self.instance), Evidence(named).dump(self.worker.worker_id),
                              px=self.evidence_ttl_ms)

    def _spawn(self, work: Any, what: str) -> None:
        task = asyncio.ensure_future(work)
        self._marks.add(task)
        task.add_done_callback(self._marks.discard)
        task.add_done_callback(log_task_failure(self.worker.supervisor, what))

    # -- quarantine ----------------------------------------------------------------------------------

    async def quarantine(self, name: str, taken: Taken, me: str) -> None:
        """The holder before this worker died while `name` was on trial there, its memory alarm naming
        it: its message kills whoever serves it. Quarantined (paused, with why), and the lease let go."""
        key, slot = unit_parts(name)
        reason = (f"its worker ran out of memory and died while serving it on trial, its memory alarm naming it, "
                  f"after an earlier holder had died with it (last: {taken.previous_worker or 'a worker'}); a "
                  "message of it may inflate past the pod's memory: subs resume tries it again")
        await self.registry.quarantine(key, quarantine.record(reason, taken.previous_instance, taken.previous_worker))
        with contextlib.suppress(*REDIS_DOWN):
            await self.client.eval(quarantine.QUARANTINE_HOLDER, 2, keys.lease_key(key, slot),
                                   keys.holder_key(key, slot), me, quarantine.QUARANTINED_HOLDER_TTL_MS)
        self.worker.metrics.trials.labels("killed").inc()
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
