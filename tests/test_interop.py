"""Formats endpoints already understand, verified by those formats' own libraries at the endpoint:
the CloudEvents SDK parses every request of `content: cloudevents`, and a functions-framework
function (as Cloud Run / Cloud Functions run it) receives `content: gcp` requests as Pub/Sub events."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from cloudevents.http import from_http

from tests.support.builders import make_sub
from tests.support.endpoints import Endpoint
from tests.support.helpers import eventually
from tests.support.pulsar_client import Client
from worker.broker.embedded import free_port, terminate, wait_for_port
from worker.core.messages import Envelope, build_request, rfc3339
from worker.model.subscriptions import CloudEvents, parse_subscription
from worker.runtime.errors import ConfigError

ATTRIBUTES = {"content-type": "application/json", "region": "eu1", "Bad-Name": "x", "id": "spoof",
              "averyveryverylongattributename": "y"}


@pytest.mark.parametrize("mode", ["binary", "structured"])
async def test_cloudevents_requests_parse_with_the_official_sdk(
        start_worker, endpoint: Endpoint, client: Client, topic, mode):
    sub = make_sub(topic, endpoint.url, content="cloudevents", cloudevents=CloudEvents(mode=mode))
    w = await start_worker(sub)
    [json_id] = client.publish(topic, [b'{"order": 7}'], properties=ATTRIBUTES, key="cust-1")
    [bytes_id] = client.publish(topic, [b"\x00\xffraw"])
    await eventually(lambda: w.dispatchers[sub.key].stats.acked == 2, what="both delivered")
    requests = endpoint.by_id()
    [as_json], [as_bytes] = requests[json_id], requests[bytes_id]

    event = from_http(as_json.headers, as_json.body)
    assert event["specversion"] == "1.0" and event["id"] == json_id
    assert event["source"] == f"//pulsar/{topic}" and event["type"] == "pubsub.message.published"
    assert event["time"] == as_json.headers["Pubsub-Publish-Time"]
    assert event["subject"] == "cust-1" and event["datacontenttype"] == "application/json"
    assert event.data == {"order": 7}
    assert event["region"] == "eu1" and event["deliveryattempt"] == "1"
    attributes = event.get_attributes()
    assert "Bad-Name" not in attributes and "bad-name" not in attributes  # not a valid extension name
    assert "averyveryverylongattributename" not in attributes  # longer than 20
    assert as_json.headers["Pubsub-Message-Id"] == json_id  # the Pubsub-* headers stay
    assert as_json.headers["Content-Type"] == ("application/json" if mode == "binary"
                                               else "application/cloudevents+json")

    event = from_http(as_bytes.headers, as_bytes.body)
    assert event["id"] == bytes_id and "subject" not in event.get_attributes()
    if mode == "binary":
        assert event.data == b"\x00\xffraw"
    else:  # not JSON: data_base64
        assert json.loads(as_bytes.body)["data_base64"] == base64.b64encode(b"\x00\xffraw").decode()
        assert event.data == b"\x00\xffraw"


# Values a header cannot carry as they are: the HTTP binding (1.0.2, 3.1.3.2) percent-encodes them.
AWKWARD = {"spaced": "a b", "pct": "100% sure", "quoted": 'say "hi"', "accented": "café €", "emoji": "\U0001F600",
           "encodedlooking": "a%20b"}
SDK2_PYTHON = Path(sys.executable).parent.parent / "cloudevents2" / "bin" / "python"


def decode_with_sdk2(requests: list) -> list[dict]:
    """Each request decoded by the CloudEvents Python SDK 2.x (which percent-decodes binary-mode
    headers as the binding says), run in its own venv (`make install` creates it)."""
    if not SDK2_PYTHON.exists():
        pytest.skip("the CloudEvents SDK 2.x venv is missing: run make install")
    payload = json.dumps([{"headers": dict(r.headers), "body": base64.b64encode(r.body).decode()} for r in requests])
    decoded = subprocess.run([str(SDK2_PYTHON), str(Path(__file__).parent / "interop_cloudevents2.py")],
                             input=payload, capture_output=True, text=True, timeout=60)
    assert decoded.returncode == 0, decoded.stderr
    return list(json.loads(decoded.stdout))


@pytest.mark.parametrize("mode", ["binary", "structured"])
async def test_cloudevents_attributes_a_header_cannot_carry_arrive_exactly(
        start_worker, endpoint: Endpoint, client: Client, topic, mode):
    """Binary mode left out a subject or extension that was not printable ASCII (counted as omitted)
    and sent space, double quote and percent as they were, so a decoding SDK turned "a%20b" into
    "a b". Now every such value is percent-encoded, and the SDK that decodes reads it exactly."""
    sub = make_sub(topic, endpoint.url, content="cloudevents", cloudevents=CloudEvents(mode=mode))
    w = await start_worker(sub)
    [message_id] = client.publish(topic, [b'{"n": 1}'], key="café 7 % \"x\"",
                                  properties={"content-type": "application/json", **AWKWARD, "ctl": "a\u0007b"})
    await eventually(lambda: w.dispatchers[sub.key].stats.acked == 1, what="delivered")
    [request] = endpoint.by_id()[message_id]
    if mode == "binary":
        assert all(value.isascii() and " " not in value for name, value in request.headers.items()
                   if name.lower().startswith("ce-")), request.headers
    [event] = decode_with_sdk2([request])
    attributes = event["attributes"]
    assert {name: attributes.get(name) for name in AWKWARD} == AWKWARD
    assert attributes["subject"] == "café 7 % \"x\"" and attributes["id"] == message_id
    assert "ctl" not in attributes  # a control character is not allowed in a CloudEvents string
    assert event["data"] == {"n": 1} and attributes["deliveryattempt"] == "1"
    omitted = w.metrics.registry.get_sample_value(
        "pushworker_attributes_omitted_total", {"project": sub.tenant, "subscription": sub.name})
    assert omitted == 1  # the control character's attribute only


def test_cloudevents_type_and_source_are_configured_and_checked():
    doc = {"name": "ce", "topic": "persistent://p-a/main/t",
           "deliver": {"mode": "push", "push": {"url": "https://example.com/h", "content": "cloudevents",
                                                "cloudevents": {"mode": "structured", "type": "com.example.order",
                                                                "source": "/orders"}}}}
    sub = parse_subscription(doc)
    env = Envelope("1:2:-1:-1", b"x", sub.topic, 1_700_000_000_123)
    body = orjson.loads(build_request(sub, env, 3).body)
    assert (body["type"], body["source"], body["deliveryattempt"]) == ("com.example.order", "/orders", "3")
    doc["deliver"]["push"]["cloudevents"]["type"] = "has spaces"
    with pytest.raises(ConfigError, match=r"cloudevents.*type: must be 1-256 visible ASCII"):
        parse_subscription(doc)
    doc["deliver"]["push"]["content"] = "raw"
    doc["deliver"]["push"]["cloudevents"] = {"mode": "binary"}
    with pytest.raises(ConfigError, match=r"cloudevents: is only for content: cloudevents"):
        parse_subscription(doc)


def test_gcp_body_follows_googles_push_shape_and_leaves_empty_fields_out():
    sub = make_sub("persistent://p-shop/main/orders", "https://example.com/h", name="orders-push", content="gcp")
    full = orjson.loads(build_request(sub, Envelope("1:2:-1:-1", b"hi", sub.topic, 1_700_000_000_123,
                                                    {"a": "b"}, "k"), 2).body)
    published = rfc3339(1_700_000_000_123)
    assert full == {"message": {"data": "aGk=", "attributes": {"a": "b"}, "messageId": "1:2:-1:-1",
                                "message_id": "1:2:-1:-1", "publishTime": published, "publish_time": published,
                                "orderingKey": "k"},
                    "subscription": "projects/p-shop/subscriptions/orders-push", "deliveryAttempt": 2}
    empty = orjson.loads(build_request(sub, Envelope("1:3:-1:-1", b"", sub.topic, 1_700_000_000_123), 1).body)
    assert set(empty["message"]) == {"messageId", "message_id", "publishTime", "publish_time"}


async def test_a_functions_framework_function_receives_gcp_requests_as_pubsub_events(
        start_worker, client: Client, topic, tmp_path):
    port = free_port()
    received = tmp_path / "received.jsonl"
    function = subprocess.Popen(
        [str(Path(sys.executable).parent / "functions-framework"), "--source", str(Path(__file__).parent /
         "interop_function.py"), "--target", "receive", "--signature-type", "cloudevent",
         "--host", "127.0.0.1", "--port", str(port)],
        env={**os.environ, "RECEIVED_FILE": str(received)}, stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "function.log", "wb"))  # noqa: SIM115 - owned by the child
    try:
        wait_for_port(port, function, "functions-framework", 30)
        sub = make_sub(topic, f"http://127.0.0.1:{port}/", content="gcp")
        w = await start_worker(sub)
        ids = client.publish(topic, [b'{"n": 1}', b"\x00binary"], properties={"origin": "test", "kind": "order"})
        await eventually(lambda: w.dispatchers[sub.key].stats.acked == 2, what="both accepted by the function")
    finally:
        terminate(function, 10)
    events = [json.loads(line) for line in received.read_text().splitlines()]
    assert sorted(e["id"] for e in events) == sorted(ids)
    for event, payload in zip(sorted(events, key=lambda e: ids.index(e["id"])), (b'{"n": 1}', b"\x00binary"),
                              strict=True):
        assert event["type"] == "google.cloud.pubsub.topic.v1.messagePublished"
        message = event["data"]["message"]
        assert base64.b64decode(message["data"]) == payload
        assert message["attributes"] == {"origin": "test", "kind": "order"}
