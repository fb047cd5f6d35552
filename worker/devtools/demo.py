"""`make demo`: the whole path on the embedded default, in under a minute.

Starts the embedded broker and Redis (through an ordinary `Worker` with no URLs configured), a
local endpoint that fails some requests, and a push subscription with a dead-letter topic; then
publishes messages, shows progress live and prints a summary.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import sys
import time
from pathlib import Path

import pulsar
from aiohttp import web

from worker import logs
from worker.config import HttpSettings, Settings
from worker.destinations import DestinationPolicy
from worker.devtools.endpoints import serve_local
from worker.service import Worker
from worker.subscriptions import RetryPolicy, Subscription

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
            await asyncio.sleep(1.5)  # past the 1 s ack deadline: a timeout
        self.acked_ids.add(body["message"]["message_id"])
        return web.Response(status=204)


async def run_demo(messages: int = 300) -> int:
    logs.configure("console", "error")  # the progress line tells the story
    state_dir = Path(".push-worker/demo")
    shutil.rmtree(state_dir, ignore_errors=True)
    endpoint = FlakyEndpoint()
    runner, port = await serve_local("/hook", endpoint.handle)

    sub = Subscription(
        name="orders-push", topic=TOPIC, url=f"http://127.0.0.1:{port}/hook", ack_deadline_seconds=1,
        max_deliver=4, max_ack_pending=100, retry=RetryPolicy(0.2, 2.0), dead_letter_topic=DLQ,
    )
    settings = Settings(state_dir=state_dir, http=HttpSettings(port=0),
                        destinations=DestinationPolicy(allow_private=True), subscriptions=(sub,),
                        shutdown_grace_seconds=5)
    started = time.monotonic()
    print(f"push-worker demo: embedded broker + Redis under {state_dir}, endpoint on port {port}")
    async with Worker(settings, worker_id="demo") as worker:
        assert worker.status is not None
        print(f"metrics: http://127.0.0.1:{worker.status.port}/metrics")
        dlq_count = await asyncio.to_thread(_publish_and_watch_dlq, worker.pulsar_url, messages)
        await _progress(worker, sub.key, messages, started)
        dead = await asyncio.to_thread(_count_dead_letters, worker.pulsar_url, dlq_count)
        stats = worker.dispatchers[sub.key].stats
    await runner.cleanup()
    elapsed = time.monotonic() - started
    print("\nsummary")
    print(f"  published        {messages}")
    print(f"  delivered        {stats.acked}")
    print(f"  retried          {stats.retried} failed attempts retried")
    print(f"  dead-lettered    {stats.dead_lettered} (found on {DLQ}: {dead})")
    print(f"  endpoint calls   {endpoint.requests}")
    print(f"  elapsed          {elapsed:.1f}s")
    lost = messages - stats.acked - stats.dead_lettered
    print(f"  lost             {lost}")
    return 0 if lost == 0 and dead == stats.dead_lettered else 1


def _publish_and_watch_dlq(url: str, messages: int) -> int:
    client = pulsar.Client(url, logger=_quiet())
    try:
        # Subscribe to the dead-letter topic first so nothing parked there is missed.
        client.subscribe(DLQ, "demo-inspector", initial_position=pulsar.InitialPosition.Earliest).close()
        producer = client.create_producer(TOPIC, batching_enabled=False)
        for i in range(messages):
            if i % 25 == 0:
                time.sleep(0.1)  # paced, so the progress line has something to show
            producer.send_async(f'{{"order": {i}}}'.encode(), None, properties={"kind": "order"},
                                partition_key=f"customer-{i % 7}")
        producer.flush()
        return 0
    finally:
        client.close()


def _count_dead_letters(url: str, _: int) -> int:
    client = pulsar.Client(url, logger=_quiet())
    try:
        consumer = client.subscribe(DLQ, "demo-inspector")
        count = 0
        while True:
            try:
                msg = consumer.receive(timeout_millis=500)
            except pulsar.Timeout:
                return count
            count += 1
            consumer.acknowledge(msg)
    finally:
        client.close()


def _quiet() -> pulsar.ConsoleLogger:
    return pulsar.ConsoleLogger(pulsar.LoggerLevel.Error)


async def _progress(worker: Worker, key: str, total: int, started: float, limit: float = 50.0) -> None:
    while time.monotonic() - started < limit:
        dispatcher = worker.dispatchers.get(key)
        if dispatcher is not None:
            s = dispatcher.stats
            done = s.acked + s.dead_lettered + s.dropped
            bar = "#" * int(30 * done / total)
            sys.stdout.write(f"\r  [{bar:<30}] {done}/{total} settled  delivered={s.acked} "
                             f"retries={s.retried} dead-lettered={s.dead_lettered} "
                             f"in-flight={dispatcher.unsettled:<4}")
            sys.stdout.flush()
            if done >= total:
                return
        await asyncio.sleep(0.2)
