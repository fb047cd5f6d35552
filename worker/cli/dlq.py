"""`dlq list|show|redrive`: dead letters of one subscription."""

from __future__ import annotations

import argparse
import re
from typing import Any

from worker.cli.common import connection_args, moment, positive_int, positive_number, run_loop
from worker.ops.render import render
from worker.runtime.errors import UsageError


def dlq_command(args: argparse.Namespace) -> int:
    from worker.ops import dlq
    from worker.ops.admin import locate

    if args.action == "redrive" and not (args.rate > 0):
        raise UsageError("dlq redrive", "--rate", "must be > 0 messages a second")
    since, until = getattr(args, "since", None), getattr(args, "until", None)
    if since is not None and until is not None and until < since:
        raise UsageError(f"dlq {args.action}", "--until", "must not be before --since")
    target = locate(args.config, redis_url=args.redis_url, pulsar_url=args.service_url)
    options = {"limit": getattr(args, "limit", 1000), "message_id": getattr(args, "message_id", None),
               "rate": getattr(args, "rate", 10.0), "max_messages": getattr(args, "max_messages", None),
               "concurrency": getattr(args, "concurrency", 8), "since": since, "until": until,
               "status": getattr(args, "status", None), "dry_run": getattr(args, "dry_run", False)}
    print(render(run_loop(dlq.run(target, args.action, args.subscription, **options)), args.json))
    return 0


STATUS_RULE = re.compile(r"[1-5]xx|[1-5][0-9][0-9]|[a-z_]{1,40}")


def status(text: str) -> str:
    """A last status to select: a class (5xx), a code (503) or a result (timeout, connection_error)."""
    if not STATUS_RULE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"must be a class like 5xx, a code like 503, or a result like timeout "
                                         f"(got {text!r})")
    return text


def selection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--since", type=moment, help="only those dead-lettered at or after this time (RFC 3339 or ms)")
    p.add_argument("--until", type=moment, help="only those dead-lettered at or before this time")
    p.add_argument("--status", type=status, action="append",
                   help="only those whose last attempt ended so: 4xx, 5xx, 503, timeout, connection_error, ... "
                        "(repeatable)")


def register(cmds: Any) -> None:
    dlq = cmds.add_parser("dlq", help="dead letters of one subscription").add_subparsers(dest="action", required=True)
    p = dlq.add_parser("list", help="dead letters waiting (nothing is moved)")
    p.add_argument("subscription", help="NAME or PROJECT/NAME")
    p.add_argument("--limit", type=positive_int, default=100, help="at most this many (default 100)")
    selection_args(p)
    connection_args(p, broker=True)
    p.set_defaults(func=dlq_command)
    p = dlq.add_parser("show", help="one dead letter: payload, attributes, attempt history")
    p.add_argument("subscription", help="NAME or PROJECT/NAME")
    p.add_argument("message_id", help="the dead letter's id or the original message id")
    p.add_argument("--limit", type=positive_int, default=10000, help="how many dead letters to look through")
    connection_args(p, broker=True)
    p.set_defaults(func=dlq_command)
    p = dlq.add_parser("redrive", help="deliver dead letters to this subscription's endpoint again (resumable)")
    p.add_argument("subscription", help="NAME or PROJECT/NAME")
    p.add_argument("--rate", type=positive_number, default=10.0, help="messages a second (default 10)")
    p.add_argument("--concurrency", type=positive_int, default=8, help="requests at once (default 8)")
    p.add_argument("--max-messages", type=positive_int, default=None, help="stop after this many")
    p.add_argument("--message-id", default=None,
                   help="redrive only this dead letter (its own id or its original id); the others stay")
    selection_args(p)
    p.add_argument("--dry-run", action="store_true", help="count what would be redriven; move nothing")
    connection_args(p, broker=True)
    p.set_defaults(func=dlq_command)
