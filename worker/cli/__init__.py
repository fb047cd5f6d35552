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

from worker.cli import admin, dlq, layout, messages, subs
from worker.cli import worker as worker_commands
from worker.cli.common import Parser
from worker.ops.explain import explain
from worker.ops.render import inert
from worker.runtime import release
from worker.runtime.errors import ConfigErrors, strip_userinfo

EXAMPLES = """examples:
  push-worker check --config worker.yaml           validate a worker's configuration
  push-worker run --config worker.yaml             serve its subscriptions and the registry's
  push-worker subs list --config worker.yaml       every subscription, its state and counters
  push-worker show NAME MESSAGE_ID                 one message's attempts
  push-worker dlq list NAME --since 1h             dead letters of the last hour
  push-worker COMMAND --help                       a command's options

docs: README.md and docs/ in the source (docs/commands.md: every command; docs/guarantees.md: what
the fleet promises; docs/configuration.md: every setting)"""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="push-worker", description=__doc__.splitlines()[0] if __doc__ else None,
                    epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"push-worker {release.describe()}")
    cmds = parser.add_subparsers(dest="command", required=True)
    for group in (worker_commands, admin, subs, messages, dlq, layout):
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


if __name__ == "__main__":
    sys.exit(main())
