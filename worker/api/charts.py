"""The console's charts over the delivery log's window, as numbers for an inline SVG (no script, no
outside resource): deliveries per hour, the outcome classes' shares, and the p95 latency."""

from __future__ import annotations

from typing import Any

from worker.core.messages import rfc3339

WIDTH, HEIGHT = 432, 60
CLASS_ORDER = ("2xx", "3xx", "4xx", "5xx", "timeout", "connection_error")


def _css(outcome: str) -> str:
    return {"2xx": "ok", "4xx": "warn", "5xx": "bad"}.get(outcome, "other")


def charts(hours: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Three charts of `delivery_log.hourly`'s rows (oldest first)."""
    if not hours:
        return []
    step = WIDTH / len(hours)
    left, right = rfc3339(hours[0]["hour_ms"])[:13] + "h", rfc3339(hours[-1]["hour_ms"])[:13] + "h"
    most = max(max(h["attempts"] for h in hours), 1)
    rate = [{"x": round(i * step, 1), "w": round(max(step - 1, 1), 1), "h": round(h["attempts"] / most * HEIGHT, 1),
             "y": round(HEIGHT - h["attempts"] / most * HEIGHT, 1), "cls": "rate",
             "label": f"{rfc3339(h['hour_ms'])[:13]}h: {h['attempts']} attempts"} for i, h in enumerate(hours)]
    shares = []
    for i, h in enumerate(hours):
        total = sum(h["by_class"].values())
        top = 0.0
        classes = [c for c in CLASS_ORDER if c in h["by_class"]] + sorted(set(h["by_class"]) - set(CLASS_ORDER))
        for outcome in classes:
            part = h["by_class"][outcome] / total * HEIGHT if total else 0.0
            shares.append({"x": round(i * step, 1), "w": round(max(step - 1, 1), 1), "y": round(top, 1),
                           "h": round(part, 1), "cls": _css(outcome),
                           "label": f"{rfc3339(h['hour_ms'])[:13]}h: {outcome} {h['by_class'][outcome]}"})
            top += part
    latencies = [h["p95_latency_ms"] for h in hours]
    slowest = max([v for v in latencies if v is not None] or [1.0])
    points = [(round(i * step + step / 2, 1), round(HEIGHT - v / slowest * (HEIGHT - 2), 1), v, hours[i]["hour_ms"])
              for i, v in enumerate(latencies) if v is not None]
    line = " ".join(f"{x},{y}" for x, y, _, _ in points)
    dots = [{"x": x - 1.5, "y": y - 1.5, "w": 3, "h": 3, "cls": "rate",  # a lone hour shows as a dot
             "label": f"{rfc3339(hour)[:13]}h: p95 {v:g} ms"} for x, y, v, hour in points]
    frame = {"width": WIDTH, "height": HEIGHT, "left": left, "right": right}
    return [{**frame, "id": "rate", "title": "Attempts per hour", "bars": rate, "line": "", "top": f"{most}"},
            {**frame, "id": "outcomes", "title": "Outcomes per hour (share)", "bars": shares, "line": "",
             "top": "100%"},
            {**frame, "id": "p95", "title": "p95 latency per hour", "bars": dots, "line": line,
             "top": f"{slowest:g} ms"}]
