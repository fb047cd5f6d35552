"""`python -m devtools bench-fleet --rollout`: how often a rolling restart moves each subscription.

Computed from layout 2's assignment alone (`leases.assign_buckets`, what every worker computes), no
Redis and no processes: a Deployment's rolling restart replaces every worker by one with a new id,
either a new one first then an old one gone (maxSurge), or the other way round (maxUnavailable).
A subscription moves when the owner the assignment gives it changes.
"""

from __future__ import annotations

from collections import Counter

from worker.fleet.leases import assign_buckets, bucket_of
from worker.ops.render import table


def moves(subscriptions: int, workers: int, surge: bool) -> tuple[Counter[int], float]:
    """Subscriptions by how often they moved over the restart, and the worst share against the mean
    seen after any step."""
    sizes = Counter(bucket_of(f"p-scale/s{i:05d}") for i in range(subscriptions))
    members = [f"old-{i:03d}" for i in range(workers)]
    owners = assign_buckets(sizes, members)
    moved: Counter[int] = Counter()
    worst = 0.0
    for i in range(workers):
        steps = [f"+new-{i:03d}", f"-old-{i:03d}"] if surge else [f"-old-{i:03d}", f"+new-{i:03d}"]
        for step in steps:
            members = [*members, step[1:]] if step[0] == "+" else [m for m in members if m != step[1:]]
            after = assign_buckets(sizes, members)
            moved.update(b for b in sizes if after[b] != owners[b])
            owners = after
            load: Counter[str] = Counter()
            for bucket, owner in owners.items():
                load[owner] += sizes[bucket]
            mean = subscriptions / len(members)
            worst = max(worst, max(abs(load[m] / mean - 1) for m in members))
    by_moves: Counter[int] = Counter()
    for bucket, size in sizes.items():
        by_moves[moved[bucket]] += size
    return by_moves, worst


def run_rollout(subscriptions: int, workers: int) -> int:
    print(f"devtools bench-fleet --rollout: {subscriptions:,} subscriptions over {workers} workers, each replaced "
          "by a worker of a new id, one at a time (layout 2's assignment)\n")
    rows = []
    for surge in (True, False):
        by_moves, worst = moves(subscriptions, workers, surge)
        total = sum(by_moves.values())
        rows.append({"restart": "new first (maxSurge)" if surge else "old first (maxUnavailable)",
                     "moved at most twice": f"{sum(n for k, n in by_moves.items() if k <= 2) / total:.1%}",
                     "mean moves": f"{sum(k * n for k, n in by_moves.items()) / total:.2f}",
                     "most moves": str(max(by_moves)), "worst share": f"{worst:+.1%}"})
    print(table(rows, ["restart", "moved at most twice", "mean moves", "most moves", "worst share"],
                right=("moved at most twice", "mean moves", "most moves", "worst share")))
    return 0
