"""The delivery log's bounds: a subscription's stream keeps at most `redis.delivery_log_attempts`
entries and none older than `redis.delivery_log_seconds`, and its hourly counts drop the hours the
window has left (real Redis; the search itself is tested through the API, tests/test_operator_api.py)."""

from __future__ import annotations

import asyncio
import time

import redis as redis_sync
import redis.asyncio as aioredis

from tests.support.helpers import eventually
from worker.core import attempts, keys
from worker.core.attempts import AttemptStore
from worker.core.redis_batch import Pipeliner
from worker.model.config import RedisSettings
from worker.ops import delivery_log
from worker.ops.delivery_log import LogQuery

SUB = "p-test/logged"


def attempt(n: int, status: str = "204") -> dict:
    return {"at_ms": int(time.time() * 1000), "attempt": 1, "result": "ack" if status == "204" else "nack",
            "status": status, "latency_ms": 3.0 + n % 50, "worker": "w0",
            "request_headers": {"Pubsub-Message-Id": f"1:{n}:-1:-1"}, "response_headers": {"server": "t"}}


async def test_the_log_keeps_the_newest_attempts_up_to_its_count_and_drops_what_is_older_than_its_window(redis_url):
    client = redis_sync.Redis.from_url(redis_url)
    async_client = aioredis.Redis.from_url(redis_url)
    # A window of two hours: a test that runs across an hour's end still finds its counts.
    settings = RedisSettings(delivery_log_attempts=1000, delivery_log_seconds=7200)
    store = AttemptStore(Pipeliner(async_client), settings)
    now_ms = int(time.time() * 1000)
    hour = now_ms // 3_600_000
    try:
        # What an earlier day left: entries three hours old, and the counts of their hour.
        for i in range(50):
            client.xadd(keys.log_key(SUB), {"message_id": f"old-{i}"}, id=f"{now_ms - 3 * 3_600_000}-{i + 1}")
        client.hset(keys.log_stats_key(SUB), mapping={f"{hour - 5}:2xx": 50, f"{hour - 5}:l1": 50, "hour": hour - 5})
        for n in range(1500):
            await store.record(SUB, f"1:{n}:-1:-1", [attempt(n, "503" if n % 10 == 0 else "204")], settled=n % 10 != 0,
                               lazy=n % 2 == 0)
        await store.close()  # the hourly counts are summed in the worker: added now (else within a second)
        await eventually(lambda: client.xlen(keys.log_key(SUB)) <= 1100, what="the log trimmed to its count")
        length = client.xlen(keys.log_key(SUB))
        # MAXLEN ~ trims whole stream nodes (100 entries each): never below the bound, at most a node above.
        assert 1000 <= length <= 1100, length
        kept = [delivery_log.entry_of(i, fields) for i, fields in client.xrange(keys.log_key(SUB))]
        assert not any(e["message_id"].startswith("old-") for e in kept)  # older than the window
        assert kept[-1]["message_id"] == "1:1499:-1:-1" and kept[-1]["response_headers"] == {"server": "t"}
        assert 0 < client.ttl(keys.log_key(SUB)) <= 7200
        stats = client.hgetall(keys.log_stats_key(SUB))
        assert not any(field.startswith(f"{hour - 5}:".encode()) for field in stats)
        hours = await delivery_log.hourly(async_client, SUB, 7200)
        assert len(hours) == 2 and sum(h["attempts"] for h in hours) == 1500
        assert sum(h["by_class"].get("5xx", 0) for h in hours) == 150
        # A search reads at most SCAN_BUDGET entries a call, and says where to go on.
        rare = await delivery_log.search(async_client, SUB, LogQuery(message_id="1:600:-1:-1", limit=5), 7200)
        assert [e["message_id"] for e in rare["entries"]] == ["1:600:-1:-1"] and rare["scanned"] == length
    finally:
        await store.pipeliner.close()
        await async_client.aclose()
        client.close()


async def test_an_attempt_costs_the_log_about_600_bytes_with_the_usual_headers(redis_url):
    """docs/sizing.md's figure: an acked attempt with a dozen request headers and three answered
    ones, as a worker writes it, in Redis's own count (MEMORY USAGE of the stream per entry)."""
    client = redis_sync.Redis.from_url(redis_url)
    async_client = aioredis.Redis.from_url(redis_url)
    store = AttemptStore(Pipeliner(async_client), RedisSettings())
    sent = {"Content-Type": "application/json", "Pubsub-Subscription": "orders",
            "Pubsub-Topic": "persistent://p-demo/main/orders", "Pubsub-Publish-Time": "2026-12-06T11:00:00.123Z",
            "Pubsub-Delivery-Attempt": "1", "Authorization": "[redacted]", "webhook-id": "msg_2Lk5",
            "webhook-timestamp": "1765018800", "webhook-signature": "[redacted]", "Pubsub-Ordering-Key": "c-7"}
    answered = {"content-length": "0", "date": "Sun, 06 Dec 2026 11:00:00 GMT", "server": "nginx"}
    try:
        for start in range(0, 5000, 500):  # a worker's moments: many records at once, none awaited alone
            await asyncio.gather(*(store.record(SUB, f"123:{n}:-1:-1", [{
                **attempt(n), "worker": "push-worker-7d9f5c-x2k4q",
                "request_headers": {**sent, "Pubsub-Message-Id": f"123:{n}:-1:-1"}, "response_headers": answered}],
                settled=True, acked_first_time=True, lazy=n % 100 != 0) for n in range(start, start + 500)))
        await eventually(lambda: client.xlen(keys.log_key(SUB)) == 5000, what="all logged")
        per_entry = client.memory_usage(keys.log_key(SUB), samples=0) / 5000
        assert 450 <= per_entry <= 750, per_entry
    finally:
        await store.pipeliner.close()
        await async_client.aclose()
        client.close()


async def test_no_log_is_kept_with_delivery_log_attempts_0(redis_url):
    """`redis.delivery_log_attempts: 0` turns the log off: attempts are recorded as before, nothing
    else (what `make bench` compares the log's cost with)."""
    client = redis_sync.Redis.from_url(redis_url)
    async_client = aioredis.Redis.from_url(redis_url)
    store = AttemptStore(Pipeliner(async_client), RedisSettings(delivery_log_attempts=0))
    try:
        await store.record(SUB, "1:1:-1:-1", [attempt(1)], settled=True)
        assert await attempts.is_settled(async_client, SUB, "1:1:-1:-1")
        assert not client.exists(keys.log_key(SUB), keys.log_stats_key(SUB))
    finally:
        await store.pipeliner.close()
        await async_client.aclose()
        client.close()


async def test_the_hourly_counts_reach_redis_within_a_second_without_a_command_a_message(redis_url):
    """The counts behind the charts are summed in the worker and added by one script call a second
    (log_upkeep.py): a burst of attempts costs no HINCRBY of its own, and nothing waits for a close."""
    client = redis_sync.Redis.from_url(redis_url)
    async_client = aioredis.Redis.from_url(redis_url)
    store = AttemptStore(Pipeliner(async_client), RedisSettings())
    sub = "p-test/counted"
    try:
        client.config_resetstat()
        await asyncio.gather(*(store.record(sub, f"2:{n}:-1:-1", [attempt(n)], settled=True, acked_first_time=True)
                               for n in range(200)))
        assert client.info("commandstats").get("cmdstat_hincrby", {}).get("calls", 0) == 0
        await eventually(lambda: sum(int(v) for f, v in client.hgetall(keys.log_stats_key(sub)).items()
                                     if f.endswith(b":2xx")) == 200, timeout=5, what="the counts added")
        assert client.info("commandstats")["cmdstat_hincrby"]["calls"] <= 2 * 50  # one per field, not per attempt
        assert client.ttl(keys.log_stats_key(sub)) > 0 and client.ttl(keys.log_key(sub)) > 0
    finally:
        await store.close()
        await store.pipeliner.close()
        await async_client.aclose()
        client.close()
