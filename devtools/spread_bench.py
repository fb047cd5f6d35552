"""`make bench BENCH_ARGS="--section spread"`: one hot subscription spread over 1, 2 and 4 workers,
each a "pod" with a CPU limit, as Kubernetes enforces one: a cgroup (v1 `cpu` controller) whose CFS
quota is a fraction of a core, so several fit on a 2-core machine. Needs root, that controller, and
Apache Pulsar (`PULSAR_URL`, `PULSAR_ADMIN_URL`: pulsar-lite refuses a second worker's consumer
whose id equals the first's, docs/testing.md)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import yaml

CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


def cgroups_available() -> str:
    """Why the section cannot run here ("" when it can)."""
    if not (CPU_CGROUP / "cpu.cfs_quota_us").exists():
        return "no cgroup v1 cpu controller at /sys/fs/cgroup/cpu"
    try:
        probe = CPU_CGROUP / f"pw-bench-probe-{time.monotonic_ns()}"
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        return f"cannot create a cgroup there ({e.strerror}): run as root"
    return ""


@contextlib.contextmanager
def pod(name: str, cores: float) -> Iterator[Path]:
    """A cgroup whose processes together get at most `cores` of CPU time."""
    path = CPU_CGROUP / name
    path.mkdir()
    try:
        (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (path / "cpu.cfs_quota_us").write_text(str(int(cores * PERIOD_US)))
        yield path
    finally:
        for _ in range(50):  # its processes must be gone before it can go
            with contextlib.suppress(OSError):
                path.rmdir()
                break
            time.sleep(0.1)


def start_in(cgroup: Path, command: list[str], log: Path, **env: str) -> subprocess.Popen[bytes]:
    """`command` as a process that enters `cgroup` before it execs (so every thread is limited)."""
    import os

    wrapper = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh", *command]
    with open(log, "ab") as out:
        return subprocess.Popen(wrapper, stdout=out, stderr=out, env={**os.environ, **env})


def scale_out(bench: Any, kind: str, counts: tuple[int, ...] = (1, 2, 4), cores: float = 0.25,
              window: float = 10.0) -> list[dict[str, Any]]:
    """For each N in `counts`: a backlog on one subscription of `kind` (key-shared: 1,000 keys) with
    max_workers N, N workers of `cores` each; once N serve it, the deliveries a second over `window`
    seconds."""
    return [{"kind": kind, "workers": n, "msg_s": _measure(bench, kind, n, cores, window)} for n in counts]


def _measure(bench: Any, kind: str, n: int, cores: float, window: float) -> float:
    from devtools.bench import _get, _status_port, _wait, _worker_ready
    from worker.core.keys import lease_key

    name = f"hot-{n}-{time.monotonic_ns() % 10**6}"
    sink = bench.sink()
    topic = bench.backlog(name, kind, 0)
    config = bench.dir / f"spread-{name}.yaml"
    config.write_text(yaml.safe_dump({
        "pulsar": {"service_url": bench.broker.url, "admin_url": bench.broker.admin_url,
                   "backlog_interval_seconds": 1},
        "redis": {"url": bench.redis_service.url}, "http": {"port": 0},
        "destinations": {"allow_private": True}, "log": {"format": "json", "level": "warning"},
        "state_dir": str(bench.dir / "worker"),
        # Every reading asks for one more worker: the subscription spreads to N in about N seconds.
        "fleet": {"name": name, "lease_seconds": 5, "heartbeat_seconds": 0.5, "backlog_per_worker": 1},
        "subscriptions": [{**bench.sub(name, topic, sink + "/push", kind, concurrency=64 * n), "max_workers": n}]}))
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
            _wait(lambda: all(_status_port(p) and _worker_ready(p) for p in ps), 120, f"{n} workers ready")
            _wait(lambda: all(bench.redis.mget(leases)), 120, f"{n} workers serving {name}")
            time.sleep(2.0)  # the last one's first requests: a second or two to reach its pace
            before, started = _get(sink + "/stats")["acked"], time.monotonic()
            time.sleep(window)
            after = _get(sink + "/stats")["acked"]
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
