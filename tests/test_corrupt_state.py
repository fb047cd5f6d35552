"""Garbage in Redis: whatever a key the fleet reads holds (wrong type, invalid JSON or UTF-8, huge
values, impossible numbers), a real worker process keeps delivering its valid subscriptions and
logs what it ignored; attempt records that are corrupt start over instead of blocking delivery."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import redis as redis_sync
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.support.helpers import eventually, spawn_worker, stop_worker, wait_sync
from tests.support.pulsar_client import Client
from worker.broker.prefetch import LargestMessages
from worker.core import attempts, keys
from worker.core.attempts import AttemptStore
from worker.core.keys import fleet_key
from worker.core.redis_batch import Pipeliner
from worker.model.config import RedisSettings

FLEET = "garbage"


class Recorder(BaseHTTPRequestHandler):
    """A real endpoint on a thread (the hypothesis test below is synchronous): records payloads."""

    seen: set[bytes] = set()

    def do_POST(self) -> None:
        Recorder.seen.add(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *_: Any) -> None:
        pass


def garbage_values() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=64),  # mostly invalid UTF-8
        st.text(max_size=64).map(str.encode),
        st.sampled_from([b"not-a-number", b"-1", b"9" * 40, b"[1, 2]", b'{"name": "x"}', b"{", b"\xff\xfe",
                         b"null", b'{"topic": 5}', b"1e309"]),
        st.integers(min_value=100_000, max_value=1_000_000).map(Huge),
    )


class Huge(bytes):
    """A huge value drawn as its size: hypothesis shows (and warns about) the repr of what it draws."""

    def __new__(cls, size: int) -> Huge:
        return super().__new__(cls, b"x" * size)

    def __repr__(self) -> str:
        return f"Huge({len(self)})"


WORKER_ID = "w-garbage"
# (what to corrupt, which Redis type to put there)
TARGETS = ["members", "version", "registry", "registry-entry", "paused", "expired", "lease", "seek", "events",
           "status", "instance", "workers", "endpoint-pause", "holder", "quarantined"]
TYPES = ["string", "hash", "list", "set", "zset"]


def write(client: redis_sync.Redis, key: str, kind: str, value: bytes) -> None:
    # One transaction: a worker reading the registry between a delete and a write saw it empty (a valid
    # registry: it released the subscriptions), which is not the garbage under test.
    with client.pipeline(transaction=True) as pipe:
        pipe.delete(key)
        if kind == "string":
            pipe.set(key, value)
        elif kind == "hash":
            pipe.hset(key, value or b"f", value)
        elif kind == "list":
            pipe.rpush(key, value)
        elif kind == "set":
            pipe.sadd(key, value)
        else:
            pipe.zadd(key, {value or b"m": 1e12})
        pipe.execute()


def test_garbage_in_every_key_the_fleet_reads_never_stops_valid_subscriptions(broker, redis_url, tmp_path: Path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/push"
    static_topic = f"persistent://p-test/main/g-{uuid.uuid4().hex[:8]}"
    registry_topic = f"persistent://p-test/main/g-{uuid.uuid4().hex[:8]}"
    push = {"mode": "push", "push": {"url": url, "content": "raw"}}
    registered = {"name": "registered", "topic": registry_topic, "deliver": push, "ack_deadline_seconds": 5}
    config = tmp_path / "w.yaml"
    config.write_text(yaml.safe_dump({
        "pulsar": {"service_url": broker.url}, "redis": {"url": redis_url}, "http": {"port": 0},
        "destinations": {"allow_private": True}, "log": {"format": "json", "level": "info"},
        "fleet": {"name": FLEET, "lease_seconds": 2}, "shutdown_grace_seconds": 30,
        # max_workers 2: its width and its shared Retry-After are read every round (one worker serves it).
        "subscriptions": [{"name": "static", "topic": static_topic, "deliver": push, "ack_deadline_seconds": 5,
                           "max_workers": 2}]}))
    client = redis_sync.Redis.from_url(redis_url)
    registry_key, version_key = fleet_key(FLEET, "registry"), fleet_key(FLEET, "version")

    def restore() -> None:
        for what, kind in (("members", b"zset"), ("paused", b"set"), ("expired", b"set"), ("quarantined", b"hash")):
            if client.type(fleet_key(FLEET, what)) not in (b"none", kind):
                client.delete(fleet_key(FLEET, what))
        # One transaction, as the operator commands write: a worker reading between the delete and
        # the write saw an empty registry, then kept it while the next example made the key unreadable.
        # The version a value never used before: workers re-read the registry when the version differs
        # from the one they saw, and a counter started over at 1 could equal it.
        with client.pipeline(transaction=True) as pipe:
            pipe.delete(registry_key, version_key)
            pipe.hset(registry_key, "p-test/registered", json.dumps(registered))
            pipe.set(version_key, time.time_ns())
            pipe.execute()
        client.publish(fleet_key(FLEET, "events"), b"registry")

    restore()
    log = tmp_path / "worker.log"
    proc = spawn_worker(config, log, PUSH_WORKER_ID=WORKER_ID)
    publisher = Client(broker.url)
    sent = 0

    def delivered_through_both() -> None:
        nonlocal sent
        sent += 1
        marks = [f"static-{sent}".encode(), f"registered-{sent}".encode()]
        publisher.publish(static_topic, marks[:1])
        publisher.publish(registry_topic, marks[1:])
        wait_sync(lambda: set(marks) <= Recorder.seen, timeout=30, what=f"delivery after garbage ({marks})")
        assert proc.poll() is None, "the worker died"

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(target=st.sampled_from(TARGETS), kind=st.sampled_from(TYPES), value=garbage_values())
    @example(target="version", kind="string", value=b"not-a-number")  # once stopped all delivery silently
    @example(target="registry-entry", kind="string", value=b"\xff{")
    @example(target="members", kind="zset", value=b"ghost")
    @example(target="instance", kind="hash", value=b"not a mark")
    @example(target="workers", kind="hash", value=b"not a number")
    @example(target="endpoint-pause", kind="string", value=b"x")
    @example(target="holder", kind="string", value=b"x")
    @example(target="quarantined", kind="hash", value=b"not a record")
    @example(target="quarantined", kind="string", value=b"x")
    def corrupt_then_deliver(target: str, kind: str, value: bytes) -> None:
        if target == "registry" and kind == "hash":
            # The registry's own type: garbage beside the valid entry. A hash without that entry would be a
            # registry that deletes the subscription (released, then re-subscribed: up to the broker's
            # 30 s operation timeout on Apache Pulsar), not garbage.
            client.hset(registry_key, value[:40] or b"f", value)
            client.incr(version_key)
        elif target == "registry-entry":  # an entry of its own, next to the valid one
            client.hset(registry_key, b"p-test/" + value[:40], value)
            client.incr(version_key)
        elif target == "events":
            client.publish(fleet_key(FLEET, "events"), b"seek " + value[:1000])
            client.publish(fleet_key(FLEET, "events"), value[:1000])
        elif target == "lease":
            write(client, f"{keys.PREFIX}:{keys.tag('p-test/static')}:lease", kind, value)
        elif target == "seek":
            client.set(f"{keys.PREFIX}:{keys.tag('p-test/static')}:seek", value)
            client.publish(fleet_key(FLEET, "events"), b"seek p-test/static")
        elif target == "instance":  # the mark of the process heartbeating under the worker's id
            write(client, fleet_key(FLEET, f"instance:{WORKER_ID}"), kind, value)
        elif target == "status":
            write(client, f"{keys.PREFIX}:{keys.tag('p-test/static')}:status", kind, value)
        elif target == "workers":  # how many workers serve the (spread) static subscription
            write(client, keys.workers_key("p-test/static"), kind, value)
        elif target == "endpoint-pause":
            write(client, keys.endpoint_pause_key("p-test/static"), kind, value)
        elif target == "holder":  # who holds the static subscription's lease, and whether on trial
            write(client, keys.holder_key("p-test/static"), kind, value)
        else:
            write(client, fleet_key(FLEET, target), kind, value)
        client.publish(fleet_key(FLEET, "events"), b"registry")
        try:
            delivered_through_both()
        finally:
            restore()

    try:
        wait_sync(lambda: b"worker started" in log.read_bytes(), timeout=60, what="the worker")
        delivered_through_both()
        corrupt_then_deliver()
    finally:
        assert stop_worker(proc, 30) == 0
        publisher.close()
        server.shutdown()
        client.close()
    events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    ignored = [e for e in events if e["event"] == "ignored invalid state in Redis"]
    # A workers count that is not one is ignored (served by one worker), not a failed round.
    assert {e["what"] for e in ignored} >= {"registry entry", "fleet members", "workers"}, {e["what"] for e in ignored}
    # Garbage is ignored where it is read: no fleet round fails over it (a failing round renews the
    # leases but takes nothing on, applies no edit and, past a lease, turns /readyz red).
    assert not [e for e in events if e["event"] == "fleet tick failed"]
    failures = [e for e in events if e["event"] == "background task failed; restarting"]
    assert not failures, failures[0]["traceback"]


@pytest.mark.parametrize("layout", [1, 2])
async def test_corrupt_attempt_records_start_over_instead_of_blocking(redis_url, layout):
    client = redis_sync.Redis.from_url(redis_url)
    import redis.asyncio as aioredis

    async_client = aioredis.Redis.from_url(redis_url)
    store = AttemptStore(Pipeliner(async_client), RedisSettings(attempts_ttl_seconds=3600))
    store.set_layout(layout)
    sub = f"p-test/corrupt-{layout}"
    try:
        if layout == 1:
            client.set(keys.message_key(sub, "1:1:-1:-1"), b"\xff not a hash")  # wrong type
            client.hset(keys.message_key(sub, "1:2:-1:-1"), "n", "not-a-number")
            client.hset(keys.message_key(sub, "1:3:-1:-1"), mapping={"n": "9" * 30, "last": "x" * 10_000})
            client.hset(keys.message_key(sub, "1:4:-1:-1"), "n", "-7")
            client.hset(keys.message_key(sub, "1:5:-1:-1"), "n", "4")  # a healthy record in the same batch
        else:
            client.hset(keys.attempt_key(sub, "1:1:-1:-1"), "x", "not a string")  # wrong type
            client.set(keys.attempt_key(sub, "1:2:-1:-1"), "not-a-number")
            client.set(keys.attempt_key(sub, "1:3:-1:-1"), "9" * 30 + ",0,," + "x" * 10_000)
            client.set(keys.attempt_key(sub, "1:4:-1:-1"), "-7")
            client.set(keys.attempt_key(sub, "1:5:-1:-1"), "4,0,,503")  # a healthy record in the same batch
        client.set(keys.history_key(sub, "1:1:-1:-1"), "wrong type")
        client.set(keys.settled_key(sub), "wrong type")
        client.set(keys.log_key(sub), "wrong type")
        client.rpush(keys.log_stats_key(sub), "wrong type")
        records = [await store.begin(sub, f"1:{i}:-1:-1") for i in range(1, 6)]
        # A count of 30 digits is no count of attempts: said, never incremented (the message is settled).
        assert [(r.number, r.corrupt, r.unrepresentable) for r in records] == [
            (1, True, False), (1, True, False), (0, False, True), (1, True, False), (5, False, False)]
        assert all(len(r.last_status) <= 64 for r in records)
        await store.record(sub, "1:1:-1:-1", [{"attempt": 1, "result": "ack"}], settled=True)
        assert await attempts.is_settled(async_client, sub, "1:1:-1:-1")
        assert client.llen(keys.history_key(sub, "1:1:-1:-1")) == 1
        assert client.xlen(keys.log_key(sub)) == 1  # the delivery log started over too
        again = await store.begin(sub, "1:1:-1:-1")
        assert again.settled  # a redelivered copy of a settled message: no new attempt
        await store.close()  # the log's counts: their key of the wrong type started over too
        assert sum(int(v) for v in client.hgetall(keys.log_stats_key(sub)).values()) == 2
    finally:
        await store.pipeliner.close()
        await async_client.aclose()
        client.close()


async def test_a_largest_message_size_that_is_garbage_is_taken_as_unknown(redis_url):
    """The size that sizes a subscription's prefetch (`prefetch.LargestMessages`): anything but a
    positive integer is "not known" (the default prefetch), never an error that stops a subscribe."""
    import redis.asyncio as aioredis

    client = redis_sync.Redis.from_url(redis_url)
    async_client = aioredis.Redis.from_url(redis_url)
    largest = LargestMessages(Pipeliner(async_client), ttl_seconds=60)
    key = keys.largest_message_key("p-test/sizes")
    try:
        for garbage in (b"\xff", b"-5", b"0", b"9" * 40, b"1e9", b""):
            client.set(key, garbage)
            assert await largest.recall("p-test/sizes") == 0, garbage
        client.delete(key)
        client.hset(key, "f", "v")  # the wrong type
        assert await largest.recall("p-test/sizes") == 0
        client.delete(key)
        assert await largest.recall("p-test/sizes") == 0
        await largest.remember("p-test/sizes", 4 << 20)
        assert await largest.recall("p-test/sizes") == 4 << 20 and 0 < client.ttl(key) <= 60
    finally:
        await largest.redis.close()
        await async_client.aclose()
        client.close()


async def test_a_full_redis_is_waited_for_not_taken_for_corruption(own_redis):
    """At maxmemory (noeviction) Redis refuses writes with OOM. The store took that for a corrupt
    record: it deleted the counter (DEL is allowed when full) and started the message over at
    attempt 1, so the numbering went back and a request went out with no count behind it. Now the
    count waits for Redis, and continues where it was."""
    import redis.asyncio as aioredis

    admin = redis_sync.Redis.from_url(own_redis.url)
    async_client = aioredis.Redis.from_url(own_redis.url)
    refusals: list[int] = []
    store = AttemptStore(Pipeliner(async_client), RedisSettings(attempts_ttl_seconds=3600),
                         on_error=lambda: refusals.append(1))
    sub, message = "p-test/full", "1:7:-1:-1"
    key = keys.attempt_key(sub, message)
    try:
        admin.set(key, "3,0,,500")
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)  # full: every write is refused
        counting = asyncio.create_task(store.begin(sub, message))
        recording = asyncio.create_task(store.record(sub, message, [{"attempt": 3, "result": "500"}], settled=False))
        # each call refused at least twice: waiting, not giving up
        await eventually(lambda: len(refusals) >= 4, timeout=10, what="Redis asked again after refusals")
        assert not counting.done() and not recording.done()
        assert admin.get(key) == b"3,0,,500" and admin.exists(keys.history_key(sub, message)) == 0
        admin.config_set("maxmemory", 0)
        record = await asyncio.wait_for(counting, 10)
        await asyncio.wait_for(recording, 10)
        assert (record.number, record.corrupt) == (4, False)
        assert admin.llen(keys.history_key(sub, message)) == 1
    finally:
        admin.config_set("maxmemory", 0)
        await store.pipeliner.close()
        await async_client.aclose()
        admin.close()
