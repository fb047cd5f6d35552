"""Generates the Grafana dashboards in grafana/dashboards/ (run: python grafana/build_dashboards.py).

The JSON files are checked in; this script is their source. Queries use $__rate_interval and the
`job` (fleet), `project` and `subscription` template variables; the test suite evaluates every query
against a real Prometheus scraping a real worker.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import quote

DS = {"type": "prometheus", "uid": "${datasource}"}
OUT = Path(__file__).parent / "dashboards"


# Traces: the Tempo data source of grafana/provisioning/datasources.yaml (uid `tempo`), which the
# Prometheus one names for its exemplars' trace ids (docs/deploying.md#grafana).
TEMPO_UID = "tempo"


def traces_url(subscription: str, project: str) -> str:
    """Grafana Explore on Tempo, searching the spans of a subscription (TraceQL on the attributes
    the worker's spans carry: docs/observability.md#traces)."""
    query = (f'{{ span.messaging.destination.subscription.name =~ "{subscription}" && '
             f'span.pushworker.project =~ "{project}" }}')
    left = {"datasource": TEMPO_UID, "queries": [{"refId": "A", "datasource": {"type": "tempo", "uid": TEMPO_UID},
                                                  "queryType": "traceql", "query": query}]}
    return "/explore?left=" + quote(json.dumps(left, separators=(",", ":")), safe="${}._")


def panel(pid: int, title: str, targets: list[tuple[str, str]], x: int, y: int, unit: str = "short",
          kind: str = "timeseries", w: int = 12, h: int = 8, exemplars: bool = False,
          links: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """`exemplars`: the points of a latency histogram's traces shown (and linked to Tempo);
    `links`: a series' data links (a subscription's traces)."""
    defaults: dict[str, Any] = {"unit": unit}
    if links:
        defaults["links"] = links
    return {
        "id": pid, "type": kind, "title": title, "datasource": DS,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom"}} if kind == "timeseries" else {},
        "targets": [{"refId": chr(65 + i), "datasource": DS, "expr": expr, "legendFormat": legend,
                     **({"exemplar": True} if exemplars else {})}
                    for i, (expr, legend) in enumerate(targets)],
    }


def dashboard(uid: str, title: str, panels: list[dict[str, Any]], variables: list[dict[str, Any]],
              links: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    datasource_var = {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source",
                      "current": {}, "hide": 0}
    return {
        "uid": uid, "title": title, "tags": ["push-worker"], "timezone": "utc", "schemaVersion": 39,
        "version": 1, "editable": True, "refresh": "30s", "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": [datasource_var, *variables]}, "panels": panels, "annotations": {"list": []},
        "links": links or [],
    }


def query_var(name: str, label: str, query: str) -> dict[str, Any]:
    return {"name": name, "type": "query", "datasource": DS, "label": label,
            "query": {"query": query, "refId": "vars"}, "definition": query,
            "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*", "current": {}, "hide": 0}


# The fleet filter: Prometheus `job` (and `namespace`, where the scrape adds it) of the workers, so two
# fleets scraped by one Prometheus are not summed. The project variable keeps the same subscription
# name in two projects apart. Subscriptions are listed from pushworker_subscription_state, so paused,
# expired and erroring ones appear, not only those being delivered.
JOB_VAR = query_var("job", "Fleet (job)", "label_values(pushworker_fleet_size, job)")
PROJECT_VAR = query_var("project", "Project", 'label_values(pushworker_subscription_state{job=~"$job"}, project)')
SUB_VAR = query_var("subscription", "Subscription",
                    'label_values(pushworker_subscription_state{job=~"$job", project=~"$project"}, subscription)')
FLEET = 'job=~"$job"'
SEL = 'job=~"$job", project=~"$project", subscription=~"$subscription"'

R = "$__rate_interval"


def fleet() -> dict[str, Any]:
    f = FLEET
    return dashboard("push-worker-fleet", "push-worker / fleet overview", [
        panel(1, "Delivery rate by result", [(f"sum by (result) (rate(pushworker_deliveries_total{{{f}}}[{R}]))",
                                              "{{result}}")], 0, 0, "reqps"),
        panel(2, "Error ratio (attempts not acked)", [(
            f'sum(rate(pushworker_deliveries_total{{{f}, result!="ack"}}[{R}])) '
            f"/ clamp_min(sum(rate(pushworker_deliveries_total{{{f}}}[{R}])), 1e-9)", "error ratio")],
            12, 0, "percentunit"),
        panel(3, "Attempt latency p50 / p99 (exemplars link to traces)", [
            (f"histogram_quantile(0.5, sum by (le) (rate(pushworker_delivery_duration_seconds_bucket{{{f}}}[{R}])))",
             "p50"),
            (f"histogram_quantile(0.99, sum by (le) (rate(pushworker_delivery_duration_seconds_bucket{{{f}}}[{R}])))",
             "p99"),
        ], 0, 8, "s", exemplars=True),
        panel(4, "Backlog by subscription", [(
            f"max by (project, subscription) (pushworker_subscription_backlog{{{f}}})",
            "{{project}}/{{subscription}}")], 12, 8),
        panel(5, "Dead-lettered per second", [(
            f"sum by (project, subscription) (rate(pushworker_messages_dead_lettered_total{{{f}}}[{R}]))",
            "{{project}}/{{subscription}}")], 0, 16, "ops"),
        panel(6, "Dropped per second (exhausted, no dead-letter topic: these are gone)", [(
            f"sum by (project, subscription) (rate(pushworker_messages_dropped_total{{{f}}}[{R}]))",
            "{{project}}/{{subscription}}")], 12, 16, "ops"),
        panel(7, "In flight and held for retry", [(f"sum(pushworker_in_flight{{{f}}})", "in flight"),
                                                  (f"sum(pushworker_held_for_retry{{{f}}})", "held for retry")], 0, 24),
        panel(8, "Redis and broker errors per second", [
            (f"sum(rate(pushworker_redis_errors_total{{{f}}}[{R}]))", "redis"),
            (f"sum by (operation) (rate(pushworker_broker_errors_total{{{f}}}[{R}]))", "broker {{operation}}"),
        ], 12, 24, "ops"),
        panel(9, "Workers", [(f"max(pushworker_fleet_size{{{f}}})", "fleet size seen by workers"),
                             (f"count(up{{{f}}} == 1)", "scraped and up")], 0, 32),
        panel(10, "Ownership balance (subscriptions per worker)", [(
            f"count by (instance) (pushworker_subscription_owned{{{f}}} == 1)", "{{instance}}")], 12, 32),
        panel(11, "Subscriptions by state (Active, Error, Suspended, Seeking, Paused, Quarantined, Expired)", [(
            f"sum by (state) (pushworker_subscription_state{{{f}}})", "{{state}}")], 0, 40),
        panel(12, "Subscriptions in the Error state (the broker refuses them)", [(
            f'sum by (project, subscription) (pushworker_subscription_state{{{f}, state="Error"}}) or vector(0)',
            "{{project}}/{{subscription}}")], 12, 40),
        panel(13, "Subscriptions suspended by their breaker (endpoint down: only probes go)", [(
            f'sum by (project, subscription) (pushworker_subscription_state{{{f}, state="Suspended"}}) or vector(0)',
            "{{project}}/{{subscription}}")], 0, 48),
        panel(14, "Subscriptions quarantined (a message of theirs killed their workers: subs resume)", [(
            f'sum by (project, subscription) (pushworker_subscription_state{{{f}, state="Quarantined"}}) or vector(0)',
            "{{project}}/{{subscription}}")], 12, 48),
        panel(15, "Containment: trials by outcome (a worker died with its memory alarm raised)", [(
            f"sum by (outcome) (increase(pushworker_trials_total{{{f}}}[{R}]))", "{{outcome}}")], 0, 56),
        panel(16, "Containment: wait for a trial p50 / p99 (suspects are not served meanwhile)", [
            (f"histogram_quantile(0.5, sum by (le) (rate(pushworker_trial_wait_seconds_bucket{{{f}}}[{R}])))", "p50"),
            (f"histogram_quantile(0.99, sum by (le) (rate(pushworker_trial_wait_seconds_bucket{{{f}}}[{R}])))", "p99"),
        ], 12, 56, "s"),
        panel(17, "Fair share: work held back for another project's turn, per second (by worker)", [(
            f"sum by (instance) (rate(pushworker_fair_share_waits_total{{{f}}}[{R}]))", "{{instance}}")],
            0, 64, "ops"),
        panel(18, "Redis commands sent per delivery attempt (a script call counts one)", [(
            f"sum(rate(pushworker_redis_commands_total{{{f}}}[{R}])) "
            f"/ clamp_min(sum(rate(pushworker_deliveries_total{{{f}}}[{R}])), 1e-9)", "commands / attempt")],
            12, 64),
    ], [JOB_VAR])


def subscription() -> dict[str, Any]:
    sel = SEL
    by = "project, subscription"
    name = "{{project}}/{{subscription}}"
    return dashboard("push-worker-subscription", "push-worker / subscription", [
        panel(1, "Deliveries by result", [(
            f"sum by ({by}, result) (rate(pushworker_deliveries_total{{{sel}}}[{R}]))",
            f"{name} {{{{result}}}}")], 0, 0, "reqps"),
        panel(2, "Attempt latency p50 / p99 (exemplars and each series link to traces)", [
            (f"histogram_quantile(0.5, sum by (le, {by}) "
             f"(rate(pushworker_delivery_duration_seconds_bucket{{{sel}}}[{R}])))", f"{name} p50"),
            (f"histogram_quantile(0.99, sum by (le, {by}) "
             f"(rate(pushworker_delivery_duration_seconds_bucket{{{sel}}}[{R}])))", f"{name} p99"),
        ], 12, 0, "s", exemplars=True, links=[{
            "title": "Traces of ${__field.labels.project}/${__field.labels.subscription}",
            "url": traces_url("${__field.labels.subscription}", "${__field.labels.project}")}]),
        # Every worker serving a spread subscription reports its backlog: max, not sum.
        panel(3, "Backlog", [(f"max by ({by}) (pushworker_subscription_backlog{{{sel}}})", name)], 0, 8),
        panel(4, "Retries, dead-letters and drops per second", [
            (f"sum by ({by}) (rate(pushworker_retries_total{{{sel}}}[{R}]))", f"{name} retries"),
            (f"sum by ({by}) (rate(pushworker_messages_dead_lettered_total{{{sel}}}[{R}]))", f"{name} dead-lettered"),
            (f"sum by ({by}) (rate(pushworker_messages_dropped_total{{{sel}}}[{R}]))", f"{name} dropped"),
        ], 12, 8, "ops"),
        panel(5, "Unsettled, in flight, held for retry", [
            (f"sum by ({by}) (pushworker_unsettled{{{sel}}})", f"{name} unsettled"),
            (f"sum by ({by}) (pushworker_in_flight{{{sel}}})", f"{name} in flight"),
            (f"sum by ({by}) (pushworker_held_for_retry{{{sel}}})", f"{name} held"),
        ], 0, 16),
        panel(6, "Endpoint concurrency window", [(
            f"max by ({by}) (pushworker_endpoint_concurrency_window{{{sel}}})", name)], 12, 16),
        panel(7, "Owner", [(f"max by ({by}, instance) (pushworker_subscription_owned{{{sel}}})",
                            f"{name} on {{{{instance}}}}")], 0, 24, kind="table", w=12),
        panel(8, "State (Active, Error, Suspended, Seeking, Starting, Paused, Quarantined, Expired)", [(
            f"max by ({by}, state) (pushworker_subscription_state{{{sel}}})", f"{name} {{{{state}}}}")],
            12, 24, kind="table", w=12),
        panel(9, "Workers serving it (max_workers above 1)", [(
            f"max by ({by}) (pushworker_subscription_workers{{{sel}}})", name)], 0, 32),
    ], [JOB_VAR, PROJECT_VAR, SUB_VAR], links=[{
        "title": "Traces (Tempo)", "type": "link", "icon": "external link", "targetBlank": True,
        "url": traces_url("${subscription:regex}", "${project:regex}")}])


def boards() -> dict[str, str]:
    """Each dashboard's file name and its JSON text, as the files hold it."""
    return {name: json.dumps(board, indent=2) + "\n"
            for name, board in (("push-worker-fleet.json", fleet()), ("push-worker-subscription.json", subscription()))}


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    for name, text in boards().items():
        (OUT / name).write_text(text)
        print(f"wrote {OUT / name}")
