"""Generates the Grafana dashboards in grafana/dashboards/ (run: python grafana/build_dashboards.py).

The JSON files are checked in; this script is their source. Queries use $__rate_interval and the
`subscription` template variable; the test suite evaluates every query against a real Prometheus.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DS = {"type": "prometheus", "uid": "${datasource}"}
OUT = Path(__file__).parent / "dashboards"


def panel(pid: int, title: str, targets: list[tuple[str, str]], x: int, y: int, unit: str = "short",
          kind: str = "timeseries", w: int = 12, h: int = 8) -> dict[str, Any]:
    return {
        "id": pid, "type": kind, "title": title, "datasource": DS,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom"}} if kind == "timeseries" else {},
        "targets": [{"refId": chr(65 + i), "datasource": DS, "expr": expr, "legendFormat": legend}
                    for i, (expr, legend) in enumerate(targets)],
    }


def dashboard(uid: str, title: str, panels: list[dict[str, Any]], variables: list[dict[str, Any]]) -> dict[str, Any]:
    datasource_var = {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source",
                      "current": {}, "hide": 0}
    return {
        "uid": uid, "title": title, "tags": ["push-worker"], "timezone": "utc", "schemaVersion": 39,
        "version": 1, "editable": True, "refresh": "30s", "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": [datasource_var, *variables]}, "panels": panels, "annotations": {"list": []},
    }


SUB_VAR = {"name": "subscription", "type": "query", "datasource": DS, "label": "Subscription",
           "query": {"query": "label_values(pushworker_subscription_owned, subscription)", "refId": "vars"},
           "definition": "label_values(pushworker_subscription_owned, subscription)",
           "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*", "current": {}, "hide": 0}

R = "$__rate_interval"


def fleet() -> dict[str, Any]:
    return dashboard("push-worker-fleet", "push-worker / fleet overview", [
        panel(1, "Delivery rate by result", [(f"sum by (result) (rate(pushworker_deliveries_total[{R}]))",
                                              "{{result}}")], 0, 0, "reqps"),
        panel(2, "Error ratio (attempts not acked)", [(
            f'sum(rate(pushworker_deliveries_total{{result!="ack"}}[{R}])) '
            f"/ clamp_min(sum(rate(pushworker_deliveries_total[{R}])), 1e-9)", "error ratio")], 12, 0, "percentunit"),
        panel(3, "Attempt latency p50 / p99", [
            (f"histogram_quantile(0.5, sum by (le) (rate(pushworker_delivery_duration_seconds_bucket[{R}])))", "p50"),
            (f"histogram_quantile(0.99, sum by (le) (rate(pushworker_delivery_duration_seconds_bucket[{R}])))", "p99"),
        ], 0, 8, "s"),
        panel(4, "Backlog by subscription", [("sum by (project, subscription) (pushworker_subscription_backlog)",
                                              "{{project}}/{{subscription}}")], 12, 8),
        panel(5, "Dead-lettered per second", [(
            f"sum by (project, subscription) (rate(pushworker_messages_dead_lettered_total[{R}]))",
            "{{project}}/{{subscription}}")], 0, 16, "ops"),
        panel(6, "In flight and held for retry", [("sum(pushworker_in_flight)", "in flight"),
                                                  ("sum(pushworker_held_for_retry)", "held for retry")], 12, 16),
        panel(7, "Workers", [("max(pushworker_fleet_size)", "fleet size seen by workers"),
                             ('count(up{job="push-worker"} == 1)', "scraped and up")], 0, 24),
        panel(8, "Ownership balance (subscriptions per worker)", [(
            "count by (instance) (pushworker_subscription_owned == 1)", "{{instance}}")], 12, 24),
        panel(9, "Subscriptions by state (Active, Error, Seeking, Paused, Expired)", [(
            "sum by (state) (pushworker_subscription_state)", "{{state}}")], 0, 32),
    ], [])


def subscription() -> dict[str, Any]:
    sel = 'subscription=~"$subscription"'
    return dashboard("push-worker-subscription", "push-worker / subscription", [
        panel(1, "Deliveries by result", [(
            f"sum by (subscription, result) (rate(pushworker_deliveries_total{{{sel}}}[{R}]))",
            "{{subscription}} {{result}}")], 0, 0, "reqps"),
        panel(2, "Attempt latency p50 / p99", [
            (f"histogram_quantile(0.5, sum by (le, subscription) "
             f"(rate(pushworker_delivery_duration_seconds_bucket{{{sel}}}[{R}])))", "{{subscription}} p50"),
            (f"histogram_quantile(0.99, sum by (le, subscription) "
             f"(rate(pushworker_delivery_duration_seconds_bucket{{{sel}}}[{R}])))", "{{subscription}} p99"),
        ], 12, 0, "s"),
        panel(3, "Backlog", [(f"sum by (subscription) (pushworker_subscription_backlog{{{sel}}})",
                              "{{subscription}}")], 0, 8),
        panel(4, "Retries and dead-letters per second", [
            (f"sum by (subscription) (rate(pushworker_retries_total{{{sel}}}[{R}]))", "{{subscription}} retries"),
            (f"sum by (subscription) (rate(pushworker_messages_dead_lettered_total{{{sel}}}[{R}]))",
             "{{subscription}} dead-lettered"),
        ], 12, 8, "ops"),
        panel(5, "Unsettled, in flight, held for retry", [
            (f"sum by (subscription) (pushworker_unsettled{{{sel}}})", "{{subscription}} unsettled"),
            (f"sum by (subscription) (pushworker_in_flight{{{sel}}})", "{{subscription}} in flight"),
            (f"sum by (subscription) (pushworker_held_for_retry{{{sel}}})", "{{subscription}} held"),
        ], 0, 16),
        panel(6, "Endpoint concurrency window", [(
            f"max by (subscription) (pushworker_endpoint_concurrency_window{{{sel}}})", "{{subscription}}")], 12, 16),
        panel(7, "Owner", [(f"max by (subscription, instance) (pushworker_subscription_owned{{{sel}}})",
                            "{{subscription}} on {{instance}}")], 0, 24, kind="table", w=12),
        panel(8, "State", [(f"max by (subscription, state) (pushworker_subscription_state{{{sel}}})",
                            "{{subscription}} {{state}}")], 12, 24, kind="table", w=12),
    ], [SUB_VAR])


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    for name, board in (("push-worker-fleet.json", fleet()), ("push-worker-subscription.json", subscription())):
        (OUT / name).write_text(json.dumps(board, indent=2) + "\n")
        print(f"wrote {OUT / name}")
