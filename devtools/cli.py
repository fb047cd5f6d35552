"""`python -m devtools demo|bench|bench-fleet|soak`: the development tools' command line (the
Makefile's `demo`, `bench` and `soak` targets run it). Not part of the shipped package."""

from __future__ import annotations

import argparse
from typing import Any

from devtools import BENCH_SECTIONS
from worker.cli.common import Parser, positive_int, positive_number, run_loop


def _cmd_demo(args: argparse.Namespace) -> int:
    from devtools.demo import run_demo

    return run_loop(run_demo(messages=args.messages, console=not args.no_console))


def _cmd_bench(args: argparse.Namespace) -> int:
    from devtools.bench import SECTIONS, run_bench

    return run_loop(run_bench(messages=args.messages, concurrency=args.concurrency,
                              sections=tuple(args.section or SECTIONS), steady_rate=args.steady_rate,
                              rounds=args.rounds, record_baseline=args.record_baseline))


def _cmd_bench_fleet(args: argparse.Namespace) -> int:
    if args.rollout:
        from devtools.fleet_rollout import run_rollout

        return run_rollout(args.subscriptions if args.subscriptions != 60 else 100_000, args.workers or 100)
    if args.simulated:
        from devtools.fleet_scale import run_scale

        return run_loop(run_scale(tuple(args.sizes), args.workers or 10, args.lease_seconds or 10.0,
                                  staggered=args.staggered))
    from devtools.fleet_bench import run

    return run_loop(run(args.subscriptions, args.workers or 3, args.lease_seconds or 5.0))


def _cmd_soak(args: argparse.Namespace) -> int:
    from devtools.soak import run_soak

    return run_loop(run_soak(args.seconds, args.workers, args.rate, args.hard_kills))


def build_parser() -> Parser:
    parser = Parser(prog="python -m devtools", description="push-worker's development tools")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


def register(cmds: Any) -> None:
    p = cmds.add_parser("demo", help="embedded broker, Redis and a flaky endpoint: watch delivery live")
    p.add_argument("--messages", type=positive_int, default=300, help="how many to publish (default 300)")
    p.add_argument("--no-console", action="store_true",
                   help="end after the summary (default: the console stays up until Ctrl-C)")
    p.set_defaults(func=_cmd_demo)

    p = cmds.add_parser("bench", help="measure delivery throughput against a bare aiohttp loop")
    p.add_argument("--messages", type=positive_int, default=20000, help="messages per case (default 20000)")
    p.add_argument("--concurrency", type=positive_int, default=64, help="requests at once (default 64)")
    p.add_argument("--section", action="append",
                   choices=BENCH_SECTIONS,
                   help="run only this section (repeatable; default: all but spread, which needs root, "
                        "a cgroup cpu controller and Apache Pulsar)")
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="runs of the shared case, each between references of its own; the median is "
                        "reported (default 3: one run's ratio varies by tens of percent on a shared machine)")
    p.add_argument("--steady-rate", type=positive_number, default=1000.0,
                   help="msg/s offered in total in the subscriptions section (default 1000: what this "
                        "project's 2-core machine sustains with broker, Redis, sink and publisher beside the worker)")
    p.add_argument("--record-baseline", action="store_true",
                   help="write this run's guarded ratios to docs/measurements/baseline.json (commit it saying why) "
                        "instead of checking them")
    p.set_defaults(func=_cmd_bench)
    p = cmds.add_parser("bench-fleet", help="ownership convergence after a kill, movement on a join")
    p.add_argument("--subscriptions", type=positive_int, default=60, help="subscriptions to spread (default 60)")
    p.add_argument("--workers", type=positive_int, default=None,
                   help="workers (default 3 processes; with --simulated, 10)")
    p.add_argument("--lease-seconds", type=positive_number, default=None,
                   help="lease length (default 5; with --simulated, 10)")
    p.add_argument("--simulated", action="store_true",
                   help="the fleet's Redis traffic at scale on a real Redis Cluster: simulated workers running "
                        "the real ownership code, no delivery")
    p.add_argument("--staggered", action="store_true",
                   help="with --simulated: start each worker once the one before joined (pods on machines of "
                        "their own), not all at once")
    p.add_argument("--rollout", action="store_true",
                   help="how often a rolling restart moves each subscription, from the assignment alone (default "
                        "100,000 subscriptions over 100 workers)")
    p.add_argument("--sizes", type=positive_int, nargs="+", default=[1000, 10000],
                   help="with --simulated: subscription counts to measure (default 1000 10000)")
    p.set_defaults(func=_cmd_bench_fleet)

    p = cmds.add_parser("soak", help="a bounded run under mixed failures; reports delivered, duplicated, "
                        "dead-lettered and lost (exit 1 if any was lost)")
    p.add_argument("--seconds", type=positive_number, default=60.0, help="how long to publish (default 60)")
    p.add_argument("--workers", type=positive_int, default=2, help="worker processes (default 2)")
    p.add_argument("--rate", type=positive_number, default=40.0, help="messages a second")
    p.add_argument("--hard-kills", action="store_true",
                   help="restart workers with SIGKILL only (default: SIGTERM and SIGKILL in turn)")
    p.set_defaults(func=_cmd_soak)
