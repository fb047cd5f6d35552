"""Entries of a message's attempt history (`push-worker show`, `history`), as stored in Redis, and
the same entries as the delivery log keeps them (with the headers both ways, the ordering key)."""

from __future__ import annotations

import time
from typing import Any

import orjson

from worker.core.delivery import Outcome

# Kept in the delivery log only: the message's own history stays small.
LOG_ONLY = ("request_headers", "response_headers", "ordering_key")
# A delivery log entry's fields, always all of them and in this order (a stream stores the names of
# entries shaped alike once).
LOG_FIELDS = ("message_id", "attempt", "result", "status", "latency_ms", "worker", "ordering_key",
              "request_headers", "response_headers", "answer", "detail", "extra")
_TOLD = frozenset(("at_ms", "attempt", "result", "event", "status", "latency_ms", "worker", "answer", "detail",
                   *LOG_ONLY))
# Upper bounds (ms) of the latency bins the log counts per hour: the charts' p95.
LATENCY_BINS_MS = (5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000)


def attempt_entry(attempt: int, outcome: Outcome, worker_id: str, ordering_key: str = "") -> dict[str, Any]:
    """One attempt: when, which, how it ended, how long it took, who sent it (and, for the log, the
    headers both ways and the message's ordering key)."""
    entry: dict[str, Any] = {"at_ms": int(time.time() * 1000), "attempt": attempt, "result": outcome.result.value,
                             "status": outcome.last_status, "latency_ms": round(outcome.latency * 1000, 1),
                             "worker": worker_id}
    if outcome.detail:
        entry["detail"] = outcome.detail
    if outcome.answer:
        entry["answer"] = outcome.answer
    if outcome.request_headers is not None:
        entry["request_headers"] = outcome.request_headers
    if outcome.response_headers is not None:
        entry["response_headers"] = outcome.response_headers
    if ordering_key:
        entry["ordering_key"] = ordering_key
    return entry


# An operator's replay (ops/replay.py) delivers as this worker id; its one attempt failing settles the
# message as REPLAY_FAILED, not as dropped: the history tells a failed replay from a drop.
REPLAY_DELIVERER = "replay"
REPLAY_FAILED = "replay-failed"


def event_entry(event: str, worker_id: str, **fields: Any) -> dict[str, Any]:
    """Something that happened to the message other than an attempt (dead-lettered, discarded, ...)."""
    return {"at_ms": int(time.time() * 1000), "event": event, "worker": worker_id, **fields}


def outcome_class(status: str) -> str:
    """An attempt's class in the log's counts: 2xx (and 102), 3xx, 4xx, 5xx, or what failed."""
    if status.isdigit() and len(status) == 3:
        return "2xx" if status == "102" else f"{status[0]}xx"
    return status or "unknown"


def latency_bin(latency_ms: float) -> int:
    for i, bound in enumerate(LATENCY_BINS_MS):
        if latency_ms <= bound:
            return i
    return len(LATENCY_BINS_MS)


def _text(value: Any) -> str | bytes:
    if value is None:
        return ""
    if isinstance(value, dict):
        return orjson.dumps(value)
    return str(value)


def log_document(message_id: str, entry: dict[str, Any]) -> bytes:
    """Layout 2's delivery log entry: one JSON document (the stream's one field `e`), the history entry
    with the message id: one value to build and to store instead of LOG_FIELDS' twelve."""
    return orjson.dumps({"message_id": message_id, **entry})


def log_counts(entry: dict[str, Any]) -> tuple[str, int] | None:
    """An attempt's outcome class and latency bin for the log's hourly counts (None: an event)."""
    if "attempt" in entry and "event" not in entry:
        return outcome_class(str(entry.get("status", ""))), latency_bin(float(entry.get("latency_ms", 0)))
    return None


def log_values(message_id: str, entry: dict[str, Any]) -> list[str | bytes]:
    """The delivery log's values for one history entry: LOG_FIELDS, then its outcome class and
    latency bin (both '' for an event, which the hourly counts leave out)."""
    extra = {k: v for k, v in entry.items() if k not in _TOLD}
    values: list[str | bytes] = [message_id, _text(entry.get("attempt")),
                                 _text(entry.get("result", entry.get("event"))), _text(entry.get("status")),
                                 _text(entry.get("latency_ms")), _text(entry.get("worker")),
                                 _text(entry.get("ordering_key")), _text(entry.get("request_headers")),
                                 _text(entry.get("response_headers")), _text(entry.get("answer")),
                                 _text(entry.get("detail")), orjson.dumps(extra) if extra else ""]
    if "attempt" in entry and "event" not in entry:
        values += [outcome_class(str(entry.get("status", ""))), str(latency_bin(float(entry.get("latency_ms", 0))))]
    else:
        values += ["", ""]
    return values
