"""The operator API's crowd, a misbehaviour of the neighbours bench (`make bench`, section
neighbours): `push-worker admin` beside the worker, 50 viewers listing a project's subscriptions as
fast as they are answered, and 250 connections that send their request head a byte every few
seconds (slowloris). The admin process is a process of its own on the bench's cores, the worker on
a core of its own: what operator load costs deliveries is what crosses between them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from devtools.cgroups import cgroups_available, pod, start_in
from worker.broker import embedded

VIEWERS = 50
SLOW_CONNECTIONS = 250
SECONDS = 12.0
CORES = 0.25  # the admin pod's and its callers' share of the bench's core


def admin_section(directory: Path) -> dict[str, Any]:
    """An `admin:` section on a free port with one viewer token of p-good (the well-behaved project)."""
    token = directory / "viewer-token"
    if not token.exists():
        token.write_text(secrets.token_hex(24))
    return {"host": "127.0.0.1", "port": embedded.free_port(),
            "tokens": [{"subject": "viewer", "file": str(token), "roles": ["viewer:p-good"]}]}


def run(config: Path, section: dict[str, Any], seconds: float = SECONDS, cores: float = CORES) -> str:
    """Start the admin process for `config` and hold the crowd on it for `seconds`, both in one
    cgroup of `cores` (a pod's CPU limit, where cgroups can be made: the crowd's own CPU stands for
    clients on other machines), then stop it; what the viewers got, by status."""
    log = config.parent / "admin.log"
    admin_command = [sys.executable, "-m", "worker.cli", "admin", "--config", str(config)]
    crowd_command = [sys.executable, "-m", "devtools.operator_crowd", str(section["port"]),
                     section["tokens"][0]["file"], str(seconds)]
    with contextlib.ExitStack() as stack:
        why = cgroups_available()  # "" when cgroups can be made
        if not why:
            limited = f"{cores:g} core"
            cgroup = stack.enter_context(pod(f"pw-bench-operators-{time.monotonic_ns()}", cores))
            admin, crowd = (start_in(cgroup, command, log) for command in (admin_command, crowd_command))
        else:
            limited = f"no CPU limit: {why}"
            admin = subprocess.Popen(admin_command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            crowd = subprocess.Popen(crowd_command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            crowd.wait(seconds + 60)
        finally:
            for proc in (crowd, admin):
                proc.terminate()
                proc.wait(30)
    answers = (config.parent / "crowd.json")
    return f"{answers.read_text() if answers.exists() else '?'} ({limited})"


def burn(directory: Path, seconds: float = SECONDS, cores: float = CORES) -> str:
    """The operators' reference: a process that only burns CPU, in a cgroup of the same `cores` on
    the same core, for as long. What the crowd costs beyond it is what the API costs."""
    why = cgroups_available()
    if why:
        return f"no reference: {why}"
    spin = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"
    with pod(f"pw-bench-burner-{time.monotonic_ns()}", cores) as cgroup:
        start_in(cgroup, [sys.executable, "-c", spin], directory / "burner.log").wait(seconds + 60)
    return f"burned {cores:g} core for {seconds:g} s"


async def _crowd(port: int, token: str, seconds: float) -> dict[str, int]:
    for _ in range(600):  # the admin process starting: a minute at most
        if await _answers(port):
            break
        await asyncio.sleep(0.1)
    deadline = time.monotonic() + seconds
    answers: dict[str, int] = {}
    url = f"http://127.0.0.1:{port}/v1/projects/p-good/subscriptions"

    async def viewer(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < deadline:
            try:
                async with session.get(url, headers={"Authorization": f"Bearer {token}"}) as answer:
                    await answer.read()
                    answers[str(answer.status)] = answers.get(str(answer.status), 0) + 1
            except aiohttp.ClientError:
                answers["error"] = answers.get("error", 0) + 1

    async def slow() -> None:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            answers["refused"] = answers.get("refused", 0) + 1
            return
        try:
            for byte in b"GET /v1/me HTTP/1.1\r\nHost: x\r\n":
                if time.monotonic() >= deadline or writer.is_closing():
                    break
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(3)
        except OSError:
            pass
        finally:
            writer.close()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=VIEWERS)) as session:
        await asyncio.gather(*(viewer(session) for _ in range(VIEWERS)), *(slow() for _ in range(SLOW_CONNECTIONS)))
    return answers


async def _answers(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    return True


if __name__ == "__main__":  # the crowd, as a process of its own: PORT TOKEN_FILE SECONDS
    port, token_file, seconds = int(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
    result = asyncio.run(_crowd(port, token_file.read_text(), seconds))
    (token_file.parent / "crowd.json").write_text(json.dumps(result, sort_keys=True))
