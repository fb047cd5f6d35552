"""The Pulsar admin REST API (`pulsar.admin_url`), for what the binary protocol cannot do: reading a
topic's stats, and evicting a frozen worker's consumer.

A worker that is frozen (SIGSTOP, a long pause, a partition that drops packets) keeps its TCP
connection to the broker open. Once its lease expired and another worker took the subscription
over, Apache Pulsar still dispatches a share of a Shared subscription's messages to the frozen
consumer until the broker's keepalive drops the connection (up to 2 x keepAliveIntervalSeconds,
60 s by default). The new owner holds the only lease, so any other consumer of the subscription is
stale: unloading the topic closes every consumer on it (live clients reconnect at once), and the
stale consumer's unacked messages are redelivered to the new owner.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import aiohttp

from worker.subscriptions import Subscription, topic_parts

OPERATOR_CONSUMERS = "push-worker-"  # seek, purge and redrive consumers of the operator commands


def topic_path(admin_url: str, topic: str) -> str:
    """`<admin>/admin/v2/persistent/<tenant>/<namespace>/<name>`."""
    domain, tenant, namespace, name = topic_parts(topic)
    return f"{admin_url.rstrip('/')}/admin/v2/{domain}/{quote(tenant)}/{quote(namespace)}/{quote(name)}"


async def topic_stats(session: aiohttp.ClientSession, admin_url: str, topic: str) -> dict[str, Any] | None:
    """The topic's stats, or a partitioned topic's aggregated stats; None when neither answers."""
    timeout = aiohttp.ClientTimeout(total=10)
    for path in ("stats", "partitioned-stats"):
        async with session.get(f"{topic_path(admin_url, topic)}/{path}", timeout=timeout,
                               allow_redirects=False) as response:
            if response.status == 200:
                stats: dict[str, Any] = await response.json(content_type=None)
                return stats
    return None


async def subscription_stats(session: aiohttp.ClientSession, admin_url: str,
                             sub: Subscription) -> dict[str, Any] | None:
    """The broker's stats of the subscription (msgBacklog, consumers, ...); None when it has none."""
    stats = await topic_stats(session, admin_url, sub.topic)
    entry = ((stats or {}).get("subscriptions") or {}).get(sub.pulsar_subscription)
    return entry if isinstance(entry, dict) else None


async def stale_consumers(session: aiohttp.ClientSession, admin_url: str, sub: Subscription,
                          own_name: str) -> list[str]:
    """Names of the subscription's consumers that are neither this worker's nor an operator command's."""
    entry = await subscription_stats(session, admin_url, sub) or {}
    names = [str(c.get("consumerName", "")) for c in entry.get("consumers") or []]
    return sorted({n for n in names if n != own_name and not n.startswith(OPERATOR_CONSUMERS)})


async def unload(session: aiohttp.ClientSession, admin_url: str, topic: str) -> None:
    timeout = aiohttp.ClientTimeout(total=30)
    async with session.put(f"{topic_path(admin_url, topic)}/unload", timeout=timeout,
                           allow_redirects=False) as response:
        if response.status >= 300:
            raise RuntimeError(f"unloading {topic} answered HTTP {response.status}")
