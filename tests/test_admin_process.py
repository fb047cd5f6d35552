"""`push-worker admin`: the operator API and console in a process of their own, as deployed
(deploy/base/admin-deployment.yaml) and as an embedded worker starts it beside itself."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from tests.support.admin import PRINCIPALS, admin_settings
from tests.support.helpers import env, eventually, http_get, spawn_worker, stop_worker
from worker.broker.embedded import free_port


def _admin_section(directory: Path, port: int) -> tuple[dict[str, Any], dict[str, str]]:
    settings, tokens = admin_settings(directory)
    section = {"host": "127.0.0.1", "port": port,
               "tokens": [{"subject": t.subject, "file": t.file, "roles": PRINCIPALS[t.subject]}
                          for t in settings.tokens]}
    return section, tokens


def _api(port: int, path: str, token: str) -> tuple[int, Any]:
    return http_get(f"http://127.0.0.1:{port}{path}", {"Authorization": f"Bearer {token}"})


def _admin_process(config: Path, log_path: Path) -> subprocess.Popen[bytes]:
    """`push-worker admin --config CONFIG`, its output to `log_path`."""
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "worker.cli", "admin", "--config", str(config)],
                                stdout=log, stderr=log, env=env())


async def _ready(http_port: int) -> None:
    await eventually(lambda: http_get(f"http://127.0.0.1:{http_port}/readyz")[0] == 200, timeout=30,
                     what="the admin process ready")


def _pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


async def test_push_worker_admin_serves_the_api_and_its_probes_and_stops_on_sigterm(broker, redis_url, tmp_path):
    admin_port, http_port = free_port(), free_port()
    section, tokens = _admin_section(tmp_path / "tokens", admin_port)
    config = tmp_path / "worker.yaml"
    config.write_text(yaml.safe_dump({"pulsar": {"service_url": broker.url}, "redis": {"url": redis_url},
                                      "http": {"port": http_port}, "admin": section, "log": {"format": "json"}}))
    proc = _admin_process(config, tmp_path / "admin.log")
    try:
        await _ready(http_port)
        assert http_get(f"http://127.0.0.1:{http_port}/healthz")[0] == 200
        status, listed = await asyncio.to_thread(_api, admin_port, "/v1/projects/p-a/subscriptions", tokens["alice"])
        assert status == 200 and listed["subscriptions"] == []
        assert (await asyncio.to_thread(_api, admin_port, "/v1/projects/p-a/subscriptions", "forged"))[0] == 401
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5) as answer:
            metrics = answer.read().decode()
        assert "pushworker_admin_refused_anonymous_total 1.0" in metrics, metrics
        assert 'pushworker_admin_requests_total{status="2xx"} 1.0' in metrics
    finally:
        assert stop_worker(proc, 15) == 0
    assert "admin process stopped" in (tmp_path / "admin.log").read_text()


async def test_push_worker_admin_without_an_admin_section_says_so_in_one_line(redis_url, broker, tmp_path):
    config = tmp_path / "worker.yaml"
    config.write_text(yaml.safe_dump({"pulsar": {"service_url": broker.url}, "redis": {"url": redis_url}}))
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "worker.cli", "admin", "--config", str(config),
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                env=env())
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    assert err.decode().strip() == ("push-worker: invalid configuration: config: admin: is required: push-worker "
                                    "admin serves the admin: section's listener (docs/operator-api.md)")


async def test_an_embedded_worker_starts_the_admin_process_beside_it_and_takes_it_along_when_killed(tmp_path):
    admin_port = free_port()
    section, tokens = _admin_section(tmp_path / "tokens", admin_port)
    config = tmp_path / "worker.yaml"
    config.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"), "http": {"port": free_port()},
                                      "admin": section, "log": {"format": "json"}}))
    log = tmp_path / "worker.log"
    proc = spawn_worker(config, log)
    try:
        await eventually(lambda: asyncio.to_thread(lambda: _api(admin_port, "/v1/projects/p-a/subscriptions",
                                                                tokens["alice"])[0] == 200),
                         timeout=60, what="the API answering beside the embedded worker")
        started = [json.loads(line) for line in log.read_text().splitlines()
                   if line.startswith("{") and '"admin process started"' in line]
        child = next(line["pid"] for line in started if "pid" in line)
        assert child != proc.pid and _pid_alive(child)  # a process of its own
        proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(proc.wait, 10)
        await eventually(lambda: not _pid_alive(child), timeout=20, what="the admin process gone with the worker")
    finally:
        if proc.poll() is None:
            stop_worker(proc, 30)
    assert os.path.exists(log)


def _footprint(pid: int) -> tuple[int, int, int]:
    """Threads, open descriptors and resident bytes of a process."""
    proc = Path(f"/proc/{pid}")
    resident = int((proc / "statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return len(os.listdir(proc / "task")), len(os.listdir(proc / "fd")), resident


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.broker_independent  # the admin process's own threads, descriptors and memory (lane time bounded)
async def test_a_thousand_replays_redrives_and_payload_reads_leave_the_admin_process_as_it_was(
        start_worker, broker, redis_url, endpoint, client, tmp_path):
    """Every replay and redrive made a Pulsar client the admin process never gave back (60 replays:
    23 -> 83 threads, 115 -> 475 descriptors). One client serves them all now: after 1,000
    operations its threads, descriptors and memory are where they were after the first 50."""
    from tests.support.admin import ApiClient
    from tests.test_operator_api import definition
    from worker.model.config import FleetSettings

    fleet = "bounded-" + uuid.uuid4().hex[:8]
    secrets = tmp_path / "secrets"
    (secrets / "p-a").mkdir(parents=True)
    (secrets / "p-a" / "push-token").write_text("p-a-bearer-" + uuid.uuid4().hex)
    w = await start_worker(secrets_dir=secrets, fleet=FleetSettings(name=fleet, lease_seconds=3,
                                                                    heartbeat_seconds=0.5))
    admin_port, http_port = free_port(), free_port()
    section, tokens = _admin_section(tmp_path / "tokens", admin_port)
    config = tmp_path / "worker.yaml"
    config.write_text(yaml.safe_dump({"pulsar": {"service_url": w.pulsar_url}, "redis": {"url": redis_url},
                                      "http": {"port": http_port}, "admin": section, "log": {"format": "json"},
                                      "fleet": {"name": fleet}, "secrets": {"dir": str(secrets)},
                                      "destinations": {"allow_private": True}}))
    endpoint.behaviour = lambda rec: web.Response(status=204)
    proc = _admin_process(config, tmp_path / "admin.log")
    try:
        await _ready(http_port)
        alice = ApiClient(f"http://127.0.0.1:{admin_port}", tokens["alice"])
        topic = f"persistent://p-a/main/bounded-{uuid.uuid4().hex[:8]}"
        status, _ = await alice.call("POST", "/v1/projects/p-a/subscriptions", definition(
            "bounded", topic, endpoint.url, dead_letter={"topic": topic + "-dlq"}))
        assert status == 201
        [delivered] = client.publish(topic, [b"replayed"])
        await eventually(lambda: any(r.acked for r in endpoint.requests), timeout=30, what="delivered")
        base = "/v1/projects/p-a/subscriptions/bounded"

        async def operate(i: int) -> None:
            if i % 100 == 1:  # a redrive waits for its cursor to run dry (2 s): a few of them
                status, _ = await alice.call("POST", f"{base}/redrive", {})  # no dead letters: a read, no move
            elif i % 2:
                status, _ = await alice.call("POST", f"{base}/messages/{delivered}/replay")
            else:
                status, _, _ = await alice.raw(f"{base}/messages/{delivered}/payload")
            assert status == 200, (i, status)

        for i in range(50):
            await operate(i)
        before = _footprint(proc.pid)
        for i in range(50, 1050):
            await operate(i)
        after = _footprint(proc.pid)
        assert after[0] <= before[0] + 2, (before, after)  # threads
        assert after[1] <= before[1] + 10, (before, after)  # descriptors
        assert after[2] <= before[2] + (40 << 20), (before, after)  # resident memory
    finally:
        assert stop_worker(proc, 15) == 0


async def test_a_busy_admin_port_is_one_line_a_growing_pause_and_not_ready_never_a_traceback(tmp_path):
    """The admin port taken by another process: the worker logged a full traceback at error level each
    time it started the admin process again (5 in 18 s) while /readyz said ready. Now each exit is one
    warning line with the admin process's own words, the pauses grow, /readyz says why it is not
    ready; once the port is free the admin process comes up and the worker is ready."""
    import socket

    admin_port, http_port = free_port(), free_port()
    section, tokens = _admin_section(tmp_path / "tokens", admin_port)
    config = tmp_path / "worker.yaml"
    config.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"), "http": {"port": http_port},
                                      "admin": section, "log": {"format": "json"}}))
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("127.0.0.1", admin_port))
    squatter.listen()
    log = tmp_path / "worker.log"
    proc = spawn_worker(config, log)

    def exits() -> list[dict[str, Any]]:
        return [json.loads(line) for line in log.read_text().splitlines()
                if line.startswith("{") and '"admin process exited; starting it again"' in line]
    try:
        await eventually(lambda: len(exits()) >= 3, timeout=60, what="the admin process exiting three times")
        status, why = await asyncio.to_thread(http_get, f"http://127.0.0.1:{http_port}/readyz")
        assert status == 503 and "admin process exited with code" in str(why), (status, why)
        said = exits()
        assert [e["in_seconds"] for e in said[:3]] == [1.0, 2.0, 4.0], said
        assert all(e["level"] == "warning" and "admin" in e["said"] for e in said), said
        assert "Traceback" not in log.read_text()
        squatter.close()
        await eventually(lambda: asyncio.to_thread(lambda: _api(admin_port, "/v1/projects/p-a/subscriptions",
                                                                tokens["alice"])[0] == 200),
                         timeout=60, what="the API answering once the port is free")
        await eventually(lambda: http_get(f"http://127.0.0.1:{http_port}/readyz")[0] == 200, timeout=30,
                         what="ready again")
    finally:
        squatter.close()
        stop_worker(proc, 30)
