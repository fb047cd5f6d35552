"""OpenTelemetry: traces of deliveries, exported by OTLP (`tracing.py`). The SDK loads only when
tracing is configured: `start` is the one way in."""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.core.metrics import Metrics
from worker.model.config import TracingSettings
from worker.runtime.release import version

if TYPE_CHECKING:
    from worker.core.context import Tracer


def start(settings: TracingSettings, metrics: Metrics) -> Tracer | None:
    """The process's tracer, or None when tracing is not configured (nothing of OpenTelemetry loaded)."""
    if not settings.enabled:
        return None
    from worker.telemetry.tracing import Tracer  # the SDK, only now

    return Tracer(settings, metrics, version())
