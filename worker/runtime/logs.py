"""structlog setup: JSON lines in production, a readable console when attached to a terminal."""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, MutableMapping
from typing import Any

import structlog

_SECRET_KEYS = ("password", "token", "secret", "authorization", "redis_url")


def _redact(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    # Belt and braces: no event field whose name suggests a secret is ever written.
    for k in event:
        if any(s in k.lower() for s in _SECRET_KEYS):
            event[k] = "[redacted]"
    return event


def configure(fmt: str = "auto", level: str = "info") -> None:
    """Configure structlog and stdlib logging (the Pulsar C++ client logs through stdlib)."""
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer: Any = structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    numeric = getattr(logging, level.upper(), logging.INFO)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _redact,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("pulsar").setLevel(max(numeric, logging.WARNING))


def get(name: str = "push-worker", **bound: Any) -> Any:
    return structlog.get_logger(name).bind(**bound)


# "2026-12-01 02:20:46.522 ERROR [139837603571392] ClientConnection:485 | Failed to ..."
_CLIENT_LINE = re.compile(r"^\S+ \S+ (?P<level>[A-Z]+)\s+\[\d+\] (?P<source>\S+) \| (?P<message>.*)$")
_CLIENT_LEVELS = {"DEBUG": "debug", "INFO": "info", "WARN": "warning", "ERROR": "error"}
_client_log_path: str | None = None
_client_log_lock = threading.Lock()


def pulsar_client_log_path() -> str:
    """A file path for the Pulsar C++ client's FileLogger whose lines come out as structured events
    (`pulsar client`, with the client's level, source and message), so a JSON log stays JSON.

    The client writes into a pipe and a daemon thread re-emits each line: the client's own threads
    never need the GIL (a Python logger called from them can deadlock the client's destructor at
    exit). One pipe serves every client of the process."""
    global _client_log_path
    with _client_log_lock:
        if _client_log_path is None:
            read_fd, write_fd = os.pipe()
            threading.Thread(target=_relay_client_log, args=(read_fd,), name="pulsar-client-log",
                             daemon=True).start()
            _client_log_path = f"/dev/fd/{write_fd}"
        return _client_log_path


# Client lines about what the worker handles and says itself, at a lower level than the client's
# error: a seek succeeds by the broker closing the consumer (the client reports the close as a
# failed seek); a broker that does not answer is said by the worker (`waiting for the broker at
# <url>`, readiness), and the client's line per reconnect attempt is the detail under it.
_HANDLED = ((re.compile(r"Failed to seek: (ResultDisconnected|Disconnected)"), "info"),
            (re.compile(r"Failed to establish connection|Connection refused|Connection reset"), "info"))


def _relay_client_log(read_fd: int) -> None:
    log = get("pulsar")
    with os.fdopen(read_fd, "r", encoding="utf-8", errors="replace") as lines:
        for line in lines:
            found = _CLIENT_LINE.match(line.rstrip("\n"))
            if found is None:
                log.warning("pulsar client", message=line.rstrip("\n"))
                continue
            level = _CLIENT_LEVELS.get(found["level"], "warning")
            level = next((lower for pattern, lower in _HANDLED if pattern.search(found["message"])), level)
            getattr(log, level)("pulsar client", source=found["source"], message=found["message"])


class Throttled:
    """Per-message log lines of one subscription, rate-limited per kind (the event's text): at most
    `burst` at once and `rate` a second after that (100 and 10: every line of an ordinary incident).
    One project's endpoint failing thousands of attempts a second wrote 84 MB of `delivery failed`
    lines a minute, for every project's log pipeline to carry. A line that follows suppressed ones
    says how many (`suppressed`), and `on_suppressed` counts them
    (`pushworker_log_lines_suppressed_total`)."""

    def __init__(self, log: Any, on_suppressed: Callable[[], None], rate: float = 10.0, burst: float = 100.0) -> None:
        self._log = log
        self._on_suppressed = on_suppressed
        self._rate, self._burst = rate, burst
        self._buckets: dict[str, list[float]] = {}  # event -> [tokens, last refill, suppressed since last line]

    def _emit(self, level: str, event: str, fields: dict[str, Any]) -> None:
        now = time.monotonic()
        bucket = self._buckets.get(event)
        if bucket is None:
            bucket = self._buckets[event] = [self._burst, now, 0.0]
        bucket[0] = min(self._burst, bucket[0] + (now - bucket[1]) * self._rate)
        bucket[1] = now
        if bucket[0] < 1.0:
            bucket[2] += 1
            self._on_suppressed()
            return
        bucket[0] -= 1.0
        if bucket[2]:
            fields["suppressed"] = int(bucket[2])
            bucket[2] = 0.0
        getattr(self._log, level)(event, **fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit("warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit("error", event, fields)
