"""`run`, `check` and `publish`: a worker process, its config, one message."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any, Protocol

import yaml

from worker.cli.common import KEEP_UNTIL_EXIT, run_loop
from worker.model.config import load_settings
from worker.model.subscriptions import TOPIC_RULE, topic_parts
from worker.runtime import collector, logs
from worker.runtime.errors import UsageError


class Draining(Protocol):
    """What Ctrl-C asks of the running worker (`service.Worker`, imported only when a worker runs)."""

    @property
    def stopping(self) -> bool: ...

    def requests_under_way(self) -> int: ...

    def request_stop(self) -> None: ...


async def _serve(config_path: str) -> int:
    from worker.fleet.admission import preflight
    from worker.process.service import Worker

    settings = load_settings(config_path)
    preflight(settings)
    logs.configure(settings.log_format, settings.log_level)
    if empty_config(config_path):
        logs.get().warning(EMPTY_CONFIG.format(config_path))
    worker = Worker(settings, config_path=config_path, own_process=True)
    KEEP_UNTIL_EXIT.append(worker)
    loop = asyncio.get_running_loop()
    # SIGHUP too: a worker whose terminal closed drains and hands over like one told to stop, instead
    # of dying on the spot with its leases held until they lapse.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, worker.request_stop)
    loop.add_signal_handler(signal.SIGINT, _interrupted, worker)
    loop.add_signal_handler(signal.SIGUSR1, _dump_tasks)  # what a stuck worker is waiting on
    async with worker:
        collector.tune_for_serving()
        await worker.run_until_stopped()
        logs.get().info("stop requested; draining", grace_seconds=settings.shutdown_grace_seconds)
    return 0


EMPTY_CONFIG = ("{} is empty: every setting is its default (the embedded broker and Redis, no "
                "subscriptions but the registry's)")


def empty_config(path: str) -> bool:
    """Whether the config file holds no settings at all (an empty or comment-only file is valid, but
    more often a wrong path or an empty mount than a choice)."""
    try:
        return yaml.safe_load(Path(path).read_text()) is None
    except (OSError, yaml.YAMLError):
        return False  # load_settings has said what is wrong with it


def _interrupted(worker: Draining) -> None:
    """Ctrl-C: the first drains (as SIGTERM does) and says how to stop at once; the second stops at
    once. Requests under way are abandoned then: their messages go back to the broker (redelivered,
    attempt counts kept) and the leases lapse after fleet.lease_seconds, as after a crash."""
    in_flight = worker.requests_under_way()
    if not worker.stopping:
        logs.get().warning(f"draining, {in_flight} in flight; press Ctrl-C again to stop now")
        worker.request_stop()
        return
    logs.get().warning(f"stopping now: {in_flight} request(s) under way abandoned; their messages go back "
                       "to the broker")
    os._exit(130)  # 128 + SIGINT, as a shell reports an interrupted program


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
        # A compiled coroutine (worker.runtime.compiled) shows no frames: what its task waits on still names the step.
        waits_on = repr(getattr(task, "_fut_waiter", None))
        logs.get().warning("task", name=task.get_name(), awaits=frames, waits_on=waits_on)


def _cmd_run(args: argparse.Namespace) -> int:
    return run_loop(_serve(args.config))


def _cmd_check(args: argparse.Namespace) -> int:
    from worker.fleet.admission import preflight

    settings = load_settings(args.config)
    preflight(settings)
    print(f"ok: {len(settings.subscriptions)} push subscription(s)")
    for line in settings.deprecated:
        print(f"warning: {line}", file=sys.stderr)
    if empty_config(args.config):
        print("warning: " + EMPTY_CONFIG.format(args.config), file=sys.stderr)
    for i, token in enumerate(settings.admin.tokens if settings.admin is not None else ()):
        if not os.path.exists(token.file):  # read when it changes: a Secret mounted later is taken then
            print(f"warning: admin.tokens[{i}].file: {token.file} does not exist: the API and console refuse "
                  f"{token.subject}'s token until it does", file=sys.stderr)
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
    if args.connect_timeout <= 0:
        raise UsageError("publish", "--connect-timeout", f"must be more than 0 seconds (got {args.connect_timeout:g})")
    message_id = publish(target.settings.pulsar, target.pulsar("publish"), args.topic, args.data.encode(), attrs,
                         args.key, min(10, target.settings.pulsar.operation_timeout_seconds), args.connect_timeout)
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
    p.add_argument("--connect-timeout", type=float, default=3.0, metavar="SECONDS",
                   help="how long the broker may take to accept a connection (default 3)")
    p.add_argument("--service-url", default=None,
                   help="default: $PUSH_WORKER_PULSAR_URL, the config, or a local embedded worker")
    p.add_argument("--config", "-c", help="worker.yaml (for pulsar.service_url)")
    p.set_defaults(func=_cmd_publish)
