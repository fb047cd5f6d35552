"""The console's charts as numbers (pure logic): labels a person can read, none overlapping, and a
legend naming every colour drawn."""

from __future__ import annotations

import itertools

from worker.api.charts import LABEL_WIDTH, WIDTH, charts

HOUR_MS = 3_600_000


def hours(count: int, by_class: dict[str, int] | None = None) -> list[dict[str, object]]:
    return [{"hour_ms": 1_765_000_800_000 + i * HOUR_MS, "attempts": 37 * (i % 5),
             "by_class": by_class if by_class is not None else {"2xx": 30, "5xx": 7},
             "p95_latency_ms": 12.5 + i if i % 3 else None} for i in range(count)]


def test_seventy_two_hours_get_x_labels_that_never_overlap_and_stay_inside_the_picture():
    for chart in charts(hours(72)):
        xs = sorted(t["label_x"] for t in chart["x_ticks"])
        assert 4 <= len(xs) <= 8, len(xs)
        assert all(b - a >= LABEL_WIDTH + 8 for a, b in itertools.pairwise(xs)), xs
        assert all(LABEL_WIDTH / 2 <= x <= WIDTH - LABEL_WIDTH / 2 for x in xs)
        assert chart["x_ticks"][0]["label"] == "12-09 05h"  # the newest hour is labelled


def test_the_y_axis_has_three_labelled_lines_up_to_a_round_top():
    rate, outcomes, p95 = charts(hours(72))
    assert [t["label"] for t in rate["y_ticks"]] == ["0", "100", "200"]  # the most is 148: up to 200
    assert [t["label"] for t in outcomes["y_ticks"]] == ["0%", "50%", "100%"]
    assert [t["label"] for t in p95["y_ticks"]] == ["0 ms", "50 ms", "100 ms"]  # the slowest is 83.5 ms
    tallest = max(bar["h"] for bar in rate["bars"])
    assert tallest == round(148 / 200 * (rate["bottom"] - rate["top"]), 1)


def test_the_outcome_legend_names_each_class_drawn_and_only_those():
    _, outcomes, _ = charts(hours(3, {"2xx": 5, "timeout": 1, "teapot": 1}))
    assert [(k["label"], k["cls"]) for k in outcomes["legend"]] == [("2xx", "ok"), ("timeout", "other"),
                                                                     ("teapot", "other")]
    assert {bar["cls"] for bar in outcomes["bars"]} == {"ok", "other"}


def test_one_hour_is_one_labelled_bar():
    rate, _, _ = charts(hours(1))
    assert len(rate["bars"]) == 1 and [t["label"] for t in rate["x_ticks"]] == ["12-06 06h"]
    assert charts([]) == []
