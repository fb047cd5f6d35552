"""Probing the worker processes the development tools start: their status listener found through
the process, its /readyz and /metrics, and polling until something holds."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import psutil
from prometheus_client.parser import text_string_to_metric_families

# The bench's own polling runs on the cores the worker needs while it is measured: plain blocking
# requests (no event loop and HTTP session per poll), a few times a second. Throughput comes from
# the sink's first and last timestamps, so the poll interval does not change it.
POLL_SECONDS = 0.2


def fetch(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - local http URLs only
            return bytes(response.read())
    except urllib.error.HTTPError as e:  # /readyz answers 503 with a JSON body until ready
        return bytes(e.read())


def get(url: str) -> Any:
    return json.loads(fetch(url))


def post(url: str) -> None:
    with urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=10):  # noqa: S310
        pass


def wait(predicate: Any, timeout: float, what: str, poll: float = POLL_SECONDS) -> float:
    """Poll until `predicate` holds; returns how long that took."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() > started + timeout:
            raise TimeoutError(f"bench: timed out waiting for {what}")
        time.sleep(poll)
    return time.monotonic() - started


def status_port(ps: psutil.Process) -> int | None:
    for conn in ps.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN:
            return int(conn.laddr.port)
    return None


def worker_ready(ps: psutil.Process) -> bool:
    port = status_port(ps)
    try:
        return port is not None and bool(get(f"http://127.0.0.1:{port}/readyz").get("ready"))
    except (OSError, ValueError):  # not listening yet, or not JSON
        return False


def metric(ps: psutil.Process, name: str, **labels: str) -> float:
    """Sum of a metric's samples on the worker's /metrics (those with `labels`)."""
    text = fetch(f"http://127.0.0.1:{status_port(ps)}/metrics").decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and labels.items() <= s.labels.items())
