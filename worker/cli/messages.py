"""`show`, `queue`, `history`, `discard`, `purge`: one subscription's messages."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from typing import Any

from worker.cli import dlq
from worker.cli.common import connection_args, positive_int, seconds
from worker.ops.render import Output, render
from worker.runtime.errors import UsageError


def _cmd_messages(args: argparse.Namespace) -> int:
    """queue, history, discard, purge."""
    from worker.ops.admin import Admin, locate

    if args.command == "discard":
        _named(args)
    if args.command == "queue" and args.state == "dead":
        args.action, args.limit = "list", args.limit
        return dlq.dlq_command(args)
    if args.command == "purge" and not args.yes:
        if not sys.stdin.isatty():
            raise UsageError("purge", "--yes", "is required when not on a terminal (it skips the whole backlog)")
        answer = input(f"Skip the whole backlog of {args.subscription}? Type its name to confirm: ")
        if answer.strip() != args.subscription:
            print("not purged")
            return 1
    target = locate(args.config, redis_url=args.redis_url, pulsar_url=getattr(args, "service_url", None))

    async def go() -> Output:
        admin = Admin(target, args.command)
        try:
            if args.command == "queue":
                return await admin.queue(args.subscription, args.state, args.limit)
            if args.command == "history":
                return await admin.history(args.subscription, args.limit)
            if args.command == "discard":
                return await admin.discard(args.message_id, args.subscription, args.wait)
            pulsar = dataclasses.replace(target.settings.pulsar, service_url=target.pulsar("purge"))
            return await admin.purge(args.subscription, pulsar)
        finally:
            await admin.close()

    print(render(asyncio.run(go()), args.json))
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from worker.ops.admin import Admin, locate

    _named(args)
    target = locate(args.config, redis_url=args.redis_url)

    async def go() -> int:
        admin = Admin(target, "show")
        try:
            print(render(await admin.show(args.message_id, args.subscription), args.json))
        finally:
            await admin.close()
        return 0

    return asyncio.run(go())


DEPRECATED_ORDER_SINCE, DEPRECATED_ORDER_REMOVED = "1.2.0", "2.0.0"


def subscription_then_message(p: argparse.ArgumentParser) -> None:
    """SUBSCRIPTION MESSAGE_ID, as every command that names a message takes them (`dlq show` too); the
    order before 1.2.0, MESSAGE_ID --subscription NAME, still works, with a deprecation warning."""
    p.add_argument("first", metavar="SUBSCRIPTION", help="NAME or PROJECT/NAME")
    p.add_argument("second", metavar="MESSAGE_ID", nargs="?",
                   help="as in Pubsub-Message-Id: ledger:entry:partition:batch")
    p.add_argument("--subscription", "-s", help=argparse.SUPPRESS)


def _named(args: argparse.Namespace) -> None:
    """args.subscription and args.message_id from either order (the old one warned of, once)."""
    if args.second is not None and args.subscription is None:
        args.subscription, args.message_id = args.first, args.second
        return
    if args.second is None and args.subscription is not None:
        args.message_id = args.first
        sys.stderr.write(f"warning: `{args.command} MESSAGE_ID --subscription NAME` is deprecated since "
                         f"{DEPRECATED_ORDER_SINCE} and is removed in {DEPRECATED_ORDER_REMOVED}: use "
                         f"`{args.command} NAME MESSAGE_ID`\n")
        return
    raise UsageError(args.command, "arguments", "are SUBSCRIPTION MESSAGE_ID (e.g. orders 1:2:-1:-1)")


def register(cmds: Any) -> None:
    p = cmds.add_parser("show", help="a message's delivery attempts in one subscription")
    subscription_then_message(p)
    connection_args(p)
    p.set_defaults(func=_cmd_show)

    p = cmds.add_parser("queue", help="a subscription's messages by state: inflight, retrying or dead")
    p.add_argument("subscription", help="NAME or PROJECT/NAME")
    p.add_argument("--state", choices=("inflight", "retrying", "dead"), required=True,
                   help="inflight: first attempt under way; retrying: failed at least once; dead: dead letters")
    p.add_argument("--limit", type=positive_int, default=100, help="at most this many (default 100)")
    connection_args(p, broker=True)
    p.set_defaults(func=_cmd_messages)

    p = cmds.add_parser("history", help="a subscription's recently settled messages and how each ended")
    p.add_argument("subscription", help="NAME or PROJECT/NAME")
    p.add_argument("--limit", type=positive_int, default=50, help="the newest this many (default 50)")
    connection_args(p)
    p.set_defaults(func=_cmd_messages)

    p = cmds.add_parser("discard", help="settle one message without delivering it (recorded in its history)")
    subscription_then_message(p)
    p.add_argument("--wait", type=seconds, default=10.0, help="seconds to wait for a worker to settle it")
    connection_args(p)
    p.set_defaults(func=_cmd_messages)

    p = cmds.add_parser("purge", help="skip a subscription's whole backlog (asks for confirmation)")
    p.add_argument("subscription", help="NAME or PROJECT/NAME")
    p.add_argument("--yes", action="store_true", help="do not ask")
    connection_args(p, broker=True)
    p.set_defaults(func=_cmd_messages)
