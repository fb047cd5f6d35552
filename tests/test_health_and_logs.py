"""/healthz, /readyz and the logs of a real worker process: JSON events, and no secrets in them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pulsar
import redis as redis_sync
import yaml
from aiohttp import web
from structlog.testing import capture_logs

from tests.support.builders import make_sub
from tests.support.helpers import eventually, http_get, spawn_worker, stop_worker
from tests.support.pulsar_client import Client
from tests.support.redis_targets import ALL_REDIS
from worker.broker.embedded import free_port, start_redis
from worker.model.config import FleetSettings


async def test_probes_and_json_logs_without_secrets(broker, endpoint, client: Client, topic, tmp_path: Path):
    secret_redis = start_redis(tmp_path / "redis")
    password = "s3cret-Redis-pw"
    redis_sync.Redis.from_url(secret_redis.url).config_set("requirepass", password)
    url_with_password = secret_redis.url.replace("redis://", f"redis://:{password}@")
    endpoint.behaviour = lambda rec: web.Response(status=500 if rec.body_payload == b"bad" else 204)
    port = free_port()
    config = tmp_path / "w.yaml"
    config.write_text(yaml.safe_dump({
        "pulsar": {"service_url": broker.url}, "http": {"port": port}, "destinations": {"allow_private": True},
        "log": {"format": "json", "level": "debug"},
        "subscriptions": [{"name": "logged", "topic": topic, "max_deliver": 2,
                           "retry": {"min_backoff_seconds": 0.05, "max_backoff_seconds": 0.1},
                           "deliver": {"mode": "push", "push": {"url": endpoint.url}}}]}))
    log = tmp_path / "worker.log"
    proc = spawn_worker(config, log, PUSH_WORKER_REDIS_URL=url_with_password)
    try:
        await eventually(lambda: http_get(f"http://127.0.0.1:{port}/healthz")[0] == 200, what="alive")
        await eventually(lambda: http_get(f"http://127.0.0.1:{port}/readyz") == (200, {"ready": True, "reason": "ok"}),
                         what="ready")
        client.publish(topic, [b"good", b"bad"])
        await eventually(lambda: "dropped after last attempt" in log.read_text(), what="the bad message settled")
        secret_redis.stop()  # Redis gone: not ready any more
        await eventually(lambda: http_get(f"http://127.0.0.1:{port}/readyz")[0] == 503, what="not ready without Redis")
        assert http_get(f"http://127.0.0.1:{port}/readyz")[1]["reason"] == "redis unreachable"
        assert http_get(f"http://127.0.0.1:{port}/healthz")[0] == 200
    finally:
        assert stop_worker(proc, 30) == 0
    text = log.read_text()
    assert password not in text
    events = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    delivered = [e for e in events if e["event"] == "delivered"]
    failed = [e for e in events if e["event"] == "delivery failed"]
    assert delivered and failed
    for e in delivered + failed:
        assert {"subscription", "project", "message_id", "attempt", "status", "latency", "level", "timestamp"} <= set(e)
    assert delivered[0]["level"] == "debug" and failed[0]["level"] == "info"


async def test_readiness_judges_the_worker_not_a_subscription_that_cannot_subscribe(
        broker, redis_url, endpoint, client: Client, topic):
    """A rolling update must not wait forever on one subscription the broker keeps refusing (here:
    an exclusive subscription another consumer holds); the broker answered, so the worker is ready."""
    from tests.support.builders import make_settings, make_sub
    from worker.model.config import PulsarSettings
    from worker.process.service import Worker

    blocked = make_sub(topic, endpoint.url, type="exclusive")
    holder = client.client.subscribe(topic, blocked.pulsar_subscription, consumer_type=pulsar.ConsumerType.Exclusive)
    worker = Worker(make_settings(broker.url, redis_url, (blocked,),
                                  pulsar=PulsarSettings(service_url=broker.url, operation_timeout_seconds=2)),
                    worker_id="ready-test")
    try:
        await worker.start()
        assert worker.status is not None
        url = f"http://127.0.0.1:{worker.status.port}/readyz"
        for _ in range(300):
            code, body = await asyncio.to_thread(http_get, url)
            if code == 200:
                break
            await asyncio.sleep(0.05)
        assert (code, body) == (200, {"ready": True, "reason": "ok"})
        assert blocked.key not in worker.dispatchers  # still refused: served by nobody, but not blocking
    finally:
        await worker.close()
        holder.close()


@ALL_REDIS
async def test_a_redis_that_evicts_keys_is_warned_of_at_start(start_worker, redis_target, endpoint, topic):
    """Managed Redis services evict keys that have a TTL when full (`volatile-lru` by default), and
    every key of the worker has one: an evicted attempt count restarts a message's numbering, an
    evicted lease lets a second worker take a subscription. Nothing said so; now each evicting
    master is named at start (every master of a Cluster), and a `noeviction` one is not."""
    admin = redis_target.client()
    masters = 3 if redis_target.mode == "cluster" else 1
    every_master = {"target_nodes": "primaries"} if redis_target.mode == "cluster" else {}

    def configure(name: str, value: object) -> None:
        admin.config_set(name, value, **every_master)
    try:
        configure("maxmemory", "1gb")
        configure("maxmemory-policy", "volatile-lru")
        with capture_logs() as logged:
            first = await start_worker(make_sub(topic, endpoint.url))
        await first.close()  # the next worker gets the next subscription, not this one
        warned = [e for e in logged if e["event"].startswith("redis evicts keys when full")]
        assert len(warned) == masters and {e["maxmemory_policy"] for e in warned} == {"volatile-lru"}, warned
        assert len({e["redis"] for e in warned}) == masters
        configure("maxmemory-policy", "noeviction")
        with capture_logs() as logged:
            await start_worker(make_sub(topic + "-b", endpoint.url))
        assert not [e for e in logged if e["event"].startswith("redis evicts keys")], logged
    finally:
        configure("maxmemory-policy", "noeviction")
        configure("maxmemory", 0)
        admin.close()


async def test_a_full_redis_turns_readiness_red_with_why_and_delivery_resumes_when_it_has_room(
        start_worker, own_redis, endpoint, client: Client, topic):
    """A Redis at maxmemory (noeviction) answers PING but refuses writes: every fleet round fails and
    the leases lapse, so nothing is delivered. Readiness said ok meanwhile, and the log said only
    "ResponseError"; now /readyz turns red past a lease period with Redis's answer, and the worker
    serves again once Redis has room."""
    sub = make_sub(topic, endpoint.url)
    worker = await start_worker(sub, redis=own_redis.url, fleet=FleetSettings(lease_seconds=2, heartbeat_seconds=0.2))
    assert worker.status is not None
    url = f"http://127.0.0.1:{worker.status.port}/readyz"
    admin = redis_sync.Redis.from_url(own_redis.url)
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)  # full: every write is refused (OOM)
    try:
        red: list[tuple[int, dict]] = []

        async def reported_full() -> bool:
            red[:] = [await asyncio.to_thread(http_get, url)]
            return red[0][0] == 503 and "fleet round failing" in red[0][1]["reason"]

        await eventually(reported_full, timeout=15, what="readiness to report the full Redis", interval=0.1)
        assert "OOM" in red[0][1]["reason"], red
    finally:
        admin.config_set("maxmemory", 0)
        admin.close()
    [mid] = client.publish(topic, [b"after"])
    await eventually(lambda: mid in endpoint.by_id(), timeout=20, what="delivery once Redis has room")
    async def ready() -> bool:
        return (await asyncio.to_thread(http_get, url))[0] == 200

    await eventually(ready, timeout=10, what="ready again", interval=0.1)


async def test_proxy_settings_are_said_to_be_unused_and_their_values_never_logged(
        start_worker, endpoint, client, topic, monkeypatch):
    """A cluster whose egress goes through a proxy sets HTTPS_PROXY; the worker's clients connect
    directly (the destination guard checks the addresses connected to). Silence left an operator
    with connection errors and no cause; now the variables are named at start, their values (which
    may hold a password) never."""
    monkeypatch.setenv("HTTPS_PROXY", "http://egress:proxy-password@proxy.internal:3128")
    monkeypatch.setenv("no_proxy", "localhost")  # not a proxy: not named
    with capture_logs() as logged:
        await start_worker(make_sub(topic, endpoint.url))
    warned = [e for e in logged if e["event"].startswith("proxy settings are not used")]
    assert [e["variables"] for e in warned] == [["HTTPS_PROXY"]], logged
    assert "proxy-password" not in repr(logged)
    client.publish(topic, [b"direct"])  # and delivery connects directly, as said
    await eventually(lambda: len(endpoint.requests) == 1, what="delivery")


async def test_a_second_ctrl_c_stops_at_once_and_the_first_says_so(broker, redis_url, endpoint, client: Client,
                                                                   topic, tmp_path: Path):
    """Ctrl-C drains, which can take up to `shutdown_grace_seconds`; a second Ctrl-C was silently
    ignored. The first now says how many requests are under way and how to stop at once; the second
    stops at once (their messages go back to the broker)."""
    import signal

    release = asyncio.Event()

    async def hang(rec):
        await release.wait()
        return web.Response(status=204)

    endpoint.behaviour = hang
    config = tmp_path / "w.yaml"
    config.write_text(yaml.safe_dump({
        "pulsar": {"service_url": broker.url}, "redis": {"url": redis_url}, "http": {"port": 0},
        "destinations": {"allow_private": True}, "log": {"format": "json"},
        "shutdown_grace_seconds": 60, "state_dir": str(tmp_path / "state"),
        "subscriptions": [{"name": "interrupted", "topic": topic, "ack_deadline_seconds": 120,
                           "deliver": {"mode": "push", "push": {"url": endpoint.url}}}]}))
    log = tmp_path / "worker.log"
    proc = spawn_worker(config, log)
    try:
        await eventually(lambda: '"worker started"' in log.read_text(), timeout=60, what="started")
        client.publish(topic, [b"slow"])
        await eventually(lambda: len(endpoint.requests) == 1, what="a request under way")
        proc.send_signal(signal.SIGINT)
        await eventually(lambda: "draining, 1 in flight; press Ctrl-C again to stop now" in log.read_text(),
                         what="the first Ctrl-C said how to stop now")
        assert proc.poll() is None  # draining: the request has 60 s
        proc.send_signal(signal.SIGINT)
        await eventually(lambda: proc.poll() is not None, timeout=10, what="stopped at once")
        assert proc.returncode == 130
        assert "stopping now: 1 request(s) under way abandoned" in log.read_text()
    finally:
        release.set()
        stop_worker(proc)


async def test_a_worker_waiting_for_the_broker_says_so_and_not_that_it_started(redis_url, endpoint, tmp_path: Path):
    """With the broker unreachable, a worker logged `worker started` and then the client's raw
    `Failed to establish connection to 0.0.0.0:0` errors, one per reconnect. It says what it waits
    for, as it does for Redis, and `worker started` only once it is ready."""
    port = free_port()  # nothing listens there
    config = tmp_path / "w.yaml"
    config.write_text(yaml.safe_dump({
        "pulsar": {"service_url": f"pulsar://127.0.0.1:{port}", "operation_timeout_seconds": 3},
        "redis": {"url": redis_url}, "http": {"port": 0}, "destinations": {"allow_private": True},
        "log": {"format": "json", "level": "info"},
        "subscriptions": [{"name": "waiting", "topic": "persistent://p-test/main/waiting",
                           "deliver": {"mode": "push", "push": {"url": endpoint.url}}}]}))
    log = tmp_path / "worker.log"
    proc = spawn_worker(config, log)
    try:
        await eventually(lambda: f"waiting for the broker at pulsar://127.0.0.1:{port}" in log.read_text(),
                         timeout=60, what="the worker saying what it waits for")
        events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        assert not [e for e in events if e["event"] == "worker started"]
        assert not [e for e in events if e["level"] == "error"], [e for e in events if e["level"] == "error"]
    finally:
        assert stop_worker(proc, 30) == 0
