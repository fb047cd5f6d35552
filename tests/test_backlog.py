"""Backlog per owned subscription, read from the broker (its Prometheus endpoint or its admin API),
against known counts."""

from __future__ import annotations

import pytest
from aiohttp import web

from tests.support import brokers
from tests.support.builders import make_sub
from tests.support.helpers import eventually
from tests.support.pulsar_client import Client
from worker.broker.backlog import BacklogReader, parse_backlog_metrics
from worker.broker.broker_admin import AdminError, make_session
from worker.model.config import PulsarSettings
from worker.model.subscriptions import RetryPolicy

# Both sources on Apache Pulsar (topic stats through its admin API, and its /metrics with full topic
# labels); pulsar-lite has only /metrics (short topic labels).
SOURCES = ["metrics", "admin"] if brokers.ON_APACHE_PULSAR else ["metrics"]


def backlog_settings(broker, source: str) -> PulsarSettings:
    if source == "admin":
        return PulsarSettings(service_url=broker.url, admin_url=brokers.admin_url(broker), backlog_interval_seconds=1)
    return PulsarSettings(service_url=broker.url, metrics_url=broker.metrics_url, backlog_interval_seconds=1)


@pytest.mark.parametrize("source", SOURCES)
async def test_backlog_gauge_matches_what_was_published(broker, start_worker, endpoint, client, topic, source):
    endpoint.behaviour = lambda rec: web.Response(status=503)  # nothing gets acked: all stays in backlog
    sub = make_sub(topic, endpoint.url, max_deliver=1000, retry=RetryPolicy(30, 60))
    w = await start_worker(sub, pulsar=backlog_settings(broker, source))
    n = 37
    client.publish(topic, [b"x"] * n)

    def backlog() -> float | None:
        return w.metrics.registry.get_sample_value("pushworker_subscription_backlog",
                                                   {"project": sub.tenant, "subscription": sub.name})

    await eventually(lambda: backlog() == n, timeout=30, what=f"backlog {n}")
    endpoint.behaviour = None
    await w.close()
    w2 = await start_worker(sub, pulsar=backlog_settings(broker, source))
    await eventually(lambda: w2.dispatchers[sub.key].stats.acked == n, what="all delivered")
    await eventually(lambda: w2.metrics.registry.get_sample_value(
        "pushworker_subscription_backlog", {"project": sub.tenant, "subscription": sub.name}) == 0,
        timeout=30, what="backlog 0")


@pytest.mark.parametrize("source", SOURCES)
async def test_backlog_of_a_partitioned_topic_is_the_sum_of_its_partitions(
        partitioned_broker, start_worker, endpoint, partitioned_topic, source):
    endpoint.behaviour = lambda rec: web.Response(status=503)
    topic = partitioned_topic
    sub = make_sub(topic, endpoint.url, max_deliver=1000, retry=RetryPolicy(30, 60))
    w = await start_worker(sub, broker_url=partitioned_broker.url, pulsar=backlog_settings(partitioned_broker, source))
    c = Client(partitioned_broker.url)
    try:
        c.publish(topic, [b"x"] * 8, key="a")
        c.publish(topic, [b"y"] * 7, key="b")
        c.publish(topic, [b"z"] * 6, key="c")
        partitions = c.client.get_topic_partitions(topic)
    finally:
        c.close()
    assert len(partitions) == 3
    await eventually(lambda: w.metrics.registry.get_sample_value(
        "pushworker_subscription_backlog", {"project": sub.tenant, "subscription": sub.name}) == 21,
        timeout=30, what="backlog 21 over 3 partitions")


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


async def test_a_redirecting_metrics_url_is_an_error_that_names_the_url_to_configure(aiohttp_server):
    # Apache Pulsar answers /metrics with 302 to /metrics/; following it is not allowed, and reading
    # the empty redirect as "no backlog" would hide the mistake.
    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound("/metrics/")

    app = web.Application()
    app.router.add_get("/metrics", redirect)
    server = await aiohttp_server(app)
    async with make_session() as session:
        reader = BacklogReader(session, None, str(server.make_url("/metrics")))
        with pytest.raises(AdminError, match=r"redirect to '/metrics/': configure that URL"):
            await reader.read([make_sub("persistent://p-a/main/t", "http://127.0.0.1:1/")])


async def test_an_unreachable_admin_api_costs_no_delivery(broker, start_worker, endpoint, client, topic):
    """The admin API serves the backlog and the stale-consumer check; both are best effort."""
    sub = make_sub(topic, endpoint.url)
    w = await start_worker(sub, pulsar=PulsarSettings(service_url=broker.url, admin_url="http://127.0.0.1:1",
                                                      backlog_interval_seconds=1))
    [mid] = client.publish(topic, [b"x"])
    await eventually(lambda: mid in endpoint.by_id(), what="delivered")
    await eventually(lambda: (w.metrics.registry.get_sample_value("pushworker_broker_errors_total",
                                                                  {"operation": "admin"}) or 0) >= 1,
                     what="the failed stale-consumer check counted")

