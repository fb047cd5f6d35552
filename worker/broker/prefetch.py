"""The largest message each subscription has carried, kept in Redis: how many messages its consumer
prefetches (`core.budgets.prefetch_for`).

The Pulsar client prefetches a number of messages, whatever their size, and the C++ client has no
memory limit for consumers (pulsar-client-cpp issue #161): 150 messages of 4 MiB sat in one
consumer's queue (600 MiB) beside what the worker held. So a subscription prefetches, from its first
message on, only as many messages of the broker's largest size (`pulsar.max_message_bytes`) as fit
in half of `max_held_bytes_per_subscription`, and at most its window. A message larger still (a
compressed or chunked one, whose size the broker does not limit) makes it subscribe again with as
many of that size as fit; that size is remembered in Redis, so that the next owner starts small: a
pod killed by one subscription's prefetch would otherwise take each next owner with it.
"""

from __future__ import annotations

import asyncio

from worker.core import keys
from worker.core.redis_batch import Pipeliner
from worker.state.redis_client import REDIS_DOWN

READ_SECONDS = 2.0  # a slow Redis delays no subscribe longer than this (the default prefetch then)


class LargestMessages:
    """The largest message size each subscription has carried (`keys.largest_message_key`)."""

    def __init__(self, redis: Pipeliner, ttl_seconds: int) -> None:
        self.redis = redis  # batched: a thousand subscriptions starting at once make one round trip
        self.ttl_seconds = ttl_seconds

    async def recall(self, subscription_key: str) -> int:
        """The size remembered, or 0: none, unreadable (anything but a positive integer), or Redis
        unavailable. Only the prefetch depends on it, so nothing here fails a subscribe."""
        try:
            value = await asyncio.wait_for(self.redis.submit("GET", keys.largest_message_key(subscription_key)),
                                           READ_SECONDS)
            size = int(value) if value is not None else 0
        except (*REDIS_DOWN, TimeoutError, ValueError):  # a WRONGTYPE answer (garbage) is a RedisError too
            return 0
        return size if 0 < size < 1 << 40 else 0

    async def remember(self, subscription_key: str, size: int) -> None:
        try:
            await asyncio.wait_for(self.redis.submit("SET", keys.largest_message_key(subscription_key), size,
                                                     "EX", self.ttl_seconds), READ_SECONDS)
        except (*REDIS_DOWN, TimeoutError):
            pass  # this worker still subscribes again with less; only the next owner would not know
