"""W3C trace context from the publisher to the endpoint: a message's `traceparent` and `tracestate`
properties arrive as the request's headers in every body format and at every attempt; a CloudEvent
carries them as its distributed-tracing extension too; a malformed one is not passed on as a header."""

from __future__ import annotations

import json

import pytest
from aiohttp import web
from cloudevents.http import from_http

from tests.support.builders import make_sub
from tests.support.endpoints import Endpoint, Received
from tests.support.helpers import eventually
from tests.support.pulsar_client import Client
from worker.core.messages import trace_headers
from worker.model.subscriptions import CloudEvents

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
STATE = "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"


@pytest.mark.parametrize("content, mode", [("wrapped", "binary"), ("raw", "binary"), ("gcp", "binary"),
                                           ("cloudevents", "binary"), ("cloudevents", "structured")])
async def test_the_publishers_trace_context_reaches_the_endpoint_at_every_attempt(
        start_worker, endpoint: Endpoint, client: Client, topic, content, mode):
    """The defaults otherwise; the first attempt fails (a 503), so the retry is seen carrying it too."""
    def answer(rec: Received) -> web.Response:
        return web.Response(status=503 if rec.headers["Pubsub-Delivery-Attempt"] == "1" else 204)

    endpoint.behaviour = answer
    sub = make_sub(topic, endpoint.url, content=content, cloudevents=CloudEvents(mode=mode))
    w = await start_worker(sub)
    [traced] = client.publish(topic, [b'{"order": 1}'], properties={"traceparent": PARENT, "tracestate": STATE,
                                                                   "content-type": "application/json"})
    [plain] = client.publish(topic, [b"x"], properties={"traceparent": "00-xyz"})  # malformed
    await eventually(lambda: w.dispatchers[sub.key].stats.acked == 2, what="both delivered")
    attempts = endpoint.by_id()[traced]
    assert [r.headers["Pubsub-Delivery-Attempt"] for r in attempts] == ["1", "2"]
    for r in attempts:
        assert (r.headers["traceparent"], r.headers["tracestate"]) == (PARENT, STATE)
    if content == "cloudevents":  # the distributed-tracing extension, in the event itself
        event = from_http(attempts[-1].headers, attempts[-1].body)
        assert (event["traceparent"], event["tracestate"]) == (PARENT, STATE)
    if content == "wrapped":  # the body keeps the properties as attributes, as before
        assert json.loads(attempts[-1].body)["message"]["attributes"]["traceparent"] == PARENT
    assert all("traceparent" not in r.headers for r in endpoint.by_id()[plain])


def test_only_a_well_formed_traceparent_is_passed_on_and_a_tracestate_only_beside_one():
    assert trace_headers({"traceparent": PARENT}) == {"traceparent": PARENT}
    assert trace_headers({"traceparent": PARENT, "tracestate": STATE}) == {"traceparent": PARENT, "tracestate": STATE}
    assert trace_headers({"tracestate": STATE}) == {}
    for bad in ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # version ff: invalid
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # all-zero trace id
                "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # all-zero parent id
                "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",  # upper case
                PARENT + "\r\nX-Injected: 1", PARENT + "-extra", ""):
        assert trace_headers({"traceparent": bad, "tracestate": STATE}) == {}, bad
    assert trace_headers({"traceparent": PARENT, "tracestate": "a=1\r\nX: 2"}) == {"traceparent": PARENT}
    assert trace_headers({"traceparent": PARENT, "tracestate": "a=" + "b" * 600}) == {"traceparent": PARENT}
