"""The operator's commands on a subscription's messages: queue, history, discard, purge, and seek
(by the worker serving it, by the command alone, during fleet rounds and pauses, on partitions)."""

from __future__ import annotations

import asyncio
import json
import time

import redis.asyncio as aioredis
from aiohttp import web

from tests.support.builders import push_sub, worker_yaml
from tests.support.endpoints import Endpoint
from tests.support.helpers import cli, eventually
from tests.support.pulsar_client import Client
from worker.core import keys
from worker.fleet import leases, seek
from worker.fleet.quarantine import ACQUIRE_HOLDING
from worker.fleet.seek import SEEK_COMMAND, SeekTarget
from worker.model.config import RedisSettings
from worker.model.subscriptions import Subscription

# -- CLI: queue, history, discard, purge --------------------------------------------------------------

async def test_queue_history_discard_and_purge(start_worker, endpoint: Endpoint, client: Client, topic,
                                               redis_url, broker, tmp_path):
    mode = {"fail": {b"retry-me"}, "all_fail": False}
    # The slow message stays in flight until the test has looked at it (a fixed 3 s delay raced the
    # CLI processes the checks start, and lost on a busy machine).
    release_slow = asyncio.Event()

    async def behave(rec):
        if rec.body_payload == b"slow":
            await release_slow.wait()
        failing = mode["all_fail"] or rec.body_payload in mode["fail"]
        return web.Response(status=500 if failing else 204)

    endpoint.behaviour = behave
    config, settings = worker_yaml(tmp_path, broker.url, redis_url, push_sub(
        "ops-cli", topic, endpoint.url, max_deliver=-1, dead_letter={"topic": topic + "-dlq"},
        retry={"min_backoff_seconds": 0.3, "max_backoff_seconds": 0.3},
        ack_deadline_seconds=120))  # the slow one's attempt lasts until the test releases it
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
    release_slow.set()
    code, out, _ = await cli("queue", sub.name, "--state", "dead", *args)
    assert code == 0 and json.loads(out)["messages"] == []

    code, out, err = await cli("discard", sub.name, retry_me, *args)
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
        record = keys.attempt_key(sub.key, ok)
        kept = await r.get(record)
        code, out, err = await cli("discard", sub.name, ok, *args)
        assert code == 0 and json.loads(out)["result"] == "already_settled", err
        assert 0 < await r.ttl(record) <= RedisSettings().settled_ttl_seconds
        assert await r.get(record) == kept == b"1"  # a first attempt's record, acked: unmarked
        # A message the subscription's state does not know (never tried, or settled long ago): exit 3,
        # and nothing is written (it answered "will be discarded" and left a record for a week).
        unknown = "999:0:-1:-1"
        code, _, err = await cli("discard", sub.name, unknown, *args)
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
                # What a worker runs:
                assert await client.eval(ACQUIRE_HOLDING, 2, lease, keys.holder_key("p-test/alone"), "w1", 10_000,
                                         "instance", 60_000) == [0]
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
