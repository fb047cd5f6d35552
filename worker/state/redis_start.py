"""Redis at a worker's start: waiting until it answers, and warning when it would evict our keys."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from redis.exceptions import AuthenticationError, ResponseError

from worker.runtime.aio import wait_event
from worker.runtime.errors import StartupError
from worker.state import redis_client
from worker.state.redis_client import REDIS_DOWN, AsyncClient

PING_SECONDS = 5  # how long a start waits for each PING before it logs and tries again


async def wait_until_answering(client: AsyncClient, stop: asyncio.Event, log: Any,
                               on_error: Callable[[], None]) -> bool:
    """Until Redis answers a PING: one log line per retry, with backoff. A refusal that no retry can
    mend (authentication) ends the start. False if `stop` was set meanwhile."""
    delay = 0.5
    while not stop.is_set():
        try:
            await asyncio.wait_for(client.ping(), timeout=PING_SECONDS)
            if delay > 0.5:
                log.info("redis answers")
            return True
        except AuthenticationError as e:
            raise StartupError(f"redis refused the credentials of redis.url ({e}); check the password") from None
        except ResponseError as e:
            if "NOAUTH" in str(e) or "WRONGPASS" in str(e):
                raise StartupError(f"redis refused the credentials of redis.url ({e}); check the password") from None
            log.warning("redis not ready; retrying", error=str(e)[:200], in_seconds=delay)
        except (*REDIS_DOWN, TimeoutError) as e:
            on_error()
            said = f"no answer within {PING_SECONDS} s" if type(e) is TimeoutError else redis_client.describe(e)
            log.warning("redis unreachable; retrying", error=f"{type(e).__name__}: {said}"[:300], in_seconds=delay)
        await wait_event(stop, delay)
        delay = min(delay * 2, 10.0)
    return False


async def warn_if_evicting(client: AsyncClient, log: Any) -> None:
    """Managed Redis services evict keys with a TTL by default (`volatile-lru`): an evicted attempt
    count restarts a message's numbering, an evicted lease lets a second worker take a
    subscription. Said at start; a Redis that does not answer INFO (an ACL) is not judged."""
    try:
        evicting = await asyncio.wait_for(redis_client.evicting_masters(client), PING_SECONDS)
    except (*REDIS_DOWN, TimeoutError) as e:
        log.info("redis eviction policy not checked", error=redis_client.describe(e)[:200])
        return
    for address, policy in evicting.items():
        log.warning("redis evicts keys when full: an evicted attempt count restarts a message's numbering "
                    "and an evicted lease lets two workers serve a subscription; set maxmemory-policy "
                    "noeviction", maxmemory_policy=policy, redis=address)


OLDEST = (6, 2)  # XTRIM MINID (the delivery log's trim by age) came with Redis 6.2


def too_old(version: str) -> bool:
    """Whether a `redis_version` is older than OLDEST (one that does not parse is not judged)."""
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) < OLDEST


async def require_version(client: AsyncClient, log: Any) -> None:
    """Refuse to start on a Redis older than OLDEST: its every record would fail, and deliveries
    would wait for ever. A Redis that does not answer INFO (an ACL) is not judged."""
    try:
        info = await asyncio.wait_for(client.info("server"), PING_SECONDS)
    except (*REDIS_DOWN, TimeoutError, ResponseError) as e:
        log.info("redis version not checked", error=redis_client.describe(e)[:200])
        return
    versions = {str(v.get("redis_version", "")) for v in info.values()} if "redis_version" not in info else \
        {str(info["redis_version"])}  # a Cluster answers per node
    if old := sorted(v for v in versions if too_old(v)):
        raise StartupError(f"redis {old[0]} is older than {'.'.join(map(str, OLDEST))}, which push-worker needs "
                           "(the delivery log's trims); upgrade Redis")
