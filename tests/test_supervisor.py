"""No background task dies silently: failures are logged with their traceback, counted, restarted
with backoff; a task that keeps failing turns /readyz and then /healthz red."""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from tests.support.builders import make_sub
from tests.support.helpers import eventually, http_get, metrics_text
from worker.runtime.supervisor import Supervisor

pytestmark = pytest.mark.broker_independent


async def test_a_failing_task_is_logged_counted_and_restarted():
    failures: list[str] = []
    runs = 0
    finished = asyncio.Event()

    async def flaky() -> None:
        nonlocal runs
        runs += 1
        if runs < 3:
            raise ValueError(f"bad value {runs}")
        finished.set()

    supervisor = Supervisor(on_failure=failures.append)
    with capture_logs() as logs:
        supervisor.spawn("flaky", flaky)
        await asyncio.wait_for(finished.wait(), 10)
    assert runs == 3 and failures == ["flaky", "flaky"]
    errors = [e for e in logs if e["event"] == "background task failed; restarting"]
    assert [e["log_level"] for e in errors] == ["error", "error"]
    assert "ValueError: bad value 1" in errors[0]["traceback"] and errors[0]["task"] == "flaky"
    assert errors[1]["in_seconds"] > errors[0]["in_seconds"]  # backoff grows
    await supervisor.close()


async def test_a_task_that_keeps_failing_turns_ready_then_alive_red_and_a_stable_run_clears_it():
    supervisor = Supervisor(ready_after=0.3, live_after=0.8, stable_after=0.5)
    broken = True

    async def sometimes() -> None:
        while broken:
            raise RuntimeError("still broken")
        await asyncio.Event().wait()  # healthy from now on

    with capture_logs():
        supervisor.spawn("sometimes", sometimes)
        assert supervisor.not_ready() == "" and supervisor.not_alive() == ""
        await eventually(lambda: supervisor.not_ready() != "", timeout=5, what="not ready")
        assert "task sometimes failing" in supervisor.not_ready()
        await eventually(lambda: supervisor.not_alive() != "", timeout=5, what="not alive")
        broken = False
        await eventually(lambda: supervisor.not_alive() == "" and supervisor.not_ready() == "", timeout=15,
                         what="a stable run clears the streak")
    await supervisor.close()


async def test_a_worker_whose_fleet_loop_keeps_failing_reports_it(start_worker, endpoint, topic):
    """Fault injection in a real worker: its fleet round raises on every call."""
    worker = await start_worker(make_sub(topic, endpoint.url))
    worker.supervisor.ready_after, worker.supervisor.live_after = 0.5, 1.5
    assert worker.fleet is not None and worker.status is not None
    port = worker.status.port

    async def broken_tick() -> None:
        raise KeyError("injected")

    worker.fleet.tick = broken_tick  # type: ignore[method-assign]
    worker.fleet._wake.set()

    async def probe(path: str, status: int) -> dict:
        for _ in range(200):
            code, body = await asyncio.to_thread(http_get, f"http://127.0.0.1:{port}{path}")
            if code == status:
                return body
            await asyncio.sleep(0.05)
        raise AssertionError(f"{path} never answered {status}")

    assert "task fleet failing" in (await probe("/readyz", 503))["reason"]
    assert "task fleet failing" in (await probe("/healthz", 503))["reason"]
    assert 'pushworker_task_failures_total{task="fleet"}' in await asyncio.to_thread(metrics_text, port)
