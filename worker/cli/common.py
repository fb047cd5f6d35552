"""What the command groups share: the event loop runner and the connection options."""

from __future__ import annotations

import argparse
import asyncio
import difflib
import math
import re
import sys
from collections.abc import Coroutine
from typing import Any, NoReturn, TypeVar

from worker.runtime.fields import parse_moment

T = TypeVar("T")


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (exit code 2), like every other failure; an option is
    never taken for another it abbreviates (`--conf` is not `--config`), and an option no command has
    is named as such, not hidden behind the required one it kept out (`run --cfg x`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._given: list[str] = []

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        if message.startswith(("the following arguments are required", "unrecognized arguments")):
            known = _options(self)
            unknown = [given.split("=", 1)[0] for given in self._given
                       if given.startswith("-") and given != "-" and given.split("=", 1)[0] not in known
                       and not re.fullmatch(r"-[0-9.]+", given)]
            if unknown:
                close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
                message = f"no such option {unknown[0]}" + (f" (did you mean {close[0]}?)" if close else "")
        self.exit(2, f"push-worker: invalid argument: {message} (see: {self.prog} --help)\n")


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of `parser` and of its commands' parsers (an unrecognized option of a command
    reaches the top parser: its name is matched against theirs)."""
    found: set[str] = set()
    for action in parser._actions:
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                found |= _options(sub)
    return found


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
