"""What a worker that runs for months gives back when its subscriptions come and go, and what large
messages may take of its memory."""

from __future__ import annotations

import asyncio
import gc
import json
import weakref
from pathlib import Path

import yaml
from aiohttp import web

from tests.support.builders import make_sub
from tests.support.endpoints import Endpoint
from tests.support.helpers import eventually, spawn_worker, stop_worker
from worker.runtime.collector import GC_THRESHOLD


async def test_a_released_subscription_is_freed_under_the_workers_collector_settings(
        start_worker, endpoint: Endpoint, client, topic):
    """A dispatcher, its consumer and its tasks refer to each other. Under the worker's collector
    settings only a full collection frees them once they are old, and that came after about 100
    million allocations: a quiet worker whose subscriptions came and went grew by about 30 KiB for
    each."""
    previous = gc.get_threshold()
    gc.set_threshold(*GC_THRESHOLD)
    try:
        sub = make_sub(topic, endpoint.url)
        w = await start_worker(sub)
        [mid] = client.publish(topic, [b"one"])
        await eventually(lambda: any(r.acked for r in endpoint.by_id().get(mid, [])), what="delivered")
        # Its consumer is in the cycle; the dispatcher itself, compiled, takes no weak reference.
        released = weakref.ref(w.dispatchers[sub.key].consumer)
        gc.collect()  # old now: from here only a full collection reaches it
        await w.served.remove(sub.key)
        await eventually(lambda: released() is None, timeout=5, what="the released dispatcher freed")
    finally:
        gc.set_threshold(*previous)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def large_message_config(tmp_path, broker, redis_url, endpoint, topic, **pulsar) -> Path:
    sub = make_sub(topic, endpoint.url, content="raw")
    config = tmp_path / "w.yaml"
    config.write_text(yaml.safe_dump({
        "pulsar": {"service_url": broker.url, **pulsar}, "redis": {"url": redis_url}, "http": {"port": 0},
        "destinations": {"allow_private": True}, "log": {"format": "json"}, "shutdown_grace_seconds": 1,
        # Raw 4 MiB messages count 8 MiB each (the client's copy and ours): 4 held at most; a prefetch of 18 MiB.
        "max_held_bytes_per_subscription": 36 << 20,
        "subscriptions": [{"name": sub.name, "topic": topic, "ack_deadline_seconds": 60,
                           "deliver": {"mode": "push", "push": {"url": endpoint.url, "content": "raw"}}}]}))
    return config


SIZE, COUNT = 4 << 20, 40  # a backlog of 160 MiB


def held_backlog(endpoint: Endpoint, client, topic: str) -> asyncio.Event:
    """COUNT messages of SIZE bytes published; the endpoint holds every request until the event is set."""
    release = asyncio.Event()

    async def hold(rec):
        await release.wait()
        return web.Response(status=204)

    endpoint.behaviour = hold
    client.publish(topic, [bytes([n]) * SIZE for n in range(COUNT)])
    return release


async def all_delivered(endpoint: Endpoint) -> None:
    everything = {bytes([n]) for n in range(COUNT)}
    await eventually(lambda: {r.body[:1] for r in endpoint.requests if r.acked} == everything,
                     timeout=120, what="every message delivered")


async def logged(log: Path, event: str, what: str) -> list[dict]:
    """The worker's log lines of `event` (JSON), once there is one."""
    marker = json.dumps(event)
    await eventually(lambda: marker in log.read_text(), timeout=60, what=what)
    return [json.loads(line) for line in log.read_text().splitlines() if marker in line]


async def peak_while_held(worker, endpoint: Endpoint, held: int) -> float:
    """The worker's peak RSS over 2 s once it holds `held` more messages at the endpoint."""
    before = len(endpoint.requests)
    await eventually(lambda: len(endpoint.requests) - before >= held, timeout=30, what=f"{held} messages held")
    peak = 0.0
    for _ in range(20):  # sampled for 2 s while they are held
        peak = max(peak, rss_mib(worker.pid))
        await asyncio.sleep(0.1)
    return peak


async def test_a_subscription_prefetches_no_more_bytes_than_its_share_from_its_first_message_on(
        broker, redis_url, endpoint: Endpoint, client, topic, tmp_path):
    """The Pulsar client prefetches a number of messages whatever their size: a subscription that had
    not yet seen a large message took up to its window of them (150 messages of 4 MiB: 600 MiB in
    the client's queue). Its prefetch is sized for the broker's largest message from the start."""
    release = held_backlog(endpoint, client, topic)
    config = large_message_config(tmp_path, broker, redis_url, endpoint, topic)  # the broker's largest: 5 MiB
    worker = spawn_worker(config, tmp_path / "w.log")
    try:
        peak = await peak_while_held(worker, endpoint, 4)
        release.set()
        await all_delivered(endpoint)
    finally:
        release.set()
        assert stop_worker(worker, 30) == 0
    # 4 held (32 MiB) and 3 prefetched (18 MiB of 5 MiB messages) beside an idle worker's 75 MiB; the
    # whole backlog prefetched is 160 MiB more (on Apache Pulsar; pulsar-lite hands a consumer at
    # most about 20 MiB per flow request, so there the figure cannot tell them apart).
    assert peak < 190, f"the worker peaked at {peak:.0f} MiB"


async def test_a_subscription_of_messages_larger_than_the_brokers_prefetches_fewer_and_so_does_its_next_owner(
        broker, redis_url, endpoint: Endpoint, client, topic, tmp_path):
    """A message can be larger than the broker's maximum once the client has it (a compressed one
    inflated, a chunked one put together). Once a worker sees one, it subscribes again with a
    prefetch that fits them, and remembers the size in Redis: the next owner starts small (a pod
    killed by such a prefetch took each next owner with it). Here the worker is told the broker's
    largest is 1 MiB and gets messages of 4 MiB."""
    release = held_backlog(endpoint, client, topic)
    config = large_message_config(tmp_path, broker, redis_url, endpoint, topic, max_message_bytes=1 << 20)
    sized = "large messages: prefetch sized to them"
    log = tmp_path / "first.log"
    first = spawn_worker(config, log, PUSH_WORKER_ID="first")
    try:
        [event, *_] = await logged(log, sized, "the prefetch sized to the messages")
        assert (event["message_bytes"], event["prefetch"]) == (SIZE, 4), event  # 18 MiB of 4 MiB messages
    finally:
        assert stop_worker(first, 30) == 0
    log = tmp_path / "second.log"
    second = spawn_worker(config, log, PUSH_WORKER_ID="second")
    try:
        # Sized before its first message (without the remembered size it would prefetch 18 of them).
        [event, *_] = await logged(log, sized, "the next owner sized from the start")
        assert (event["message_bytes"], event["prefetch"]) == (SIZE, 4), event
        release.set()
        await all_delivered(endpoint)
    finally:
        release.set()
        assert stop_worker(second, 30) == 0


async def test_a_subscription_of_large_messages_moves_to_a_connection_of_its_own_and_its_next_owner_starts_there(
        broker, redis_url, endpoint: Endpoint, client, topic, tmp_path):
    """4 MiB frames on the connection every subscription shares held another project's messages
    behind them (its p99 1,021x its own alone, `make bench --section neighbours`). From its first
    message of 1 MiB or more a subscription is served through a Pulsar client of its own; Redis
    remembers the size, so the next owner subscribes there from the start. Nothing is lost."""
    release = held_backlog(endpoint, client, topic)
    config = large_message_config(tmp_path, broker, redis_url, endpoint, topic)  # 4 MiB under the broker's 5
    moved = "large messages: a connection of their own"
    log = tmp_path / "first.log"
    first = spawn_worker(config, log, PUSH_WORKER_ID="first")
    try:
        [event, *_] = await logged(log, moved, "moved to a connection of its own")
        assert (event["message_bytes"], event["remembered"]) == (SIZE, False), event
    finally:
        assert stop_worker(first, 30) == 0
    log = tmp_path / "second.log"
    second = spawn_worker(config, log, PUSH_WORKER_ID="second")
    try:
        events = await logged(log, moved, "the next owner there from the start")
        # Its first subscribe went there, with the size Redis remembered: it was not moved again.
        assert [(e["message_bytes"], e["remembered"]) for e in events] == [(SIZE, True)], events
        release.set()
        await all_delivered(endpoint)
    finally:
        release.set()
        assert stop_worker(second, 30) == 0
