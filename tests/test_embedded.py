"""The embedded default started from a directory with the default, relative state_dir."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.helpers import http_get, spawn_worker, wait_sync
from worker.embedded import free_port, terminate


def test_run_with_the_default_relative_state_dir_reads_its_backlog(tmp_path: Path):
    """pulsar-lite once got a config path relative to the wrong directory: its metrics went to
    0.0.0.0:8080 and the backlog was never read."""
    port = free_port()
    (tmp_path / "worker.yaml").write_text(yaml.safe_dump({
        "http": {"port": port}, "destinations": {"allow_private": True}, "log": {"format": "json"},
        "subscriptions": [{"name": "local", "topic": "persistent://p-local/main/t",
                           "deliver": {"mode": "push", "push": {"url": "http://127.0.0.1:9/push"}}}]}))
    proc = spawn_worker("worker.yaml", tmp_path / "w.log", cwd=tmp_path)
    try:
        def backlog_reported() -> bool:
            code, _ = http_get(f"http://127.0.0.1:{port}/healthz")
            if code != 200:
                return False
            import urllib.request

            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                return b"pushworker_subscription_backlog{" in r.read()

        wait_sync(backlog_reported, timeout=10, what="the backlog read at start (not after the 15 s interval)")
        conf = (tmp_path / ".push-worker" / "pulsar-lite.toml").read_text()
        assert 'addr = "127.0.0.1:' in conf
    finally:
        assert terminate(proc, 30) == 0
    assert "backlog read failed" not in (tmp_path / "w.log").read_text()
