"""`make demo`: the whole path on the embedded default, in under a minute.

Starts the embedded broker and Redis (through an ordinary `Worker` with no URLs configured), a
local endpoint that fails some requests, and a push subscription with a dead-letter topic; then
publishes messages, shows progress live and prints a summary. The console stays up after it, on
loopback with a demo-only token, until Ctrl-C (`--no-console`: the summary ends the demo).
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import signal
import time
from pathlib import Path

import pulsar
from aiohttp import web
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn

from devtools.endpoints import serve_local
from worker.api.server import AdminServer
from worker.broker import embedded
from worker.core.messages import format_message_id
from worker.endpoint.destinations import DestinationPolicy
from worker.model.admin_settings import AdminSettings, Grants, StaticToken
from worker.model.config import HttpSettings, Settings, parse_settings
from worker.model.subscriptions import parse_subscription
from worker.process.service import Worker
from worker.runtime import logs

TOPIC = "persistent://p-demo/main/orders"
DLQ = "persistent://p-demo/main/orders-dlq"


class FlakyEndpoint:
    """Acks most messages; every 20th payload always fails (it will be dead-lettered); others fail
    now and then with 500, 503 + Retry-After, or a slow answer past the deadline."""

    def __init__(self) -> None:
        self.requests = 0
        self.acked_ids: set[str] = set()
        self.rng = random.Random(7)

    async def handle(self, request: web.Request) -> web.Response:
        self.requests += 1
        body = await request.json()
        payload_index = int(request.headers.get("Pubsub-Message-Id", "0:0").split(":")[1])
        if payload_index % 20 == 0:
            return web.Response(status=500, text="this one always fails")
        roll = self.rng.random()
        if roll < 0.15:
            return web.Response(status=500)
        if roll < 0.20:
            return web.Response(status=503, headers={"Retry-After": "1"})
        if roll < 0.23:
            await asyncio.sleep(1.5)  # past the 1 s ack deadline: a timeout (the worker stopped waiting,
            return web.Response(status=204)  # so this answer acks nothing)
        self.acked_ids.add(body["message"]["message_id"])
        return web.Response(status=204)


async def run_demo(messages: int = 300, console: bool = True) -> int:
    logs.configure("console", "error")  # the progress line tells the story
    state_dir = Path(".push-worker/demo")
    lock = embedded.lock_state_dir(state_dir)  # a demo running here already: refused, nothing wiped
    try:
        embedded.clear_state_dir(state_dir)  # a fresh start each time
    finally:
        os.close(lock)  # the worker below holds it again
    endpoint = FlakyEndpoint()
    runner, port = await serve_local("/hook", endpoint.handle)

    # Read as a config file's subscription is (its definition kept): the console shows it as one.
    sub = parse_subscription({
        "name": "orders-push", "topic": TOPIC, "ack_deadline_seconds": 1, "max_deliver": 4, "max_ack_pending": 100,
        "retry": {"min_backoff_seconds": 0.2, "max_backoff_seconds": 2.0}, "dead_letter": {"topic": DLQ},
        "deliver": {"mode": "push", "push": {"url": f"http://127.0.0.1:{port}/hook"}}}, trusted=True)
    token = _console_token(state_dir)
    admin = AdminSettings(port=embedded.free_port(), refresh_seconds=5,
                          tokens=(StaticToken("demo", str(state_dir / "console-token"), Grants(admin=True)),))
    # Traces as a worker takes them: OTEL_EXPORTER_OTLP_ENDPOINT and the other standard variables.
    tracing = parse_settings({}, env=os.environ).tracing
    settings = Settings(state_dir=state_dir, http=HttpSettings(port=0),
                        destinations=DestinationPolicy(allow_private=True), subscriptions=(sub,),
                        shutdown_grace_seconds=5, admin=admin if console else None, tracing=tracing)
    started = time.monotonic()
    print(f"demo: embedded broker + Redis under {state_dir}, endpoint on port {port}")
    if tracing.enabled:
        print(f"traces: every attempt a span, sent to {tracing.traces_url}; a dead-lettered message's attempts "
              "and its dead letter are one trace (service push-worker)")
    else:
        print("traces: off; to follow each message through its attempts, run a collector taking OTLP on port 4318 "
              "(Jaeger, Tempo: docs/observability.md#traces) and OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 "
              "make demo")
    async with Worker(settings, worker_id="demo") as worker:
        assert worker.status is not None
        print(f"metrics: http://127.0.0.1:{worker.status.port}/metrics")
        published = await asyncio.to_thread(_publish, worker.pulsar_url, messages)
        await _progress(worker, sub.key, messages, started)
        dead = await asyncio.to_thread(_dead_letters, worker.pulsar_url)
        stats = worker.dispatchers[sub.key].stats
        elapsed = time.monotonic() - started
        lost = _summary(published, endpoint, dead, stats.retried, elapsed)
        if console:
            await _console_until_stopped(admin, settings, worker, token)
    await runner.cleanup()
    return 0 if not lost else 1


def _console_token(state_dir: Path) -> str:
    """The demo's only token: a fresh one each run, in a file its user alone reads (the admin process
    reads tokens from files, as from a mounted secret)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / "console-token"
    token = secrets.token_urlsafe(24)
    path.write_text(token)
    path.chmod(0o600)
    return token


async def _console_until_stopped(admin: AdminSettings, settings: Settings, worker: Worker, token: str) -> None:
    """The console on loopback with the demo's token, until Ctrl-C (or SIGTERM)."""
    server = AdminServer(admin, settings, worker.redis_url, worker.pulsar_url)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        print(f"\nconsole: http://127.0.0.1:{server.port}/console/")
        print(f"  log in with the demo-only token {token} (admin of every project; a new one each run)")
        print("  the subscription, its failed messages and dead letters are there; Ctrl-C stops the demo",
              flush=True)
        await stop.wait()
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        await server.close()
    print("demo stopped")


def _summary(published: set[str], endpoint: FlakyEndpoint, dead: set[str], retried: int, elapsed: float) -> set[str]:
    """The summary lines; returns the lost ids."""
    print("\nsummary")
    # Lost is counted from outside the worker: what was published, less what the endpoint acked and
    # what the dead-letter topic holds (by original message id).
    lost = published - endpoint.acked_ids - dead
    print(f"  published        {len(published)}")
    print(f"  delivered        {len(published & endpoint.acked_ids)} (acked by the endpoint)")
    print(f"  dead-lettered    {len(published & dead)} (on {DLQ})")
    print(f"  retries          {retried} (failed attempts tried again)")
    print(f"  endpoint calls   {endpoint.requests}")
    print(f"  elapsed          {elapsed:.1f}s")
    print(f"  lost             {len(lost)}", flush=True)
    return lost


def _publish(url: str, messages: int) -> set[str]:
    """Publish the demo's messages; returns their ids as the endpoint sees them."""
    client = pulsar.Client(url, logger=_quiet())
    ids: set[str] = set()

    def sent(result: pulsar.Result, mid: pulsar.MessageId) -> None:
        if result == pulsar.Result.Ok:
            ids.add(format_message_id(mid))

    try:
        # Subscribe to the dead-letter topic first so nothing parked there is missed.
        client.subscribe(DLQ, "demo-inspector", initial_position=pulsar.InitialPosition.Earliest).close()
        producer = client.create_producer(TOPIC, batching_enabled=False)
        for i in range(messages):
            if i % 25 == 0:
                time.sleep(0.1)  # paced, so the progress line has something to show
            producer.send_async(f'{{"order": {i}}}'.encode(), sent, properties={"kind": "order"},
                                partition_key=f"customer-{i % 7}")
        producer.flush()
        return ids
    finally:
        client.close()


def _dead_letters(url: str) -> set[str]:
    """The original ids of the messages on the dead-letter topic."""
    client = pulsar.Client(url, logger=_quiet())
    try:
        consumer = client.subscribe(DLQ, "demo-inspector")
        out: set[str] = set()
        while True:
            try:
                msg = consumer.receive(timeout_millis=500)
            except pulsar.Timeout:
                return out
            out.add(msg.properties().get("pubsub.original_message_id", ""))
            consumer.acknowledge(msg)
    finally:
        client.close()


def _quiet() -> pulsar.ConsoleLogger:
    return pulsar.ConsoleLogger(pulsar.LoggerLevel.Error)


async def _progress(worker: Worker, key: str, total: int, started: float, limit: float = 50.0) -> None:
    """A live bar on a terminal (rich); elsewhere (a log, CI) a line every 2 seconds and at the end."""
    console = Console()
    live = console.is_terminal
    printed_at = 0.0
    columns = (TextColumn("  "), BarColumn(bar_width=30), TextColumn("{task.description}"))
    with Progress(*columns, console=console, disable=not live, transient=False) as bar:
        task = bar.add_task("", total=total)
        while time.monotonic() - started < limit:
            dispatcher = worker.dispatchers.get(key)
            if dispatcher is not None:
                s = dispatcher.stats
                done = s.settled
                line = (f"{done}/{total} settled  delivered={s.acked} retries={s.retried} "
                        f"dead-lettered={s.dead_lettered} unsettled={dispatcher.unsettled}")
                # Settled is counted when the outcome is known; the window slot frees a moment later
                # (the broker's ack), so the last line waits for unsettled=0 rather than show 300/300 and 1.
                final = done >= total and (dispatcher.unsettled == 0 or time.monotonic() - started >= limit - 1)
                if live:
                    bar.update(task, completed=done, description=line)
                elif final or (done < total and time.monotonic() - printed_at >= 2.0):
                    console.print(f"  {line}", highlight=False, soft_wrap=True)
                    printed_at = time.monotonic()
                if final:
                    return
            await asyncio.sleep(0.2)
