"""One project cannot crash the worker that serves everyone: a message is bounded before it is
expanded, a failure of one message settles that message and never counts toward the worker's
health, retrying forever keeps working at any attempt number, and per-message log lines are
rate-limited. Real broker, Redis, worker and endpoints (the settle-alone test drives the
dispatcher with an in-memory consumer: its logic is what is under test)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import pulsar
import pytest
import redis
import redis.asyncio as aioredis
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from tests.support.builders import make_sub, push_sub, worker_yaml
from tests.support.endpoints import Endpoint
from tests.support.helpers import cli, eventually
from tests.support.pulsar_client import Client
from tests.support.redis_targets import ALL_REDIS, RedisTarget
from worker.broker.consumer import make_client
from worker.broker.deadletter import DeadLetterPublisher
from worker.core import keys
from worker.core.attempts import AttemptStore
from worker.core.backoff import MIN_BACKOFF_SECONDS, retry_delay
from worker.core.delivery import Deliverer
from worker.core.dispatcher import DeliveryContext, Dispatcher
from worker.core.messages import Envelope
from worker.core.metrics import Metrics
from worker.core.redis_batch import Pipeliner
from worker.endpoint.destinations import DestinationPolicy
from worker.model.config import PulsarSettings, RedisSettings
from worker.model.subscriptions import RetryPolicy
from worker.runtime.logs import Throttled
from worker.state import redis_client


@settings(max_examples=500, deadline=None)
@given(attempt=st.integers(min_value=0, max_value=10**9),
       lo=st.floats(min_value=0, max_value=3600), span=st.floats(min_value=0, max_value=3600),
       retry_after=st.one_of(st.none(), st.floats(min_value=0, max_value=1e12)))
def test_the_retry_delay_is_bounded_for_any_attempt_number(attempt, lo, span, retry_after):
    """`max_deliver: -1` raised OverflowError from attempt 1,025 on (2 ** 1024 as a float), on every
    redelivery, on every owner in turn."""
    policy = RetryPolicy(lo, min(3600.0, lo + span))
    delay = retry_delay(policy, attempt, retry_after)
    assert MIN_BACKOFF_SECONDS <= delay <= max(policy.max_backoff_seconds, MIN_BACKOFF_SECONDS)


async def test_retrying_forever_goes_on_past_attempt_1024(start_worker, endpoint: Endpoint, client: Client,
                                                          topic, redis_url):
    endpoint.behaviour = lambda rec: web.Response(status=500)
    sub = make_sub(topic, endpoint.url, max_deliver=-1, retry=RetryPolicy(0.1, 0.1))
    [mid] = client.publish(topic, [b"forever"])
    # The message has been tried 1,023 times already (its count is in Redis, as after 8-17 hours down).
    redis.Redis.from_url(redis_url).set(keys.attempt_key(sub.key, mid), "1023,0,,500")
    w = await start_worker(sub)
    await eventually(lambda: len(endpoint.requests) >= 4, what="attempts 1,024 to 1,027")
    numbers = [int(r.headers["Pubsub-Delivery-Attempt"]) for r in endpoint.requests]
    assert numbers[:4] == [1024, 1025, 1026, 1027]
    assert w.supervisor.failing_for() == {} and (await w.readiness())[0] and w.liveness()[0]


class Handed:
    """An in-memory consumer handing out given messages once each; records acks and nacks."""

    def __init__(self, messages: list[object]) -> None:
        self.messages = list(messages)
        self.acked: list[object] = []
        self.nacked: list[object] = []

    async def receive(self) -> object:
        if not self.messages:
            await asyncio.Event().wait()
        return self.messages.pop(0)

    def receive_ready(self) -> object | None:
        return self.messages.pop(0) if self.messages else None

    async def acknowledge(self, message: object) -> None:
        self.acked.append(message)

    async def negative_acknowledge(self, message: object) -> None:
        self.nacked.append(message)

    async def close(self) -> None:
        pass


async def test_a_message_whose_handling_raises_is_settled_alone(redis_url, broker, endpoint: Endpoint, topic,
                                                                client: Client):
    """A bug that belongs to one message (here: an envelope no request can be built from) dead-letters
    that message with the reason (or, without a dead-letter topic, hands it back to the broker);
    the other messages are delivered, and nothing counts toward the worker's health."""
    dlq = topic + "-dlq"
    watcher = client.watch(dlq)

    def envelope(m: object) -> Envelope:
        mid = str(m)
        published = 10**20 if mid.startswith("bad") else 0  # no date: no request can be built
        return Envelope(mid + ":0:-1:-1", mid.encode(), topic, published)

    rclient = aioredis.Redis.from_url(redis_url)
    pipeliner = Pipeliner(rclient)
    pulsar_client = make_client(PulsarSettings(), broker.url)
    deliverer = Deliverer(DestinationPolicy(allow_private=True))
    dispatchers = []
    try:
        for dead_letter_topic in (dlq, None):
            consumer = Handed(["1", "bad2", "3"])
            ctx = DeliveryContext(deliverer, AttemptStore(pipeliner, RedisSettings(attempts_ttl_seconds=3600)),
                                  DeadLetterPublisher(pulsar_client), Metrics())
            sub = make_sub(topic, endpoint.url, dead_letter_topic=dead_letter_topic)
            dispatcher = Dispatcher(sub, consumer, envelope, ctx)
            dispatchers.append(dispatcher)
            with capture_logs() as logged:
                dispatcher.start()
                if dead_letter_topic:
                    await eventually(lambda c=consumer: sorted(c.acked) == ["1", "3", "bad2"], what="all settled")
                    [letter] = await asyncio.to_thread(client.drain, watcher, 1)
                    assert letter.data() == b"bad2"
                    assert letter.properties()["pubsub.last_status"] == "worker_error"
                else:
                    await eventually(lambda c=consumer: sorted(c.acked) == ["1", "3"] and c.nacked == ["bad2"],
                                     what="delivered, and the failing one handed back")
            assert any(e["event"].startswith("handling a message failed") and "worker_error" in e["error"]
                       for e in logged), logged
            assert ctx.metrics.message_failures.labels(sub.tenant, sub.name)._value.get() == 1
            assert ctx.supervisor.failing_for() == {}  # nothing toward readiness or liveness
        assert sorted(r.body_payload for r in endpoint.requests) == [b"1", b"1", b"3", b"3"]
    finally:
        for dispatcher in dispatchers:
            await dispatcher.stop(grace=1)
        await pipeliner.close()
        await rclient.aclose()
        await deliverer.close()
        await pulsar_client.close()


async def test_a_compressed_message_that_inflates_past_the_limit_is_dead_lettered_unsent(
        start_worker, endpoint: Endpoint, client: Client, topic):
    """A few bytes of zstd that inflate to 3 MiB, with a 1 MiB request limit: dead-lettered as
    payload_too_large before any request is built, its payload whole in the dead letter (under the
    broker's message size, so it is not chunked); the next message is delivered."""
    dlq = topic + "-dlq"
    watcher = client.watch(dlq)
    sub = make_sub(topic, endpoint.url, dead_letter_topic=dlq, max_ack_pending=4)
    w = await start_worker(sub, destinations=DestinationPolicy(allow_private=True, max_request_bytes=1 << 20))
    producer = client.client.create_producer(topic, batching_enabled=False,
                                             compression_type=pulsar.CompressionType.ZSTD)
    bomb = bytes(3 << 20)
    producer.send(bomb)
    producer.send(b"fine")
    producer.close()
    await eventually(lambda: [r.body_payload for r in endpoint.requests] == [b"fine"], what="the next message")
    [letter] = await asyncio.to_thread(client.drain, watcher, 1)
    assert letter.properties()["pubsub.last_status"] == "payload_too_large" and letter.data() == bomb
    # 3 MiB in hand: the subscription moves to a connection of its own meanwhile (its dispatcher is
    # replaced, its counters carried over).
    await eventually(lambda: sub.key in w.dispatchers and w.dispatchers[sub.key].stats.dead_lettered == 1,
                     what="counted")
    assert w.metrics.deliveries.labels(sub.tenant, sub.name, "payload_too_large")._value.get() == 0  # never tried


def test_per_message_log_lines_are_rate_limited_and_say_how_many_were_left_out():
    lines: list[tuple[str, dict[str, object]]] = []
    suppressed: list[int] = []

    class Sink:
        def info(self, event: str, **fields: object) -> None:
            lines.append((event, fields))

    log = Throttled(Sink(), lambda: suppressed.append(1), rate=0.0, burst=5)
    for i in range(1000):
        log.info("delivery failed", attempt=i)
    assert len(lines) == 5 and len(suppressed) == 995
    log._buckets["delivery failed"][0] = 1.0  # a token back, as time would give it
    log.info("delivery failed", attempt=1000)
    assert lines[-1][1] == {"attempt": 1000, "suppressed": 995}
    log.info("dead-lettered")  # each kind has its own budget
    assert lines[-1][0] == "dead-lettered"


async def test_operator_output_is_inert(redis_url, broker, client: Client, topic, tmp_path):
    """Payloads, keys and forged `pubsub.*` properties with terminal escapes print as escapes: an
    operator's `dlq list` / `dlq show` cannot be retitled, cleared or fed forged lines."""
    dlq = topic + "-dlq"
    config, _ = worker_yaml(tmp_path, broker.url, redis_url,
                            push_sub("inert", topic, "https://push.example/h", dead_letter={"topic": dlq}))
    evil = "\x1b]0;owned\x07\x1b[2J\nforged: line \u202eevil\u2066 \u200b\u2028"  # bidi and invisible too
    producer = client.client.create_producer(dlq, batching_enabled=False)
    producer.send(f"payload {evil}".encode(), properties={
        "pubsub.original_message_id": f"1:2:-1:-1{evil}", "pubsub.last_status": evil, "x": evil,
        "pubsub.subscription": "inert", "pubsub.original_topic": topic}, partition_key=evil)
    producer.close()
    code, listed, err = await cli("dlq", "list", "inert", "--config", config)
    assert code == 0 and "1 dead letter(s)" in listed, err
    code, out, err = await cli("dlq", "list", "inert", "--config", config, "--json")
    [letter] = json.loads(out)["messages"]
    code, shown, err = await cli("dlq", "show", "inert", letter["dead_letter_id"], "--config", config)
    assert code == 0, err
    for out in (listed, shown):
        assert not any(c in out for c in "\x1b\x07\x9b\u202e\u2066\u200b\u2028") and "\\x1b]0;owned\\x07" in out
        assert "\\u202eevil\\u2066 \\u200b\\u2028" in out
    assert "\nforged: line" not in shown and "\\x0aforged: line" in shown


async def test_registry_fields_of_any_shape_are_shown_invalid_and_break_no_command(redis_url, tmp_path):
    """A field without `/` made every command that takes a bare name fail with IndexError for every
    project; a field named with bidi controls was printed raw by `subs list` (#61)."""
    registry = redis.Redis.from_url(redis_url)
    hash_key = keys.fleet_key("default", "registry")
    registry.hset(hash_key, mapping={"noslash": "{}", "p-a/\u202eevil\u2066": "{}", "p-a/x/y": "{}"})
    try:
        for command in (["subs", "get", "orders"], ["history", "orders"], ["queue", "orders", "--state", "retrying"]):
            code, out, err = await cli(*command, "--redis-url", redis_url)
            assert code == 3 and err.strip() == "push-worker: orders: no such subscription", (command, err)
        code, out, err = await cli("subs", "list", "--redis-url", redis_url)
        assert code == 0, err
        assert "noslash" in out and "\\u202eevil\\u2066" in out and "\u202e" not in out, out
    finally:
        registry.hdel(hash_key, "noslash", "p-a/\u202eevil\u2066", "p-a/x/y")
        registry.close()


async def test_registry_entries_have_size_and_count_limits(redis_url, tmp_path):
    fleet = keys.fleet_key("default", "registry")
    url = "https://push.example/" + "a" * 2100
    code, _, err = await cli("subs", "apply", "-f", "-", "--redis-url", redis_url,
                             stdin=json.dumps(push_sub("long", "persistent://p-a/main/t", url)))
    assert code == 2 and "deliver.push.url: must be at most 2048 characters" in err, err
    big = push_sub("big", "persistent://p-a/main/t", "https://push.example/h", display_name="x" * 200)
    big["filter"] = "attributes:" + "k" * 20_000
    code, _, err = await cli("subs", "apply", "-f", "-", "--redis-url", redis_url, stdin=json.dumps(big))
    assert code == 2, err
    rclient = redis.Redis.from_url(redis_url)
    rclient.hset(fleet, "p-a/big", json.dumps(big))  # written around `subs apply`
    config = tmp_path / "worker.yaml"
    config.write_text(json.dumps({"redis": {"url": redis_url}, "fleet": {"max_subscriptions_per_project": 2}}))
    for name in ("s1", "s2", "s3"):
        rclient.hset(fleet, f"p-a/{name}", json.dumps(push_sub(name, "persistent://p-a/main/t",
                                                                "https://push.example/h")))
    code, out, err = await cli("subs", "list", "--json", "--config", str(config))
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["big"]["state"] == "Invalid" and "at most 16384" in rows["big"]["reason"]
    assert [rows[n]["state"] for n in ("s1", "s2")] == ["Unowned", "Unowned"]
    assert rows["s3"]["state"] == "Invalid" and "more than 2 push subscriptions" in rows["s3"]["reason"]
    code, _, err = await cli("subs", "apply", "-f", "-", "--config", str(config),
                             stdin=json.dumps(push_sub("s4", "persistent://p-a/main/t", "https://push.example/h")))
    assert code == 2 and "at most 2 (fleet.max_subscriptions_per_project)" in err, err
    rclient.close()


async def test_a_registry_change_parses_only_what_changed(redis_url):
    """Entries are parsed once; after one edit only that entry is parsed again."""
    from unittest import mock

    import worker.fleet.registry as registry_module
    from worker.fleet.registry import Registry

    rclient = aioredis.Redis.from_url(redis_url)
    registry = Registry(rclient, "default")
    entries = {f"p-a/s{i}": json.dumps(push_sub(f"s{i}", "persistent://p-a/main/t", "https://push.example/h",
                                                filter=f'attributes.k = "{i}"')) for i in range(300)}
    await rclient.hset(registry.hash, mapping=entries)
    with mock.patch.object(registry_module, "parse_subscription", wraps=registry_module.parse_subscription) as parse:
        assert len((await registry.read())[0]) == 300
        assert parse.call_count == 300
        await rclient.hset(registry.hash, "p-a/s7", json.dumps(push_sub("s7", "persistent://p-a/main/t",
                                                                         "https://push.example/other")))
        valid, _ = await registry.read()
        assert parse.call_count == 301 and valid["p-a/s7"].url == "https://push.example/other"
    await rclient.aclose()


async def test_a_shared_budget_lends_what_is_unused_and_keeps_room_for_fair_shares():
    from worker.core.budgets import ByteBudget, SharedBudget

    pool = SharedBudget(100)
    a, b = ByteBudget(1000, pool), ByteBudget(1000, pool)  # fair share: 50 each
    assert all(a.try_take(10) for _ in range(7)) and a.used == 70  # borrowing...
    assert not a.try_take(10)  # ...up to three quarters of the total: the rest is for fair shares
    assert b.try_take(25) and b.try_take(5)  # b, under its share, takes from the reserve
    waiting = asyncio.ensure_future(b.take(20))  # b at 30 wants 20 more: over the total now
    await asyncio.sleep(0)
    assert not waiting.done() and not a.try_take(1)  # a may not borrow while b, under its share, waits
    a.give_back(30)
    await asyncio.wait_for(waiting, 1)
    assert (a.used, b.used, pool.used) == (40, 50, 90)
    lone = ByteBudget(1000, pool)
    assert lone.try_take(500)  # one message always goes, whatever its size
    lone.close()
    a.close()
    assert pool.used == 50 and pool.fair_share() == 100


# pulsar-lite stops dispatching 1 MiB messages now and then although the consumer has permits and
# the messages are stored (the next publish sends them): docs/testing.md. Here that is a stall.
@pytest.mark.apache_pulsar
async def test_one_project_holding_large_messages_cannot_take_the_worker_over_its_memory_budget(
        start_worker, client: Client, topic):
    """Three projects' subscriptions of 1 MiB messages behind slow endpoints, on a worker with a
    16 MiB budget: what the worker holds stays under the budget (plus one message each), every
    message is delivered, and each subscription gets its turn."""
    from aiohttp import web as aioweb

    from tests.support.endpoints import serve

    got: dict[str, int] = {}

    async def slow(request: aioweb.Request) -> aioweb.Response:
        await request.read()
        await asyncio.sleep(0.05)
        got[request.path] = got.get(request.path, 0) + 1
        return aioweb.Response(status=204)

    runner, url = await serve("/{tail:.*}", slow)
    subs = [make_sub(f"persistent://p-{p}/main/big-{topic[-6:]}", url.replace("push", p), max_ack_pending=200)
            for p in ("a", "b", "c")]
    try:
        # Each subscription's own bound far above the worker's, so that only the shared budget holds them.
        w = await start_worker(*subs, max_held_bytes=16 << 20, max_held_bytes_per_subscription=192 << 20)
        peak = 0

        def sample() -> bool:
            nonlocal peak
            peak = max(peak, w.memory.used)
            return sum(got.values()) == 90

        for sub in subs:
            client.publish(sub.topic, [os.urandom(1 << 20) for _ in range(30)])
        await eventually(sample, timeout=60, what="all 90 delivered")
        assert peak <= (16 << 20) + 3 * (1 << 20), peak / (1 << 20)
        assert got == {"/a": 30, "/b": 30, "/c": 30}
    finally:
        await runner.cleanup()


async def test_a_hung_endpoint_cannot_take_another_projects_connections(start_worker, client: Client, endpoint):
    """p-hang's endpoint acks 400 requests (its window grows) and then hangs, with a wide window and
    a long deadline; p-good shares the worker (max_connections 32): p-good delivers everything while
    p-hang holds at most what it may borrow (three quarters of 32)."""
    from aiohttp import web as aioweb

    from tests.support.endpoints import serve

    answered, hanging = 0, 0
    forever = asyncio.Event()

    async def acks_then_hangs(request: aioweb.Request) -> aioweb.Response:
        nonlocal answered, hanging
        await request.read()
        if answered < 400:
            answered += 1
            return aioweb.Response(status=204)
        hanging += 1
        await forever.wait()
        return aioweb.Response(status=204)

    runner, url = await serve("/{tail:.*}", acks_then_hangs)
    tag = os.urandom(3).hex()
    bad = make_sub(f"persistent://p-hang/main/h-{tag}", url, ack_deadline_seconds=600, max_ack_pending=2000,
                   max_concurrency=2000)
    good = make_sub(f"persistent://p-good/main/g-{tag}", endpoint.url)
    try:
        await start_worker(bad, good, destinations=DestinationPolicy(allow_private=True, max_connections=32))
        client.publish(bad.topic, [b"x"] * 1000)
        await eventually(lambda: hanging >= 20, what="p-hang's requests hang")
        client.publish(good.topic, [b"good %d" % i for i in range(50)])
        await eventually(lambda: len({r.body_payload for r in endpoint.requests}) == 50, what="p-good delivers")
        assert hanging <= 24  # three quarters of 32: the rest is kept for the other project
    finally:
        forever.set()
        await runner.cleanup()


def test_the_budgets_come_from_the_container(tmp_path):
    """Half the cgroup's memory limit (v2 `memory.max`, v1 `memory.limit_in_bytes`), 512 MiB without
    one; connections below the open-files limit, which is raised to the hard limit."""
    import resource

    from worker.runtime import resources

    (tmp_path / "memory.max").write_text("max\n")
    assert resources.held_bytes_budget(None, tmp_path) == (512 << 20, "default (no memory limit found)")
    (tmp_path / "memory.max").write_text(str(1 << 30))
    assert resources.held_bytes_budget(None, tmp_path)[0] == 512 << 20
    (tmp_path / "memory.max").unlink()
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(str(3 << 30))
    assert resources.held_bytes_budget(None, tmp_path) == (
        3 << 29, f"half of {tmp_path / 'memory' / 'memory.limit_in_bytes'}")
    assert resources.held_bytes_budget(64 << 20, tmp_path) == (64 << 20, "max_held_bytes")
    soft, hard = resources.raise_open_files_limit()
    assert soft == resource.getrlimit(resource.RLIMIT_NOFILE)[0] and (soft == hard or hard == resource.RLIM_INFINITY)
    assert resources.connections_budget(None, 2048) == (1536, "open-files limit 2048 less 512")
    assert resources.connections_budget(100, 2048) == (100, "max_connections")


def test_the_memory_limit_of_a_nested_cgroup_is_found_through_proc_self_cgroup(tmp_path):
    """A pod's container in a nested cgroup (v1 or v2): its own limit is found through
    /proc/self/cgroup, and the smallest limit on the way up to the root is the one that holds."""
    from worker.runtime import resources

    proc = tmp_path / "cgroup"
    nested = tmp_path / "memory" / "kubepods" / "pod1"
    nested.mkdir(parents=True)
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(str(resources._NO_LIMIT_V1 * 8))
    (tmp_path / "memory" / "kubepods" / "memory.limit_in_bytes").write_text(str(4 << 30))
    (nested / "memory.limit_in_bytes").write_text(str(1 << 30))
    proc.write_text("5:cpu,cpuacct:/kubepods/pod1\n4:memory:/kubepods/pod1\n0::/\n")
    assert resources.memory_limit(tmp_path, proc) == (1 << 30, str(nested / "memory.limit_in_bytes"))
    (nested / "memory.limit_in_bytes").write_text(str(8 << 30))  # the parent's is smaller: it holds
    assert resources.memory_limit(tmp_path, proc)[0] == 4 << 30
    assert resources.held_bytes_budget(None, tmp_path, proc)[0] == 2 << 30
    v2 = tmp_path / "v2"
    (v2 / "pods" / "one").mkdir(parents=True)
    (v2 / "pods" / "one" / "memory.max").write_text(str(768 << 20))
    proc.write_text("0::/pods/one\n")
    assert resources.memory_limit(v2, proc) == (768 << 20, str(v2 / "pods" / "one" / "memory.max"))
    proc.write_text("0::/gone/elsewhere\n")  # a path the mount does not show (a namespace's root): none found
    assert resources.memory_limit(v2, proc) == (None, "")


async def test_messages_over_the_attribute_limits_are_dead_lettered_unsent(start_worker, endpoint: Endpoint,
                                                                           client: Client, topic):
    """Google's limits: 100 attributes, 256-byte keys, 1,024-byte values (150,000 attributes took
    297 ms to turn into one CloudEvents request, on the event loop every project shares)."""
    dlq = topic + "-dlq"
    watcher = client.watch(dlq)
    sub = make_sub(topic, endpoint.url, dead_letter_topic=dlq, content="cloudevents")
    await start_worker(sub)
    over = client.publish(topic, [b"many"], properties={f"a{i}": "v" for i in range(101)})
    over += client.publish(topic, [b"long key"], properties={"k" * 257: "v"})
    over += client.publish(topic, [b"long value"], properties={"k": "v" * 1025})
    [fine] = client.publish(topic, [b"fine"], properties={f"a{i}": "v" * 1024 for i in range(100)})
    await eventually(lambda: fine in endpoint.by_id(), what="the message at the limits")
    letters = await asyncio.to_thread(client.drain, watcher, 3)
    assert sorted(m.properties()["pubsub.original_message_id"] for m in letters) == sorted(over)
    assert {m.properties()["pubsub.last_status"] for m in letters} == {"attributes_too_large"}
    assert set(endpoint.by_id()) == {fine}


def _calls(client: Any, mode: str, command: str) -> int:
    """How often Redis ran `command` (on every primary of a Cluster)."""
    nodes = client.info("commandstats", target_nodes="primaries").values() if mode == "cluster" else [
        client.info("commandstats")]
    return sum(int(n.get(f"cmdstat_{command}", {}).get("calls", 0)) for n in nodes)


@ALL_REDIS
async def test_a_registry_change_is_read_at_the_cost_of_what_changed(redis_target: RedisTarget):
    """Every change made every worker read the whole registry (a thousand 16 KiB definitions: 16 MB a
    change, per worker). A worker reads the change log and then only the keys it names; a change the
    log does not account for (one by the previous release, which bumps the version alone; a log of
    the wrong type) makes it read everything, as before."""
    from worker.fleet.registry import Registry
    from worker.fleet.registry_follower import RegistryFollower

    client = redis_client.connect(redis_target.settings, socket_timeout=10)
    sync = redis_target.client()
    registry = Registry(client, f"follow-{time.monotonic_ns()}")
    follower = RegistryFollower(registry)
    mode = redis_target.mode

    def definition(i: int, url: str = "https://push.example/h") -> dict[str, Any]:
        return push_sub(f"s{i}", "persistent://p-a/main/t", url, filter=f'attributes.k = "{i}"')

    try:
        await registry.apply_all([definition(i) for i in range(200)])
        await follower.refresh()
        assert len(follower.subscriptions()[0]) == 200 and follower.full_reads == 1

        hgetall = _calls(sync, mode, "hgetall")
        await registry.apply(definition(7, "https://push.example/other"))
        await registry.set_paused("p-a/s8", True)
        await registry.delete("p-a/s9")
        await follower.refresh()
        valid, _ = follower.subscriptions()
        assert valid["p-a/s7"].url == "https://push.example/other" and "p-a/s9" not in valid
        assert follower.paused == {"p-a/s8"}
        assert _calls(sync, mode, "hgetall") == hgetall and follower.full_reads == 1
        await follower.refresh()  # nothing changed: nothing read
        assert follower.full_reads == 1

        # The previous release writes the definition and bumps the version, with no log entry.
        await client.hset(registry.hash, "p-a/s10", json.dumps(definition(10, "https://push.example/old")))
        await client.incr(registry.version_key)
        await follower.refresh()
        assert follower.full_reads == 2 and follower.subscriptions()[0]["p-a/s10"].url == "https://push.example/old"

        # A change log that is garbage: changes still land, and are read in full.
        await client.delete(registry.changes_key)
        await client.set(registry.changes_key, "garbage")
        await registry.apply(definition(11, "https://push.example/after-garbage"))
        await follower.refresh()
        assert follower.full_reads == 3
        assert follower.subscriptions()[0]["p-a/s11"].url == "https://push.example/after-garbage"
    finally:
        await client.aclose()
        sync.close()
