"""What the command groups share: the event loop runner and the connection options."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# Objects holding Pulsar clients stay referenced until the process exits through os._exit: their
# C++ destructors can block at interpreter teardown.
KEEP_UNTIL_EXIT: list[object] = []


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop

        return uvloop.run(main)
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(main)


def connection_args(p: argparse.ArgumentParser, broker: bool = False) -> None:
    p.add_argument("--config", "-c", help="worker.yaml (for redis.url, pulsar.service_url, fleet.name, "
                   "and the subscriptions it defines)")
    p.add_argument("--redis-url", help="default: $PUSH_WORKER_REDIS_URL, the config, or a local embedded worker")
    if broker:
        p.add_argument("--service-url", help="default: $PUSH_WORKER_PULSAR_URL, the config, or a local embedded worker")
    p.add_argument("--json", action="store_true", help="machine-readable output")
