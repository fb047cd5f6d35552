"""`python -m devtools soak`: a bounded run under mixed failures that counts what happened to every message.

A fleet of worker processes (embedded broker and Redis, or the ones configured) serves two push
subscriptions on one topic, one of them signed, while a publisher sends numbered messages at a
steady rate. Meanwhile the endpoint fails requests in every way it can (500, 503 with Retry-After,
timeouts, dropped connections, 102), some messages are poison (always refused: they must be
dead-lettered), workers are restarted one after another (SIGTERM and SIGKILL in turn; all SIGKILL
with --hard-kills), and Redis is restarted once. At the end it reports per subscription, each on its
own: published, delivered, duplicated (deliveries beyond the first), attempt-number regressions (a
request whose Pubsub-Delivery-Attempt is not above every earlier one of the same message),
dead-lettered (and dead letters beyond the first) and lost; the exit code is 0 only when nothing
was lost and no numbering went back.

pulsar-lite keeps a SIGKILLed worker's consumers and their unacked messages until it restarts (Apache
Pulsar releases them at once): when messages stay unsettled after the run, the soak restarts the
embedded broker once, says so, and then requires every message.

Not a CI test (it runs for minutes); `make soak` runs it for 60 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pulsar
import yaml
from aiohttp import web

from devtools import apache_pulsar
from devtools.endpoints import serve_local
from worker.broker import embedded
from worker.broker.embedded import free_port, terminate
from worker.ops.render import table

TOPIC = "persistent://p-soak/main/events"
SUBSCRIPTIONS = ("soak-shared", "soak-keyed")
POISON_EVERY = 97  # message numbers divisible by this are always refused


class ChaosEndpoint:
    """Records every acked delivery by (subscription, message number); fails the rest on purpose."""

    def __init__(self, seed: int = 11) -> None:
        self.rng = random.Random(seed)
        self.acked: dict[str, Counter[int]] = {s: Counter() for s in SUBSCRIPTIONS}
        self.highest_attempt: dict[str, dict[int, int]] = {s: {} for s in SUBSCRIPTIONS}
        self.regressions: dict[str, Counter[int]] = {s: Counter() for s in SUBSCRIPTIONS}
        self.requests = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        body = await request.read()
        number = int(body.split(b"#", 1)[1])
        sub = request.headers["Pubsub-Subscription"]
        attempt = int(request.headers["Pubsub-Delivery-Attempt"])
        if attempt <= self.highest_attempt[sub].get(number, 0):
            self.regressions[sub][number] += 1
        self.highest_attempt[sub][number] = max(attempt, self.highest_attempt[sub].get(number, 0))
        if number % POISON_EVERY == 0:
            return web.Response(status=422, text="poison")
        roll = self.rng.random()
        if roll < 0.08:
            return web.Response(status=500)
        if roll < 0.10:
            return web.Response(status=503, headers={"Retry-After": "1"})
        if roll < 0.12:
            await asyncio.sleep(2.5)  # past the 2 s deadline: the worker gives up on this attempt
            return web.Response(status=204)  # (it was not counted, so it is not acked here either)
        if roll < 0.14:
            assert request.transport is not None
            request.transport.abort()  # the connection drops before any answer
            return web.Response(status=204)
        self.acked[sub][number] += 1
        if roll < 0.19:
            return web.Response(status=102)
        return web.Response(status=204)


class Fleet:
    def __init__(self, workdir: Path, config: Path) -> None:
        self.workdir, self.config = workdir, config
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, worker_id: str) -> None:
        env = {**os.environ, "PUSH_WORKER_ID": worker_id, "PUSH_WORKER_HTTP_PORT": str(free_port()),
               "SOAK_SIGNING_SECRET": "soak-secret"}
        log = open(self.workdir / f"{worker_id}.log", "ab")  # noqa: SIM115 - the process owns it
        self.procs[worker_id] = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", "run", "--config", str(self.config)],
            stdout=log, stderr=log, env=env)

    def restart(self, worker_id: str, hard: bool) -> None:
        proc = self.procs[worker_id]
        if hard:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        else:
            terminate(proc, 30)
        self.start(worker_id)

    def stop(self) -> None:
        for proc in self.procs.values():
            terminate(proc, 30)


def _definitions(url: str, dlq: str) -> list[dict[str, Any]]:
    common = {"topic": TOPIC, "ack_deadline_seconds": 2, "max_deliver": 4, "max_ack_pending": 200,
              "retry": {"min_backoff_seconds": 0.2, "max_backoff_seconds": 2}}
    return [
        {**common, "name": SUBSCRIPTIONS[0], "type": "shared", "dead_letter": {"topic": dlq + "-shared"},
         "deliver": {"mode": "push", "push": {"url": url, "content": "raw",
                                               "signing_secrets": [{"env": "SOAK_SIGNING_SECRET"}]}}},
        {**common, "name": SUBSCRIPTIONS[1], "type": "key-shared", "dead_letter": {"topic": dlq + "-keyed"},
         "deliver": {"mode": "push", "push": {"url": url, "content": "raw"}}},
    ]


def _dead_letters(client: pulsar.Client, topic: str) -> Counter[int]:
    consumer = client.subscribe(topic, "soak-inspector", initial_position=pulsar.InitialPosition.Earliest)
    out: Counter[int] = Counter()
    while True:
        try:
            msg = consumer.receive(timeout_millis=1500)
        except pulsar.Timeout:
            consumer.close()
            return out
        out[int((msg.data() or b"#-1").split(b"#", 1)[1])] += 1
        consumer.acknowledge(msg)


async def run_soak(seconds: float = 60.0, workers: int = 2, rate: float = 40.0, hard_kills: bool = False) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="push-worker-soak-"))
    external = apache_pulsar.broker_from_environment(("p-soak",))
    broker: Any = external or embedded.start_pulsar(workdir / "pulsar", die_with_parent=True)
    redis = embedded.start_redis(workdir / "redis", die_with_parent=True)
    endpoint = ChaosEndpoint()
    runner, port = await serve_local("/hook", endpoint.handle)
    dlq = "persistent://p-soak/main/events-dlq"
    config = workdir / "worker.yaml"
    config.write_text(yaml.safe_dump({
        "pulsar": {"service_url": broker.url}, "redis": {"url": redis.url}, "state_dir": str(workdir / "state"),
        "destinations": {"allow_private": True}, "shutdown_grace_seconds": 5, "log": {"format": "json"},
        "fleet": {"name": "soak", "lease_seconds": 4, "heartbeat_seconds": 0.5},
        "subscriptions": _definitions(f"http://127.0.0.1:{port}/hook", dlq),
    }))
    client = pulsar.Client(broker.url, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
    for suffix in ("-shared", "-keyed"):  # subscribe first so every dead letter is seen
        client.subscribe(dlq + suffix, "soak-inspector", initial_position=pulsar.InitialPosition.Earliest).close()
    fleet = Fleet(workdir, config)
    for i in range(workers):
        fleet.start(f"soak-{i}")
    print(f"soak: {seconds:.0f}s, {workers} workers, {rate:g} msg/s, logs in {workdir}")
    published = 0
    started = time.monotonic()
    try:
        producer = client.create_producer(TOPIC, batching_enabled=False)
        next_restart, restarts, redis_restarted = started + seconds / (workers + 2), 0, False
        while time.monotonic() - started < seconds:
            producer.send_async(b"event#%d" % published, None, partition_key=f"k{published % 13}")
            published += 1
            now = time.monotonic()
            if now >= next_restart:
                victim = f"soak-{restarts % workers}"
                hard = hard_kills or restarts % 2 == 1
                await asyncio.to_thread(fleet.restart, victim, hard)  # the endpoint keeps serving
                restarts += 1
                next_restart = now + seconds / (workers + 2)
                print(f"  {now - started:5.1f}s  restarted {victim} ({'SIGKILL' if hard else 'SIGTERM'})")
            if not redis_restarted and now - started > seconds / 2:
                await asyncio.to_thread(redis.restart)
                redis_restarted = True
                print(f"  {now - started:5.1f}s  restarted Redis")
            await asyncio.sleep(1.0 / rate)
        producer.flush()
        print(f"  published {published}; waiting for every message to settle")
        tally = DeadLetterTally(client, dlq)
        settle_deadline = time.monotonic() + 180
        progress, progress_at, broker_restarted = -1, time.monotonic(), False
        while time.monotonic() < settle_deadline and not _settled(endpoint, published, tally.read()):
            done = _count_settled(endpoint, published, tally.seen)
            if done != progress:
                progress, progress_at = done, time.monotonic()
            elif not broker_restarted and external is None and time.monotonic() - progress_at > 10:  # stranded
                broker_restarted = True
                print(f"  no progress for 10 s with {2 * published - done} unsettled: restarting the broker "
                      "(pulsar-lite keeps a killed worker's consumers)")
                await asyncio.to_thread(broker.restart)
            await asyncio.sleep(1.0)
        return _report(endpoint, published, tally.seen)
    finally:
        fleet.stop()
        with contextlib.suppress(Exception):
            client.close()
        await runner.cleanup()
        broker.stop()
        redis.stop()


class DeadLetterTally:
    """Dead letters per subscription, by message number. The inspector subscription acks what it
    read, so each read adds to what was seen before."""

    def __init__(self, client: pulsar.Client, dlq: str) -> None:
        self.client, self.dlq = client, dlq
        self.seen: dict[str, Counter[int]] = {s: Counter() for s in SUBSCRIPTIONS}

    def read(self) -> dict[str, Counter[int]]:
        for sub in SUBSCRIPTIONS:
            self.seen[sub].update(_dead_letters(self.client, self.dlq + ("-shared" if sub == SUBSCRIPTIONS[0]
                                                                          else "-keyed")))
        return self.seen


def _settled(endpoint: ChaosEndpoint, published: int, dead: dict[str, Counter[int]]) -> bool:
    return _count_settled(endpoint, published, dead) == len(SUBSCRIPTIONS) * published


def _count_settled(endpoint: ChaosEndpoint, published: int, dead: dict[str, Counter[int]]) -> int:
    return sum(1 for sub in SUBSCRIPTIONS for n in range(published) if n in endpoint.acked[sub] or n in dead[sub])


def _report(endpoint: ChaosEndpoint, published: int, dead_letters: dict[str, Counter[int]]) -> int:
    lost_total = regressions_total = 0
    rows = []
    for sub in SUBSCRIPTIONS:
        acked, dead = endpoint.acked[sub], dead_letters[sub]
        delivered = sum(1 for n in range(published) if n in acked)
        duplicated = sum(c - 1 for c in acked.values() if c > 1)
        regressions = sum(endpoint.regressions[sub].values())
        dead_lettered = sum(1 for n in range(published) if n in dead)
        dead_duplicates = sum(c - 1 for c in dead.values() if c > 1)
        lost = sum(1 for n in range(published) if n not in acked and n not in dead)
        lost_total += lost
        regressions_total += regressions
        rows.append({"subscription": sub, "published": published, "delivered": delivered, "duplicated": duplicated,
                     "regressions": regressions, "dead-lettered": dead_lettered, "dlq-dups": dead_duplicates,
                     "lost": lost})
    print("\n" + table(rows, list(rows[0])))
    print(f"endpoint requests: {endpoint.requests}; poison messages: every {POISON_EVERY}th")
    print("lost 0: every message was delivered or dead-lettered" if lost_total == 0 else f"LOST {lost_total}")
    print("attempt numbers never went back" if regressions_total == 0
          else f"ATTEMPT NUMBERS WENT BACK {regressions_total} time(s)")
    return 0 if lost_total == 0 and regressions_total == 0 else 1
