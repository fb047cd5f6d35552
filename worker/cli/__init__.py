"""`push-worker` command line: run a worker, the demo, the benchmark, and small operator helpers.

Exit codes: 0 ok, 1 runtime failure, 2 bad configuration or usage, 3 not found (each with a one-line
reason, no traceback).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Coroutine, Sequence
from datetime import datetime
from typing import Any, TypeVar

from worker import logs
from worker.config import load_settings
from worker.errors import ConfigError, NotFound, PushWorkerError
from worker.ops.render import Output, render


def _run_loop(main: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop

        return uvloop.run(main)
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(main)


T = TypeVar("T")

# Objects holding Pulsar clients stay referenced until the process exits through os._exit: their
# C++ destructors can block at interpreter teardown.
_KEEP_UNTIL_EXIT: list[object] = []


async def _serve(config_path: str) -> int:
    from worker.service import Worker, preflight

    settings = load_settings(config_path)
    preflight(settings)
    logs.configure(settings.log_format, settings.log_level)
    worker = Worker(settings)
    _KEEP_UNTIL_EXIT.append(worker)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.request_stop)
    loop.add_signal_handler(signal.SIGUSR1, _dump_tasks)  # what a stuck worker is waiting on
    async with worker:
        await worker.run_until_stopped()
        logs.get().info("stop requested; draining", grace_seconds=settings.shutdown_grace_seconds)
    return 0


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
        logs.get().warning("task", name=task.get_name(), awaits=frames)


def _cmd_run(args: argparse.Namespace) -> int:
    return _run_loop(_serve(args.config))


def _cmd_check(args: argparse.Namespace) -> int:
    from worker.service import preflight

    settings = load_settings(args.config)
    preflight(settings)
    print(f"ok: {len(settings.subscriptions)} push subscription(s)")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from worker.devtools.demo import run_demo

    return _run_loop(run_demo(messages=args.messages))


def _cmd_publish(args: argparse.Namespace) -> int:
    from worker.ops.admin import locate
    from worker.ops.publish import publish

    attrs = {}
    for item in args.attr or []:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ConfigError("publish", "--attr", f"must be NAME=VALUE (got {item!r})")
        attrs[name] = value
    target = locate(args.config, pulsar_url=args.service_url)
    message_id = publish(target.pulsar("publish"), args.topic, args.data.encode(), attrs, args.key,
                         min(10, target.settings.pulsar.operation_timeout_seconds))
    print(message_id)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from worker.devtools.bench import run_bench

    return _run_loop(run_bench(messages=args.messages, concurrency=args.concurrency))


def _cmd_subs(args: argparse.Namespace) -> int:
    from worker.ops.admin import Admin, locate

    target = locate(args.config, redis_url=args.redis_url, pulsar_url=getattr(args, "service_url", None))

    async def go() -> int:
        admin = Admin(target)
        try:
            if args.action == "apply":
                print(render(await admin.apply(args.file), args.json))
            elif args.action == "delete":
                if (args.name is None) == (args.topic is None):
                    raise ConfigError("subs delete", "NAME", "give a subscription NAME or --topic TOPIC (not both)")
                print(render(await admin.delete(args.name, args.topic), args.json))
            elif args.action == "list":
                print(render(await admin.list(), args.json))
            elif args.action in ("pause", "resume"):
                print(render(await admin.pause(args.name, args.action == "pause", args.wait), args.json))
            elif args.action == "seek":
                pulsar = dataclasses.replace(target.settings.pulsar, service_url=target.pulsar("subs seek"))
                print(render(await admin.seek(args.name, _seek_target(args), pulsar), args.json))
            else:
                print(render(await admin.get(args.name), args.json))
        finally:
            await admin.close()
        return 0

    return asyncio.run(go())


def _seek_target(args: argparse.Namespace) -> Any:
    from worker.fleet.lifecycle import SeekTarget

    if args.to_earliest:
        return SeekTarget("earliest")
    if args.to_latest:
        return SeekTarget("latest")
    value = args.to
    if value.isdigit():
        return SeekTarget(int(value))
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ConfigError("subs seek", "--to", f"must be an RFC 3339 time or ms since the epoch (got {value!r})") \
            from None
    if when.tzinfo is None:
        raise ConfigError("subs seek", "--to", "must carry a time zone, e.g. 2026-11-30T08:00:00Z")
    return SeekTarget(int(when.timestamp() * 1000))


def _cmd_messages(args: argparse.Namespace) -> int:
    """queue, history, discard, purge."""
    from worker.ops.admin import Admin, locate

    if args.command == "queue" and args.state == "dead":
        args.action, args.limit = "list", args.limit
        return _cmd_dlq(args)
    if args.command == "purge" and not args.yes:
        if not sys.stdin.isatty():
            raise ConfigError("purge", "--yes", "is required when not on a terminal (it skips the whole backlog)")
        answer = input(f"Skip the whole backlog of {args.subscription}? Type its name to confirm: ")
        if answer.strip() != args.subscription:
            print("not purged")
            return 1
    target = locate(args.config, redis_url=args.redis_url, pulsar_url=getattr(args, "service_url", None))

    async def go() -> Output:
        admin = Admin(target)
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

    target = locate(args.config, redis_url=args.redis_url)

    async def go() -> int:
        admin = Admin(target)
        try:
            print(render(await admin.show(args.message_id, args.subscription), args.json))
        finally:
            await admin.close()
        return 0

    return asyncio.run(go())


def _cmd_dlq(args: argparse.Namespace) -> int:
    from worker.ops import dlq
    from worker.ops.admin import locate

    if args.action == "redrive" and not (args.rate > 0):
        raise ConfigError("dlq redrive", "--rate", "must be > 0 messages a second")
    target = locate(args.config, redis_url=args.redis_url, pulsar_url=args.service_url)
    options = {"limit": getattr(args, "limit", 1000), "message_id": getattr(args, "message_id", None),
               "rate": getattr(args, "rate", 10.0), "max_messages": getattr(args, "max_messages", None),
               "concurrency": getattr(args, "concurrency", 8)}
    print(render(_run_loop(dlq.run(target, args.action, args.subscription, **options)), args.json))
    return 0


def _connection_args(p: argparse.ArgumentParser, broker: bool = False) -> None:
    p.add_argument("--config", "-c", help="worker.yaml (for redis.url, pulsar.service_url, fleet.name, "
                   "and the subscriptions it defines)")
    p.add_argument("--redis-url", help="default: $PUSH_WORKER_REDIS_URL, the config, or a local embedded worker")
    if broker:
        p.add_argument("--service-url", help="default: $PUSH_WORKER_PULSAR_URL, the config, or a local embedded worker")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _cmd_soak(args: argparse.Namespace) -> int:
    from worker.devtools.soak import run_soak

    return _run_loop(run_soak(args.seconds, args.workers, args.rate, args.hard_kills))


def _cmd_bench_fleet(args: argparse.Namespace) -> int:
    from worker.devtools.fleet_bench import run

    return _run_loop(run(args.subscriptions, args.workers, args.lease_seconds))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="push-worker", description=__doc__.splitlines()[0] if __doc__ else None)
    cmds = parser.add_subparsers(dest="command", required=True)

    p = cmds.add_parser("run", help="run a worker")
    p.add_argument("--config", "-c", required=True, help="worker.yaml")
    p.set_defaults(func=_cmd_run)

    p = cmds.add_parser("check", help="validate a config file and exit")
    p.add_argument("--config", "-c", required=True)
    p.set_defaults(func=_cmd_check)

    p = cmds.add_parser("demo", help="embedded broker, Redis and a flaky endpoint: watch delivery live")
    p.add_argument("--messages", type=int, default=300)
    p.set_defaults(func=_cmd_demo)

    p = cmds.add_parser("bench", help="measure delivery throughput against a bare aiohttp loop")
    p.add_argument("--messages", type=int, default=20000)
    p.add_argument("--concurrency", type=int, default=64)
    p.set_defaults(func=_cmd_bench)

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
            p.add_argument("--wait", type=float, default=60.0,
                           help="seconds to wait for the owner to finish requests under way (default 60)")
        else:
            p.set_defaults(wait=0.0)
        if action == "seek":
            where = p.add_mutually_exclusive_group(required=True)
            where.add_argument("--to", help="RFC 3339 time (2026-11-30T08:00:00Z) or ms since the epoch")
            where.add_argument("--to-earliest", action="store_true", help="the oldest message kept")
            where.add_argument("--to-latest", action="store_true", help="skip everything published so far")
        _connection_args(p, broker=action == "seek")
        p.set_defaults(func=_cmd_subs)

    p = cmds.add_parser("show", help="a message's delivery attempts in one subscription")
    p.add_argument("message_id", help="as in Pubsub-Message-Id: ledger:entry:partition:batch")
    p.add_argument("--subscription", "-s", required=True, help="NAME or PROJECT/NAME")
    _connection_args(p)
    p.set_defaults(func=_cmd_show)

    p = cmds.add_parser("queue", help="a subscription's messages by state: inflight, retrying or dead")
    p.add_argument("subscription", help="NAME or PROJECT/NAME")
    p.add_argument("--state", choices=("inflight", "retrying", "dead"), required=True)
    p.add_argument("--limit", type=int, default=100)
    _connection_args(p, broker=True)
    p.set_defaults(func=_cmd_messages)

    p = cmds.add_parser("history", help="a subscription's recently settled messages and how each ended")
    p.add_argument("subscription", help="NAME or PROJECT/NAME")
    p.add_argument("--limit", type=int, default=50)
    _connection_args(p)
    p.set_defaults(func=_cmd_messages)

    p = cmds.add_parser("discard", help="settle one message without delivering it (recorded in its history)")
    p.add_argument("message_id")
    p.add_argument("--subscription", "-s", required=True, help="NAME or PROJECT/NAME")
    p.add_argument("--wait", type=float, default=10.0, help="seconds to wait for a worker to settle it")
    _connection_args(p)
    p.set_defaults(func=_cmd_messages)

    p = cmds.add_parser("purge", help="skip a subscription's whole backlog (asks for confirmation)")
    p.add_argument("subscription", help="NAME or PROJECT/NAME")
    p.add_argument("--yes", action="store_true", help="do not ask")
    _connection_args(p, broker=True)
    p.set_defaults(func=_cmd_messages)

    dlq = cmds.add_parser("dlq", help="dead letters of one subscription").add_subparsers(dest="action", required=True)
    p = dlq.add_parser("list", help="dead letters waiting (nothing is moved)")
    p.add_argument("subscription", help="NAME or PROJECT/NAME")
    p.add_argument("--limit", type=int, default=100)
    _connection_args(p, broker=True)
    p.set_defaults(func=_cmd_dlq)
    p = dlq.add_parser("show", help="one dead letter: payload, attributes, attempt history")
    p.add_argument("subscription", help="NAME or PROJECT/NAME")
    p.add_argument("message_id", help="the dead letter's id or the original message id")
    p.add_argument("--limit", type=int, default=10000, help="how many dead letters to look through")
    _connection_args(p, broker=True)
    p.set_defaults(func=_cmd_dlq)
    p = dlq.add_parser("redrive", help="deliver dead letters to this subscription's endpoint again (resumable)")
    p.add_argument("subscription", help="NAME or PROJECT/NAME")
    p.add_argument("--rate", type=float, default=10.0, help="messages a second (default 10)")
    p.add_argument("--concurrency", type=int, default=8, help="requests at once (default 8)")
    p.add_argument("--max-messages", type=int, default=None, help="stop after this many")
    _connection_args(p, broker=True)
    p.set_defaults(func=_cmd_dlq)

    p = cmds.add_parser("bench-fleet", help="ownership convergence after a kill, movement on a join")
    p.add_argument("--subscriptions", type=int, default=60)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--lease-seconds", type=float, default=5.0)
    p.set_defaults(func=_cmd_bench_fleet)

    p = cmds.add_parser("soak", help="a bounded run under mixed failures; reports delivered, duplicated, "
                        "dead-lettered and lost (exit 1 if any was lost)")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rate", type=float, default=40.0, help="messages a second")
    p.add_argument("--hard-kills", action="store_true",
                   help="restart workers with SIGKILL only (default: SIGTERM and SIGKILL in turn)")
    p.set_defaults(func=_cmd_soak)

    p = cmds.add_parser("publish", help="publish one message (for trying things out)")
    p.add_argument("topic")
    p.add_argument("data")
    p.add_argument("--attr", action="append", metavar="K=V")
    p.add_argument("--key")
    p.add_argument("--service-url", default=None,
                   help="default: $PUSH_WORKER_PULSAR_URL, the config, or a local embedded worker")
    p.add_argument("--config", "-c", help="worker.yaml (for pulsar.service_url)")
    p.set_defaults(func=_cmd_publish)
    return parser


def _exit_now(code: int) -> None:
    """Leave without running C++ static destructors: the Pulsar client library can abort in them
    (`terminate called without an active exception`) although every client was closed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code = _dispatch(args)
    if argv is None:  # a real process, not a call from tests
        _exit_now(code)
    return code


def _dispatch(args: argparse.Namespace) -> int:
    """Run the command; every failure ends in one line on stderr and its exit code, never a traceback
    (PUSH_WORKER_DEBUG=1 adds the traceback for a bug report)."""
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        code, line = explain(e)
        if os.environ.get("PUSH_WORKER_DEBUG"):
            import traceback

            traceback.print_exc()
        print(f"push-worker: {line}", file=sys.stderr)
        return code


def explain(error: BaseException) -> tuple[int, str]:
    """The exit code and the one line an operator sees for `error`: what failed and what to check."""
    import pulsar
    import pulsar.asyncio as pulsar_async
    from redis import exceptions as redis_errors

    text = " ".join(str(error).split())[:300] or type(error).__name__
    if isinstance(error, ConfigError):
        return 2, f"invalid configuration: {text}"
    if isinstance(error, NotFound):
        return 3, text
    if isinstance(error, PushWorkerError):
        return 1, text
    if isinstance(error, redis_errors.AuthenticationError) or "WRONGPASS" in text or "NOAUTH" in text:
        return 1, f"redis refused the credentials ({text}); check the password in the Redis URL"
    if isinstance(error, (redis_errors.ConnectionError, redis_errors.TimeoutError)):
        return 1, (f"redis unreachable ({text}); check --redis-url, redis.url or $PUSH_WORKER_REDIS_URL, "
                   "and that Redis is running")
    if isinstance(error, redis_errors.RedisError):
        return 1, f"redis answered with an error ({text}); its data may be damaged"
    if isinstance(error, (pulsar.PulsarException, pulsar_async.PulsarException)):
        return 1, (f"the broker failed ({text}); check --service-url, pulsar.service_url or "
                   "$PUSH_WORKER_PULSAR_URL, and that the broker is running")
    if isinstance(error, OSError):
        return 1, f"{text}"
    return 1, f"unexpected error: {type(error).__name__}: {text} (a bug: PUSH_WORKER_DEBUG=1 shows where)"


if __name__ == "__main__":
    sys.exit(main())
