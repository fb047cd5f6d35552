"""A rolling upgrade: workers of the previous release and of this one in one fleet, each version's
CLI changing the registry (tests/support/previous_release.py). What changes in Redis between the two is
said in CHANGELOG.md under "Rolling upgrade"."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.support.endpoints import Endpoint
from tests.support.fleet_harness import FleetHarness, WorkerProcess, fleet_sub
from tests.support.helpers import eventually
from tests.support.pulsar_client import Client


def updates(worker: WorkerProcess) -> dict[str, int]:
    """How often `worker` applied a changed definition, by subscription (from its JSON log)."""
    counts: dict[str, int] = {}
    for line in worker.log.read_text().splitlines():
        if '"subscription updated"' in line:
            key = json.loads(line)["subscription"]
            counts[key] = counts.get(key, 0) + 1
    return counts


async def test_a_fleet_of_the_previous_release_and_this_one_follows_each_versions_registry_changes(
        tmp_path: Path, broker, redis_url: str, endpoint: Endpoint, client: Client, previous_release: Path):
    """This release reads only the registry keys a change names, from a change log the previous
    release does not write: a change by the previous release's CLI must still reach this release's
    workers (they read the whole registry when the log does not account for a change), and a change
    by this release's CLI must reach the previous release's workers (the version still moves). Each
    subscription is served by one worker at a time, and every message is delivered once."""
    fleet = FleetHarness(tmp_path, broker.url, redis_url)
    run = time.monotonic_ns()
    topics = [f"persistent://p-up/main/t{run}-{i}" for i in range(8)]
    names = [f"up-{run}-{i}" for i in range(8)]
    keys = [f"p-up/{name}" for name in names]
    try:
        old, new = fleet.start("old", code=previous_release), fleet.start("new")
        await eventually(lambda: old.fleet_size() == new.fleet_size() == 2, timeout=60, what="a fleet of two")

        def definitions(path: str) -> list[dict]:
            return [fleet_sub(name, topic, f"{endpoint.url}{path}") for name, topic in zip(names, topics, strict=True)]

        async def delivered_at(path: str) -> None:
            """One message per subscription, published once its owner serves the current definition,
            arrives at `path`."""
            sent = {client.publish(topic, [f"{path} {topic}".encode()])[0] for topic in topics}
            await eventually(lambda: sent <= {r.headers["Pubsub-Message-Id"] for r in endpoint.requests
                                              if r.acked and r.path == "/push" + path},
                             timeout=60, what=f"every subscription's message at {path}")

        async def owners_applied(before: dict[str, dict[str, int]]) -> None:
            owners = fleet.owners(keys)
            by_id = {"old": old, "new": new}
            await eventually(lambda: all(updates(by_id[owners[k]]).get(k, 0) > before[owners[k]].get(k, 0)
                                         for k in keys), timeout=60, what="every owner applying the change")

        assert fleet.apply(definitions("/a")).returncode == 0
        await eventually(lambda: None not in fleet.owners(keys).values(), timeout=60, what="every subscription owned")
        assert set(fleet.owners(keys).values()) == {"old", "new"}  # both versions serve some
        await delivered_at("/a")

        for path, code in (("/b", previous_release), ("/c", None)):  # the old CLI's change, then the new one's
            before = {"old": updates(old), "new": updates(new)}
            result = fleet.apply(definitions(path), code=code)
            assert result.returncode == 0, result.stderr
            await owners_applied(before)
            await delivered_at(path)

        ids = [r.headers["Pubsub-Message-Id"] for r in endpoint.requests]
        assert len(ids) == len(set(ids)) == 24, "each message delivered once"
    finally:
        fleet.close()
