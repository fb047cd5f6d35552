"""Helpers every test module shares (fixtures live in conftest.py): polling with a deadline, "nothing
happens" windows, worker processes, the command line, HTTP probes, what an endpoint saw, subscription
definitions."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from tests.support.endpoints import Endpoint

ROOT = Path(__file__).resolve().parents[2]


# -- waiting ----------------------------------------------------------------------------------

async def eventually(predicate: Callable[[], bool | Awaitable[bool]], timeout: float = 20.0,
                     what: str = "condition", interval: float = 0.02) -> None:
    """Poll `predicate` (plain or async) until it holds, with a deadline (no sleeps as synchronisation)."""
    deadline = time.monotonic() + timeout
    while True:
        held = predicate()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


def wait_sync(predicate: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def _still_holds(predicate: Callable[[], bool], deadline: float, what: str) -> bool:
    """Whether the window goes on; raises as soon as `predicate` stops holding."""
    if not predicate():
        raise AssertionError(f"{what} stopped holding")
    return time.monotonic() < deadline


async def assert_stays(predicate: Callable[[], bool], seconds: float, what: str = "condition") -> None:
    """For "nothing happens" windows: `predicate` holds now and through `seconds` (checked as it
    goes, so a violation fails at once instead of after the window)."""
    deadline = time.monotonic() + seconds
    while _still_holds(predicate, deadline, what):
        await asyncio.sleep(0.02)


def stays_sync(predicate: Callable[[], bool], seconds: float, what: str = "condition") -> None:
    """`assert_stays` for blocking code (threads, harness helpers)."""
    deadline = time.monotonic() + seconds
    while _still_holds(predicate, deadline, what):
        time.sleep(0.05)


# -- processes and the command line -----------------------------------------------------------

def python_for(code: Path | None = None) -> str:
    """The interpreter that runs `code`: another release's own environment, installed from the locks
    it shipped (tests/support/previous_release.py), or this one's."""
    own = code / PREVIOUS_PYTHON if code is not None else None
    return own.read_text().strip() if own is not None and own.exists() else sys.executable


PREVIOUS_PYTHON = ".python"  # in a release's extracted directory: the path of its environment's interpreter


def code_path(code: Path | None = None) -> dict[str, str]:
    """How a Python process finds the code under test: `code` (another release's checkout), or the
    compiled build `make test` runs on (its PYTHONPATH and PYTHONSAFEPATH, inherited) before the
    checkout."""
    if code is not None:
        return {"PYTHONPATH": str(code)}
    first = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    safe = {"PYTHONSAFEPATH": "1"} if os.environ.get("PYTHONSAFEPATH") else {}
    return {"PYTHONPATH": os.pathsep.join([*first, str(ROOT)]), **safe}


def env(**extra: str) -> dict[str, str]:
    """The environment for a `push-worker` process run from the checkout."""
    # faulthandler: a worker that stop_worker has to abort prints every thread's stack first.
    return {**os.environ, **code_path(), "PYTHONFAULTHANDLER": "1", **extra}


def spawn_worker(config: Path | str, log: Path, cwd: Path | None = None, gid: int | None = None,
                 code: Path | None = None, **extra_env: str) -> subprocess.Popen[bytes]:
    """`push-worker run --config CONFIG` as its own process, its output appended to `log`; `code`:
    another release's `worker` package, run by its own interpreter (`python_for`); with `gid`, in a
    group of its own (still root), so that a firewall rule can single out its packets
    (tests/support/faults.py)."""
    group = ["setpriv", f"--regid={gid}", "--clear-groups", "--"] if gid is not None else []
    environment = env(**extra_env) if code is None else {**os.environ, **code_path(code), "PYTHONFAULTHANDLER": "1",
                                                         **extra_env}
    with open(log, "ab") as out:
        return subprocess.Popen([*group, python_for(code), "-m", "worker.cli", "run", "--config", str(config)],
                                stdout=out, stderr=out, env=environment, cwd=cwd or code)


def stop_worker(proc: subprocess.Popen[bytes], timeout: float = 30) -> int:
    """SIGTERM, then the exit code once it ends within `timeout`. One that has not leaves the cause
    in its log before it goes: what each task waits on (SIGUSR1, answered by its event loop), then
    every thread's stack (SIGABRT, answered by faulthandler even when the loop itself is blocked)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            for dump in (signal.SIGUSR1, signal.SIGABRT):
                proc.send_signal(dump)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(2)  # time to write it: a hung worker does not end on SIGUSR1
            proc.kill()
            proc.wait()
    return proc.returncode


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 120,
            environment: dict[str, str] | None = None, module: str = "worker.cli") -> subprocess.CompletedProcess[str]:
    """`push-worker ARGS` (or, with module="devtools", a development tool) as a separate process, to
    its end (no standard input)."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env=environment or env(), stdin=subprocess.DEVNULL)


async def cli(*args: str, stdin: str | None = None, extra_env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """`push-worker ARGS` as a separate process, awaited; (exit code, stdout, stderr). The test
    environment's PUSH_WORKER_* variables are left out, so only the arguments (and `extra_env`)
    choose the target."""
    clean = {k: v for k, v in env().items() if not k.startswith("PUSH_WORKER_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "worker.cli", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.PIPE, env=clean | (extra_env or {}))
    try:
        out, err = await asyncio.wait_for(proc.communicate(stdin.encode() if stdin else b""), timeout=60)
    except TimeoutError:
        proc.kill()
        out, err = await proc.communicate()
        raise AssertionError(f"push-worker {' '.join(args)} did not end:\n{err.decode()[-3000:]}") from None
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


# -- HTTP probes ------------------------------------------------------------------------------

def http_get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of a GET; (0, {}) when nothing answers. Blocking: from a test that runs
    a worker in its own event loop, call it through asyncio.to_thread."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except OSError:
        return 0, {}


def metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


# -- what an endpoint saw ---------------------------------------------------------------------

def assert_numbering_never_repeats(endpoint: Endpoint) -> None:
    """Every message's attempt numbers, in the order the endpoint received them, only go up."""
    for mid, requests in endpoint.by_id().items():
        numbers = [int(r.headers["Pubsub-Delivery-Attempt"]) for r in requests]
        assert numbers == sorted(set(numbers)), f"{mid}: numbering went back or repeated: {numbers}"


# -- definitions ------------------------------------------------------------------------------

def self_signed(where: Path, subject_alt_name: str) -> tuple[Path, Path]:
    """A self-signed certificate for `subject_alt_name` (`IP:...` or `DNS:...`) and its key."""
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=" + subject_alt_name.split(":", 1)[1], "-addext", f"subjectAltName={subject_alt_name}",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


class TlsTerminator:
    """A TLS terminator in front of a plain TCP service (a managed Redis with in-transit encryption
    looks like this to its clients): each connection is decrypted and piped to `target_port`."""

    def __init__(self, target_port: int, certificate: tuple[Path, Path]) -> None:
        self.target_port = target_port
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(*certificate)
        self.server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> TlsTerminator:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.context)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()
