"""Delay before the next attempt: exponential with full jitter, bounded by the subscription's policy."""

from __future__ import annotations

import random

from worker.subscriptions import RetryPolicy


def retry_delay(policy: RetryPolicy, failed_attempt: int, retry_after: float | None = None,
                rng: random.Random | None = None) -> float:
    """Seconds to wait after attempt `failed_attempt` (1-based) failed.

    The ceiling doubles each attempt from `min_backoff_seconds` up to `max_backoff_seconds`; the
    delay is drawn between the minimum and that ceiling, so a fleet's retries do not arrive in step.
    An endpoint's Retry-After wins when longer, but never beyond the maximum.
    """
    lo, hi = policy.min_backoff_seconds, policy.max_backoff_seconds
    ceiling = min(hi, lo * (2 ** max(0, failed_attempt - 1))) if lo > 0 else 0.0
    delay = (rng or random).uniform(lo, max(lo, ceiling))
    if retry_after is not None:
        delay = max(delay, min(retry_after, hi))
    return min(delay, hi)
