"""`layout`, `layout upgrade`: the Redis layout the fleet's records follow, and the switch to 2."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from worker.cli.common import connection_args, seconds
from worker.ops.render import Output, render
from worker.runtime.errors import UsageError


def _cmd_layout(args: argparse.Namespace) -> int:
    from worker.ops import layout_switch
    from worker.ops.admin import Admin, locate

    upgrading = args.action == "upgrade"
    if upgrading and not args.yes:
        if not sys.stdin.isatty():
            raise UsageError("layout upgrade", "--yes", "is required when not on a terminal (releases before "
                             "1.2.0 cannot run on layout 2: no rollback to them after it)")
        answer = input("After the switch, releases before 1.2.0 refuse to start: no rollback to them. "
                       "Type 'layout 2' to switch: ")
        if answer.strip() != "layout 2":
            print("not switched")
            return 1
    target = locate(args.config, redis_url=args.redis_url)
    ttl = target.settings.redis.attempts_ttl_seconds

    async def go() -> Output:
        admin = Admin(target, "layout")
        try:
            if upgrading:
                return await layout_switch.upgrade(admin.client, target.fleet, ttl, args.wait)
            return await layout_switch.status(admin.client, target.fleet, ttl)
        finally:
            await admin.close()

    print(render(asyncio.run(go()), args.json))
    return 0


def register(cmds: Any) -> None:
    p = cmds.add_parser("layout", help="the Redis layout the fleet's records follow; `layout upgrade` switches to 2")
    p.add_argument("action", nargs="?", choices=["show", "upgrade"], default="show",
                   help="show (the default): the layout and what each worker reads; upgrade: switch to layout 2 "
                        "once every worker of the fleet reads it")
    p.add_argument("--yes", action="store_true", help="switch without asking (upgrade)")
    p.add_argument("--wait", type=seconds, default=15.0, help="how long each step waits for the workers (s)")
    connection_args(p)
    p.set_defaults(func=_cmd_layout)
