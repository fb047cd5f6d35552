"""The fleet's state on each Redis topology: a standalone server, a Redis Cluster (3 masters, 3
replicas) and a Sentinel setup (1 master, 2 replicas, 3 Sentinels), all real redis-server processes.

A test opts into every topology with `@ALL_REDIS`; its `redis_target` (and `start_worker`) then
run once per mode. Without the mark it gets the standalone server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from worker.model.config import RedisSettings
from worker.state import redis_client

MODES = ("standalone", "cluster", "sentinel")
ALL_REDIS = pytest.mark.parametrize("redis_target", MODES, indirect=True)


@dataclass
class RedisTarget:
    """Where a test's workers keep their state, in each form a test needs."""

    mode: str
    settings: RedisSettings
    config: dict[str, Any]  # the `redis:` block of a worker's config file
    topology: Any = None  # ClusterTopology / SentinelTopology (None: standalone)

    def client(self) -> Any:
        """A blocking client (redis.Redis or redis.RedisCluster) for the test's own checks."""
        return redis_client.connect_sync(self.settings, socket_timeout=5)

    def flush(self) -> None:
        c = self.client()
        try:
            if self.mode == "cluster":
                c.flushall(target_nodes="primaries")
            else:
                c.flushall()
            c.script_flush()  # the worker must load its scripts again, as after a failover
        finally:
            c.close()
