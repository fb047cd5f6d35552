"""The fleet with several real worker processes, a real broker, Redis and endpoints."""

from __future__ import annotations

import asyncio
import collections
import json
import signal
import threading
import time
from datetime import datetime

import pytest
from aiohttp import web

from tests.support import brokers
from tests.support.brokers import is_pulsar_lite
from tests.support.endpoints import Endpoint, serve
from tests.support.fleet_harness import (
    FleetHarness,
    delivered,
    first_deliveries_by_partition,
    fleet_sub,
    settled_ownership,
    topics,
)
from tests.support.helpers import assert_stays, eventually, stays_sync, wait_sync
from tests.support.pulsar_client import Client
from tests.support.redis_targets import ALL_REDIS
from worker.fleet import assign

pytestmark = pytest.mark.slow


@pytest.fixture
def fleet(tmp_path, broker, redis_target):
    # With the broker's admin API (Apache Pulsar), workers evict a frozen worker's consumers.
    h = FleetHarness(tmp_path, broker.url, redis_target, admin_url=brokers.admin_url(broker))
    yield h
    h.close()


async def test_three_workers_share_thirty_subscriptions_evenly(fleet: FleetHarness, endpoint: Endpoint):
    subs = [fleet_sub(f"s{i:02d}", t, endpoint.url) for i, t in enumerate(topics(30))]
    result = fleet.apply(subs)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("created") == 30
    workers = [fleet.start() for _ in range(3)]
    started = time.monotonic()
    keys = [f"p-fleet/s{i:02d}" for i in range(30)]

    def converged() -> bool:
        owned = [w.owned() for w in workers]
        owners = collections.Counter(fleet.owners(keys).values())
        return (sum(len(o) for o in owned) == 30 and None not in owners
                and all(owners[w.id] == len(o) for w, o in zip(workers, owned, strict=True))
                and all(8 <= len(o) <= 12 for o in owned))

    def settled() -> bool:  # converged, and still so a moment later: no handover under way
        if not converged():
            return False
        try:
            stays_sync(converged, 0.5)
        except AssertionError:
            return False
        return True

    await asyncio.to_thread(wait_sync, settled, 30, "30 subscriptions spread evenly over 3 workers")
    owned = [w.owned() for w in workers]
    assert set.union(*owned) == {f'pushworker_subscription_owned{{project="p-fleet",subscription="s{i:02d}"}}'
                                 for i in range(30)}
    assert sum(len(o) for o in owned) == 30  # each owned by exactly one worker
    assert all(8 <= len(o) <= 12 for o in owned), [len(o) for o in owned]
    assert collections.Counter(fleet.owners(keys).values()) == {w.id: len(o) for w, o in zip(workers, owned,
                                                                                            strict=True)}
    assert all(w.metrics()["pushworker_fleet_size"] == 3 for w in workers)
    print(f"\nconverged in {time.monotonic() - started:.1f}s: {[len(o) for o in owned]}")
    listing = json.loads(fleet.cli("subs", "list", "--json").stdout)
    assert len(listing) == 30 and all(row["owner"] in {"w0", "w1", "w2"} for row in listing)


@ALL_REDIS
async def test_kill_9_under_load_reowns_within_target_and_loses_nothing(
        tmp_path, own_broker, redis_target, endpoint: Endpoint):
    fleet = FleetHarness(tmp_path, own_broker.url, redis_target)
    client = Client(own_broker.url)
    try:
        await _kill_9_scenario(fleet, own_broker, endpoint, client)
    finally:
        client.close()
        fleet.close()


async def _kill_9_scenario(fleet: FleetHarness, broker, endpoint: Endpoint, client: Client) -> None:
    endpoint.behaviour = lambda rec: web.Response(
        status=500 if rec.headers["Pubsub-Subscription"] == "doomed" else 204)
    names = [f"k{i}" for i in range(5)] + ["doomed"]
    ts = topics(len(names))
    fleet.apply([fleet_sub(n, t, endpoint.url) for n, t in zip(names, ts, strict=True)])
    workers = [fleet.start() for _ in range(3)]
    keys = [f"p-fleet/{n}" for n in names]
    await asyncio.to_thread(settled_ownership, fleet, workers, keys, 2)
    before = {t: client.publish(t, [b"before-%d" % i for i in range(20)]) for t in ts}
    await eventually(lambda: sum(len(v) for v in delivered(endpoint).values()) >= 50, timeout=30,
                     what="deliveries under way")
    victim = next(w for w in workers if fleet.owners(keys)["p-fleet/doomed"] != w.id)
    victim_keys = {k for k, o in fleet.owners(keys).items() if o == victim.id}
    victim.signal(signal.SIGKILL)
    killed_at = time.monotonic()
    after = {t: client.publish(t, [b"after-%d" % i for i in range(20)]) for t in ts}
    survivors = {w.id for w in workers if w is not victim}
    await asyncio.to_thread(wait_sync, lambda: all(fleet.owners(keys)[k] in survivors for k in keys), 30,
                            "re-owned by survivors")
    reowned_after = time.monotonic() - killed_at
    assert reowned_after <= 10.0, reowned_after  # lease 3 s: takeover well within the 10 s target
    assert victim_keys  # the victim did own something
    expected = {n: set(before[t]) | set(after[t]) for n, t in zip(names, ts, strict=True) if n != "doomed"}
    def all_delivered() -> bool:
        return all(expected[n] <= delivered(endpoint)[n] for n in expected)

    try:
        await eventually(all_delivered, timeout=10, what="every message delivered to every subscription")
    except AssertionError:
        # pulsar-lite keeps the killed worker's Shared consumers after their connection closed and
        # goes on dispatching to them; the messages stay unacked on the broker. Apache Pulsar removes
        # a dead connection's consumers (there, a stranded message fails the test). A broker restart
        # clears them: nothing may be missing then.
        if not is_pulsar_lite(broker):
            raise
        print("\npulsar-lite kept the dead worker's consumers; restarting the broker")
        await asyncio.to_thread(broker.restart)
        await eventually(all_delivered, timeout=60, what="every message delivered after the broker restart")
    # Attempt counts continue across the move: numbering of the always-failing subscription never goes back.
    doomed = collections.defaultdict(list)
    for r in endpoint.requests:
        if r.headers["Pubsub-Subscription"] == "doomed":
            doomed[r.headers["Pubsub-Message-Id"]].append(int(r.headers["Pubsub-Delivery-Attempt"]))
    assert doomed and all(n == sorted(set(n)) for n in doomed.values())


async def test_paused_worker_delivers_nothing_for_subscriptions_it_lost(
        fleet: FleetHarness, endpoint: Endpoint, client: Client):
    names = [f"p{i}" for i in range(4)]
    ts = topics(4)
    fleet.apply([fleet_sub(n, t, endpoint.url) for n, t in zip(names, ts, strict=True)])
    a, b = fleet.start(), fleet.start()
    keys = [f"p-fleet/{n}" for n in names]
    await asyncio.to_thread(settled_ownership, fleet, [a, b], keys, 2)
    for t in ts:
        client.publish(t, [b"warm"])
    await eventually(lambda: len(endpoint.requests) >= 4, what="warm-up deliveries")
    a_keys = [k for k, o in fleet.owners(keys).items() if o == a.id]
    a.signal(signal.SIGSTOP)
    paused_at = time.monotonic()
    await asyncio.to_thread(wait_sync, lambda: all(o == b.id for o in fleet.owners(keys).values()), 20,
                            "b owns everything")
    assert time.monotonic() - paused_at > 2.5  # only after a's lease expired (3 s, renewed every 0.3 s)
    during = {t: client.publish(t, [b"during-%d" % i for i in range(5)]) for t in ts}
    resumed_at = time.time()
    a.signal(signal.SIGCONT)
    after = {t: client.publish(t, [b"after-%d" % i for i in range(5)]) for t in ts}
    want = {n: set(during[t]) | set(after[t]) for n, t in zip(names, ts, strict=True)}
    await eventually(lambda: all(want[n] <= delivered(endpoint)[n] for n in names), timeout=60,
                     what="all delivered")
    # After resuming, a delivered nothing on its old leases. (Rejoining the fleet, it may win some
    # subscriptions back through a fresh lease; deliveries after that are its own.)
    def at(e: dict) -> float:
        return datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()

    def logged() -> list[dict]:
        return [json.loads(line) for line in (fleet.tmp / "w0.log").read_text().splitlines() if line.startswith("{")]

    def lost() -> set[str]:
        return {e["subscription"] for e in logged() if e["event"] == "lease lost; stopped delivering"
                and at(e) >= resumed_at}

    await eventually(lambda: set(a_keys) <= lost(), timeout=10, what="the resumed worker noticing its lost leases")
    events = logged()
    for key in a_keys:
        name = key.split("/")[1]
        reacquired = min((at(e) for e in events if e["event"] == "subscription acquired"
                          and e.get("subscription") == key and at(e) >= resumed_at), default=float("inf"))
        stale = [e for e in events if e["event"] in ("delivered", "delivery failed")
                 and e.get("subscription") == name and resumed_at <= at(e) < reacquired]
        assert not stale, (key, stale[:3])


@pytest.mark.apache_pulsar
async def test_a_frozen_owner_of_a_single_subscription_is_taken_over(
        fleet: FleetHarness, endpoint: Endpoint, client: Client, broker):
    """SIGSTOP the owner of the only subscription: the other worker takes the lease and subscribes
    beside the frozen worker's still-open connection, and everything published meanwhile arrives.

    Apache Pulsar accepts that second consumer, but a Shared subscription goes on dispatching a share
    of the messages to the frozen one until the broker's keepalive drops its connection (measured:
    56 s). The new owner finds the frozen consumer through the admin API and unloads the topic, so
    those messages come back at once. pulsar-lite refuses the second consumer while the frozen
    connection is open (and has no admin API), so this test exists on Apache Pulsar only."""
    [t] = topics(1)
    fleet.apply([fleet_sub("solo", t, endpoint.url)])
    key = "p-fleet/solo"
    a, b = fleet.start(), fleet.start()
    await asyncio.to_thread(wait_sync, lambda: a.fleet_size() == b.fleet_size() == 2, 30, "a fleet of 2")
    owners = {a.id: a, b.id: b}

    def settled() -> bool:  # one worker holds the lease and serves it, and still does a second later
        holder = owners.get(fleet.owners([key])[key] or "")
        if holder is None or len(holder.owned()) != 1:
            return False
        try:
            stays_sync(lambda: fleet.owners([key])[key] == holder.id, 1.0)
        except AssertionError:
            return False
        return True

    await asyncio.to_thread(wait_sync, settled, 30, "settled ownership")
    owner = owners[fleet.owners([key])[key] or ""]
    other = b if owner is a else a
    client.publish(t, [b"warm"])
    await eventually(lambda: len(delivered(endpoint)["solo"]) == 1, what="warm-up delivery")
    owner.signal(signal.SIGSTOP)
    try:
        await asyncio.to_thread(wait_sync, lambda: fleet.owners([key])[key] == other.id, 20, "taken over")
        during = set(client.publish(t, [b"during-%d" % i for i in range(10)]))
        published_at = time.monotonic()
        await eventually(lambda: during <= delivered(endpoint)["solo"], timeout=20,
                         what="delivered by the new owner while the old one is frozen")
        print(f"\nall delivered {time.monotonic() - published_at:.1f}s after publishing")
        log = (fleet.tmp / f"{other.id}.log").read_text()
        assert "stale consumers on the broker; unloading the topic" in log
    finally:
        owner.signal(signal.SIGCONT)


async def test_a_failover_subscription_handed_over_by_a_kill_keeps_order_per_partition(
        tmp_path, partitioned_broker, partitioned_topic, redis_url, endpoint: Endpoint):
    """A failover subscription on a topic of 3 partitions: its owner is killed mid-stream, the other
    worker takes over, and in each partition the messages reached the endpoint for the first time
    in publish order (a message the killed owner had sent comes again; none overtakes another)."""
    async def slow(rec):
        await asyncio.sleep(0.005)
        return web.Response(status=204)

    endpoint.behaviour = slow
    fleet = FleetHarness(tmp_path, partitioned_broker.url, redis_url)
    client = Client(partitioned_broker.url)
    try:
        fleet.apply([fleet_sub("ordered", partitioned_topic, endpoint.url, type="failover")])
        a = fleet.start()
        await asyncio.to_thread(wait_sync, lambda: len(a.owned()) == 1, 30, "owned")
        b = fleet.start()
        await asyncio.to_thread(wait_sync, lambda: b.fleet_size() == 2, 30, "a fleet of 2")
        await asyncio.to_thread(wait_sync, lambda: len(a.owned()) + len(b.owned()) == 1, 30, "one owner")
        owner = a if a.owned() else b
        ids = client.publish(partitioned_topic, [b"m%d" % i for i in range(300)], key=None)
        await eventually(lambda: len(delivered(endpoint)["ordered"]) >= 60, timeout=30, what="streaming")
        owner.signal(signal.SIGKILL)
        await eventually(lambda: set(ids) <= delivered(endpoint)["ordered"], timeout=60,
                         what="every message delivered after the handover")
    finally:
        client.close()
        fleet.close()
    first_seen = first_deliveries_by_partition(endpoint)
    assert set(first_seen) == {"0", "1", "2"}
    for partition, entries in first_seen.items():
        assert entries == sorted(entries), (partition, entries[:20])


async def test_rolling_restart_under_load_loses_nothing(fleet: FleetHarness, endpoint: Endpoint, client: Client):
    names = [f"r{i}" for i in range(6)]
    ts = topics(6)
    fleet.apply([fleet_sub(n, t, endpoint.url) for n, t in zip(names, ts, strict=True)])
    workers = [fleet.start() for _ in range(3)]
    keys = [f"p-fleet/{n}" for n in names]
    await asyncio.to_thread(settled_ownership, fleet, workers, keys, 2)
    published: dict[str, list[str]] = collections.defaultdict(list)
    stop = threading.Event()

    def publish_steadily() -> None:
        i = 0
        while not stop.is_set():
            for n, t in zip(names, ts, strict=True):
                published[n] += client.publish(t, [b"m-%d" % i])
            i += 1
            time.sleep(0.02)

    publisher = threading.Thread(target=publish_steadily)
    publisher.start()
    try:
        for old in list(workers):
            assert await asyncio.to_thread(old.stop) == 0  # SIGTERM: drains and hands over
            workers.append(fleet.start())
            live = {w.id for w in workers if w.proc.poll() is None}
            await asyncio.to_thread(wait_sync, lambda live=live: all(o in live for o in fleet.owners(keys).values()),
                                    30, "handed over")
    finally:
        stop.set()
        publisher.join()
    total = sum(len(v) for v in published.values())
    await eventually(lambda: all(set(published[n]) <= delivered(endpoint)[n] for n in names), timeout=60,
                     what="every published message delivered")
    acks = collections.Counter((r.headers["Pubsub-Subscription"], r.headers["Pubsub-Message-Id"])
                               for r in endpoint.requests if r.acked)
    duplicates = sum(c - 1 for c in acks.values())
    print(f"\nrolling restart: {total} messages x subscriptions, lost 0, duplicates {duplicates} "
          f"({100 * duplicates / total:.2f}%)")


def _slow_subscriptions(fleet: FleetHarness, endpoint: Endpoint, client: Client, prefix: str, count: int,
                        backlog: int, seconds: float, answered: list[tuple[float, float]] | None = None) -> list[str]:
    """`count` subscriptions of `backlog` messages each, their endpoint answering 204 after `seconds`
    (noted in `answered` as (arrived, answered)); returns their names."""
    async def slow(rec):
        await asyncio.sleep(seconds)
        if answered is not None:
            answered.append((rec.at, time.monotonic()))
        return web.Response(status=204)

    endpoint.behaviour = slow
    names = [f"{prefix}{i}" for i in range(count)]
    ts = topics(count)
    assert fleet.apply([fleet_sub(n, t, endpoint.url, ack_deadline_seconds=10)
                        for n, t in zip(names, ts, strict=True)]).returncode == 0
    for t in ts:
        client.publish(t, [b"slow"] * backlog)
    return names


async def test_a_slow_hand_over_does_not_cost_the_worker_the_subscriptions_it_keeps(
        fleet: FleetHarness, endpoint: Endpoint, client: Client):
    # A second worker joins while every subscription has requests under way that take longer than
    # the lease (3 s). The first worker drains what it hands over; its rounds, heartbeat and renewals
    # must go on meanwhile. They used to wait for the drains: the leases it kept lapsed, its member
    # entry too, and the other worker took everything, then gave half of it back.
    names = _slow_subscriptions(fleet, endpoint, client, "s", 8, backlog=100, seconds=4)
    first = fleet.start()
    keys = [f"p-fleet/{n}" for n in names]
    await asyncio.to_thread(wait_sync, lambda: len(first.owned()) == 8, 30, "the first worker owns all")
    await eventually(lambda: {r.headers["Pubsub-Subscription"] for r in endpoint.requests} == set(names),
                     timeout=30, what="requests under way on every subscription")
    second = fleet.start()
    kept = [k for k, owner in assign(keys, [first.id, second.id]).items() if owner == first.id]
    assert 0 < len(kept) < 8
    # Longer than the drains (4 s) and the lease: the first worker held what it keeps throughout.
    await asyncio.to_thread(stays_sync, lambda: all(o == first.id for o in fleet.owners(kept).values()), 8,
                            "the first worker's leases on what it keeps")
    await asyncio.to_thread(settled_ownership, fleet, [first, second], keys, 4)
    assert "lease lost" not in (fleet.tmp / f"{first.id}.log").read_text()


async def test_two_processes_under_one_worker_id_say_so_and_a_restart_under_it_does_not(
        fleet: FleetHarness, endpoint: Endpoint):
    """A constant PUSH_WORKER_ID (where the pod name belongs) made two processes one member of the
    fleet: both served every subscription the id owned, with /readyz green and nothing logged. Now
    both say so while both run (/readyz 503 and an error line), and stop saying so once one is
    gone; a restart under the same id after kill -9 (a pod keeping its name) is not taken for one."""
    assert fleet.apply([fleet_sub("t0", topics(1)[0], endpoint.url)]).returncode == 0
    first = fleet.start("pod-a")
    await asyncio.to_thread(wait_sync, lambda: first.readiness()[0] == 200, 30, "the first process ready")
    first.signal(signal.SIGKILL)
    await asyncio.to_thread(first.stop)
    restarted = fleet.start("pod-a")
    await asyncio.to_thread(wait_sync, lambda: restarted.readiness()[0] == 200, 30, "the restarted process ready")
    # Several heartbeats (0.3 s apart) with the predecessor's mark still in Redis: no twin.
    await asyncio.to_thread(stays_sync, lambda: restarted.readiness()[0] == 200, 2, "the restarted one ready")
    twin = fleet.start("pod-a")
    said = "another process runs as worker id pod-a"
    await asyncio.to_thread(wait_sync, lambda: all(w.readiness()[0] == 503 and said in w.readiness()[1]
                                                   for w in (restarted, twin)), 30, "both twins saying so")
    for w in (restarted, twin):
        assert "another process runs with this worker id" in w.log.read_text()
    assert await asyncio.to_thread(twin.stop) == 0
    await asyncio.to_thread(wait_sync, lambda: restarted.readiness()[0] == 200, 15, "ready again, alone")
    assert "this worker id is its own again" in restarted.log.read_text()


async def test_a_clean_stop_hands_over_at_once_not_at_the_next_heartbeat(
        tmp_path, broker, redis_url: str, endpoint: Endpoint):
    # The leaving worker tells the others when its leases are free: with heartbeats 5 s apart, the
    # others must not wait for their next round to take over.
    fleet = FleetHarness(tmp_path, broker.url, redis_url, lease_seconds=10, heartbeat_seconds=5)
    try:
        names = [f"h{i}" for i in range(4)]
        assert fleet.apply([fleet_sub(n, t, endpoint.url) for n, t in zip(names, topics(4), strict=True)]
                           ).returncode == 0
        leaving, staying = fleet.start(), fleet.start()
        keys = [f"p-fleet/{n}" for n in names]
        await asyncio.to_thread(settled_ownership, fleet, [leaving, staying], keys, 2)
        leaving.signal(signal.SIGTERM)
        await asyncio.to_thread(wait_sync, lambda: all(o == staying.id for o in fleet.owners(keys).values()), 2.5,
                                "the staying worker holds every lease")
        assert await asyncio.to_thread(leaving.stop) == 0
    finally:
        fleet.close()


async def test_a_stopping_worker_holds_its_leases_until_its_requests_under_way_end(
        fleet: FleetHarness, endpoint: Endpoint, client: Client):
    # SIGTERM while requests under way take longer than the lease (3 s): the worker drains them and
    # only then releases. Its leases used to lapse mid-drain, and the next worker started on the
    # subscriptions while the first one's requests were still out.
    answered: list[tuple[float, float]] = []  # (arrived, answered)
    names = _slow_subscriptions(fleet, endpoint, client, "d", 2, backlog=20, seconds=5, answered=answered)
    first = fleet.start()
    keys = [f"p-fleet/{n}" for n in names]
    await eventually(lambda: {r.headers["Pubsub-Subscription"] for r in endpoint.requests if r.status is None}
                     == set(names), timeout=30, what="requests under way on both subscriptions")
    first.signal(signal.SIGTERM)
    stopped_at = time.monotonic()
    second = fleet.start()
    taken: dict[str, float] = {}  # when the second worker first held each lease

    def watch() -> None:
        while len(taken) < len(keys) and time.monotonic() - stopped_at < 40:
            now = time.monotonic()
            for key, owner in fleet.owners(keys).items():
                if owner == second.id:
                    taken.setdefault(key, now)
            time.sleep(0.02)

    await asyncio.to_thread(watch)
    assert await asyncio.to_thread(first.stop) == 0
    assert set(taken) == set(keys), "the second worker took over"
    drained = max(done for arrived, done in answered if arrived < stopped_at)
    assert drained - stopped_at > 3, "the drain outlasted the lease"
    assert min(taken.values()) >= drained, (
        f"a lease moved {drained - min(taken.values()):.1f}s before the first worker's requests ended")


@ALL_REDIS
async def test_live_edits_take_effect_immutable_edits_refused_delete_stops(
        fleet: FleetHarness, endpoint: Endpoint, client: Client, broker, tmp_path):
    second = Endpoint()
    from aiohttp import web as aioweb

    async def handle(request):
        second.requests.append(request.headers.get("Pubsub-Message-Id"))  # type: ignore[arg-type]
        return aioweb.Response(status=204)

    runner, other_url = await serve("/other", handle)

    [t] = topics(1)
    definition = fleet_sub("edit-me", t, endpoint.url, ack_deadline_seconds=1, max_deliver=1000,
                          dead_letter={"topic": t + "-dlq"})
    assert fleet.apply([definition]).returncode == 0
    w = fleet.start()
    await asyncio.to_thread(wait_sync, lambda: len(w.owned()) == 1, 30, "owned")

    async def slow(rec):
        await asyncio.sleep(2)
        return web.Response(status=204)

    # Ack deadline: a 2 s endpoint times out under a 1 s deadline, and is acked once it is 5 s.
    endpoint.behaviour = slow
    [mid] = client.publish(t, [b"slow"])
    await eventually(lambda: len(endpoint.by_id().get(mid, [])) >= 2, what="timeouts under 1 s deadline")
    definition["ack_deadline_seconds"] = 5
    edited = time.monotonic()
    assert "updated" in fleet.apply([definition]).stdout
    await eventually(lambda: any(r.acked for r in endpoint.by_id()[mid]), timeout=15, what="acked under 5 s")
    assert time.monotonic() - edited < 2 + 2 + 2  # within the 2 s propagation target, plus one retry and the 2 s answer

    # Push URL: the next delivery goes to the new endpoint.
    definition["deliver"]["push"]["url"] = other_url
    fleet.apply([definition])
    await asyncio.sleep(2.0)  # the promise under test: an edit lands within 2 s (a poll would not test it)
    [mid2] = client.publish(t, [b"to-the-other"])
    await eventually(lambda: mid2 in second.requests, timeout=10, what="delivered to the new URL")
    assert mid2 not in endpoint.by_id()

    # max_deliver: lowered to 2, a failing message is dead-lettered after its second attempt.
    definition["deliver"]["push"]["url"] = endpoint.url
    definition["max_deliver"] = 2
    definition["dead_letter"]["after_attempts"] = 2
    endpoint.behaviour = lambda rec: web.Response(status=500)
    watcher = client.watch(t + "-dlq")
    fleet.apply([definition])
    await asyncio.sleep(2.0)  # the same promise: within 2 s the lowered max_deliver applies
    [mid3] = client.publish(t, [b"fails"])
    [dead] = await asyncio.to_thread(Client.drain, watcher, 1)
    assert dead.properties()["pubsub.delivery_attempts"] == "2"
    assert len(endpoint.by_id()[mid3]) == 2

    # Immutable fields are refused with a clear error, and nothing changes.
    for field, value in (("type", "exclusive"), ("start_from", "new"), ("topic", t + "-other")):
        bad = json.loads(json.dumps(definition))
        bad[field] = value
        result = fleet.apply([bad])
        assert result.returncode == 2, result.stdout
        assert f"subscription 'edit-me': {field}: is immutable" in result.stderr
    got = json.loads(fleet.cli("subs", "get", "edit-me", "--json").stdout)
    assert got["definition"].get("type", "shared") == "shared" and got["status"]["owner"] == w.id

    # Delete stops delivery promptly, and the worker drops the subscription's series (every kind:
    # counters, the histogram, each result of deliveries): a fleet's churn must not pile them up.
    def series() -> set[str]:
        return {k.split("{")[0] for k in w.metrics() if 'subscription="edit-me"' in k}

    assert {"pushworker_messages_acked_total", "pushworker_delivery_duration_seconds_bucket",
            "pushworker_deliveries_total", "pushworker_subscription_owned"} <= series()
    endpoint.behaviour = None
    result = fleet.cli("subs", "delete", "edit-me")
    assert result.returncode == 0 and "deleted" in result.stdout
    await asyncio.to_thread(wait_sync, lambda: not w.owned(), 5, "no longer served")
    await asyncio.to_thread(wait_sync, lambda: not series(), 5, "no series of the deleted subscription")
    before = len(endpoint.requests)
    client.publish(t, [b"after-delete"])
    await assert_stays(lambda: len(endpoint.requests) == before, 2.0, "nothing delivered after the delete")
    assert fleet.cli("subs", "get", "edit-me").returncode == 3  # not found
    await runner.cleanup()
