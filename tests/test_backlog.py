"""Backlog per owned subscription, read from the broker's Prometheus endpoint, against reality."""

from __future__ import annotations

from aiohttp import web

from tests.conftest import make_sub
from tests.helpers import eventually
from worker.backlog import parse_backlog_metrics
from worker.config import PulsarSettings
from worker.subscriptions import RetryPolicy


async def test_backlog_gauge_matches_what_was_published(broker, start_worker, endpoint, client, topic):
    endpoint.behaviour = lambda rec: web.Response(status=503)  # nothing gets acked: all stays in backlog
    sub = make_sub(topic, endpoint.url, max_deliver=1000, retry=RetryPolicy(30, 60))
    w = await start_worker(sub, pulsar=PulsarSettings(service_url=broker.url, metrics_url=broker.metrics_url,
                                                      backlog_interval_seconds=1))
    n = 37
    client.publish(topic, [b"x"] * n)

    def backlog() -> float | None:
        return w.metrics.registry.get_sample_value("pushworker_subscription_backlog",
                                                   {"project": sub.tenant, "subscription": sub.name})

    await eventually(lambda: backlog() == n, timeout=30, what=f"backlog {n}")
    endpoint.behaviour = None
    await w.close()
    w2 = await start_worker(sub, pulsar=PulsarSettings(service_url=broker.url, metrics_url=broker.metrics_url,
                                                       backlog_interval_seconds=1))
    await eventually(lambda: w2.dispatchers[sub.key].stats.acked == n, what="all delivered")
    await eventually(lambda: w2.metrics.registry.get_sample_value(
        "pushworker_subscription_backlog", {"project": sub.tenant, "subscription": sub.name}) == 0,
        timeout=30, what="backlog 0")


def test_metrics_parser_sums_partitions_and_reads_both_label_styles():
    text = "\n".join([
        "# HELP pulsar_subscription_back_log backlog",
        'pulsar_subscription_back_log{cluster="c",namespace="p-a/main",topic="persistent://p-a/main/t-partition-0",'
        'subscription="s"} 3',
        'pulsar_subscription_back_log{topic="persistent://p-a/main/t-partition-1",subscription="s"} 4',
        'pulsar_subscription_back_log{namespace="p-a/main",topic="t",subscription="s"} 5',
        'pulsar_subscription_back_log_other{topic="t",subscription="s"} 99',
        "a line no Prometheus parser accepts",  # elsewhere on the page: must not cost the reading
        'pulsar_subscription_back_log{topic="q\\"t",subscription="s,1"} 2 1700000000000',  # escape, timestamp
    ])
    samples = parse_backlog_metrics(text)
    assert samples[("persistent://p-a/main/t-partition-0", "p-a/main", "s")] == 3
    assert samples[("t", "p-a/main", "s")] == 5
    assert samples[('q"t', "", "s,1")] == 2
    assert len(samples) == 4
