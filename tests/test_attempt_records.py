"""Layout 2's attempt records (worker/core/attempt_records.py) on a real Redis: what a message costs,
what a redelivered copy finds, and the switch from layout 1 (docs/upgrading.md#redis-layout)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis as redis_sync
import redis.asyncio as aioredis

from tests.support.helpers import eventually
from worker.core import attempts, keys
from worker.core.attempts import AttemptStore
from worker.core.redis_batch import Pipeliner
from worker.model.config import RedisSettings

SUB = "p-test/records"


def entry(n: int, status: str = "204") -> dict:
    return {"at_ms": int(time.time() * 1000), "attempt": n, "result": "ack" if status == "204" else "nack",
            "status": status, "latency_ms": 2.0, "worker": "w0"}


@pytest.fixture
async def records(redis_url):
    """A Redis client for looking, and an attempt store on its own connection (closed after)."""
    client = redis_sync.Redis.from_url(redis_url)
    async_client = aioredis.Redis.from_url(redis_url)
    store = AttemptStore(Pipeliner(async_client), RedisSettings())
    yield client, async_client, store
    await store.close()
    await store.pipeliner.close()
    await async_client.aclose()
    client.close()


def calls(client: redis_sync.Redis) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in client.info("commandstats").items()
            if k not in ("cmdstat_info", "cmdstat_config", "cmdstat_hello", "cmdstat_client", "cmdstat_ping")}


async def test_a_message_acked_at_its_first_attempt_costs_about_two_commands_and_its_copy_is_not_sent_again(
        records):
    """The common case, measured by Redis itself: 200 messages counted, then acked at their first
    attempt, as one moment's batch. Each costs one SET and one XADD of its own; what they share (one
    script call, one HSET into the five-minute bucket, one LPUSH) is paid once. A redelivered copy
    (its ack lost in a crash) finds the record and the bucket: settled, no attempt numbered."""
    client, async_client, store = records
    ids = [f"7:{n}:-1:-1" for n in range(200)]
    client.config_resetstat()
    begun = await store.begin_all(SUB, ids)
    assert [r.number for r in begun] == [1] * 200
    await store.record_all(SUB, [(m, [entry(1)], True) for m in ids], settled=True)
    counted = calls(client)
    assert counted.get("set") == 200 and counted.get("xadd") == 200, counted
    assert sum(counted.values()) <= 2 * 200 + 20, counted  # about two a message (and a first EVAL each)
    assert not client.exists(keys.history_key(SUB, ids[0]))  # its history is kept in the bucket
    again = await store.begin(SUB, ids[0])
    assert again.settled and again.number == 1
    assert await attempts.is_settled(async_client, SUB, ids[0])
    shown = list(await attempts.stored_history(async_client, SUB, ids[0]))
    assert len(shown) == 1 and b'"status":"204"' in shown[0]


async def test_a_message_retried_once_costs_13_commands_and_each_further_attempt_8(records):
    """docs/sizing.md's formula for retried messages: a message that takes k >= 2 attempts costs
    8k - 3 commands (its share of the script calls aside), measured by Redis over 100 messages."""
    client, _async_client, store = records
    for k in (2, 3):
        ids = [f"11:{k}{n:03d}:-1:-1" for n in range(100)]
        client.config_resetstat()
        for attempt in range(1, k + 1):
            await store.begin_all(SUB, ids)
            last = attempt == k
            await store.record_all(SUB, [(m, [entry(attempt, "204" if last else "503")], False) for m in ids],
                                   settled=last, last_status="" if last else "503")
        counted = calls(client)
        scripts = counted.pop("evalsha", 0) + counted.pop("eval", 0)
        per_message = sum(counted.values()) / 100  # a settled list's LPUSH and EXPIRE a call: +0.02
        assert 8 * k - 3 <= per_message <= 8 * k - 3 + 0.05, (k, counted)
        assert scripts <= 2 * k + 2  # one call per kind and moment, not per message


async def test_a_first_attempt_cut_by_a_crash_is_numbered_2_when_redelivered_and_a_retry_goes_on_from_its_count(
        records):
    client, _async_client, store = records
    assert (await store.begin(SUB, "8:1:-1:-1")).number == 1  # then the worker dies: nothing recorded
    redelivered = await store.begin(SUB, "8:1:-1:-1")
    assert (redelivered.number, redelivered.settled) == (2, False)
    await store.record(SUB, "8:1:-1:-1", [entry(2, "503")], settled=False, last_status="503")
    assert client.get(keys.attempt_key(SUB, "8:1:-1:-1")) == b"2,0,,503"
    assert client.ttl(keys.attempt_key(SUB, "8:1:-1:-1")) > RedisSettings().settled_ttl_seconds  # kept for retries
    third = await store.begin(SUB, "8:1:-1:-1")
    assert (third.number, third.last_status) == (3, "503")
    await store.record(SUB, "8:1:-1:-1", [entry(3)], settled=True)
    assert client.get(keys.attempt_key(SUB, "8:1:-1:-1")) == b"s"
    assert (await store.begin(SUB, "8:1:-1:-1")).settled
    assert client.llen(keys.history_key(SUB, "8:1:-1:-1")) == 2  # a retried message keeps its list


async def test_after_the_switch_a_message_counted_in_layout_1_goes_on_from_its_count(records):
    """Beside layout 2, layout 1's records are read until `attempts_ttl_seconds` after the switch: a
    message counted 3 times and one settled before it are neither numbered back nor sent again."""
    client, _async_client, store = records
    client.hset(keys.message_key(SUB, "9:1:-1:-1"), mapping={"n": 3, "last": "503"})
    client.hset(keys.message_key(SUB, "9:2:-1:-1"), mapping={"n": 1, "settled": 1})
    store.set_layout(2, layout_1_until=time.time() + 3600)
    counted = await store.begin_all(SUB, ["9:1:-1:-1", "9:2:-1:-1", "9:3:-1:-1"])
    assert [(r.number, r.settled) for r in counted] == [(4, False), (1, True), (1, False)]
    store.set_layout(2)  # the window over: layout 1's records are no longer read
    assert (await store.begin(SUB, "9:4:-1:-1")).number == 1
    assert client.get(keys.attempt_key(SUB, "9:1:-1:-1")) == b"4,0,,503"


async def test_while_a_switch_is_under_way_no_attempt_is_counted(redis_url):
    async_client = aioredis.Redis.from_url(redis_url)
    store = AttemptStore(Pipeliner(async_client), RedisSettings())
    try:
        store.set_layout(1, switching=True)
        waiting = asyncio.ensure_future(store.begin(SUB, "10:1:-1:-1"))
        await asyncio.sleep(0.05)  # a moment in which it could have been counted
        assert not waiting.done()
        store.set_layout(2)
        await eventually(lambda: waiting.done(), what="counted once the switch is through")
        assert waiting.result().number == 1
        assert await async_client.get(keys.attempt_key(SUB, "10:1:-1:-1")) == b"1"
    finally:
        await store.close()
        await store.pipeliner.close()
        await async_client.aclose()


async def test_the_bucket_of_acked_messages_gets_its_ttl_even_when_redis_refused_the_first_write(own_redis):
    """The bucket's TTL is sent once a process and bucket: a call Redis refused (full) must not use
    that once up, or the retried write makes a bucket that never expires."""
    admin = redis_sync.Redis.from_url(own_redis.url)
    async_client = aioredis.Redis.from_url(own_redis.url)
    refusals: list[int] = []
    store = AttemptStore(Pipeliner(async_client), RedisSettings(), on_error=lambda: refusals.append(1))
    try:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)  # full: every write is refused
        recording = asyncio.ensure_future(store.record(SUB, "12:1:-1:-1", [entry(1)], settled=True,
                                                       acked_first_time=True))
        await eventually(lambda: len(refusals) >= 2, timeout=10, what="the write refused and tried again")
        admin.config_set("maxmemory", 0)
        await asyncio.wait_for(recording, 10)
        [bucket] = admin.keys(f"pw:{{{SUB}}}:acked:*")
        assert admin.ttl(bucket) > 0
    finally:
        admin.config_set("maxmemory", 0)
        await store.close()
        await store.pipeliner.close()
        await async_client.aclose()
        admin.close()
