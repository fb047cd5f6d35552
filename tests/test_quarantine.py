"""A message that kills its worker is contained (#58): each worker a 1 GiB "pod" (a cgroup v1 memory
limit, nested, entered before exec; an OOM kill there is real), restarted as a kubelet would. A
1.5 GiB zstd bomb on one of 50 subscriptions costs at most two worker deaths; that subscription is
Quarantined (with why and since), every other one is served again and delivers, none is quarantined
by mistake; `subs resume` tries it again."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pulsar
import pytest
import redis
import yaml

from devtools import apache_pulsar
from devtools.cgroups import cgroups_available
from tests.support import brokers
from tests.support.builders import push_sub
from tests.support.endpoints import Endpoint
from tests.support.helpers import cli, env, eventually
from tests.support.pulsar_client import Client
from worker.core.keys import fleet_key

MEMORY = Path("/sys/fs/cgroup/memory")
POD_BYTES = 1 << 30
FLEET = "contain"
SUBSCRIPTIONS = 50
POISONED = 17


@contextlib.contextmanager
def pods(count: int) -> Iterator[list[Path]]:
    """`count` cgroups of POD_BYTES each, nested one level below a cgroup of the test's own (as a
    kubelet nests a pod's containers): the worker must find its limit through /proc/self/cgroup."""
    parent = MEMORY / f"pw-test-{uuid.uuid4().hex[:8]}"
    parent.mkdir()
    made = []
    try:
        for i in range(count):
            pod = parent / f"w{i}"
            pod.mkdir()
            made.append(pod)
            (pod / "memory.limit_in_bytes").write_text(str(POD_BYTES))
            with contextlib.suppress(OSError):  # no swap accounting: nothing to limit there
                (pod / "memory.memsw.limit_in_bytes").write_text(str(POD_BYTES))
        yield made
    finally:
        for cgroup in [*made, parent]:
            for _ in range(100):  # its processes must be gone before it can go
                try:
                    cgroup.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)


class Kubelet:
    """Runs one worker per pod and starts it again when it dies, as a Deployment's kubelet restarts a
    container (at once: the tightest case for the fleet); counts the deaths and how each ended."""

    def __init__(self, config: Path, logs: Path, cgroups: list[Path]) -> None:
        self.config, self.logs, self.cgroups = config, logs, cgroups
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.deaths: list[tuple[str, int]] = []

    def start(self, i: int) -> None:
        wrapper = ["sh", "-c", f'echo $$ > {self.cgroups[i]}/cgroup.procs && exec "$@"', "sh",
                   sys.executable, "-m", "worker.cli", "run", "--config", str(self.config)]
        with open(self.logs / f"w{i}.log", "ab") as out:
            self.procs[i] = subprocess.Popen(wrapper, stdout=out, stderr=out,
                                             env=env(PUSH_WORKER_ID=f"pod-{i}"))

    def watch(self) -> None:
        """Restart every worker that ended."""
        for i, proc in list(self.procs.items()):
            if proc.poll() is not None:
                self.deaths.append((f"pod-{i}", proc.returncode))
                self.start(i)

    def oom_kills(self) -> int:
        return sum(int(line.split()[1]) for cgroup in self.cgroups
                   for line in (cgroup / "memory.oom_control").read_text().splitlines() if line.startswith("oom_kill "))

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def unguarded_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """An Apache Pulsar without the broker guard (every other one the project starts loads it, and it
    keeps the bomb away): what holds for a platform that has not installed it."""
    broker = apache_pulsar.start(tmp_path_factory.mktemp("unguarded"), guard=False)
    brokers.prepare(broker)
    yield broker
    broker.stop()


# Apache Pulsar: pulsar-lite keeps a killed worker's consumers (and their unacked messages, the bomb
# among them) until it restarts, so the bomb never reaches a second owner there (docs/testing.md).
@pytest.mark.apache_pulsar
@pytest.mark.slow
@pytest.mark.alone  # two 1 GiB cgroups filled to their OOM kill: the machine's memory, not this test's
@pytest.mark.timeout(480)
async def test_a_bomb_costs_at_most_two_deaths_and_quarantines_its_subscription_alone(
        unguarded_broker, redis_url, endpoint: Endpoint, tmp_path: Path):
    why = cgroups_available(MEMORY, "memory.limit_in_bytes")
    if why:
        pytest.skip(why)
    broker = unguarded_broker
    client = Client(broker.url)
    topics = [f"persistent://p-test/main/q{i}-{uuid.uuid4().hex[:8]}" for i in range(SUBSCRIPTIONS)]
    names = [f"s{i:02d}" for i in range(SUBSCRIPTIONS)]
    config = tmp_path / "worker.yaml"
    config.write_text(yaml.safe_dump({
        "pulsar": {"service_url": broker.url}, "redis": {"url": redis_url}, "http": {"port": 0},
        "destinations": {"allow_private": True}, "log": {"format": "json", "level": "info"},
        "fleet": {"name": FLEET, "lease_seconds": 2, "heartbeat_seconds": 0.5, "trial_seconds": 2},
        "subscriptions": [push_sub(name, topic, endpoint.url) for name, topic in zip(names, topics, strict=True)]}))
    store = redis.Redis.from_url(redis_url)

    def delivered(marker: str) -> set[int]:
        payloads = {r.body_payload for r in endpoint.requests}
        return {i for i in range(SUBSCRIPTIONS) if f"{marker}-{i}".encode() in payloads}

    with pods(2) as cgroups:
        kubelet = Kubelet(config, tmp_path, cgroups)
        try:
            for i in range(len(cgroups)):
                kubelet.start(i)
            for i, topic in enumerate(topics):
                client.publish(topic, [f"before-{i}".encode()])
            await eventually(lambda: len(delivered("before")) == SUBSCRIPTIONS, timeout=60,
                             what="every subscription delivering")
            for i in range(len(cgroups)):  # the pod's limit, found through /proc/self/cgroup in a nested cgroup
                started = [json.loads(line) for line in (tmp_path / f"w{i}.log").read_text().splitlines()
                           if line.startswith("{") and '"budgets"' in line]
                assert started and started[0]["max_held_bytes"] == POD_BYTES // 2, started
                assert str(cgroups[i]) in started[0]["max_held_bytes_from"], started

            producer = client.client.create_producer(topics[POISONED], batching_enabled=False,
                                                     compression_type=pulsar.CompressionType.ZSTD)
            producer.send(bytes(3 << 29))  # 1.5 GiB of zeros: a few KiB on the wire
            producer.close()
            for i, topic in enumerate(topics):
                if i != POISONED:
                    client.publish(topic, [f"after-{i}".encode()])

            def contained() -> bool:
                kubelet.watch()
                return bool(store.hexists(fleet_key(FLEET, "quarantined"), f"p-test/{names[POISONED]}")) and \
                    len(delivered("after")) == SUBSCRIPTIONS - 1
            await eventually(contained, timeout=300, interval=0.2, what="the bomb's subscription quarantined, "
                                                                      "every other one delivering")
            kubelet.watch()
            assert 1 <= len(kubelet.deaths) <= 2, kubelet.deaths
            assert kubelet.oom_kills() == len(kubelet.deaths), (kubelet.oom_kills(), kubelet.deaths)
            quarantined = {k.decode() for k in store.hkeys(fleet_key(FLEET, "quarantined"))}
            assert quarantined == {f"p-test/{names[POISONED]}"}  # none by mistake

            rows: dict[str, dict[str, str]] = {}

            async def listed_active() -> bool:  # the restarted pod takes its share back, suspects one at a time
                nonlocal rows
                kubelet.watch()
                code, out, err = await cli("subs", "list", "--config", str(config), "--json")
                assert code == 0, err
                rows = {row["name"]: row for row in json.loads(out)}
                return all(rows[n]["state"] == "Active" for n in names if n != names[POISONED])
            await eventually(listed_active, timeout=180, interval=1.0, what="every other subscription Active")
            assert rows[names[POISONED]]["state"] == "Quarantined", rows[names[POISONED]]
            assert rows[names[POISONED]]["reason"].startswith("quarantined since "), rows[names[POISONED]]
            assert len(kubelet.deaths) <= 2, kubelet.deaths

            # Resumed, it is tried again, alone first: the bomb is still there, so it costs one death more.
            deaths_before = len(kubelet.deaths)
            code, out, err = await cli("subs", "resume", names[POISONED], "--config", str(config))
            assert code == 0 and "resumed" in out, (out, err)
            assert not store.hexists(fleet_key(FLEET, "quarantined"), f"p-test/{names[POISONED]}")

            def again() -> bool:
                kubelet.watch()
                return bool(store.hexists(fleet_key(FLEET, "quarantined"), f"p-test/{names[POISONED]}"))
            await eventually(again, timeout=180, interval=0.2, what="quarantined again")
            assert len(kubelet.deaths) - deaths_before == 1, kubelet.deaths
            quarantined = {k.decode() for k in store.hkeys(fleet_key(FLEET, "quarantined"))}
            assert quarantined == {f"p-test/{names[POISONED]}"}  # none by mistake, this time either
        finally:
            kubelet.stop()
            store.close()
            client.close()

