"""A subscription's last five minutes of attempts, for the operator API and console: how many ended
in each class (2xx, 4xx, 5xx, timeout, other), the delivery rate in 10-second steps (the console's
sparkline), the p95 latency and the last error. Each serving worker keeps its own and publishes its
summary with its status (fleet/status.py); the API adds the workers' summaries up."""

from __future__ import annotations

import time
from typing import Any

from worker.core.delivery import Outcome

STEP_SECONDS = 10
STEPS = 30  # five minutes
OUTCOMES = ("2xx", "4xx", "5xx", "timeout", "other")
# Upper bounds (ms) of the latency buckets; a p95 is told as the bound of the bucket it falls in.
LATENCY_BOUNDS_MS = (5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10_000, 30_000, 60_000, 600_000)
_WIDTH = 1 + len(OUTCOMES) + len(LATENCY_BOUNDS_MS)  # delivered, the outcomes, the latency buckets


_CLASS_OF_LABEL = {"ack": 0, "4xx": 1, "5xx": 2, "timeout": 3}  # Outcome.label -> index in OUTCOMES


def outcome_class(outcome: Outcome) -> int:
    """The index in OUTCOMES of how an attempt ended (its metric label's class; anything else: other)."""
    return _CLASS_OF_LABEL.get(outcome.label, 4)


class RecentDeliveries:
    """Counts per 10-second step in a ring of STEPS; a step is zeroed when time comes round to it."""

    def __init__(self) -> None:
        self._steps: list[list[int]] = [[0] * _WIDTH for _ in range(STEPS)]
        self._step_of: list[int] = [-1] * STEPS  # which step number each slot of the ring holds
        self._newest = -1  # the newest step anything was recorded in
        self.last_error: dict[str, Any] | None = None

    def record(self, outcome: Outcome, messages: int) -> None:
        now = time.time()
        counts = self._step(int(now) // STEP_SECONDS)
        kind = outcome_class(outcome)
        if kind == 0:
            counts[0] += messages
        counts[1 + kind] += messages
        latency_ms = outcome.latency * 1000
        bucket = 0
        while bucket < len(LATENCY_BOUNDS_MS) - 1 and latency_ms > LATENCY_BOUNDS_MS[bucket]:
            bucket += 1
        counts[1 + len(OUTCOMES) + bucket] += 1
        if kind != 0:
            self.last_error = {"at_ms": int(now * 1000), "status": outcome.last_status,
                               "detail": outcome.detail[:200]}

    def _step(self, number: int) -> list[int]:
        slot = number % STEPS
        counts = self._steps[slot]
        self._newest = number
        if self._step_of[slot] != number:
            for i in range(_WIDTH):
                counts[i] = 0
            self._step_of[slot] = number
        return counts

    def summary(self, now: float | None = None) -> dict[str, Any]:
        """The window up to `now`: `delivered` per step (oldest first), totals per outcome class,
        latency bucket counts, and the last error. Plain JSON, short when nothing happened."""
        current = int(time.time() if now is None else now) // STEP_SECONDS
        if self._newest <= current - STEPS:
            # Nothing in the window: the same summary every time, so an idle subscription's status
            # is not rewritten every step (a thousand idle ones would be a thousand writes).
            return {} if self.last_error is None else {"last_error": self.last_error}
        delivered: list[int] = []
        totals = [0] * (len(OUTCOMES) + len(LATENCY_BOUNDS_MS))
        for number in range(current - STEPS + 1, current + 1):
            slot = number % STEPS
            if self._step_of[slot] != number:
                delivered.append(0)
                continue
            counts = self._steps[slot]
            delivered.append(counts[0])
            for i in range(len(totals)):
                totals[i] += counts[1 + i]
        out: dict[str, Any] = {"step_seconds": STEP_SECONDS, "until_step": current, "delivered": delivered,
                               "outcomes": dict(zip(OUTCOMES, totals[:len(OUTCOMES)], strict=True)),
                               "latency_buckets": totals[len(OUTCOMES):]}
        if self.last_error is not None:
            out["last_error"] = self.last_error
        return out


Parsed = tuple[int, list[int], list[int], list[int], dict[str, Any] | None]


def _parsed(summary: Any) -> Parsed | None:
    """A summary as read back from Redis (which may hold anything): its last step, delivered per
    step, outcome counts, latency buckets and last error; None when it does not add up."""
    try:
        error = summary.get("last_error")
        if error is not None and not (isinstance(error, dict) and isinstance(error.get("at_ms", 0), int)):
            return None
        return (int(summary.get("until_step", -1)),
                [int(c) for c in summary.get("delivered", [])[:STEPS]],
                [int(summary.get("outcomes", {}).get(name, 0)) for name in OUTCOMES],
                [int(c) for c in summary.get("latency_buckets", [])[:len(LATENCY_BOUNDS_MS)]], error)
    except (TypeError, ValueError, AttributeError):
        return None


def merge(summaries: list[Any]) -> dict[str, Any]:
    """The serving workers' summaries as one: counts added (aligned on their last step), the p95
    latency from the added buckets (ms; None without attempts), the newest last error. A summary
    that does not add up is left out."""
    parsed = [p for s in summaries if (p := _parsed(s)) is not None]
    until = max((p[0] for p in parsed), default=0)
    delivered = [0] * STEPS
    outcomes = [0] * len(OUTCOMES)
    buckets = [0] * len(LATENCY_BOUNDS_MS)
    last_error: dict[str, Any] | None = None
    for step, steps, counts, latencies, error in parsed:
        shift = until - step if step >= 0 else 0
        for i, count in enumerate(steps):
            if 0 <= i - shift < STEPS:
                delivered[i - shift] += count
        outcomes = [a + b for a, b in zip(outcomes, counts, strict=True)]
        for i, count in enumerate(latencies):
            buckets[i] += count
        if error is not None and (last_error is None or error.get("at_ms", 0) > last_error.get("at_ms", 0)):
            last_error = error
    return {"window_seconds": STEP_SECONDS * STEPS, "step_seconds": STEP_SECONDS, "delivered": delivered,
            "outcomes": dict(zip(OUTCOMES, outcomes, strict=True)), "p95_latency_ms": percentile(buckets, 0.95),
            "last_error": last_error}


def percentile(buckets: list[int], q: float) -> float | None:
    total = sum(buckets)
    if total == 0:
        return None
    seen = 0
    for bound, count in zip(LATENCY_BOUNDS_MS, buckets, strict=True):
        seen += count
        if seen >= q * total:
            return float(bound)
    return float(LATENCY_BOUNDS_MS[-1])
