"""A message that kills its worker is contained, and only such a death costs a trial: each worker a
1 GiB "pod" (a cgroup v1 memory limit, nested, entered before exec; an OOM kill there is real),
restarted as a kubelet would.

- A 1.5 GiB zstd bomb on one of 400 subscriptions (200 a worker) costs at most two deaths; that
  subscription is Quarantined (with why and since), every other one of the dead worker's delivers
  again within 60 s of the death, none is quarantined by mistake; `subs resume` tries it again.
- A bomb on a subscription that is not on trial, landing beside another project's trial, quarantines
  the bomb's subscription and not the one on trial.
- A kill -9 (no memory evidence) starts no trial: the dead worker's subscriptions deliver again
  within the lease + 10 s."""

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
from worker.core.keys import fleet_key, holder_key

MEMORY = Path("/sys/fs/cgroup/memory")
POD_BYTES = 1 << 30
FLEET = "contain"
SUBSCRIPTIONS = 400  # 200 a worker
POISONED = 17
HEALTHY_BACK_SECONDS = 60.0  # a memory death's healthy subscriptions deliver again within this


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
        self.died_at: list[float] = []  # monotonic, as seen by `watch` (polled every 0.2 s)

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
                self.died_at.append(time.monotonic())
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


def write_config(tmp_path: Path, broker_url: str, redis_url: str, subscriptions: list[dict[str, object]],
                 **fleet: object) -> Path:
    """A worker config with the fleet's defaults but a short lease (2 s: the tests wait less for a
    dead worker's leases to lapse), logging JSON."""
    config = tmp_path / "worker.yaml"
    config.write_text(yaml.safe_dump({
        "pulsar": {"service_url": broker_url}, "redis": {"url": redis_url}, "http": {"port": 0},
        "destinations": {"allow_private": True}, "log": {"format": "json", "level": "info"},
        "fleet": {"name": FLEET, "lease_seconds": 2, "heartbeat_seconds": 0.5, **fleet},
        "subscriptions": subscriptions}))
    return config


def first_delivered(endpoint: Endpoint, marker: str, count: int) -> dict[int, float]:
    """When `<marker>-<i>` first reached the endpoint (monotonic), by i."""
    wanted = {f"{marker}-{i}".encode(): i for i in range(count)}
    out: dict[int, float] = {}
    for r in list(endpoint.requests):
        i = wanted.get(r.body_payload)
        if i is not None and i not in out:
            out[i] = r.at
    return out


def send_bomb(client: Client, topic: str) -> None:
    """1.5 GiB of zeros, ZSTD-compressed: a few KiB on the wire, inflated by the consumer's client."""
    producer = client.client.create_producer(topic, batching_enabled=False,
                                             compression_type=pulsar.CompressionType.ZSTD)
    producer.send(bytes(3 << 29))
    producer.close()


def log_lines(path: Path, event: str | None) -> list[dict[str, object]]:
    """A worker's JSON log lines of one event (every line for None)."""
    complete = path.read_text().split("\n")[:-1]  # a line still being written is not read
    lines = [json.loads(line) for line in complete if line.startswith("{")]
    return [line for line in lines if event is None or line.get("event") == event]


def held_now(path: Path) -> set[object]:
    """The subscriptions a worker holds by its log: acquired and not released since."""
    held: set[object] = set()
    for line in log_lines(path, None):
        if line.get("event") == "subscription acquired":
            held.add(line["subscription"])
        elif line.get("event") in ("subscription released", "subscription paused"):
            held.discard(line["subscription"])
    return held


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
    config = write_config(tmp_path, broker.url, redis_url, [push_sub(name, topic, endpoint.url)
                                                            for name, topic in zip(names, topics, strict=True)])
    store = redis.Redis.from_url(redis_url)

    def delivered(marker: str) -> set[int]:
        return set(first_delivered(endpoint, marker, SUBSCRIPTIONS))

    with pods(2) as cgroups:
        kubelet = Kubelet(config, tmp_path, cgroups)
        try:
            for i in range(len(cgroups)):
                kubelet.start(i)
            for i, topic in enumerate(topics):
                client.publish(topic, [f"before-{i}".encode()])
            await eventually(lambda: len(delivered("before")) == SUBSCRIPTIONS, timeout=120,
                             what="every subscription delivering")
            for i in range(len(cgroups)):  # the pod's limit, found through /proc/self/cgroup in a nested cgroup
                started = [json.loads(line) for line in (tmp_path / f"w{i}.log").read_text().splitlines()
                           if line.startswith("{") and '"budgets"' in line]
                assert started and started[0]["max_held_bytes"] == POD_BYTES // 2, started
                assert str(cgroups[i]) in started[0]["max_held_bytes_from"], started

            send_bomb(client, topics[POISONED])
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
            # The dead worker's 199 healthy subscriptions came back within a minute of its death, not
            # one trial after another.
            back = first_delivered(endpoint, "after", SUBSCRIPTIONS)
            late = {i: round(at - kubelet.died_at[0], 1) for i, at in back.items()
                    if at - kubelet.died_at[0] > HEALTHY_BACK_SECONDS}
            assert not late, late
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



@pytest.mark.apache_pulsar
@pytest.mark.slow
@pytest.mark.alone  # a 1 GiB cgroup filled to its OOM kill
@pytest.mark.timeout(300)
async def test_a_bomb_beside_another_projects_trial_quarantines_the_bomb_and_not_the_trial(
        unguarded_broker, redis_url, endpoint: Endpoint, tmp_path: Path):
    """One worker serves p-a's subscription on trial (resumed after a quarantine: tried first) and
    p-b's, not on trial. A bomb on p-b's inflates on the shared client: the alarm names no trial, so
    p-a's is not quarantined; the next holder tries both, each on a client of its own, and the bomb
    is named there: p-b's alone is quarantined, after two deaths."""
    why = cgroups_available(MEMORY, "memory.limit_in_bytes")
    if why:
        pytest.skip(why)
    broker = unguarded_broker
    client = Client(broker.url)
    trial_topic, bomb_topic = (f"persistent://{tenant}/main/{uuid.uuid4().hex[:8]}" for tenant in ("p-a", "p-b"))
    subs = [push_sub("on-trial", trial_topic, endpoint.url),
            push_sub("bombed", bomb_topic, endpoint.url)]
    # On trial for long: it is still on trial when the bomb lands beside it.
    config = write_config(tmp_path, broker.url, redis_url, subs, trial_seconds=60)
    store = redis.Redis.from_url(redis_url)
    # What `subs resume` of a quarantined subscription leaves: the next holder tries it first.
    store.hset(holder_key("p-a/on-trial"), mapping={"instance": "quarantined", "worker": "w-gone", "trial": "0"})
    quarantined_key = fleet_key(FLEET, "quarantined")

    def payloads() -> set[bytes]:
        return {r.body_payload for r in endpoint.requests}

    with pods(1) as cgroups:
        kubelet = Kubelet(config, tmp_path, cgroups)
        try:
            kubelet.start(0)
            client.publish(trial_topic, [b"trial-1"])
            client.publish(bomb_topic, [b"bombed-1"])
            await eventually(lambda: {b"trial-1", b"bombed-1"} <= payloads(), timeout=60, what="both delivering")
            assert [line["subscription"] for line in log_lines(tmp_path / "w0.log", "on trial: its last holder died "
                    "with its memory alarm raised; served on a client of its own for a while")] == ["p-a/on-trial"]

            send_bomb(client, bomb_topic)
            client.publish(trial_topic, [b"trial-2"])

            def contained() -> bool:
                kubelet.watch()
                return bool(store.hexists(quarantined_key, "p-b/bombed")) and b"trial-2" in payloads()
            await eventually(contained, timeout=180, interval=0.2, what="the bomb's subscription quarantined, "
                                                                      "the one on trial delivering")
            kubelet.watch()
            assert len(kubelet.deaths) == 2 and kubelet.oom_kills() == 2, (kubelet.deaths, kubelet.oom_kills())
            assert {k.decode() for k in store.hkeys(quarantined_key)} == {"p-b/bombed"}  # not p-a's
            client.publish(trial_topic, [b"trial-3"])
            await eventually(lambda: b"trial-3" in payloads(), timeout=60, what="p-a's still delivering")
            assert {k.decode() for k in store.hkeys(quarantined_key)} == {"p-b/bombed"}
        finally:
            kubelet.stop()
            store.close()
            client.close()


@pytest.mark.apache_pulsar
@pytest.mark.slow
@pytest.mark.alone  # cgroups
@pytest.mark.timeout(300)
async def test_a_kill_9_starts_no_trial_and_the_dead_workers_subscriptions_deliver_within_the_lease_and_10_s(
        broker, redis_url, endpoint: Endpoint, tmp_path: Path):
    """Two workers (1 GiB pods: the memory watch runs) share 40 subscriptions at the fleet's defaults
    (a 10 s lease); one is killed with SIGKILL, with no memory pressure. No trial: every subscription
    it held delivers a message published after the kill within the lease + 10 s."""
    why = cgroups_available(MEMORY, "memory.limit_in_bytes")
    if why:
        pytest.skip(why)
    count = 40
    client = Client(broker.url)
    topics = [f"persistent://p-test/main/k{i}-{uuid.uuid4().hex[:8]}" for i in range(count)]
    names = [f"k{i:02d}" for i in range(count)]
    config = tmp_path / "worker.yaml"
    config.write_text(yaml.safe_dump({
        "pulsar": {"service_url": broker.url}, "redis": {"url": redis_url}, "http": {"port": 0},
        "destinations": {"allow_private": True}, "log": {"format": "json", "level": "info"},
        "fleet": {"name": f"kill-{uuid.uuid4().hex[:6]}"},  # the defaults: lease 10 s, trials 5 s
        "subscriptions": [push_sub(n, t, endpoint.url) for n, t in zip(names, topics, strict=True)]}))
    lease_seconds = 10.0

    with pods(2) as cgroups:
        kubelet = Kubelet(config, tmp_path, cgroups)
        try:
            for i in range(2):
                kubelet.start(i)
            for i, topic in enumerate(topics):
                client.publish(topic, [f"before-{i}".encode()])
            await eventually(lambda: len(first_delivered(endpoint, "before", count)) == count, timeout=90,
                             what="every subscription delivering")
            # The rebalance after the second start may still be handing over: kill when pod-0 holds a share.
            await eventually(lambda: 0 < len(held_now(tmp_path / "w0.log")) < count, timeout=60,
                             what="pod-0 holding a share, not all")
            kubelet.procs[0].kill()
            killed_at = time.monotonic()
            for i, topic in enumerate(topics):
                client.publish(topic, [f"after-{i}".encode()])
            await eventually(lambda: len(first_delivered(endpoint, "after", count)) == count, timeout=120,
                             what="every subscription delivering after the kill")
            back = first_delivered(endpoint, "after", count)
            late = {names[i]: round(at - killed_at, 1) for i, at in back.items()
                    if at - killed_at > lease_seconds + 10}
            assert not late, late
            kubelet.watch()
            for i in range(2):  # no trial anywhere: a kill -9 leaves no memory evidence
                log = tmp_path / f"w{i}.log"
                assert not [line for line in log_lines(log, "subscription acquired") if line.get("suspect")], i
                assert "on trial" not in log.read_text(), i
        finally:
            kubelet.stop()
            client.close()
