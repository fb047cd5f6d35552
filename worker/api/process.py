"""`push-worker admin --config FILE`: the operator API and console in a process of their own.

Operator traffic (a viewer's reads, a console left open, an anonymous flood, slow clients) then
never shares a worker's event loop, file descriptors or memory: deliveries go on at their pace
whatever the API is asked. The process reads the worker's config: `admin:` (its listener and who
may use it), the connections (Redis and the broker, with the same environment overrides),
`secrets.dir` (a redrive signs as the worker does) and `http:`, where it serves /healthz, /readyz
and /metrics as a worker does. It holds no lease and no consumer but a dead-letter read's.
"""

from __future__ import annotations

import asyncio

from worker.api.metrics import AdminMetrics
from worker.api.server import AdminServer
from worker.model.config import Settings
from worker.runtime import logs
from worker.runtime.errors import ConfigError
from worker.runtime.http_server import StatusServer


class AdminProcess:
    """The admin listener plus the status listener, for one `push-worker admin`."""

    def __init__(self, settings: Settings, redis_url: str, pulsar_url: str) -> None:
        if settings.admin is None:
            raise ConfigError("config", "admin", "is required: push-worker admin serves the admin: section's "
                              "listener (docs/operator-api.md)")
        self.settings = settings
        self.metrics = AdminMetrics()
        self.server = AdminServer(settings.admin, settings, redis_url, pulsar_url, self.metrics)
        self.status = StatusServer(settings.http.host, settings.http.port, self.metrics, self.readiness)
        self._stop = asyncio.Event()
        self.log = logs.get()

    async def start(self) -> None:
        await self.status.start()
        try:
            await self.server.start()
        except BaseException:
            await self.status.close()
            raise
        self.log.info("admin process started", admin_port=self.server.port, http_port=self.status.port)

    async def readiness(self) -> tuple[bool, str]:
        """Ready while Redis answers: every answer of the API is read from it."""
        if self._stop.is_set():
            return False, "stopping"
        try:
            await asyncio.wait_for(self.server.ops.admin.client.ping(), timeout=2)
        except Exception:
            return False, "redis unreachable"
        return True, "ok"

    def request_stop(self) -> None:
        self._stop.set()

    async def run_until_stopped(self) -> None:
        await self._stop.wait()

    async def close(self) -> None:
        self._stop.set()
        await self.server.close()
        await self.status.close()
        self.log.info("admin process stopped")
