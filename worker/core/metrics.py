"""Prometheus metrics (prefix `pushworker_`). Labels stay low-cardinality: project and subscription
names, result classes; never URLs or message ids."""

from __future__ import annotations

import contextlib
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

SUB = ("project", "subscription")
BROKER_OPERATIONS = ("receive", "ack", "subscribe", "backlog", "admin", "dead_letter", "lookup")


class Metrics:
    """All metrics of one worker, on their own registry (tests run several workers in one process)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.deliveries = Counter("pushworker_deliveries", "Delivery attempts by result (ack, 1xx/3xx/4xx/5xx, "
                                  "timeout, connection_error, payload_too_large, not_sent)", (*SUB, "result"),
                                  registry=r)
        self.delivery_seconds = Histogram(
            "pushworker_delivery_duration_seconds", "Duration of one delivery attempt", SUB, registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600))
        self.acked = Counter("pushworker_messages_acked", "Messages settled by an ack from the endpoint",
                             SUB, registry=r)
        self.dead_lettered = Counter("pushworker_messages_dead_lettered",
                                     "Messages republished to the dead-letter topic", SUB, registry=r)
        self.dropped = Counter("pushworker_messages_dropped",
                               "Exhausted messages acked and dropped (no dead-letter topic)", SUB, registry=r)
        self.filtered = Counter("pushworker_messages_filtered", "Messages the subscription's filter did not "
                                "match: acked without a request", SUB, registry=r)
        self.settled_redeliveries = Counter(
            "pushworker_settled_redeliveries", "Redelivered copies of messages already settled (their ack was "
            "lost to a crash or a broker outage), acked without a request", SUB, registry=r)
        self.retries = Counter("pushworker_retries", "Failed attempts scheduled for a retry", SUB, registry=r)
        self.rate_limited_seconds = Counter("pushworker_rate_limited_seconds", "Time requests waited on the "
                                            "subscription's rate limit (deliver.push.rate_limit), summed",
                                            SUB, registry=r)
        self.in_flight = Gauge("pushworker_in_flight", "HTTP requests under way", SUB, registry=r)
        self.held_for_retry = Gauge("pushworker_held_for_retry", "Messages waiting for their retry backoff",
                                    SUB, registry=r)
        self.unsettled = Gauge("pushworker_unsettled", "Messages taken from the broker and not yet settled "
                               "(bounded by max_ack_pending)", SUB, registry=r)
        self.held_bytes = Gauge("pushworker_held_bytes", "Memory the unsettled messages take: twice their "
                                "payload, plus its base64 body where there is one (bounded by "
                                "max_held_bytes_per_subscription, but for one message larger than it)", SUB,
                                registry=r)
        self.message_failures = Counter("pushworker_message_failures", "Messages whose handling raised (a bug, "
                                        "an overflow): each settled alone (dead-lettered as worker_error, or handed "
                                        "back to the broker); never counted toward the worker's health",
                                        SUB, registry=r)
        self.log_lines_suppressed = Counter("pushworker_log_lines_suppressed", "Per-message log lines left out "
                                            "by the per-subscription rate limit (each kind says how many in its "
                                            "next line)", SUB, registry=r)
        self.max_held_bytes = Gauge("pushworker_max_held_bytes", "The worker's budget of memory for held messages, "
                                    "shared fairly by its subscriptions (max_held_bytes)", registry=r)
        self.worker_held_bytes = Gauge("pushworker_worker_held_bytes", "Memory all the worker's "
                                       "subscriptions hold (bounded by pushworker_max_held_bytes)", registry=r)
        self.attributes_omitted = Counter("pushworker_attributes_omitted",
                                          "Attributes not sent as headers (unsafe name or value)", SUB, registry=r)
        self.redis_round_trips = Counter("pushworker_redis_round_trips", "Pipelined round trips to Redis",
                                         registry=r)
        self.redis_commands = Counter("pushworker_redis_commands", "Commands sent to Redis", registry=r)
        self.fair_share_waits = Counter("pushworker_fair_share_waits", "Units of work that waited for their "
                                        "project's turn of the event loop (the fair share held a project back)",
                                        registry=r)
        self.trials = Counter("pushworker_trials", "Trials of suspects (subscriptions whose worker died with its "
                              "memory alarm raised) by outcome: passed, stalled (never subscribed), ended (let go "
                              "before the end), killed (its worker died on it: counted by the next holder, which "
                              "quarantines it)", ("outcome",), registry=r)
        for outcome in ("passed", "stalled", "ended", "killed"):  # series from the start, for rate()
            self.trials.labels(outcome)
        self.trial_wait_seconds = Histogram("pushworker_trial_wait_seconds", "How long a suspect waited for its "
                                            "trial (it is not served meanwhile)",
                                            buckets=(0.1, 1, 5, 10, 30, 60, 120, 300, 600, 1800), registry=r)
        self.trace_spans_exported = Counter("pushworker_trace_spans_exported", "Spans the OTLP collector "
                                            "accepted (tracing on)", registry=r)
        self.trace_spans_dropped = Counter("pushworker_trace_spans_dropped", "Spans dropped: the export queue was "
                                           "full or the collector refused or did not answer (tracing on)",
                                           registry=r)
        self.redis_errors = Counter("pushworker_redis_errors", "Redis calls that failed (and were retried)",
                                    registry=r)
        self.task_failures = Counter("pushworker_task_failures", "Background tasks that failed unexpectedly "
                                     "(each is logged with its traceback and restarted)", ("task",), registry=r)
        self.broker_errors = Counter("pushworker_broker_errors", "Broker calls that failed",
                                     ("operation",), registry=r)
        for operation in BROKER_OPERATIONS:  # series from the start, so a rate() sees the first error
            self.broker_errors.labels(operation)
        self.endpoint_window = Gauge("pushworker_endpoint_concurrency_window",
                                     "Adaptive concurrency window of the subscription's endpoint", SUB, registry=r)
        self.backlog = Gauge("pushworker_subscription_backlog", "Messages the broker holds for the subscription "
                             "(msgBacklog), reported by its owner", SUB, registry=r)
        self.backlog_source = Gauge("pushworker_backlog_source_configured", "1 when the worker has a backlog "
                                    "source (pulsar.admin_url or pulsar.metrics_url), else 0", registry=r)
        self.fleet_size = Gauge("pushworker_fleet_size", "Live workers this worker sees in its fleet", registry=r)
        self.owned = Gauge("pushworker_subscription_owned", "1 for each subscription this worker serves",
                           SUB, registry=r)
        self.assigned = Gauge("pushworker_subscription_assigned", "1 for each subscription the fleet assigns to "
                              "this worker (served, paused or expired): one worker reports each existing one",
                              SUB, registry=r)
        self.workers = Gauge("pushworker_subscription_workers", "Workers the fleet has decided serve the "
                             "subscription (max_workers), reported by the holder of its slot 0", SUB, registry=r)
        self.state = Gauge("pushworker_subscription_state", "1 for the subscription's state (Active, Error, "
                           "Seeking; Paused and Expired from the worker it is assigned to)", (*SUB, "state"),
                           registry=r)
        self._states: dict[tuple[str, str], str] = {}
        self._results: dict[tuple[str, str], set[str]] = {}  # the `result` labels of each subscription's deliveries

    def round_trip(self, commands: int) -> None:
        self.redis_round_trips.inc()
        self.redis_commands.inc(commands)

    def for_subscription(self, project: str, subscription: str) -> SubscriptionMetrics:
        return SubscriptionMetrics(self, project, subscription)

    def set_state(self, project: str, subscription: str, state: str | None) -> None:
        """One series per subscription, labelled with its current state; None drops it."""
        old = self._states.pop((project, subscription), None)
        if old is not None and old != state:
            with contextlib.suppress(KeyError):
                self.state.remove(project, subscription, old)
        if state is not None:
            self._states[(project, subscription)] = str(state)
            self.state.labels(project, subscription, str(state)).set(1)

    def forget(self, project: str, subscription: str) -> None:
        """Drop every series of a subscription when this worker no longer serves it (moved, paused,
        deleted): with subscriptions coming and going, a worker would otherwise collect series
        without end (measured: 36 a subscription). The owner's series count on from zero, which
        rate() and increase() read as a counter reset."""
        self.set_state(project, subscription, None)
        for metric in (self.in_flight, self.held_for_retry, self.unsettled, self.held_bytes, self.owned,
                       self.endpoint_window, self.backlog, self.delivery_seconds, self.acked, self.dead_lettered,
                       self.dropped, self.filtered, self.settled_redeliveries, self.retries, self.rate_limited_seconds,
                       self.attributes_omitted,
                       self.message_failures, self.log_lines_suppressed):
            with contextlib.suppress(KeyError):
                metric.remove(project, subscription)
        for result in self._results.pop((project, subscription), ()):
            with contextlib.suppress(KeyError):
                self.deliveries.remove(project, subscription, result)


class SubscriptionMetrics:
    """One subscription's metric children, bound once: the hot path does no label lookups."""

    def __init__(self, m: Metrics, project: str, subscription: str) -> None:
        labels = (project, subscription)
        self._deliveries = m.deliveries
        self._results = m._results
        self._labels = labels
        self._by_result: dict[str, Any] = {}
        self.delivery_seconds = m.delivery_seconds.labels(*labels)
        self.acked = m.acked.labels(*labels)
        self.dead_lettered = m.dead_lettered.labels(*labels)
        self.dropped = m.dropped.labels(*labels)
        self.filtered = m.filtered.labels(*labels)
        self.retries = m.retries.labels(*labels)
        self.rate_limited_seconds = m.rate_limited_seconds.labels(*labels)
        self.settled_redeliveries = m.settled_redeliveries.labels(*labels)
        self.in_flight = m.in_flight.labels(*labels)
        self.held_for_retry = m.held_for_retry.labels(*labels)
        self.unsettled = m.unsettled.labels(*labels)
        self.held_bytes = m.held_bytes.labels(*labels)
        self.attributes_omitted = m.attributes_omitted.labels(*labels)
        self.message_failures = m.message_failures.labels(*labels)
        self.log_lines_suppressed = m.log_lines_suppressed.labels(*labels)
        self.endpoint_window = m.endpoint_window.labels(*labels)
        self.owned = m.owned.labels(*labels)
        self.broker_errors = m.broker_errors

    def delivery(self, result: str) -> Any:
        child = self._by_result.get(result)
        if child is None:
            child = self._by_result[result] = self._deliveries.labels(*self._labels, result)
            self._results.setdefault(self._labels, set()).add(result)  # for `Metrics.forget`
        return child
