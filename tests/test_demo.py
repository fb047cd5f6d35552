"""`make demo` runs the main job: the demo command as a user runs it, in a clean directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.broker_independent


def test_demo_delivers_retries_and_dead_letters_and_loses_nothing(tmp_path: Path):
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "worker.cli", "demo"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
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
