"""Platform parity: retry semantics (-1 / 0), max_concurrency, topic deletion, partitioned topics."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import pulsar
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from structlog.testing import capture_logs

from devtools import apache_pulsar
from tests import brokers
from tests.conftest import Client, Endpoint, make_settings, make_sub, serve
from tests.helpers import cli, eventually, push_sub, worker_yaml
from worker import broker_admin, keys
from worker.backlog import BacklogReader
from worker.config import FleetSettings, PulsarSettings, RedisSettings
from worker.consumer import quiet_logger
from worker.errors import ConfigError
from worker.fleet import leases, seek
from worker.fleet.registry import Registry
from worker.fleet.seek import SEEK_COMMAND, SeekTarget
from worker.service import Worker
from worker.subscriptions import RetryPolicy, Subscription


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
    in_flight, peak = 0, 0

    async def slow(rec):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.05)
        in_flight -= 1
        return web.Response(status=204)

    endpoint.behaviour = slow
    sub = make_sub(topic, endpoint.url, max_ack_pending=100, max_concurrency=3)
    w = await start_worker(sub)
    client.publish(topic, [b"%d" % i for i in range(60)])
    await eventually(lambda: w.dispatchers[sub.key].stats.acked == 60, what="all delivered")
    assert peak == 3  # reached, never passed


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


# -- lifecycle: seek, Error, Expired ---------------------------------------------------------------

def state_of(w, sub_key: str) -> str | None:
    project, name = sub_key.split("/", 1)
    for metric in w.metrics.registry.collect():
        if metric.name == "pushworker_subscription_state":
            for sample in metric.samples:
                if sample.labels["project"] == project and sample.labels["subscription"] == name and sample.value:
                    return str(sample.labels["state"])
    return None


async def test_seek_redelivers_from_the_chosen_time_with_fresh_attempt_counts(
        start_worker, endpoint: Endpoint, client: Client, topic, redis_url, broker, tmp_path):
    stuck = True
    endpoint.behaviour = lambda rec: web.Response(status=500 if stuck and rec.body_payload == b"stuck" else 204)
    config, settings = worker_yaml(tmp_path, broker.url, redis_url, push_sub(
        "rewind-me", topic, endpoint.url, max_deliver=-1, retry={"min_backoff_seconds": 0.2,
                                                                 "max_backoff_seconds": 0.2}))
    [sub] = settings.subscriptions
    w = await start_worker(sub)
    early = client.publish(topic, [b"early-%d" % i for i in range(3)])
    await eventually(lambda: set(early) <= set(endpoint.by_id()), what="early batch delivered")
    mark_ms = int(time.time() * 1000) + 50
    await eventually(lambda: time.time() * 1000 > mark_ms + 50, what="clock past the mark")
    late = client.publish(topic, [b"late-%d" % i for i in range(3)] + [b"stuck"])
    await eventually(lambda: len(endpoint.by_id().get(late[-1], [])) >= 3, what="stuck message retried")
    assert state_of(w, sub.key) == "Active"

    before = len(endpoint.requests)
    code, out, err = await cli("subs", "seek", sub.name, "--to", str(mark_ms), "--config", config, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["by"] == "w0" and result["attempt_counters_reset"] >= 1
    stuck = False
    await eventually(lambda: set(late) <= {r.headers["Pubsub-Message-Id"] for r in endpoint.requests[before:]
                                           if r.acked}, what="the late batch delivered again")
    again = endpoint.requests[before:]
    assert not set(early) & {r.headers["Pubsub-Message-Id"] for r in again}  # only from the chosen time
    for mid in late:  # counts start again: the stuck one was at 3 or more before the seek
        assert "1" in [r.headers["Pubsub-Delivery-Attempt"] for r in again if r.headers["Pubsub-Message-Id"] == mid]

    # Paused: nobody holds it, so the command moves the cursor itself; resume delivers from there.
    assert (await cli("subs", "pause", sub.name, "--config", config))[0] == 0
    before = len(endpoint.requests)
    code, out, err = await cli("subs", "seek", sub.name, "--to-earliest", "--config", config)
    assert code == 0 and "this command" in out, err
    assert (await cli("subs", "resume", sub.name, "--config", config))[0] == 0
    await eventually(lambda: set(early + late) <= {r.headers["Pubsub-Message-Id"] for r in endpoint.requests[before:]},
                     what="everything again from the earliest")

    code, _, err = await cli("subs", "seek", sub.name, "--to", "yesterday", "--config", config)
    assert code == 2 and "--to" in err

    # A time still to come skips the backlog as --to-latest does (pulsar-lite refused it outright).
    code, out, err = await cli("subs", "seek", sub.name, "--to", "9999-12-31T23:59:59Z", "--config", config)
    assert code == 0, err
    before = len(endpoint.requests)
    [after] = client.publish(topic, [b"after"])
    await eventually(lambda: after in endpoint.by_id(), what="a message published after the seek delivered")
    assert {r.headers["Pubsub-Message-Id"] for r in endpoint.requests[before:]} == {after}


async def test_a_failing_endpoint_puts_the_subscription_in_error_and_recovery_clears_it(
        start_worker, endpoint: Endpoint, client: Client, topic):
    healthy = False
    endpoint.behaviour = lambda rec: web.Response(status=204 if healthy else 502)
    sub = make_sub(topic, endpoint.url, max_deliver=-1, retry=RetryPolicy(0.05, 0.1))
    w = await start_worker(sub, fleet=FleetSettings(error_after_seconds=1.0))
    client.publish(topic, [b"x"])
    await eventually(lambda: state_of(w, sub.key) == "Error", what="Error after 1 s of failures")
    assert "endpoint failing" in w.dispatchers[sub.key].state_reason and "502" in w.dispatchers[sub.key].state_reason
    healthy = True
    await eventually(lambda: state_of(w, sub.key) == "Active", what="Active again")


async def test_a_subscription_the_broker_refuses_shows_why_and_is_served_once_it_may(
        broker, start_worker, endpoint: Endpoint, client: Client, topic, redis_url):
    """Another consumer holds the exclusive subscription: the broker refuses the worker's. `subs list`
    gives the broker's answer as the reason (it showed Starting with no reason, for good), and once
    the other consumer goes, the worker serves it and the reason is gone."""
    definition = {"name": "refused", "topic": topic, "type": "exclusive",
                  "deliver": {"mode": "push", "push": {"url": endpoint.url}}}
    squatter = client.client.subscribe(topic, "refused", consumer_type=pulsar.ConsumerType.Exclusive)
    redis = aioredis.Redis.from_url(redis_url)
    await Registry(redis, "default").apply(definition)
    await redis.aclose()
    # pulsar-lite does not answer the second consumer (Apache Pulsar answers ConsumerBusy): the
    # subscribe ends at the operation timeout.
    w = await start_worker(pulsar=PulsarSettings(service_url=broker.url, operation_timeout_seconds=3),
                           fleet=FleetSettings(heartbeat_seconds=0.2))

    async def listed_until(check: Callable[[dict], bool], what: str) -> None:
        deadline = time.monotonic() + 20
        while True:
            code, out, err = await cli("subs", "list", "--redis-url", redis_url, "--json")
            assert code == 0, err
            [row] = [r for r in json.loads(out) if r["name"] == "refused"]
            if check(row):
                return
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {row}"
            await asyncio.sleep(0.2)

    said = ("subscribe failing: no answer from the broker (Timeout)" if brokers.is_pulsar_lite(broker)
            else "subscribe failing: the broker answered ConsumerBusy")
    await listed_until(lambda r: r["state"] == "Starting" and r["reason"] == said, "the refusal shown as the reason")
    assert "p-test/refused" not in w.dispatchers
    squatter.close()
    [mid] = client.publish(topic, [b"after"])
    await eventually(lambda: mid in endpoint.by_id(), timeout=30, what="delivery once the subscription is free")
    await listed_until(lambda r: r["state"] == "Active" and r["reason"] == "", "Active with no reason")


async def test_a_registry_entry_named_like_a_config_subscription_never_takes_its_place(
        start_worker, endpoint: Endpoint, client: Client, topic, redis_url):
    """The registry is written on behalf of projects; the config file by the operator. An entry with a
    config subscription's key is Invalid (docs/security.md): the config's definition (JSON bodies)
    keeps serving, never the registry's (raw bodies)."""
    sub = make_sub(topic, endpoint.url)
    w = await start_worker(sub, fleet=FleetSettings(heartbeat_seconds=0.2))

    async def delivered_as(payload: bytes) -> str:
        [mid] = client.publish(topic, [payload])
        await eventually(lambda: mid in endpoint.by_id(), what=f"delivery of {payload!r}")
        return endpoint.by_id()[mid][0].headers["Content-Type"]

    assert await delivered_as(b"config") == "application/json"
    redis = aioredis.Redis.from_url(redis_url)
    shadow = {"name": sub.name, "topic": topic, "deliver": {"mode": "push", "push": {"url": endpoint.url,
                                                                                      "content": "raw"}}}
    with pytest.raises(ConfigError, match="is a subscription of the workers' config file"):
        await Registry(redis, "default", static=[sub.key]).apply(shadow)  # what `subs apply --config` says
    await Registry(redis, "default").apply(shadow)  # without the config, the worker is the one to refuse it
    await eventually(lambda: any(sub.key in detail and "config file" in detail for _, detail in w.fleet._ignored),
                     what="the shadowing entry refused")
    assert await delivered_as(b"registry") == "application/json"
    assert w.dispatchers[sub.key].sub == sub
    await redis.aclose()


@pytest.mark.apache_pulsar
async def test_a_refused_unsubscribe_still_closes_the_consumer_and_is_logged(
        broker, start_worker, endpoint: Endpoint, client: Client, topic):
    """Apache Pulsar refuses to delete a subscription another consumer is attached to (an expiry while
    a frozen worker's consumer is still there). The worker's own consumer used to stay open then,
    holding its prefetched messages, with nothing logged; now it is closed and the refusal logged.
    (pulsar-lite deletes the subscription anyway.)"""
    sub = make_sub(topic, endpoint.url)
    w = await start_worker(sub, pulsar=PulsarSettings(service_url=broker.url, operation_timeout_seconds=5))
    other = client.client.subscribe(topic, sub.pulsar_subscription, consumer_type=pulsar.ConsumerType.Shared,
                                    consumer_name="someone-else")
    try:
        with capture_logs() as logged:
            await w.served.remove(sub.key, grace=0, unsubscribe=True)
        assert any(e["event"].startswith("broker subscription not deleted") for e in logged), logged
        async with aiohttp.ClientSession() as session:
            entry = await broker_admin.subscription_stats(session, brokers.admin_url(broker), sub)
        assert entry is not None  # still there: the broker refused
        assert [c["consumerName"] for c in entry["consumers"]] == ["someone-else"]
    finally:
        other.close()


@pytest.mark.apache_pulsar
async def test_a_command_the_broker_refuses_says_so_and_not_to_check_its_url(broker):
    """Apache Pulsar creates no tenant on first use: `publish` to one that does not exist said `the
    broker failed (Pulsar error: TopicNotFound); check --service-url ...`, though the broker had
    answered at that URL."""
    code, _, err = await cli("publish", "persistent://p-nosuch-tenant/main/t", "x", "--service-url", broker.url)
    assert code == 1 and err.strip() == ("push-worker: the broker refused: TopicNotFound (the topic, or its tenant "
                                         "or namespace, does not exist: Apache Pulsar creates none of them on first "
                                         "use)"), err


@pytest.mark.apache_pulsar
async def test_a_dead_letter_topic_that_refuses_publishes_is_said_counted_and_waited_for(
        start_worker, endpoint: Endpoint, client: Client, topic):
    """An exclusive producer holds the dead-letter topic, so Apache Pulsar refuses the worker's
    (ProducerBusy; the same silence came from a dead-letter namespace that does not exist). The
    worker retried without a word: no log line of its own, no metric, the subscription Active with
    no reason, exhausted messages piling up unacked, and a shutdown that waited its whole grace for
    them. Now it logs, counts and says why, a stop releases the message at once, and the next owner
    dead-letters it without another request once the topic takes publishes. (pulsar-lite accepts a
    second producer beside an exclusive one.)"""
    endpoint.behaviour = lambda rec: web.Response(status=500)
    dlq = topic + "-dlq"
    squatter = client.client.create_producer(dlq, access_mode=pulsar.ProducerAccessMode.Exclusive)
    sub = make_sub(topic, endpoint.url, max_deliver=1, dead_letter_topic=dlq)

    async def refused_by(w: Any) -> Any:
        dispatcher = w.dispatchers[sub.key]
        await eventually(lambda: "dead-letter publish failing" in dispatcher.state_reason, timeout=30,
                         what="the refusal given as the subscription's reason")
        assert "ProducerBusy" in dispatcher.state_reason and dispatcher.unsettled == 1
        return dispatcher

    with capture_logs() as logged:
        first = await start_worker(sub, shutdown_grace_seconds=30)
        [mid] = client.publish(topic, [b"exhausted"])
        await refused_by(first)
    failing = [e for e in logged if e["event"].startswith("dead-letter publish failing")]
    assert failing and failing[0]["dead_letter_topic"] == dlq and "ProducerBusy" in failing[0]["error"]
    assert first.metrics.registry.get_sample_value("pushworker_broker_errors_total",
                                                   {"operation": "dead_letter"}) >= 1
    began = time.monotonic()
    await first.close()
    assert time.monotonic() - began < 10, "the stop waited out its grace for a dead-letter publish"

    dispatcher = await refused_by(await start_worker(sub))  # the message again, its attempts spent
    watcher = client.watch(dlq)
    squatter.close()
    [dead] = await asyncio.to_thread(Client.drain, watcher, 1)
    assert dead.properties()["pubsub.original_message_id"] == mid
    assert dead.properties()["pubsub.delivery_attempts"] == "1"
    assert dead.properties()["pubsub.last_status"] == "500"  # the first owner's attempt, not "unknown"
    assert len(endpoint.by_id()[mid]) == 1  # no request after the attempts were spent
    await eventually(lambda: dispatcher.state_reason == "" and dispatcher.unsettled == 0,
                     what="the reason gone once the dead letter is confirmed")


async def test_a_backlog_over_the_threshold_for_long_enough_expires_the_subscription(
        broker, start_worker, endpoint: Endpoint, client: Client, topic, redis_url):
    endpoint.behaviour = lambda rec: web.Response(status=500)
    definition = {"name": "expiring", "topic": topic, "max_deliver": -1, "max_ack_pending": 1,
                  "retry": {"min_backoff_seconds": 1, "max_backoff_seconds": 1},
                  "deliver": {"mode": "push", "push": {"url": endpoint.url}}}
    redis = aioredis.Redis.from_url(redis_url)
    await Registry(redis, "default").apply(definition)
    w = await start_worker(pulsar=PulsarSettings(service_url=broker.url, metrics_url=broker.metrics_url,
                                                 backlog_interval_seconds=0.5),
                           fleet=FleetSettings(expire_backlog=5, expire_after_seconds=1.0))
    key = "p-test/expiring"
    client.publish(topic, [b"%d" % i for i in range(20)])
    await eventually(lambda: state_of(w, key) == "Expired", timeout=45, what="Expired")
    # The state is reported in the fleet round that starts the hand-over; the dispatcher goes when
    # that task runs, a turn of the loop later (asserted at once, a CI run caught it in between).
    await eventually(lambda: key not in w.dispatchers, timeout=10, what="its dispatcher stopped")
    code, out, _ = await cli("subs", "list", "--redis-url", redis_url, "--json")
    assert [r["state"] for r in json.loads(out) if r["name"] == "expiring"] == ["Expired"]
    for args in (("subs", "pause", "expiring"),
                 ("subs", "seek", "expiring", "--to-latest", "--service-url", broker.url)):
        code, _, err = await cli(*args, "--redis-url", redis_url)
        assert code == 2 and "Expired: only deletion is allowed" in err, err
    code, _, err = await cli("subs", "apply", "-f", "-", "--redis-url", redis_url, stdin=json.dumps(definition))
    assert code == 2 and "Expired: only deletion is allowed" in err, err
    code, out, err = await cli("subs", "delete", "expiring", "--redis-url", redis_url)
    assert code == 0, err
    await eventually(lambda: state_of(w, key) is None, what="state metric gone after deletion")
    await redis.aclose()


# -- CLI: queue, history, discard, purge --------------------------------------------------------------

async def test_queue_history_discard_and_purge(start_worker, endpoint: Endpoint, client: Client, topic,
                                               redis_url, broker, tmp_path):
    mode = {"fail": {b"retry-me"}, "all_fail": False}

    async def behave(rec):
        if rec.body_payload == b"slow":
            await asyncio.sleep(3)
        failing = mode["all_fail"] or rec.body_payload in mode["fail"]
        return web.Response(status=500 if failing else 204)

    endpoint.behaviour = behave
    config, settings = worker_yaml(tmp_path, broker.url, redis_url, push_sub(
        "ops-cli", topic, endpoint.url, max_deliver=-1, dead_letter={"topic": topic + "-dlq"},
        retry={"min_backoff_seconds": 0.3, "max_backoff_seconds": 0.3}))
    [sub] = settings.subscriptions
    w = await start_worker(sub)
    [ok, retry_me, slow] = client.publish(topic, [b"ok", b"retry-me", b"slow"])
    await eventually(lambda: len(endpoint.by_id().get(retry_me, [])) >= 2 and slow in endpoint.by_id()
                     and ok in endpoint.by_id(), what="one delivered, one retrying, one in flight")
    args = ("--config", config, "--json")

    code, out, err = await cli("queue", sub.name, "--state", "retrying", *args)
    assert code == 0, err
    [retrying] = json.loads(out)["messages"]
    assert retrying["message_id"] == retry_me and retrying["last_status"] == "500" and retrying["attempts"] >= 2
    code, out, _ = await cli("queue", sub.name, "--state", "inflight", *args)
    assert [m["message_id"] for m in json.loads(out)["messages"]] == [slow]
    code, out, _ = await cli("queue", sub.name, "--state", "dead", *args)
    assert code == 0 and json.loads(out)["messages"] == []

    code, out, err = await cli("discard", retry_me, "--subscription", sub.name, *args)
    assert code == 0 and json.loads(out)["result"] == "discarded", err
    attempts_at_discard = len(endpoint.by_id()[retry_me])
    await eventually(lambda: w.dispatchers[sub.key].stats.acked >= 2, what="slow one delivered")
    code, out, _ = await cli("history", sub.name, *args)
    settled = {m["message_id"]: m.get("result") or m.get("event") for m in json.loads(out)["messages"]}
    assert settled == {ok: "ack", retry_me: "discarded", slow: "ack"}
    code, out, _ = await cli("history", sub.name, "--config", config)
    assert "delivered" in out and "discarded" in out
    # Discarding a message settled already changes nothing: its settled marker keeps its TTL (it once
    # said "discarded" of a delivered message and kept the marker for a week).
    r = aioredis.Redis.from_url(redis_url)
    try:
        code, out, err = await cli("discard", ok, "--subscription", sub.name, *args)
        assert code == 0 and json.loads(out)["result"] == "already_settled", err
        assert 0 < await r.ttl(keys.message_key(sub.key, ok)) <= RedisSettings().settled_ttl_seconds
        assert await r.hget(keys.message_key(sub.key, ok), "discard") is None
        # A message the subscription's state does not know (never tried, or settled long ago): exit 3,
        # and nothing is written (it answered "will be discarded" and left a record for a week).
        unknown = "999:0:-1:-1"
        code, _, err = await cli("discard", unknown, "--subscription", sub.name, *args)
        assert code == 3 and f"no message {unknown} known" in err, err
        assert not await r.exists(keys.message_key(sub.key, unknown))
    finally:
        await r.aclose()

    mode["all_fail"] = True
    backlog = client.publish(topic, [b"backlog-%d" % i for i in range(5)])
    await eventually(lambda: all(b in endpoint.by_id() for b in backlog), what="backlog attempted")
    code, _, err = await cli("purge", sub.name, "--config", config)  # not a terminal, no --yes
    assert code == 2 and "--yes" in err
    code, out, err = await cli("purge", sub.name, "--yes", "--config", config)
    assert code == 0 and "purged" in out, err
    purged_at = len(endpoint.requests)
    mode["all_fail"] = False
    await only_new_messages_come(client, topic, endpoint, backlog, since=purged_at)
    assert len(endpoint.by_id()[retry_me]) == attempts_at_discard  # discarded: never tried again


async def only_new_messages_come(client: Client, topic: str, endpoint: Endpoint, purged: list[str], since: int,
                                 keys_: tuple[str | None, ...] = (None,)) -> list[str]:
    """After a purge: a message published now (one per key in `keys_`) is delivered, and none of
    `purged` is (within a second, several retry periods: one not purged would show up). Returns
    the new messages' ids."""
    after = [mid for key in keys_ for mid in client.publish(topic, [b"after"], key=key)]
    await eventually(lambda: set(after) <= set(endpoint.by_id()), what="messages after the purge delivered")
    settle = time.monotonic() + 1.0
    await eventually(lambda: time.monotonic() > settle, what="settle")
    assert not set(purged) & {r.headers["Pubsub-Message-Id"] for r in endpoint.requests[since:]}
    return after


def failing_until_told(endpoint: Endpoint) -> dict[str, bool]:
    """The endpoint answers 500 until `switch["failing"]` is set False, then 204."""
    switch = {"failing": True}
    endpoint.behaviour = lambda rec: web.Response(status=500 if switch["failing"] else 204)
    return switch


def retrying_without_end(tmp_path, broker_url: str, redis_url: str, name: str, topic: str,
                         endpoint: Endpoint) -> tuple[str, Subscription]:
    """A config file with one subscription retrying every 0.2 s without a limit, and that subscription."""
    config, settings = worker_yaml(tmp_path, broker_url, redis_url, push_sub(
        name, topic, endpoint.url, max_deliver=-1, retry={"min_backoff_seconds": 0.2, "max_backoff_seconds": 0.2}))
    [sub] = settings.subscriptions
    return config, sub


async def test_a_fleet_round_during_a_purge_starts_no_consumer_before_the_cursor_moved(
        start_worker, endpoint: Endpoint, client: Client, topic, redis_url, broker, tmp_path, monkeypatch):
    switch = failing_until_told(endpoint)
    config, sub = retrying_without_end(tmp_path, broker.url, redis_url, "purge-race", topic, endpoint)
    w = await start_worker(sub)
    backlog = client.publish(topic, [b"backlog-%d" % i for i in range(5)])
    await eventually(lambda: all(len(endpoint.by_id().get(m, [])) >= 2 for m in backlog), what="backlog retrying")

    seek_with_own_consumer = seek.seek_with_own_consumer
    served_while_seeking: list[bool] = []

    async def seek_after_a_fleet_round(pulsar_client, seek_sub, target):
        # The fleet's rounds come on a timer of their own, so at any moment of a seek: here, right
        # before the cursor moves (the round once started a consumer there, which kept the backlog).
        assert w.fleet is not None
        await w.fleet.tick()
        served_while_seeking.append(await w.served.started(sub.key) is not None)
        await seek_with_own_consumer(pulsar_client, seek_sub, target)

    monkeypatch.setattr(seek, "seek_with_own_consumer", seek_after_a_fleet_round)
    code, out, err = await cli("purge", sub.name, "--yes", "--config", config)
    assert code == 0 and "purged" in out, err
    assert served_while_seeking == [False]
    purged_at = len(endpoint.requests)
    switch["failing"] = False
    await only_new_messages_come(client, topic, endpoint, backlog, since=purged_at)


async def test_a_subscription_paused_during_its_seek_is_not_served_when_the_seek_ends(
        start_worker, endpoint: Endpoint, topic, redis_url, broker, tmp_path, monkeypatch):
    config, sub = retrying_without_end(tmp_path, broker.url, redis_url, "pause-mid-seek", topic, endpoint)
    w = await start_worker(sub)
    seek_with_own_consumer = seek.seek_with_own_consumer

    async def seek_while_an_operator_pauses(pulsar_client, seek_sub, target):
        code, _, err = await cli("subs", "pause", sub.name, "--config", config)  # returns once the lease is released
        assert code == 0, err
        await seek_with_own_consumer(pulsar_client, seek_sub, target)

    monkeypatch.setattr(seek, "seek_with_own_consumer", seek_while_an_operator_pauses)
    await w.served.seek(sub.key, SeekTarget("latest"))  # what the owner runs for `subs seek` and `purge`
    assert sub.key not in w.served.serving  # it ran on after the pause until a fleet round stopped it


async def test_a_command_seeking_alone_holds_the_lease_so_no_worker_starts_meanwhile(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    lease = keys.lease_key("p-test/alone")
    try:
        async with leases.hold(client, "p-test/alone", "seek-command-1", ttl_seconds=0.3) as held:
            assert held
            until = time.monotonic() + 1.0  # over three times the lease's time to live: it is renewed
            while time.monotonic() < until:
                assert await client.eval(leases.ACQUIRE, 1, lease, "w1", 10_000) == 0  # what a worker runs
                await asyncio.sleep(0.05)
            async with leases.hold(client, "p-test/alone", "seek-command-2", ttl_seconds=1) as second:
                assert not second
            assert await client.get(lease) == b"seek-command-1"
        assert await client.get(lease) is None  # released at once, not left to expire
    finally:
        await client.aclose()


async def test_a_seek_command_waits_for_another_one_instead_of_asking_it_as_a_worker(
        endpoint: Endpoint, topic, redis_url, broker, tmp_path):
    config, sub = retrying_without_end(tmp_path, broker.url, redis_url, "two-seeks", topic, endpoint)
    client = aioredis.Redis.from_url(redis_url)
    try:
        async with leases.hold(client, sub.key, SEEK_COMMAND + "first", ttl_seconds=10):
            second = asyncio.ensure_future(cli("subs", "seek", sub.name, "--to-latest", "--config", config))
            settle = time.monotonic() + 1.0
            await eventually(lambda: time.monotonic() > settle, what="settle")
            assert not second.done() and not await client.exists(keys.seek_key(sub.key))  # no request to a "worker"
        code, out, err = await second
        assert code == 0 and "this command" in out, err
    finally:
        await client.aclose()


async def test_purge_and_seek_move_every_partition_of_a_partitioned_topic(
        partitioned_broker, redis_url, start_worker, endpoint: Endpoint, partitioned_topic, tmp_path):
    topic = partitioned_topic
    switch = failing_until_told(endpoint)
    config, sub = retrying_without_end(tmp_path, partitioned_broker.url, redis_url, "purge-parts", topic, endpoint)
    await start_worker(sub, broker_url=partitioned_broker.url)
    client = Client(partitioned_broker.url)
    try:
        old = [mid for i in range(9) for mid in client.publish(topic, [b"old-%d" % i], key=f"k{i}")]
        assert {mid.split(":")[2] for mid in old} == {"0", "1", "2"}  # every partition has some
        await eventually(lambda: all(len(endpoint.by_id().get(m, [])) >= 2 for m in old), what="all retrying")
        code, out, err = await cli("purge", sub.name, "--yes", "--config", config)
        assert code == 0 and "purged" in out, err
        purged_at = len(endpoint.requests)
        switch["failing"] = False
        after = await only_new_messages_come(client, topic, endpoint, old, since=purged_at,
                                             keys_=tuple(f"k{i}" for i in range(9)))

        # Paused, the command seeks with consumers of its own: every partition goes back to the start.
        assert (await cli("subs", "pause", sub.name, "--config", config))[0] == 0
        before = len(endpoint.requests)
        code, out, err = await cli("subs", "seek", sub.name, "--to-earliest", "--config", config)
        assert code == 0 and "this command" in out, err
        assert (await cli("subs", "resume", sub.name, "--config", config))[0] == 0
        await eventually(lambda: set(old + after) <= {r.headers["Pubsub-Message-Id"]
                                                      for r in endpoint.requests[before:] if r.acked},
                         what="everything again from the earliest, on every partition")
    finally:
        client.client.close()


@pytest.mark.apache_pulsar
async def test_a_message_over_the_brokers_size_limit_is_delivered_whole_and_dead_lettered_whole(
        broker, start_worker, endpoint: Endpoint, client: Client, topic):
    """A producer with chunking on splits a message over the broker's limit (5 MB) into chunks; the
    consumer joins them. The worker delivered such a message whole, but its dead-letter producer had
    no chunking: the republish was refused (MessageTooBig) and retried for ever, the original never
    settled. (pulsar-lite's dispatch of chunked messages sometimes stalls the message after one, so
    this runs on Apache Pulsar only.)"""
    big = bytes(range(256)) * (1024 * 26)  # 6.5 MiB: two chunks
    ok_sub = make_sub(topic, endpoint.url, name="whole", content="raw")
    dlq = topic + "-dlq"
    failing = make_sub(topic, endpoint.url + "/fail", name="fails", content="raw", max_deliver=1,
                       dead_letter_topic=dlq)
    endpoint.behaviour = lambda rec: web.Response(status=500 if rec.headers["Pubsub-Subscription"] == "fails" else 204)
    watcher = client.watch(dlq)
    await start_worker(ok_sub, failing)
    producer = client.client.create_producer(topic, batching_enabled=False, chunking_enabled=True)
    producer.send(big, properties={"kind": "large"})
    producer.close()
    dead = await asyncio.to_thread(Client.drain, watcher, 1, 60)
    assert len(dead) == 1 and dead[0].data() == big
    assert dead[0].properties()["pubsub.last_status"] == "500"
    whole = [r for r in endpoint.requests if r.headers["Pubsub-Subscription"] == "whole"]
    assert [r.body == big for r in whole] == [True]
    async with aiohttp.ClientSession() as session:
        for sub in (ok_sub, failing):  # every chunk acked, not only the last
            async def backlog(s: Subscription = sub) -> Any:
                entry = await broker_admin.subscription_stats(session, brokers.admin_url(broker), s)
                return (entry or {}).get("msgBacklog")
            deadline = time.monotonic() + 30
            while await backlog() != 0:
                assert time.monotonic() < deadline, f"{sub.name}: backlog {await backlog()}"
                await asyncio.sleep(0.5)


SECRET = b"push-worker-test-secret-of-32-bytes!"
FORGED = b"another-secret-of-32-bytes-long!!!"  # signs tokens the secured broker cannot verify


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, certificate) -> Iterator[apache_pulsar.ApachePulsar]:
    """An Apache Pulsar as production clusters run it: token authentication and authorization, TLS
    with a private CA beside the plain ports. Role `worker` may consume and produce in p-test/main."""
    broker = apache_pulsar.start(tmp_path_factory.mktemp("secured"), token_secret=SECRET, tls=certificate)
    try:
        apache_pulsar.ensure_namespace(broker.admin_url, "p-test", token=broker.admin_token)
        status, _ = apache_pulsar.admin_request(broker.admin_url, "POST",
                                                "/admin/v2/namespaces/p-test/main/permissions/worker",
                                                ["consume", "produce"], token=broker.admin_token)
        assert status == 204
        yield broker
    finally:
        broker.stop()


def publish_as_admin(broker: apache_pulsar.ApachePulsar, topic: str, count: int) -> None:
    client = pulsar.Client(broker.url, authentication=pulsar.AuthenticationToken(broker.admin_token),
                           logger=quiet_logger())
    try:
        producer = client.create_producer(topic, batching_enabled=False)
        for i in range(count):
            producer.send(b"m%d" % i)
    finally:
        client.close()


def backlog_of(w: Any, sub: Subscription) -> Any:
    return w.metrics.registry.get_sample_value("pushworker_subscription_backlog",
                                               {"project": sub.tenant, "subscription": sub.name})


@pytest.mark.apache_pulsar
async def test_a_broker_that_wants_tokens_gets_the_workers_token_on_its_admin_api_too(
        secured, start_worker, endpoint: Endpoint, topic):
    """Production clusters authenticate: the worker sent its token on the binary protocol but not to
    the admin API, whose 401 read as "no such topic": no backlog metric (nothing for the HPA), no
    expiry, no word in the log. Now the token goes with the admin calls too, and a refusal (here: the
    role may consume but not unload a topic, to evict a stale consumer) is logged with the broker's
    reason and counted. The worker's admin URL here is a broker that does not own the topic: it
    redirects (307) to the one that does, as Apache Pulsar's brokers do in a cluster; the redirect
    was not followed, the reading lost the same silent way."""
    redirected: list[str] = []

    async def not_the_owner(request: web.Request) -> web.StreamResponse:
        redirected.append(request.headers.get("Authorization", ""))
        raise web.HTTPTemporaryRedirect(secured.admin_url + request.path_qs)

    runner, url = await serve("/{tail:.*}", not_the_owner, method="*")
    other_broker = url.removesuffix("/push")
    endpoint.behaviour = lambda rec: web.Response(status=503)
    sub = make_sub(topic, endpoint.url, max_deliver=100, retry=RetryPolicy(30, 30))
    admin_client = pulsar.Client(secured.url, authentication=pulsar.AuthenticationToken(secured.admin_token),
                                 logger=quiet_logger())
    stale = admin_client.subscribe(topic, sub.pulsar_subscription, consumer_type=pulsar.ConsumerType.Shared,
                                   consumer_name="someone-else", receiver_queue_size=1)
    try:
        worker_token = apache_pulsar.token(SECRET, "worker")
        settings = PulsarSettings(service_url=secured.url, admin_url=other_broker, backlog_interval_seconds=0.5,
                                  auth_token=worker_token)
        with capture_logs() as logged:
            w = await start_worker(sub, pulsar=settings)
            publish_as_admin(secured, topic, 5)
            await eventually(lambda: backlog_of(w, sub) == 5, timeout=30, what="the backlog read with the token")
        refused = [e for e in logged if e["event"] == "stale consumer check failed"]
        assert refused and "refused the token" in refused[0]["error"], logged
        assert "UNLOAD" in refused[0]["error"] and "admin of their tenants" in refused[0]["error"]
        assert w.metrics.registry.get_sample_value("pushworker_broker_errors_total", {"operation": "admin"}) == 1
        assert not [e for e in logged if e["event"] == "backlog read failed"]
        assert redirected and set(redirected) == {f"Bearer {worker_token}"}
    finally:
        stale.close()
        admin_client.close()
        await runner.cleanup()


@pytest.mark.apache_pulsar
async def test_a_broker_behind_a_private_ca_is_trusted_on_both_its_protocols(
        secured, certificate, start_worker, endpoint: Endpoint, topic):
    """`pulsar.tls_trust_certs_file` was the binary protocol's trust only: the admin API over https,
    signed by the same private CA, failed verification at every backlog read (logged with the
    error's type only). Now it is trusted there too, as Pulsar's own admin client does; and the
    binary protocol over TLS, with the host name checked, is proven on Apache Pulsar."""
    endpoint.behaviour = lambda rec: web.Response(status=503)
    sub = make_sub(topic, endpoint.url, max_deliver=100, retry=RetryPolicy(30, 30))
    settings = PulsarSettings(service_url=secured.tls_url, tls_trust_certs_file=str(certificate[0]),
                              admin_url=secured.tls_admin_url, backlog_interval_seconds=0.5,
                              auth_token=apache_pulsar.token(SECRET, "worker"))
    with capture_logs() as logged:
        w = await start_worker(sub, pulsar=settings)
        publish_as_admin(secured, topic, 4)
        await eventually(lambda: backlog_of(w, sub) == 4 and len(endpoint.requests) >= 4, timeout=30,
                         what="deliveries over TLS and the backlog read over https")
    assert not [e for e in logged if e["event"] == "backlog read failed"], logged


@pytest.mark.apache_pulsar
async def test_a_metrics_endpoint_that_wants_tokens_gets_the_workers(secured, start_worker, endpoint: Endpoint, topic):
    """With `authenticateMetricsEndpoint`, the broker's /metrics/ answers 401 without a token: the
    backlog read from `pulsar.metrics_url` failed at every interval, logged as a bare
    ClientResponseError. The worker's token goes there too now."""
    endpoint.behaviour = lambda rec: web.Response(status=503)
    sub = make_sub(topic, endpoint.url, max_deliver=100, retry=RetryPolicy(30, 30))
    settings = PulsarSettings(service_url=secured.url, metrics_url=secured.admin_url + "/metrics/",
                              backlog_interval_seconds=0.5, auth_token=apache_pulsar.token(SECRET, "worker"))
    with capture_logs() as logged:
        w = await start_worker(sub, pulsar=settings)
        publish_as_admin(secured, topic, 3)
        await eventually(lambda: backlog_of(w, sub) == 3, timeout=30, what="the backlog read from /metrics/")
    assert not [e for e in logged if e["event"] == "backlog read failed"], logged
    session = broker_admin.make_session()  # without the token: said as what to set
    forged = broker_admin.make_session(token=apache_pulsar.token(FORGED, "worker"))
    try:
        with pytest.raises(broker_admin.AdminError, match=r"wants a token \(set PUSH_WORKER_PULSAR_TOKEN"):
            await BacklogReader(session, None, secured.admin_url + "/metrics/").read([sub])
        # A token the broker cannot verify: any verified token may read /metrics/, so no role advice.
        # The reason is the title of the broker's HTML error page, on the log line's one line.
        with pytest.raises(broker_admin.AdminError, match=r"^pulsar.metrics_url refused the token \(HTTP 401: "
                           r"Error 401 Authentication required\); the broker does not accept it"):
            await BacklogReader(forged, None, secured.admin_url + "/metrics/").read([sub])
    finally:
        await session.close()
        await forged.close()


@pytest.mark.apache_pulsar
async def test_readiness_names_the_token_when_an_authenticating_broker_does_not_answer(
        secured, redis_target, endpoint: Endpoint, topic):
    """Apache Pulsar drops a connection whose token it refuses, unanswered: the client sees the same
    timeout as from a dead broker. /readyz said "broker unreachable" only; with a token configured
    it names the token too, the one thing that may be wrong on a broker that is up."""
    forged = apache_pulsar.token(FORGED, "worker")
    settings = make_settings(secured.url, redis_target.settings, (make_sub(topic, endpoint.url),),
                             pulsar=PulsarSettings(service_url=secured.url, auth_token=forged,
                                                   operation_timeout_seconds=5))
    w = Worker(settings, worker_id="w-forged")
    try:
        await w.start()
        deadline = time.monotonic() + 30
        while (reason := (await w.readiness())[1]) != "broker unreachable or refusing PUSH_WORKER_PULSAR_TOKEN":
            assert time.monotonic() < deadline, reason
            await asyncio.sleep(0.2)
    finally:
        await w.close()


@pytest.mark.apache_pulsar
async def test_publish_uses_the_workers_token_and_tls_trust(secured, certificate, tmp_path, topic):
    """`push-worker publish` built a client of its own with neither `PUSH_WORKER_PULSAR_TOKEN` nor
    `pulsar.tls_trust_certs_file`: on a cluster that authenticates it timed out ("no answer from the
    broker"), and over TLS with a private CA it could not connect."""
    token = {"PUSH_WORKER_PULSAR_TOKEN": apache_pulsar.token(SECRET, "worker")}
    code, out, err = await cli("publish", topic, "plain", "--service-url", secured.url, extra_env=token)
    assert code == 0 and out.strip(), err
    config = tmp_path / "w.yaml"
    config.write_text(json.dumps({"pulsar": {"service_url": secured.tls_url,
                                             "tls_trust_certs_file": str(certificate[0])}}))
    code, out, err = await cli("publish", topic, "over tls", "-c", str(config), extra_env=token)
    assert code == 0 and out.strip(), err
    # Without a token the broker drops the connection unanswered: the one line says what to check.
    code, _, err = await cli("publish", topic, "no token", "--service-url", secured.url)
    assert code == 1 and len(err.strip().splitlines()) == 1 and "$PUSH_WORKER_PULSAR_TOKEN" in err, err
