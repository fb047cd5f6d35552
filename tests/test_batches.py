"""Several messages a request (`deliver.push.batch`): the bodies (wrapped, and CloudEvents' JSON batch
format read by the official SDK), per-message attempts when a batch fails, ordering keys across
batches, the signature over the batch. Real broker, Redis, worker and endpoints."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import random
from collections import defaultdict
from typing import Any

import jwt
import pytest
from aiohttp import web
from cloudevents.http import from_json
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.support.builders import make_sub, push_sub
from tests.support.endpoints import Endpoint, Received
from tests.support.helpers import cli, eventually
from tests.support.pulsar_client import Client
from worker.broker.embedded import free_port
from worker.core.batches import Forming
from worker.core.messages import Envelope, batch_entry_bytes
from worker.endpoint.oidc import Oidc, OidcIssuer, OidcKey
from worker.endpoint.secrets import SecretRef
from worker.fleet.registry import Registry
from worker.model.config import HttpSettings
from worker.model.subscriptions import BatchPolicy, parse_subscription
from worker.runtime.errors import ConfigError


def batched(topic: str, url: str, batch: Any, content: str = "wrapped") -> dict[str, Any]:
    return push_sub("b", topic, url) | {"deliver": {"mode": "push", "push": {"url": url, "content": content,
                                                                              "batch": batch}}}


def entries(rec: Received) -> list[dict[str, Any]]:
    """The messages a wrapped batch request carries."""
    body = json.loads(rec.body)
    assert set(body) == {"subscription", "messages"}, body
    return list(body["messages"])


@pytest.mark.broker_independent
def test_a_batch_is_checked_at_load_and_needs_a_format_with_a_batch_form():
    topic, url = "persistent://p-a/main/t", "https://example.com/h"
    assert parse_subscription(batched(topic, url, {})).batch == BatchPolicy()  # every field has its default
    assert parse_subscription(batched(topic, url, {"max_messages": 10, "max_wait_ms": 0})).batch == \
        BatchPolicy(max_messages=10, max_bytes=BatchPolicy().max_bytes, max_wait_ms=0)
    assert parse_subscription(batched(topic, url, {}, "cloudevents")).batch is not None
    assert parse_subscription(push_sub("b", topic, url)).batch is None  # one message a request unless asked
    for content in ("raw", "gcp"):
        with pytest.raises(ConfigError, match=f"deliver.push.batch: needs content wrapped or cloudevents "
                                              f"\\(content {content} has no batch form\\)"):
            parse_subscription(batched(topic, url, {}, content))
    for bad, says in (({"max_messages": 0}, "max_messages: must be in 1..1000"),
                      ({"max_bytes": 10}, "max_bytes: must be in 1024..67108864"),
                      ({"max_wait_ms": -1}, "max_wait_ms: must be in 0..10000"),
                      ({"size": 3}, "size: is not a known field")):
        with pytest.raises(ConfigError, match=says):
            parse_subscription(batched(topic, url, bad))


@pytest.mark.broker_independent
def test_a_batch_takes_a_lanes_messages_in_order_and_keeps_to_its_limits():
    def env(i: int, size: int = 10) -> Envelope:
        return Envelope(f"1:{i}:-1:-1", b"x" * size, "persistent://p-a/main/t", 0)

    forming = Forming()
    for i in range(6):
        forming.add((None, env(i)), "k1" if i % 2 else None)  # odd ones in lane k1, even ones loose
    items, lanes = forming.take(4, 1 << 20)
    ids = [e.message_id for _, e in items]
    assert len(ids) == 4 and [i for i in ids if int(i.split(":")[1]) % 2] == sorted(
        i for i in ids if int(i.split(":")[1]) % 2)  # the lane's messages in their order
    assert list(lanes) == ["k1"] and forming.count == 6 - 4 - len(lanes["k1"])  # the rest of k1 waits behind
    rest, _ = forming.take(100, 1 << 20)
    assert not [e for _, e in rest if int(e.message_id.split(":")[1]) % 2]  # k1 left: its rest waits behind
    assert {e.message_id for _, e in rest} | set(ids) | {e.message_id for _, e in lanes["k1"]} == \
        {env(i).message_id for i in range(6)}
    # Bytes: a batch stops before its estimate passes max_bytes, but a larger message goes alone.
    for i in range(3):
        forming.add((None, env(i, 3000)), None)
    one = batch_entry_bytes(env(0, 3000))
    assert len(forming.take(100, 2 * one)[0]) == 2 and len(forming.take(100, 10)[0]) == 1 and not forming


async def test_wrapped_batches_carry_up_to_max_messages_each_with_its_envelope_and_are_signed(
        start_worker, endpoint: Endpoint, client: Client, topic, monkeypatch):
    secret = "whsec_" + base64.b64encode(b"batch-secret-32-bytes-long-ok!!!").decode()
    monkeypatch.setenv("TEST_BATCH_SECRET", secret)
    sub = make_sub(topic, endpoint.url, batch=BatchPolicy(max_messages=25, max_wait_ms=200),
                   signing_secrets=(SecretRef(env="TEST_BATCH_SECRET"),))
    ids = client.publish(topic, [b"m%d" % i for i in range(200)], properties={"kind": "order"})
    w = await start_worker(sub)
    await eventually(lambda: w.dispatchers[sub.key].stats.acked == 200, what="all delivered")
    carried = [entries(rec) for rec in endpoint.requests]
    assert sorted(e["message_id"] for batch in carried for e in batch) == sorted(ids)  # each once
    assert max(len(b) for b in carried) == 25 and len(carried) <= 200 // 25 + 4  # batched, not one a request
    first = carried[0][0]
    assert set(first) == {"message_id", "data", "attributes", "ordering_key", "publish_time", "delivery_attempt"}
    assert base64.b64decode(first["data"]).startswith(b"m") and first["attributes"] == {"kind": "order"}
    assert first["delivery_attempt"] == 1
    rec = endpoint.requests[0]
    headers = {k.lower(): v for k, v in rec.headers.items()}
    assert headers["content-type"] == "application/json" and headers["pubsub-topic"] == topic
    assert "pubsub-message-id" not in headers  # per-message headers are in the body's entries
    assert headers["webhook-id"].startswith("batch_")  # the batch's id, not a message's
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + rec.body
    digest = hmac.new(base64.b64decode(secret[6:]), signed, hashlib.sha256).digest()
    expected = "v1," + base64.b64encode(digest).decode()
    assert headers["webhook-signature"] == expected  # over the whole batch


async def test_a_failed_batch_is_a_failed_attempt_for_each_message_and_they_dead_letter_once(
        start_worker, endpoint: Endpoint, client: Client, topic):
    """Every request refused: each message is tried max_deliver times (its own numbers, 1..3, in
    whatever batch carries it) and dead-lettered once; then a recovered endpoint acks a batch whole."""
    endpoint.behaviour = lambda rec: web.Response(status=500)
    dlq = topic + "-dlq"
    watcher = client.watch(dlq)
    sub = make_sub(topic, endpoint.url, max_deliver=3, dead_letter_topic=dlq, breaker=None,
                   batch=BatchPolicy(max_messages=10, max_wait_ms=100))
    ids = client.publish(topic, [b"d%d" % i for i in range(30)])
    w = await start_worker(sub)
    dead = await asyncio.to_thread(Client.drain, watcher, 30)
    assert sorted(m.properties()["pubsub.original_message_id"] for m in dead) == sorted(ids)
    assert {m.properties()["pubsub.delivery_attempts"] for m in dead} == {"3"}
    assert {m.properties()["pubsub.last_status"] for m in dead} == {"500"}
    attempts: dict[str, list[int]] = defaultdict(list)
    for rec in endpoint.requests:
        for e in entries(rec):
            attempts[e["message_id"]].append(e["delivery_attempt"])
    assert {mid: numbers for mid, numbers in attempts.items()} == {mid: [1, 2, 3] for mid in ids}
    # The broker confirms a dead letter before the dispatcher counts it: the watcher can be first.
    await eventually(lambda: w.dispatchers[sub.key].stats.dead_lettered == 30, what="30 counted")

    endpoint.behaviour = None
    more = client.publish(topic, [b"ok%d" % i for i in range(10)])
    await eventually(lambda: w.dispatchers[sub.key].stats.acked == 10, what="a recovered endpoint")
    assert sorted(e["message_id"] for r in endpoint.requests if r.acked for e in entries(r)) == sorted(more)


@pytest.mark.parametrize("kind", ["key-shared", "exclusive"])
async def test_ordering_keys_keep_their_order_within_and_across_batches(
        start_worker, endpoint: Endpoint, client: Client, topic, kind):
    """A refused batch (one request in four) is tried again before anything behind its keys: each
    key's first deliveries arrive in publish order; exclusive batches carry several of its one lane."""
    rng = random.Random(7)
    endpoint.behaviour = lambda rec: web.Response(status=503 if rng.random() < 0.25 else 204)
    sub = make_sub(topic, endpoint.url, type=kind, max_deliver=-1, breaker=None,
                   batch=BatchPolicy(max_messages=8, max_wait_ms=20))
    producer = client.client.create_producer(topic, batching_enabled=False)
    published: dict[str, list[bytes]] = defaultdict(list)
    for i in range(160):
        key = f"k{i % 5}"
        producer.send(b"%s-%d" % (key.encode(), i), partition_key=key)
        published[key].append(b"%s-%d" % (key.encode(), i))
    producer.close()
    w = await start_worker(sub)
    await eventually(lambda: w.dispatchers[sub.key].stats.acked == 160, timeout=60, what="all delivered")
    first_seen: dict[str, list[bytes]] = defaultdict(list)
    seen: set[bytes] = set()
    for rec in endpoint.requests:
        for e in entries(rec):
            data = base64.b64decode(e["data"])
            if data not in seen:
                seen.add(data)
                first_seen[data.split(b"-")[0].decode()].append(data)
    assert first_seen == published
    sizes = [len(entries(r)) for r in endpoint.requests]
    assert max(sizes) > 1 and len(sizes) < 160  # batched: a lane's messages go together


async def test_cloudevents_batches_use_the_json_batch_format_read_by_the_official_sdk(
        start_worker, endpoint: Endpoint, client: Client, topic):
    sub = parse_subscription(batched(topic, endpoint.url, {"max_messages": 10, "max_wait_ms": 200}, "cloudevents"),
                             trusted=True)
    ids = client.publish(topic, [b'{"n": %d}' % i for i in range(5)], properties={"content-type": "application/json",
                                                                                 "region": "eu1"})
    w = await start_worker(sub)
    await eventually(lambda: w.dispatchers[sub.key].stats.acked == 5, what="delivered")
    events = []
    for rec in endpoint.requests:
        assert rec.headers["Content-Type"] == "application/cloudevents-batch+json"
        # The batch format is a JSON array of events in the JSON format: each is read by the SDK.
        events += [from_json(json.dumps(element)) for element in json.loads(rec.body)]
    assert sorted(e["id"] for e in events) == sorted(ids)
    event = next(e for e in events if e["id"] == ids[0])
    assert event.data == {"n": 0} and event["region"] == "eu1" and event["deliveryattempt"] == "1"
    assert event["source"] == f"//pulsar/{topic}" and event["specversion"] == "1.0"


async def test_a_batch_applied_through_the_registry_is_shown_by_subs_get_and_edited_live(
        start_worker, endpoint: Endpoint, client: Client, topic, redis_url, registry: Registry):
    definition = batched(topic, endpoint.url, {"max_messages": 5, "max_wait_ms": 100}) | {"name": "batched"}
    await registry.apply_all([definition])
    client.publish(topic, [b"a%d" % i for i in range(20)])
    w = await start_worker()
    key = "p-test/batched"
    await eventually(lambda: key in w.dispatchers and w.dispatchers[key].stats.acked == 20, what="delivered")
    assert max(len(entries(r)) for r in endpoint.requests) == 5
    code, out, err = await cli("subs", "get", "batched", "--redis-url", redis_url, "--json")
    assert code == 0 and json.loads(out)["batch"] == {"max_messages": 5, "max_bytes": 1048576, "max_wait_ms": 100}, err

    definition["deliver"]["push"]["batch"] = {"max_messages": 50, "max_wait_ms": 300}
    await registry.apply_all([definition])
    await eventually(lambda: w.dispatchers[key].sub.batch.max_messages == 50, what="the edit applied")
    before = len(endpoint.requests)
    client.publish(topic, [b"b%d" % i for i in range(20)])
    await eventually(lambda: w.dispatchers[key].stats.acked == 40, what="delivered after the edit")
    assert max(len(entries(r)) for r in endpoint.requests[before:]) > 5

    del definition["deliver"]["push"]["batch"]  # one message a request again
    await registry.apply_all([definition])
    await eventually(lambda: w.dispatchers[key].sub.batch is None, what="the batch removed")
    before = len(endpoint.requests)
    [mid] = client.publish(topic, [b"single"])
    await eventually(lambda: w.dispatchers[key].stats.acked == 41, what="delivered alone")
    [rec] = endpoint.requests[before:]
    assert rec.headers["Pubsub-Message-Id"] == mid and json.loads(rec.body)["message"]["message_id"] == mid


async def test_an_oidc_token_goes_with_each_batch_and_verifies_with_the_published_keys(
        start_worker, endpoint: Endpoint, client: Client, topic, tmp_path):
    key = tmp_path / "oidc.pem"
    key.write_bytes(rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    port = free_port()
    issuer = f"http://127.0.0.1:{port}"
    sub = make_sub(topic, endpoint.url, oidc=Oidc(), batch=BatchPolicy(max_messages=10, max_wait_ms=200))
    w = await start_worker(sub, http=HttpSettings(port=port),
                           oidc=OidcIssuer(issuer, (OidcKey(SecretRef(file=str(key)), "k1"),)))
    client.publish(topic, [b"o%d" % i for i in range(10)])
    await eventually(lambda: w.dispatchers[sub.key].stats.acked == 10, what="delivered")
    assert sum(len(entries(r)) for r in endpoint.requests) == 10 and len(endpoint.requests) < 10

    def verify() -> None:  # blocking HTTP, off the event loop the worker runs on
        jwks = jwt.PyJWKClient(f"{issuer}/.well-known/jwks.json", cache_keys=False)
        for rec in endpoint.requests:
            token = rec.headers["Authorization"].removeprefix("Bearer ")
            claims = jwt.decode(token, jwks.get_signing_key_from_jwt(token).key, algorithms=["RS256"],
                                audience=endpoint.url, issuer=issuer)
            assert claims["sub"] == f"projects/{sub.tenant}/subscriptions/{sub.name}"

    await asyncio.to_thread(verify)


async def test_a_batch_keeps_filling_while_the_rate_limit_holds_its_request(
        start_worker, endpoint: Endpoint, client: Client, topic):
    """10 msg/s through `rate_limit: 2/s` with batches of up to 10: every request carries what arrived
    while it waited for its turn, so 10 msg/s get through and no backlog grows. A batch closed at
    max_wait_ms and only then waited for its token: batches of 1-2, about 3.5 msg/s."""
    from worker.model.subscriptions import RateLimit

    sub = make_sub(topic, endpoint.url, batch=BatchPolicy(max_messages=10, max_wait_ms=50),
                   rate_limit=RateLimit(messages_per_second=2.0, burst=1.0))
    w = await start_worker(sub)
    began = asyncio.get_running_loop().time()
    for i in range(60):  # 10 a second for 6 s, from a thread that keeps the pace
        await asyncio.to_thread(client.publish, topic, [b"m%d" % i])
        await asyncio.sleep(max(0.0, began + (i + 1) / 10 - asyncio.get_running_loop().time()))
    await eventually(lambda: w.dispatchers[sub.key].stats.acked == 60, timeout=20, what="all delivered")
    took = asyncio.get_running_loop().time() - began
    carried = [len(entries(rec)) for rec in endpoint.requests]
    assert sum(carried) == 60 and len(carried) <= 2 * took + 1, (carried, took)
    assert took < 9.0, f"60 messages at 10/s took {took:.1f} s through 2 requests/s: batches {carried}"
