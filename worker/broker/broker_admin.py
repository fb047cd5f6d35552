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

import json
import re
import ssl
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote

import aiohttp
from yarl import URL

from worker.core.delivery import USER_AGENT
from worker.model.subscriptions import Subscription, topic_parts
from worker.state.redis_client import REDIS_DOWN

OPERATOR_CONSUMERS = "push-worker-"  # seek, purge and redrive consumers of the operator commands
BODY_CAP = 32 * 1024 * 1024  # a partitioned topic's stats with many consumers run to megabytes
# A broker answers a request about a topic another broker owns with a redirect (307) to that
# broker, as Pulsar's own admin client expects; a few hops at most.
_REDIRECTS = 3
_METHOD_KEEPING = (307, 308)


class AdminError(Exception):
    """The broker's HTTP API answered, but not with what was asked; the message says what to change."""


def make_session(token: str | None = None, trust_certs_file: str | None = None) -> aiohttp.ClientSession:
    """The session for the broker's admin API and metrics page (URLs from the operator's config, not
    from subscriptions): no cookies kept, and the worker's Pulsar credentials as Pulsar's own admin
    client uses them: the token as `Authorization: Bearer`, and `pulsar.tls_trust_certs_file`, when
    set, as the certificates to trust (in place of the system's, as for the binary protocol).
    Certificates and host names are verified either way."""
    headers = {"User-Agent": USER_AGENT} | ({"Authorization": f"Bearer {token}"} if token else {})
    trust = ssl.create_default_context(cafile=trust_certs_file) if trust_certs_file else True
    return aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar(), headers=headers,
                                 connector=aiohttp.TCPConnector(ssl=trust))


async def read_capped(response: aiohttp.ClientResponse, cap: int) -> bytes:
    """The body to its end or to `cap` bytes, whichever comes first (`content.read(n)` alone returns
    whatever has arrived so far, which can be much less than n)."""
    chunks: list[bytes] = []
    remaining = cap
    while remaining > 0:
        chunk = await response.content.read(remaining)
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


async def _call(session: aiohttp.ClientSession, method: str, url: str, seconds: float) -> tuple[int, bytes]:
    """An admin API call: its status and body. Redirects to the owning broker are followed (aiohttp's
    own following would drop the token on the way to another host); a refusal of the credentials
    raises, saying what to set."""
    timeout = aiohttp.ClientTimeout(total=seconds)
    for _ in range(_REDIRECTS + 1):
        async with session.request(method, url, timeout=timeout, allow_redirects=False) as response:
            location = response.headers.get("Location", "")
            if response.status in _METHOD_KEEPING and location:
                target = response.url.join(URL(location))
                if target.scheme not in ("http", "https"):
                    raise AdminError(f"pulsar.admin_url redirected to {target.scheme}: URL, not http(s)")
                url = str(target)
                continue
            body = await read_capped(response, BODY_CAP)
            if response.status in (401, 403):
                raise refusal("pulsar.admin_url", response.status, body, session)
            return response.status, body
    raise AdminError(f"pulsar.admin_url redirected more than {_REDIRECTS} times")


# What a refused token needs, by the URL that refused it: the admin API checks the role's
# permissions; a metrics endpoint with authenticateMetricsEndpoint admits any token it can verify.
_ROLE_NEEDS = {
    "pulsar.admin_url": "its role needs consume on the subscriptions' namespaces (topic stats) and, to evict a "
                        "frozen worker's consumer, admin of their tenants (unloading a topic)",
    "pulsar.metrics_url": "the broker does not accept it (any token it can verify may read /metrics): check "
                          "PUSH_WORKER_PULSAR_TOKEN against the broker's token key",
}


def refusal(setting: str, status: int, body: bytes, session: aiohttp.ClientSession) -> AdminError:
    """A 401 or 403 said as what to set: Apache Pulsar answers 401 for a role without permission too."""
    if "Authorization" not in session.headers:
        return AdminError(f"{setting} answered HTTP {status}: the broker wants a token (set PUSH_WORKER_PULSAR_TOKEN "
                          "to one it accepts)")
    return AdminError(f"{setting} refused the token (HTTP {status}: {_reason(body)}); {_ROLE_NEEDS[setting]}")


_TITLE = re.compile(rb"<title>(.*?)</title>", re.IGNORECASE | re.DOTALL)


def _reason(body: bytes) -> str:
    """The broker's reason of a refusal: `{"reason": ...}` from the admin API, the title of the
    servlet's HTML error page (the metrics page's 401), or else the start of its body; on one line."""
    try:
        reason = json.loads(body).get("reason")
    except (ValueError, AttributeError):
        reason = None
    if not reason:
        title = _TITLE.search(body)
        reason = (title.group(1) if title else body[:200]).decode("utf-8", "replace")
    return " ".join(str(reason).split())


def topic_path(admin_url: str, topic: str) -> str:
    """`<admin>/admin/v2/persistent/<tenant>/<namespace>/<name>`."""
    domain, tenant, namespace, name = topic_parts(topic)
    return f"{admin_url.rstrip('/')}/admin/v2/{domain}/{quote(tenant)}/{quote(namespace)}/{quote(name)}"


async def topic_stats(session: aiohttp.ClientSession, admin_url: str, topic: str) -> dict[str, Any] | None:
    """The topic's stats, or a partitioned topic's aggregated stats; None when the broker knows neither."""
    for path in ("stats", "partitioned-stats"):
        status, body = await _call(session, "GET", f"{topic_path(admin_url, topic)}/{path}", 10)
        if status == 200:
            stats: dict[str, Any] = json.loads(body)
            return stats
        if status != 404:
            raise AdminError(f"pulsar.admin_url answered HTTP {status} for the stats of {topic}: {_reason(body)}")
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
    status, body = await _call(session, "PUT", f"{topic_path(admin_url, topic)}/unload", 30)
    if status >= 300:
        raise AdminError(f"unloading {topic} answered HTTP {status}: {_reason(body)}")


async def evict_stale_consumers(session: aiohttp.ClientSession, admin_url: str, sub: Subscription,
                                worker_id: str, log: Any, metrics: Any,
                                holders: Callable[[], Awaitable[set[str]]] | None = None) -> None:
    """Once this worker serves `sub`: a consumer of another worker still on it is a frozen one (see
    above), unless that worker holds another of the subscription's slots (`holders`, read after the
    broker's list, so a worker that joined meanwhile is in it); unload the topic so its messages come
    back now, not when the broker's keepalive drops it. Best effort: a failure is logged and
    delivery goes on."""
    try:
        stale = await stale_consumers(session, admin_url, sub, worker_id)
        if stale and holders is not None:
            serving = await holders()
            stale = [name for name in stale if name not in serving]
        if stale:
            log.warning("stale consumers on the broker; unloading the topic to reclaim their messages",
                        subscription=sub.key, consumers=stale)
            await unload(session, admin_url, sub.topic)
    except (aiohttp.ClientError, TimeoutError, AdminError, ValueError, *REDIS_DOWN) as e:
        metrics.broker_errors.labels("admin").inc()
        log.warning("stale consumer check failed", subscription=sub.key, error=f"{type(e).__name__}: {e}")
