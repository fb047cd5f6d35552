"""What the command groups share: the event loop runner and the connection options."""

from __future__ import annotations

import argparse
import asyncio
import math
import re
from collections.abc import Coroutine
from datetime import datetime
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (exit code 2), like every other failure."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"push-worker: invalid argument: {message} (see: {self.prog} --help)\n")


def positive_int(text: str) -> int:
    """An argument that must be a whole number above 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number (got {text!r})") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {value})")
    return value


def _finite(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what} (got {text!r})") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number (got {text})")
    return value


def positive_number(text: str) -> float:
    """An argument that must be a number above 0."""
    value = _finite(text, "a number")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0 (got {text})")
    return value


def seconds(text: str) -> float:
    """An argument that must be a number of seconds, 0 or more (a wait: 0 does not wait)."""
    value = _finite(text, "a number of seconds")
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds (got {text})")
    return value


def parse_moment(value: str) -> int:
    """An RFC 3339 time with its zone, or ms since the epoch, as ms since the epoch; ValueError says why not."""
    if re.fullmatch(r"[0-9]{1,15}", value):  # ms since the epoch, up to the year 33658 (`isdigit` takes '²')
        return int(value)
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"must be an RFC 3339 time or ms since the epoch (got {value!r})") from None
    if when.tzinfo is None:
        raise ValueError("must carry a time zone, e.g. 2026-11-30T08:00:00Z")
    ms = int(when.timestamp() * 1000)
    if ms < 0:
        raise ValueError(f"must not be before 1970-01-01T00:00:00Z (got {value!r})")
    return ms


def moment(text: str) -> int:
    """An argument that must be a time (`parse_moment`)."""
    try:
        return parse_moment(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
