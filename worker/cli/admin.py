"""`admin`: the operator API and console, in a process of their own (worker/api/process.py)."""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import Any

from worker.cli.common import KEEP_UNTIL_EXIT, run_loop
from worker.model.config import load_settings
from worker.runtime import logs


async def _serve(config_path: str) -> int:
    from worker.api.process import AdminProcess
    from worker.ops.admin import locate

    settings = load_settings(config_path)
    logs.configure(settings.log_format, settings.log_level)
    target = locate(config_path)  # the config's connections, or a running embedded worker's
    process = AdminProcess(settings, target.redis_url or "", target.pulsar("admin"))
    KEEP_UNTIL_EXIT.append(process)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        loop.add_signal_handler(sig, process.request_stop)
    await process.start()
    try:
        await process.run_until_stopped()
    finally:
        await process.close()
    return 0


def _cmd_admin(args: argparse.Namespace) -> int:
    return run_loop(_serve(args.config))


def register(cmds: Any) -> None:
    p = cmds.add_parser("admin", help="serve the operator API and console (the config's admin: section)")
    p.add_argument("--config", "-c", required=True, help="the worker.yaml with an admin: section")
    p.set_defaults(func=_cmd_admin)
