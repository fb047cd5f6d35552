"""A rolling upgrade and its rollback: workers of the previous release (CHANGELOG.md's record,
tests/support/previous_release.py) and of this one in one fleet, as a Kubernetes rollout runs them,
each version's CLI changing the registry. What may change in Redis between releases, and which
releases can go back to which, is in CHANGELOG.md and docs/upgrading.md."""

from __future__ import annotations

import asyncio
import collections
import json
import sys
import time
from pathlib import Path

import pytest
from aiohttp import web

from tests.support.endpoints import Endpoint
from tests.support.fleet_harness import FleetHarness, WorkerProcess, fleet_sub
from tests.support.helpers import eventually
from tests.support.pulsar_client import Client
from worker.core import keys
from worker.core.keys import fleet_key, layout_key, layout_next_key


def updates(worker: WorkerProcess) -> dict[str, int]:
    """How often `worker` applied a changed definition, by subscription (from its JSON log)."""
    counts: dict[str, int] = {}
    for line in worker.log.read_text().splitlines():
        if '"subscription updated"' in line:
            key = json.loads(line)["subscription"]
            counts[key] = counts.get(key, 0) + 1
    return counts


class SteadyStream:
    """Messages published round robin over `topics`, a round every 0.1 s, until `stop`; what the
    endpoint acked, and the attempt numbers it saw, by message."""

    def __init__(self, client: Client, topics: list[str], endpoint: Endpoint) -> None:
        self.client, self.topics, self.endpoint = client, topics, endpoint
        self.published: list[str] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._publish())

    async def _publish(self) -> None:
        sequence = 0
        while not self._stop.is_set():
            for topic in self.topics:
                sequence += 1
                self.published.extend(await asyncio.to_thread(self.client.publish, topic,
                                                              [f"{topic} {sequence}".encode()]))
            await asyncio.sleep(0.1)  # the stream's pace, not a synchronisation

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    def acked(self) -> collections.Counter[str]:
        return collections.Counter(r.headers["Pubsub-Message-Id"] for r in self.endpoint.requests if r.acked)

    def numbers(self) -> dict[str, list[int]]:
        seen: dict[str, list[int]] = collections.defaultdict(list)
        for r in self.endpoint.requests:
            seen[r.headers["Pubsub-Message-Id"]].append(int(r.headers["Pubsub-Delivery-Attempt"]))
        return seen


def first_attempt_of_every_third_fails(received) -> web.Response:
    sequence = int(received.body_payload.split()[-1])
    first = received.headers["Pubsub-Delivery-Attempt"] == "1"
    return web.Response(status=503 if first and sequence % 3 == 0 else 204)


async def test_a_fleet_of_the_previous_release_and_this_one_follows_each_versions_registry_changes(
        tmp_path: Path, broker, redis_url: str, endpoint: Endpoint, client: Client, previous_release: Path):
    """This release reads only the registry keys a change names, from a change log the previous
    release does not write: a change by the previous release's CLI must still reach this release's
    workers (they read the whole registry when the log does not account for a change), and a change
    by this release's CLI must reach the previous release's workers (the version still moves). Each
    subscription is served by one worker at a time, and every message is delivered once."""
    fleet = FleetHarness(tmp_path, broker.url, redis_url)
    run = time.monotonic_ns()
    topics = [f"persistent://p-up/main/t{run}-{i}" for i in range(8)]
    names = [f"up-{run}-{i}" for i in range(8)]
    keys = [f"p-up/{name}" for name in names]
    try:
        fleet.redis.set(layout_key(), 1)  # a Redis the previous release ran on: this one keeps its layout
        old, new = fleet.start("old", code=previous_release), fleet.start("new")
        await eventually(lambda: old.fleet_size() == new.fleet_size() == 2, timeout=60, what="a fleet of two")

        def definitions(path: str) -> list[dict]:
            return [fleet_sub(name, topic, f"{endpoint.url}{path}") for name, topic in zip(names, topics, strict=True)]

        async def delivered_at(path: str) -> None:
            """One message per subscription, published once its owner serves the current definition,
            arrives at `path`."""
            sent = {client.publish(topic, [f"{path} {topic}".encode()])[0] for topic in topics}
            await eventually(lambda: sent <= {r.headers["Pubsub-Message-Id"] for r in endpoint.requests
                                              if r.acked and r.path == "/push" + path},
                             timeout=60, what=f"every subscription's message at {path}")

        async def owners_applied(before: dict[str, dict[str, int]]) -> None:
            owners = fleet.owners(keys)
            by_id = {"old": old, "new": new}
            await eventually(lambda: all(updates(by_id[owners[k]]).get(k, 0) > before[owners[k]].get(k, 0)
                                         for k in keys), timeout=60, what="every owner applying the change")

        assert fleet.apply(definitions("/a")).returncode == 0
        await eventually(lambda: None not in fleet.owners(keys).values(), timeout=60, what="every subscription owned")
        assert set(fleet.owners(keys).values()) == {"old", "new"}  # both versions serve some
        await delivered_at("/a")

        for path, code in (("/b", previous_release), ("/c", None)):  # the old CLI's change, then the new one's
            before = {"old": updates(old), "new": updates(new)}
            result = fleet.apply(definitions(path), code=code)
            assert result.returncode == 0, result.stderr
            await owners_applied(before)
            await delivered_at(path)

        ids = [r.headers["Pubsub-Message-Id"] for r in endpoint.requests]
        assert len(ids) == len(set(ids)) == 24, "each message delivered once"
    finally:
        fleet.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("direction", ["upgrade", "rollback"])
async def test_a_rollout_and_its_rollback_under_a_steady_stream_lose_nothing_and_never_number_back(
        tmp_path: Path, broker, redis_url: str, endpoint: Endpoint, client: Client, previous_release: Path,
        direction: str):
    """A fleet of two workers of one release is replaced, one pod at a time as the Deployment's
    surge of one does, by two of the other (upgrade: previous -> this; rollback: this -> previous),
    while messages keep coming and every third one fails its first attempt. Every message is acked
    once, a message's attempt numbers only go up across the handovers, and Redis keeps layout 1
    (this release writes layout 1 where it finds it, until `push-worker layout upgrade`)."""
    old_code, new_code = (previous_release, None) if direction == "upgrade" else (None, previous_release)
    fleet = FleetHarness(tmp_path, broker.url, redis_url)
    run = time.monotonic_ns()
    topics = [f"persistent://p-roll/main/t{run}-{i}" for i in range(4)]
    names = [f"roll-{run}-{i}" for i in range(4)]

    endpoint.behaviour = first_attempt_of_every_third_fails
    stream = SteadyStream(client, topics, endpoint)
    published = stream.published

    async def delivered_since(count: int) -> None:
        """Messages published from now on reach the endpoint (the fleet serves every subscription)."""
        mark = len(published) + count
        await eventually(lambda: len(published) >= mark and set(published[:mark]) <= set(stream.acked()),
                         timeout=90, what=f"the first {mark} messages acked")

    async def replace(retiring: WorkerProcess, worker_id: str) -> WorkerProcess:
        """The surge pod first, ready in a fleet of three; then the old pod's SIGTERM."""
        arriving = fleet.start(worker_id, code=new_code)
        await eventually(lambda: arriving.fleet_size() == 3, timeout=60, what=f"{worker_id} in the fleet")
        assert await asyncio.to_thread(retiring.stop) == 0
        return arriving

    try:
        fleet.redis.set(layout_key(), 1)  # a Redis the previous release ran on (either way)
        a, b = fleet.start("a", code=old_code), fleet.start("b", code=old_code)
        await eventually(lambda: a.fleet_size() == b.fleet_size() == 2, timeout=60, what="a fleet of two")
        assert fleet.apply([fleet_sub(n, t, endpoint.url) for n, t in zip(names, topics, strict=True)],
                           code=old_code).returncode == 0
        stream.start()
        await delivered_since(12)
        c = await replace(a, "c")
        await delivered_since(12)
        d = await replace(b, "d")
        await eventually(lambda: set(fleet.owners([f"p-roll/{n}" for n in names]).values()) <= {"c", "d"},
                         timeout=60, what="the new pods serving everything")
        await delivered_since(12)
        await stream.stop()
        await eventually(lambda: set(published) <= set(stream.acked()), timeout=90, what="every message acked")
        assert c.proc.poll() is None and d.proc.poll() is None
        layout = fleet.redis.get(layout_key())
        quarantined = fleet.redis.hkeys(fleet_key("test", "quarantined"))  # the harness's fleet
    finally:
        await stream.stop()
        fleet.close()
    assert [m for m, n in stream.acked().items() if n > 1] == [], "a message acked twice"
    numbers = stream.numbers()
    went_back = {m: seen for m, seen in numbers.items() if seen != sorted(set(seen))}
    assert went_back == {}, "attempt numbers went back (or repeated) across the handovers"
    assert sum(len(seen) > 1 for seen in numbers.values()) >= len(published) // 4  # the retries happened
    assert layout == b"1"  # kept by both: this release switches only when told to
    assert quarantined == [], "quarantined by mistake while the holder records changed hands"


@pytest.mark.broker_independent
async def test_holder_records_mean_the_same_to_the_previous_release_and_this_one(previous_release: Path,
                                                                               redis_url: str):
    """1.1.0's workers take any unreleased lease for a suspect and quarantine one whose record says
    trial and memory; this release writes those marks only for the subscription its alarm names, and
    a `suspect` mark 1.1.0 ignores. Each release's ACQUIRE, run by the real scripts on a real Redis,
    reads the other's records so that a mixed fleet quarantines the named one and nothing else."""
    import importlib.util

    import redis as redis_sync

    from worker.fleet import quarantine as new

    spec = importlib.util.spec_from_file_location("previous_quarantine",
                                                  previous_release / "worker" / "fleet" / "quarantine.py")
    assert spec is not None and spec.loader is not None
    old = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = old  # its dataclasses look their module up
    try:
        spec.loader.exec_module(old)
    finally:
        del sys.modules[spec.name]
    store = redis_sync.Redis.from_url(redis_url)
    lease, holder = keys.lease_key("p-roll/compat"), keys.holder_key("p-roll/compat")

    def take(script: str, instance: str) -> list[object]:
        store.delete(lease)  # the holder died: its lease lapsed, its record stays
        return store.eval(script, 2, lease, holder, f"w-{instance}", 10_000, instance, 60_000)

    try:
        # This release on trial, its alarm naming the subscription, dies: 1.1.0 quarantines it.
        take(new.ACQUIRE_HOLDING, "new-1")
        store.eval(new.MARK, 1, holder, "new-1", "trial", "1")
        store.eval(new.MARK, 1, holder, "new-1", "memory", "1")
        assert old.Taken.parse(take(old.ACQUIRE_HOLDING, "old-1")).killed_on_trial
        # 1.1.0 on trial with its alarm up dies: this release quarantines it.
        store.eval(old.MARK, 1, holder, "old-1", "trial", "1")
        store.eval(old.MARK, 1, holder, "old-1", "memory", "1")
        taken = new.Taken.parse(take(new.ACQUIRE_HOLDING, "new-2"))
        assert new.verdict("p-roll/compat", taken, None) == new.QUARANTINE
        # This release on trial beside the named one (not named) dies: 1.1.0 tries it, never quarantines it.
        store.eval(new.MARK, 1, holder, "new-2", "trial", "1")
        taken_old = old.Taken.parse(take(old.ACQUIRE_HOLDING, "old-2"))
        assert taken_old.unreleased_by("old-2") and not taken_old.killed_on_trial
        # 1.1.0 dies off trial with no evidence (none of its own kind): this release serves at once.
        taken = new.Taken.parse(take(new.ACQUIRE_HOLDING, "new-3"))
        assert new.verdict("p-roll/compat", taken, None) == new.SERVE
        # This release hands a suspect over before its trial: 1.1.0 tries it; this release too.
        assert store.eval(new.RELEASE_HOLDING, 2, lease, holder, "w-new-3", "new-3", "1") == 1
        assert old.Taken.parse(take(old.ACQUIRE_HOLDING, "old-3")).unreleased_by("old-3")
        assert store.eval(old.RELEASE_HOLDING, 2, lease, holder, "w-old-3", "old-3", "1") == 1
        taken = new.Taken.parse(take(new.ACQUIRE_HOLDING, "new-4"))
        assert new.verdict("p-roll/compat", taken, None) == new.SERVE  # 1.1.0's release marks no suspect
        assert store.eval(new.RELEASE_HOLDING, 2, lease, holder, "w-new-4", "new-4", "1") == 1
        assert new.verdict("p-roll/compat", new.Taken.parse(take(new.ACQUIRE_HOLDING, "new-5")), None) == new.SUSPECT
    finally:
        store.delete(lease, holder)
        store.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_the_switch_to_layout_2_waits_for_the_rollout_and_no_attempt_number_goes_back_across_it(
        tmp_path: Path, broker, redis_url: str, endpoint: Endpoint, client: Client, previous_release: Path):
    """On a Redis the previous release ran on, `push-worker layout upgrade` is refused while a worker of
    that release is in the fleet, and changes nothing. Once the rollout is done it switches, under a
    steady stream where every third message fails its first attempt and some fail until the switch
    is through: every message is acked once, a message counted in layout 1 and retried in layout 2
    goes on from its count, and the previous release refuses to start on layout 2 afterwards."""
    fleet = FleetHarness(tmp_path, broker.url, redis_url)
    run = time.monotonic_ns()
    topics = [f"persistent://p-switch/main/t{run}-{i}" for i in range(4)]
    names = [f"switch-{run}-{i}" for i in range(4)]
    switched = asyncio.Event()

    def answer(received) -> web.Response:
        if received.body_payload.startswith(b"straddle") and not switched.is_set():
            return web.Response(status=503)  # retried until layout 2 holds
        return first_attempt_of_every_third_fails(received)

    endpoint.behaviour = answer
    stream = SteadyStream(client, topics, endpoint)
    published, acked = stream.published, stream.acked

    try:
        fleet.redis.set(layout_key(), 1)
        old, new = fleet.start("old", code=previous_release), fleet.start("new")
        await eventually(lambda: old.fleet_size() == new.fleet_size() == 2, timeout=60, what="a fleet of two")
        assert fleet.apply([fleet_sub(n, t, endpoint.url) for n, t in zip(names, topics, strict=True)]).returncode == 0
        stream.start()
        await eventually(lambda: len(set(acked())) >= 12, timeout=90, what="deliveries under way")
        refused = fleet.cli("layout", "upgrade", "--yes")
        assert refused.returncode == 1 and "1 member(s) run a release that reads layout 1 only (old)" in \
            refused.stderr, refused.stderr
        assert fleet.redis.get(layout_key()) == b"1" and not fleet.redis.exists(layout_next_key())
        arriving = fleet.start("new2")
        await eventually(lambda: arriving.fleet_size() == 3, timeout=60, what="the surge pod in the fleet")
        assert await asyncio.to_thread(old.stop) == 0
        await eventually(lambda: new.fleet_size() == 2, timeout=60, what="the old pod gone")
        straddling = [published_id for topic in topics
                      for published_id in await asyncio.to_thread(client.publish, topic, [b"straddle 1"])]
        await eventually(lambda: all(sum(r.headers["Pubsub-Message-Id"] == m for r in endpoint.requests) >= 2
                                     for m in straddling), timeout=60, what="the straddling messages retried")
        done = await asyncio.to_thread(fleet.cli, "layout", "upgrade", "--yes")
        assert done.returncode == 0 and "redis holds layout 2" in done.stdout, done.stderr
        switched.set()
        assert fleet.redis.get(layout_key()) == b"2"
        await eventually(lambda: set(straddling) <= set(acked()), timeout=60, what="the straddling messages acked")
        mark = len(published) + 12
        await eventually(lambda: len(published) >= mark and set(published[:mark]) <= set(acked()), timeout=90,
                         what="the stream delivered in layout 2")
        # Every layout 1 lease became its holder's owner record (docs/upgrading.md#redis-layout, step 4).
        sub_keys = [f"p-switch/{n}" for n in names]
        assert not any(fleet.redis.exists(keys.lease_key(k)) for k in sub_keys), "a layout 1 lease outlived the switch"
        assert all(owner in ("new", "new2") for owner in fleet.owners(sub_keys).values()), fleet.owners(sub_keys)
        await stream.stop()
        await eventually(lambda: set(published) <= set(acked()), timeout=90, what="every message acked")
        late = fleet.start("late", code=previous_release)
        assert await asyncio.to_thread(late.proc.wait, 60) == 1
        shown = fleet.cli("layout")
    finally:
        await stream.stop()
        fleet.close()
    assert "redis holds layout 2, written by a later release" in late.log.read_text()
    assert "redis layout 2" in shown.stdout and "new2" in shown.stdout, shown.stdout
    assert [m for m, n in acked().items() if n > 1] == [], "a message acked twice"
    numbers = stream.numbers()
    went_back = {m: seen for m, seen in numbers.items() if seen != sorted(set(seen))}
    assert went_back == {}, "attempt numbers went back (or repeated) across the switch"
    assert all(len(numbers[m]) >= 3 for m in straddling)  # counted before the switch, and after it
