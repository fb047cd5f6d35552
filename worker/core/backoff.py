"""Delay before the next attempt: exponential with full jitter, bounded by the subscription's policy."""

from __future__ import annotations

import random

from worker.model.subscriptions import RetryPolicy

# The shortest wait between two attempts of a message, whatever the policy says: a subscription with
# no backoff and a wide window sent 5,000 failing attempts a second and starved every other project.
MIN_BACKOFF_SECONDS = 0.1


def retry_delay(policy: RetryPolicy, failed_attempt: int, retry_after: float | None = None,
                rng: random.Random | None = None) -> float:
    """Seconds to wait after attempt `failed_attempt` (1-based) failed.

    The ceiling doubles each attempt from `min_backoff_seconds` up to `max_backoff_seconds`; the
    delay is drawn between the minimum and that ceiling, so a fleet's retries do not arrive in step.
    An endpoint's Retry-After wins when longer, but never beyond the maximum.
    """
    lo, hi = max(policy.min_backoff_seconds, MIN_BACKOFF_SECONDS), max(policy.max_backoff_seconds, MIN_BACKOFF_SECONDS)
    # The exponent is capped: 2.0 ** 1024 overflows a float (max_deliver -1 reached attempt 1,025),
    # and from 2 ** 63 on the ceiling is the maximum anyway.
    ceiling = min(hi, lo * 2.0 ** min(max(0, failed_attempt - 1), 63))
    delay = (rng or random).uniform(lo, max(lo, ceiling))
    if retry_after is not None:
        delay = max(delay, min(retry_after, hi))
    return min(delay, hi)
