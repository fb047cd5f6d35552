"""structlog setup: JSON lines in production, a readable console when attached to a terminal."""

from __future__ import annotations

import logging
import sys
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
