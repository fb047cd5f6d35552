"""An operation of one subscription while it keeps failing and is retried (a dead-letter publish the
broker refuses, attempt records Redis does not take): each failure counted, a log line at most every
LOG_EVERY seconds, and a reason for the subscription's status (`subs list`) until one succeeds.
Without it such retries were silent: the subscription showed Active while its messages waited."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

LOG_EVERY = 30.0  # seconds between two "... failing" lines of one subscription


class Failing:
    def __init__(self, log: Any, what: str, consequence: str, count: Callable[[], None],
                 describe: Callable[[BaseException], str]) -> None:
        self.log = log
        self.what = what  # "dead-letter publish": the log's events and the reason start with it
        self.consequence = consequence  # what waits meanwhile, said in the log line
        self.count = count
        self.describe = describe
        self.since: float | None = None
        self.failures = 0
        self.last_error = ""
        self._logged_at = float("-inf")

    def failed(self, error: BaseException, **fields: Any) -> None:
        now = time.monotonic()
        self.since = now if self.since is None else self.since
        self.failures += 1
        self.last_error = self.describe(error)
        self.count()
        if now - self._logged_at >= LOG_EVERY:
            self._logged_at = now
            self.log.warning(f"{self.what} failing; {self.consequence}", **fields, error=self.last_error,
                             failures=self.failures)

    def succeeded(self, **fields: Any) -> None:
        if self.since is not None:
            self.log.info(f"{self.what} works again", **fields, failures=self.failures)
            self.since, self.failures, self._logged_at = None, 0, float("-inf")

    @property
    def reason(self) -> str:
        if self.since is None:
            return ""
        return f"{self.what} failing for {time.monotonic() - self.since:.0f} s ({self.last_error})"
