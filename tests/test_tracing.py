"""Traces in OpenTelemetry (docs/observability.md#traces): a span per attempt, a child of the
publisher's context, whose own context the endpoint receives; a span for a dead letter and for the
breaker's decision; exported by OTLP over HTTP to a real receiver that decodes them
(tests/support/otlp.py); a collector that is down costs deliveries nothing and its drops are counted."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
import urllib.parse
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from tests.support.builders import make_sub, push_sub, worker_yaml
from tests.support.endpoints import Endpoint, Received
from tests.support.helpers import cli, eventually, metrics_text
from tests.support.otlp import Collector, start_collector
from tests.support.prometheus import needs_prometheus, prometheus
from tests.support.pulsar_client import Client
from worker import telemetry
from worker.core.metrics import Metrics
from worker.model.config import TracingSettings, parse_settings
from worker.model.subscriptions import BatchPolicy, BreakerPolicy
from worker.runtime.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PUBLISHER_SPAN = "00f067aa0ba902b7"
PARENT = f"00-{TRACE}-{PUBLISHER_SPAN}-01"
STATE = "rojo=00f067aa0ba902b7"


@pytest.fixture
async def collector(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Collector]:
    # Spans leave every 0.1 s, not every 5 s (the SDK's default): a test waits for them.
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    runner, received = await start_collector()
    yield received
    await runner.cleanup()


def tracing(endpoint: str, **section: Any) -> TracingSettings:
    """The `tracing:` section as a config file says it (no OTEL_* variables)."""
    return parse_settings({"tracing": {"endpoint": endpoint, **section}}, env={}).tracing


def traceparent(received: Received) -> tuple[str, str, str]:
    """(trace id, span id, flags) of the traceparent an endpoint received."""
    _, trace_id, span_id, flags = received.headers["traceparent"].split("-")
    return trace_id, span_id, flags


async def test_a_message_through_a_failed_attempt_a_retry_and_a_dead_letter_comes_back_whole(
        collector: Collector, start_worker, endpoint: Endpoint, client: Client, topic: str):
    """The publisher's trace holds every attempt (a child of its span, with the messaging and HTTP
    attributes) and the dead letter's publish (a child of the attempt that gave up); the endpoint
    receives each attempt's own context, and the tracestate as it was."""
    endpoint.behaviour = lambda rec: web.Response(status=503)
    dlq = topic + "-dlq"
    watcher = client.watch(dlq)
    sub = make_sub(topic, endpoint.url, max_deliver=2, dead_letter_topic=dlq)
    await start_worker(sub, tracing=tracing(collector.url))
    [mid] = client.publish(topic, [b"doomed"], properties={"traceparent": PARENT, "tracestate": STATE})
    [dead] = await asyncio.to_thread(Client.drain, watcher, 1)
    assert dead.properties()["traceparent"] == PARENT  # the dead letter carries the publisher's context as-is
    await eventually(lambda: len(collector.spans) >= 3, what="three spans exported")

    first, second = sorted(collector.named("push "), key=lambda s: s.attributes["pushworker.delivery.attempt"])
    [dead_letter] = collector.named("send ")
    assert {s.trace_id for s in (first, second, dead_letter)} == {TRACE}
    for number, span, outcome in ((1, first, "retried"), (2, second, "dead-lettered")):
        assert span.parent_span_id == PUBLISHER_SPAN and span.kind == "CLIENT" and span.status == "ERROR"
        assert span.name == f"push {topic}"
        assert span.attributes["messaging.system"] == "pulsar"
        assert span.attributes["messaging.destination.name"] == topic
        assert span.attributes["messaging.destination.subscription.name"] == sub.name
        assert span.attributes["messaging.message.id"] == mid
        assert span.attributes["pushworker.delivery.attempt"] == number
        assert span.attributes["pushworker.delivery.outcome"] == outcome
        assert span.attributes["http.response.status_code"] == 503
        assert span.attributes["error.type"] == "503"
        assert span.attributes["pushworker.ack_deadline_seconds"] == float(sub.ack_deadline_seconds)
        assert span.attributes["url.full"] == endpoint.url
        assert span.resource["service.name"] == "push-worker"
        # The endpoint got this attempt's span as its parent, in the publisher's trace.
        received = endpoint.by_id()[mid][number - 1]
        assert traceparent(received) == (TRACE, span.span_id, "01")
        assert received.headers["tracestate"] == STATE
    assert dead_letter.parent_span_id == second.span_id and dead_letter.kind == "PRODUCER"
    assert dead_letter.attributes["messaging.destination.name"] == dlq
    assert dead_letter.attributes["messaging.message.id"] == mid
    assert dead_letter.attributes["pushworker.dead_letter.last_status"] == "503"


@pytest.mark.broker_independent  # what is traced does not depend on the broker
async def test_a_message_without_a_trace_gets_one_that_every_attempt_shares_and_latency_points_to_it(
        collector: Collector, start_worker, endpoint: Endpoint, client: Client, topic: str):
    """A message published without a traceparent: the worker starts a trace for it, worked out from
    the message, so that its retry (by any worker) lands in the same one; the attempt-latency
    histogram's exemplars carry its trace id where OpenMetrics is scraped."""
    endpoint.behaviour = lambda rec: web.Response(status=503 if rec.headers["Pubsub-Delivery-Attempt"] == "1" else 204)
    sub = make_sub(topic, endpoint.url)
    w = await start_worker(sub, tracing=tracing(collector.url))
    [mid] = client.publish(topic, [b"x"])
    await eventually(lambda: w.dispatchers[sub.key].stats.acked == 1, what="delivered at the second attempt")
    await eventually(lambda: len(collector.named("push ")) == 2, what="both attempts exported")
    first, second = sorted(collector.named("push "), key=lambda s: s.attributes["pushworker.delivery.attempt"])
    assert first.trace_id == second.trace_id and first.parent_span_id == second.parent_span_id == ""
    assert (first.attributes["pushworker.delivery.outcome"], second.attributes["pushworker.delivery.outcome"]) == (
        "retried", "acked")
    assert second.status != "ERROR" and second.attributes["http.response.status_code"] == 204
    assert [traceparent(r)[:2] for r in endpoint.by_id()[mid]] == [(first.trace_id, first.span_id),
                                                                   (second.trace_id, second.span_id)]
    text = await asyncio.to_thread(_scrape_openmetrics, w.status.port)
    exemplars = re.findall(r'pushworker_delivery_duration_seconds_bucket\{[^}]*subscription="' + sub.name
                           + r'"[^}]*\} \S+ # \{span_id="(\w+)",trace_id="(\w+)"\}', text)
    assert (second.span_id, second.trace_id) in exemplars or (first.span_id, first.trace_id) in exemplars, text[:3000]


@pytest.mark.broker_independent  # what is traced does not depend on the broker
@needs_prometheus
async def test_prometheus_keeps_the_latency_exemplars_and_grafana_links_them_to_the_traces(
        collector: Collector, start_worker, endpoint: Endpoint, client: Client, topic: str, tmp_path):
    """A real Prometheus with exemplar storage scrapes a tracing worker: the attempt-latency
    histogram's exemplars name traces the collector received; the dashboards send a latency point
    (exemplars, to the Tempo data source) and a subscription (a TraceQL search on the attributes
    the spans carry) to its traces."""
    sub = make_sub(topic, endpoint.url)
    w = await start_worker(sub, tracing=tracing(collector.url))
    async with prometheus(tmp_path, [f"127.0.0.1:{w.status.port}"], features=("exemplar-storage",)) as prom:
        def exemplar_trace_ids() -> set[str]:
            now = time.time()
            answer = prom.get("/api/v1/query_exemplars", query="pushworker_delivery_duration_seconds_bucket",
                              start=str(now - 300), end=str(now + 60))
            return {e["labels"]["trace_id"] for series in answer.get("data") or [] for e in series["exemplars"]}

        async def kept() -> bool:
            client.publish(topic, [b"x"])
            traced = {s.trace_id for s in collector.spans}
            return bool(await asyncio.to_thread(exemplar_trace_ids) & traced)

        await eventually(kept, timeout=30, what="an exemplar naming an exported trace")
    sources = yaml.safe_load((ROOT / "grafana" / "provisioning" / "datasources.yaml").read_text())["datasources"]
    tempo = next(d for d in sources if d["type"] == "tempo")
    [destination] = next(d for d in sources if d["type"] == "prometheus")["jsonData"]["exemplarTraceIdDestinations"]
    assert destination == {"name": "trace_id", "datasourceUid": tempo["uid"]}
    board = json.loads((ROOT / "grafana" / "dashboards" / "push-worker-subscription.json").read_text())
    [link] = board["links"]
    search = json.loads(urllib.parse.unquote(link["url"].removeprefix("/explore?left=")))
    assert search["datasource"] == tempo["uid"]
    [span] = collector.spans[:1]
    for attribute in re.findall(r"span\.([\w.]+) =~", search["queries"][0]["query"]):
        assert attribute in span.attributes, attribute  # the search names what the spans carry
    latency = next(p for p in board["panels"] if p["title"].startswith("Attempt latency"))
    assert all(t["exemplar"] for t in latency["targets"])


async def test_a_redrive_delivers_in_the_publishers_trace(
        collector: Collector, broker, start_worker, endpoint: Endpoint, client: Client, topic: str, redis_url: str,
        tmp_path):
    """A dead letter keeps its publisher's context: redriven by `push-worker dlq redrive` (its own
    process, traced by the same config), its attempt is one more span of the same trace."""
    healthy = False
    endpoint.behaviour = lambda rec: web.Response(status=204 if healthy else 500)
    config, settings = worker_yaml(tmp_path, broker.url, redis_url, push_sub(
        "traced-redrive", topic, endpoint.url, max_deliver=1, dead_letter={"topic": topic + "-dlq"}))
    document = yaml.safe_load(Path(config).read_text())
    Path(config).write_text(yaml.safe_dump({**document, "tracing": {"endpoint": collector.url}}))
    [sub] = settings.subscriptions
    w = await start_worker(sub, tracing=tracing(collector.url))
    [mid] = client.publish(topic, [b"a"], properties={"traceparent": PARENT})
    await eventually(lambda: w.dispatchers[sub.key].stats.dead_lettered == 1, what="dead-lettered")
    healthy = True
    code, _, err = await cli("dlq", "redrive", sub.name, "--config", config, "--json")
    assert code == 0, err
    redriven = endpoint.by_id()[mid][-1]
    assert redriven.acked and traceparent(redriven)[0] == TRACE
    await eventually(lambda: any(s.attributes.get("pushworker.delivery.outcome") == "acked"
                                 for s in collector.named("push ")), what="the redrive's span exported")
    [acked] = [s for s in collector.named("push ") if s.attributes["pushworker.delivery.outcome"] == "acked"]
    assert (acked.trace_id, acked.parent_span_id) == (TRACE, PUBLISHER_SPAN)
    assert traceparent(redriven)[1] == acked.span_id


def _scrape_openmetrics(port: int) -> str:
    import urllib.request

    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                     headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.headers["Content-Type"].startswith("application/openmetrics-text")
        return str(answer.read().decode())


@pytest.mark.broker_independent  # what is traced does not depend on the broker
async def test_what_is_not_sampled_makes_no_span_and_its_trace_still_reaches_the_endpoint(
        collector: Collector, start_worker, endpoint: Endpoint, client: Client, topic: str):
    """Sampling none of the new traces (sample_ratio 0): a message without a trace reaches the
    endpoint in one of its own, unsampled (flags 00), the same at every attempt; one its publisher
    did not sample goes on as it came; one its publisher sampled is traced whatever the ratio."""
    endpoint.behaviour = lambda rec: web.Response(status=503 if rec.headers["Pubsub-Delivery-Attempt"] == "1" else 204)
    sub = make_sub(topic, endpoint.url)
    w = await start_worker(sub, tracing=tracing(collector.url, sample_ratio=0))
    unsampled_parent = f"00-{TRACE}-{PUBLISHER_SPAN}-00"
    [plain] = client.publish(topic, [b"plain"])
    [declined] = client.publish(topic, [b"declined"], properties={"traceparent": unsampled_parent})
    [chosen] = client.publish(topic, [b"chosen"], properties={"traceparent": PARENT})
    await eventually(lambda: w.dispatchers[sub.key].stats.acked == 3, what="all delivered")
    first, second = (traceparent(r) for r in endpoint.by_id()[plain])
    assert first[0] == second[0] and first[2] == second[2] == "00"
    assert [r.headers["traceparent"] for r in endpoint.by_id()[declined]] == [unsampled_parent] * 2
    await eventually(lambda: len(collector.spans) == 2, what="the sampled message's two attempts")
    assert {s.attributes["messaging.message.id"] for s in collector.spans} == {chosen}
    assert [traceparent(r)[1] for r in endpoint.by_id()[chosen]] == [
        s.span_id for s in sorted(collector.spans, key=lambda s: s.attributes["pushworker.delivery.attempt"])]


@pytest.mark.broker_independent
async def test_a_batch_is_one_span_linked_to_each_message_and_the_breaker_decides_in_a_span_of_its_own(
        collector: Collector, start_worker, endpoint: Endpoint, client: Client, topic: str):
    """A batch: one span, linked to each message's context; the breaker's opening: a span of its
    own; its probe: a span like any attempt's, whose context the probe request carries."""
    endpoint.behaviour = lambda rec: web.Response(status=503)
    sub = make_sub(topic, endpoint.url, content="wrapped", batch=BatchPolicy(max_messages=3, max_wait_ms=1000),
                   max_deliver=100, breaker=BreakerPolicy(open_after_seconds=1, probe_interval_seconds=1))
    others = [f"00-{i:032x}-{i:016x}-01" for i in (1, 2, 3)]
    for payload, parent in zip((b"a", b"b", b"c"), others, strict=True):
        client.publish(topic, [payload], properties={"traceparent": parent})
    await start_worker(sub, tracing=tracing(collector.url))
    await eventually(lambda: collector.named("breaker open"), what="the breaker's decision exported", timeout=30)
    batch = collector.named("push ")[0]
    assert batch.attributes["messaging.batch.message_count"] == 3
    assert sorted((t, s) for t, s, _ in batch.links) == sorted((p.split("-")[1], p.split("-")[2]) for p in others)
    assert traceparent(endpoint.requests[0])[:2] == (batch.trace_id, batch.span_id)
    [breaker] = collector.named("breaker open")
    assert breaker.attributes["pushworker.breaker.state"] == "open"
    assert breaker.attributes["messaging.destination.subscription.name"] == sub.name
    await eventually(lambda: any(s.attributes["pushworker.breaker.probe"] for s in collector.named("push ")),
                     what="a probe's span")
    probe = next(s for s in collector.named("push ") if s.attributes["pushworker.breaker.probe"])
    assert (probe.trace_id, probe.span_id) in {traceparent(r)[:2] for r in endpoint.requests}


@pytest.mark.broker_independent  # what is traced does not depend on the broker
async def test_a_collector_that_is_down_costs_deliveries_nothing_and_its_drops_are_counted(
        start_worker, endpoint: Endpoint, client: Client, topic: str):
    """Nothing listens where the spans go: every message is delivered, none waits for the export,
    and the spans the bounded queue cannot hold (or the export loses) are counted."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{s.getsockname()[1]}"
    sub = make_sub(topic, endpoint.url)
    w = await start_worker(sub, tracing=tracing(down, max_queue_size=5))
    client.publish(topic, [b"m%d" % i for i in range(60)])
    await eventually(lambda: w.dispatchers[sub.key].stats.acked == 60, what="all delivered")
    assert max(r.at for r in endpoint.requests) - min(r.at for r in endpoint.requests) < 5.0
    async def dropped() -> bool:
        return await asyncio.to_thread(_metric, w.status.port, "pushworker_trace_spans_dropped_total") >= 50

    await eventually(dropped, what="the spans past the queue counted as dropped")


def _metric(port: int, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", metrics_text(port), re.M)
    return float(found.group(1)) if found else 0.0


def test_tracing_is_off_unless_configured_and_follows_the_standard_variables():
    assert telemetry.start(parse_settings({}, env={}).tracing, Metrics()) is None
    on = parse_settings({}, env={"OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4318/"}).tracing
    assert on.traces_url == "https://collector:4318/v1/traces"
    exact = parse_settings({"tracing": {"endpoint": "http://a:4318"}},
                           env={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://b:4318/x"}).tracing
    assert exact.traces_url == "http://b:4318/x"  # the standard variable wins over the file
    for off in ({"OTEL_SDK_DISABLED": "true"}, {"OTEL_TRACES_EXPORTER": "none"}):
        assert not parse_settings({"tracing": {"endpoint": "http://a:4318"}}, env=off).tracing.enabled
    ratio = parse_settings({"tracing": {"endpoint": "http://a:4318", "sample_ratio": 0.01}},
                           env={"OTEL_TRACES_SAMPLER": "always_on"}).tracing
    assert ratio.sampler_from_environment and ratio.sample_ratio == 0.01


@pytest.mark.parametrize("env, config, message", [
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, {}, "OTEL_EXPORTER_OTLP_PROTOCOL: must be http/protobuf"),
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, {}, "OTEL_TRACES_EXPORTER: must be otlp or none"),
    ({"OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer s3cret"}, {},
     "OTEL_EXPORTER_OTLP_HEADERS: are sent only over https://"),
    ({}, {"endpoint": "ftp://collector"}, "tracing.endpoint: must be"),
    ({}, {"sample_ratio": 2}, "tracing.sample_ratio"),
    ({"OTEL_BSP_MAX_QUEUE_SIZE": "lots"}, {}, "OTEL_BSP_MAX_QUEUE_SIZE: must be an integer"),
    ({"OTEL_TRACES_SAMPLER": "jaeger_remote"}, {}, "OTEL_TRACES_SAMPLER: must be one of always_on"),
    ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1%"}, {},
     "OTEL_TRACES_SAMPLER_ARG: must be a number in 0..1"),
])
def test_a_tracing_setting_that_cannot_work_is_refused_in_one_line(env, config, message):
    with pytest.raises(ConfigError) as refused:
        parse_settings({"tracing": {"endpoint": "http://collector.example:4318", **config}}, env=env)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert "s3cret" not in str(refused.value)
