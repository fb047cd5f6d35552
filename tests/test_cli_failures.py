"""Every operator command, run as a real process against a dead Redis, a dead broker, invalid URLs
and a registry full of garbage: one line on stderr naming what failed, the documented exit code,
never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis as redis_sync

from tests.support.helpers import code_path
from worker.broker.embedded import free_port
from worker.core import keys
from worker.core.keys import fleet_key

pytestmark = pytest.mark.broker_independent  # every broker URL here is one nothing listens on

SUB = "p-cli/valid"

# Every operator command, with what it needs besides Redis: (argv, needs the broker)
COMMANDS: list[tuple[list[str], bool]] = [
    (["subs", "list"], False), (["subs", "get", SUB], False), (["subs", "pause", SUB], False),
    (["subs", "resume", SUB], False), (["subs", "seek", SUB, "--to-earliest"], True),
    (["subs", "apply", "-f", "{defs}"], False), (["subs", "delete", "p-cli/nosuch"], False),
    (["show", SUB, "1:2:-1:-1"], False), (["queue", SUB, "--state", "inflight"], True),
    (["queue", SUB, "--state", "retrying"], True), (["queue", SUB, "--state", "dead"], True),
    (["history", SUB], False), (["discard", SUB, "1:2:-1:-1", "--wait", "0"], False),
    (["purge", SUB, "--yes"], True), (["dlq", "list", SUB], True), (["dlq", "show", SUB, "1:2:-1:-1"], True),
    (["dlq", "redrive", SUB], True), (["publish", "persistent://p-cli/main/t", "x"], True),
]


def run_all(tmp_path: Path, redis_url: str, broker_url: str, config: dict | None = None) -> list[tuple[str, int, str]]:
    config_path = tmp_path / "c.yaml"
    config_path.write_text(json.dumps(config or {"pulsar": {"operation_timeout_seconds": 2}}))
    defs = tmp_path / "defs.yaml"
    defs.write_text(json.dumps({"name": "applied", "topic": "persistent://p-cli/main/a",
                                "deliver": {"mode": "push", "push": {"url": "https://example.com/push"}}}))

    def one(command: tuple[list[str], bool]) -> tuple[str, int, str]:
        argv = [a.replace("{defs}", str(defs)) for a in command[0]]
        extra = ["--config", str(config_path)]
        extra += ["--service-url", broker_url] if command[1] else []
        extra += ["--redis-url", redis_url] if argv[0] != "publish" else []
        result = subprocess.run([sys.executable, "-m", "worker.cli", *argv, *extra], capture_output=True, timeout=120,
                                env={**os.environ, **code_path()}, stdin=subprocess.DEVNULL)
        return " ".join(argv), result.returncode, result.stderr.decode()

    with ThreadPoolExecutor(6) as pool:
        return list(pool.map(one, COMMANDS))


def assert_one_line(results: list[tuple[str, int, str]], allowed: dict[int, tuple[str, ...]]) -> None:
    """Each failure: exit code in `allowed` (code -> words one of which its line holds), one line, no
    traceback."""
    for command, code, err in results:
        assert "Traceback" not in err and "Unclosed" not in err, f"{command}:\n{err}"
        if code == 0:
            continue
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("push-worker: "), f"{command} ({code}):\n{err}"
        assert code in allowed and any(w in lines[0] for w in allowed[code]), f"{command} ({code}): {lines[0]}"


def test_against_a_dead_redis(tmp_path):
    results = run_all(tmp_path, f"redis://127.0.0.1:{free_port()}", f"pulsar://127.0.0.1:{free_port()}")
    assert_one_line(results, {1: ("redis unreachable", "broker failed"), 2: ("invalid",)})
    failed = {command for command, code, _ in results if code == 1}
    assert failed == {" ".join(c[0]).replace("{defs}", str(tmp_path / "defs.yaml")) for c in COMMANDS}


def test_against_invalid_urls(tmp_path):
    results = run_all(tmp_path, "http://not-redis", "garbage")
    assert_one_line(results, {2: ("must be a URL",)})
    assert all(code == 2 for _, code, _ in results)


def test_against_a_dead_broker_and_a_registry_full_of_garbage(redis_url, tmp_path):
    client = redis_sync.Redis.from_url(redis_url)
    registry = fleet_key("default", "registry")
    client.hset(registry, mapping={
        SUB: json.dumps({"name": "valid", "topic": "persistent://p-cli/main/t",
                         "dead_letter": {"topic": "persistent://p-cli/main/t-dlq"},
                         "deliver": {"mode": "push", "push": {"url": "https://example.com/push"}}}),
        "p-cli/not-json": b"{oops", "p-cli/array": b"[1, 2]", "p-cli/no-project": b'{"name": "x"}',
        b"p-cli/\xff\xfe": b"\xff\xfe\xfd",
    })
    client.rpush(keys.settled_key(SUB), b"not json", b"[1]", json.dumps({"message_id": "1:1:-1:-1", "at_ms": "x"}))
    client.rpush(keys.history_key(SUB, "1:2:-1:-1"), b"\xff", json.dumps({"attempt": 1, "at_ms": 1}))
    client.set(keys.message_key(SUB, "1:3:-1:-1"), b"wrong type")
    client.hset(keys.message_key(SUB, "1:4:-1:-1"), "n", "not-a-number")
    client.set(f"{keys.PREFIX}:{keys.tag(SUB)}:status", b"wrong type")
    client.close()

    results = run_all(tmp_path, redis_url, f"pulsar://127.0.0.1:{free_port()}")
    assert_one_line(results, {1: ("broker failed",), 2: ("invalid",), 3: ("no ",)})
    by_command = {command: (code, err) for command, code, err in results}
    broker_needed = {" ".join(c[0]) for c in COMMANDS if c[1]} - {f"queue {SUB} --state inflight",
                                                                 f"queue {SUB} --state retrying"}
    assert all(by_command[c][0] == 1 for c in broker_needed), {c: by_command[c] for c in broker_needed}
    assert by_command["subs delete p-cli/nosuch"][0] == 3  # not found

    listing = subprocess.run([sys.executable, "-m", "worker.cli", "subs", "list", "--redis-url", redis_url, "--json"],
                             capture_output=True, timeout=60, env={**os.environ, **code_path()})
    assert listing.returncode == 0, listing.stderr.decode()
    rows = {r["name"]: r for r in json.loads(listing.stdout)}
    assert rows["valid"]["state"] != "Invalid"
    invalid = {name: r["reason"] for name, r in rows.items() if r["state"] == "Invalid"}
    assert {"not-json", "array", "no-project"} <= set(invalid) and len(invalid) == 4, invalid
    assert all(reason for reason in invalid.values())
