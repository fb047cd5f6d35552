"""The console's charts over the delivery log's window, as numbers for an inline SVG (no script, no
outside resource): attempts per hour, the outcome classes' shares, and the p95 latency. Each has a
y axis with three labelled lines, x labels spaced so that they never overlap, and a legend."""

from __future__ import annotations

import math
from typing import Any

from worker.core.messages import rfc3339

WIDTH, HEIGHT = 580, 140  # the whole picture; the plot is inside the margins
LEFT, RIGHT, TOP, BOTTOM = 56, 8, 8, 20  # room for the y labels, the x labels
LABEL_WIDTH = 64  # px: "12-06 08h" at the axis font's size (11 px) is about 60
LABEL_SPACING = 96  # px between x labels' centres, at least
CLASS_ORDER = ("2xx", "3xx", "4xx", "5xx", "timeout", "connection_error")


def _css(outcome: str) -> str:
    return {"2xx": "ok", "4xx": "warn", "5xx": "bad"}.get(outcome, "other")


def _hour(hour_ms: int) -> str:
    """A bucket's label: month-day and hour, UTC ("12-06 08h")."""
    text = rfc3339(hour_ms)
    return f"{text[5:10]} {text[11:13]}h"


def _round_up(value: float) -> float:
    """The axis top: the value rounded up to 1, 2 or 5 times a power of ten (labels a person reads)."""
    if value <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(value))
    return float(next(m * power for m in (1, 2, 5, 10) if m * power >= value))


def _number(value: float) -> str:
    return f"{value:,.0f}" if value >= 10 or value == int(value) else f"{value:g}"


def charts(hours: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Three charts of `delivery_log.hourly`'s rows (oldest first)."""
    if not hours:
        return []
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    step = plot_w / len(hours)
    bar_w = round(max(step - 1, 1), 1)

    def x_of(i: int) -> float:
        return round(LEFT + i * step, 1)

    def mid_of(i: int) -> float:  # the centre of hour i's bar: its x label and its latency point
        return round(LEFT + i * step + step / 2, 1)

    def y_of(share: float) -> float:  # 0..1 of the axis, from the bottom
        return round(TOP + plot_h * (1 - share), 1)

    every = max(1, math.ceil(LABEL_SPACING / step))
    half_label = LABEL_WIDTH / 2  # a label is kept inside the picture
    x_ticks = [{"x": mid_of(i), "label": _hour(hours[i]["hour_ms"]),
                "label_x": min(max(mid_of(i), half_label), WIDTH - half_label)}
               for i in range(len(hours) - 1, -1, -every)]  # from the newest back: the latest hour is labelled

    def y_ticks(top: float, unit: str) -> list[dict[str, Any]]:
        return [{"y": y_of(f), "label": _number(top * f) + unit} for f in (0.0, 0.5, 1.0)]

    frame = {"width": WIDTH, "height": HEIGHT, "left": LEFT, "right": WIDTH - RIGHT, "top": TOP,
             "bottom": TOP + plot_h, "x_ticks": x_ticks}

    top = _round_up(max(h["attempts"] for h in hours))
    rate = [{"x": x_of(i), "w": bar_w, "y": y_of(h["attempts"] / top), "h": round(h["attempts"] / top * plot_h, 1),
             "cls": "rate", "label": f"{_hour(h['hour_ms'])}: {h['attempts']} attempts"} for i, h in enumerate(hours)]

    shares, seen = [], set()
    for i, h in enumerate(hours):
        total = sum(h["by_class"].values())
        below = 0.0
        classes = [c for c in CLASS_ORDER if c in h["by_class"]] + sorted(set(h["by_class"]) - set(CLASS_ORDER))
        for outcome in classes:
            part = h["by_class"][outcome] / total if total else 0.0
            seen.add(outcome)
            shares.append({"x": x_of(i), "w": bar_w, "y": y_of(below + part), "h": round(part * plot_h, 1),
                           "cls": _css(outcome),
                           "label": f"{_hour(h['hour_ms'])}: {outcome} {h['by_class'][outcome]} of {total}"})
            below += part
    legend = [{"cls": _css(c), "label": c} for c in CLASS_ORDER if c in seen] + \
             [{"cls": "other", "label": c} for c in sorted(seen - set(CLASS_ORDER))]

    latencies = [h["p95_latency_ms"] for h in hours]
    slowest = _round_up(max([v for v in latencies if v is not None] or [1.0]))
    points = [(mid_of(i), y_of(v / slowest), v, hours[i]["hour_ms"])
              for i, v in enumerate(latencies) if v is not None]
    dots = [{"x": x - 2, "y": y - 2, "w": 4, "h": 4, "cls": "rate",  # a lone hour shows as a dot
             "label": f"{_hour(hour)}: p95 {v:g} ms"} for x, y, v, hour in points]
    return [
        {**frame, "id": "rate", "title": "Attempts per hour", "bars": rate, "line": "",
         "y_ticks": y_ticks(top, ""), "legend": [{"cls": "rate", "label": "attempts"}]},
        {**frame, "id": "outcomes", "title": "Outcomes per hour (share of attempts)", "bars": shares, "line": "",
         "y_ticks": y_ticks(100, "%"), "legend": legend},
        {**frame, "id": "p95", "title": "p95 latency per hour", "bars": dots,
         "line": " ".join(f"{x},{y}" for x, y, _, _ in points), "y_ticks": y_ticks(slowest, " ms"),
         "legend": [{"cls": "rate", "label": "p95 latency"}]},
    ]
