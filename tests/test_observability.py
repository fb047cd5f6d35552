"""Dashboards and alert rules against a real Prometheus scraping a real worker with traffic."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import subprocess
import time
from pathlib import Path

import pulsar as pulsar_client
import redis as redis_sync
import redis.asyncio as aioredis
import yaml
from aiohttp import web

from tests.support.builders import make_sub, push_sub
from tests.support.helpers import cli
from tests.support.prometheus import needs_prometheus, prometheus
from tests.support.pulsar_client import Client
from worker.broker.embedded import free_port
from worker.core.keys import lease_key
from worker.fleet import quarantine
from worker.fleet.registry import Registry
from worker.model.config import FleetSettings, PulsarSettings
from worker.model.subscriptions import BreakerPolicy, RetryPolicy

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = sorted((ROOT / "grafana" / "dashboards").glob("*.json"))
RULES = ROOT / "grafana" / "alerts" / "push-worker.rules.yaml"



def panel_queries() -> list[tuple[str, str, str]]:
    out = []
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for target in panel["targets"]:
                out.append((path.name, panel["title"], target["expr"]))
    return out


def concretely(expr: str) -> str:
    """A dashboard query as Grafana sends it with the variables set to the scraped fleet, all projects
    and all subscriptions."""
    return (expr.replace("$__rate_interval", "15s").replace("$job", "push-worker").replace("$project", ".*")
            .replace("$subscription", ".*"))


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_dashboards_are_well_formed_and_generated_from_their_source():
    assert len(DASHBOARDS) == 2
    # The committed files are what the script builds (read, never rewritten: a test that regenerated
    # them in place could not see them drift, and changed the checkout).
    spec = importlib.util.spec_from_file_location("build_dashboards", ROOT / "grafana" / "build_dashboards.py")
    assert spec is not None and spec.loader is not None
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    for name, text in builder.boards().items():
        assert (ROOT / "grafana" / "dashboards" / name).read_text() == text, f"{name}: run grafana/build_dashboards.py"
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        assert board["uid"] and board["panels"]
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids))
    sub = json.loads((ROOT / "grafana/dashboards/push-worker-subscription.json").read_text())
    variables = {v["name"]: v for v in sub["templating"]["list"]}
    assert {"job", "project", "subscription"} <= set(variables)
    # Listed from the state series, so paused, expired and erroring subscriptions appear too.
    assert "pushworker_subscription_state" in variables["subscription"]["definition"]
    assert all("$subscription" in t["expr"] and "$project" in t["expr"] for p in sub["panels"] for t in p["targets"])
    # Every query of both boards is filtered to one fleet.
    assert all('job=~"$job"' in expr for _, _, expr in panel_queries())


@needs_prometheus
def test_promtool_accepts_the_rules():
    result = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 12 rules found" in result.stdout


@needs_prometheus
async def test_every_panel_query_and_alert_returns_series_against_a_scraped_worker(
        own_broker, start_worker, endpoint, topic, tmp_path, redis_url, own_redis):
    # A broker of its own: on the session broker, after hundreds of topics, pulsar-lite's metrics
    # endpoint was seen (once, in CI) to report no backlog series for new subscriptions.
    broker = own_broker
    client = Client(broker.url)
    release = asyncio.Event()

    async def behave(rec):
        name = rec.headers["Pubsub-Subscription"]
        if name.startswith("stuck"):
            await release.wait()  # its backlog grows
        return web.Response(status=500 if name.startswith("failing") else 204)

    endpoint.behaviour = behave
    # May spread (pushworker_subscription_workers); served by the one worker here.
    good = make_sub(topic, endpoint.url, name="healthy-" + topic[-6:], max_workers=2)
    stuck = make_sub(topic + "-k", endpoint.url, name="stuck-" + topic[-6:], max_ack_pending=1,
                     ack_deadline_seconds=600)
    bad = make_sub(topic + "-b", endpoint.url, name="failing-" + topic[-6:], max_deliver=2,
                   dead_letter_topic=topic + "-b-dlq", retry=RetryPolicy(0.05, 0.1))
    dropping = make_sub(topic + "-d", endpoint.url, name="failing-nodlq-" + topic[-6:], max_deliver=1)
    paused = make_sub(topic + "-p", endpoint.url, name="paused-" + topic[-6:])
    quarantined = make_sub(topic + "-q", endpoint.url, name="quarantined-" + topic[-6:])
    # Retrying forever against a failing endpoint: its breaker opens after a second (Suspended).
    held = make_sub(topic + "-h", endpoint.url, name="failing-held-" + topic[-6:], max_deliver=-1,
                    breaker=BreakerPolicy(open_after_seconds=1, probe_interval_seconds=3600))
    pulsar = PulsarSettings(service_url=broker.url, metrics_url=broker.metrics_url, backlog_interval_seconds=1)
    w = await start_worker(good, bad, dropping, paused, stuck, held, quarantined, broker_url=broker.url, pulsar=pulsar,
                           fleet=FleetSettings(error_after_seconds=2))  # failing endpoints: Error after 2 s
    # A second worker, whose Redis is full: its fleet rounds keep failing (its Redis calls).
    redis_sync.Redis.from_url(own_redis.url).config_set("maxmemory", "1")
    starved = await start_worker(broker_url=broker.url, redis=own_redis.url, pulsar=pulsar)
    # Exclusive, and held by another consumer: the broker refuses the worker's subscribe.
    refused = "refused-" + topic[-6:]
    holder = client.client.subscribe(topic + "-x", refused, consumer_type=pulsar_client.ConsumerType.Exclusive)
    (tmp_path / "refused.yaml").write_text(yaml.safe_dump({"subscriptions": [
        push_sub(refused, topic + "-x", endpoint.url, type="exclusive")]}))
    code, _, err = await cli("subs", "apply", "-f", str(tmp_path / "refused.yaml"), "--redis-url", redis_url)
    assert code == 0, err
    code, _, err = await cli("subs", "pause", paused.name, "--redis-url", redis_url)
    assert code == 0, err
    # As a worker quarantines one whose message killed its workers (tests/test_quarantine.py does it for real).
    fleet_redis = aioredis.Redis.from_url(redis_url)
    await Registry(fleet_redis, "default").quarantine(quarantined.key, quarantine.record("a test", "i", "w"))
    await fleet_redis.aclose()
    # Created in the registry and assigned to this worker, but its lease is held by a worker that
    # does not exist: an existing subscription nobody serves.
    stranded = "stranded-" + topic[-6:]
    redis_client = redis_sync.Redis.from_url(redis_url)
    redis_client.set(lease_key(f"p-test/{stranded}"), "ghost", ex=600)
    redis_client.close()
    (tmp_path / "stranded.yaml").write_text(yaml.safe_dump({"subscriptions": [
        push_sub(stranded, topic + "-s", endpoint.url)]}))
    code, _, err = await cli("subs", "apply", "-f", str(tmp_path / "stranded.yaml"), "--redis-url", redis_url)
    assert code == 0, err
    targets = [f"127.0.0.1:{w.status.port}", f"127.0.0.1:{starved.status.port}",
               f"127.0.0.1:{free_port()}"]  # and one that is down (nothing listens there)
    try:
        async with prometheus(tmp_path, targets, RULES) as prom:
            await _check_panels_and_alerts(prom, client, w, starved, good, bad, dropping, stuck, held, paused,
                                           quarantined, refused, stranded)
    finally:
        release.set()
        holder.close()
        client.close()


async def _check_panels_and_alerts(prom, client, w, starved, good, bad, dropping, stuck, held, paused,
                                   quarantined, refused, stranded) -> None:
    """Traffic while Prometheus scrapes, until every condition shows; then every panel query and
    alert rule is evaluated."""
    query = prom.query

    def enough_data() -> bool:
        history = query("pushworker_delivery_duration_seconds_count[20s]")["data"]["result"]
        return bool(query("sum(pushworker_messages_dead_lettered_total)")["data"]["result"]
                    and query("sum(pushworker_messages_dropped_total) > 0")["data"]["result"]
                    and query('pushworker_subscription_state{state="Paused"}')["data"]["result"]
                    and query('pushworker_subscription_state{state="Quarantined"}')["data"]["result"]
                    and query("pushworker_subscription_assigned")["data"]["result"]
                    and query("sum(pushworker_subscription_backlog)")["data"]["result"]
                    and query('pushworker_subscription_state{state="Error"}')["data"]["result"]
                    and query('pushworker_subscription_state{state="Starting"}')["data"]["result"]
                    and query('pushworker_subscription_state{state="Suspended"}')["data"]["result"]
                    and query("pushworker_subscription_backlog > 1000")["data"]["result"]
                    and history and len(history[0]["values"]) >= 5)

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not enough_data():  # traffic while Prometheus scrapes
        client.publish(good.topic, [b"ok"] * 20)
        client.publish(bad.topic, [b"no"] * 5)
        client.publish(dropping.topic, [b"gone"] * 2)
        client.publish(stuck.topic, [b"waits"] * 300)
        client.publish(held.topic, [b"held"])
        await asyncio.sleep(1.0)

    failures = []
    for board, title, expr in panel_queries():
        concrete = concretely(expr)
        answer = query(concrete)
        if answer.get("status") != "success":
            failures.append(f"{board} / {title}: does not evaluate: {answer.get('error')}")
        elif not answer["data"]["result"]:
            failures.append(f"{board} / {title}: no series for {concrete}")
    for rule in alert_rules():
        answer = query(rule["expr"])
        if answer.get("status") != "success":
            failures.append(f"alert {rule['alert']}: does not evaluate: {answer.get('error')}")
            continue
        # Every metric an alert reads must exist, so the alert can fire when its condition holds.
        for metric in set(re.findall(r"\b(pushworker_\w+|up)\b(?=[{\[\s)])", rule["expr"])):
            if not query(metric)["data"]["result"]:
                failures.append(f"alert {rule['alert']}: no series for {metric}")
    # The conditions that do hold in this traffic fire: dead-lettering, a failing endpoint, a drop,
    # endpoints failing long enough for Error, a subscribe the broker refuses, a subscription
    # nobody serves; and only for the subscriptions they concern.
    def firing(name: str) -> set[str]:
        expr = next(r["expr"] for r in alert_rules() if r["alert"] == name)
        return {r["metric"].get("subscription", "") for r in query(expr)["data"]["result"]}

    expected = {"PushWorkerDeadLettering": {bad.name}, "PushWorkerEndpointFailing": {bad.name, dropping.name},
                "PushWorkerMessagesDropped": {dropping.name}, "PushWorkerSubscriptionUnowned": {stranded},
                "PushWorkerSubscriptionError": {bad.name, dropping.name},
                "PushWorkerSubscribeFailing": {refused}, "PushWorkerBacklogGrowing": {stuck.name},
                "PushWorkerSubscriptionSuspended": {held.name},
                "PushWorkerSubscriptionQuarantined": {quarantined.name}}
    for name, subs in expected.items():
        # The suspended one failed only in its first second (then its breaker held everything
        # back): whether a scrape saw those failures is up to timing.
        if firing(name) - ({held.name} if name == "PushWorkerEndpointFailing" else set()) != subs:
            failures.append(f"alert {name}: fires for {sorted(firing(name))}, expected {sorted(subs)}")
    # Per worker: the refused subscribe counts as a failing broker call; the dead target is down.
    def firing_for(name: str, label: str) -> set[str]:
        expr = next(r["expr"] for r in alert_rules() if r["alert"] == name)
        return {r["metric"].get(label, "") for r in query(expr)["data"]["result"]}

    broker_errors = firing_for("PushWorkerBrokerErrors", "operation")
    down = firing_for("PushWorkerDown", "instance")
    redis_errors = firing_for("PushWorkerRedisErrors", "instance")
    if redis_errors != {f"127.0.0.1:{starved.status.port}"}:
        failures.append(f"alert PushWorkerRedisErrors: fires for {sorted(redis_errors)}, expected the starved one")
    if broker_errors != {"subscribe"}:
        failures.append(f"alert PushWorkerBrokerErrors: fires for {sorted(broker_errors)}, expected subscribe")
    if len(down) != 1 or {f"127.0.0.1:{w.status.port}", f"127.0.0.1:{starved.status.port}"} & down:
        failures.append(f"alert PushWorkerDown: fires for {sorted(down)}, expected the dead target only")
    # The subscription variable lists the paused one (it has no dispatcher, but a state).
    listed = query(concretely("pushworker_subscription_state{job=~\"$job\", project=~\"$project\"}"))
    if paused.name not in {r["metric"]["subscription"] for r in listed["data"]["result"]}:
        failures.append("the subscription variable does not list the paused subscription")
    assert not failures, "\n".join(failures)
