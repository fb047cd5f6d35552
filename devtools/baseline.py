"""`make bench`'s guards against a recorded baseline (docs/measurements/baseline.json).

Every guarded figure but one is a ratio measured against a reference of the same run (this machine's
speed drifts by tens of percent from minute to minute); the one absolute figure is the misbehaving
project's attempts a second in the neighbours section (issue #59: it keeps at least 80% of its
throughput from before the scheduler, inside this tolerance). A run fails a
guard when its median is more than TOLERANCE worse than the recorded median: higher for a cost,
lower for a gain. `make bench BENCH_ARGS=--record-baseline` writes the run's figures as the new
baseline (figures of sections not run keep their recorded value); the baseline changes only in a
commit that says why.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "docs" / "measurements" / "baseline.json"
TOLERANCE = 0.15


@dataclass(frozen=True)
class Figure:
    key: str  # its name in the baseline file
    what: str  # what it measures, said in the guard's line
    median: float
    lower_is_better: bool = True
    # How much worse than the baseline still holds; a figure whose runs vary more than TOLERANCE on
    # this machine (the seconds a fleet of processes takes to start and converge) says its own.
    tolerance: float = TOLERANCE


def verdict(figure: Figure, recorded: float | None) -> tuple[bool, str]:
    """Whether `figure` holds against the `recorded` median (None: nothing recorded, nothing to
    hold), and the line that says so."""
    if recorded is None:
        return True, f"guard: {figure.what}: {figure.median:.2f}; no baseline recorded (--record-baseline)"
    if figure.lower_is_better:
        limit = recorded * (1 + figure.tolerance)
        holds, bound = figure.median <= limit, f"at most {limit:.2f}"
    else:
        limit = recorded * (1 - figure.tolerance)
        holds, bound = figure.median >= limit, f"at least {limit:.2f}"
    return holds, (f"guard: {figure.what}: {figure.median:.2f} against the baseline's {recorded:.2f} ({bound}), "
                   f"{'holds' if holds else 'DOES NOT HOLD'}")


class Baseline:
    """The recorded medians, and this run's figures to check against them or record."""

    def __init__(self, path: Path = BASELINE) -> None:
        self.path = path
        self.recorded: dict[str, dict[str, object]] = {}
        if path.exists():
            self.recorded = json.loads(path.read_text())["figures"]
        self.measured: list[Figure] = []

    def check(self, figure: Figure) -> tuple[bool, str]:
        self.measured.append(figure)
        entry = self.recorded.get(figure.key)
        median = entry.get("median") if entry else None
        return verdict(figure, float(median) if isinstance(median, int | float) else None)

    def record(self) -> None:
        """This run's figures as the baseline; those of sections not run stay as recorded."""
        figures = dict(self.recorded)
        for f in self.measured:
            figures[f.key] = {"median": round(f.median, 3), "what": f.what, "lower_is_better": f.lower_is_better,
                              "recorded": datetime.now(UTC).strftime("%Y-%m-%dT%H:%MZ"), "commit": _commit()}
        self.path.write_text(json.dumps({"tolerance": TOLERANCE, "figures": dict(sorted(figures.items()))},
                                        indent=2) + "\n")


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return done.stdout.strip() or "unknown"
