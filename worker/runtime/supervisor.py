"""Every long-running task of a worker runs here, so none can die silently.

A task that raises is logged once as an `error` event with its traceback, counted in
`pushworker_task_failures_total{task}`, and restarted after a backoff. A task that keeps failing
(it has not run `STABLE_AFTER` seconds without failing since its streak began) turns `/readyz` red
after `READY_AFTER` seconds and `/healthz` red after `LIVE_AFTER`, so Kubernetes first stops
routing to the pod and then restarts it.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from worker.runtime import logs
from worker.runtime.aio import cancel_within

READY_AFTER = 30.0  # seconds a task may keep failing before the worker reports not ready
LIVE_AFTER = 120.0  # ... before it reports not alive (the pod is restarted)
STABLE_AFTER = 30.0  # a run this long without failing ends a failure streak
MAX_BACKOFF = 10.0


@dataclass
class _Streak:
    since: float  # when the current run of failures began
    resumed: float  # when the task runs again after its latest failure (its backoff ends)
    failures: int


class Supervisor:
    """Starts named tasks and keeps them running; `unhealthy()` says which keep failing."""

    def __init__(self, on_failure: Callable[[str], None] | None = None, ready_after: float = READY_AFTER,
                 live_after: float = LIVE_AFTER, stable_after: float = STABLE_AFTER) -> None:
        self._on_failure = on_failure or (lambda _: None)
        self.ready_after, self.live_after, self.stable_after = ready_after, live_after, stable_after
        self._tasks: set[asyncio.Task[None]] = set()
        self._streaks: dict[str, _Streak] = {}
        self.log = logs.get()

    def spawn(self, name: str, run: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
        """Run `run()` until it returns; restart it when it raises. `name` labels the metric, so it
        names a kind of task (`fleet`, `receive`), never a subscription."""
        task = asyncio.create_task(self._keep(name, run), name=name)
        self._tasks.add(task)  # the loop holds tasks weakly
        task.add_done_callback(self._tasks.discard)
        return task

    async def _keep(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        while True:
            try:
                await run()
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:
                delay = self.failed(name, e)
            await asyncio.sleep(delay)

    def failed(self, name: str, error: BaseException) -> float:
        """Record a failure of `name` (logged, counted); returns the backoff before its restart.
        Also for one-shot work that is not restarted but must not fail unseen."""
        now = time.monotonic()
        streak = self._streaks.get(name)
        if streak is None or now - streak.resumed > self.stable_after:
            streak = self._streaks[name] = _Streak(since=now, resumed=now, failures=0)
        streak.failures += 1
        delay = float(min(MAX_BACKOFF, 0.5 * 2 ** min(streak.failures - 1, 16)))
        streak.resumed = now + delay
        self._on_failure(name)
        self.log.error("background task failed; restarting", task=name, error=f"{type(error).__name__}: {error}",
                       failures_in_row=streak.failures, in_seconds=round(delay, 2),
                       traceback="".join(traceback.format_exception(error)))
        return delay

    def failing_for(self) -> dict[str, float]:
        """Tasks in a failure streak, with how long it has lasted (seconds)."""
        now = time.monotonic()
        for name in [n for n, s in self._streaks.items() if now - s.resumed > self.stable_after]:
            del self._streaks[name]
        return {name: now - s.since for name, s in self._streaks.items()}

    def not_ready(self) -> str:
        """Why the worker should not be ready (a task failing longer than `ready_after`), or ''."""
        return self._failing_longer_than(self.ready_after)

    def not_alive(self) -> str:
        """Why the worker should be restarted (a task failing longer than `live_after`), or ''."""
        return self._failing_longer_than(self.live_after)

    def _failing_longer_than(self, seconds: float) -> str:
        worst = {name: t for name, t in self.failing_for().items() if t >= seconds}
        return ", ".join(f"task {name} failing for {t:.0f}s" for name, t in sorted(worst.items()))

    async def close(self) -> None:
        await cancel_within(self._tasks, 5.0)


def log_task_failure(supervisor: Supervisor | None, name: str) -> Callable[[asyncio.Task[Any]], None]:
    """A done-callback for one-shot tasks: an exception is reported to the supervisor, not lost."""

    def done(task: asyncio.Task[Any]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        if supervisor is not None:
            supervisor.failed(name, task.exception())  # type: ignore[arg-type]
        else:
            logs.get().error("task failed", task=name, error=repr(task.exception()))

    return done
