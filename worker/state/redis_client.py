"""One place that turns `RedisSettings` into a client: a standalone server, a Redis Cluster (the
client discovers it from seed nodes and follows MOVED/ASK), or the master a set of Sentinels names
(the client asks them again after a failover).

The rest of the package does not care which: every multi-key script, pipeline and transaction stays
within one hash tag (see `keys`), so each runs in one Cluster slot.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode as SyncClusterNode
from redis.cluster import RedisCluster as SyncRedisCluster
from redis.driver_info import DriverInfo
from redis.exceptions import RedisClusterException, RedisError
from redis.retry import Retry as SyncRetry
from redis.sentinel import MasterNotFoundError as SyncMasterNotFoundError
from redis.sentinel import Sentinel as SyncSentinel

from worker.model.config import RedisSettings

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


def _sentinel_options(settings: RedisSettings, options: dict[str, Any], no_retry: Any) -> dict[str, Any]:
    """How to reach the Sentinels (their own password), then the master (the data password).

    A question to one Sentinel is not retried: asking the next one is the retry, and the master's
    connection retries the whole round. With redis-py's default (10 tries with backoff per Sentinel)
    a round over two dead Sentinels took 8.5 s instead of 2 ms, longer than the start's 5 s wait."""
    sentinel_auth = {"password": settings.sentinel_password} if settings.sentinel_password else {}
    return {"sentinel_kwargs": {**_tls(settings), **options, **sentinel_auth, "retry": no_retry},
            **_auth(settings), **_tls(settings), **options}


def connect(settings: RedisSettings, url: str = "", **options: Any) -> AsyncClient:
    """An asyncio client for `settings` (`url` stands in for settings.url: the embedded one, or an
    operator's --redis-url); `options` are socket timeouts and the like."""
    client: AsyncClient = _connect(settings, url or settings.url or "", options, aioredis.Redis, RedisCluster,
                                   ClusterNode, Sentinel, Retry(NoBackoff(), 0))
    return client


def connect_sync(settings: RedisSettings, url: str = "", **options: Any) -> redis.Redis | SyncRedisCluster:
    """The same, blocking: for dev tools and tests."""
    client: redis.Redis | SyncRedisCluster = _connect(settings, url or settings.url or "", options, redis.Redis,
                                                      SyncRedisCluster, SyncClusterNode, SyncSentinel,
                                                      SyncRetry(NoBackoff(), 0))
    return client


def _connect(settings: RedisSettings, url: str, options: dict[str, Any], standalone: Any, cluster: Any,
             node: Any, sentinel: Any, no_retry: Any) -> Any:
    options = {"driver_info": DRIVER_INFO, **options}
    if settings.mode == "cluster":
        if settings.nodes:
            return cluster(startup_nodes=[node(*_address(n)) for n in settings.nodes], **_tls(settings),
                           **_cluster_options(settings, options))
        return cluster.from_url(url, **_tls(settings), **_cluster_options(settings, options))
    if settings.mode == "sentinel":
        addresses = [_address(s) for s in settings.sentinels]
        sentinels = sentinel(addresses, **_sentinel_options(settings, options, no_retry))
        return sentinels.master_for(settings.master_name or "")
    return standalone.from_url(url, **options)


def describe(error: BaseException) -> str:
    """A Redis error in one readable line. redis-py's "No master found" carries a repr of each
    Sentinel's client (hundreds of characters of pool settings) where an operator needs which
    Sentinels did not answer, or that those that did know no healthy master of that name."""
    text = " ".join(str(error).split())
    if isinstance(error, MasterNotFoundError | SyncMasterNotFoundError):
        head, _, errors = text.partition(" : ")
        silent = [f"{host}:{port}" for host, port in re.findall(r"[(,]host=([^,]+),port=(\d+)", errors)]
        if silent:
            return f"{head}: no answer from the Sentinels at {', '.join(silent)}"
        return f"{head}: the Sentinels know no healthy master of that name (check redis.master_name)"
    return text or type(error).__name__


def is_cluster(client: Any) -> bool:
    return isinstance(client, RedisCluster | SyncRedisCluster)


async def evicting_masters(client: AsyncClient) -> dict[str, str]:
    """The masters that evict keys when full, by address, with their `maxmemory-policy`: any policy
    but `noeviction` under a `maxmemory` limit (the worker's keys carry TTLs, so the `volatile-*`
    policies, managed Redis services' default, evict them too). Every master of a Cluster is asked."""
    if isinstance(client, RedisCluster):
        replies = await client.info("memory", target_nodes=RedisCluster.PRIMARIES)
        by_node = {"": replies} if "maxmemory_policy" in replies else replies  # one master: its reply alone
    else:
        pool = client.connection_pool.connection_kwargs  # a Sentinel's master: found per connection
        address = f"{pool['host']}:{pool.get('port', 6379)}" if pool.get("host") else "the master"
        by_node = {address: await client.info("memory")}
    return {node: str(info.get("maxmemory_policy")) for node, info in by_node.items()
            if int(info.get("maxmemory", 0) or 0) and info.get("maxmemory_policy", "noeviction") != "noeviction"}


def safe_text(value: bytes | str) -> str:
    """Text of a value read back from Redis, which may hold anything: invalid UTF-8 is replaced."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value
