"""The Pulsar adapter on a real broker, on both of its paths: the fast one (pulsar-client's private
C++ consumer and message, verified with the pinned version) and the public asyncio API."""

from __future__ import annotations

import asyncio

import pulsar.asyncio as pulsar_async
import pytest

from tests.conftest import Client, make_sub
from worker.config import PulsarSettings
from worker.consumer import make_client, subscribe, to_envelope


@pytest.mark.parametrize("fast_path", [True, False])
async def test_receive_ack_and_nack_on_both_paths(broker, client: Client, topic, fast_path: bool):
    sub = make_sub(topic, "http://127.0.0.1:9/push")
    pulsar = make_client(PulsarSettings(), broker.url)
    try:
        consumer = await subscribe(pulsar, sub, "adapter-test", fast_path=fast_path)
        assert consumer.fast_path is fast_path
        ids = client.publish(topic, [b"a", b"b", b"c"], {"k": "v"}, key="key-1")
        first = await asyncio.wait_for(consumer.receive(), 10)
        taken = [first]
        while len(taken) < 3:
            ready = consumer.receive_ready()
            taken.append(ready if ready is not None else await asyncio.wait_for(consumer.receive(), 10))
        envelopes = [to_envelope(m) for m in taken]
        assert [e.message_id for e in envelopes] == ids
        assert envelopes[0].attributes == {"k": "v"} and envelopes[0].ordering_key == "key-1"
        for message in taken[:2]:
            await consumer.acknowledge(message)
        await consumer.negative_acknowledge(taken[2])  # comes back after the redelivery delay
        again = await asyncio.wait_for(consumer.receive(), 10)
        assert to_envelope(again).message_id == ids[2]
        await consumer.acknowledge(again)
        await consumer.close()
        reopened = await subscribe(pulsar, sub, "adapter-test-2", fast_path=fast_path)
        with pytest.raises((TimeoutError, pulsar_async.PulsarException)):
            await asyncio.wait_for(reopened.receive(), 1.5)  # everything was acked: nothing comes back
        await reopened.close()
    finally:
        await pulsar.close()


def test_broker_errors_are_named_and_classified():
    import pulsar

    from worker.consumer import answered_by_broker, broker_error_text, transient

    dropped = pulsar_async.PulsarException(pulsar.Result(46))  # the C++ client's Disconnected: "46 ???"
    assert broker_error_text(dropped) == "the broker answered Disconnected" and transient(dropped)
    refused = pulsar_async.PulsarException(pulsar.Result.AuthorizationError)
    assert broker_error_text(refused) == "the broker answered AuthorizationError"
    assert not transient(refused) and answered_by_broker(refused)
    timeout = pulsar_async.PulsarException(pulsar.Result.Timeout)
    assert transient(timeout) and not answered_by_broker(timeout)
    assert broker_error_text(ValueError("x")) == "ValueError: x" and not transient(ValueError("x"))
