"""`make demo` runs the main job: the demo command as a user runs it, in a clean directory."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.helpers import code_path, wait_sync
from tests.support.otlp import start_collector

pytestmark = pytest.mark.broker_independent


def test_demo_delivers_retries_and_dead_letters_and_loses_nothing(tmp_path: Path):
    environment = {**os.environ, **code_path()}
    started = time.monotonic()
    demo = subprocess.Popen([sys.executable, "-m", "devtools", "demo"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=environment)
    try:
        # A second demo in the same directory is refused in one line; it once wiped the running
        # one's broker and Redis data (63 of its 300 messages lost).
        record = tmp_path / ".push-worker" / "demo" / "endpoints.json"
        wait_sync(record.exists, timeout=60, what="the first demo's services started")
        second = subprocess.run([sys.executable, "-m", "devtools", "demo", "--messages", "5"], cwd=tmp_path,
                                capture_output=True, text=True, timeout=120, env=environment)
        assert second.returncode == 1 and second.stderr.count("\n") == 1, second.stdout + second.stderr
        assert f"is in use by a running worker (pid {demo.pid})" in second.stderr
        # The console stays up after the summary, on loopback with a demo-only token, until Ctrl-C.
        assert demo.stdout is not None
        lines: list[str] = []
        while not any(line.startswith("console: ") for line in lines):
            line = demo.stdout.readline()
            assert line, "".join(lines)  # the demo ended without offering the console
            lines.append(line)
        url = next(line for line in lines if line.startswith("console: ")).split()[1]
        token = re.search(r"demo-only token (\S+)", demo.stdout.readline())
        assert token, lines
        with urllib.request.urlopen(urllib.request.Request(
                url.replace("/console/", "/v1/projects/p-demo/subscriptions"),
                headers={"Authorization": f"Bearer {token[1]}"}), timeout=10) as answer:
            listed = json.loads(answer.read())
        assert [row["name"] for row in listed["subscriptions"]] == ["orders-push"], listed
        [row] = listed["subscriptions"]  # a config file's subscription, as the console shows it: its endpoint
        assert (row["source"], row["endpoint"]) == ("config", "127.0.0.1"), row
        with urllib.request.urlopen(url.replace("/console/", "/console/login"), timeout=10) as answer:
            assert answer.status == 200
        assert "Ctrl-C stops the demo" in demo.stdout.readline()
        demo.send_signal(signal.SIGINT)
        rest, err = demo.communicate(timeout=60)
        out = "".join(lines) + rest
    finally:
        demo.kill()
    elapsed = time.monotonic() - started
    assert demo.returncode == 0, out + err
    numbers = {k: int(v) for k, v in re.findall(r"^\s+(published|delivered|retries|dead-lettered|lost)\s+(\d+)",
                                                 out, re.M)}
    assert numbers["published"] == 300
    assert numbers["lost"] == 0
    assert numbers["delivered"] + numbers["dead-lettered"] == 300
    assert numbers["retries"] > 0 and numbers["dead-lettered"] >= 15  # every 20th payload always fails
    progress = [line for line in out.splitlines() if "settled" in line and "unsettled=" in line]
    assert progress and "\r" not in out  # not a terminal: whole lines of progress, no carriage returns
    assert progress[-1].strip().startswith("300/300 settled") and progress[-1].endswith("unsettled=0")
    assert elapsed < 60
    # Tracing is off by default; the demo says how to see its traces.
    assert "traces: off; to follow each message through its attempts" in out
    assert "OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 make demo" in out


async def test_the_demo_traced_sends_a_dead_lettered_messages_attempts_and_dead_letter_as_one_trace(tmp_path: Path):
    """`OTEL_EXPORTER_OTLP_ENDPOINT=... make demo`, as the demo's line says, against a real OTLP
    receiver: a message dead-lettered after its four attempts comes back as one trace."""
    runner, collector = await start_collector()
    try:
        environment = {**os.environ, **code_path(), "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,
                       "OTEL_BSP_SCHEDULE_DELAY": "200"}
        demo = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "devtools", "demo", "--messages", "40", "--no-console", cwd=tmp_path,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=environment)
        out, err = await asyncio.wait_for(demo.communicate(), timeout=120)
    finally:
        await runner.cleanup()
    assert demo.returncode == 0, out.decode() + err.decode()
    assert f"traces: every attempt a span, sent to {collector.url}/v1/traces" in out.decode()
    dead_letters = collector.named("send ")
    assert dead_letters, out.decode()  # every 20th payload always fails: two of the 40 are dead-lettered
    for dead in dead_letters:
        trace = [s for s in collector.spans if s.trace_id == dead.trace_id and s.name.startswith("push ")]
        assert sorted(s.attributes["pushworker.delivery.attempt"] for s in trace) == [1, 2, 3, 4]
        assert [s.attributes["pushworker.delivery.outcome"] for s in trace
                if s.attributes["pushworker.delivery.attempt"] == 4] == ["dead-lettered"]
