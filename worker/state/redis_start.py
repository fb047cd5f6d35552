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
