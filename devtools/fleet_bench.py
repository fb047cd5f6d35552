"""`python -m devtools bench-fleet`: ownership convergence after a kill and movement on a join, measured
with real worker processes on the embedded broker and Redis (a benchmark, not a test)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import redis
import yaml

from devtools.scratch import scratch_dir
from worker.broker import embedded
from worker.core.keys import lease_key
from worker.fleet import assign
from worker.state.redis_client import safe_text


def run_fleet_bench(subscriptions: int = 60, workers: int = 3, lease_seconds: float = 5.0) -> int:
    with scratch_dir("push-worker-fleet-bench-") as tmp:
        return _run_in(tmp, subscriptions, workers, lease_seconds)


def _run_in(tmp: Path, subscriptions: int, workers: int, lease_seconds: float) -> int:
    broker = embedded.start_pulsar(tmp / "pulsar", die_with_parent=True)
    redis_service = embedded.start_redis(tmp / "redis", die_with_parent=True)
    client = redis.Redis.from_url(redis_service.url)
    config = tmp / "worker.yaml"
    config.write_text(yaml.safe_dump({
        "pulsar": {"service_url": broker.url}, "redis": {"url": redis_service.url}, "http": {"port": 0},
        "destinations": {"allow_private": True}, "log": {"format": "json", "level": "info"},
        "fleet": {"name": "bench", "lease_seconds": lease_seconds, "heartbeat_seconds": 0.5},
        "subscriptions": [{"name": f"s{i:04d}", "topic": f"persistent://p-bench/main/t{i}",
                           "deliver": {"mode": "push", "push": {"url": "http://127.0.0.1:9/never"}}}
                          for i in range(subscriptions)]}))
    keys = [f"p-bench/s{i:04d}" for i in range(subscriptions)]
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(worker_id: str) -> None:
        env = {**os.environ, "PUSH_WORKER_ID": worker_id}
        procs[worker_id] = subprocess.Popen([sys.executable, "-m", "worker.cli", "run", "--config", str(config)],
                                            env=env, stderr=open(tmp / f"{worker_id}.log", "ab"))  # noqa: SIM115

    def owners() -> dict[str, str | None]:
        values = client.mget([lease_key(k) for k in keys])
        return {k: safe_text(v) if v else None for k, v in zip(keys, values, strict=True)}

    def wait_until(predicate: object, timeout: float = 120) -> float:
        started = time.monotonic()
        while not predicate():  # type: ignore[operator]
            if time.monotonic() - started > timeout:
                raise TimeoutError("fleet did not converge")
            time.sleep(0.05)
        return time.monotonic() - started

    def balanced(ids: set[str]) -> bool:
        """Every worker owns a share, none more than the bounded load allows (ceil(n/w))."""
        o = owners()
        counts = Counter(o.values())
        return set(counts) == ids and max(counts.values()) <= -(-subscriptions // len(ids))

    try:
        print(f"devtools bench-fleet: {subscriptions} subscriptions, {workers} workers, "
              f"lease {lease_seconds:g}s, heartbeat 0.5s\n")
        for i in range(workers):
            start(f"w{i}")
        ids = set(procs)
        wait_until(lambda: balanced(ids))
        before = owners()
        start(f"w{workers}")
        join_time = wait_until(lambda: balanced(set(procs)))
        after = owners()
        moved = sum(before[k] != after[k] for k in keys) / subscriptions
        ideal = 1 / (workers + 1)
        print(f"join:  a worker joins, {workers} -> {workers + 1}: balanced again in {join_time:.1f}s; "
              f"{100 * moved:.1f}% of subscriptions moved (ideal {100 * ideal:.1f}%)")
        victim = "w0"
        procs[victim].send_signal(signal.SIGKILL)
        procs[victim].wait()
        survivors = set(procs) - {victim}
        kill_time = wait_until(lambda: all(o in survivors for o in owners().values()))
        held = sum(o == victim for o in after.values())
        suspects = sum(_suspects(tmp / f"{w}.log") for w in survivors)
        print(f"kill:  kill -9 of one worker: its {held} subscriptions re-owned in {kill_time:.1f}s "
              f"(lease {lease_seconds:g}s); {suspects} held back for a trial (a kill leaves no memory evidence: "
              "each is served as it is taken)")
        big = [f"p-x/s{i}" for i in range(10_000)]
        a, b = assign(big, [f"w{i}" for i in range(10)]), assign(big, [f"w{i}" for i in range(11)])
        print(f"model: 10,000 subscriptions, 10 -> 11 workers: {100 * sum(a[k] != b[k] for k in big) / len(big):.1f}% "
              f"moved (ideal {100 / 11:.1f}%)")
        return 0
    finally:
        for proc in procs.values():
            embedded.terminate(proc, 20)
        client.close()
        broker.stop()
        redis_service.stop()


def _suspects(log: Path) -> int:
    """Subscriptions a worker took as suspects (held back for a trial), from its JSON log."""
    count = 0
    for line in log.read_text().splitlines():
        if '"subscription acquired"' in line and '"suspect": true' in line:
            count += 1
    return count


async def run(subscriptions: int, workers: int, lease_seconds: float) -> int:
    return await asyncio.to_thread(run_fleet_bench, subscriptions, workers, lease_seconds)
