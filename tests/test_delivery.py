"""The delivery contract end to end: real broker, real Redis, real HTTP endpoint, in-process worker."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
from datetime import datetime

import pulsar
import pytest
from aiohttp import web
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tests.support.builders import make_sub, push_sub, worker_yaml
from tests.support.endpoints import ConcurrencyProbe, Endpoint
from tests.support.helpers import assert_stays, cli, eventually
from tests.support.pulsar_client import Client
from tests.support.redis_targets import ALL_REDIS

CONTRACT_HEADERS = ("Pubsub-Subscription", "Pubsub-Topic", "Pubsub-Message-Id", "Pubsub-Delivery-Attempt",
                    "Pubsub-Publish-Time")


@ALL_REDIS
async def test_wrapped_delivery_follows_the_contract(start_worker, endpoint: Endpoint, client: Client, topic):
    sub = make_sub(topic, endpoint.url, content="wrapped")
    await start_worker(sub)
    payloads = [f"order-{i}".encode() for i in range(20)] + [b"", bytes(range(256))]
    ids = client.publish(topic, payloads[:10], {"kind": "order", "x-trace": "abc"})
    ids += client.publish(topic, payloads[10:], key="customer-7")

    await eventually(lambda: len(endpoint.requests) >= len(payloads), what="all deliveries")
    await asyncio.sleep(0)
    assert len(endpoint.requests) == len(payloads)  # each acked once: no redelivery
    for rec, mid, payload in zip(sorted(endpoint.requests, key=lambda r: ids.index(r.headers["Pubsub-Message-Id"])),
                                 ids, payloads, strict=True):
        h = rec.headers
        assert all(name in h for name in CONTRACT_HEADERS)
        assert h["Pubsub-Subscription"] == sub.name
        assert h["Pubsub-Topic"] == topic
        assert h["Pubsub-Message-Id"] == mid
        assert len(mid.split(":")) == 4 and all(p.lstrip("-").isdigit() for p in mid.split(":"))
        assert h["Pubsub-Delivery-Attempt"] == "1"
        assert h["Content-Type"] == "application/json"
        published = datetime.fromisoformat(h["Pubsub-Publish-Time"].replace("Z", "+00:00"))
        assert published.tzinfo is not None
        body = json.loads(rec.body)
        assert body["subscription"] == sub.name
        m = body["message"]
        assert set(m) == {"message_id", "data", "attributes", "ordering_key", "publish_time", "delivery_attempt"}
        assert base64.b64decode(m["data"]) == payload
        assert m["message_id"] == mid
        assert m["delivery_attempt"] == 1
        assert m["publish_time"] == h["Pubsub-Publish-Time"]
        if payload.startswith(b"order-") and int(payload[6:]) < 10:
            assert m["attributes"] == {"kind": "order", "x-trace": "abc"}
            assert m["ordering_key"] is None and "Pubsub-Ordering-Key" not in h
        else:
            assert m["attributes"] == {}
            assert m["ordering_key"] == "customer-7" and h["Pubsub-Ordering-Key"] == "customer-7"


async def test_raw_delivery_sends_payload_bytes_and_safe_attributes(start_worker, endpoint, client, topic):
    sub = make_sub(topic, endpoint.url, content="raw")
    w = await start_worker(sub)
    client.publish(topic, [b"\x00\x01binary\xff"], {"content-type": "image/png", "color": "blue",
                                                    "bad name": "x", "evil": "a\r\nInjected: 1",
                                                    # names that differ only in case: one header name
                                                    "Region": "eu", "region": "us"})
    client.publish(topic, [b"plain"], {})
    await eventually(lambda: len(endpoint.requests) == 2, what="two deliveries")
    first, second = sorted(endpoint.requests, key=lambda r: r.body != b"\x00\x01binary\xff")
    assert first.body == b"\x00\x01binary\xff"
    assert first.headers["Content-Type"] == "image/png"
    assert first.headers["Pubsub-Attr-color"] == "blue"
    assert "Injected" not in first.headers
    assert not any(k.startswith("Pubsub-Attr-bad") or k == "Pubsub-Attr-evil" for k in first.headers)
    assert not any(k.lower() == "pubsub-attr-region" for k in first.headers)
    assert second.body == b"plain"
    assert second.headers["Content-Type"] == "application/octet-stream"
    omitted = w.metrics.registry.get_sample_value(
        "pushworker_attributes_omitted_total", {"project": sub.tenant, "subscription": sub.name})
    assert omitted == 4


@pytest.mark.parametrize("status", [200, 201, 202, 204, 299])
async def test_each_ack_status_acks_once(start_worker, endpoint, client, topic, status):
    endpoint.behaviour = lambda rec: web.Response(status=status)
    sub = make_sub(topic, endpoint.url)
    w = await start_worker(sub)
    client.publish(topic, [b"a", b"b", b"c"])
    d = w.dispatchers[sub.key]
    await eventually(lambda: d.stats.acked == 3, what="three acks")
    # Let any (wrong) redelivery surface: close the worker, which releases unacked messages, and
    # start a second one; it must receive nothing.
    await w.close()
    w2 = await start_worker(sub)
    await assert_stays(lambda: len(endpoint.requests) == 3 and w2.dispatchers[sub.key].stats.acked == 0, 0.5,
                       "no redelivery to the second worker")


async def test_interim_102_is_an_ack(start_worker, client, topic):
    """An endpoint answering `102 Processing` (and nothing more) has accepted the message."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 102 Processing\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(30)  # never a final answer

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sub = make_sub(topic, f"http://127.0.0.1:{port}/", ack_deadline_seconds=10)
    w = await start_worker(sub)
    client.publish(topic, [b"x"])
    d = w.dispatchers[sub.key]
    await eventually(lambda: d.stats.acked == 1, timeout=5, what="ack on 102")
    assert len(seen) == 1 and d.stats.retried == 0
    server.close()


@pytest.mark.parametrize("status", [301, 400, 404, 409, 429, 500, 503])
async def test_non_ack_status_is_retried_then_dead_lettered(start_worker, endpoint, client, topic, status):
    headers = {"Location": "http://127.0.0.1:1/elsewhere"} if status == 301 else {}
    endpoint.behaviour = lambda rec: web.Response(status=status, headers=headers)
    dlq = topic + "-dlq"
    watcher = client.watch(dlq)
    sub = make_sub(topic, endpoint.url, max_deliver=3, dead_letter_topic=dlq)
    await start_worker(sub)
    [mid] = client.publish(topic, [b"doomed"], {"kind": "order"}, key="k1")
    [dead] = await asyncio.to_thread(Client.drain, watcher, 1)
    attempts = endpoint.by_id()[mid]
    assert [r.headers["Pubsub-Delivery-Attempt"] for r in attempts] == ["1", "2", "3"]
    assert dead.data() == b"doomed"
    assert dead.partition_key() == "k1"
    props = dead.properties()
    assert props["kind"] == "order"
    assert props["pubsub.original_message_id"] == mid
    assert props["pubsub.original_topic"] == topic
    assert props["pubsub.subscription"] == sub.name
    assert props["pubsub.delivery_attempts"] == "3"
    assert props["pubsub.last_status"] == str(status)


async def test_timeouts_retry_with_growing_delays_then_dead_letter(start_worker, endpoint, client, topic):
    async def hang(rec):
        await asyncio.sleep(5)
        return web.Response(status=204)

    endpoint.behaviour = hang
    dlq = topic + "-dlq"
    watcher = client.watch(dlq)
    from worker.model.subscriptions import RetryPolicy

    # Breaker off: alone on its subscription, this message's failures are every attempt the endpoint
    # gets, so its last attempt would wait for the breaker's decision (tests/test_breaker.py).
    sub = make_sub(topic, endpoint.url, ack_deadline_seconds=1, max_deliver=4, dead_letter_topic=dlq,
                   retry=RetryPolicy(0.2, 5.0), breaker=None)
    await start_worker(sub)
    [mid] = client.publish(topic, [b"slow"])
    [dead] = await asyncio.to_thread(Client.drain, watcher, 1, 40.0)
    assert dead.properties()["pubsub.last_status"] == "timeout"
    assert dead.properties()["pubsub.delivery_attempts"] == "4"
    times = [r.at for r in endpoint.by_id()[mid]]
    assert len(times) == 4
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # Each gap is the 1 s deadline plus a backoff drawn from a doubling ceiling; never below either.
    assert all(g >= 1.0 + 0.2 - 0.05 for g in gaps), gaps


async def test_refused_connection_is_retried_then_dead_lettered(start_worker, client, topic):
    from worker.broker.embedded import free_port

    dlq = topic + "-dlq"
    watcher = client.watch(dlq)
    sub = make_sub(topic, f"http://127.0.0.1:{free_port()}/nobody", max_deliver=2, dead_letter_topic=dlq)
    w = await start_worker(sub)
    client.publish(topic, [b"x"])
    [dead] = await asyncio.to_thread(Client.drain, watcher, 1)
    assert dead.properties()["pubsub.last_status"] == "connection_error"
    assert w.metrics.registry.get_sample_value(
        "pushworker_deliveries_total",
        {"project": sub.tenant, "subscription": sub.name, "result": "connection_error"}) == 2


async def test_without_dead_letter_topic_exhausted_messages_are_dropped_and_counted(
        start_worker, endpoint, client, topic):
    endpoint.behaviour = lambda rec: web.Response(status=500)
    sub = make_sub(topic, endpoint.url, max_deliver=2)
    w = await start_worker(sub)
    client.publish(topic, [b"x", b"y"])
    d = w.dispatchers[sub.key]
    await eventually(lambda: d.stats.dropped == 2, what="two drops")
    assert len(endpoint.requests) == 4
    assert w.metrics.registry.get_sample_value(
        "pushworker_messages_dropped_total", {"project": sub.tenant, "subscription": sub.name}) == 2


async def test_a_message_its_producer_encrypted_is_dead_lettered_with_what_decrypting_it_needs(
        start_worker, endpoint, client: Client, broker, redis_url, topic, tmp_path):
    """Pulsar's end-to-end encryption: the worker holds no key. The client's default for such a
    message (FAIL) kept it from the worker, unacked, with its flow permit: 60 of them ahead of plain
    messages (a prefetch queue of 50) stalled the subscription for good, nothing delivered, nothing
    logged but the client's own errors. Now each is dead-lettered unsent, with the data key and IV
    its reader needs beside the private key: decrypted here from the dead letter alone. A redrive
    does not send the ciphertext either: it dead-letters it again, context and all."""
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (tmp_path / "private.pem").write_bytes(private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()))
    (tmp_path / "public.pem").write_bytes(private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    config, settings = worker_yaml(tmp_path, broker.url, redis_url, push_sub(
        "sealed", topic, endpoint.url, max_ack_pending=50, dead_letter={"topic": topic + "-dlq"}))
    [sub] = settings.subscriptions
    dead = client.watch(topic + "-dlq")
    w = await start_worker(sub)
    keys = pulsar.CryptoKeyReader(str(tmp_path / "public.pem"), str(tmp_path / "private.pem"))
    encrypting = client.client.create_producer(topic, encryption_key="orders-key", crypto_key_reader=keys,
                                               batching_enabled=False)
    for i in range(60):
        encrypting.send_async(b"secret %d" % i, None)
    encrypting.flush()
    encrypting.close()
    plain = client.publish(topic, [b"plain %d" % i for i in range(20)])
    await eventually(lambda: set(plain) <= set(endpoint.by_id()), timeout=30, what="the plain messages")
    assert len(endpoint.requests) == 20  # nothing encrypted was sent
    await eventually(lambda: w.dispatchers[sub.key].stats.dead_lettered == 60, what="60 dead letters")
    letters = client.drain(dead, 60)
    assert len(letters) == 60 and {m.properties()["pubsub.last_status"] for m in letters} == {"unreadable"}
    context = json.loads(letters[0].properties()["pubsub.encryption_context"])
    [data_key] = context["keys"]
    assert data_key["key"] == "orders-key"
    key = private.decrypt(base64.b64decode(data_key["value"]),
                          padding.OAEP(mgf=padding.MGF1(hashes.SHA1()), algorithm=hashes.SHA1(), label=None))
    assert AESGCM(key).decrypt(base64.b64decode(context["param"]), letters[0].data(), None).startswith(b"secret ")
    code, out, err = await cli("dlq", "redrive", sub.name, "--config", config, "--rate", "1000", "--json")
    assert code == 0, err
    assert (json.loads(out)["redriven"], json.loads(out)["dead_lettered_again"]) == (0, 60)
    assert len(endpoint.requests) == 20
    again = client.drain(dead, 60)
    assert {m.properties()["pubsub.encryption_context"] for m in again} == {
        m.properties()["pubsub.encryption_context"] for m in letters}


async def test_retry_after_is_honoured_up_to_the_max(start_worker, endpoint, client, topic):
    calls: list[float] = []

    def answer(rec):
        calls.append(rec.at)
        if len(calls) == 1:
            return web.Response(status=429, headers={"Retry-After": "1"})
        return web.Response(status=204)

    endpoint.behaviour = answer
    from worker.model.subscriptions import RetryPolicy

    sub = make_sub(topic, endpoint.url, retry=RetryPolicy(0.01, 3.0))
    w = await start_worker(sub)
    client.publish(topic, [b"x"])
    await eventually(lambda: w.dispatchers[sub.key].stats.acked == 1, what="ack after Retry-After")
    assert calls[1] - calls[0] >= 0.95


async def test_max_ack_pending_bounds_concurrent_requests(start_worker, endpoint, client, topic):
    probe = ConcurrencyProbe()
    endpoint.behaviour = probe
    sub = make_sub(topic, endpoint.url, max_ack_pending=7)
    w = await start_worker(sub)
    client.publish(topic, [b"m%d" % i for i in range(60)])
    await eventually(lambda: w.dispatchers[sub.key].stats.acked == 60, what="all acked")
    assert probe.peak == 7


async def test_held_bytes_bound_a_subscription_of_large_messages(start_worker, endpoint, client, topic):
    """`max_ack_pending` counts messages: a subscription of large ones took a worker to 2 GiB (150
    of 4 MiB, measured), enough to kill a pod and then each next owner. The memory a subscription's
    messages take is bounded by `max_held_bytes_per_subscription`; a message larger than the
    bound goes alone, and nothing is lost."""
    current = peak = 0
    alone: list[int] = []  # requests under way, counted as the large message arrived

    async def slow(rec):
        nonlocal current, peak
        current += 1
        peak = max(peak, current)
        if len(rec.body) > 1 << 20:
            alone.append(current)
        await asyncio.sleep(0.1)
        current -= 1
        return web.Response(status=204)

    endpoint.behaviour = slow
    sub = make_sub(topic, endpoint.url, content="raw")  # max_ack_pending 1000: not what bounds here
    w = await start_worker(sub, max_held_bytes_per_subscription=1 << 20)
    small = 256 << 10
    payloads = [bytes([n]) * small for n in range(20)]
    client.publish(topic, [*payloads[:12], b"L" * (3 << 20), *payloads[12:]])
    # (Its consumer subscribes again with a prefetch of one meanwhile: tests/test_resources.py.)
    everything = {p[:1] for p in payloads} | {b"L"}
    await eventually(lambda: {r.body[:1] for r in endpoint.requests if r.acked} == everything, timeout=60,
                     what="all acked")
    assert peak == 2, peak  # 2 of 256 KiB fill 1 MiB: each counts twice (the client's copy and the worker's)
    assert alone == [1]
    assert len(endpoint.requests) == 21  # each once: the requests under way ended before the consumer changed
    # The counters (`subs list`) go on across the change of consumer.
    await eventually(lambda: sub.key in w.dispatchers and w.dispatchers[sub.key].stats.acked == 21,
                     what="21 acked by the subscription's counters")

