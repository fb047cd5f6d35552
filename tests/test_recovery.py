"""Crashes and restarts: a worker killed with SIGKILL, SIGTERM drain, broker and Redis restarts and freezes."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest
import yaml
from aiohttp import web

from tests.support.builders import make_sub
from tests.support.endpoints import Endpoint
from tests.support.helpers import assert_numbering_never_repeats, assert_stays, eventually, spawn_worker
from tests.support.pulsar_client import Client
from tests.support.redis_targets import ALL_REDIS, RedisTarget
from worker.endpoint.destinations import DestinationPolicy
from worker.model.subscriptions import RetryPolicy


def worker_config(path: Path, broker_url: str, redis: str | dict, topic: str, url: str, fleet: dict | None = None,
                  **sub) -> Path:
    doc: dict = {
        "pulsar": {"service_url": broker_url}, "redis": {"url": redis} if isinstance(redis, str) else redis,
        "http": {"port": 0},
        "destinations": {"allow_private": True}, "shutdown_grace_seconds": 10,
        "log": {"format": "json", "level": "info"},
        "subscriptions": [{
            "name": "crashy", "topic": topic, "type": sub.get("type", "shared"),
            "max_deliver": sub.get("max_deliver", 5),
            "ack_deadline_seconds": 5, "retry": {"min_backoff_seconds": 0.3, "max_backoff_seconds": 0.6},
            # The breaker off, as in every test not about it (tests/support/builders.push_sub says why).
            "deliver": {"mode": "push", "push": {"url": url, "breaker": "off"}},
            "dead_letter": {"topic": topic + "-dlq"},
            **({"max_ack_pending": sub["max_ack_pending"]} if "max_ack_pending" in sub else {}),
        }],
    }
    if fleet is not None:
        doc["fleet"] = fleet
    path.write_text(yaml.safe_dump(doc))
    return path


@ALL_REDIS
async def test_kill_9_then_restart_continues_attempt_numbers_and_loses_nothing(
        broker, redis_target: RedisTarget, endpoint: Endpoint, client: Client, topic, tmp_path):
    payloads = [f"m{i}".encode() for i in range(30)]
    doomed = {p for p in payloads if int(p[1:]) % 3 == 0}  # always fail: must reach the dead-letter topic
    endpoint.behaviour = lambda rec: web.Response(status=500 if rec.body_payload in doomed else 204)
    config = worker_config(tmp_path / "w.yaml", broker.url, redis_target.config, topic, endpoint.url + "?raw",
                           max_deliver=5)
    watcher = client.watch(topic + "-dlq")
    ids = client.publish(topic, payloads)
    doomed_ids = {mid for mid, p in zip(ids, payloads, strict=True) if p in doomed}

    proc = spawn_worker(config, tmp_path / "w1.log")
    try:
        # Kill mid-way: every doomed message has been tried at least twice, none exhausted yet.
        await eventually(lambda: all(len(endpoint.by_id().get(m, [])) >= 2 for m in doomed_ids), timeout=30,
                         what="two attempts of each doomed message")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        before = {m: [int(r.headers["Pubsub-Delivery-Attempt"]) for r in rs] for m, rs in endpoint.by_id().items()}
        proc = spawn_worker(config, tmp_path / "w2.log")
        dead = await asyncio.to_thread(Client.drain_originals, watcher, doomed_ids)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)

    assert {d.properties()["pubsub.original_message_id"] for d in dead} == doomed_ids
    assert all(d.properties()["pubsub.delivery_attempts"] == "5" for d in dead)
    by_id = endpoint.by_id()
    for mid in doomed_ids:
        numbers = [int(r.headers["Pubsub-Delivery-Attempt"]) for r in by_id[mid]]
        assert numbers == sorted(set(numbers)), f"{mid}: numbering went back: {numbers}"
        assert numbers[-1] <= 5
        after = numbers[len(before.get(mid, [])):]
        assert not after or after[0] > max(before.get(mid, [0])), f"{mid}: {before.get(mid)} then {after}"
    delivered = {m for m, rs in by_id.items() if m not in doomed_ids}
    assert delivered == set(ids) - doomed_ids  # every other message reached the endpoint


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
async def test_sigterm_lets_in_flight_deliveries_finish_then_exits(
        stop_signal, broker, redis_url, endpoint: Endpoint, client: Client, topic, tmp_path):
    """SIGHUP (a closed terminal) drains like SIGTERM: it used to end the worker on the spot."""
    started = asyncio.Event()
    finished: list[str] = []

    async def slow(rec):
        started.set()
        await asyncio.sleep(1.5)
        finished.append(rec.headers["Pubsub-Message-Id"])
        return web.Response(status=204)

    endpoint.behaviour = slow
    config = worker_config(tmp_path / "w.yaml", broker.url, redis_url, topic, endpoint.url)
    ids = client.publish(topic, [b"a", b"b", b"c"])
    proc = spawn_worker(config, tmp_path / "w.log")
    await asyncio.wait_for(started.wait(), 30)
    proc.send_signal(stop_signal)
    rc = await asyncio.to_thread(proc.wait, 20)
    assert rc == 0
    assert sorted(finished) == sorted(ids)  # all three were in flight and finished inside the grace
    # Acked before exit: a new worker gets nothing more.
    endpoint.behaviour = None
    proc = spawn_worker(config, tmp_path / "w2.log")
    try:
        await assert_stays(lambda: len(endpoint.requests) == 3, 2.0, "no redelivery of acked messages")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    assert len(endpoint.requests) == 3


async def test_sigterm_sends_nothing_more_of_an_ordered_subscription_than_what_is_under_way(
        broker, redis_url, endpoint: Endpoint, client: Client, topic, tmp_path):
    # Exclusive: one lane. The messages queued behind the one under way are not sent during the
    # drain: they go back to the broker, and the next worker delivers them, in order.
    started = asyncio.Event()

    async def slow(rec):
        started.set()
        await asyncio.sleep(1.5)
        return web.Response(status=204)

    endpoint.behaviour = slow
    config = worker_config(tmp_path / "w.yaml", broker.url, redis_url, topic, endpoint.url, type="exclusive")
    client.publish(topic, [b"a", b"b", b"c"])
    proc = spawn_worker(config, tmp_path / "w.log")
    await asyncio.wait_for(started.wait(), 30)
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(proc.wait, 20) == 0
    assert [r.body_payload for r in endpoint.requests] == [b"a"]
    endpoint.behaviour = None
    proc = spawn_worker(config, tmp_path / "w2.log")
    try:
        await eventually(lambda: len(endpoint.requests) >= 3, what="the rest delivered by the next worker")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    assert [r.body_payload for r in endpoint.requests] == [b"a", b"b", b"c"]


async def test_broker_restart_during_delivery_recovers_without_loss(
        own_broker, redis_url, start_worker, endpoint: Endpoint, topic):
    sub = make_sub(topic, endpoint.url)
    w = await start_worker(sub, broker_url=own_broker.url)
    c = Client(own_broker.url)
    try:
        first = c.publish(topic, [b"before-%d" % i for i in range(20)])
        await eventually(lambda: set(first) <= set(endpoint.by_id()), what="first batch")
    finally:
        c.close()
    await asyncio.to_thread(own_broker.restart)
    c = Client(own_broker.url)
    try:
        second = await asyncio.to_thread(c.publish, topic, [b"after-%d" % i for i in range(20)])
        await eventually(lambda: set(second) <= set(endpoint.by_id()), timeout=60, what="second batch")
    finally:
        c.close()
    # The endpoint has seen every request; the acks behind them may still wait for the client's
    # reconnection (an ack is counted once the broker client took it).
    await eventually(lambda: w.dispatchers[sub.key].stats.acked >= 40, timeout=30, what="all acked")


async def test_redis_restart_during_delivery_recovers_and_counts_continue(
        own_redis, start_worker, endpoint: Endpoint, client: Client, topic):
    fail_first = True
    endpoint.behaviour = lambda rec: web.Response(status=500 if fail_first else 204)
    sub = make_sub(topic, endpoint.url, max_deliver=50, retry=RetryPolicy(0.2, 0.4))
    w = await start_worker(sub, redis=own_redis.url)
    ids = client.publish(topic, [b"x%d" % i for i in range(10)])
    await eventually(lambda: all(len(endpoint.by_id().get(m, [])) >= 2 for m in ids), what="two attempts each")
    await asyncio.to_thread(own_redis.restart)
    await eventually(lambda: all(len(endpoint.by_id().get(m, [])) >= 4 for m in ids), timeout=30,
                     what="attempts after the Redis restart")
    fail_first = False
    await eventually(lambda: w.dispatchers[sub.key].stats.acked == 10, timeout=30, what="all delivered")
    assert_numbering_never_repeats(endpoint)  # persisted counts: numbering never goes back


async def _slow_204(_rec) -> web.Response:
    await asyncio.sleep(0.3)
    return web.Response(status=204)


async def test_a_frozen_broker_holds_delivery_and_the_thaw_delivers_the_rest(
        own_broker, redis_url, endpoint: Endpoint, topic, tmp_path):
    """SIGSTOP of the broker mid-stream: its connections stay open and nothing answers. The worker
    delivers what it already holds, then waits; on SIGCONT it delivers the rest and what was
    published after, and is still running."""
    endpoint.behaviour = _slow_204
    config = worker_config(tmp_path / "w.yaml", own_broker.url, redis_url, topic, endpoint.url, max_ack_pending=10)
    client = Client(own_broker.url)
    proc = spawn_worker(config, tmp_path / "w.log")
    try:
        ids = client.publish(topic, [b"m%d" % i for i in range(100)])
        await eventually(lambda: len(endpoint.requests) >= 10, what="delivering")
        own_broker.proc.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(8)  # the freeze itself (10 messages in flight, 10 prefetched)
        finally:
            own_broker.proc.send_signal(signal.SIGCONT)
        assert len(endpoint.by_id()) < len(ids)  # the freeze held delivery: what follows is the thaw's
        ids += client.publish(topic, [b"n%d" % i for i in range(20)])
        await eventually(lambda: set(ids) <= set(endpoint.by_id()), timeout=60, what="everything after the thaw")
        assert proc.poll() is None
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert_numbering_never_repeats(endpoint)


# A 10 s lease is renewed once less than about 7 s of it is left in Redis: a freeze of 4-5 s stays within it.
@pytest.mark.parametrize("lease, frozen_for", [(10.0, 3.0), (3.0, 7.0)], ids=["within-the-lease", "past-the-lease"])
async def test_a_frozen_redis_stops_every_attempt_and_the_thaw_delivers_the_rest(
        broker, own_redis, endpoint: Endpoint, client: Client, topic, tmp_path, lease: float, frozen_for: float):
    """SIGSTOP of Redis mid-stream (its connections stay open, nothing answers): once the requests
    under way have ended, no request goes out without its attempt count. Past the lease, the worker
    also loses its lease and takes the subscription again after the thaw. After SIGCONT everything
    is delivered, no attempt number repeated."""
    endpoint.behaviour = _slow_204
    config = worker_config(tmp_path / "w.yaml", broker.url, own_redis.url, topic, endpoint.url,
                           fleet={"lease_seconds": lease}, max_ack_pending=10)
    ids = client.publish(topic, [b"m%d" % i for i in range(100)])
    proc = spawn_worker(config, tmp_path / "w.log")
    try:
        await eventually(lambda: len(endpoint.requests) >= 10, what="delivering")
        own_redis.proc.send_signal(signal.SIGSTOP)
        try:
            await eventually(lambda: all(r.status is not None for r in endpoint.requests), what="under way ended")
            await asyncio.sleep(0.5)  # a count Redis answered just before the freeze may still send its request
            during = len(endpoint.requests)
            await asyncio.sleep(frozen_for)  # the rest of the freeze
            assert len(endpoint.requests) == during, "a request went out while Redis could not count it"
        finally:
            own_redis.proc.send_signal(signal.SIGCONT)
        ids += client.publish(topic, [b"n%d" % i for i in range(20)])
        await eventually(lambda: set(ids) <= set(endpoint.by_id()), timeout=60, what="everything after the thaw")
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert ("lease lost" in (tmp_path / "w.log").read_text()) is (frozen_for > lease)
    assert_numbering_never_repeats(endpoint)


async def test_connect_time_check_refuses_private_addresses(start_worker, endpoint: Endpoint, client, topic):
    """A name that resolves to loopback is refused when connecting, not only when loaded."""
    port = endpoint.url.split(":")[2].split("/")[0]
    sub = make_sub(topic, f"http://localhost:{port}/push", max_deliver=2)
    w = await start_worker(sub, destinations=DestinationPolicy(allow_private=False))
    client.publish(topic, [b"x"])
    await eventually(lambda: w.dispatchers[sub.key].stats.dropped == 1, what="refused then dropped")
    assert endpoint.requests == []
