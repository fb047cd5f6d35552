"""The operator API beside an embedded worker, in a process of its own.

`push-worker run` with the embedded broker or Redis and an `admin:` section starts
`push-worker admin` as a child process, so the API and console work out of the box and operator
load still never shares the worker's event loop or file descriptors. The child gets the embedded
services' URLs and a free status port; it dies with the worker (even a kill -9) and comes back,
after a growing pause, when it exits on its own (a busy admin port: one line each time, and the
worker not ready meanwhile). A worker on external services leaves `admin:` to `push-worker admin`
(its own Deployment: deploy/base/admin-deployment.yaml).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any

from worker.broker.embedded import parent_death_signal

STOP_SECONDS = 10.0


RESTART_FIRST_SECONDS = 1.0  # after the admin process exits, it is started again after this...
RESTART_MOST_SECONDS = 60.0  # ...doubling up to this while it keeps exiting
STABLE_SECONDS = 60.0  # a run this long starts the backoff over
SAID_CHARACTERS = 300  # of the admin process's last stderr line, in the worker's log


class AdminBeside:
    def __init__(self, config_path: str, urls: dict[str, str], log: Any) -> None:
        self.config_path = config_path
        # The embedded services' URLs (loopback, no credentials) and any free port for its probes.
        self.env = {**os.environ, "PUSH_WORKER_HTTP_PORT": "0",
                    **{f"PUSH_WORKER_{name.upper()}": url for name, url in urls.items() if url}}
        self.log = log
        self.proc: asyncio.subprocess.Process | None = None
        self.down = "not started yet"  # why the admin process is not running ('' while it runs)

    async def run(self) -> None:
        """Start the admin process and start it again whenever it exits, after a growing pause; each exit
        is one line in the worker's log with the last line the process said (a busy admin port: its
        own one line), never a traceback, and readiness is red while it is down (`down`)."""
        pause = RESTART_FIRST_SECONDS
        while True:
            started = time.monotonic()
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "worker.cli", "admin", "--config", self.config_path, env=self.env,
                stdin=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
                start_new_session=True,  # a Ctrl-C for the worker drains it first
                preexec_fn=parent_death_signal())
            self.log.info("admin process started", pid=self.proc.pid)
            self.down = ""
            said = await self._relay(self.proc.stderr)
            code = await self.proc.wait()
            if time.monotonic() - started >= STABLE_SECONDS:
                pause = RESTART_FIRST_SECONDS
            self.down = f"the admin process exited with code {code}" + (f": {said}" if said else "")
            self.log.warning("admin process exited; starting it again", code=code, said=said, in_seconds=pause)
            await asyncio.sleep(pause)
            pause = min(pause * 2, RESTART_MOST_SECONDS)

    @staticmethod
    async def _relay(stream: asyncio.StreamReader | None) -> str:
        """Pass the admin process's stderr on to the worker's (its log lines), keeping the last line."""
        last = ""
        if stream is None:
            return last
        async for line in stream:
            sys.stderr.buffer.write(line)
            sys.stderr.flush()
            if line.strip():
                last = line.decode(errors="replace").strip()[:SAID_CHARACTERS]
        return last

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
