"""The command line's contract as a user meets it: --version, help for every option, usage errors
in one line with exit code 2 (said as arguments, not configuration), topics that must be
persistent, and a config that must be a mapping."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

import pytest
import yaml

from devtools.cli import build_parser as build_devtools_parser
from tests.support.helpers import env, run_cli
from worker.cli import build_parser

pytestmark = pytest.mark.broker_independent


def test_version():
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.startswith("push-worker ")


def test_the_help_shows_examples_and_where_the_docs_are():
    result = run_cli("--help")
    assert result.returncode == 0
    assert "examples:" in result.stdout and "push-worker run --config worker.yaml" in result.stdout
    assert "docs/commands.md" in result.stdout and "docs/guarantees.md" in result.stdout


def test_times_before_now_are_taken_everywhere_a_time_is():
    """`--since 1h` (the CLI) and `?since=30m` (the API) read the same: that long before now."""
    import time

    from worker.runtime.fields import parse_moment

    now = time.time() * 1000
    for text, seconds in (("90s", 90), ("30m", 1800), ("1h", 3600), ("2d", 172_800), ("1.5h", 5400)):
        assert abs(now - seconds * 1000 - parse_moment(text)) < 5000, text
    assert parse_moment("100000d") == 0  # before the epoch: the epoch
    assert parse_moment("2026-12-05T08:00:00Z") == 1_796_457_600_000


def test_every_option_of_every_command_has_help():
    def parsers(p: argparse.ArgumentParser, path: str):
        yield path, p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from parsers(sub, f"{path} {name}")

    every = [*parsers(build_parser(), "push-worker"), *parsers(build_devtools_parser(), "python -m devtools")]
    missing = [f"{path} {'/'.join(a.option_strings) or a.dest}" for path, p in every
               for a in p._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
               and not a.help]
    assert missing == []


def test_the_development_tools_are_not_push_worker_commands_and_say_usage_errors_alike():
    result = run_cli("demo")
    assert result.returncode == 2 and "invalid choice" in result.stderr
    # an infinite number was taken: a soak that never ends
    result = run_cli("soak", "--seconds", "inf", module="devtools")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("push-worker: invalid argument: ") and "--seconds: must be a finite number" in lines[0]


@pytest.mark.parametrize(("args", "says"), [
    (["history", "orders", "--limit", "-5"], "--limit: must be at least 1"),
    (["subs", "seek", "orders", "--to", "yesterday", "--redis-url", "redis://127.0.0.1:9"],
     "--to: must be an RFC 3339"),
    (["subs", "seek", "orders", "--to", "\u00b2", "--redis-url", "redis://127.0.0.1:9"],  # isdigit() takes it
     "--to: must be an RFC 3339"),
    (["subs", "seek", "orders", "--to", "0001-01-01T00:00:00Z", "--redis-url", "redis://127.0.0.1:9"],
     "--to: must not be before 1970-01-01T00:00:00Z"),  # it reached the worker, whose client refused it
    (["publish", "orders", "x"], "must be a full topic name like persistent://"),
    (["purge", "orders"], "--yes: is required when not on a terminal"),
    (["dlq", "redrive", "orders", "--rate", "0"], "--rate: must be above 0"),
    (["no-such-command"], "invalid choice"),
    # a negative wait went through to Redis; a broken URL given as an argument was said as configuration
    (["discard", "orders", "1:2:-1:-1", "--wait", "-5"], "--wait: must be 0 or more seconds"),
    (["subs", "pause", "orders", "--wait", "nan"], "--wait: must be a finite number"),
    # an infinite number was taken: a soak that never ends, a redrive without pacing
    (["dlq", "redrive", "orders", "--rate", "inf"], "--rate: must be a finite number"),
    (["subs", "list", "--redis-url", "http://redis"], "subs list: --redis-url: must be a URL with scheme redis"),
    (["publish", "persistent://p-x/main/t", "x", "--service-url", "garbage"], "--service-url: must be a URL"),
    # an option no command has was hidden behind the required one it kept out, or taken for the one it abbreviates
    (["run", "--cfg", "worker.yaml"], "no such option --cfg (did you mean --config?)"),
    (["run", "--conf", "worker.yaml"], "no such option --conf (did you mean --config?)"),
    (["subs", "list", "--jsn"], "no such option --jsn (did you mean --json?)"),
    (["dlq", "list", "orders", "--since", "1y"], "--since: must be an RFC 3339 time, ms since the epoch, or a time "
                                                 "before now like 30m, 1h or 2d"),
])
def test_usage_errors_are_one_line_exit_2_and_say_argument(args, says):
    result = run_cli(*args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("push-worker: invalid argument: ") and says in lines[0], lines[0]


@pytest.mark.parametrize("args", [
    ["subs", "list"], ["show", "orders", "1:2:-1:-1"], ["history", "orders"], ["queue", "orders", "--state",
    "retrying"], ["discard", "orders", "1:2:-1:-1"], ["dlq", "list", "orders"],
])
def test_a_command_with_nowhere_to_connect_names_itself(tmp_path: Path, args):
    """No URL given and no embedded worker running: the error names the command run (every one of
    these once said `subs:`)."""
    environment = {k: v for k, v in env().items() if not k.startswith("PUSH_WORKER_")}
    result = run_cli(*args, cwd=tmp_path, environment=environment)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    command = " ".join(args[:2]) if args[0] in ("subs", "dlq") else args[0]
    assert lines[0].startswith(f"push-worker: invalid configuration: {command}: --redis-url: is required"), lines[0]


@pytest.mark.parametrize(("doc", "says"), [
    (["a", "list"], "config: must be a mapping of settings"),
    ({"subscriptions": [{"name": "np", "topic": "non-persistent://p-x/main/t",
                         "deliver": {"mode": "push", "push": {"url": "https://example.com/push"}}}]},
     "topic: must be persistent://"),
])
def test_config_rules_a_new_user_meets(tmp_path: Path, doc, says):
    path = tmp_path / "worker.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = run_cli("check", "--config", str(path))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and says in lines[0], result.stderr


def test_dlq_redrive_refuses_to_start_without_its_signing_secret(tmp_path: Path, redis_url):
    """It once re-dead-lettered every message as not_sent and said only "0 delivered"."""
    path = tmp_path / "worker.yaml"
    path.write_text(yaml.safe_dump({"subscriptions": [{
        "name": "signed", "topic": "persistent://p-x/main/t", "dead_letter": {"topic": "persistent://p-x/main/t-dlq"},
        "deliver": {"mode": "push", "push": {"url": "https://example.com/push",
                                             "signing_secrets": [{"env": "PW_TEST_MISSING_SECRET"}]}}}]}))
    result = run_cli("dlq", "redrive", "signed", "--config", str(path), "--redis-url", redis_url,
                     "--service-url", "pulsar://127.0.0.1:9")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "PW_TEST_MISSING_SECRET" in lines[0] and "signing_secrets[0]" in lines[0], lines[0]


def test_run_on_a_port_in_use_says_which_setting_to_change(tmp_path: Path):
    """It said `[Errno 98] error while attempting to bind on address ...`."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = tmp_path / "worker.yaml"
        path.write_text(yaml.safe_dump({"http": {"port": port}, "pulsar": {"service_url": "pulsar://127.0.0.1:9"},
                                        "redis": {"url": "redis://127.0.0.1:9"}}))
        result = run_cli("run", "--config", str(path), timeout=60)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert last == (f"push-worker: http: cannot listen on 127.0.0.1:{port} (Address already in use): choose "
                    "http.port or $PUSH_WORKER_HTTP_PORT (0: any free port)"), last


def test_dead_letters_of_a_subscription_without_a_dead_letter_topic_are_not_found(tmp_path: Path, redis_url):
    """It said `invalid configuration: ... dead_letter.topic: is not set` (exit 2) of a valid config."""
    path = tmp_path / "worker.yaml"
    path.write_text(yaml.safe_dump({"subscriptions": [{
        "name": "plain", "topic": "persistent://p-x/main/t",
        "deliver": {"mode": "push", "push": {"url": "https://example.com/push"}}}]}))
    for command in (["dlq", "list", "plain"], ["dlq", "redrive", "plain"], ["queue", "plain", "--state", "dead"]):
        result = run_cli(*command, "--config", str(path), "--redis-url", redis_url, "--service-url", "pulsar://127.0.0.1:9")
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 3 and len(lines) == 1, (command, result.stderr)
        assert "no dead letters" in lines[0] and "invalid configuration" not in lines[0], lines[0]


def test_a_broker_that_never_answers_is_not_said_to_have_answered(tmp_path: Path):
    """`publish` said `the broker failed (Pulsar error: TimeOut)`, commands on the async client `the
    broker answered Timeout`, though nothing listened on the port."""
    path = tmp_path / "worker.yaml"
    path.write_text(yaml.safe_dump({"pulsar": {"operation_timeout_seconds": 2}}))
    result = run_cli("publish", "persistent://p-x/main/t", "x", "--config", str(path),
                     "--service-url", "pulsar://127.0.0.1:9", timeout=60)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert "the broker failed: no connection to pulsar://127.0.0.1:9 within" in lines[0], lines[0]
    assert "answered" not in lines[0], lines[0]


def test_a_full_redis_is_said_to_be_full_not_damaged(tmp_path: Path, own_redis):
    """`subs apply` against a Redis at maxmemory said `redis answered with an error (OOM ...); its
    data may be damaged`: the data was fine, Redis was full."""
    import redis as redis_sync

    defs = tmp_path / "defs.yaml"
    defs.write_text(yaml.safe_dump({"name": "full", "topic": "persistent://p-x/main/t",
                                    "deliver": {"mode": "push", "push": {"url": "https://example.com/push"}}}))
    admin = redis_sync.Redis.from_url(own_redis.url)
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)
    try:
        result = run_cli("subs", "apply", "-f", str(defs), "--redis-url", own_redis.url)
    finally:
        admin.config_set("maxmemory", 0)
        admin.close()
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert "redis refused the command: it is full" in lines[0] and "damaged" not in lines[0], lines[0]


def test_publish_to_a_dead_broker_says_so_at_once_naming_the_url():
    """It took 10.5 s and said only `Timeout`."""
    import time

    from worker.broker.embedded import free_port

    url = f"pulsar://127.0.0.1:{free_port()}"
    started = time.monotonic()
    result = run_cli("publish", "persistent://p-cli/main/t", "x", "--service-url", url, "--connect-timeout", "1")
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip() == (f"push-worker: the broker failed: no connection to {url} within 1 s (connection "
                                     "refused); check --service-url, pulsar.service_url or $PUSH_WORKER_PULSAR_URL "
                                     "and that the broker is running")
    assert time.monotonic() - started < 5
    result = run_cli("publish", "persistent://p-cli/main/t", "x", "--service-url", url, "--connect-timeout", "0")
    assert result.returncode == 2 and "--connect-timeout: must be more than 0 seconds" in result.stderr


def test_check_warns_of_an_admin_token_file_that_does_not_exist(tmp_path: Path):
    """A token file not mounted (yet): `check` passes (it is read when it appears) and says so."""
    config = tmp_path / "worker.yaml"
    config.write_text(yaml.safe_dump({"admin": {"port": 9475, "tokens": [
        {"subject": "ops", "file": str(tmp_path / "missing"), "roles": ["admin"]}]}}))
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert f"warning: admin.tokens[0].file: {tmp_path / 'missing'} does not exist" in result.stderr
    (tmp_path / "missing").write_text("a-token-of-forty-characters-or-so-0123456789")
    assert "admin.tokens" not in run_cli("check", "--config", str(config)).stderr


def test_dlq_redrive_without_config_says_it_needs_the_secrets_dir(tmp_path: Path, redis_url):
    """A registry subscription whose credentials are project secrets: without --config there is no
    secrets.dir to read them from. It said "invalid configuration: the worker has no secrets.dir"
    while `dlq list` and `--dry-run` work without it."""
    subs = tmp_path / "subs.yaml"
    subs.write_text(yaml.safe_dump({"subscriptions": [{
        "name": "tokened", "topic": "persistent://p-x/main/t", "dead_letter": {"topic": "persistent://p-x/main/t-dlq"},
        "deliver": {"mode": "push", "push": {"url": "https://example.com/push", "bearer_token": {"secret": "tok"}}}}]}))
    applied = run_cli("subs", "apply", "-f", str(subs), "--redis-url", redis_url)
    assert applied.returncode == 0, applied.stderr
    result = run_cli("dlq", "redrive", "tokened", "--redis-url", redis_url, "--service-url", "pulsar://127.0.0.1:9")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "dlq redrive: --config: is required for this subscription" in lines[0], lines[0]
    assert "secrets.dir" in lines[0]


def test_check_names_every_broken_rule_not_only_the_first(tmp_path: Path):
    """Three sections and two subscriptions broken: five lines, one a rule, exit 2 (it said the first)."""
    config = tmp_path / "worker.yaml"
    config.write_text(yaml.safe_dump({
        "fleet": {"lease_seconds": 1}, "http": {"port": 99999}, "pulsar": {"service_url": "http://broker"},
        "subscriptions": [
            {"name": "a", "topic": "persistent://p-a/main/t", "deliver": {"mode": "push", "push": {"url": "ftp://x"}}},
            {"name": "b", "topic": "nope", "deliver": {"mode": "push", "push": {"url": "https://example.com/"}}},
            {"name": "c", "topic": "persistent://p-a/main/t",
             "deliver": {"mode": "push", "push": {"url": "https://example.com/"}}}]}))
    result = run_cli("check", "--config", str(config))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and result.stdout == "", result
    assert [line.split(": ", 2)[2].split(":")[0:2] for line in lines] == [
        ["config", " pulsar.service_url"], ["config", " http.port"], ["config", " fleet.lease_seconds"],
        ["subscription 'a'", " deliver.push.url"], ["subscription 'b'", " topic"]], lines
    assert all(line.startswith("push-worker: invalid configuration: ") for line in lines)
