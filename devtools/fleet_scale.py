"""`python -m devtools bench-fleet --simulated`: the fleet's Redis traffic at scale, on a real Redis Cluster.

Simulated workers, one process each as in a fleet, run the real ownership code (`worker.fleet.Fleet`:
membership heartbeats, the assignment, lease acquire/renew/release, status reports, registry
reads) against a real Redis Cluster; only delivery is left out (no broker consumers: 10,000 of
them would measure the broker, not the fleet's state). Measured per size, from Redis: commands per
second per subscription at idle, time to re-own a killed worker's subscriptions, and Redis memory
per subscription; and memory per in-flight message from real attempt records.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import psutil

from devtools import redis_topologies
from devtools.probes import wait
from devtools.scratch import scratch_dir
from worker.core.attempts import AttemptStore
from worker.core.dispatcher import Fence
from worker.core.metrics import Metrics
from worker.core.redis_batch import Pipeliner
from worker.fleet import Fleet
from worker.fleet.memory_watch import ThreadCpu
from worker.fleet.ownership import owners_now
from worker.model.config import FleetSettings, RedisSettings
from worker.model.subscriptions import RetryPolicy, Subscription
from worker.ops.render import table
from worker.runtime import logs
from worker.runtime.supervisor import Supervisor
from worker.state.redis_client import connect, connect_sync


class SimulatedWorker:
    """What `Fleet` needs of a worker, with delivery left out: `add` and `remove` only record."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.metrics = Metrics()
        self.supervisor = Supervisor()
        self.dispatchers: dict[str, Any] = {}
        self.subscribe_failures: dict[str, str] = {}
        self.serving: set[str] = set()
        self.stopping = False
        self.trial_threads = ThreadCpu()

    def add(self, sub: Subscription, lease: Fence | None = None, trial: bool = False) -> None:
        self.serving.add(sub.key)

    def end_trial(self, key: str) -> None:
        pass

    async def remove(self, key: str, grace: float | None = None, unsubscribe: bool = False) -> None:
        self.serving.discard(key)

    async def seek(self, key: str, target: Any) -> int:
        return 0

    async def partitions(self, topic: str) -> int:
        return 1


def scale_subscription(i: int) -> Subscription:
    """The i-th of the scale run's subscriptions (its endpoint never answers: nothing is delivered)."""
    return Subscription(name=f"s{i:05d}", topic=f"persistent://p-scale/main/t{i}", url="http://127.0.0.1:9/never",
                        ack_deadline_seconds=10, max_deliver=5, retry=RetryPolicy(1.0, 60.0))


def _commands(client: Any) -> int:
    info = client.info("stats", target_nodes="primaries")
    return sum(int(node["total_commands_processed"]) for node in info.values())


def _memory(client: Any) -> int:
    info = client.info("memory", target_nodes="primaries")
    return sum(int(node["used_memory"]) for node in info.values())


async def simulated_worker_main(worker_id: str, settings_json: str) -> None:
    """One simulated worker in a process of its own, as in a real fleet: `python -m
    devtools.fleet_scale <id> <json>`; runs until killed."""
    spec = json.loads(settings_json)
    settings = RedisSettings(mode="cluster", nodes=tuple(spec["nodes"]))
    subs = tuple(scale_subscription(i) for i in range(spec["count"]))
    client = connect(settings, socket_timeout=10, socket_connect_timeout=5)
    await client.ping()  # as a worker does before joining (and it maps the slots)
    fleet = Fleet(SimulatedWorker(worker_id), client,
                  FleetSettings(name="scale", lease_seconds=spec["lease"], heartbeat_seconds=1.0), subs)
    await fleet.start()
    print("joined", flush=True)  # for a staggered start (`_measure`)
    await asyncio.Event().wait()


def _owners(client: Any, count: int, every: int = 1) -> list[str]:
    """Who serves each subscription ('' nobody), 1,000 a pipeline; every `every`th subscription only."""
    names = [scale_subscription(i).key for i in range(0, count, every)]
    found: dict[str, list[str]] = {}
    for start in range(0, len(names), 1000):
        found.update(owners_now(client, "scale", names[start:start + 1000]))
    return [found[name][0] for name in names]


def _all_owned(client: Any, count: int) -> bool:
    """Whether every subscription is owned: a sample of a fiftieth first (reading 100,000 owner records
    takes seconds of a core the workers need while they converge), then all of them."""
    return all(_owners(client, count, every=50)) and all(_owners(client, count))


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a process has used, as a pod's cgroup would count it."""
    return float(sum(psutil.Process(pid).cpu_times()[:2]))


def _start(spec: str, workers: int, staggered: bool) -> list[subprocess.Popen[bytes]]:
    """The simulated workers, a process each; staggered: each once the one before joined, as pods
    on machines of their own would (on this one, 100 processes starting at once take minutes of
    CPU before any of them joins)."""
    procs = []
    for i in range(workers):
        procs.append(subprocess.Popen([sys.executable, "-m", "devtools.fleet_scale", f"sim-{i}", spec],
                                      stdout=subprocess.PIPE if staggered else subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        if staggered and procs[-1].stdout is not None:
            procs[-1].stdout.readline()
    return procs


def _measure(settings: RedisSettings, sync: Any, count: int, workers: int, lease: float,
             idle_seconds: float, staggered: bool = False) -> dict[str, Any]:
    sync.flushall(target_nodes="primaries")
    base_memory = _memory(sync)
    spec = json.dumps({"nodes": list(settings.nodes), "count": count, "lease": lease})
    first_started = time.monotonic()
    procs = _start(spec, workers, staggered)
    last_started = time.monotonic()  # "owned within N s of the last worker's start"
    print(f"  started in {last_started - first_started:.1f}s", file=sys.stderr, flush=True)
    try:
        wait(lambda: _all_owned(sync, count), 900, "every subscription owned")
        owned_after = time.monotonic() - last_started
        print(f"  owned {owned_after:.1f}s after the last worker's start; idle for {lease + idle_seconds:g}s",
              file=sys.stderr, flush=True)
        time.sleep(lease)  # hand-overs of the start settle; status writes reach their rhythm
        before, cpu_before = _commands(sync), [_cpu_seconds(p.pid) for p in procs]
        time.sleep(idle_seconds)
        rate = (_commands(sync) - before) / idle_seconds
        cpu = [(_cpu_seconds(p.pid) - b) / idle_seconds for p, b in zip(procs, cpu_before, strict=True)]
        memory = _memory(sync) - base_memory
        owners = _owners(sync, count)
        shares = Counter(owners)
        orphaned = shares["sim-0"]
        # Only the killed worker's subscriptions are read while they are re-owned: reading all 100,000
        # takes seconds, and the time measured would be the reading's.
        theirs = [scale_subscription(i).key for i, owner in enumerate(owners) if owner == "sim-0"]
        procs[0].kill()  # kill -9: nothing released, its entry lapses
        procs[0].wait()
        reowned = wait(lambda: all(o[0] not in ("", "sim-0") for o in owners_now(sync, "scale", theirs).values()),
                       300, "the killed worker's subscriptions re-owned")
        print(f"  re-owned in {reowned:.1f}s", file=sys.stderr, flush=True)
        mean = count / workers
        loads = [shares[f"sim-{i}"] for i in range(workers)]  # a worker owning nothing counts too
        return {"subscriptions": count, "workers": workers, "owned_in_s": owned_after,
                "commands_per_s": rate, "per_sub": rate / count, "memory_per_sub": memory / count,
                "orphaned": orphaned, "reowned_in_s": reowned,
                "balance": (min(loads) / mean - 1, max(loads) / mean - 1),
                "worker_cpu": (statistics.median(cpu), max(cpu))}
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def figures(count: int, workers: int, lease: float = 10.0, idle_seconds: float = 10.0) -> dict[str, Any]:
    """One size measured on a Redis Cluster of its own (`make bench --section fleet` guards them)."""
    with scratch_dir("push-worker-fleet-scale-") as directory:
        topology = redis_topologies.start_cluster(directory)
        sync = connect_sync(topology.settings())
        try:
            return {**_measure(topology.settings(), sync, count, workers, lease, idle_seconds), "lease": lease}
        finally:
            sync.close()
            topology.stop()


async def _in_flight_memory(settings: RedisSettings, sync: Any, messages: int = 20_000) -> float:
    """Redis bytes per message between its first attempt and its settling (the attempt counter),
    and per failed attempt (its history entry and last status)."""
    await asyncio.to_thread(sync.flushall, target_nodes="primaries")
    before = await asyncio.to_thread(_memory, sync)
    client = connect(settings)
    pipeliner = Pipeliner(client)
    store = AttemptStore(pipeliner, settings)
    try:
        for start in range(0, messages, 1000):
            await asyncio.gather(*(store.begin(f"p-scale/s{i % 100:05d}", f"{i}:1:-1:-1")
                                   for i in range(start, start + 1000)))
    finally:
        await pipeliner.close()
        await client.aclose()
    return (await asyncio.to_thread(_memory, sync) - before) / messages


async def run_scale(sizes: tuple[int, ...] = (1_000, 10_000), workers: int = 10, lease: float = 10.0,
                    idle_seconds: float = 10.0, staggered: bool = False) -> int:
    logs.configure("json", "error")
    with scratch_dir("push-worker-fleet-scale-") as directory:
        topology = await asyncio.to_thread(redis_topologies.start_cluster, directory)
        settings = topology.settings()
        sync = connect_sync(settings)
        try:
            print(f"devtools bench-fleet --simulated: Redis Cluster of 3 masters + 3 replicas, {workers} simulated "
                  f"workers (the real ownership code, no delivery), lease {lease:g}s, heartbeat 1s; owned: seconds "
                  "after the last worker's start; balance: the smallest and largest share against the mean; "
                  "worker cpu: a worker process's share of a core at idle (median, max)\n")
            rows = []
            for n in sizes:
                print(f"measuring {n:,} subscriptions ...", file=sys.stderr, flush=True)
                rows.append(await asyncio.to_thread(_measure, settings, sync, n, workers, lease, idle_seconds,
                                                    staggered))
            print(table([{"subscriptions": f"{r['subscriptions']:,}", "owned in s": f"{r['owned_in_s']:.1f}",
                          "redis cmd/s": f"{r['commands_per_s']:,.0f}", "cmd/s per sub": f"{r['per_sub']:.3f}",
                          "memory/sub B": f"{r['memory_per_sub']:,.0f}",
                          "re-owned after kill s": f"{r['reowned_in_s']:.1f} ({r['orphaned']:,} subs)",
                          "balance": f"{r['balance'][0]:+.0%}/{r['balance'][1]:+.0%}",
                          "worker cpu idle": f"{r['worker_cpu'][0]:.1%} (max {r['worker_cpu'][1]:.1%})"}
                         for r in rows],
                        ["subscriptions", "owned in s", "redis cmd/s", "cmd/s per sub", "memory/sub B",
                         "re-owned after kill s", "balance", "worker cpu idle"],
                        right=("subscriptions", "owned in s", "redis cmd/s", "cmd/s per sub", "memory/sub B")))
            per_message = await _in_flight_memory(settings, sync)
            print(f"\nin flight: {per_message:,.0f} bytes of Redis per message between its first attempt and settling")
            if len(rows) > 1:
                first, last = rows[0], rows[-1]
                growth = last["subscriptions"] / first["subscriptions"]
                added = last["subscriptions"] - first["subscriptions"]
                marginal = (last["memory_per_sub"] * last["subscriptions"]
                            - first["memory_per_sub"] * first["subscriptions"]) / added
                print(f"growth {first['subscriptions']:,} -> {last['subscriptions']:,} subscriptions (x{growth:g}): "
                      f"Redis commands/s x{last['commands_per_s'] / first['commands_per_s']:.1f}, re-own time "
                      f"x{last['reowned_in_s'] / first['reowned_in_s']:.1f}; Redis memory per added subscription "
                      f"{marginal:,.0f} bytes (the fixed part: connections, scripts, cluster state)")
            return 0
        finally:
            sync.close()
            topology.stop()


if __name__ == "__main__":
    logs.configure("json", "error")
    asyncio.run(simulated_worker_main(sys.argv[1], sys.argv[2]))
