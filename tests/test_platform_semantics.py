"""The platform's delivery semantics: max_deliver -1 (retry forever) and 0 (dead-letter the first
failure), max_concurrency below max_ack_pending, a deleted topic, partitioned topics (order per key
and per partition)."""

from __future__ import annotations

import asyncio
import threading
import time

import pulsar
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from tests.support.builders import make_sub
from tests.support.endpoints import ConcurrencyProbe, Endpoint
from tests.support.helpers import cli, eventually
from tests.support.pulsar_client import Client
from worker.fleet.registry import Registry
from worker.model.subscriptions import RetryPolicy


async def test_max_deliver_minus_one_retries_forever(start_worker, endpoint: Endpoint, client: Client, topic):
    answers = iter([500] * 12)
    endpoint.behaviour = lambda rec: web.Response(status=next(answers, 204))
    sub = make_sub(topic, endpoint.url, max_deliver=-1, retry=RetryPolicy(0.01, 0.02),
                   dead_letter_topic=topic + "-dlq")
    w = await start_worker(sub)
    [mid] = client.publish(topic, [b"x"])
    await eventually(lambda: w.dispatchers[sub.key].stats.acked == 1, what="acked after 12 failures")
    assert [r.headers["Pubsub-Delivery-Attempt"] for r in endpoint.by_id()[mid]] == [str(n) for n in range(1, 14)]
    assert w.dispatchers[sub.key].stats.dead_lettered == 0


async def test_max_deliver_zero_dead_letters_the_first_failure_without_retry(
        start_worker, endpoint: Endpoint, client: Client, topic):
    endpoint.behaviour = lambda rec: web.Response(status=503 if rec.body_payload == b"bad" else 204)
    dlq = topic + "-dlq"
    watcher = client.watch(dlq)
    sub = make_sub(topic, endpoint.url, max_deliver=0, dead_letter_topic=dlq)
    w = await start_worker(sub)
    [bad, good] = client.publish(topic, [b"bad", b"good"])
    [dead] = await asyncio.to_thread(Client.drain, watcher, 1)
    assert dead.properties()["pubsub.original_message_id"] == bad
    assert dead.properties()["pubsub.delivery_attempts"] == "1"
    await eventually(lambda: w.dispatchers[sub.key].stats.acked == 1, what="the good one delivered")
    assert len(endpoint.by_id()[bad]) == 1 and len(endpoint.by_id()[good]) == 1


async def test_max_concurrency_caps_requests_in_flight_below_max_ack_pending(
        start_worker, endpoint: Endpoint, client: Client, topic):
    probe = ConcurrencyProbe()
    endpoint.behaviour = probe
    sub = make_sub(topic, endpoint.url, max_ack_pending=100, max_concurrency=3)
    w = await start_worker(sub)
    client.publish(topic, [b"%d" % i for i in range(60)])
    await eventually(lambda: w.dispatchers[sub.key].stats.acked == 60, what="all delivered")
    assert probe.peak == 3  # reached, never passed


async def test_topic_deletion_stops_delivery_within_two_seconds_and_clears_state(
        start_worker, endpoint: Endpoint, client: Client, topic, redis_url):
    doomed = [{"name": f"doomed-{i}", "topic": topic, "max_deliver": 3, "ack_deadline_seconds": 5,
               "dead_letter": {"topic": topic + "-dlq"},
               "deliver": {"mode": "push", "push": {"url": endpoint.url}}} for i in range(2)]
    survivor = {**doomed[0], "name": "survivor", "topic": topic + "-kept"}
    redis = aioredis.Redis.from_url(redis_url)
    await Registry(redis, "default").apply_all([*doomed, survivor])
    w = await start_worker()
    keys = [f"p-test/doomed-{i}" for i in range(2)]
    await eventually(lambda: set(keys) <= set(w.dispatchers), what="registry subscriptions served")

    stop = threading.Event()

    def publish_steadily() -> None:
        producer = client.client.create_producer(topic, batching_enabled=False)
        while not stop.is_set():
            producer.send(b"tick")
            time.sleep(0.02)
        producer.close()

    publisher = threading.Thread(target=publish_steadily)
    publisher.start()
    try:
        await eventually(lambda: len(endpoint.requests) >= 10, what="steady delivery")
        code, out, err = await cli("subs", "delete", "--topic", topic, "--redis-url", redis_url)
        deleted_at = time.monotonic()
        assert code == 0, err
        assert sorted(out.split()) == sorted([f"{k}:" for k in keys] + ["deleted"] * 2)
        await eventually(lambda: not set(keys) & set(w.dispatchers), timeout=2, what="consumers closed in 2 s")
        cutoff = deleted_at + 2.0
        await eventually(lambda: time.monotonic() > cutoff + 1.0, what="a second past the 2 s bound")
        late = [r for r in endpoint.requests if r.at > cutoff and r.headers["Pubsub-Topic"] == topic]
        assert late == []  # nothing delivered afterwards, though messages kept coming
    finally:
        stop.set()
        await asyncio.to_thread(publisher.join)
    for key in keys:
        assert [k async for k in redis.scan_iter(match=f"pw:{{{key}}}:*")] == []
    assert topic + "-dlq" not in w.dead_letters._producers  # no subscription here uses it any more
    client.publish(topic + "-kept", [b"still here"])
    await eventually(lambda: any(r.body_payload == b"still here" for r in endpoint.requests),
                     what="the other topic's subscription unaffected")
    await redis.aclose()


async def test_partitioned_topic_keeps_per_key_order_and_the_contract(
        partitioned_broker, redis_url, start_worker, endpoint: Endpoint, partitioned_topic):
    topic = partitioned_topic
    endpoint.behaviour = lambda rec: web.Response(status=500 if rec.body_payload.endswith(b"-0") and
                                                  rec.headers["Pubsub-Delivery-Attempt"] == "1" else 204)
    keyed = make_sub(topic, endpoint.url, type="key-shared", retry=RetryPolicy(0.05, 0.1))
    w = await start_worker(keyed, broker_url=partitioned_broker.url)
    client = pulsar.Client(partitioned_broker.url, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
    try:
        producer = client.create_producer(topic, batching_enabled=False)
        for i in range(10):
            for k in range(12):
                producer.send(f"k{k}-{i}".encode(), partition_key=f"k{k}")
        partitions = client.get_topic_partitions(topic)
    finally:
        client.close()
    assert len(partitions) == 3
    await eventually(lambda: w.dispatchers[keyed.key].stats.acked == 120, timeout=30, what="all delivered")
    acked = [r for r in endpoint.requests if r.acked]
    assert {r.headers["Pubsub-Message-Id"].split(":")[2] for r in acked} == {"0", "1", "2"}  # ids carry the partition
    for k in range(12):
        seq = [int(r.body_payload.split(b"-")[1]) for r in acked if r.body_payload.startswith(b"k%d-" % k)]
        assert seq == list(range(10)), (k, seq)  # per-key order, the failed first message retried in place
    assert {r.headers["Pubsub-Topic"] for r in acked} == {topic}


@pytest.mark.parametrize("kind", ["exclusive", "failover"])
async def test_partitioned_topic_keeps_order_per_partition_and_dead_letters_with_partition_ids(
        partitioned_broker, start_worker, endpoint: Endpoint, partitioned_topic, kind):
    topic = partitioned_topic
    endpoint.behaviour = lambda rec: web.Response(status=500 if rec.body_payload == b"poison" else 204)
    dlq = topic + "-dlq"
    client = Client(partitioned_broker.url)
    try:
        watcher = client.watch(dlq)
        sub = make_sub(topic, endpoint.url, type=kind, max_deliver=2, retry=RetryPolicy(0.02, 0.05),
                       dead_letter_topic=dlq)
        w = await start_worker(sub, broker_url=partitioned_broker.url)
        producer = client.client.create_producer(topic, batching_enabled=False)
        for i in range(45):
            producer.send(b"poison" if i == 7 else b"m%d" % i, partition_key=f"k{i % 9}")
        await eventually(lambda: w.dispatchers[sub.key].stats.acked == 44, timeout=30, what="delivered")
        [dead] = await asyncio.to_thread(Client.drain, watcher, 1)
    finally:
        client.close()
    original = dead.properties()["pubsub.original_message_id"]
    assert original.split(":")[2] in {"0", "1", "2"} and dead.data() == b"poison"
    acked = [r.headers["Pubsub-Message-Id"] for r in endpoint.requests if r.acked]
    for partition in ("0", "1", "2"):
        entries = [int(m.split(":")[1]) for m in acked if m.split(":")[2] == partition]
        assert entries == sorted(entries) and entries, partition  # in order within each partition
