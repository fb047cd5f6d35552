"""One place that turns `RedisSettings` into a client: a standalone server, a Redis Cluster (the
client discovers it from seed nodes and follows MOVED/ASK), or the master a set of Sentinels names
(the client asks them again after a failover).

The rest of the package does not care which: every multi-key script, pipeline and transaction stays
within one hash tag (see `keys`), so each runs in one Cluster slot.
"""

from __future__ import annotations

import hashlib
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.sentinel import Sentinel
from redis.cluster import ClusterNode as SyncClusterNode
from redis.cluster import RedisCluster as SyncRedisCluster
from redis.driver_info import DriverInfo
from redis.exceptions import RedisClusterException, RedisError
from redis.sentinel import Sentinel as SyncSentinel

from worker.config import RedisSettings

AsyncClient = aioredis.Redis | RedisCluster

# What a Redis outage raises: redis-py's errors, socket errors, and (Cluster) RedisClusterException,
# which is not a RedisError: "cannot be connected" when no node answers, "slot not covered".
REDIS_DOWN = (RedisError, RedisClusterException, OSError)


# Given, not left to redis-py: it would otherwise look its own version up in the installed packages'
# metadata for every new connection (importlib.metadata, uncached), which held the event loop for
# 30-100 ms per connection in a busy worker (a reconnect, a handover, the pool growing).
DRIVER_INFO = DriverInfo(name="redis-py", lib_version=redis.__version__)


def script_sha(source: str) -> str:
    """How Redis names a Lua script (what EVALSHA takes)."""
    return hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def _auth(settings: RedisSettings) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if settings.username:
        out["username"] = settings.username
    if settings.password:
        out["password"] = settings.password
    return out


def _tls(settings: RedisSettings) -> dict[str, Any]:
    """TLS with verification on (redis-py's default once ssl is set)."""
    if not settings.tls:
        return {}
    return {"ssl": True, **({"ssl_ca_certs": settings.tls_ca_file} if settings.tls_ca_file else {})}


def _cluster_options(settings: RedisSettings, options: dict[str, Any]) -> dict[str, Any]:
    out = {**_auth(settings), **options, "require_full_coverage": False}  # serve the slots that are up
    out.pop("health_check_interval", None)  # not a cluster option
    return out


def _sentinel_options(settings: RedisSettings, options: dict[str, Any]) -> dict[str, Any]:
    """How to reach the Sentinels (their own password), then the master (the data password)."""
    sentinel_auth = {"password": settings.sentinel_password} if settings.sentinel_password else {}
    return {"sentinel_kwargs": {**_tls(settings), **options, **sentinel_auth}, **_auth(settings), **_tls(settings),
            **options}


def connect(settings: RedisSettings, url: str = "", **options: Any) -> AsyncClient:
    """An asyncio client for `settings` (`url` stands in for settings.url: the embedded one, or an
    operator's --redis-url); `options` are socket timeouts and the like."""
    client: AsyncClient = _connect(settings, url or settings.url or "", options, aioredis.Redis, RedisCluster,
                                   ClusterNode, Sentinel)
    return client


def connect_sync(settings: RedisSettings, url: str = "", **options: Any) -> redis.Redis | SyncRedisCluster:
    """The same, blocking: for dev tools and tests."""
    client: redis.Redis | SyncRedisCluster = _connect(settings, url or settings.url or "", options, redis.Redis,
                                                      SyncRedisCluster, SyncClusterNode, SyncSentinel)
    return client


def _connect(settings: RedisSettings, url: str, options: dict[str, Any], standalone: Any, cluster: Any,
             node: Any, sentinel: Any) -> Any:
    options = {"driver_info": DRIVER_INFO, **options}
    if settings.mode == "cluster":
        if settings.nodes:
            return cluster(startup_nodes=[node(*_address(n)) for n in settings.nodes], **_tls(settings),
                           **_cluster_options(settings, options))
        return cluster.from_url(url, **_tls(settings), **_cluster_options(settings, options))
    if settings.mode == "sentinel":
        sentinels = sentinel([_address(s) for s in settings.sentinels], **_sentinel_options(settings, options))
        return sentinels.master_for(settings.master_name or "")
    return standalone.from_url(url, **options)


def is_cluster(client: Any) -> bool:
    return isinstance(client, RedisCluster | SyncRedisCluster)
