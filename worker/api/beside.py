"""The operator API beside an embedded worker, in a process of its own.

`push-worker run` with the embedded broker or Redis and an `admin:` section starts
`push-worker admin` as a child process, so the API and console work out of the box and operator
load still never shares the worker's event loop or file descriptors. The child gets the embedded
services' URLs and a free status port; it dies with the worker (even a kill -9) and comes back
when it exits on its own. A worker on external services leaves `admin:` to `push-worker admin`
(its own Deployment: deploy/base/admin-deployment.yaml).
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

from worker.broker.embedded import parent_death_signal

STOP_SECONDS = 10.0


class AdminExited(Exception):
    """The admin process ended while the worker runs (the supervisor logs it and starts it again)."""


class AdminBeside:
    def __init__(self, config_path: str, urls: dict[str, str], log: Any) -> None:
        self.config_path = config_path
        # The embedded services' URLs (loopback, no credentials) and any free port for its probes.
        self.env = {**os.environ, "PUSH_WORKER_HTTP_PORT": "0",
                    **{f"PUSH_WORKER_{name.upper()}": url for name, url in urls.items() if url}}
        self.log = log
        self.proc: asyncio.subprocess.Process | None = None

    async def run(self) -> None:
        """Start the admin process and wait on it; its exit is a failure (raised for the supervisor)."""
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "worker.cli", "admin", "--config", self.config_path, env=self.env,
            stdin=asyncio.subprocess.DEVNULL, start_new_session=True,  # a Ctrl-C for the worker drains it first
            preexec_fn=parent_death_signal())
        self.log.info("admin process started", pid=self.proc.pid)
        code = await self.proc.wait()
        raise AdminExited(f"the admin process (pid {self.proc.pid}) exited with code {code}")

    async def close(self) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), STOP_SECONDS)
        except TimeoutError:
            proc.kill()
            await proc.wait()
