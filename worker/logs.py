"""structlog setup: JSON lines in production, a readable console when attached to a terminal."""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from collections.abc import MutableMapping
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


def _relay_client_log(read_fd: int) -> None:
    log = get("pulsar")
    with os.fdopen(read_fd, "r", encoding="utf-8", errors="replace") as lines:
        for line in lines:
            found = _CLIENT_LINE.match(line.rstrip("\n"))
            if found is None:
                log.warning("pulsar client", message=line.rstrip("\n"))
                continue
            level = _CLIENT_LEVELS.get(found["level"], "warning")
            getattr(log, level)("pulsar client", source=found["source"], message=found["message"])
