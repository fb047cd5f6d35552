"""A subscription bigger than one worker (`max_workers`): its slots, their leases and shares, how
many workers serve it as its backlog grows and drains, and per-key order across its workers."""

from __future__ import annotations

import asyncio
import collections
import json
import signal
import time

import pytest
from aiohttp import web

from tests.support import brokers
from tests.support.builders import make_sub, push_sub
from tests.support.endpoints import Endpoint
from tests.support.fleet_harness import (
    FleetHarness,
    WorkerProcess,
    delivered,
    first_deliveries_by_partition,
    fleet_sub,
    topics,
)
from tests.support.helpers import eventually
from tests.support.pulsar_client import Client
from worker.core import keys
from worker.core.messages import format_message_id
from worker.fleet.spread import next_width, partitions_limit, share
from worker.model.subscriptions import RateLimit, parse_subscription
from worker.runtime.errors import ConfigError

TOPIC, URL = "persistent://p-test/main/t", "https://example.com/hook"


def backlog_source(broker) -> dict[str, object]:
    """The workers' backlog source, read every second: the admin API of Apache Pulsar, the
    Prometheus page of pulsar-lite."""
    source = {"admin_url": brokers.admin_url(broker)} if brokers.admin_url(broker) else \
        {"metrics_url": broker.metrics_url}
    return {**source, "backlog_interval_seconds": 1}


def deliveries(worker: WorkerProcess, name: str) -> float:
    """Requests `worker` made for subscription `name` (from its /metrics)."""
    try:
        samples = worker.metrics()
    except OSError:
        return 0.0
    return sum(v for k, v in samples.items()
               if k.startswith("pushworker_deliveries_total{") and f'subscription="{name}"' in k)


def publish_fast(client: Client, topic: str, n: int) -> set[str]:
    """`n` messages sent without waiting for each (a backlog at once), unbatched: the broker's backlog
    counts a batch once."""
    producer = client.client.create_producer(topic, batching_enabled=False, block_if_queue_full=True)
    ids: set[str] = set()
    for i in range(n):
        producer.send_async(b"m%d" % i, lambda result, message_id: ids.add(format_message_id(message_id)))
    producer.flush()
    producer.close()
    assert len(ids) == n
    return ids


async def slowly(rec) -> web.Response:
    """An endpoint's answer in 20 ms: a backlog builds up."""
    await asyncio.sleep(0.02)
    return web.Response(status=204)


def log_lines(worker: WorkerProcess) -> list[dict]:
    """`worker`'s JSON log lines."""
    return [json.loads(line) for line in worker.log.read_text().splitlines() if line.startswith("{")]


# -- the pure parts ----------------------------------------------------------------------------


@pytest.mark.broker_independent
def test_each_slot_serves_a_share_and_the_shares_add_up_to_the_totals():
    sub = make_sub(TOPIC, URL, max_ack_pending=10, max_concurrency=5, rate_limit=RateLimit(30.0, 9.0))
    for width in (1, 2, 3, 4, 7):
        shares = [share(sub, slot, width) for slot in range(width)]
        assert sum(s.max_ack_pending for s in shares) == 10
        assert sum(s.max_concurrency or 0 for s in shares) == max(5, width)  # at least one each
        assert sum(s.rate_limit.messages_per_second for s in shares if s.rate_limit) == pytest.approx(30.0)
        assert all(s.rate_limit and s.rate_limit.burst >= 1.0 for s in shares)
    assert share(sub, 0, 1) is sub


@pytest.mark.broker_independent
def test_the_width_steps_up_one_a_reading_and_down_only_after_a_quiet_period():
    # 5,000 a worker: a backlog of 12,000 wants 3; it gets there one reading at a time.
    assert next_width(1, 12_000, 5_000, 4, None, 0.0, 60) == (2, None)
    assert next_width(2, 12_000, 5_000, 4, None, 1.0, 60) == (3, None)
    assert next_width(3, 12_000, 5_000, 4, None, 2.0, 60) == (3, None)  # 12,000 <= 3 x 5,000: enough
    assert next_width(4, 90_000, 5_000, 4, None, 2.0, 60) == (4, None)  # never past the limit
    assert next_width(6, 0, 5_000, 4, None, 2.0, 60) == (4, None)  # a smaller limit applies at once
    # Between what width - 1 and width are for: no change (the hysteresis band).
    assert next_width(3, 10_500, 5_000, 4, None, 3.0, 60) == (3, None)
    # Below what one fewer is for: down only once it has stayed so for the quiet period.
    assert next_width(3, 9_000, 5_000, 4, None, 10.0, 60) == (3, 10.0)
    assert next_width(3, 9_000, 5_000, 4, 10.0, 69.0, 60) == (3, 10.0)
    assert next_width(3, 9_000, 5_000, 4, 10.0, 70.0, 60) == (2, 70.0)
    assert next_width(3, 12_000, 5_000, 4, 10.0, 71.0, 60) == (3, None)  # busy again: the clock restarts
    assert next_width(1, 0, 5_000, 4, None, 0.0, 60) == (1, None)


@pytest.mark.broker_independent
def test_max_workers_is_bounded_by_what_the_type_can_share():
    assert partitions_limit(make_sub(TOPIC, URL, type="shared", max_workers=8), None) == 8
    assert partitions_limit(make_sub(TOPIC, URL, type="key-shared", max_workers=8), None) == 8
    assert partitions_limit(make_sub(TOPIC, URL, type="failover", max_workers=8), 3) == 3
    assert partitions_limit(make_sub(TOPIC, URL, type="failover", max_workers=8), 1) == 1
    definition = push_sub("one", "persistent://p-test/main/t", "https://example.com/hook", type="exclusive",
                          max_workers=2)
    with pytest.raises(ConfigError, match="max_workers: must be 1 for type exclusive"):
        parse_subscription(definition)
    with pytest.raises(ConfigError, match="max_workers"):
        parse_subscription({**definition, "type": "shared", "max_workers": 65})
    assert parse_subscription({**definition, "type": "shared", "max_workers": 64}).max_workers == 64


# -- real workers ------------------------------------------------------------------------------

@pytest.fixture
def spread_fleet(tmp_path, broker, redis_url):
    fleet = FleetHarness(tmp_path, broker.url, redis_url, admin_url=brokers.admin_url(broker),
                         pulsar=backlog_source(broker), backlog_per_worker=150, spread_quiet_seconds=2)
    yield fleet
    fleet.close()


@pytest.mark.slow
@pytest.mark.apache_pulsar  # pulsar-lite refuses a second worker's consumer whose id equals the first's
async def test_a_backlog_spreads_a_subscription_over_its_workers_and_a_drained_one_narrows(
        spread_fleet: FleetHarness, endpoint: Endpoint, client: Client):
    """One subscription, three workers, max_workers 3: a backlog of 3,000 at 150 a worker takes it to
    three workers (one a backlog reading), each delivering; every message arrives and no attempt
    number repeats; drained, it goes back to one worker."""
    fleet = spread_fleet

    endpoint.behaviour = slowly
    [topic] = topics(1)
    key = "p-fleet/spread"
    # A window of 30: each worker's client prefetches at most that, so the backlog stays with the
    # broker for every worker to take from (with the default 1,000, the first workers' prefetch took
    # it all under a loaded CI machine, and the last to join delivered nothing).
    assert fleet.apply([fleet_sub("spread", topic, endpoint.url, max_workers=3, max_concurrency=6,
                                  max_ack_pending=30)]).returncode == 0
    workers = [fleet.start() for _ in range(3)]
    await eventually(lambda: fleet.holders(key, 1) != [""], timeout=30, what="the subscription served")
    # The backlog is published while the subscription is paused, so that all of it is there at once:
    # published while served, it was delivered about as fast as a loaded machine published it, and
    # the backlog read 172, which spreads to two workers, not three. Published and asked from
    # threads: the endpoint answers on this loop meanwhile.
    assert (await asyncio.to_thread(fleet.cli, "subs", "pause", key)).returncode == 0
    sent = set(await asyncio.to_thread(client.publish, topic, [b"m%d" % i for i in range(3000)]))
    assert (await asyncio.to_thread(fleet.cli, "subs", "resume", key)).returncode == 0

    def spread_to_three() -> bool:
        return fleet.redis.get(keys.workers_key(key)) == b"3" and "" not in fleet.holders(key, 3)

    await eventually(spread_to_three, timeout=60, what="three workers serving the subscription")
    assert len(set(fleet.holders(key, 3))) == 3  # distinct workers
    first = next(w for w in workers if w.id == fleet.holders(key, 1)[0])
    gauge = 'pushworker_subscription_workers{project="p-fleet",subscription="spread"}'
    await eventually(lambda: first.metrics().get(gauge) == 3, timeout=10, what="the width exported by slot 0's holder")
    listing = json.loads((await asyncio.to_thread(fleet.cli, "subs", "get", key, "--json")).stdout)
    assert sorted(listing["status"]["owner"].split(",")) == sorted(w.id for w in workers)

    def all_acked() -> bool:
        return sent <= {r.headers["Pubsub-Message-Id"] for r in endpoint.requests if r.acked}

    await eventually(all_acked, timeout=120, what="every message delivered")
    assert all(deliveries(w, "spread") > 0 for w in workers), [deliveries(w, "spread") for w in workers]
    attempts = collections.Counter((r.headers["Pubsub-Message-Id"], r.headers["Pubsub-Delivery-Attempt"])
                                   for r in endpoint.requests)
    assert max(attempts.values()) == 1, "an attempt number repeated across the subscription's workers"
    await eventually(lambda: fleet.redis.get(keys.workers_key(key)) == b"1" and fleet.holders(key, 3)[1:] == ["", ""],
                     timeout=60, what="back to one worker once drained")


@pytest.mark.slow
@pytest.mark.apache_pulsar  # as above; and its Key_Shared stalls redelivery after a reconnect
async def test_key_shared_keeps_per_key_order_across_its_workers_while_one_is_killed(
        spread_fleet: FleetHarness, endpoint: Endpoint, client: Client):
    """A key-shared subscription over three workers (Key_Shared consumers): the first deliveries of
    each key come in publish order, also while its workers grow and one of them is killed."""
    fleet = spread_fleet
    failures = iter(range(10**9))

    async def sometimes(rec) -> web.Response:
        await asyncio.sleep(0.01)
        return web.Response(status=500 if next(failures) % 7 == 0 else 204)

    endpoint.behaviour = sometimes
    [topic] = topics(1)
    key = "p-fleet/ordered"
    assert fleet.apply([fleet_sub("ordered", topic, endpoint.url, type="key-shared", max_workers=3,
                                  max_concurrency=12)]).returncode == 0
    workers = [fleet.start() for _ in range(3)]
    await eventually(lambda: fleet.holders(key, 1) != [""], timeout=30, what="the subscription served")
    order = {f"k{k}": await asyncio.to_thread(client.publish, topic, [b"%d" % i for i in range(50)], key=f"k{k}")
             for k in range(30)}
    await eventually(lambda: "" not in fleet.holders(key, 2), timeout=60, what="a second worker serving it")
    victim = next(w for w in workers if w.id == fleet.holders(key, 2)[1])
    victim.signal(signal.SIGKILL)
    killed_at = time.monotonic()
    expected = {m for ids in order.values() for m in ids}

    def all_acked() -> bool:
        return expected <= {r.headers["Pubsub-Message-Id"] for r in endpoint.requests if r.acked}

    await eventually(all_acked, timeout=120, what="every message delivered after the kill")
    print(f"\nall delivered {time.monotonic() - killed_at:.1f}s after the kill")
    first: dict[str, list[str]] = collections.defaultdict(list)
    for r in endpoint.requests:
        if r.headers["Pubsub-Delivery-Attempt"] == "1":
            first[r.headers["Pubsub-Ordering-Key"]].append(r.headers["Pubsub-Message-Id"])
    for k, ids in order.items():
        firsts = [m for m in first[k] if m in set(ids)]
        assert firsts == sorted(firsts, key=ids.index), f"key {k}: first deliveries out of publish order"


@pytest.mark.slow
@pytest.mark.apache_pulsar  # pulsar-lite refuses a second worker's consumer whose id equals the first's
async def test_max_workers_raised_on_a_live_key_shared_subscription_then_a_seek_narrows_it_first(
        spread_fleet: FleetHarness, endpoint: Endpoint, client: Client):
    """max_workers 1 -> 2 on a key-shared subscription: served anew as Key_Shared (Apache Pulsar would
    refuse a Key_Shared consumer beside the Shared one), spread, every message delivered. A seek to
    the earliest message then narrows it to one worker before the cursor moves, and every message
    comes again."""
    fleet = spread_fleet

    endpoint.behaviour = slowly
    [topic] = topics(1)
    key = "p-fleet/grows"
    definition = fleet_sub("grows", topic, endpoint.url, type="key-shared", max_concurrency=6)
    assert fleet.apply([definition]).returncode == 0
    workers = [fleet.start() for _ in range(2)]
    await eventually(lambda: fleet.holders(key, 1) != [""], timeout=30, what="the subscription served")
    first = await asyncio.to_thread(client.publish, topic, [b"a%d" % i for i in range(50)], key="k")

    def acked(ids) -> bool:
        return set(ids) <= {r.headers["Pubsub-Message-Id"] for r in endpoint.requests if r.acked}

    await eventually(lambda: acked(first), timeout=30, what="delivered with one worker")
    assert (await asyncio.to_thread(fleet.apply, [{**definition, "max_workers": 2}])).returncode == 0
    more = {f"k{k}": await asyncio.to_thread(client.publish, topic, [b"b%d" % i for i in range(100)], key=f"k{k}")
            for k in range(10)}
    await eventually(lambda: "" not in fleet.holders(key, 2), timeout=60, what="two workers serving it")
    await eventually(lambda: acked([m for ids in more.values() for m in ids]), timeout=60,
                     what="delivered with two workers")
    before = len(endpoint.requests)
    result = await asyncio.to_thread(fleet.cli, "subs", "seek", key, "--to-earliest")
    assert result.returncode == 0, result.stderr
    await eventually(lambda: set(first) | {m for ids in more.values() for m in ids}
                     <= {r.headers["Pubsub-Message-Id"] for r in endpoint.requests[before:]},
                     timeout=60, what="every message again after the seek")
    # The other worker let its slot go before the cursor moved.
    events = sorted((line["timestamp"], line["event"], line.get("slot", 0)) for w in workers for line in log_lines(w)
                    if line.get("subscription") == key and line.get("event") in ("seeking", "subscription released"))
    seeking = next(at for at, event, _ in events if event == "seeking")
    assert any(event == "subscription released" and slot and at < seeking for at, event, slot in events), events


@pytest.mark.slow
@pytest.mark.apache_pulsar  # pulsar-lite refuses a second worker's consumer whose id equals the first's
async def test_a_retry_after_one_worker_gets_holds_every_worker_of_the_subscription(
        spread_fleet: FleetHarness, endpoint: Endpoint, client: Client):
    """The endpoint answers one request `429 Retry-After: 4` while two workers serve the subscription:
    within a round neither sends another request until the 4 s have passed."""
    fleet = spread_fleet
    refused_at: list[float] = []
    both_serving = asyncio.Event()

    async def once_busy(rec) -> web.Response:
        await asyncio.sleep(0.01)
        if not refused_at and both_serving.is_set():
            refused_at.append(time.monotonic())
            return web.Response(status=429, headers={"Retry-After": "4"})
        return web.Response(status=204)

    endpoint.behaviour = once_busy
    [topic] = topics(1)
    key = "p-fleet/polite"
    assert fleet.apply([fleet_sub("polite", topic, endpoint.url, max_workers=2, max_concurrency=8)]).returncode == 0
    workers = [fleet.start() for _ in range(2)]
    await eventually(lambda: fleet.holders(key, 1) != [""], timeout=30, what="the subscription served")
    sent = await asyncio.to_thread(publish_fast, client, topic, 6000)
    await eventually(lambda: "" not in fleet.holders(key, 2), timeout=60, what="two workers serving it")
    await eventually(lambda: deliveries(workers[0], "polite") > 0 and deliveries(workers[1], "polite") > 0,
                     timeout=30, what="both delivering")
    both_serving.set()
    await eventually(lambda: bool(refused_at), timeout=60, what="the endpoint's 429")
    await eventually(lambda: sent <= delivered(endpoint)["polite"], timeout=120, what="every message delivered")
    # Requests under way, and those the other worker started before its next round, may arrive
    # within a second of the 429; none after that until the pause is over.
    during = [r.at - refused_at[0] for r in endpoint.requests if 1.0 < r.at - refused_at[0] < 3.8]
    assert not during, f"{len(during)} requests during the pause, the first {min(during):.2f} s after the 429"


@pytest.mark.slow
@pytest.mark.apache_pulsar  # pulsar-lite refuses a second worker's consumer whose id equals the first's
async def test_a_spread_subscription_dead_letters_each_message_once(
        spread_fleet: FleetHarness, endpoint: Endpoint, client: Client):
    """Every request refused, max_deliver 3, two workers: each message gets attempts 1, 2, 3 in all
    (whichever worker makes them) and is dead-lettered once."""
    fleet = spread_fleet
    endpoint.behaviour = lambda rec: web.Response(status=500)
    [topic] = topics(1)
    dead = topic + "-dlq"
    key = "p-fleet/doomed"
    definition = fleet_sub("doomed", topic, endpoint.url, max_workers=2, max_deliver=3, dead_letter={"topic": dead})
    definition["deliver"]["push"]["breaker"] = "off"  # on, it holds every message of a dead endpoint back
    assert fleet.apply([definition]).returncode == 0
    watcher = client.watch(dead)
    [fleet.start() for _ in range(2)]
    await eventually(lambda: fleet.holders(key, 1) != [""], timeout=30, what="the subscription served")
    sent = await asyncio.to_thread(publish_fast, client, topic, 2000)
    await eventually(lambda: "" not in fleet.holders(key, 2), timeout=60, what="two workers serving it")
    letters = await asyncio.to_thread(Client.drain_originals, watcher, sent, 120)
    watcher.close()
    originals = collections.Counter(m.properties().get("pubsub.original_message_id") for m in letters)
    assert set(originals) == sent and max(originals.values()) == 1, "a message dead-lettered twice"
    attempts = collections.defaultdict(list)
    for r in endpoint.requests:
        attempts[r.headers["Pubsub-Message-Id"]].append(int(r.headers["Pubsub-Delivery-Attempt"]))
    assert all(sorted(numbers) == [1, 2, 3] for numbers in attempts.values()), "attempts repeated or skipped"


@pytest.mark.slow
@pytest.mark.apache_pulsar  # pulsar-lite refuses a second worker's consumer whose id equals the first's
async def test_a_failover_subscription_spreads_up_to_its_partitions_and_keeps_order_per_partition(
        tmp_path, broker, redis_url, endpoint: Endpoint, client: Client, topic: str):
    """Failover on a topic of 2 partitions with max_workers 4: at most 2 workers serve it (each
    partition has one active consumer); one of them is killed mid-stream; in each partition the
    first deliveries come in publish order and every message arrives."""
    partitioned = brokers.partitioned(broker, topic, 2)
    fleet = FleetHarness(tmp_path, broker.url, redis_url, admin_url=brokers.admin_url(broker),
                         pulsar=backlog_source(broker), backlog_per_worker=150, spread_quiet_seconds=60)
    try:
        endpoint.behaviour = slowly
        key = "p-test/parts"
        assert fleet.apply([fleet_sub("parts", partitioned, endpoint.url, type="failover", max_workers=4,
                                      max_concurrency=8)]).returncode == 0
        workers = [fleet.start() for _ in range(3)]
        await eventually(lambda: fleet.holders(key, 1) != [""], timeout=30, what="the subscription served")
        sent = await asyncio.to_thread(publish_fast, client, partitioned, 4000)
        await eventually(lambda: fleet.redis.get(keys.workers_key(key)) == b"2" and "" not in fleet.holders(key, 2),
                         timeout=60, what="two workers serving it")
        await asyncio.sleep(3.0)  # more backlog readings: still two, the partitions' number
        assert fleet.redis.get(keys.workers_key(key)) == b"2" and fleet.holders(key, 3)[2] == ""
        victim = next(w for w in workers if w.id == fleet.holders(key, 2)[1])
        victim.signal(signal.SIGKILL)
        await eventually(lambda: sent <= delivered(endpoint)["parts"], timeout=120, what="every message delivered")
    finally:
        fleet.close()
    first_seen = first_deliveries_by_partition(endpoint)
    assert set(first_seen) == {"0", "1"}
    for partition, entries in first_seen.items():
        assert entries == sorted(entries), (partition, entries[:20])
