"""The embedded broker and Redis of a worker configured without their URLs: started with the worker,
kept running while it lives, stopped with it."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from typing import Any

from worker.broker import embedded
from worker.runtime.aio import wait_event

CHECK_SECONDS = 1.0  # how soon an embedded broker or Redis that exited is started again


class LocalServices:
    """What `start` started: `pulsar_url`, `redis_url` and `metrics_url` are those services' (or
    None where the configuration names its own). Their stops are pushed on the caller's exit stack."""

    def __init__(self, state_dir: Path, log: Any) -> None:
        self.state_dir = state_dir
        self.log = log
        self.services: list[embedded.Service] = []
        self.pulsar_url: str | None = None
        self.metrics_url: str | None = None
        self.redis_url: str | None = None

    async def start(self, stack: contextlib.AsyncExitStack, pulsar: bool, redis: bool) -> None:
        if not (pulsar or redis):
            return
        lock = embedded.lock_state_dir(self.state_dir)  # before anything there is touched
        stack.callback(os.close, lock)
        for left in await asyncio.to_thread(embedded.stop_left_running, self.state_dir):
            self.log.warning("stopped an embedded service that a killed worker left running", service=left)
        # Started from this thread, which lives as long as the worker: they die with it (die_with_parent).
        if pulsar:
            service = await self._start(stack, embedded.start_pulsar)
            self.pulsar_url, self.metrics_url = service.url, service.metrics_url
            self.log.info("embedded broker started", url=service.url, state_dir=str(self.state_dir))
        if redis:
            service = await self._start(stack, embedded.start_redis)
            self.redis_url = service.url
            self.log.info("embedded redis started", port=service.port)
        embedded.record_endpoints(self.state_dir, embedded.service_urls(self.services), self.services)

    async def _start(self, stack: contextlib.AsyncExitStack, start: Any) -> embedded.Service:
        service: embedded.Service = start(self.state_dir, die_with_parent=True, wait=False)
        self.services.append(service)
        stack.push_async_callback(asyncio.to_thread, service.stop)
        await asyncio.to_thread(service.wait_ready)
        return service

    async def keep_running(self, stop: asyncio.Event) -> None:
        """The embedded broker and Redis are this worker's own: one that exits (killed, crashed, out
        of memory) is started again on its port with its data, or nothing would ever bring it back
        and the worker would wait for it for good. A start that fails raises: the supervisor tries
        again, and a service that cannot start turns readiness, then liveness, red."""
        while not stop.is_set():
            for service in self.services:
                if service.proc.poll() is None:
                    continue
                self.log.error("embedded service exited; starting it again", service=service.name,
                               exit_code=service.proc.returncode, log=str(service.log_path))
                service.respawn()  # from the loop's thread, like the first start: it dies with the worker
                embedded.record_endpoints(self.state_dir, embedded.service_urls(self.services), self.services)
                await asyncio.to_thread(service.wait_ready)
                self.log.info("embedded service started again", service=service.name, url=service.url)
            await wait_event(stop, CHECK_SECONDS)
