"""`run`, `check` and `publish`: a worker process, its config, one message."""

from __future__ import annotations

import argparse
import asyncio
import gc
import signal
from typing import Any

from worker import logs
from worker.cli.common import KEEP_UNTIL_EXIT, run_loop
from worker.config import load_settings
from worker.errors import UsageError
from worker.subscriptions import TOPIC_RULE, topic_parts


async def _serve(config_path: str) -> int:
    from worker.admission import preflight
    from worker.service import Worker

    settings = load_settings(config_path)
    preflight(settings)
    logs.configure(settings.log_format, settings.log_level)
    worker = Worker(settings)
    KEEP_UNTIL_EXIT.append(worker)
    loop = asyncio.get_running_loop()
    # SIGHUP too: a worker whose terminal closed drains and hands over like one told to stop, instead
    # of dying on the spot with its leases held until they lapse.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, worker.request_stop)
    loop.add_signal_handler(signal.SIGUSR1, _dump_tasks)  # what a stuck worker is waiting on
    async with worker:
        _tune_gc()
        await worker.run_until_stopped()
        logs.get().info("stop requested; draining", grace_seconds=settings.shutdown_grace_seconds)
    return 0


# Young objects collected per this many new ones (CPython's default is 700): a delivery allocates
# dozens of short-lived objects, and the collector's passes cost about a fifth of a delivery's CPU
# at the default (measured A/B in `make bench`).
GC_THRESHOLD = (20_000, 50, 100)


def _tune_gc() -> None:
    """Once started: what exists now (modules, config, clients) lives as long as the process, so the
    collector stops rescanning it (gc.freeze), and young collections run less often."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)


def _dump_tasks() -> None:
    """SIGUSR1: log every task of the event loop with where it waits (for a worker that hangs)."""
    for task in asyncio.all_tasks():
        frames: list[str] = []
        awaited: Any = task.get_coro()
        while awaited is not None and len(frames) < 20:  # the await chain, outermost first
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
            if frame is None:
                frames.append(type(awaited).__name__)
                break
            frames.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno} {frame.f_code.co_name}")
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
        # A compiled coroutine (worker.compiled) shows no frames: what its task waits on still names the step.
        waits_on = repr(getattr(task, "_fut_waiter", None))
        logs.get().warning("task", name=task.get_name(), awaits=frames, waits_on=waits_on)


def _cmd_run(args: argparse.Namespace) -> int:
    return run_loop(_serve(args.config))


def _cmd_check(args: argparse.Namespace) -> int:
    from worker.admission import preflight

    settings = load_settings(args.config)
    preflight(settings)
    print(f"ok: {len(settings.subscriptions)} push subscription(s)")
    return 0


def _cmd_publish(args: argparse.Namespace) -> int:
    from worker.ops.admin import locate
    from worker.ops.publish import publish

    attrs = {}
    for item in args.attr or []:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise UsageError("publish", "--attr", f"must be NAME=VALUE (got {item!r})")
        attrs[name] = value
    try:
        topic_parts(args.topic)
    except ValueError:
        raise UsageError("publish", "TOPIC", f"{TOPIC_RULE} (got {args.topic!r})") from None
    target = locate(args.config, pulsar_url=args.service_url)
    message_id = publish(target.settings.pulsar, target.pulsar("publish"), args.topic, args.data.encode(), attrs,
                         args.key, min(10, target.settings.pulsar.operation_timeout_seconds))
    print(message_id)
    return 0


def register(cmds: Any) -> None:
    p = cmds.add_parser("run", help="run a worker")
    p.add_argument("--config", "-c", required=True, help="worker.yaml")
    p.set_defaults(func=_cmd_run)

    p = cmds.add_parser("check", help="validate a config file and exit")
    p.add_argument("--config", "-c", required=True, help="the worker.yaml to validate")
    p.set_defaults(func=_cmd_check)
    p = cmds.add_parser("publish", help="publish one message (for trying things out)")
    p.add_argument("topic", help="persistent://TENANT/NAMESPACE/TOPIC")
    p.add_argument("data", help="the payload (UTF-8 text)")
    p.add_argument("--attr", action="append", metavar="K=V", help="an attribute (repeatable)")
    p.add_argument("--key", help="the ordering key")
    p.add_argument("--service-url", default=None,
                   help="default: $PUSH_WORKER_PULSAR_URL, the config, or a local embedded worker")
    p.add_argument("--config", "-c", help="worker.yaml (for pulsar.service_url)")
    p.set_defaults(func=_cmd_publish)
