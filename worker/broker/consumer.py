"""Pulsar adapter: one client per worker, one consumer per owned subscription, plain `Envelope`s out."""

from __future__ import annotations

import asyncio
import ctypes
import functools
import os
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pulsar
import pulsar.asyncio as pulsar_async

from worker.core.budgets import default_prefetch
from worker.model.config import PulsarSettings
from worker.model.subscriptions import Subscription
from worker.runtime import logs

# A subscription served by one worker has one consumer, and the worker enforces per-key order itself
# (the dispatcher's lanes), so key-shared needs no broker-side key routing there: a Shared consumer redelivers
# unacked messages in position order, which keeps per-key order across a handover. Measured on
# pulsar-lite: its Key_Shared stalls redelivery after a reconnect (4 of 50 unacked came back) and
# its Failover redelivers when individual acks arrive out of order (1,000 published, 1,488
# delivered), which parallel key lanes do. exclusive/failover ack strictly in order (one lane).
CONSUMER_TYPES = {
    "shared": pulsar.ConsumerType.Shared,
    "key-shared": pulsar.ConsumerType.Shared,
    "exclusive": pulsar.ConsumerType.Exclusive,
    "failover": pulsar.ConsumerType.Failover,
}


PUSH_CONSUMER_PROPERTY = "push-worker"  # the consumer property deploy/pulsar-guard looks for


def consumer_type(sub: Subscription) -> Any:
    """The Pulsar consumer type `sub` is consumed with. A key-shared subscription that may spread
    over several workers (`max_workers` > 1) needs the broker's key routing to keep a key on one of
    them: Key_Shared (auto-split), whose rules for a joining consumer keep per-key order while workers
    come and go. Its producers must batch by key, or not at all (Pulsar's rule for Key_Shared)."""
    if sub.type == "key-shared" and sub.max_workers > 1:
        return pulsar.ConsumerType.KeyShared
    return CONSUMER_TYPES[sub.type]


def quiet_logger() -> Any:
    """For operator commands: the client's own log lines would bury the command's one-line answer
    (a dead broker prints a line per reconnect); its failures surface as exceptions instead."""
    return pulsar.FileLogger(pulsar.LoggerLevel.Error, os.devnull)


def make_client(settings: PulsarSettings, service_url: str, operator: bool = False) -> pulsar_async.Client:
    """An asyncio Pulsar client; TLS hostnames are verified."""
    return pulsar_async.Client(service_url, **client_options(settings, operator))


def client_options(settings: PulsarSettings, operator: bool = False) -> dict[str, Any]:
    """What every Pulsar client of the worker and its commands is given, the asyncio and the
    blocking one alike: timeouts, logging, TLS trust (hostnames verified) and the token."""
    kwargs: dict[str, Any] = {
        "operation_timeout_seconds": settings.operation_timeout_seconds,
        # The C++ client's own log lines, as structured events of the worker's log (logs.py says why
        # through a pipe and not a Python logger).
        "logger": quiet_logger() if operator else pulsar.FileLogger(pulsar.LoggerLevel.Warn,
                                                                   logs.pulsar_client_log_path()),
        "tls_validate_hostname": True,
        "tls_allow_insecure_connection": False,
    }
    if settings.tls_trust_certs_file:
        kwargs["tls_trust_certs_file_path"] = settings.tls_trust_certs_file
    if settings.auth_token:
        kwargs["authentication"] = pulsar.AuthenticationToken(settings.auth_token)
    return kwargs


@asynccontextmanager
async def open_client(settings: PulsarSettings) -> AsyncIterator[pulsar_async.Client]:
    """A client for a short operator task, closed (bounded) when it ends."""
    client = make_client(settings, settings.service_url or "", operator=True)
    try:
        yield client
    finally:
        await asyncio.wait_for(client.close(), timeout=5.0)


class PulsarConsumer:
    """One subscription's consumer as the dispatcher uses it, with a cheap hot path.

    The asyncio client completes every receive and ack through a callback that wakes the event loop
    from another thread: about 35 us of CPU per message (measured). Here a message the client
    already holds in its prefetch queue is handed over in the same turn (the C++ client calls back
    at once, on this thread), more of them are taken without waiting (`receive_ready`), and acks go
    straight to the client's ack grouping, which completes them at once: about 7 us per message.
    All of it uses the C++ consumer behind the asyncio wrapper; a client version without it gets the
    public path.
    """

    def __init__(self, consumer: pulsar_async.Consumer, fast_path: bool = True) -> None:
        self._consumer = consumer
        # Private parts of pulsar-client (verified with 3.13, pinned in pyproject.toml): the C++
        # consumer behind the wrapper and its receive_async, whose callback gets the C++ message.
        # Without them, everything goes through the public asyncio API.
        raw = getattr(consumer, "_consumer", None) if fast_path else None
        self._raw = raw if callable(getattr(raw, "receive_async", None)) else None
        # Whether the prefetch queue may hold more: asking an empty queue (receive(0)) costs about
        # 100 us (the C++ client's timeout travels as an exception), more than a whole delivery, so
        # it is asked only after a message was found waiting. A subscription of a few messages a
        # second then never asks in vain; a busy one drains its queue in bursts.
        self._maybe_more = False
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def fast_path(self) -> bool:
        return self._raw is not None

    async def receive(self) -> Any:
        if self._raw is None:
            return await self._consumer.receive()
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()  # kept: a lookup is a getpid() on Python 3.11
        future: asyncio.Future[Any] = loop.create_future()
        self._raw.receive_async(functools.partial(_received, loop, future, threading.get_ident()))
        self._maybe_more = future.done()  # completed during the call: the message was waiting
        return await future

    def receive_ready(self) -> Any | None:
        """A message the client already holds, or None (never waits)."""
        if self._raw is None or not self._maybe_more:
            return None
        try:
            return self._raw.receive(0)
        except pulsar.PulsarException:  # Timeout: nothing prefetched; anything else surfaces in receive()
            self._maybe_more = False
            return None

    async def acknowledge(self, message: Any) -> None:
        if self._raw is None:
            await self._consumer.acknowledge(message)
        else:
            self._raw.acknowledge(message)

    async def negative_acknowledge(self, message: Any) -> None:
        await self._consumer.negative_acknowledge(message)

    async def seek(self, position: int) -> None:
        await self._consumer.seek(position)

    async def unsubscribe(self) -> None:
        await self._consumer.unsubscribe()

    async def close(self) -> None:
        await self._consumer.close()


def _received(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], loop_thread: int,
              result: Any, message: Any) -> None:
    """receive_async's callback: on the loop's thread (the message was at hand) it completes the
    future at once; from the client's thread it goes through the loop."""
    if threading.get_ident() == loop_thread:
        _complete(future, result, message)
    else:
        if not hasattr(_client_thread, "kept"):
            _keep_thread_state()
        loop.call_soon_threadsafe(_complete, future, result, message)


# pybind11 gives a thread it did not start a Python thread state for each call into Python, and
# deletes it after the call. At a steady stream nearly every message arrives through a callback on
# the client's thread: a thread state, and the memory of its frame stack, made and freed per message
# (keeping it measured 12% less worker CPU at a steady 200 msg/s: docs/speed.md). One unmatched
# PyGILState_Ensure keeps the thread's state for as long as the thread lives (the client's threads
# live as long as the client); `kept`, held in that state, tells a thread that already keeps its own.
_client_thread = threading.local()


def _keep_thread_state() -> None:
    _client_thread.kept = True
    ctypes.pythonapi.PyGILState_Ensure()  # in a callback the GIL is held: this only counts one holder more


def _complete(future: asyncio.Future[Any], result: Any, message: Any) -> None:
    if future.done():  # cancelled meanwhile: the client redelivers what it handed to nobody on close
        return
    if result == pulsar.Result.Ok:
        future.set_result(message)
    else:
        future.set_exception(pulsar_async.PulsarException(result))


# Results that mean the broker did not answer (rather than refused): it is down or unreachable.
_UNREACHABLE = {pulsar.Result.Timeout, pulsar.Result.ConnectError, pulsar.Result.ServiceUnitNotReady,
                pulsar.Result.AlreadyClosed, pulsar.Result.NotConnected}


# Of those, the ones the client reports when nothing came back from the broker at all.
_SILENT = {pulsar.Result.Timeout, pulsar.Result.ConnectError, pulsar.Result.NotConnected}


# Codes of the C++ client that pulsar-client's Python enum does not name (shown as "46 ???").
_UNNAMED_RESULTS = {46: "Disconnected"}


def broker_result(error: BaseException) -> Any:
    """The client's result code of a failed broker call, or None for any other error. The async
    client's errors carry one; the blocking client's are a class per result, named like it."""
    result = getattr(error, "error", None)
    if callable(result):
        return result()
    if isinstance(error, pulsar.PulsarException) and type(error).__name__ in pulsar.Result.__members__:
        return getattr(pulsar.Result, type(error).__name__)
    return None


def result_name(code: Any) -> str:
    name = getattr(code, "name", None)
    return name if name and name != "???" else _UNNAMED_RESULTS.get(int(code), f"error {int(code)}")


def broker_error_text(error: BaseException) -> str:
    """A broker call's error as a person can read it: the result's name, not its number."""
    code = broker_result(error)
    if code is None:
        return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    # A timeout or a lost connection is the client's own verdict: saying the broker "answered" it
    # would send an operator looking at the broker's logs for a refusal that never happened.
    if code in _SILENT or int(code) in _UNNAMED_RESULTS:
        return f"no answer from the broker ({result_name(code)})"
    return f"the broker answered {result_name(code)}"


def _unreachable(code: Any) -> bool:
    return int(code) in _UNNAMED_RESULTS or code in _UNREACHABLE


def transient(error: BaseException) -> bool:
    """A broker error that trying again can mend: a dropped or refused connection, a timeout."""
    code = broker_result(error)
    return code is not None and _unreachable(code)


def answered_by_broker(error: BaseException) -> bool:
    """Whether a failed broker call got an answer from the broker (a refusal such as an unknown
    topic or missing permission) rather than no answer (timeout, connection refused, dropped)."""
    code = broker_result(error)
    return code is not None and not _unreachable(code)


async def subscribe(client: pulsar_async.Client, sub: Subscription, consumer_name: str,
                    receiver_queue_size: int | None = None, fast_path: bool = True) -> PulsarConsumer:
    """The subscription's one consumer, prefetching `receiver_queue_size` messages (by default as
    many as `max_ack_pending` allows: `prefetch.default_prefetch`)."""
    return PulsarConsumer(await client.subscribe(
        sub.topic,
        sub.pulsar_subscription,
        consumer_type=consumer_type(sub),
        initial_position=(pulsar.InitialPosition.Earliest if sub.start_from == "all"
                          else pulsar.InitialPosition.Latest),
        receiver_queue_size=receiver_queue_size or default_prefetch(sub.max_ack_pending),
        consumer_name=consumer_name,
        negative_ack_redelivery_delay_ms=1000,
        # An encrypted message the client cannot decrypt is handed over as it is (then dead-lettered
        # as a defect): the default (FAIL) kept it from the worker unacked, and its flow permit
        # with it; as many as the prefetch queue holds stalled the subscription for good.
        crypto_failure_action=pulsar.ConsumerCryptoFailureAction.CONSUME,
        # Says to the broker that this is a push consumer: deploy/pulsar-guard keeps messages that
        # declare more than a worker can take away from such consumers.
        properties={PUSH_CONSUMER_PROPERTY: "1"},
    ), fast_path)
