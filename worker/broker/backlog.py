"""The broker's backlog per owned subscription, for `pushworker_subscription_backlog`.

Two sources, whichever is configured: the Pulsar admin REST API (topic stats, `msgBacklog`) via
`pulsar.admin_url`, or the broker's Prometheus endpoint (`pulsar_subscription_back_log`) via
`pulsar.metrics_url`. Apache Pulsar labels the full topic name; pulsar-lite the short one: both match.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from worker.broker.broker_admin import BODY_CAP, AdminError, read_capped, refusal, topic_stats
from worker.model.subscriptions import Subscription, topic_parts

_METRIC = "pulsar_subscription_back_log"


def parse_backlog_metrics(text: str) -> dict[tuple[str, str, str], float]:
    """{(topic, namespace, subscription labels): backlog} from a Prometheus text exposition.
    A short topic label is only unique within its namespace label (pulsar-lite sets both)."""
    # Only the backlog's sample lines go to the parser (prometheus_client's): a broker's page holds
    # thousands of other series, and one line the strict parser refuses must not cost this reading.
    lines = [line for line in text.splitlines() if line.startswith(_METRIC + "{")]
    out: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:
            labels = sample.labels
            key = (labels.get("topic", ""), labels.get("namespace", ""), labels.get("subscription", ""))
            out[key] = out.get(key, 0.0) + float(sample.value)
    return out


def _topic_matches(label: str, topic: str) -> bool:
    if label == topic:
        return True
    short = topic_parts(topic)[3]
    # a partition of the topic, in full or short form
    return label == short or label.startswith(topic + "-partition-") or label.startswith(short + "-partition-")


class BacklogReader:
    """Reads backlogs; `read()` returns {subscription key: messages} for what it could read."""

    def __init__(self, session: aiohttp.ClientSession, admin_url: str | None, metrics_url: str | None) -> None:
        self.session = session
        self.admin_url = admin_url.rstrip("/") if admin_url else None
        self.metrics_url = metrics_url

    @property
    def enabled(self) -> bool:
        return bool(self.admin_url or self.metrics_url)

    async def read(self, subs: Iterable[Subscription]) -> dict[str, float]:
        subs = list(subs)
        found = await self.read_cursors({(s.topic, s.pulsar_subscription) for s in subs})
        return {s.key: v for s in subs if (v := found.get((s.topic, s.pulsar_subscription))) is not None}

    async def read_cursors(self, cursors: Iterable[tuple[str, str]]) -> dict[tuple[str, str], float]:
        """{(topic, Pulsar subscription): backlog} for those the broker reports."""
        out: dict[tuple[str, str], float] = {}
        if self.admin_url:
            for topic, name in cursors:
                stats = await topic_stats(self.session, self.admin_url, topic)
                entry = ((stats or {}).get("subscriptions") or {}).get(name)
                if isinstance(entry, dict):
                    out[(topic, name)] = float(entry.get("msgBacklog", 0))
        elif self.metrics_url:
            samples = parse_backlog_metrics(await self._get_text(self.metrics_url))
            for topic, name in cursors:
                _, tenant, namespace, _ = topic_parts(topic)
                values = [v for (t, ns, label), v in samples.items() if label == name
                          and _topic_matches(t, topic) and ns in ("", f"{tenant}/{namespace}")]
                if values:
                    out[(topic, name)] = sum(values)
        return out

    async def _get_text(self, url: str) -> str:
        timeout = aiohttp.ClientTimeout(total=10)
        async with self.session.get(url, timeout=timeout, allow_redirects=False) as response:
            if 300 <= response.status < 400:
                # Apache Pulsar answers /metrics with a redirect to /metrics/; redirects are not followed.
                location = urlsplit(response.headers.get("Location", "")).path
                raise AdminError(f"pulsar.metrics_url answered HTTP {response.status}, a redirect to "
                                 f"{location!r}: configure that URL (redirects are not followed)")
            body = await read_capped(response, BODY_CAP)
            if response.status in (401, 403):  # a broker with authenticateMetricsEndpoint
                raise refusal("pulsar.metrics_url", response.status, body, self.session)
            response.raise_for_status()
            return body.decode("utf-8", "replace")
