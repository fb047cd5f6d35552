"""`make bench BENCH_ARGS="--section spread"`: one hot subscription spread over 1, 2 and 4 workers,
each a "pod" with a CPU limit, as Kubernetes enforces one: a cgroup (v1 `cpu` controller) whose CFS
quota is a fraction of a core, so several fit on a 2-core machine. Needs root, that controller, and
Apache Pulsar (`PULSAR_URL`, `PULSAR_ADMIN_URL`: pulsar-lite refuses a second worker's consumer
whose id equals the first's, docs/testing.md)."""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

from devtools import probes
from devtools.cgroups import pod, start_in


def fleet_config(bench: Any, name: str, fleet: dict[str, Any], sub: dict[str, Any]) -> Path:
    """A worker.yaml for a fleet of its own (`name`) serving `sub`, its backlog read every second."""
    config: Path = bench.dir / f"spread-{name}.yaml"
    config.write_text(yaml.safe_dump({
        "pulsar": {"service_url": bench.broker.url, "admin_url": bench.broker.admin_url,
                   "backlog_interval_seconds": 1},
        "redis": {"url": bench.redis_service.url}, "http": {"port": 0},
        "destinations": {"allow_private": True}, "log": {"format": "json", "level": "warning"},
        "state_dir": str(bench.dir / "worker"),
        "fleet": {"name": name, "lease_seconds": 5, "heartbeat_seconds": 0.5, **fleet},
        "subscriptions": [sub]}))
    return config


def scale_out(bench: Any, kind: str, counts: tuple[int, ...] = (1, 2, 4), cores: float = 0.25,
              window: float = 10.0) -> list[dict[str, Any]]:
    """For each N in `counts`: a backlog on one subscription of `kind` (key-shared: 1,000 keys) with
    max_workers N, N workers of `cores` each; once N serve it, the deliveries a second over `window`
    seconds."""
    return [{"kind": kind, "workers": n, "msg_s": _measure(bench, kind, n, cores, window)} for n in counts]


def _measure(bench: Any, kind: str, n: int, cores: float, window: float) -> float:
    from worker.core.keys import lease_key

    name = f"hot-{n}-{time.monotonic_ns() % 10**6}"
    sink = bench.sink()
    topic = bench.backlog(name, kind, 0)
    # Every reading asks for one more worker: the subscription spreads to N in about N seconds.
    config = fleet_config(bench, name, {"backlog_per_worker": 1},
                          {**bench.sub(name, topic, sink + "/push", kind, concurrency=64 * n), "max_workers": n})
    backlog = 60_000 * n
    bench.publish(topic, backlog, keys=1000 if kind == "key-shared" else 0)
    leases = [lease_key(f"p-bench/{name}", slot) for slot in range(n)]
    with contextlib.ExitStack() as stack:
        procs = []
        for i in range(n):
            cgroup = stack.enter_context(pod(f"pw-bench-{name}-{i}", cores))
            procs.append(start_in(cgroup, [sys.executable, "-m", "worker.cli", "run", "--config", str(config)],
                                  bench.dir / f"{name}-w{i}.log", PUSH_WORKER_ID=f"{name}-w{i}"))
        try:
            ps = [psutil.Process(p.pid) for p in procs]
            probes.wait(lambda: all(probes.status_port(p) and probes.worker_ready(p) for p in ps), 120,
                        f"{n} workers ready")
            probes.wait(lambda: all(bench.redis.mget(leases)), 120, f"{n} workers serving {name}")
            time.sleep(2.0)  # the last one's first requests: a second or two to reach its pace
            before, started = probes.get(sink + "/stats")["acked"], time.monotonic()
            time.sleep(window)
            after = probes.get(sink + "/stats")["acked"]
            rate = (after - before) / (time.monotonic() - started)
            if after >= backlog:
                raise RuntimeError(f"bench: the backlog for {n} workers ran out inside the window")
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(60)
    return float(rate)


def report(rows: list[dict[str, Any]], cores: float) -> str:
    """Each kind's rows against its own one-worker row."""
    lines = [f"spread: one subscription, 1 KiB raw, a backlog (key-shared: 1,000 keys); each worker a cgroup "
             f"of {cores:g} core",
             "| type | workers | deliveries/s | x one worker | / (N x one worker) | at least 0.8 |",
             "|---|---:|---:|---:|---:|---|"]
    for row in rows:
        one = next(r["msg_s"] for r in rows if r["kind"] == row["kind"] and r["workers"] == 1)
        n, rate = row["workers"], row["msg_s"]
        share = rate / (n * one)
        lines.append(f"| {row['kind']} | {n} | {rate:,.0f} | {rate / one:.2f} | {share:.2f} | "
                     f"{'holds' if share >= 0.8 else 'NO'} |")
    return "\n".join(lines)


HPA_TARGET = 20_000  # the HPA's averageValue in this run: backlog per replica
HPA_SCALE_DOWN_WINDOW = 20.0  # seconds of lower recommendations before a scale-in (the HPA's stabilization)


def hpa_loop(bench: Any, image: Path | None, max_replicas: int = 4, cores: float = 0.25, burst: int = 200_000,
             keys: int = 1000) -> dict[str, Any]:
    """The autoscaling loop end to end: a burst of `burst` messages (`keys` ordering keys) on one
    key-shared subscription (max_workers `max_replicas`), stored before its first worker starts;
    every 2 s, the HPA's formula on the fleet's backlog as prometheus-adapter serves it (the sum over
    subscriptions of the max over workers of pushworker_subscription_backlog):
    desired = ceil(current x (backlog / current) / target), within 1..max_replicas. A scale-up goes
    at once (the deployed HPA's 60 s window and doubling policy are left out to keep the run short),
    a scale-in only once every recommendation of the last HPA_SCALE_DOWN_WINDOW seconds allows it.
    Workers (each a cgroup of `cores`) are started and stopped by it. Returns the time series and
    what the sink saw; draws them into `image`."""
    from worker.core.keys import workers_key

    name = f"hpa-{time.monotonic_ns() % 10**6}"
    sink = bench.sink()
    topic = bench.backlog(name, "key-shared", 0)
    config = fleet_config(bench, name, {"backlog_per_worker": HPA_TARGET, "spread_quiet_seconds": 10},
                          {**bench.sub(name, topic, sink + "/push", "key-shared", concurrency=64 * max_replicas),
                           "max_workers": max_replicas})
    workers: list[tuple[subprocess.Popen[bytes], contextlib.ExitStack]] = []
    stopped: list[tuple[subprocess.Popen[bytes], contextlib.ExitStack]] = []

    def start() -> None:
        stack = contextlib.ExitStack()
        cgroup = stack.enter_context(pod(f"pw-bench-{name}-{len(workers) + len(stopped)}", cores))
        proc = start_in(cgroup, [sys.executable, "-m", "worker.cli", "run", "--config", str(config)],
                        bench.dir / f"{name}.log", PUSH_WORKER_ID=f"{name}-w{len(workers) + len(stopped)}")
        workers.append((proc, stack))

    def fleet_backlog() -> float:
        readings = []
        for proc, _ in workers:
            with contextlib.suppress(Exception):
                readings.append(probes.metric(psutil.Process(proc.pid), "pushworker_subscription_backlog"))
        return max(readings, default=0.0)  # one subscription: the max over workers is the adapter's figure

    series: list[dict[str, float]] = []
    # The burst, stored before the first worker starts; unbatched, so that the backlog counts each message.
    bench.publish(topic, burst, keys=keys, batched=False)
    start()
    try:
        probes.wait(lambda: probes.status_port(psutil.Process(workers[0][0].pid)) is not None
              and probes.worker_ready(psutil.Process(workers[0][0].pid)), 120, "the first worker ready")
        began = time.monotonic()
        recommendations: list[tuple[float, int]] = []
        drained_at: float | None = None
        while time.monotonic() - began < 600:
            now = time.monotonic() - began
            backlog, current = fleet_backlog(), len(workers)
            desired = max(1, min(max_replicas, math.ceil(current * (backlog / current) / HPA_TARGET)))
            recommendations = [(t, d) for t, d in recommendations if now - t < HPA_SCALE_DOWN_WINDOW]
            recommendations.append((now, desired))
            if desired > current:
                for _ in range(desired - current):
                    start()
            elif max(d for _, d in recommendations) < current:
                proc, stack = workers.pop()
                proc.terminate()  # a clean stop: it hands its slot over
                stopped.append((proc, stack))
            stats = probes.get(sink + "/stats")
            width = bench.redis.get(workers_key(f"p-bench/{name}"))
            series.append({"t": now, "replicas": len(workers), "backlog": backlog, "desired": desired,
                           "serving": int(width) if width else 1, "acked": stats["unique"]})
            if stats["unique"] >= burst:
                drained_at = drained_at or now
                if len(workers) == 1 and series[-1]["serving"] == 1:
                    break
            time.sleep(2.0)
        stats = probes.get(sink + "/stats")
    finally:
        for proc, stack in [*workers, *stopped]:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(60)
            stack.close()
    result = {"series": series, "published": burst, "delivered": stats["unique"], "lost": burst - stats["unique"],
              "out_of_order": stats["out_of_order"], "drained_at": drained_at,
              "max_replicas": max(row["replicas"] for row in series)}
    if image is not None:
        draw(result, image)
    return result


def draw(result: dict[str, Any], image: Path) -> None:
    """Replicas and serving workers over time above, the backlog below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = result["series"]
    t = [row["t"] for row in series]
    figure, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 5), dpi=100)
    top.step(t, [row["replicas"] for row in series], where="post", label="replicas (the loop's HPA formula)")
    top.step(t, [row["serving"] for row in series], where="post", linestyle="--",
             label="workers serving the subscription")
    top.set_ylabel("workers")
    top.set_ylim(0, max(row["replicas"] for row in series) + 2)
    top.legend(loc="upper center", ncol=2, fontsize="small")
    bottom.plot(t, [row["backlog"] for row in series], label="backlog (pushworker_backlog)")
    bottom.plot(t, [result["published"] - row["acked"] for row in series], linestyle=":",
                label="published, not yet delivered")
    bottom.set_ylabel("messages")
    bottom.set_xlabel("seconds since the burst began")
    bottom.legend(loc="upper right", fontsize="small")
    figure.suptitle(f"{result['published']:,} messages on one key-shared subscription; lost {result['lost']}, "
                    f"out of key order {result['out_of_order']}")
    figure.tight_layout()
    image.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(image)
    plt.close(figure)


def hpa_report(result: dict[str, Any]) -> str:
    series = result["series"]
    peak = max(series, key=lambda row: row["backlog"])
    return (f"autoscaling loop: {result['published']:,} published on one key-shared subscription, "
            f"{result['delivered']:,} delivered (lost {result['lost']}, first deliveries out of key order "
            f"{result['out_of_order']}); replicas 1 -> {result['max_replicas']} -> {series[-1]['replicas']}; "
            f"backlog peak {peak['backlog']:,.0f} at {peak['t']:.0f} s; drained at {result['drained_at'] or 0:.0f} s; "
            f"back to one worker at {series[-1]['t']:.0f} s")
