"""A poison message costs its own project (#58): attempt counts the worker cannot represent settle the
message loudly, a message dead-lettered unsent is dead-lettered once, and an oversize message's dead
letter is stored compressed. Real broker, Redis, worker and endpoints."""

from __future__ import annotations

import asyncio
import random

import pulsar
import pytest
import redis
from aiohttp import web

from tests.support.brokers import bytes_published
from tests.support.builders import make_sub
from tests.support.endpoints import Endpoint
from tests.support.helpers import eventually
from tests.support.pulsar_client import Client
from worker.core import keys
from worker.core.attempts import MAX_COUNT
from worker.endpoint.destinations import DestinationPolicy
from worker.model.subscriptions import RetryPolicy

# Stored counts around the edges of Lua's doubles and Redis' integers: 2^53 + 1 is the first count a
# double cannot hold, from 2^63 - 7 the attempt header went negative, 2^63 - 1 made HINCRBY fail.
UNREPRESENTABLE = [str(MAX_COUNT), str(2**53 + 1), str(2**63 - 7), str(2**63 - 1), "9" * 30, "1e20", "inf"]


@pytest.mark.parametrize("layout", [1, 2])
async def test_an_attempt_count_past_what_lua_holds_settles_the_message_loudly(
        start_worker, endpoint: Endpoint, client: Client, topic, redis_url, layout):
    """Every stored count: the attempt numbers sent are positive and never repeat; a count the worker
    cannot represent dead-letters its message as worker_error without a request (counted, logged),
    never a message stuck behind green probes; a count just below the bound goes on up to it."""
    endpoint.behaviour = lambda rec: web.Response(status=500)
    dlq = topic + "-dlq"
    watcher = client.watch(dlq)
    sub = make_sub(topic, endpoint.url, max_deliver=-1, retry=RetryPolicy(0.1, 0.1), dead_letter_topic=dlq)
    ids = client.publish(topic, [f"m{i}".encode() for i in range(len(UNREPRESENTABLE) + 1)])
    store = redis.Redis.from_url(redis_url)
    store.set(keys.layout_key(), layout)
    for mid, count in zip(ids, [*UNREPRESENTABLE, str(MAX_COUNT - 2)], strict=True):
        if layout == 1:
            store.hset(keys.message_key(sub.key, mid), mapping={"n": count, "last": "500"})
        else:
            store.set(keys.attempt_key(sub.key, mid), f"{count},0,,500")
    w = await start_worker(sub)
    letters = await asyncio.to_thread(client.drain, watcher, len(ids))
    assert sorted(m.properties()["pubsub.original_message_id"] for m in letters) == sorted(ids)
    assert {m.properties()["pubsub.last_status"] for m in letters} == {"worker_error"}
    # Only the message below the bound was tried: attempts 10^15 - 1 and 10^15, then its count is at the bound.
    assert [(r.headers["Pubsub-Message-Id"], int(r.headers["Pubsub-Delivery-Attempt"])) for r in endpoint.requests] \
        == [(ids[-1], MAX_COUNT - 1), (ids[-1], MAX_COUNT)]
    assert w.metrics.message_failures.labels(sub.tenant, sub.name)._value.get() == len(ids)
    assert w.supervisor.failing_for() == {} and (await w.readiness())[0] and w.liveness()[0]
    for mid in ids:  # settled: a redelivered copy is acked without a request
        if layout == 1:
            assert store.hget(keys.message_key(sub.key, mid), "settled") == b"1"
        else:
            assert store.get(keys.attempt_key(sub.key, mid)) == b"s"
    store.close()


async def test_an_oversize_message_is_dead_lettered_once_and_stored_compressed(
        broker, start_worker, endpoint: Endpoint, client: Client, topic):
    """Compressed messages that inflate past any request (16 MiB each, one per compression type) are
    dead-lettered unsent, each once: a copy the broker hands out again (the prefetch shrinks for them,
    and the consumer is made anew) finds the settled marker and is acked. Each dead letter is stored
    compressed: at most twice the bytes the original took in the broker."""
    dlq = topic + "-dlq"
    watcher = client.watch(dlq)
    sub = make_sub(topic, endpoint.url, dead_letter_topic=dlq, max_ack_pending=8)
    block = random.Random(58).randbytes(4096)  # compresses well with every codec, not to nothing
    payloads = {}
    for i, codec in enumerate((pulsar.CompressionType.ZLib, pulsar.CompressionType.LZ4, pulsar.CompressionType.ZSTD)):
        payload = bytes([i]) + block * (4096 - 1)  # 16 MiB - 4 KiB + 1: past the prefetch's bound, so it shrinks
        producer = client.client.create_producer(topic, batching_enabled=False, compression_type=codec)
        mid = producer.send(payload)
        payloads[f"{mid.ledger_id()}:{mid.entry_id()}:{mid.partition()}:{mid.batch_index()}"] = payload
        producer.close()
    client.publish(topic, [b"after"])
    original_bytes = bytes_published(broker, topic)
    w = await start_worker(sub, destinations=DestinationPolicy(allow_private=True, max_request_bytes=1 << 20))
    await eventually(lambda: [r.body_payload for r in endpoint.requests] == [b"after"], what="the next message")
    letters = await asyncio.to_thread(client.drain, watcher, 3)
    assert {m.properties()["pubsub.original_message_id"]: m.data() for m in letters} == payloads
    # Whatever the broker hands out again is acked as settled: no fourth letter comes.
    assert await asyncio.to_thread(client.drain, watcher, 1, 3.0) == []
    assert w.dispatchers[sub.key].stats.dead_lettered == 3
    assert bytes_published(broker, dlq) <= 2 * original_bytes, (bytes_published(broker, dlq), original_bytes)
