"""OpenTelemetry traces of deliveries: one span per attempt (a child of the publisher's context, or
of a new trace), one per dead letter, one per breaker decision; exported by OTLP over HTTP from
the SDK's batch processor, whose bounded queue drops (and counts) what a slow or absent collector
cannot take, so that delivery never waits for it.

Imported only when `tracing` is configured (`telemetry.start`): a worker without it loads no
OpenTelemetry at all, and its per-message path checks one attribute (`DeliveryContext.tracer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import random
import threading
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from worker.core.delivery import Outcome
from worker.core.messages import Envelope, trace_headers
from worker.core.metrics import Metrics
from worker.endpoint.destinations import without_credentials
from worker.model.config import TracingSettings
from worker.model.subscriptions import Subscription

# What an attempt span says beyond the semantic conventions (docs/observability.md#traces).
ATTEMPT = "pushworker.delivery.attempt"
OUTCOME = "pushworker.delivery.outcome"  # acked, retried, dead-lettered, dropped, stopped (core.context)
DEADLINE = "pushworker.ack_deadline_seconds"
PROBE = "pushworker.breaker.probe"
PROJECT = "pushworker.project"

CLOSE_SECONDS = 2.0  # a stop waits this long for the last spans: a collector that is up takes them in milliseconds


class _MessageIds(RandomIdGenerator):
    """Random ids, but for a message that came without a trace: its trace id is worked out from
    the message (topic and id), so that every attempt of it, by any worker, after any crash, lands
    in one trace without storing anything."""

    def __init__(self) -> None:
        self.next_trace_id = 0  # set right before a span is started, in the loop's thread

    def generate_trace_id(self) -> int:
        if self.next_trace_id:
            trace_id, self.next_trace_id = self.next_trace_id, 0
            return trace_id
        return super().generate_trace_id()


def message_trace_id(env: Envelope, topic: str) -> int:
    """The trace id of a message without a trace: uniform bits, as TraceIdRatioBased expects."""
    digest = hashlib.blake2b(f"{topic}\0{env.message_id}".encode(), digest_size=16).digest()
    return int.from_bytes(digest, "big") or 1


class _CountingProcessor(BatchSpanProcessor):
    """The SDK's batch processor, counting the spans its full queue drops (it only logs them)."""

    def __init__(self, exporter: SpanExporter, max_queue_size: int, metrics: Metrics) -> None:
        # A batch is at most the queue (the SDK refuses a larger one); OTEL_BSP_MAX_EXPORT_BATCH_SIZE
        # else, or the SDK's 512 when it is not a number (as the SDK reads its other variables).
        batch = os.environ.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "")
        size = min(max_queue_size, max(1, int(batch)) if batch.strip().isdigit() else 512)
        super().__init__(exporter, max_queue_size=max_queue_size, max_export_batch_size=size)
        self._capacity = max_queue_size
        self._metrics = metrics

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is not None and span.context.trace_flags.sampled:
            queue = getattr(self._batch_processor, "_queue", None)
            if queue is not None and len(queue) >= self._capacity:
                self._metrics.trace_spans_dropped.inc()
        super().on_end(span)


class _CountingExporter(SpanExporter):
    """The OTLP exporter, counting what it exported and what it could not."""

    def __init__(self, exporter: SpanExporter, metrics: Metrics) -> None:
        self._exporter = exporter
        self._metrics = metrics
        self.failing = False  # the last export failed: the collector is down or refuses
        self.exporting_since = 0.0  # when the export under way began (monotonic; 0.0: none)

    @property
    def stuck(self) -> bool:
        """The collector is down or refuses, or an export has been retrying for over a second."""
        since = self.exporting_since
        return self.failing or (since > 0.0 and time.monotonic() - since > 1.0)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.exporting_since = time.monotonic()
        result = self._exporter.export(spans)
        self.exporting_since = 0.0
        self.failing = result is not SpanExportResult.SUCCESS
        if self.failing:
            self._metrics.trace_spans_dropped.inc(len(spans))
        else:
            self._metrics.trace_spans_exported.inc(len(spans))
        return result

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._exporter.force_flush(timeout_millis)


def _parent(headers: dict[str, str]) -> Any:
    """The publisher's context from a message's (well-formed) `traceparent`/`tracestate`, or None."""
    parent = headers.get("traceparent")
    if parent is None:
        return None
    _, trace_id, span_id, flags = parent.split("-")[:4]
    state = TraceState.from_header([headers["tracestate"]]) if "tracestate" in headers else None
    context = SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=True,
                          trace_flags=TraceFlags(int(flags, 16) & 1), trace_state=state)
    return trace.set_span_in_context(NonRecordingSpan(context))


def _sampled(headers: dict[str, str]) -> bool:
    return int(headers["traceparent"][-2:], 16) & 1 == 1


class Tracer:
    """Starts and ends the spans of deliveries (`core.context.Tracer`)."""

    def __init__(self, settings: TracingSettings, metrics: Metrics, version: str) -> None:
        assert settings.traces_url is not None
        self._metrics = metrics
        self._ids = _MessageIds()
        resource_attributes = {"service.version": version}
        if not os.environ.get("OTEL_SERVICE_NAME") and "service.name" not in os.environ.get(
                "OTEL_RESOURCE_ATTRIBUTES", ""):
            resource_attributes["service.name"] = settings.service_name
        # OTEL_TRACES_SAMPLER chose a sampler: the SDK reads it (None) and decides every span. Else
        # the section's ratio, parent-based, which `attempt` applies itself before the SDK is asked
        # (the same decision: TraceIdRatioBased's bound on the trace id's low 64 bits), so that a
        # message not sampled costs a hash and a header, not a span (`make bench --section tracing`).
        self._ratio_bound: int | None = None
        sampler = None
        if not settings.sampler_from_environment:
            sampler = ParentBased(TraceIdRatioBased(settings.sample_ratio))
            self._ratio_bound = TraceIdRatioBased.get_bound_for_rate(settings.sample_ratio)
        self._provider = TracerProvider(resource=Resource.create(resource_attributes), sampler=sampler,
                                        id_generator=self._ids, shutdown_on_exit=False)
        self._exporter = exporter = _CountingExporter(OTLPSpanExporter(endpoint=settings.traces_url), metrics)
        self._provider.add_span_processor(_CountingProcessor(exporter, settings.max_queue_size, metrics))
        # Counted above; the SDK's own line for every span a full queue drops, and the exporter's for
        # every retry, would flood the log (a failed export is still an error line).
        logging.getLogger("opentelemetry.sdk._shared_internal").setLevel(logging.ERROR)
        logging.getLogger("opentelemetry.exporter.otlp.proto.http").setLevel(logging.ERROR)
        self._tracer = self._provider.get_tracer("push-worker", version)
        self._described: dict[tuple[str, str, str, int], dict[str, Any]] = {}

    # -- an attempt ------------------------------------------------------------------------------

    def attempt(self, sub: Subscription, sending: Sequence[tuple[Envelope, int]],
                probe: bool) -> tuple[Any, dict[str, str]]:
        """The span of one request, started now (None: not sampled), and the trace headers the
        request carries. One message: a child of its publisher's context, or of a trace of its own
        worked out from the message; its headers name the span. A batch: a new trace linked to
        each message's context."""
        if len(sending) != 1:
            return self._batch(sub, sending, probe)
        env, number = sending[0]
        given = trace_headers(env.attributes) if "traceparent" in env.attributes else {}
        own_trace = 0 if given else message_trace_id(env, sub.topic)
        if self._ratio_bound is not None:  # the sampler's decision, made here first (see __init__)
            if given and not _sampled(given):
                return None, {}  # the publisher did not sample it: its headers go on as they are
            if own_trace and own_trace & TraceIdRatioBased.TRACE_ID_LIMIT >= self._ratio_bound:
                return None, {"traceparent": f"00-{own_trace:032x}-{random.getrandbits(64) or 1:016x}-00"}
        span = self._start(f"push {sub.topic}", SpanKind.CLIENT, _parent(given), own_trace, {
            **self._description(sub), "messaging.message.id": env.message_id, ATTEMPT: number, PROBE: probe})
        return (span if span.is_recording() else None), self.headers(span)

    def _start(self, name: str, kind: SpanKind, parent: Any, own_trace: int,
               attributes: dict[str, Any] | None = None) -> Any:
        """A span started now under `parent`; without one, in the message's own trace (`own_trace`)."""
        if parent is None:
            self._ids.next_trace_id = own_trace
        try:
            return self._tracer.start_span(name, context=parent, kind=kind, attributes=attributes)
        finally:
            self._ids.next_trace_id = 0

    def _batch(self, sub: Subscription, sending: Sequence[tuple[Envelope, int]],
               probe: bool) -> tuple[Any, dict[str, str]]:
        links = []
        for env, number in sending:
            parent = _parent(trace_headers(env.attributes))
            if parent is not None:
                links.append(Link(trace.get_current_span(parent).get_span_context(),
                                  {"messaging.message.id": env.message_id, ATTEMPT: number}))
        span = self._tracer.start_span(f"push {sub.topic}", kind=SpanKind.CLIENT, links=links, attributes={
            **self._description(sub), "messaging.batch.message_count": len(sending), PROBE: probe})
        return (span if span.is_recording() else None), self.headers(span)

    def _description(self, sub: Subscription) -> dict[str, Any]:
        """What every attempt span of `sub` says of it (semantic conventions), worked out once."""
        key = (sub.key, sub.topic, sub.url, sub.ack_deadline_seconds)
        described = self._described.get(key)
        if described is None:
            if len(self._described) >= 10_000:  # edits and moves leave old entries: start again
                self._described.clear()
            parts = urlsplit(sub.url)
            described = self._described[key] = {
                "messaging.system": "pulsar", "messaging.operation.type": "process",
                "messaging.destination.name": sub.topic, "messaging.destination.subscription.name": sub.name,
                "http.request.method": "POST", "url.full": without_credentials(sub.url),
                "server.address": parts.hostname or "",
                "server.port": parts.port or (443 if parts.scheme == "https" else 80),
                DEADLINE: float(sub.ack_deadline_seconds), PROJECT: sub.tenant}
        return described

    @staticmethod
    def headers(span: Any) -> dict[str, str]:
        """The `traceparent` (and `tracestate`) the endpoint gets: the attempt span's context."""
        context = span.get_span_context()
        headers = {"traceparent": f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"}
        if context.trace_state:
            headers["tracestate"] = context.trace_state.to_header()
        return headers

    # An attempt's span, once started, is one being recorded: `attempt` gives no other.

    @staticmethod
    def answered(span: Any, outcome: Outcome) -> None:
        """What the endpoint answered (or that it did not)."""
        if outcome.status is not None:
            span.set_attribute("http.response.status_code", outcome.status)
        if not outcome.acked:
            span.set_attribute("error.type", outcome.last_status)
            span.set_status(Status(StatusCode.ERROR, outcome.last_status))

    @staticmethod
    def exemplar(span: Any) -> dict[str, str] | None:
        """The trace an observation of the attempt-latency histogram points to."""
        context = span.get_span_context()
        return {"trace_id": f"{context.trace_id:032x}", "span_id": f"{context.span_id:016x}"}

    @staticmethod
    def settled(span: Any, decision: str) -> None:
        """Ends the attempt's span with what became of it: acked, retried, dead-lettered or dropped."""
        span.set_attribute(OUTCOME, decision)
        span.end()

    # -- beyond an attempt -----------------------------------------------------------------------

    def dead_letter(self, sub: Subscription, env: Envelope, topic: str, attempts: int, last_status: str,
                    after: Any) -> Any:
        """The span of a dead letter's publish, started now: a child of the attempt that gave up
        (`after`), or else of the message's own context."""
        parent = trace.set_span_in_context(after) if after is not None else _parent(trace_headers(env.attributes))
        span = self._start(f"send {topic}", SpanKind.PRODUCER, parent,
                           message_trace_id(env, sub.topic) if parent is None else 0)
        if span.is_recording():
            span.set_attributes({
                "messaging.system": "pulsar", "messaging.operation.type": "send", "messaging.operation.name": "send",
                "messaging.destination.name": topic, "messaging.message.id": env.message_id,
                "messaging.destination.subscription.name": sub.name, PROJECT: sub.tenant,
                "pushworker.dead_letter.attempts": attempts, "pushworker.dead_letter.last_status": last_status})
        return span

    @staticmethod
    def published(span: Any, confirmed: bool) -> None:
        """Ends a dead letter's span: confirmed by the broker, or not (the worker stopped first)."""
        if not confirmed:
            span.set_status(Status(StatusCode.ERROR, "not confirmed before the stop"))
        span.end()

    def breaker(self, sub: Subscription, opened: bool, reason: str) -> None:
        """A span of its own for the breaker's decision on `sub`'s endpoint."""
        span = self._tracer.start_span(f"breaker {'open' if opened else 'close'} {sub.name}", kind=SpanKind.INTERNAL)
        if span.is_recording():
            span.set_attributes({"messaging.system": "pulsar", "messaging.destination.name": sub.topic,
                                 "messaging.destination.subscription.name": sub.name, PROJECT: sub.tenant,
                                 "url.full": without_credentials(sub.url),
                                 "pushworker.breaker.state": "open" if opened else "closed",
                                 "pushworker.breaker.reason": reason})
        span.end()

    async def close(self) -> None:
        """What is queued goes to the collector, within CLOSE_SECONDS; at once, and lost, when its last
        export failed (a stop does not wait for a collector that is down). On a thread of its own:
        the loop's executor would hold the process's exit for the exporter's retries."""
        loop = asyncio.get_running_loop()
        done = asyncio.Event()

        def shut_down() -> None:
            try:
                self._provider.shutdown()
            finally:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(done.set)

        threading.Thread(target=shut_down, name="trace-shutdown", daemon=True).start()
        if not self._exporter.stuck:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), CLOSE_SECONDS)

