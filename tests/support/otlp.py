"""A real OTLP/HTTP trace receiver for tests: an aiohttp server that decodes what exporters send
(protobuf `ExportTraceServiceRequest`, gzip or not) with `opentelemetry-proto`, as a collector does."""

from __future__ import annotations

import gzip
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto

from tests.support.endpoints import serve


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs if isinstance(pair, KeyValue)}


@dataclass
class ReceivedSpan:
    """One span as the collector decoded it: ids in lower-case hex, as a traceparent writes them."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # empty: a root span
    kind: str  # CLIENT, PRODUCER, INTERNAL...
    attributes: dict[str, Any]
    status: str  # UNSET, OK, ERROR
    links: list[tuple[str, str, dict[str, Any]]]  # (trace id, span id, attributes)
    resource: dict[str, Any]


@dataclass
class Collector:
    """The receiver: `url` is what OTEL_EXPORTER_OTLP_ENDPOINT or `tracing.endpoint` names."""

    url: str = ""
    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0

    def named(self, prefix: str) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.name.startswith(prefix)]


async def start_collector() -> tuple[web.AppRunner, Collector]:
    collector = Collector()

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if request.headers.get("Content-Type") != "application/x-protobuf":
            return web.Response(status=415)
        export = ExportTraceServiceRequest.FromString(body)
        collector.requests += 1
        for resource_spans in export.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    collector.spans.append(ReceivedSpan(
                        span.name, span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(),
                        SpanProto.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_"),
                        _attributes(span.attributes), span.status.StatusCode.Name(span.status.code)
                        .removeprefix("STATUS_CODE_"),
                        [(link.trace_id.hex(), link.span_id.hex(), _attributes(link.attributes))
                         for link in span.links],
                        resource))
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    runner, url = await serve("/v1/traces", handle)
    collector.url = url.removesuffix("/v1/traces")
    return runner, collector
