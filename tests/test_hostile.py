"""Hostile and broken input: endpoints that misbehave at the socket level, Redis going away, and
fuzzed configuration and registry input."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis
import yaml
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.builders import make_sub
from tests.support.endpoints import Endpoint
from tests.support.helpers import assert_numbering_never_repeats, eventually
from tests.support.pulsar_client import Client
from worker.core.delivery import RESPONSE_BODY_CAP, Deliverer, Result
from worker.core.messages import PushRequest
from worker.endpoint.destinations import DestinationPolicy
from worker.fleet.registry import Registry
from worker.model.config import parse_settings
from worker.model.subscriptions import RetryPolicy, parse_subscription
from worker.runtime.errors import ConfigError

Behaviour = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
DEADLINE = 1.5


@contextlib.asynccontextmanager
async def raw_endpoint(behaviour: Behaviour) -> AsyncIterator[tuple[str, list[int]]]:
    """A real TCP server speaking (or failing to speak) HTTP by hand; yields (url, bytes written)."""
    written = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await reader.readuntil(b"\r\n\r\n")
            await behaviour(reader, writer)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/push", written
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 2)


async def hang_after_headers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
    await writer.drain()
    await asyncio.sleep(30)


async def trickle_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n")
    for _ in range(300):
        writer.write(b"x")
        await writer.drain()
        await asyncio.sleep(0.1)


async def hang_before_anything(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(30)


async def close_mid_response(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
    await writer.drain()


async def garbage_status_line(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"\x00\xffNOT HTTP AT ALL\r\n\r\n")
    await writer.drain()


async def redirect_to_metadata(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 302 Found\r\nLocation: http://169.254.169.254/latest/meta-data/\r\n"
                 b"Content-Length: 0\r\n\r\n")
    await writer.drain()


@pytest.mark.broker_independent
@pytest.mark.parametrize(("behaviour", "result", "status"), [
    (hang_after_headers, Result.TIMEOUT, None),
    (trickle_body, Result.TIMEOUT, None),
    (hang_before_anything, Result.TIMEOUT, None),
    (close_mid_response, Result.CONNECTION_ERROR, None),
    (garbage_status_line, Result.CONNECTION_ERROR, None),
    (redirect_to_metadata, Result.NACK, 302),
])
async def test_misbehaving_endpoints_are_bounded_failed_attempts(behaviour, result, status):
    deliverer = Deliverer(DestinationPolicy(allow_private=True))
    try:
        async with raw_endpoint(behaviour) as (url, _):
            started = time.monotonic()
            outcome = await deliverer.attempt(
                url, PushRequest({"Content-Type": "application/json"}, b"{}"), DEADLINE)
            elapsed = time.monotonic() - started
        assert (outcome.result, outcome.status) == (result, status), outcome
        assert elapsed < DEADLINE + 1.0
    finally:
        await deliverer.close()


@pytest.mark.broker_independent
async def test_an_endless_response_body_is_read_only_up_to_the_cap():
    sent = [0]

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 500 Oops\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n%s\r\n" % (65536, b"z" * 65536)
        with contextlib.suppress(ConnectionError):
            while sent[0] < 1024 * 1024 * 1024:
                writer.write(chunk)
                await writer.drain()
                sent[0] += 65536

    deliverer = Deliverer(DestinationPolicy(allow_private=True))
    try:
        async with raw_endpoint(endless) as (url, _):
            outcome = await deliverer.attempt(
                url, PushRequest({}, b"{}"), 10.0)
            assert (outcome.result, outcome.status) == (Result.NACK, 500)
            assert outcome.latency < 5.0
            # The server could push at most the cap plus what socket buffers hold before we hung up.
            await eventually(lambda: sent[0] > 0, what="server wrote")
            assert sent[0] < RESPONSE_BODY_CAP + 64 * 1024 * 1024
    finally:
        await deliverer.close()


async def test_a_hostile_endpoint_fails_its_own_messages_while_others_flow(
        start_worker, endpoint: Endpoint, client: Client, topic):
    async with raw_endpoint(hang_after_headers) as (bad_url, _):
        bad = make_sub(topic, bad_url, ack_deadline_seconds=1, max_deliver=2, retry=RetryPolicy(0.05, 0.05))
        good = make_sub(topic + "-good", endpoint.url)
        w = await start_worker(bad, good)
        client.publish(topic, [b"b%d" % i for i in range(3)])
        client.publish(topic + "-good", [b"g%d" % i for i in range(50)])
        await eventually(lambda: w.dispatchers[good.key].stats.acked == 50, what="good subscription unaffected")
        await eventually(lambda: w.dispatchers[bad.key].stats.dropped == 3, what="hostile endpoint's messages settle")


# -- Redis going away -----------------------------------------------------------------------------

async def test_no_attempt_is_made_without_redis_and_delivery_resumes_by_itself(
        own_redis, start_worker, endpoint: Endpoint, client: Client, topic):
    failing = True
    endpoint.behaviour = lambda rec: web.Response(status=500 if failing else 204)
    sub = make_sub(topic, endpoint.url, max_deliver=1000, retry=RetryPolicy(0.1, 0.1))
    w = await start_worker(sub, redis=own_redis.url)
    ids = client.publish(topic, [b"r%d" % i for i in range(5)])
    await eventually(lambda: all(len(endpoint.by_id().get(m, [])) >= 2 for m in ids), what="retrying")

    own_redis.kill()
    settle_deadline = time.monotonic() + 0.5  # attempts already recorded may still finish meanwhile
    await eventually(lambda: time.monotonic() > settle_deadline, what="in-flight settled")
    during = len(endpoint.requests)
    outage_end = time.monotonic() + 3.0  # the outage: 3 s without Redis (30 retry periods)
    await eventually(lambda: time.monotonic() > outage_end, what="outage")
    assert len(endpoint.requests) == during  # no request went out without its attempt record

    failing = False
    await asyncio.to_thread(own_redis.restart)
    await eventually(lambda: w.dispatchers[sub.key].stats.acked == 5, timeout=30, what="resumed by itself")
    assert_numbering_never_repeats(endpoint)  # the count survived the outage


# -- fuzzing ----------------------------------------------------------------------------------------

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from(["push", "pull", "shared", "http://e.com/h", "all",
                                                           "persistent://p-a/main/t", "orders", "raw"]))
FIELDS = ["name", "topic", "type", "ack_deadline_seconds", "max_deliver", "max_ack_pending", "start_from",
          "retry", "deliver", "dead_letter", "mode", "push", "url", "content", "signing_secrets", "bearer_token",
          "env", "file", "min_backoff_seconds", "max_backoff_seconds", "after_attempts", "pulsar", "redis",
          "service_url", "http", "port", "destinations", "allow_private", "allow_cidrs", "subscriptions", "fleet",
          "lease_seconds", "heartbeat_seconds", "log", "level", "format", "state_dir", "max_request_bytes"]
documents = st.recursive(scalars, lambda children: st.one_of(
    st.lists(children, max_size=4),
    st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=5) | st.integers(), children, max_size=6)),
    max_leaves=25)


def mutated_subscription() -> st.SearchStrategy[Any]:
    base = {"name": "orders", "topic": "persistent://p-a/main/t", "deliver": {"mode": "push",
                                                                              "push": {"url": "http://e.com/h"}}}
    return st.builds(lambda extra, drop: {**{k: v for k, v in base.items() if k not in drop}, **extra},
                     st.dictionaries(st.sampled_from(FIELDS), documents, max_size=3),
                     st.sets(st.sampled_from(list(base))))


@pytest.mark.broker_independent
@settings(max_examples=400, deadline=None)
@given(st.one_of(documents, st.fixed_dictionaries({"subscriptions": st.lists(mutated_subscription(), max_size=3)})))
def test_fuzzed_config_is_either_valid_or_a_clear_error(doc):
    try:
        parse_settings(doc, env={})
    except ConfigError as e:
        assert e.field and e.rule  # names the field and the rule


@pytest.mark.broker_independent
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(mutated_subscription(), documents), min_size=1, max_size=3))
def test_fuzzed_registry_input_is_all_or_nothing(redis_url, definitions):
    async def go() -> None:
        client = aioredis.Redis.from_url(redis_url)
        try:
            registry = Registry(client, "fuzz")
            before = await client.hgetall(registry.hash)
            from worker.model.config import Settings
            from worker.ops.admin import Admin, Target

            admin = Admin(Target(Settings(), redis_url=redis_url), "subs")
            admin.registry = registry
            path = f"/tmp/fuzz-{id(definitions)}.yaml"
            with open(path, "w") as f:
                yaml.safe_dump(definitions, f)
            try:
                valid = all(isinstance(d, dict) and _parses(d) for d in definitions)
                try:
                    await admin.apply(path)
                    applied = True
                except ConfigError as e:
                    assert e.field and e.rule
                    applied = False
                after = await client.hgetall(registry.hash)
                if not applied:
                    assert after == before  # a refused batch changes nothing
                else:
                    assert valid
                    for value in after.values():  # whatever is stored, workers can read back
                        parse_subscription(orjson.loads(value))
            finally:
                await admin.close()
                import os

                os.unlink(path)
        finally:
            await client.aclose()

    asyncio.run(go())


def _parses(d: dict[str, Any]) -> bool:
    try:
        parse_subscription(d)
        return True
    except ConfigError:
        return False


@pytest.mark.broker_independent
async def test_registry_refuses_a_batch_with_one_bad_definition_and_writes_none(redis_url, tmp_path):
    from worker.model.config import Settings
    from worker.ops.admin import Admin, Target

    good = {"name": "good", "topic": "persistent://p-a/main/t",
            "deliver": {"mode": "push", "push": {"url": "http://e.com/h"}}}
    bad = {**good, "name": "bad", "max_deliver": -5}
    path = tmp_path / "subs.yaml"
    path.write_text(orjson.dumps([good, bad]).decode())
    admin = Admin(Target(Settings(), redis_url=redis_url), "subs")
    try:
        with pytest.raises(ConfigError, match="max_deliver"):
            await admin.apply(str(path))
        assert await admin.registry.definitions() == {}
    finally:
        await admin.close()
