"""`make bench`'s guards against the recorded baseline (devtools/baseline.py): pure logic."""

from __future__ import annotations

import json

import pytest

from devtools.baseline import TOLERANCE, Baseline, Figure, verdict

pytestmark = pytest.mark.broker_independent


def test_a_cost_may_grow_by_the_tolerance_and_no_more():
    assert verdict(Figure("k", "cost", 1.0 * (1 + TOLERANCE) - 0.001), 1.0)[0]
    holds, line = verdict(Figure("k", "cost", 1.0 * (1 + TOLERANCE) + 0.001), 1.0)
    assert not holds and "DOES NOT HOLD" in line and "at most 1.15" in line


def test_a_figure_that_varies_more_says_its_own_tolerance():
    assert verdict(Figure("k", "seconds", 1.59, tolerance=0.6), 1.0)[0]
    assert not verdict(Figure("k", "seconds", 1.61, tolerance=0.6), 1.0)[0]


def test_a_gain_may_shrink_by_the_tolerance_and_no_more():
    assert verdict(Figure("k", "gain", 1.8, lower_is_better=False), 2.0)[0]
    holds, line = verdict(Figure("k", "gain", 1.6, lower_is_better=False), 2.0)
    assert not holds and "at least 1.70" in line


def test_nothing_recorded_is_said_and_holds():
    holds, line = verdict(Figure("k", "new", 3.0), None)
    assert holds and "no baseline recorded" in line


def test_recording_keeps_what_this_run_did_not_measure(tmp_path):
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps({"tolerance": TOLERANCE, "figures": {
        "idle": {"median": 0.02, "lower_is_better": True}, "bursts": {"median": 1.05, "lower_is_better": True}}}))
    baseline = Baseline(path)
    assert not baseline.check(Figure("bursts", "bursts", 1.5))[0]  # 1.5 against 1.05: broken
    baseline.record()
    figures = json.loads(path.read_text())["figures"]
    assert figures["bursts"]["median"] == 1.5 and figures["idle"]["median"] == 0.02
    assert Baseline(path).check(Figure("bursts", "bursts", 1.5))[0]
