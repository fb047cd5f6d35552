"""Network partitions, not crashes: a worker whose process runs on while its connection to Redis
hangs (a fault point between them, tests/support/faults.py), or is slow. Figures in
docs/reliability.md#network-partitions."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import shutil
import time
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.support import brokers
from tests.support.endpoints import Endpoint
from tests.support.faults import FaultyLink, GroupFirewall
from tests.support.fleet_harness import FleetHarness, WorkerProcess, delivered, fleet_sub, settled_ownership, topics
from tests.support.helpers import eventually, wait_sync
from tests.support.pulsar_client import Client
from worker.core.messages import format_message_id

pytestmark = [pytest.mark.slow, pytest.mark.alone]  # iptables rules: the machine's, not this test's
# Dropping one worker's packets takes iptables and root (the machine's kind has both; CI installs iptables).
needs_iptables = pytest.mark.skipif((not shutil.which("iptables") or os.geteuid() != 0) and not os.environ.get("CI"),
                                    reason="iptables as root (CI installs Debian's package)")

LEASE, HEARTBEAT = 3.0, 0.3


def requests_made(worker: WorkerProcess, since: float = 0.0, until: float = float("inf")) -> int:
    """The requests `worker` made whose answer (or failure) it logged between `since` and `until`
    (wall clock): its log, since the metrics of a subscription it lost are gone with it."""
    count = 0
    for line in worker.log.read_text().splitlines():
        if line.startswith("{") and ('"delivered"' in line or '"delivery failed"' in line):
            entry = json.loads(line)
            at = datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00")).timestamp()
            count += since <= at < until
    return count


async def three_workers(fleet: FleetHarness, endpoint: Endpoint, prefix: str, **cut: Any
                        ) -> tuple[WorkerProcess, list[WorkerProcess], list[str], list[str]]:
    """Six subscriptions over three workers, two each once settled: w0 started with `cut` (its fault
    point), w1 and w2 as they are. Returns w0, the others, the subscriptions' keys and their topics."""
    names = [f"{prefix}{i}" for i in range(6)]
    ts = topics(len(names))
    assert fleet.apply([fleet_sub(n, t, endpoint.url) for n, t in zip(names, ts, strict=True)]).returncode == 0
    faulty = fleet.start("w0", **cut)
    others = [fleet.start("w1"), fleet.start("w2")]
    keys = [f"p-fleet/{n}" for n in names]
    await asyncio.to_thread(settled_ownership, fleet, [faulty, *others], keys, 2)
    return faulty, others, keys, ts


async def steady_stream(client: Client, topics_: list[str], sent: list[str], stop: asyncio.Event) -> None:
    """A message to every topic each 50 ms until `stop`, their ids into `sent`."""
    i = 0
    while not stop.is_set():
        for t in topics_:
            sent.extend(await asyncio.to_thread(client.publish, t, [b"m%d" % i]))
        i += 1
        await asyncio.sleep(0.05)


async def delivered_once_each_attempt(endpoint: Endpoint, sent: list[str]) -> int:
    """Once every message in `sent` has been acked: no attempt number used twice. Returns how many
    requests repeated a message (a later attempt of one already sent)."""
    await eventually(lambda: set(sent) <= {m for ids in delivered(endpoint).values() for m in ids}, timeout=90,
                     what="every message delivered")
    attempts = collections.Counter((r.headers["Pubsub-Message-Id"], r.headers["Pubsub-Delivery-Attempt"])
                                   for r in endpoint.requests)
    assert max(attempts.values()) == 1, "an attempt number was used twice"
    return len(endpoint.requests) - len({r.headers["Pubsub-Message-Id"] for r in endpoint.requests})


@pytest.fixture
def fleet(tmp_path, broker, redis_url):
    h = FleetHarness(tmp_path, broker.url, redis_url, admin_url=brokers.admin_url(broker),
                     lease_seconds=LEASE, heartbeat_seconds=HEARTBEAT)
    yield h
    h.close()


@pytest.mark.timeout(300)
async def test_a_worker_cut_from_redis_stops_before_its_leases_lapse_and_rejoins_after_the_heal(
        fleet: FleetHarness, redis_url: str, endpoint: Endpoint, client: Client):
    """Cut from Redis for 30 s while two others run: it sends no request meanwhile (none could be
    recorded), the others hold its subscriptions within a lease period and a round, it rejoins after
    the heal, nothing is lost and no attempt number is used twice."""
    link, through = FaultyLink.to_url(redis_url)
    try:
        cut, others, keys, ts = await three_workers(fleet, endpoint, "cut", PUSH_WORKER_REDIS_URL=through)
        sent: list[str] = []
        stop = asyncio.Event()
        publishing = asyncio.create_task(steady_stream(client, ts, sent, stop))
        await eventually(lambda: requests_made(cut) >= 10, timeout=30, what="the worker delivering")
        link.cut()
        cut_at, cut_wall = time.monotonic(), time.time()
        survivors = {w.id for w in others}
        await asyncio.to_thread(wait_sync, lambda: all(o in survivors for o in fleet.owners(keys).values()), 30,
                                "the others holding every subscription")
        taken_over = time.monotonic() - cut_at
        await asyncio.sleep(max(0.0, 30 - (time.monotonic() - cut_at)))
        # Requests begun before the cut (their attempts recorded) end within a second of it.
        assert requests_made(cut, since=cut_wall + 1.0, until=time.time()) == 0, \
            "the cut-off worker sent requests whose attempts it could not record"
        link.heal()
        healed_at = time.monotonic()
        await eventually(lambda: others[0].fleet_size() == 3, timeout=30, what="the healed worker back in the fleet")
        await asyncio.to_thread(settled_ownership, fleet, [cut, *others], keys, 2)
        rejoined = time.monotonic() - healed_at
        stop.set()
        await publishing
        duplicates = await delivered_once_each_attempt(endpoint, sent)
        print(f"\ntaken over {taken_over:.1f}s after the cut (lease {LEASE:g}s, round {HEARTBEAT:g}s); "
              f"rejoined and balanced {rejoined:.1f}s after the heal; {len(sent)} messages, "
              f"{duplicates} delivered more than once")
        assert taken_over <= LEASE + 2 * HEARTBEAT + 1.0, taken_over
    finally:
        link.close()


@needs_iptables
@pytest.mark.timeout(300)
async def test_a_slow_or_lossy_redis_slows_delivery_and_loses_nothing(
        fleet: FleetHarness, redis_url: str, endpoint: Endpoint, client: Client):
    """A steady 200 msg/s for 3 s through a fault point to Redis as it is, with 50 ms added each way,
    and with 5% of its packets dropped: the worker keeps its lease (renewed well inside it), stays
    ready and delivers every message each time, its attempt numbers never used twice."""
    link, through = FaultyLink.to_url(redis_url)
    try:
        [topic] = topics(1)
        assert fleet.apply([fleet_sub("slow", topic, endpoint.url, max_concurrency=64)]).returncode == 0
        worker = fleet.start("w0", PUSH_WORKER_REDIS_URL=through)
        await eventually(lambda: fleet.owners(["p-fleet/slow"])["p-fleet/slow"] == "w0", timeout=30,
                         what="the subscription served through the link")
        figures = []

        def publish_paced(n: int, rate: float) -> dict[str, float]:
            """Message id -> when it was published (monotonic), evenly spaced."""
            producer = client.client.create_producer(topic, batching_enabled=False)
            sent, started = {}, time.monotonic()
            for i in range(n):
                time.sleep(max(0.0, started + i / rate - time.monotonic()))
                sent[format_message_id(producer.send(b"s%d" % i))] = time.monotonic()
            producer.close()
            return sent

        async def deliver(what: str) -> None:
            sent = await asyncio.to_thread(publish_paced, 600, 200.0)
            await eventually(lambda: set(sent) <= delivered(endpoint)["slow"], timeout=120,
                             what=f"every message, {what}")
            first = {}
            for r in endpoint.requests:
                first.setdefault(r.headers["Pubsub-Message-Id"], r.at)
            latency = sorted(first[m] - at for m, at in sent.items())
            figures.append(f"{what}: p50 {1000 * latency[len(latency) // 2]:.0f} ms, "
                           f"p99 {1000 * latency[int(len(latency) * 0.99)]:.0f} ms")
            assert fleet.owners(["p-fleet/slow"])["p-fleet/slow"] == "w0", f"the lease was lost, {what}"
            assert worker.readiness()[0] == 200, worker.readiness()

        await deliver("as it is")
        link.latency = 0.05
        await deliver("50 ms added each way")
        link.latency = 0.0
        with link.packet_loss(0.05):
            await deliver("5% of packets dropped")
        figures[-1] += f" ({link.dropped} packets dropped)"
        assert link.dropped > 0
        attempts = collections.Counter((r.headers["Pubsub-Message-Id"], r.headers["Pubsub-Delivery-Attempt"])
                                       for r in endpoint.requests)
        assert max(attempts.values()) == 1, "an attempt number was used twice"
        print("\n200 msg/s for 3 s, publish to the endpoint, through the link to Redis: " + "; ".join(figures))
    finally:
        link.close()


@needs_iptables
@pytest.mark.apache_pulsar  # pulsar-lite never drops a dead connection's consumers: what they hold waits for the heal
@pytest.mark.timeout(300)
async def test_a_worker_cut_from_the_broker_hands_its_subscriptions_over_and_rejoins_after_the_heal(
        tmp_path, broker, redis_url: str, endpoint: Endpoint, client: Client):
    """Its packets to the broker dropped for 40 s (Redis still answering it): after
    fleet.broker_lost_after_seconds it steps out of the fleet, the others serve its subscriptions,
    it rejoins after the heal; nothing lost, no attempt number used twice, duplicates counted."""
    fleet = FleetHarness(tmp_path, broker.url, redis_url, admin_url=brokers.admin_url(broker),
                         lease_seconds=LEASE, heartbeat_seconds=HEARTBEAT, broker_lost_after_seconds=5)
    firewall = GroupFirewall(40_000 + os.getpid() % 20_000)
    broker_port = urlsplit(broker.url).port
    assert broker_port is not None
    try:
        cut, others, keys, ts = await three_workers(fleet, endpoint, "bcut", gid=firewall.gid)
        sent: list[str] = []
        stop = asyncio.Event()
        publishing = asyncio.create_task(steady_stream(client, ts, sent, stop))
        await eventually(lambda: requests_made(cut) >= 10, timeout=30, what="the worker delivering")
        firewall.block(broker_port)
        cut_at = time.monotonic()
        survivors = {w.id for w in others}
        await asyncio.to_thread(wait_sync, lambda: all(o in survivors for o in fleet.owners(keys).values()), 60,
                                "the others holding every subscription")
        taken_over = time.monotonic() - cut_at
        assert "cut off from the broker" in cut.readiness()[1]
        await asyncio.sleep(max(0.0, 40 - (time.monotonic() - cut_at)))
        firewall.unblock(broker_port)
        healed_at = time.monotonic()
        await asyncio.to_thread(settled_ownership, fleet, [cut, *others], keys, 2)
        rejoined = time.monotonic() - healed_at
        stop.set()
        await publishing
        duplicates = await delivered_once_each_attempt(endpoint, sent)
        print(f"\nhanded over {taken_over:.1f}s after the cut (broker_lost_after_seconds 5); rejoined and balanced "
              f"{rejoined:.1f}s after the heal; {len(sent)} messages, {duplicates} delivered more than once")
        assert taken_over <= 5 + 2 + 5 + 10 + LEASE  # lost after, a probe's period and timeout, a drain, a lease
    finally:
        firewall.close()
        fleet.close()
