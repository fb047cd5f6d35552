"""Entries of a message's attempt history (`push-worker show`, `history`), as stored in Redis."""

from __future__ import annotations

import time
from typing import Any

from worker.core.delivery import Outcome


def attempt_entry(attempt: int, outcome: Outcome, worker_id: str) -> dict[str, Any]:
    """One attempt: when, which, how it ended, how long it took, who sent it."""
    entry: dict[str, Any] = {"at_ms": int(time.time() * 1000), "attempt": attempt, "result": outcome.result.value,
                             "status": outcome.last_status, "latency_ms": round(outcome.latency * 1000, 1),
                             "worker": worker_id}
    if outcome.detail:
        entry["detail"] = outcome.detail
    if outcome.answer:
        entry["answer"] = outcome.answer
    return entry


def event_entry(event: str, worker_id: str, **fields: Any) -> dict[str, Any]:
    """Something that happened to the message other than an attempt (dead-lettered, discarded, ...)."""
    return {"at_ms": int(time.time() * 1000), "event": event, "worker": worker_id, **fields}
