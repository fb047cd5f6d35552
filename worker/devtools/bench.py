"""`push-worker bench` / `make bench`: delivery speed measured against a reference in the same run.

Everything runs on this machine: the embedded broker and Redis, a sink endpoint answering 204 (in
its own process), the reference (a bare aiohttp POST loop at the same concurrency, its own
process) and one `push-worker run` process. Figures are printed as ratios against the reference.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pulsar
import redis
import uvloop
import yaml
from prometheus_client.parser import text_string_to_metric_families

from worker import embedded
from worker.consumer import CONSUMER_TYPES
from worker.devtools import apache_pulsar, redis_topologies
from worker.ops.render import table

PAYLOAD = os.urandom(768).hex().encode()[:1024]  # 1 KiB
LATENCY_RATE = 200.0  # messages/s in the latency phase


# -- the sink (own process) ---------------------------------------------------------------------

NO_CONTENT = b"HTTP/1.1 204 No Content\r\n\r\n"
FAILED = b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n"


class SinkState:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.count, self.acked = 0, 0
        self.first: float | None = None
        self.last: float | None = None
        self.published: list[tuple[float, bytes]] = []  # (arrival, Pubsub-Publish-Time), parsed when asked

    def counts(self) -> bytes:  # polled while the worker runs: kept cheap
        return json.dumps({"count": self.count, "acked": self.acked, "first": self.first, "last": self.last}).encode()

    def latency(self) -> bytes:
        return json.dumps([now - datetime.fromisoformat(sent.decode().replace("Z", "+00:00")).timestamp()
                           for now, sent in self.published]).encode()


class SinkProtocol(asyncio.Protocol):
    """A fast HTTP/1.1 sink: reads each request's head and Content-Length body, answers 204 (or 500
    for `fail_rate` of requests) on the same keep-alive connection. Kept minimal so that the sink
    is not what limits either measurement; it also serves GET /stats, GET /latency and POST /reset."""

    def __init__(self, state: SinkState, fail_rate: float, rng: random.Random) -> None:
        self.state, self.fail_rate, self.rng = state, fail_rate, rng
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = bytes(self.buffer[:end])
            length, published = 0, None
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                name = name.lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"pubsub-publish-time":
                    published = value.strip()
            if len(self.buffer) < end + 4 + length:
                return
            del self.buffer[:end + 4 + length]
            assert self.transport is not None
            self.transport.write(self.answer(head.split(b" ", 2)[:2], published))

    def answer(self, request: list[bytes], published: bytes | None) -> bytes:
        state = self.state
        if request[0] == b"GET":
            body = state.counts() if request[1] == b"/stats" else state.latency()
            return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
                len(body), body)
        if request == [b"POST", b"/reset"]:
            state.reset()
            return b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
        now = time.time()
        state.count += 1
        state.first = state.first or now
        if self.rng.random() < self.fail_rate:
            return FAILED
        state.acked += 1
        state.last = now
        if published and len(state.published) < 200_000:
            state.published.append((now, published))
        return NO_CONTENT


def sink_main(port: int, fail_rate: float) -> None:
    state, rng = SinkState(), random.Random(3)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: SinkProtocol(state, fail_rate, rng), "127.0.0.1", port)
        await server.serve_forever()

    uvloop.run(serve())


# -- the reference (own process) ----------------------------------------------------------------

async def reference_main(url: str, total: int, concurrency: int) -> None:
    """A bare aiohttp POST loop (on uvloop, like the worker): the most one process can push to this sink."""
    remaining = total
    async with aiohttp.ClientSession() as session:
        async def loop() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                async with session.post(url, data=PAYLOAD, headers={"Content-Type": "application/octet-stream"}) as r:
                    await r.read()

        started = time.monotonic()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        print(json.dumps({"elapsed": time.monotonic() - started}))


# -- orchestration ------------------------------------------------------------------------------

@dataclass
class Figures:
    name: str
    rate: float
    p50_ms: float
    p99_ms: float
    redis_per_msg: float
    round_trips_per_msg: float
    cpu_s_per_1k: float
    rss_mb: float


# The bench's own polling runs on the cores the worker needs while it is measured: plain blocking
# requests (no event loop and HTTP session per poll), a few times a second. Throughput comes from
# the sink's first and last timestamps, so the poll interval does not change it.
POLL_SECONDS = 0.2


def _fetch(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - local http URLs only
            return bytes(response.read())
    except urllib.error.HTTPError as e:  # /readyz answers 503 with a JSON body until ready
        return bytes(e.read())


def _get(url: str) -> Any:
    return json.loads(_fetch(url))


def _post(url: str) -> None:
    with urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=10):  # noqa: S310
        pass


def _wait(predicate: Any, timeout: float, what: str) -> float:
    """Poll until `predicate` holds; returns how long that took."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() > started + timeout:
            raise TimeoutError(f"bench: timed out waiting for {what}")
        time.sleep(POLL_SECONDS)
    return time.monotonic() - started


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Bench:
    def __init__(self, messages: int, concurrency: int) -> None:
        self.messages = messages
        self.concurrency = concurrency
        self.dir = Path(tempfile.mkdtemp(prefix="push-worker-bench-"))
        self.broker: Any = (apache_pulsar.broker_from_environment(("p-bench",))
                            or embedded.start_pulsar(self.dir / "pulsar"))
        self.redis_service = embedded.start_redis(self.dir / "redis")
        self.redis = redis.Redis.from_url(self.redis_service.url)
        self.client = pulsar.Client(self.broker.url, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
        self.sinks: list[subprocess.Popen[bytes]] = []
        self.cluster: redis_topologies.ClusterTopology | None = None  # started for the cluster case

    def close(self) -> None:
        for p in self.sinks:
            p.terminate()
        self.client.close()
        self.redis.close()
        self.broker.stop()
        self.redis_service.stop()
        if self.cluster is not None:
            self.cluster.stop()

    def sink(self, fail_rate: float = 0.0) -> str:
        port = embedded.free_port()
        proc = subprocess.Popen([sys.executable, "-m", "worker.devtools.bench", "sink", str(port), str(fail_rate)])
        self.sinks.append(proc)
        embedded.wait_for_port(port, proc, "sink")
        return f"http://127.0.0.1:{port}"

    def reference(self, sink: str) -> float:
        out = subprocess.run([sys.executable, "-m", "worker.devtools.bench", "reference", sink + "/push",
                              str(self.messages), str(self.concurrency)], capture_output=True, text=True, check=True)
        return self.messages / float(json.loads(out.stdout)["elapsed"])

    def publish(self, topic: str, n: int, keys: int = 0, rate: float = 0.0) -> None:
        producer = self.client.create_producer(topic, batching_enabled=not rate, batching_max_publish_delay_ms=5,
                                               block_if_queue_full=True)
        started = time.monotonic()
        for i in range(n):
            kwargs: dict[str, Any] = {}
            if keys:
                kwargs["partition_key"] = f"key-{i % keys}"
            producer.send_async(PAYLOAD, None, **kwargs)
            if rate and i % 50 == 0:
                ahead = i / rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
        producer.flush()
        producer.close()

    def redis_config(self, mode: str) -> dict[str, Any]:
        if mode == "cluster":
            if self.cluster is None:
                self.cluster = redis_topologies.start_cluster(self.dir / "redis-cluster")
            return self.cluster.config()
        return {"url": self.redis_service.url}

    def config(self, subs: list[dict[str, Any]], redis_mode: str = "standalone") -> Path:
        path = self.dir / f"worker-{time.monotonic_ns()}.yaml"
        path.write_text(yaml.safe_dump({
            "pulsar": {"service_url": self.broker.url}, "redis": self.redis_config(redis_mode),
            "http": {"port": 0}, "destinations": {"allow_private": True}, "log": {"format": "json", "level": "error"},
            "state_dir": str(self.dir / "worker"), "subscriptions": subs}))
        return path

    def sub(self, name: str, topic: str, url: str, kind: str = "shared") -> dict[str, Any]:
        return {"name": name, "topic": topic, "type": kind, "max_ack_pending": self.concurrency, "max_deliver": 1000,
                "retry": {"min_backoff_seconds": 0.05, "max_backoff_seconds": 0.5},
                "deliver": {"mode": "push", "push": {"url": url, "content": "raw"}}}

    def start_worker(self, config: Path) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-m", "worker.cli", "run", "--config", str(config)],
                                stderr=open(self.dir / "worker.log", "ab"))

    def run_worker(self, name: str, kind: str = "shared", keys: int = 0, fail_rate: float = 0.0,
                   redis_mode: str = "standalone") -> Figures:
        sink = self.sink(fail_rate)
        topic = f"persistent://p-bench/main/{name}"
        # Create the cursor first, with the consumer type the worker will use: a cursor created with one
        # type and consumed with another got every message redelivered on pulsar-lite.
        self.client.subscribe(topic, name, consumer_type=CONSUMER_TYPES[kind]).close()
        self.publish(topic, self.messages, keys=keys)
        proc = self.start_worker(self.config([self.sub(name, topic, sink + "/push", kind)], redis_mode))
        ps = psutil.Process(proc.pid)
        try:
            _wait(lambda: _get(sink + "/stats")["acked"] >= self.messages, 600, f"{name}: all acked")
            stats = _get(sink + "/stats")
            cpu = ps.cpu_times()
            rss = ps.memory_info().rss
            redis_per_msg = _metric(ps, "pushworker_redis_commands_total") / self.messages
            round_trips = _metric(ps, "pushworker_redis_round_trips_total")
            rate = self.messages / (stats["last"] - stats["first"])
            # Latency phase: a steady stream, publish-to-ack. At a modest rate so that it measures the
            # worker's path, not a 2-core machine saturated by broker, Redis, sink and publisher.
            _post(sink + "/reset")
            n = int(LATENCY_RATE * 5)
            self.publish(topic, n, keys=keys, rate=LATENCY_RATE)
            _wait(lambda: _get(sink + "/stats")["acked"] >= n, 120, f"{name}: latency phase")
            latency = _get(sink + "/latency")
        finally:
            proc.terminate()
            proc.wait(30)
        return Figures(name, rate, 1000 * _percentile(latency, 0.5), 1000 * _percentile(latency, 0.99),
                       redis_per_msg, round_trips / self.messages,
                       1000 * (cpu.user + cpu.system) / (self.messages + n), rss / 2**20)

    def idle(self, count: int = 1000) -> tuple[float, float, float]:
        sink = self.sink()
        subs = [self.sub(f"idle-{i}", f"persistent://p-bench/main/idle-{i}", sink + "/push") for i in range(count)]
        proc = self.start_worker(self.config(subs))
        ps = psutil.Process(proc.pid)
        try:
            started = time.monotonic()
            # Subscribed when the broker shows every cursor: wait for the worker's own readiness instead.
            _wait(lambda: _worker_ready(ps), 300, "1000 subscriptions")
            ready_after = time.monotonic() - started
            cpu0 = sum(ps.cpu_times()[:2])
            time.sleep(10)
            idle_cpu = (sum(ps.cpu_times()[:2]) - cpu0) / 10
            rss = ps.memory_info().rss / 2**20
        finally:
            proc.terminate()
            proc.wait(60)
        return ready_after, idle_cpu, rss


def _status_port(ps: psutil.Process) -> int | None:
    for conn in ps.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN:
            return int(conn.laddr.port)
    return None


def _worker_ready(ps: psutil.Process) -> bool:
    port = _status_port(ps)
    try:
        return port is not None and bool(_get(f"http://127.0.0.1:{port}/readyz").get("ready"))
    except (OSError, ValueError):  # not listening yet, or not JSON
        return False


def _metric(ps: psutil.Process, name: str) -> float:
    """Sum of a metric's samples on the worker's /metrics."""
    text = _fetch(f"http://127.0.0.1:{_status_port(ps)}/metrics").decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)


async def run_bench(messages: int = 20000, concurrency: int = 64) -> int:
    def work() -> int:
        bench = Bench(messages, concurrency)
        try:
            print(f"push-worker bench: {messages} messages of 1 KiB, concurrency {concurrency}, "
                  f"{os.cpu_count()} cores\n")
            # This machine's speed drifts by tens of percent from minute to minute (shared cores), so
            # each case is compared with the reference measured just before and just after it.
            ref_sink = bench.sink()
            references = [bench.reference(ref_sink)]
            rows: list[tuple[Figures, float]] = []
            for case in (("shared",), ("keyshared", "key-shared", 1000), ("failing10", "shared", 0, 0.10),
                         ("shared-cluster", "shared", 0, 0.0, "cluster")):  # Redis Cluster, 3 masters
                figures = bench.run_worker(*case)
                references.append(bench.reference(ref_sink))
                rows.append((figures, (references[-2] + references[-1]) / 2))
            print("reference (bare aiohttp POST loop, one process, on uvloop): "
                  + ", ".join(f"{r:,.0f}" for r in references) + " req/s, measured around each case")
            print(f"latency: publish-to-ack on a steady {LATENCY_RATE:.0f} msg/s stream\n")
            print(table([{"case": f.name, "deliveries/s": f"{f.rate:,.0f}", "reference": f"{reference:,.0f}",
                          "x reference": f"{f.rate / reference:.2f}", "p50 ms": f"{f.p50_ms:.1f}",
                          "p99 ms": f"{f.p99_ms:.1f}", "redis cmd/msg": f"{f.redis_per_msg:.2f}",
                          "round trips/msg": f"{f.round_trips_per_msg:.2f}", "cpu s/1k msg": f"{f.cpu_s_per_1k:.3f}",
                          "rss MiB": f"{f.rss_mb:.0f}"} for f, reference in rows],
                        ["case", "deliveries/s", "reference", "x reference", "p50 ms", "p99 ms", "redis cmd/msg",
                         "round trips/msg", "cpu s/1k msg", "rss MiB"],
                        right=("deliveries/s", "reference", "x reference", "p50 ms", "p99 ms", "redis cmd/msg",
                               "round trips/msg", "cpu s/1k msg", "rss MiB")))
            ready, cpu, rss = bench.idle()
            print(f"\nidle: 1000 push subscriptions ready in {ready:.1f}s; idle CPU {100 * cpu:.1f}% of a core; "
                  f"RSS {rss:.0f} MiB")
            return 0
        finally:
            bench.close()

    return await asyncio.to_thread(work)


if __name__ == "__main__":
    if sys.argv[1] == "sink":
        sink_main(int(sys.argv[2]), float(sys.argv[3]))
    elif sys.argv[1] == "reference":
        uvloop.run(reference_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))  # as the worker runs
