"""`subs apply|delete|list|get|pause|resume|seek`: the live subscription registry."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from typing import Any

from worker.cli.common import connection_args, seconds
from worker.ops.render import render
from worker.runtime.errors import UsageError
from worker.runtime.fields import parse_moment


def _cmd_subs(args: argparse.Namespace) -> int:
    from worker.ops.admin import Admin, locate

    seek_to = _seek_target(args) if args.action == "seek" else None  # a bad argument fails before connecting
    target = locate(args.config, redis_url=args.redis_url, pulsar_url=getattr(args, "service_url", None))

    async def go() -> int:
        admin = Admin(target, f"subs {args.action}")
        try:
            if args.action == "apply":
                print(render(await admin.apply(args.file), args.json))
            elif args.action == "delete":
                if (args.name is None) == (args.topic is None):
                    raise UsageError("subs delete", "NAME", "give a subscription NAME or --topic TOPIC (not both)")
                print(render(await admin.delete(args.name, args.topic), args.json))
            elif args.action == "list":
                print(render(await admin.list(), args.json))
            elif args.action in ("pause", "resume"):
                print(render(await admin.pause(args.name, args.action == "pause", args.wait), args.json))
            elif args.action == "seek":
                pulsar = dataclasses.replace(target.settings.pulsar, service_url=target.pulsar("subs seek"))
                assert seek_to is not None
                print(render(await admin.seek(args.name, seek_to, pulsar), args.json))
            else:
                print(render(await admin.get(args.name), args.json))
        finally:
            await admin.close()
        return 0

    return asyncio.run(go())


def _seek_target(args: argparse.Namespace) -> Any:
    from worker.fleet.seek import SeekTarget

    if args.to_earliest:
        return SeekTarget("earliest")
    if args.to_latest:
        return SeekTarget("latest")
    try:
        ms = parse_moment(args.to)
    except ValueError as e:
        hint = "; the whole retained backlog: --to-earliest" if str(e).startswith("must not be before") else ""
        raise UsageError("subs seek", "--to", f"{e}{hint}") from None
    return SeekTarget(ms)


def register(cmds: Any) -> None:
    subs = cmds.add_parser("subs", help="the live subscription registry").add_subparsers(dest="action", required=True)
    for action, help_text in (("apply", "create or edit subscriptions from a YAML file"),
                              ("delete", "delete a subscription, or --topic T: every subscription of a deleted topic"),
                              ("list", "subscriptions with owner, state, counters"),
                              ("get", "one subscription's definition and status"),
                              ("pause", "stop delivery for one subscription; its backlog waits in the broker"),
                              ("resume", "restart delivery of a paused subscription"),
                              ("seek", "rewind or fast-forward the subscription's cursor; attempt counts reset")):
        p = subs.add_parser(action, help=help_text)
        if action == "apply":
            p.add_argument("-f", "--file", required=True,
                           help="YAML: one subscription, a list, or {subscriptions: [...]}; - for stdin")
        elif action == "delete":
            p.add_argument("name", nargs="?", help="NAME or PROJECT/NAME")
            p.add_argument("--topic", help="delete every subscription of this topic (the topic was deleted)")
        elif action != "list":
            p.add_argument("name", help="NAME or PROJECT/NAME")
        if action == "pause":
            p.add_argument("--wait", type=seconds, default=60.0,
                           help="seconds to wait for the owner to finish requests under way (default 60)")
        else:
            p.set_defaults(wait=0.0)
        if action == "seek":
            where = p.add_mutually_exclusive_group(required=True)
            where.add_argument("--to", help="RFC 3339 time (2026-11-30T08:00:00Z) or ms since the epoch")
            where.add_argument("--to-earliest", action="store_true", help="the oldest message kept")
            where.add_argument("--to-latest", action="store_true", help="skip everything published so far")
        connection_args(p, broker=action == "seek")
        p.set_defaults(func=_cmd_subs)
