"""The embedded default: started from a directory with the default, relative state_dir; a worker
killed with SIGKILL, and the next one started on its state_dir."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest
import yaml
from aiohttp import web

from tests.support.endpoints import Endpoint
from tests.support.helpers import (
    assert_numbering_never_repeats,
    cli,
    eventually,
    http_get,
    run_cli,
    spawn_worker,
    stop_worker,
    wait_sync,
)
from worker.broker import embedded
from worker.broker.embedded import EmbeddedError, free_port, start_redis

pytestmark = pytest.mark.broker_independent


def test_run_with_the_default_relative_state_dir_reads_its_backlog(tmp_path: Path):
    """pulsar-lite once got a config path relative to the wrong directory: its metrics went to
    0.0.0.0:8080 and the backlog was never read."""
    port = free_port()
    (tmp_path / "worker.yaml").write_text(yaml.safe_dump({
        "http": {"port": port}, "destinations": {"allow_private": True}, "log": {"format": "json"},
        "subscriptions": [{"name": "local", "topic": "persistent://p-local/main/t",
                           "deliver": {"mode": "push", "push": {"url": "http://127.0.0.1:9/push"}}}]}))
    proc = spawn_worker("worker.yaml", tmp_path / "w.log", cwd=tmp_path)
    try:
        def backlog_reported() -> bool:
            code, _ = http_get(f"http://127.0.0.1:{port}/healthz")
            if code != 200:
                return False
            import urllib.request

            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                return b"pushworker_subscription_backlog{" in r.read()

        wait_sync(backlog_reported, timeout=10, what="the backlog read at start (not after the 15 s interval)")
        conf = (tmp_path / ".push-worker" / "pulsar-lite.toml").read_text()
        assert 'addr = "127.0.0.1:' in conf
    finally:
        assert stop_worker(proc, 30) == 0
    assert "backlog read failed" not in (tmp_path / "w.log").read_text()


def _state(pid: int) -> str:
    """The process's state letter (R, S, T stopped, Z zombie...); '' when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's reaper may be slow, or absent in a container)."""
    return _state(pid) not in ("", "Z")


def _embedded_config(path: Path, state_dir: Path, url: str) -> Path:
    path.write_text(yaml.safe_dump({
        "state_dir": str(state_dir), "http": {"port": free_port()}, "destinations": {"allow_private": True},
        "log": {"format": "json"},
        "subscriptions": [{"name": "local", "topic": "persistent://p-local/main/t", "max_deliver": 50,
                           "retry": {"min_backoff_seconds": 0.3, "max_backoff_seconds": 0.3},
                           "deliver": {"mode": "push", "push": {"url": url}}}]}))
    return path


async def _publish(config: Path, data: str) -> str:
    """`push-worker publish` to the embedded worker's topic; the message id."""
    code, out, err = await cli("publish", "persistent://p-local/main/t", data, "--config", str(config))
    assert code == 0, err
    return out.strip()


def _delivered(endpoint: Endpoint, mid: str) -> bool:
    return any(r.acked for r in endpoint.by_id().get(mid, []))


async def test_a_killed_worker_takes_its_broker_and_redis_along_and_the_next_start_goes_on(
        endpoint: Endpoint, tmp_path: Path):
    """A worker killed with SIGKILL used to leave its embedded broker and Redis running: they held
    its state_dir's data, and the next start failed ("pulsar-lite exited with code 1")."""
    state = tmp_path / "state"
    endpoint.behaviour = lambda rec: web.Response(status=500 if rec.body_payload == b"doomed" else 204)
    config = _embedded_config(tmp_path / "w.yaml", state, endpoint.url + "?raw")
    record = state / "endpoints.json"

    async def start(n: int) -> tuple[object, dict]:
        proc = spawn_worker(config, tmp_path / f"w{n}.log")
        await eventually(lambda: record.exists() and json.loads(record.read_text())["worker_pid"] == proc.pid,
                         timeout=30, what=f"worker {n}'s embedded services recorded")
        return proc, json.loads(record.read_text())["pids"]

    proc, pids = await start(1)
    doomed = await _publish(config, "doomed")
    first = await _publish(config, "first")
    await eventually(lambda: _delivered(endpoint, first) and len(endpoint.by_id().get(doomed, [])) >= 2, timeout=30,
                     what="the first message delivered and two attempts of the doomed one")
    proc.send_signal(signal.SIGKILL)
    await asyncio.to_thread(proc.wait, 10)
    await eventually(lambda: not any(_running(pid) for pid in pids.values()), timeout=20,
                     what="the killed worker's broker and Redis gone with it")
    tried = len(endpoint.by_id()[doomed])

    proc, pids = await start(2)
    try:
        second = await _publish(config, "second")
        await eventually(lambda: _delivered(endpoint, second) and len(endpoint.by_id()[doomed]) > tried + 1, timeout=30,
                         what="delivery going on after the restart")
        # A second worker on the same state_dir: refused in one line; the first one's services stay up.
        other = _embedded_config(tmp_path / "other.yaml", state, endpoint.url + "?raw")
        code, _, err = await cli("run", "--config", str(other))
        assert code == 1
        assert f"push-worker: state_dir {state} is in use by a running worker (pid {proc.pid})" in err
        assert all(_running(pid) for pid in pids.values())

        # Services left running all the same: the next start stops them instead of failing on their
        # data. They die with their worker, so the left-over ones are started here, on its data, and
        # recorded as the killed worker's. (Frozen with SIGSTOP they did not stay: their process
        # group, orphaned by the kill, gets SIGHUP and SIGCONT from the kernel, then their SIGTERM.)
        dead_worker = proc.pid
        proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(proc.wait, 10)
        await eventually(lambda: not any(_running(pid) for pid in pids.values()), timeout=20,
                         what="the killed worker's broker and Redis gone with it")
        leftovers = [await asyncio.to_thread(embedded.start_pulsar, state),
                     await asyncio.to_thread(embedded.start_redis, state)]
        pids = {s.name: s.proc.pid for s in leftovers}
        record.write_text(json.dumps({**embedded.service_urls(leftovers), "worker_pid": dead_worker, "pids": pids}))
        assert all(_running(pid) for pid in pids.values())
        proc, left = await start(3)
        for service in leftovers:
            await asyncio.to_thread(service.proc.wait, 10)  # reaped: stopped by the new worker
        assert not any(_running(pid) for pid in pids.values())
        third = await _publish(config, "third")
        await eventually(lambda: _delivered(endpoint, third), timeout=30, what="delivery by the third worker")
    finally:
        assert stop_worker(proc, 30) == 0
    assert "stopped an embedded service that a killed worker left running" in (tmp_path / "w3.log").read_text()
    assert not any(_running(pid) for pid in left.values())  # a clean stop stops them too
    # With no worker running there, a command asks for a URL at once instead of timing out on old ports.
    code, _, err = await cli("publish", "persistent://p-local/main/t", "late", "--config", str(config))
    assert code == 2 and "--service-url: is required" in err
    # At least once: a kill right after an endpoint's answer may send that message again (numbered on).
    assert_numbering_never_repeats(endpoint)
    assert {r.body_payload for r in endpoint.requests if r.acked} == {b"first", b"second", b"third"}


async def test_an_embedded_service_that_dies_is_started_again_and_delivery_goes_on(endpoint: Endpoint, tmp_path: Path):
    """A worker whose embedded Redis was killed waited for it for good (not ready, yet alive):
    nothing else would ever start it again."""
    state = tmp_path / "state"
    endpoint.behaviour = lambda rec: web.Response(status=500 if rec.body_payload == b"doomed" else 204)
    config = _embedded_config(tmp_path / "w.yaml", state, endpoint.url + "?raw")
    port = yaml.safe_load(config.read_text())["http"]["port"]
    record = state / "endpoints.json"

    def recorded() -> dict:
        try:
            return json.loads(record.read_text())
        except (OSError, ValueError):
            return {}

    proc = spawn_worker(config, tmp_path / "w.log")
    try:
        await eventually(lambda: recorded().get("worker_pid") == proc.pid, timeout=30, what="services recorded")
        doomed = await _publish(config, "doomed")
        await eventually(lambda: len(endpoint.by_id().get(doomed, [])) >= 2, timeout=30, what="two attempts")
        for name in ("redis-server", "pulsar-lite"):
            old = recorded()["pids"][name]
            os.kill(old, signal.SIGKILL)
            await eventually(lambda old=old, name=name: recorded()["pids"][name] != old
                             and _running(recorded()["pids"][name]), timeout=30, what=f"{name} started again")
            tried = len(endpoint.by_id()[doomed])
            await eventually(lambda tried=tried: len(endpoint.by_id()[doomed]) > tried + 1, timeout=30,
                             what=f"attempts going on after {name} came back")
            after = await _publish(config, f"after {name}")
            await eventually(lambda after=after: _delivered(endpoint, after), timeout=30, what=f"delivery after {name}")
            await eventually(lambda: http_get(f"http://127.0.0.1:{port}/readyz")[0] == 200, timeout=30,
                             what="ready again")
        pids = recorded()["pids"]
    finally:
        assert stop_worker(proc, 30) == 0
    log = (tmp_path / "w.log").read_text()
    assert log.count("embedded service exited; starting it again") == 2, log[-3000:]
    assert not any(_running(pid) for pid in pids.values())  # the restarted ones stop with the worker
    assert_numbering_never_repeats(endpoint)  # the attempt counts survived Redis's restart


def test_a_state_dir_that_cannot_be_used_is_named_in_one_line(tmp_path: Path):
    """It once said only `[Errno 17] File exists: '...'`."""
    (tmp_path / "a-file").touch()
    config = _embedded_config(tmp_path / "w.yaml", tmp_path / "a-file", "http://127.0.0.1:9/push")
    result = run_cli("run", "--config", str(config), timeout=60)
    last = result.stderr.strip().splitlines()[-1]  # after the worker's log lines (JSON here)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert last.startswith(f"push-worker: state_dir {tmp_path / 'a-file'} cannot be used (File exists)"), last


def test_free_port_never_hands_out_a_port_twice():
    """The kernel offered one port twice within a few calls: two fleet-test workers got it, and the
    second could not listen (500 plain bind-to-0 calls here repeat about 10 ports)."""
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)


def test_a_service_that_cannot_start_says_why_in_the_error(tmp_path: Path):
    """Not just "exited with code 1": the reason, from its log."""
    with pytest.raises(EmbeddedError) as raised:
        start_redis(tmp_path, None, "--no-such-directive", "x")
    assert "redis-server exited with code 1 before accepting connections: Bad directive" in str(raised.value)
    assert f"(log: {tmp_path / 'redis.log'})" in str(raised.value)
