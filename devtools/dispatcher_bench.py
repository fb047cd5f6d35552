"""`make bench --section dispatcher`: the dispatcher's own CPU per message, by subscription type.

The consumer, the attempt store and the endpoint are in memory (each call still a real await on
uvloop, the collector tuned as in the worker), so the figure holds only what the dispatcher adds:
ordering lanes, the window, the adaptive endpoint limit, metrics, history entries. The types run
interleaved and each is read against shared in the same runs: with no broker, Redis or sink beside
it, a difference of a few microseconds a message shows, where the end-to-end cases cannot show a
tenth (key-shared cost 3.6-4.0 us a message more than shared before 2026-12-03, -0.6 to +1.2 after).
"""

from __future__ import annotations

import asyncio
import gc
import ssl
import statistics
import time
from typing import Any

import uvloop

from worker import telemetry
from worker.broker.deadletter import DeadLetterPublisher
from worker.core.attempts import AttemptRecord
from worker.core.delivery import Outcome, Result
from worker.core.dispatcher import DeliveryContext, Dispatcher
from worker.core.messages import Envelope, PushRequest
from worker.core.metrics import Metrics
from worker.model.config import TracingSettings, parse_settings
from worker.model.subscriptions import Subscription
from worker.runtime import logs
from worker.runtime.collector import GC_THRESHOLD

CASES = (("shared", 0), ("key-shared", 1000), ("exclusive", 0))  # (type, keys)


class _Backlog:
    """A consumer holding `count` messages, all at hand at once (a burst)."""

    def __init__(self, count: int) -> None:
        self.count, self.taken, self.acked = count, 0, 0
        self.all_acked = asyncio.Event()

    async def receive(self) -> int:
        if self.taken >= self.count:
            await asyncio.Event().wait()
        return self.receive_ready() or 0

    def receive_ready(self) -> int | None:
        if self.taken >= self.count:
            return None
        self.taken += 1
        return self.taken

    async def acknowledge(self, message: Any) -> None:
        self.acked += 1
        if self.acked == self.count:
            self.all_acked.set()

    async def negative_acknowledge(self, message: Any) -> None:
        pass

    async def unsubscribe(self) -> None:
        pass

    async def close(self) -> None:
        pass


class _Attempts:
    """Every message on its first attempt; records go nowhere."""

    async def begin(self, subscription_key: str, message_id: str, probe: bool = False) -> AttemptRecord:
        return AttemptRecord(1, "")

    async def begin_all(self, subscription_key: str, message_ids: list[str],
                        probe: bool = False) -> list[AttemptRecord]:
        return [AttemptRecord(1, "") for _ in message_ids]

    def failing_reason(self, subscription_key: str) -> str:
        return ""

    async def settled(self, subscription_key: str, message_id: str) -> bool:
        return False

    async def unsent(self, subscription_key: str, message_ids: list[str]) -> None:
        pass

    def record(self, subscription_key: str, message_id: str, entries: list[dict[str, Any]],
               settled: bool, last_status: str = "", acked_first_time: bool = False,
               lazy: bool = False) -> asyncio.Future[None]:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    def record_all(self, subscription_key: str, messages: list[tuple[str, list[dict[str, Any]], bool]],
                   settled: bool, last_status: str = "", lazy: bool = False) -> asyncio.Future[None]:
        return self.record(subscription_key, "", [], settled)

    async def close(self) -> None:
        pass


class _Endpoint:
    """Acks every request after one turn of the loop."""

    async def attempt(self, url: str, request: PushRequest, deadline: float, credentials: bool = False,
                      owner: str = "", tls: ssl.SSLContext | None = None) -> Outcome:
        await asyncio.sleep(0)
        return Outcome(Result.ACK, 204, 0.001)


async def _cpu_per_message(kind: str, keys: int, messages: int, window: int,
                           tracing: TracingSettings | None = None) -> float:
    """CPU per message, every thread (a tracer's exporter included)."""
    sub = Subscription(name=f"bench-{kind}", topic="persistent://p-bench/main/dispatcher",
                       url="http://127.0.0.1:9/push", type=kind, max_ack_pending=window)
    backlog = _Backlog(messages)
    metrics = Metrics()
    ctx = DeliveryContext(_Endpoint(), _Attempts(), DeadLetterPublisher(None), metrics)
    if tracing is not None:
        ctx.tracer = telemetry.start(tracing, metrics)

    def envelope(n: int) -> Envelope:
        return Envelope(str(n), b"x", sub.topic, 0, ordering_key=f"key-{n % keys}" if keys else None)

    dispatcher = Dispatcher(sub, backlog, envelope, ctx)
    gc.collect()  # the garbage of the run before is not this one's cost
    started = time.process_time()
    dispatcher.start()
    await backlog.all_acked.wait()
    if ctx.tracer is not None:  # its spans exported within the measure: they are a message's cost
        await ctx.tracer.close()
    cpu = time.process_time() - started
    await dispatcher.stop(1.0)
    return 1e6 * cpu / messages


async def _measure(messages: int, window: int, runs: int) -> dict[str, list[float]]:
    figures: dict[str, list[float]] = {kind: [] for kind, _ in CASES}
    for _ in range(runs):  # interleaved: a drift of the machine's speed touches every type alike
        for kind, keys in CASES:
            figures[kind].append(await _cpu_per_message(kind, keys, messages, window))
    return figures


def tracing_cost(collector: str, ratios: tuple[float, ...], messages: int = 40000, window: int = 64,
                 runs: int = 9) -> dict[float, list[float]]:
    """What a tracer sampling each of `ratios` of new traces, exporting to `collector` (a process of
    its own), adds to the shared case's CPU per message: in each run, against a run without one
    right before it (a machine's speed drifts between runs; a pair shares its moment). The
    end-to-end cases vary by a tenth from run to run; this shows a microsecond."""
    async def measure() -> dict[float, list[float]]:
        added: dict[float, list[float]] = {ratio: [] for ratio in ratios}
        for _ in range(runs):
            for ratio in ratios:
                settings = parse_settings({"tracing": {"endpoint": collector, "sample_ratio": ratio}}, env={}).tracing
                off = await _cpu_per_message("shared", 0, messages, window)
                added[ratio].append(await _cpu_per_message("shared", 0, messages, window, settings) - off)
        return added

    logs.configure("json", "error")
    previous = gc.get_threshold()
    gc.set_threshold(*GC_THRESHOLD)
    try:
        return uvloop.run(measure())
    finally:
        gc.set_threshold(*previous)


def report(messages: int = 40000, window: int = 64, runs: int = 7) -> str:
    """Run the cases on a loop of their own (uvloop, as the worker) and describe them."""
    logs.configure("json", "error")
    previous = gc.get_threshold()
    gc.set_threshold(*GC_THRESHOLD)  # as the worker runs; the bench's own process gets its setting back
    try:
        figures = uvloop.run(_measure(messages, window, runs))
    finally:
        gc.set_threshold(*previous)
    shared = statistics.median(figures["shared"])
    lines = [f"dispatcher alone (in-memory consumer, attempt store and endpoint; {messages} messages, "
             f"window {window}, {runs} interleaved runs): CPU per message, median"]
    for kind, keys in CASES:
        median = statistics.median(figures[kind])
        label = f"{kind} ({keys:,} keys)" if keys else kind
        lines.append(f"  {label:24s} {median:5.1f} us  {median - shared:+5.1f} us against shared  "
                     f"(runs {', '.join(f'{x:.1f}' for x in figures[kind])})")
    return "\n".join(lines) + "\n"
