"""The Pulsar adapter on a real broker, on both of its paths: the fast one (pulsar-client's private
C++ consumer and message, verified with the pinned version) and the public asyncio API."""

from __future__ import annotations

import asyncio
import threading

import pulsar.asyncio as pulsar_async
import pytest

from tests.support.builders import make_sub
from tests.support.pulsar_client import Client
from worker.broker import consumer as consumer_module
from worker.broker.consumer import make_client, subscribe
from worker.core.pulsar_messages import to_envelope
from worker.model.config import PulsarSettings


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


async def test_fast_path_after_a_wait_skips_the_queue_and_keeps_order(broker, client: Client, topic):
    """After a receive that had to wait, receive_ready() answers None without asking the client (an
    empty queue costs it about 100 us per call); what arrives next is still taken in order, by
    receive() and the drains after it."""
    sub = make_sub(topic, "http://127.0.0.1:9/push")
    pulsar = make_client(PulsarSettings(), broker.url)
    try:
        consumer = await subscribe(pulsar, sub, "adapter-turns")
        waiting = asyncio.ensure_future(consumer.receive())
        await asyncio.sleep(0)  # the receive is registered with the client before anything is published
        first_id = client.publish(topic, [b"first"])[0]
        first = await asyncio.wait_for(waiting, 10)
        assert to_envelope(first).message_id == first_id
        assert consumer.receive_ready() is None  # it waited: the queue is not asked
        ids = client.publish(topic, [b"a", b"b", b"c"])
        taken: list[object] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while len(taken) < 3:
            assert loop.time() < deadline, "the published messages did not arrive"
            taken.append(await asyncio.wait_for(consumer.receive(), 10))
            while (ready := consumer.receive_ready()) is not None:
                taken.append(ready)
        assert [to_envelope(m).message_id for m in taken] == ids
        for message in (first, *taken):
            await consumer.acknowledge(message)
        await consumer.close()
    finally:
        await pulsar.close()


async def test_the_client_thread_keeps_its_python_thread_state_between_messages(broker, client: Client, topic,
                                                                               monkeypatch):
    """Messages that arrive while a receive waits come through a callback on the client's thread.
    That thread keeps one Python thread state instead of being given a new one per message: it
    takes it once, however many messages it hands over."""
    kept: list[int] = []
    keep = consumer_module._keep_thread_state

    def counted() -> None:
        kept.append(threading.get_ident())
        keep()

    monkeypatch.setattr(consumer_module, "_keep_thread_state", counted)
    sub = make_sub(topic, "http://127.0.0.1:9/push")
    pulsar = make_client(PulsarSettings(), broker.url)
    try:
        consumer = await subscribe(pulsar, sub, "adapter-thread-state")
        for n in range(4):
            waiting = asyncio.ensure_future(consumer.receive())
            await asyncio.sleep(0)  # the receive is registered with the client before the message is published
            [message_id] = client.publish(topic, [f"m{n}".encode()])
            message = await asyncio.wait_for(waiting, 10)
            assert to_envelope(message).message_id == message_id
            await consumer.acknowledge(message)
        assert kept, "no message came through the client's thread"
        assert len(kept) == len(set(kept)), f"a client thread took a new thread state per message: {kept}"
        await consumer.close()
    finally:
        await pulsar.close()


def test_broker_errors_are_named_and_classified():
    import pulsar

    from worker.broker.consumer import answered_by_broker, broker_error_text, transient

    dropped = pulsar_async.PulsarException(pulsar.Result(46))  # the C++ client's Disconnected: "46 ???"
    assert broker_error_text(dropped) == "no answer from the broker (Disconnected)" and transient(dropped)
    refused = pulsar_async.PulsarException(pulsar.Result.AuthorizationError)
    assert broker_error_text(refused) == "the broker answered AuthorizationError"
    assert not transient(refused) and answered_by_broker(refused)
    timeout = pulsar_async.PulsarException(pulsar.Result.Timeout)
    assert transient(timeout) and not answered_by_broker(timeout)
    assert broker_error_text(timeout) == "no answer from the broker (Timeout)"
    assert broker_error_text(ValueError("x")) == "ValueError: x" and not transient(ValueError("x"))
    # The blocking client (publish, the dead-letter republish's cursor) raises a class per result.
    assert broker_error_text(pulsar.Timeout("Pulsar error: TimeOut")) == "no answer from the broker (Timeout)"
    assert broker_error_text(pulsar.TopicNotFound("x")) == "the broker answered TopicNotFound"
    assert answered_by_broker(pulsar.TopicNotFound("x")) and not answered_by_broker(pulsar.Timeout("x"))
    assert not answered_by_broker(dropped)  # a dropped connection is no answer (it once counted as one)
