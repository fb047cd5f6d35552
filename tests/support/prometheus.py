"""A real Prometheus (Debian's package) scraping test targets every second: started on a free port,
queried over its HTTP API, stopped by the context manager."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.helpers import wait_sync
from worker.broker.embedded import free_port, wait_for_port

needs_prometheus = pytest.mark.skipif(not shutil.which("prometheus") and not os.environ.get("CI"),
                                      reason="prometheus not installed (CI installs Debian's package)")


class Prometheus:
    def __init__(self, port: int) -> None:
        self.port = port

    def get(self, path: str, **params: str) -> dict[str, Any]:
        url = f"http://127.0.0.1:{self.port}{path}?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return dict(json.loads(r.read()))
        except urllib.error.HTTPError as e:
            return dict(json.loads(e.read()))

    def query(self, expr: str) -> dict[str, Any]:
        return self.get("/api/v1/query", query=expr)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False


@asynccontextmanager
async def prometheus(where: Path, targets: list[str], rules: Path | None = None,
                     features: tuple[str, ...] = ()) -> AsyncIterator[Prometheus]:
    """Prometheus scraping `targets` (host:port) as job push-worker, with `rules` and `features`
    (--enable-feature), its files under `where`."""
    port = free_port()
    (where / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)] if rules else [],
        "scrape_configs": [{"job_name": "push-worker", "static_configs": [{"targets": targets}]}],
    }))
    proc = subprocess.Popen(["prometheus", f"--config.file={where / 'prometheus.yml'}",
                             f"--storage.tsdb.path={where / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
                             *(f"--enable-feature={f}" for f in features)],
                            stdout=subprocess.DEVNULL, stderr=open(where / "prometheus.log", "wb"))  # noqa: SIM115
    try:
        await asyncio.to_thread(wait_for_port, port, proc, "prometheus", 30)
        server = Prometheus(port)
        await asyncio.to_thread(wait_sync, server.ready, 30, "prometheus ready")
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
