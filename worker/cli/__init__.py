"""`push-worker` command line: run a worker, check its config, publish, and the operator commands.

Exit codes: 0 ok, 1 runtime failure, 2 bad configuration or usage, 3 not found (each with a one-line
reason, no traceback).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from worker.cli import dlq, messages, subs
from worker.cli import worker as worker_commands
from worker.cli.common import Parser
from worker.errors import ConfigError, ConfigErrors, NotFound, PushWorkerError, UsageError, strip_userinfo
from worker.ops.render import inert

EXAMPLES = """examples:
  push-worker check --config worker.yaml           validate a worker's configuration
  push-worker run --config worker.yaml             serve its subscriptions and the registry's
  push-worker subs list --config worker.yaml       every subscription, its state and counters
  push-worker show MESSAGE_ID -s NAME              one message's attempts
  push-worker dlq list NAME --since 1h             dead letters of the last hour
  push-worker COMMAND --help                       a command's options

docs: README.md and docs/ in the source (docs/commands.md: every command; docs/guarantees.md: what
the fleet promises; docs/configuration.md: every setting)"""


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import version

    parser = Parser(prog="push-worker", description=__doc__.splitlines()[0] if __doc__ else None,
                    epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"push-worker {version('push-worker')}")
    cmds = parser.add_subparsers(dest="command", required=True)
    for group in (worker_commands, subs, messages, dlq):
        group.register(cmds)
    return parser


def _exit_now(code: int) -> None:
    """Leave without running C++ static destructors: the Pulsar client library can abort in them
    (`terminate called without an active exception`) although every client was closed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser(), argv)


def run(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    """Parse and run one command (also the development tools': `python -m devtools`)."""
    args = parser.parse_args(argv)
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
        try:
            code, line = explain(e)
        except Exception as while_explaining:  # a bug in the explaining must not cost the one line
            code, line = 1, f"unexpected error: {type(e).__name__}: {e} (and {while_explaining!r} explaining it)"
        if os.environ.get("PUSH_WORKER_DEBUG"):
            import traceback

            traceback.print_exc()
        # Several broken rules of one configuration (`check`): a line each.
        lines = [explain(one)[1] for one in e.errors] if isinstance(e, ConfigErrors) else [line]
        # One write: never split by another thread's log line.
        sys.stderr.write("".join(f"push-worker: {inert(strip_userinfo(text))}\n" for text in lines))
        return code


# A Redis that works but will not do what was asked, and what to do about it: its error code (as
# it comes back from inside a script) or redis-py's class for it (which drops the code).
_REDIS_REFUSALS = (
    ("OOM ", "OutOfMemoryError", "it is full (maxmemory reached, policy noeviction): give it memory or lower the TTLs"),
    ("READONLY ", "ReadOnlyError",
     "it is a read-only replica: point the Redis URL at the master (or use redis.mode sentinel)"),
    ("NOPERM ", "NoPermissionError", "its ACL user may not run it"),
    ("LOADING ", "BusyLoadingError", "it is still loading its data: try again shortly"),
    ("MISCONF ", "", "it cannot save to disk and refuses writes: check its disk and logs"),
)


# What a broker's refusal usually means for an operator command.
_BROKER_REFUSALS = {
    "TopicNotFound": " (the topic, or its tenant or namespace, does not exist: Apache Pulsar creates none of "
                     "them on first use)",
    "AuthenticationError": " (check the token: $PUSH_WORKER_PULSAR_TOKEN)",
    "AuthorizationError": " (the token's role lacks a permission on the namespace)",
}


def explain(error: BaseException) -> tuple[int, str]:
    """The exit code and the one line an operator sees for `error`: what failed and what to check."""
    import pulsar
    import pulsar.asyncio as pulsar_async
    from redis import exceptions as redis_errors

    text = " ".join(str(error).split())[:300] or type(error).__name__
    if isinstance(error, UsageError):
        return 2, f"invalid argument: {text}"
    if isinstance(error, ConfigError):
        return 2, f"invalid configuration: {text}"
    if isinstance(error, NotFound):
        return 3, text
    if isinstance(error, PushWorkerError):
        return 1, text
    if isinstance(error, redis_errors.AuthenticationError) or "WRONGPASS" in text or "NOAUTH" in text:
        return 1, f"redis refused the credentials ({text}); check the password in the Redis URL"
    if isinstance(error, (redis_errors.ConnectionError, redis_errors.TimeoutError, redis_errors.RedisClusterException)):
        from worker.redis_client import describe

        return 1, (f"redis unreachable ({describe(error)[:300]}); check --redis-url, redis.url or "
                   "$PUSH_WORKER_REDIS_URL (or redis.nodes / redis.sentinels), and that Redis is running")
    if isinstance(error, redis_errors.RedisError):
        refused = next((why for code, kind, why in _REDIS_REFUSALS
                        if code in text or type(error).__name__ == kind), None)
        if refused:
            return 1, f"redis refused the command: {refused} ({text})"
        return 1, f"redis answered with an error ({text}); its data may be damaged"
    if isinstance(error, (pulsar.PulsarException, pulsar_async.PulsarException)):
        from worker.consumer import answered_by_broker, broker_error_text, broker_result, result_name

        if answered_by_broker(error):  # it is there and said no: its URL is not what to check
            name = result_name(broker_result(error))
            return 1, f"the broker refused: {name}" + _BROKER_REFUSALS.get(name, "")
        # A broker that authenticates drops a connection without a valid token unanswered: the
        # client sees the same timeout as from a dead broker (measured on Apache Pulsar).
        return 1, (f"the broker failed: {broker_error_text(error)}; check --service-url, pulsar.service_url or "
                   "$PUSH_WORKER_PULSAR_URL, that the broker is running, and $PUSH_WORKER_PULSAR_TOKEN if it "
                   "authenticates clients")
    if isinstance(error, OSError):
        return 1, f"{text}"
    return 1, f"unexpected error: {type(error).__name__}: {text} (a bug: PUSH_WORKER_DEBUG=1 shows where)"


if __name__ == "__main__":
    sys.exit(main())
