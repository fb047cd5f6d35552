"""The fleet's ownership loop: membership, balanced ownership, handover, and the live registry.

Each worker heartbeats into a sorted set scored by Redis server time (no cross-host clock skew),
computes the owner of every subscription by rendezvous hashing over the live members (a join or
leave moves about 1/N of them), and serves a subscription only while it holds that
subscription's lease (see `leases`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import ResponseError

from worker.broker.consumer import consumer_type
from worker.core import keys
from worker.core.redis_batch import Pipeliner
from worker.fleet import layout, ownership, seek
from worker.fleet.containment import Containment
from worker.fleet.leases import Lease, assign, assign_buckets, assign_slots, bucket_of, unit_parts, units
from worker.fleet.published import ConfigDefinitions
from worker.fleet.quarantine import (
    ACQUIRE_HOLDING,
    HOLDER_TTL_LEASES,
    QUARANTINE,
    RELEASE_HOLDING,
    RENEW_HOLDING,
    SUSPECT,
    Taken,
)
from worker.fleet.registry import Admit, Registry, clear_state
from worker.fleet.registry_follower import RegistryFollower
from worker.fleet.spread import Spreading, share
from worker.fleet.status import StatusReports
from worker.fleet.worker_protocol import ServingWorker
from worker.model.config import FleetSettings
from worker.model.subscriptions import State, Subscription
from worker.runtime import logs
from worker.runtime.aio import cancel_within, wait_event
from worker.runtime.supervisor import log_task_failure
from worker.state.redis_client import REDIS_DOWN, AsyncClient, describe, safe_text

Heard = tuple[list[Any], int, Any, int, int, list[Any]]  # what _HEARTBEAT returns

# Two sorted sets scored by expiry (Redis time): `members` (KEYS[1]), the worker ids subscriptions are
# assigned to, and `alive` (KEYS[4]), the incarnation (ARGV[6]) of every worker running, draining ones
# too (layout 2's leases: `ownership.py`). ARGV[5] '0' keeps this worker out of `members` (stepped
# out, leaving). An incarnation whose entry lapsed is not renewed (it is dead to the fleet): the
# worker joins as a new one (ARGV[7] '1').
# Every worker runs it every second: seven commands (the EVAL and six), most of the fleet's idle
# cost. Entries whose expiry lies further ahead than any heartbeat sets (3 TTLs) are garbage, not
# workers: never read (left in the view they would be assigned subscriptions nobody serves), removed
# with the lapsed ones when ARGV[8] is '1' (`Fleet._sweeps`). A key of the wrong type is
# corrupt state and starts over, found by the command it fails. Returns {the members, how many
# garbage entries went, the previous instance (below), 1 when this worker's `alive` entry had not
# lapsed, Redis time (ms), the live workers}.
_HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local dropped = 0
-- Whether a command failed on a key of the wrong type; any other error (a full Redis: OOM) fails
-- the script, as it did before anything was written (a write lets the rest of a script past OOM).
local function failed(reply)
  if type(reply) ~= 'table' or reply['err'] == nil then return false end
  if string.sub(reply['err'], 1, 9) ~= 'WRONGTYPE' then error(reply['err']) end
  return true
end
local function started_over(key) redis.call('DEL', key); dropped = dropped + 1 end
local function live(key)
  local found = redis.pcall('ZRANGEBYSCORE', key, '(' .. now, now + 3 * ttl)
  if failed(found) then started_over(key); return {} end
  return found
end
local function renew(key, member)
  if failed(redis.pcall('ZADD', key, now + ttl, member)) then
    started_over(key); redis.call('ZADD', key, now + ttl, member)
  end
end
if ARGV[5] == '1' then renew(KEYS[1], ARGV[1])
elseif failed(redis.pcall('ZREM', KEYS[1], ARGV[1])) then started_over(KEYS[1]) end
local alive = live(KEYS[4])
local continuous = 0
for _, incarnation in ipairs(alive) do
  if incarnation == ARGV[6] then continuous = 1 end
end
if continuous == 1 or ARGV[7] == '1' then
  renew(KEYS[4], ARGV[6])
  if continuous == 0 then table.insert(alive, ARGV[6]) end
end
local members = live(KEYS[1])
-- Which process heartbeated under this id last (KEYS[2], ARGV[3] its instance): another one in
-- between two of ours means two processes run with one id.
local previous = redis.pcall('SET', KEYS[2], ARGV[3], 'PX', 3 * ttl, 'GET')
if failed(previous) then
  redis.call('SET', KEYS[2], ARGV[3], 'PX', 3 * ttl); previous = false
end
-- The layouts this worker reads, and where it stands (KEYS[3]): `push-worker layout upgrade` reads
-- it. Written when it changes and every lease period (ARGV[9] '1'): it lives three.
if ARGV[9] == '1' then redis.call('SET', KEYS[3], ARGV[4], 'PX', 3 * ttl) end
if ARGV[8] == '1' then
  for _, key in ipairs({KEYS[1], KEYS[4]}) do
    local garbage = redis.pcall('ZREMRANGEBYSCORE', key, '(' .. (now + 3 * ttl), '+inf')
    if failed(garbage) then started_over(key) else
      dropped = dropped + garbage
      redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
    end
  end
end
return {members, dropped, type(previous) == 'string' and previous or '', continuous, now, alive}
"""


_NEVER_READ = object()


async def _known(value: object) -> object:
    """A value this round already has, where a read may stand."""
    return value


DELETE_GRACE = 1.0  # seconds requests under way get when their subscription is deleted
# GET of a key that is not a string fails: a lease key holding a hash (corrupt) is simply not ours.
class Fleet:
    """Runs the ownership loop of one worker."""

    def __init__(self, worker: ServingWorker, client: AsyncClient, settings: FleetSettings,
                 static: tuple[Subscription, ...], admit: Admit | None = None,
                 refuse_layout: Callable[[str], None] | None = None,
                 on_layout: Callable[[layout.LayoutState], None] | None = None,
                 layout_state: layout.LayoutState | None = None) -> None:
        self.worker = worker
        # The layout read last (every round), told to `on_layout` when it changes.
        self.on_layout = on_layout or (lambda _: None)
        self.layout_state = layout_state or layout.LayoutState(layout.LAYOUT)
        self.client = client
        self.settings = settings
        # Redis holds a newer release's layout (read every round): stop before writing anything more.
        self.refuse_layout = refuse_layout
        self.refused = ""  # why, once it did: no round writes anything after
        self.log = logs.get(worker=worker.worker_id, fleet=settings.name)
        self._wake = asyncio.Event()
        self._ticking = asyncio.Lock()
        self.static = {s.key: s for s in static}
        self.registry = Registry(client, settings.name, self.static, admit, settings.max_subscriptions_per_project)
        self.follower = RegistryFollower(self.registry)
        self.published = ConfigDefinitions(client, worker.worker_id, self.static)
        self.members_key = keys.fleet_key(settings.name, "members")
        self.alive_key = ownership.alive_key(settings.name)
        # Held leases by unit: a subscription's key for its slot 0, `<key>#<slot>` for another slot
        # (`leases.unit`). A worker serves at most one slot of a subscription. In layout 2 they are one
        # object, `member_lease`, renewed by each heartbeat that finds this worker's entry unlapsed
        # (`ownership.py`); the units in `_layout1_units` hold a lease of their own (layout 1, renewed).
        self.leases: dict[str, Lease] = {}
        self._layout1_units: set[str] = set()
        self._owned_at: dict[str, float] = {}  # layout 2: when each owner record was written or refreshed
        self.member_lease = self._new_lease()
        self.members: list[str] = []
        self.alive: list[str] = []  # the incarnation of every running worker, as the last heartbeat read them
        self.view_ms = 0  # when (Redis time) the last heartbeat read them
        self._joined = False  # whether this incarnation has an entry in `alive` yet
        # Layout 2 takes subscriptions once no member arrived for two rounds (or they have been arriving
        # for a whole lease): a fleet starting or rolling computes one assignment, not one per arrival,
        # each moving thousands of subscriptions. A member leaving is taken over at once. A slot found
        # held is tried again two rounds later.
        self._members_changed_at = 0.0
        self._unsettled_since: float | None = None
        self._refused: dict[str, float] = {}
        self.took_share = False  # once its first round taking subscriptions ran: in the fleet (readiness)
        self._assigned_keys: set[str] = set()  # the subscriptions whose slot 0 is assigned here
        self._unreleased: dict[str, str] = {}  # layout 2 releases that failed (unit -> suspect flag): again
        self.subscriptions: dict[str, Subscription] = dict(self.static)
        self.paused: set[str] = set()
        self.expired: set[str] = set()
        self.quarantined: dict[str, bytes] = {}  # quarantine records of paused keys (`quarantine.py`)
        self._state_reported: set[str] = set()  # paused/expired keys assigned here, exported as a state metric
        self._assigned_reported: set[str] = set()  # keys exported as pushworker_subscription_assigned
        self._seeks: set[asyncio.Task[None]] = set()
        # Hand-overs draining in the background, by key: the lease stays held (and renewed) until the
        # drain ends. Drained inside the round, one after another, they held up the heartbeat and the
        # renewals of every other lease: a drain longer than the lease lost the subscriptions this
        # worker kept, and the member entry lapsed (seen: a join under load moved them back and forth).
        self._handovers: dict[str, asyncio.Task[None]] = {}
        self._registry_version: object = _NEVER_READ  # as read from Redis (compared, never parsed)
        self._notified = False  # a registry or membership notice came since the version was last read
        self._beats = 0  # heartbeats sent
        self._layout_2_reads = 0  # whole reads of the layout in a row that found layout 2
        self._reads_written: tuple[str, float] = ("", -float("inf"))  # `reads`, as last written, and when
        self._ignored: set[tuple[str, str]] = set()  # what was logged as ignored (once each)
        self._mine: frozenset[str] = frozenset()  # the units assigned to this worker
        self._assignment_basis: tuple[object, ...] = ()
        self._registry_generation = 0  # bumped at each registry read: what the assignment depends on
        self._spread: dict[str, Subscription] = {}  # the spread subscriptions (max_workers > 1)
        self._buckets: dict[int, list[str]] = {}  # layout 2's buckets of subscription keys (`leases.bucket_of`)
        self._index_subscriptions()
        self._tasks: list[asyncio.Task[None]] = []
        self.ttl_ms = int(settings.lease_seconds * 1000)
        self.member_ttl_ms = self.ttl_ms
        self.holder_ttl_ms = HOLDER_TTL_LEASES * self.ttl_ms
        # Renewals and status reports of a thousand subscriptions as a few script calls in one round
        # trip, on a connection of their own: as separate commands through redis-py they held the
        # event loop for tens of milliseconds at a time, and every delivery waited.
        self.batch = Pipeliner(client)
        self.spreading = Spreading(client, self.batch, settings.backlog_per_worker, settings.spread_quiet_seconds,
                                   worker, settings.name, self.registry.channel, self._wake, self.log)
        # The last backlog reading of each served subscription (value, monotonic time read), written
        # by the backlog report: the holder of a spread subscription's slot 0 decides its width by it.
        self.backlogs: dict[str, tuple[float, float]] = {}
        self.status = StatusReports(worker, self.batch, self.ttl_ms, self.backlogs)
        # The last round that went through, and why the rounds since failed: a Redis that answers
        # PING but refuses writes (full at maxmemory: OOM) stops every round, and with it the leases.
        self.last_round_ok = time.monotonic()
        self.round_error = ""
        # Two processes with one PUSH_WORKER_ID (a constant where the pod name belongs) are one member
        # to the fleet: both serve everything that id owns, and no scaling spreads it.
        self.instance = uuid.uuid4().hex
        self.incarnation = f"{self.instance}.0"  # a new one each time this worker's `alive` entry lapsed
        self.view_margin_ms = int(min(2.0, settings.lease_seconds / 4) * 1000)  # for Cluster nodes' clocks
        self.containment = Containment(client, self.registry, worker, settings.trial_seconds, settings.trials_at_once,
                                       self.instance, settings.name, self.holder_ttl_ms, self.log)
        self.instance_key = keys.fleet_key(settings.name, f"instance:{worker.worker_id}")
        self.reads_key = keys.fleet_key(settings.name, f"reads:{worker.worker_id}")
        self._foreign_mark_at = -float("inf")
        self._twin_seen_at = 0.0
        self.stepped_out = ""  # why this worker serves nothing and is no member, while it cannot reach the broker

    def twin_reason(self) -> str:
        """Why this worker's id is not its own, while another process heartbeats under it; else ''."""
        if not self._twin_seen_at:
            return ""
        return (f"another process runs as worker id {self.me} (seen {time.monotonic() - self._twin_seen_at:.0f} s "
                "ago): give each worker its own PUSH_WORKER_ID (the pod name)")

    def _note_instance(self, previous: str) -> None:
        # One foreign mark may be a predecessor's under the same id (a pod restarted with its name) or
        # garbage; a second within a lease period is another process heartbeating under the id.
        now = time.monotonic()
        if previous and previous != self.instance:
            if now - self._foreign_mark_at <= self.settings.lease_seconds:
                if not self._twin_seen_at:
                    self.log.error("another process runs with this worker id; both serve every subscription the "
                                   "id owns, and the fleet cannot spread them: give each worker its own "
                                   "PUSH_WORKER_ID (the pod name)")
                self._twin_seen_at = now
            self._foreign_mark_at = now
        elif self._twin_seen_at and now - self._twin_seen_at > self.settings.lease_seconds:
            self.log.info("this worker id is its own again")
            self._twin_seen_at = 0.0

    def failing_for(self) -> float:
        """Seconds since the last round that went through, while rounds fail; 0 when the last one did."""
        return time.monotonic() - self.last_round_ok if self.round_error else 0.0

    @property
    def me(self) -> str:
        return self.worker.worker_id

    def _new_lease(self) -> Lease:
        return Lease(self.settings.lease_seconds, margin=min(2.0, self.settings.lease_seconds / 4))

    async def start(self) -> None:
        """Join at once (the first round runs here), then keep going in supervised tasks."""
        self._wake.set()
        self.containment.start()
        supervisor = self.worker.supervisor
        self._tasks = [supervisor.spawn("fleet", self._loop), supervisor.spawn("fleet-events", self._listen)]
        await self._tick_safely()

    async def _loop(self) -> None:
        while True:
            await wait_event(self._wake, self.settings.heartbeat_seconds)
            self._wake.clear()
            await self._tick_safely()

    async def _tick_safely(self) -> None:
        try:
            async with self._ticking:  # the first round (start) and the loop's never overlap
                await self.tick()
            self.last_round_ok, self.round_error = time.monotonic(), ""
        except REDIS_DOWN as e:
            self.worker.metrics.redis_errors.inc()
            self.round_error = f"{type(e).__name__}: {describe(e)}"[:300]
            self.log.warning("fleet tick failed", error=self.round_error)
            await self._drop_expired()
        except Exception:
            await self._drop_expired()  # fenced anyway; stop what can no longer be renewed
            raise

    def _ignore(self, what: str, detail: str) -> None:
        """Log once that a value read from Redis was ignored (corrupt or invalid state)."""
        if (what, detail) not in self._ignored:
            if len(self._ignored) > 10_000:  # garbage must not grow the worker's memory without bound
                self._ignored.clear()
            self._ignored.add((what, detail))
            self.log.warning("ignored invalid state in Redis", what=what, detail=detail[:300])

    async def _listen(self) -> None:
        """Registry and membership notifications make changes land well inside the resync period."""
        while True:
            pubsub = self.client.pubsub()
            try:
                await pubsub.subscribe(self.registry.channel)
                async for message in pubsub.listen():
                    if message.get("type") != "message":
                        continue
                    data = message.get("data") or b""
                    if isinstance(data, bytes) and data.startswith(b"seek "):
                        self._start_seek(safe_text(data[5:]))
                    else:
                        self._refused.clear()  # a worker left or let go: what it held is tried at once
                        self._notified = True
                        self._wake.set()
            except REDIS_DOWN:
                await asyncio.sleep(1.0)  # the heartbeat resync covers the gap
            finally:
                with contextlib.suppress(*REDIS_DOWN):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]

    async def step_out(self, why: str) -> None:
        """Cut off from the broker (`broker_watch`): leave the member set so that the assignment
        gives every subscription to the others, and hand over what is held (drained, then released)."""
        self.stepped_out = why
        self.log.error("cut off from the broker: handing every subscription to the others until it answers",
                       reason=why, held=len(self.leases))
        with contextlib.suppress(*REDIS_DOWN):
            await self.client.zrem(self.members_key, self.me)
            await self.client.publish(self.registry.channel, b"members")
        for name in list(self.leases):
            if name not in self._handovers:
                self._start_hand_over(name)

    def step_in(self) -> None:
        self.log.info("the broker answers again: rejoining the fleet")
        self.stepped_out = ""
        self._wake.set()

    async def tick(self) -> None:
        """One round: heartbeat, read the registry if it changed, renew, release, acquire. Stepped
        out, only the leases still draining are renewed."""
        # A newer release's layout stops this worker before it writes anything more: read first, alone.
        if self.refused:
            return
        if not await self._read_layout():
            return
        sent_at = time.monotonic()
        held = self._due_renewals(sent_at)
        if self.stepped_out:  # alive while draining (layout 2's leases), in no assignment
            await self._lose(await self._keep_alive(held, sent_at))
            return
        # The registry's version each fifth round, and at once after a notice: its announcements
        # (`_listen`) bring changes; the version catches one that was lost.
        notified, self._notified = self._notified, False
        read_version = notified or self._beats % 5 == 0 or self._registry_version is _NEVER_READ
        results = await asyncio.gather(
            self._heartbeat(assignable=True),
            self.batch.submit("GET", self.registry.version_key) if read_version else _known(self._registry_version),
            *(self._renewal(key) for key in held),
            return_exceptions=True)
        for result in results:
            if isinstance(result, REDIS_DOWN) and not isinstance(result, ResponseError):
                raise result  # the connection failed: the whole round did
        if isinstance(results[0], BaseException):
            raise results[0]
        await self._heard(results[0], sent_at)
        version = results[1]
        if isinstance(version, Exception):
            self._ignore("registry version", str(version))
            version = object()  # unreadable: read the registry every round until it is repaired
        await self._lose(self._renewed(held, results[2:], sent_at))
        if self.layout_state.layout == 2 and self._layout1_units and self._joined:
            await self._convert_layout1_leases()
        if version != self._registry_version:
            await self._read_registry()
            self._registry_version = version
        for key in await self.spreading.read(self._spread):
            self._ignore("workers", f"{key}: not a number of workers; served by one until it is decided again")
        await self._reconcile()
        first_slots = [k for k in self.spreading.widths if k in self.leases and k not in self._handovers]
        await self.spreading.settle(first_slots, self.subscriptions, len(self.members), self.backlogs)
        await self._resume_breakers()
        await self._release_again()
        await self._refresh_owner_records()
        await self.published.publish_if_due(self._assigned_keys)

    async def _read_layout(self) -> bool:
        """Read the layout Redis holds; False when it is newer than this release's (refused). Once
        layout 2 was read whole twice (its `since` written before it), only the layout key is read."""
        if self._layout_2_reads >= 2:
            raw = await self.batch.submit("GET", keys.layout_key())
            if self._layout_newer(raw):
                return False
            if layout.check(raw) == 2:
                return True
        raw, since, switching = await asyncio.gather(*(self.batch.submit("GET", key) for key in (
            keys.layout_key(), keys.layout_since_key(), keys.layout_next_key())))
        if self._layout_newer(raw):
            return False
        state = layout.state_of(raw, since, switching)
        self._layout_2_reads = self._layout_2_reads + 1 if state.layout == 2 else 0
        if state != self.layout_state:
            self.layout_state = state
            self.on_layout(state)
        return True

    def _sweeps(self) -> bool:
        """Whether this heartbeat removes lapsed and garbage entries: the first member's every tenth
        (the others' views skip them anyway), and any worker's first."""
        return self._beats == 1 or (self._beats % 10 == 1 and (not self.members or self.members[0] == self.me))

    def _heartbeat(self, assignable: bool) -> asyncio.Future[Any]:
        self._beats += 1
        reads, now = self.reads, time.monotonic()
        write_reads = reads != self._reads_written[0] or now - self._reads_written[1] >= self.settings.lease_seconds
        future = self.batch.submit(
            "EVAL", _HEARTBEAT, 4, self.members_key, self.instance_key, self.reads_key, self.alive_key,
            self.me, self.member_ttl_ms, self.instance, reads, "1" if assignable else "0", self.incarnation,
            "0" if self._joined else "1", "1" if self._sweeps() else "0", "1" if write_reads else "0")
        if write_reads:
            future.add_done_callback(lambda f: None if f.cancelled() or f.exception() else
                                     setattr(self, "_reads_written", (reads, now)))
        return future

    async def _heard(self, reply: Heard, sent_at: float) -> None:
        """Take in a heartbeat's answer: the members, the live workers, and layout 2's leases, renewed
        while this worker's entry never lapsed. One that lapsed (a pause, a partition longer than the
        lease) may have had its subscriptions taken: they stop, and this worker joins again next round
        as a new incarnation (`ownership.py`)."""
        members, dropped, previous, continuous, now_ms, alive = reply
        self._note_instance(safe_text(previous))
        if dropped:
            self._ignore("fleet members", f"{dropped} entries with an impossible expiry or of the wrong type")
        members = sorted(safe_text(m) for m in members)
        if not set(members) <= set(self.members):  # arrivals (its own too: a worker's first round)
            self._members_changed_at = time.monotonic()
            self._unsettled_since = self._unsettled_since or self._members_changed_at
        self.members = members
        self.alive, self.view_ms = sorted(safe_text(m) for m in alive), int(now_ms)
        self.worker.metrics.fleet_size.set(len(self.members))
        if self._joined and not continuous:
            owned = [name for name in self.leases if name not in self._layout1_units]
            self.log.warning("this worker's entry in the fleet lapsed: its subscriptions may be served by others "
                             "now; stopped, and joining again", owned=len(owned))
            await self._lose(owned)
            self._unreleased.clear()  # records of the lapsed incarnation: dead to everyone now
            self.incarnation = f"{self.instance}.{int(self.incarnation.rsplit('.', 1)[1]) + 1}"
            self.member_lease = self._new_lease()
            self._joined = False
            self._wake.set()  # join at once
            return
        self._joined = True
        self.member_lease.renewed(sent_at)
        for lease in {id(lease): lease for name, lease in self.leases.items()
                      if name not in self._layout1_units and lease is not self.member_lease}.values():
            lease.renewed(sent_at)  # held under layout 1 before the switch: now on the heartbeat too

    def _due_renewals(self, now: float) -> list[str]:
        """The layout 1 leases to renew this round."""
        return [name for name in self._layout1_units if (lease := self.leases.get(name)) is not None and lease.due(now)]

    async def _convert_layout1_leases(self) -> None:
        """Redis switched to layout 2 while this worker held layout 1 leases: each becomes its owner
        record (`ownership.ACQUIRE` takes the taker's own lease), and then rides on the heartbeat."""
        names = sorted(self._layout1_units - set(self._handovers))  # those draining release their lease
        replies = await asyncio.gather(*(self._owner_operation(name) for name in names),
                                       return_exceptions=True)
        for name, reply in zip(names, replies, strict=True):
            if not (isinstance(reply, list) and reply[0] == 1):
                continue
            if name in self.leases:
                self._layout1_units.discard(name)
                self._owned_at[name] = time.monotonic()
            else:  # lost meanwhile: its record goes too
                self._unreleased[name] = "0"
        if self._layout1_units:
            self.log.info("layout 2: some subscriptions still on their layout 1 lease; tried again next round",
                          count=len(self._layout1_units))

    def _owner_operation(self, name: str) -> asyncio.Future[Any]:
        key, slot = unit_parts(name)
        shared = (self.me, self.instance, self.incarnation, ownership.OWNER_TTL_MS, self.ttl_ms,
                  self.view_ms - self.view_margin_ms, *self.alive)
        unit_keys = (keys.lease_key(key, slot), keys.holder_key(key, slot))
        return self.batch.operation(ownership.ACQUIRE, (), shared, unit_keys, (), key)

    async def _refresh_owner_records(self) -> None:
        """Owner records expire (so that one nobody may take goes on its own): refreshed well before."""
        now = time.monotonic()
        due = [n for n, at in self._owned_at.items() if now - at > ownership.OWNER_REFRESH_SECONDS and n in self.leases]
        if not due:
            return
        results = await asyncio.gather(*(self.batch.operation(
            ownership.REFRESH, (), (self.incarnation, ownership.OWNER_TTL_MS),
            (keys.holder_key(*unit_parts(name)),), (), unit_parts(name)[0]) for name in due), return_exceptions=True)
        lost = []
        for name, result in zip(due, results, strict=True):
            if isinstance(result, list) and result[0] == 1:
                self._owned_at[name] = now
            elif isinstance(result, list):
                lost.append(name)  # not ours any more (deleted by hand): stop, taken again if still ours to take
        await self._lose(lost)

    @property
    def reads(self) -> str:
        """What this worker says of the layouts (`keys.fleet_key(..., 'reads:<id>')`): `1` (it writes
        layout 1 and can switch), `hold` (a switch under way: no new attempt counted), `2`."""
        state = self.layout_state
        return "2" if state.layout == 2 else "hold" if state.switching else "1"

    def _layout_newer(self, raw: Any) -> bool:
        """Whether Redis holds a layout this release must not write (said once, to `refuse_layout`)."""
        try:
            layout.check(raw)
        except layout.LayoutTooNew as e:
            if self.refuse_layout is None:
                raise
            self.refused = str(e)
            self.refuse_layout(self.refused)
            return True
        return False

    async def _resume_breakers(self) -> None:
        """`subs resume` closes an open breaker: it writes when (`keys.resumed_key`) and wakes the
        fleet; only suspended subscriptions are looked up, so this costs nothing when none is."""
        suspended = [(key, served) for key, served in self.worker.dispatchers.items()
                     if served.state is State.SUSPENDED]
        if not suspended:
            return
        values = await asyncio.gather(*(self.batch.submit("GET", keys.resumed_key(key)) for key, _ in suspended),
                                      return_exceptions=True)
        for (key, served), value in zip(suspended, values, strict=True):
            if isinstance(value, BaseException):
                continue  # the next round reads it again
            try:
                resumed_at_ms = int(value)
            except (TypeError, ValueError):  # none, or garbage
                continue
            if served.resume(resumed_at_ms):
                self.log.info("breaker closed by hand (subs resume)", subscription=key)

    def _renewal(self, name: str) -> asyncio.Future[Any]:
        key, slot = unit_parts(name)
        return self.batch.operation(RENEW_HOLDING, (), (self.me, self.ttl_ms, self.instance, self.holder_ttl_ms),
                                    (keys.lease_key(key, slot), keys.holder_key(key, slot)), (), key)

    def _renewed(self, held: list[str], results: Sequence[Any], sent_at: float) -> list[str]:
        """Mark the leases renewed; returns those that were not (someone else's now, or Redis failed)."""
        lost = []
        for key, renewed in zip(held, results, strict=True):
            lease = self.leases.get(key)
            if lease is None:  # released meanwhile (a hand-over that ended while the renewal was out)
                continue
            if isinstance(renewed, list) and renewed[0] == 1:
                lease.renewed(sent_at)
            else:
                lost.append(key)
        return lost

    async def _read_registry(self) -> None:
        """The registry, paused and expired sets: what changed since the last read (`RegistryFollower`).
        A registry that cannot be read (a key of the wrong type) keeps what was read last; invalid
        entries are skipped; both are logged."""
        try:
            await self.follower.refresh()
        except ResponseError as e:
            self._ignore("registry", str(e))
            return
        live, invalid = self.follower.subscriptions()
        self.subscriptions = {**live, **self.static}  # the config's own win (the registry cannot shadow them)
        self._index_subscriptions()
        for key, reason in invalid.items():
            self._ignore("registry entry", f"{key}: {reason}")
        for what, reason in self.follower.unreadable.items():
            self._ignore(what, reason)
        self.paused = set(self.follower.paused)
        self.expired = set(self.follower.expired)
        self.quarantined = {k: v for k, v in self.follower.quarantined.items() if k in self.paused}
        await self.containment.lift_own(self.quarantined, self.paused)

    def _index_subscriptions(self) -> None:
        """What the assignment reads of the subscriptions, once a registry read (not every round)."""
        self._registry_generation += 1
        self._spread = {k: sub for k, sub in self.subscriptions.items() if sub.max_workers > 1}
        buckets: dict[int, list[str]] = {}
        for key in self.subscriptions:
            buckets.setdefault(bucket_of(key), []).append(key)
        self._buckets = buckets

    def _assigned(self) -> frozenset[str]:
        """The units (subscriptions' slots) assigned to this worker, computed again only when the
        members, the registry or a spread subscription's width change. Layout 2 assigns buckets
        (`leases.assign_buckets`: a change costs about as much with 100,000 subscriptions as with 10);
        layout 1 assigns each unit as 1.1.0 does, so that the two releases agree during a rollout."""
        widths = self.spreading.assign_widths(self._spread, len(self.members))
        layout1 = self.layout_state.layout == 1
        basis = (layout1, tuple(self.members), self._registry_generation, tuple(sorted(widths.items())))
        if basis == self._assignment_basis:
            return self._mine
        if layout1:
            owners = assign(units({**dict.fromkeys(self.subscriptions, 1), **widths}), self.members)
            mine = {u for u, member in owners.items() if member == self.me}
        else:
            buckets = assign_buckets({b: len(ks) for b, ks in self._buckets.items()}, self.members)
            mine = {key for bucket, member in buckets.items() if member == self.me for key in self._buckets[bucket]}
            first = {key: buckets[bucket_of(key)] for key in widths}
            mine |= {u for u, member in assign_slots(widths, first, self.members).items() if member == self.me}
        self._mine, self._assignment_basis = frozenset(mine), basis
        self._assigned_keys = {u for u in mine if "#" not in u}
        return self._mine

    def _share(self, name: str) -> Subscription:
        """The definition the holder of unit `name` serves: its share of the subscription's totals."""
        key, slot = unit_parts(name)
        return share(self.subscriptions[key], slot, self.spreading.widths.get(key, 1))

    async def _reconcile(self) -> None:
        mine = self._assigned()
        # A paused subscription keeps its owner in the assignment (resuming moves nothing else);
        # the owner just does not serve it, so its backlog waits in the broker.
        held_back = self.paused | self.expired
        wanted = {u for u in mine if unit_parts(u)[0] not in held_back}
        if self._refused:
            self._refused = {name: at for name, at in self._refused.items() if name in wanted}
        self._report_held_back_states({k for k in held_back if k in mine})
        self._report_assigned(self._assigned_keys)
        for name in [u for u in self.leases if u not in wanted and u not in self._handovers]:
            self._start_hand_over(name)
        # One consumer of a subscription per worker: another of its slots is taken here only once the
        # slot held before has drained (a width change can move a worker from one slot to another).
        busy = {unit_parts(u)[0] for u in (*self.leases, *self._handovers)}
        if not self.worker.stopping:  # leaving: take on nothing new
            await self._acquire([name for name in sorted(wanted - set(self.leases) - set(self._handovers))
                                 if unit_parts(name)[0] not in busy])
        held = {unit_parts(u)[0] for u in self.leases}
        for key in self.worker.serving - held:  # safety net: nothing runs without a lease
            await self.worker.remove(key, grace=0)
        settled = set(self.leases) - set(self._handovers)  # wanted again mid-drain: acquired anew after it
        await self.containment.advance()
        serving = self.worker.serving
        for name in wanted & settled:
            key, sub = unit_parts(name)[0], self._share(name)
            if key not in serving:  # new, or a start that failed: try again
                if not self.containment.holds_back(name):  # a suspect waits for its trial
                    self.worker.add(sub, lease=self.leases[name], trial=self.containment.on_trial(name))
                continue
            dispatcher = self.worker.dispatchers.get(key)
            if dispatcher is None or dispatcher.sub is sub or dispatcher.sub == sub:
                continue
            if consumer_type(dispatcher.sub) != consumer_type(sub):
                # max_workers of a key-shared subscription crossed 1: served anew with the other
                # consumer type (the lease is released after the drain and taken again next round).
                self._start_hand_over(name)
            else:
                dispatcher.update(sub)
                self.log.info("subscription updated", subscription=key)
        await self.status.publish(self.leases)

    async def _acquire(self, names: list[str]) -> None:
        """Take the units: in layout 2 their owner records, all in one round trip (`ownership.py`); in
        layout 1 a lease each."""
        taken = []
        settled = self.layout_state.layout == 1 or self._settled()
        self.took_share = self.took_share or settled
        if self.layout_state.layout == 1:
            for name in names:
                key, slot = unit_parts(name)
                sent_at = time.monotonic()
                reply = await self.client.eval(ACQUIRE_HOLDING, 2, keys.lease_key(key, slot),
                                               keys.holder_key(key, slot), self.me, self.ttl_ms, self.instance,
                                               self.holder_ttl_ms)
                lease = self._new_lease()
                lease.renewed(sent_at)
                if await self._taken(name, reply, lease):
                    self._layout1_units.add(name)
                    taken.append(name)
        elif self.member_lease.valid() and settled:  # a view too old to take anything by: none
            now = time.monotonic()
            retry = now - 2 * self.settings.heartbeat_seconds
            names = [name for name in names if self._refused.get(name, 0.0) <= retry]
            replies = await asyncio.gather(*(self._owner_operation(name) for name in names),
                                           return_exceptions=True)
            for name, reply in zip(names, replies, strict=True):
                if isinstance(reply, REDIS_DOWN) and not isinstance(reply, ResponseError):
                    raise reply
                if isinstance(reply, BaseException):
                    self._ignore("owner record", f"{name}: {reply}")
                elif await self._taken(name, reply, self.member_lease):
                    self._owned_at[name] = time.monotonic()
                    self._unreleased.pop(name, None)
                    self._refused.pop(name, None)
                    taken.append(name)
                else:
                    self._refused[name] = now
        await self._seek_if_asked([name for name in taken if not unit_parts(name)[1]])

    def _settled(self) -> bool:
        """Whether no member arrived for two rounds, or members have been arriving for a lease."""
        now = time.monotonic()
        if now - self._members_changed_at >= 2 * self.settings.heartbeat_seconds:
            self._unsettled_since = None
            return True
        return self._unsettled_since is not None and now - self._unsettled_since >= self.settings.lease_seconds

    async def _seek_if_asked(self, names: list[str]) -> None:
        """A seek asked for while nobody held the subscription: its new slot 0 holder seeks (looked up
        in one round trip: a task each for a thousand subscriptions taken at once emptied the pool)."""
        asked = await asyncio.gather(*(self.batch.submit("EXISTS", keys.seek_key(name)) for name in names))
        for name, found in zip(names, asked, strict=True):
            if found:
                self._start_seek(name)

    async def _taken(self, name: str, reply: list[Any], lease: Lease) -> bool:
        """Start serving a unit just taken (reply: `ACQUIRE_HOLDING`'s or `ownership.ACQUIRE`'s), or
        quarantine it (containment's verdict); whether it is now held."""
        key, slot = unit_parts(name)
        if reply[0] == -1:
            self._ignore("lease", f"{name}: a lease without an expiry; it now lapses in {self.settings.lease_seconds}s")
        if reply[0] != 1:
            return False  # the previous holder still holds it: it releases on handover, or it expires
        taken = Taken.parse(reply)
        contained = self.containment.on and taken.unreleased_by(self.instance)
        verdict = await self.containment.verdict(name, taken) if contained else ""
        if verdict == QUARANTINE:
            await self.containment.quarantine(name, taken, self.me)
            self.paused.add(key)
            return False
        self.leases[name] = lease
        if verdict == SUSPECT:  # its holder died with its memory alarm raised: started when its trial comes
            self.containment.suspect(name)
        else:
            self.worker.add(self._share(name), lease=lease)
        self.log.info("subscription acquired", subscription=key, **({"slot": slot} if slot else {}),
                      **({"died": taken.previous_worker, "suspect": verdict == SUSPECT} if contained else {}))
        return True

    def _start_hand_over(self, name: str) -> None:
        task = asyncio.create_task(self._hand_over(name), name=f"hand over {name}")
        self._handovers[name] = task
        task.add_done_callback(lambda _: self._handovers.pop(name, None))
        task.add_done_callback(log_task_failure(self.worker.supervisor, "hand over"))

    async def _hand_over(self, name: str) -> None:
        """Deleted, paused, or now someone else's: drain, then release at once so the next holder starts.
        A deleted subscription (or one whose topic was deleted) stops within DELETE_GRACE and its Redis
        state is cleared."""
        key, slot = unit_parts(name)
        deleted = key not in self.subscriptions
        expired = key in self.expired
        # Expired: "internal resources are deleted", so the broker subscription goes too.
        await self.worker.remove(key, grace=DELETE_GRACE if deleted or expired else None, unsubscribe=expired)
        suspect = self.containment.suspected(name)  # not tried yet: the next holder tries it
        lease, layout1 = self._forget(name)
        if lease is not None and layout1:
            with contextlib.suppress(*REDIS_DOWN):  # else it lapses
                await self.client.eval(RELEASE_HOLDING, 2, keys.lease_key(key, slot), keys.holder_key(key, slot),
                                       self.me, self.instance, "1" if suspect else "0")
        elif lease is not None:
            await self._release([name], ["1" if suspect else "0"])
        if deleted or expired:
            with contextlib.suppress(*REDIS_DOWN):
                await clear_state(self.client, key)
        elif key in self.paused or slot:  # a slot let go has no status (`subs list` shows who serves)
            with contextlib.suppress(*REDIS_DOWN):
                await self.client.delete(keys.status_key(key, slot))
        self.log.info("subscription paused" if key in self.paused else "subscription released", subscription=key,
                      **({"slot": slot} if slot else {}))

    async def _release(self, names: list[str], suspects: list[str]) -> None:
        """Release layout 2 owner records, in one round trip. One that could not be released (Redis
        did not answer) is released again each round: left, it would keep the slot from everyone
        while this worker lives."""
        results = await asyncio.gather(*(self.batch.operation(
            ownership.RELEASE, (), (self.me, self.incarnation), (keys.lease_key(*unit_parts(name)),
                                                                 keys.holder_key(*unit_parts(name))),
            (suspect,), unit_parts(name)[0]) for name, suspect in zip(names, suspects, strict=True)),
            return_exceptions=True)
        for name, suspect, result in zip(names, suspects, results, strict=True):
            if isinstance(result, BaseException) and name not in self.leases:
                self._unreleased[name] = suspect
            else:
                self._unreleased.pop(name, None)

    async def _release_again(self) -> None:
        if self._unreleased:
            pending = {name: suspect for name, suspect in self._unreleased.items() if name not in self.leases}
            await self._release(list(pending), list(pending.values()))

    def _forget(self, name: str) -> tuple[Lease | None, bool]:
        """Hold unit `name` no more here: its lease (None if it was not held), and whether that was a
        layout 1 lease of its own."""
        layout1 = name in self._layout1_units
        self._layout1_units.discard(name)
        self._owned_at.pop(name, None)
        self.containment.untry(name)
        return self.leases.pop(name, None), layout1

    async def _lose(self, lost: list[str]) -> None:
        """The leases are gone (expired while we were paused or cut off): stop at once, all together
        (one after another, a broker that does not answer closes would hold up the round for
        `dispatcher.CLOSE_TIMEOUT` per subscription)."""
        for name in lost:
            lease, layout1 = self._forget(name)
            if lease is not None and not layout1:
                # Its record may still name this incarnation (Redis came back before the entry
                # lapsed): released, or it would keep the slot from whoever it is assigned to now.
                self._unreleased[name] = "0"
        await asyncio.gather(*(self.worker.remove(unit_parts(name)[0], grace=0) for name in lost))
        for name in lost:
            self.log.warning("lease lost; stopped delivering", subscription=unit_parts(name)[0])

    async def _drop_expired(self) -> None:
        await self._lose([k for k, lease in self.leases.items() if not lease.valid()])

    def _report_held_back_states(self, keys: set[str]) -> None:
        """Paused and Expired subscriptions have no dispatcher; the worker they are assigned to
        exports their state, so every subscription has one."""
        for key in self._state_reported - keys:
            if key not in self.worker.dispatchers:
                project, name = key.split("/", 1)
                self.worker.metrics.set_state(project, name, None)
        for key in keys:
            project, name = key.split("/", 1)
            state = State.EXPIRED if key in self.expired else State.QUARANTINED if key in self.quarantined \
                else State.PAUSED
            self.worker.metrics.set_state(project, name, state)
        self._state_reported = keys

    def _report_assigned(self, keys: set[str]) -> None:
        """`pushworker_subscription_assigned`: an existing subscription that nobody owns for long
        (and is not paused or expired) is what the Unowned alert looks for; a deleted one has no series."""
        if keys is self._assigned_reported:
            return  # the assignment did not change (it is computed again only when it may have)
        for key in self._assigned_reported - keys:
            with contextlib.suppress(KeyError):
                self.worker.metrics.assigned.remove(*key.split("/", 1))
        for key in keys - self._assigned_reported:
            self.worker.metrics.assigned.labels(*key.split("/", 1)).set(1)
        self._assigned_reported = keys

    def _start_seek(self, key: str) -> None:
        if key not in self.leases or key in self._handovers:
            return  # the holder of the lease does it (or the operator's command, when nobody holds it)
        task = asyncio.create_task(self._seek(key), name=f"seek {key}")
        self._seeks.add(task)
        task.add_done_callback(self._seeks.discard)
        task.add_done_callback(log_task_failure(self.worker.supervisor, "seek"))

    async def _seek(self, key: str) -> None:
        sub = self.subscriptions.get(key)
        narrowed = sub is not None and sub.max_workers > 1 and bool(await self.client.exists(keys.seek_key(key)))
        if narrowed:
            await self.spreading.narrow(key, sub.max_workers if sub is not None else 1, self.me)
        try:
            await seek.run_seek_request(self.client, key, self.me, self.worker.seek, self.log)
        except seek.UnreadableSeekRequest as e:
            self._ignore("seek request", f"{key}: {e}")
        finally:
            self.spreading.narrowed.discard(key)  # the next backlog reading may spread it again

    async def leave(self) -> None:
        """Clean scale-down: leave the member set at once, so the others take each subscription as
        soon as its lease is released; drain every subscription and release its lease. The leases are
        renewed while their subscriptions drain: left to lapse, a drain longer than the lease let the
        next owner start while this worker's requests were still under way."""
        for task in await cancel_within([*self._tasks, *self._seeks], 10):
            self.log.warning("task did not stop when leaving the fleet", task=task.get_name())
        if self.refused:  # a newer layout: nothing is written, the leases lapse
            await self._lose(list(self.leases))
            self.containment.close()
            await self.batch.close()
            return
        with contextlib.suppress(*REDIS_DOWN):
            await self.client.zrem(self.members_key, self.me)
            await self.client.publish(self.registry.channel, b"members")
        for key in list(self.leases):
            if key not in self._handovers:
                self._start_hand_over(key)
        renewing = asyncio.create_task(self._renew_while_draining(), name="renew while leaving")
        try:
            await asyncio.gather(*self._handovers.values(), return_exceptions=True)
        finally:
            renewing.cancel()
            await asyncio.gather(renewing, return_exceptions=True)
        with contextlib.suppress(*REDIS_DOWN):  # the leases are free: the others take them now, not next round
            await self.client.zrem(self.alive_key, self.incarnation)
            await self.client.publish(self.registry.channel, b"members")
        self.containment.close()
        await self.batch.close()

    async def _renew_while_draining(self) -> None:
        # Alive (layout 2's leases) and out of the assignment. A renewal that fails leaves the lease to
        # lapse: its dispatcher is fenced (no new attempt), and the release at the end of the drain
        # only deletes a lease or record that is still ours.
        while self.leases:
            sent_at = time.monotonic()
            await self._keep_alive(self._due_renewals(sent_at), sent_at)
            await asyncio.sleep(self.settings.heartbeat_seconds)

    async def _keep_alive(self, held: list[str], sent_at: float) -> list[str]:
        """A heartbeat out of the assignment (stepped out, leaving) and the layout 1 renewals due;
        returns the leases that were not renewed."""
        results = await asyncio.gather(self._heartbeat(assignable=False), *(self._renewal(key) for key in held),
                                       return_exceptions=True)
        lost = self._renewed(held, results[1:], sent_at)
        if not isinstance(results[0], BaseException):
            await self._heard(results[0], sent_at)
        return lost
