"""Whether a subscription's endpoint is failing: Active, or Error once every attempt has failed for
`error_after` seconds (at least ERROR_MIN_FAILURES of them), as the platform docs describe."""

from __future__ import annotations

import time

from worker.model.subscriptions import ERROR_AFTER_SECONDS, State

__all__ = ["ERROR_AFTER_SECONDS", "ERROR_MIN_FAILURES", "EndpointHealth"]

ERROR_MIN_FAILURES = 3


class EndpointHealth:
    """Fed every attempt's result; tells the subscription's state and why."""

    def __init__(self, error_after: float = ERROR_AFTER_SECONDS) -> None:
        self.error_after = error_after
        self.failures_in_row = 0
        self.failing_since = 0.0
        self.last_failure = ""

    def record(self, acked: bool, status: str) -> None:
        if acked:
            self.failures_in_row = 0
            return
        if self.failures_in_row == 0:
            self.failing_since = time.monotonic()
        self.failures_in_row += 1
        self.last_failure = status

    def reset(self) -> None:
        """Count failures from zero (the breaker closed by hand: the old streak must not reopen it)."""
        self.failures_in_row = 0

    @property
    def state(self) -> State:
        if (self.failures_in_row >= ERROR_MIN_FAILURES
                and time.monotonic() - self.failing_since >= self.error_after):
            return State.ERROR
        return State.ACTIVE

    @property
    def reason(self) -> str:
        """Why the state is what it is (for `subs list`); empty when Active."""
        if self.state is State.ERROR:
            minutes = (time.monotonic() - self.failing_since) / 60
            return (f"endpoint failing for {minutes:.0f} min ({self.failures_in_row} attempts in a row, "
                    f"last: {self.last_failure})")
        return ""
