"""Real worker processes sharing one broker and one Redis, for the fleet tests."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.builders import push_sub
from tests.support.endpoints import Endpoint
from tests.support.helpers import code_path, http_get, python_for, spawn_worker, stays_sync, stop_worker, wait_sync
from tests.support.redis_targets import RedisTarget
from worker.broker.embedded import free_port
from worker.fleet.ownership import owners_now
from worker.model.config import RedisSettings


class WorkerProcess:
    def __init__(self, worker_id: str, config: Path, log: Path, code: Path | None = None, gid: int | None = None,
                 **env: str) -> None:
        """`code`: a directory holding another version's `worker` package (the previous release);
        `gid`: a group of its own (`spawn_worker`); `env`: more of its environment
        (PUSH_WORKER_REDIS_URL through a fault point, say)."""
        self.id, self.log = worker_id, log
        self.port = free_port()
        self.proc = spawn_worker(config, log, gid=gid, code=code, PUSH_WORKER_ID=worker_id,
                                 PUSH_WORKER_HTTP_PORT=str(self.port), **env)

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics as {'name{labels}': value}."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            text = r.read().decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in s.labels.items())
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def fleet_size(self) -> float | None:
        """What this worker's /metrics says of the fleet's size; None while it does not answer."""
        try:
            return self.metrics().get("pushworker_fleet_size")
        except OSError:
            return None

    def owned(self) -> set[str]:
        try:
            samples = self.metrics()
        except OSError:
            return set()
        return {k for k, v in samples.items() if k.startswith("pushworker_subscription_owned{") and v == 1}

    def readiness(self) -> tuple[int, str]:
        """/readyz's status and reason; (0, "") while nothing answers."""
        status, body = http_get(f"http://127.0.0.1:{self.port}/readyz")
        return status, str(body.get("reason", ""))

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 30) -> int:
        return stop_worker(self.proc, timeout)


class FleetHarness:
    def __init__(self, tmp: Path, broker_url: str, redis: str | RedisTarget, admin_url: str = "",
                 pulsar: dict[str, Any] | None = None, **fleet: Any) -> None:
        """`pulsar`: more of the workers' pulsar settings (a backlog source, say); `fleet`: their fleet settings."""
        self.tmp = tmp
        target = redis if isinstance(redis, RedisTarget) else RedisTarget("standalone", RedisSettings(url=redis),
                                                                          {"url": redis})
        self.redis = target.client()
        self.config = tmp / "worker.yaml"
        self.config.write_text(yaml.safe_dump({
            "pulsar": {"service_url": broker_url, **({"admin_url": admin_url} if admin_url else {}), **(pulsar or {})},
            "redis": target.config,
            "destinations": {"allow_private": True}, "shutdown_grace_seconds": 10,
            "log": {"format": "json", "level": "debug"},
            "fleet": {"name": "test", "lease_seconds": 3, "heartbeat_seconds": 0.3, **fleet},
        }))
        self.workers: dict[str, WorkerProcess] = {}
        self._n = 0

    def start(self, worker_id: str | None = None, code: Path | None = None, gid: int | None = None,
              **env: str) -> WorkerProcess:
        worker_id = worker_id or f"w{self._n}"
        self._n += 1
        name = worker_id if worker_id not in self.workers else f"{worker_id}#{self._n}"  # a twin (same id)
        w = WorkerProcess(worker_id, self.config, self.tmp / f"{name}.log", code, gid, **env)
        self.workers[name] = w
        return w

    def apply(self, definitions: list[dict[str, Any]], code: Path | None = None) -> subprocess.CompletedProcess[str]:
        path = self.tmp / f"subs-{uuid.uuid4().hex[:8]}.yaml"
        path.write_text(yaml.safe_dump({"subscriptions": definitions}))
        return self.cli("subs", "apply", "-f", str(path), code=code)

    def cli(self, *args: str, code: Path | None = None) -> subprocess.CompletedProcess[str]:
        """`push-worker ARGS --config ...`; `code`: another version's (as for `start`)."""
        return subprocess.run([python_for(code), "-m", "worker.cli", *args, "--config", str(self.config)],
                              capture_output=True, text=True, timeout=60, cwd=code,
                              env={**os.environ, **code_path(code)})

    def holders(self, key: str, slots: int) -> list[str]:
        """The workers holding the subscription's slots, by slot ("" where none does)."""
        return owners_now(self.redis, "test", [key], slots)[key]

    def owners(self, keys: list[str]) -> dict[str, str | None]:
        return {k: owner[0] or None for k, owner in owners_now(self.redis, "test", keys).items()}

    def close(self) -> None:
        for w in self.workers.values():
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGCONT)
            w.stop()
        self.redis.close()


def fleet_sub(name: str, topic: str, url: str, **extra) -> dict:
    """Fleet tests retry for as long as they run (messages must arrive whatever the owner does), with
    the breaker at its default: the previous release's workers (tests/test_upgrade.py) know no
    `breaker` field, and nothing here is dead-lettered for it to hold back."""
    definition = push_sub(name, topic, url, **{"max_deliver": 1000,
                                               "retry": {"min_backoff_seconds": 0.2, "max_backoff_seconds": 0.5},
                                               **extra})
    definition["deliver"]["push"].pop("breaker", None)
    return definition


def topics(n: int) -> list[str]:
    base = uuid.uuid4().hex[:8]
    return [f"persistent://p-fleet/main/{base}-{i}" for i in range(n)]


def settled_ownership(fleet: FleetHarness, workers, keys: list[str], per_worker: int) -> None:
    """Wait until leases and every worker's own metrics agree, and stay so for a second.

    (pulsar-lite leaks a consumer whose connection dies in the same moment it subscribed; killing
    a worker in the middle of a handover would hit that broker bug rather than test the fleet.)"""
    def agree() -> bool:
        owners = fleet.owners(keys)
        return all(len(w.owned()) == per_worker and sum(o == w.id for o in owners.values()) == per_worker
                   for w in workers)

    wait_sync(agree, 30, "ownership settled")
    stays_sync(agree, 1.0, "settled ownership")


def first_deliveries_by_partition(endpoint: Endpoint) -> dict[str, list[int]]:
    """Per partition, the entry ids of the messages the endpoint received, in the order each first arrived."""
    first_seen: dict[str, list[int]] = collections.defaultdict(list)
    seen: set[str] = set()
    for r in endpoint.requests:
        mid = r.headers["Pubsub-Message-Id"]
        if mid not in seen:
            seen.add(mid)
            _, entry, partition, _ = mid.split(":")
            first_seen[partition].append(int(entry))
    return first_seen


def delivered(endpoint: Endpoint) -> dict[str, set[str]]:
    """Per subscription name, the message ids the endpoint acked."""
    out: dict[str, set[str]] = collections.defaultdict(set)
    for r in endpoint.requests:
        if r.acked:
            out[r.headers["Pubsub-Subscription"]].add(r.headers["Pubsub-Message-Id"])
    return out
