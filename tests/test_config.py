"""Config validation: each rule gives a clear error naming subscription, field and rule; the CLI
exits 2 without a traceback."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.helpers import code_path
from worker.model.config import load_settings, parse_settings
from worker.runtime.errors import ConfigError

pytestmark = pytest.mark.broker_independent

GOOD = {
    "pulsar": {"service_url": "pulsar://127.0.0.1:6650"},
    "redis": {"url": "redis://127.0.0.1:6379/0"},
    "state_dir": ".push-worker",
    "http": {"host": "127.0.0.1", "port": 9464},
    "destinations": {"allow_private": False},
    "subscriptions": [{
        "name": "orders-push",
        "topic": "persistent://p-demo/main/orders",
        "type": "shared",
        "ack_deadline_seconds": 30,
        "max_deliver": 5,
        "max_ack_pending": 1000,
        "start_from": "all",
        "retry": {"min_backoff_seconds": 1, "max_backoff_seconds": 60},
        "deliver": {"mode": "push", "push": {"url": "https://example.com/hook", "content": "wrapped"}},
        "dead_letter": {"topic": "persistent://p-demo/main/orders-dlq"},
    }],
}


def with_sub(**changes):
    doc = copy.deepcopy(GOOD)
    sub = doc["subscriptions"][0]
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        node = sub
        for p in parents:
            node = node.setdefault(p, {})
        if value is ...:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return doc


def test_the_documented_example_loads():
    s = parse_settings(GOOD, env={})
    [sub] = s.subscriptions
    assert (sub.name, sub.type, sub.ack_deadline_seconds, sub.max_deliver, sub.max_ack_pending) == (
        "orders-push", "shared", 30, 5, 1000)
    assert sub.url == "https://example.com/hook" and sub.content == "wrapped"
    assert sub.dead_letter_topic == "persistent://p-demo/main/orders-dlq"
    assert sub.key == "p-demo/orders-push"
    assert s.pulsar.service_url == "pulsar://127.0.0.1:6650"


def test_defaults_follow_the_platform_docs():
    doc = with_sub(type=..., ack_deadline_seconds=..., max_deliver=..., max_ack_pending=..., start_from=...,
                   retry=..., dead_letter=...)
    [sub] = parse_settings(doc, env={}).subscriptions
    assert (sub.type, sub.ack_deadline_seconds, sub.max_deliver, sub.max_ack_pending, sub.start_from) == (
        "shared", 30, 5, 1000, "all")
    assert sub.dead_letter_topic is None


def test_after_attempts_overrides_max_deliver():
    [sub] = parse_settings(with_sub(dead_letter__after_attempts=2), env={}).subscriptions
    assert sub.max_deliver == 2


def test_pull_subscriptions_are_ignored():
    doc = with_sub(deliver={"mode": "pull"})
    assert parse_settings(doc, env={}).subscriptions == ()


def test_absent_connections_mean_embedded_and_env_overrides():
    doc = copy.deepcopy(GOOD)
    del doc["pulsar"], doc["redis"]
    s = parse_settings(doc, env={})
    assert s.pulsar.service_url is None and s.redis.url is None
    s = parse_settings(doc, env={"PUSH_WORKER_PULSAR_URL": "pulsar://b:6650", "PUSH_WORKER_REDIS_URL":
                                 "redis://:pw@r:6379/1", "PUSH_WORKER_STATE_DIR": "/tmp/x",
                                 "PUSH_WORKER_PULSAR_TOKEN": "tok"})
    assert s.pulsar.service_url == "pulsar://b:6650" and s.redis.url == "redis://:pw@r:6379/1"
    assert str(s.state_dir) == "/tmp/x" and s.pulsar.auth_token == "tok"
    assert "pw@" not in repr(s) and "'tok'" not in repr(s)  # secrets stay out of reprs and logs


BAD = [
    (dict(name="Orders"), "name", "lowercase"),
    (dict(name="9orders"), "name", "starts with a letter"),
    (dict(name="orders-"), "name", "does not end with a dash"),
    (dict(name="a" * 64), "name", "63"),
    (dict(name=...), "name", "required"),
    (dict(topic="orders"), "topic", "persistent://"),
    (dict(type="fanout"), "type", "shared, key-shared, exclusive, failover"),
    (dict(ack_deadline_seconds=0), "ack_deadline_seconds", "1..600"),
    (dict(ack_deadline_seconds=601), "ack_deadline_seconds", "1..600"),
    (dict(ack_deadline_seconds="30"), "ack_deadline_seconds", "integer"),
    (dict(max_deliver=-2), "max_deliver", "-1..1000"),
    (dict(max_concurrency=0), "max_concurrency", "1..10000"),
    (dict(max_ack_pending=0), "max_ack_pending", "1..100000"),
    (dict(start_from="latest"), "start_from", "all, new"),
    (dict(retry__min_backoff_seconds=-1), "retry.min_backoff_seconds", "0..3600"),
    (dict(retry__max_backoff_seconds=0.5), "retry.max_backoff_seconds", ">= min_backoff_seconds"),
    (dict(deliver__push__url="ftp://example.com/x"), "deliver.push.url", "http or https"),
    (dict(deliver__push__url="https:///nohost"), "deliver.push.url", "host"),
    (dict(deliver__push__url="https://u:p@example.com/"), "deliver.push.url", "credentials"),
    # These three passed `check` (the first failed it as "unexpected error"): the HTTP client then
    # refused the port, or dropped the newline and so posted to another path.
    (dict(deliver__push__url="https://[::1/push"), "deliver.push.url", "valid URL"),
    (dict(deliver__push__url="https://example.com:99999/push"), "deliver.push.url", "valid URL"),
    (dict(deliver__push__url="https://example.com/push\nX-Injected: 1"), "deliver.push.url", "control characters"),
    (dict(deliver__push__url=...), "deliver.push.url", "required"),
    (dict(deliver__push__content="xml"), "deliver.push.content", "wrapped, raw"),
    (dict(dead_letter__topic="persistent://p-demo/main/orders"), "dead_letter.topic", "differ"),
    # one of the topic's partitions, or the partitioned topic of a partition: dead letters would come back
    (dict(dead_letter__topic="persistent://p-demo/main/orders-partition-2"), "dead_letter.topic", "partitions"),
    (dict(topic="persistent://p-demo/main/orders-partition-0", dead_letter__topic="persistent://p-demo/main/orders"),
     "dead_letter.topic", "partitions"),
    (dict(dead_letter__topic="persistent://p-other/main/dlq"), "dead_letter.topic", "tenant"),
    (dict(dead_letter__after_attempts=-2), "dead_letter.after_attempts", "-1..1000"),
    (dict(colour="red"), "colour", "not a known field"),
    (dict(display_name=7), "display_name", "string"),
    (dict(deliver__push__signing_secrets="plain"), "deliver.push.signing_secrets", "one secret, or two"),
    (dict(deliver__push__signing_secrets=[{"env": "A"}] * 3), "deliver.push.signing_secrets", "two during a rotation"),
    (dict(deliver__push__signing_secrets=["s3cret"]), "deliver.push.signing_secrets[0]", "{env: VARIABLE}"),
    (dict(deliver__push__signing_secrets=[{"env": "A", "file": "/x"}]), "deliver.push.signing_secrets[0]",
     "exactly one of secret, env or file"),
    (dict(deliver__push__signing_secrets=[{"env": "A B"}]), "deliver.push.signing_secrets[0].env",
     "environment variable name"),
    (dict(deliver__push__bearer_token="tok"), "deliver.push.bearer_token", "never go in the definition"),
]


@pytest.mark.parametrize(("changes", "field", "rule"), BAD, ids=[b[1] + ":" + b[2] for b in BAD])
def test_each_rule_names_subscription_field_and_rule(changes, field, rule):
    with pytest.raises(ConfigError) as err:
        parse_settings(with_sub(**changes), env={})
    message = str(err.value)
    assert err.value.field == field, message
    assert rule in message, message
    if "name" not in changes:
        assert "'orders-push'" in message


def test_top_level_rules():
    for doc, field in [({"http": {"port": 70000}}, "http.port"), ({"pulsar": {"service_url": "http://x"}},
                       "pulsar.service_url"), ({"subscriptions": {"a": 1}}, "subscriptions"),
                       ({"destinations": {"allow_private": "yes"}}, "destinations.allow_private"),
                       ({"destinations": {"allow_cidrs": "10.0.0.0/8"}}, "destinations.allow_cidrs"),
                       ({"destinations": {"allow_cidrs": ["10.0.0.1/8"]}}, "destinations.allow_cidrs[0]"),
                       ({"destinations": {"max_request_bytes": 10}}, "destinations.max_request_bytes"),
                       ({"max_held_bytes_per_subscription": 1000}, "max_held_bytes_per_subscription"),
                       ({"redis": {"history_ttl_seconds": 0}}, "redis.history_ttl_seconds"),
                       ({"redis": {"acked_history_ttl_seconds": -1}}, "redis.acked_history_ttl_seconds"),
                       ({"bogus": 1}, "bogus")]:
        with pytest.raises(ConfigError) as err:
            parse_settings(doc, env={})
        assert err.value.field == field


@pytest.mark.parametrize(("variable", "value", "rule"), [
    ("PUSH_WORKER_HTTP_PORT", "abc", "must be an integer"), ("PUSH_WORKER_HTTP_PORT", "70000", "must be in 0..65535"),
    ("PUSH_WORKER_HTTP_PORT", "-1", "must be in 0..65535"), ("PUSH_WORKER_FLEET", "a b{}", "lowercase letters"),
    # the id names the worker in leases, status and consumer names: it once took anything
    ("PUSH_WORKER_ID", "pod\n1", "must be 1-253 visible ASCII"), ("PUSH_WORKER_ID", "a b", "must be 1-253 visible"),
    ("PUSH_WORKER_ID", "p" * 254, "must be 1-253 visible ASCII"),
])
def test_an_environment_override_follows_the_rule_of_its_field_and_is_named(variable, value, rule):
    """PUSH_WORKER_HTTP_PORT=99999 once passed `check` (the file's http.port was checked, not it),
    and a bad PUSH_WORKER_FLEET was blamed on the file's fleet.name."""
    with pytest.raises(ConfigError) as raised:
        parse_settings({}, env={variable: value})
    assert str(raised.value).startswith(f"environment: {variable}: {rule}")


def test_duplicate_subscription_is_refused():
    doc = copy.deepcopy(GOOD)
    doc["subscriptions"].append(copy.deepcopy(doc["subscriptions"][0]))
    with pytest.raises(ConfigError, match="defined twice"):
        parse_settings(doc, env={})


def test_unreadable_and_broken_yaml(tmp_path: Path):
    with pytest.raises(ConfigError, match="cannot be read"):
        load_settings(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("subscriptions: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_settings(bad)


def test_a_key_given_twice_is_refused_with_its_line(tmp_path: Path):
    """PyYAML keeps the last of two equal keys: a second `max_deliver:` further down quietly won."""
    path = tmp_path / "worker.yaml"
    path.write_text("subscriptions:\n  - name: orders\n    max_deliver: 5\n    max_deliver: 50\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line 4 \(duplicate key 'max_deliver'\)"):
        load_settings(path)
    # A merge key's keys may be overridden beside it: that is YAML, not a duplicate.
    path.write_text(yaml.safe_dump(GOOD) + "defaults: &d {a: 1, b: 2}\nmerged:\n  <<: *d\n  b: 3\n")
    with pytest.raises(ConfigError, match="defaults: is not a known field"):
        load_settings(path)


def _cli(*args: str, cwd: Path, **environment: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "worker.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=60, env={"PATH": "/usr/bin:/bin", **code_path(), **environment})


@pytest.mark.parametrize("command", ["run", "check"])
def test_cli_exits_2_with_a_clear_message_and_no_traceback(tmp_path: Path, command: str):
    path = tmp_path / "worker.yaml"
    path.write_text(yaml.safe_dump(with_sub(ack_deadline_seconds=0)))
    result = _cli(command, "--config", str(path), cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "subscription 'orders-push': ack_deadline_seconds: must be in 1..600 (got 0)" in result.stderr


def test_cli_refuses_private_destination_unless_allowed(tmp_path: Path):
    path = tmp_path / "worker.yaml"
    path.write_text(yaml.safe_dump(with_sub(deliver__push__url="http://localhost:9/hook")))
    result = _cli("check", "--config", str(path), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "deliver.push.url" in result.stderr and "loopback" in result.stderr
    doc = with_sub(deliver__push__url="http://localhost:9/hook")
    doc["destinations"]["allow_private"] = True
    path.write_text(yaml.safe_dump(doc))
    result = _cli("check", "--config", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr


def test_allow_cidrs_opens_a_private_network_for_check(tmp_path: Path):
    path = tmp_path / "worker.yaml"
    doc = with_sub(deliver__push__url="http://127.0.0.1:9/hook")
    doc["destinations"]["allow_cidrs"] = ["127.0.0.0/8"]
    path.write_text(yaml.safe_dump(doc))
    result = _cli("check", "--config", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr


def test_check_refuses_a_secret_that_cannot_be_read(tmp_path: Path):
    path = tmp_path / "worker.yaml"
    path.write_text(yaml.safe_dump(with_sub(deliver__push__signing_secrets=[{"file": str(tmp_path / "nope")}],
                                            deliver__push__bearer_token={"env": "PW_TEST_UNSET_TOKEN"})))
    result = _cli("check", "--config", str(path), cwd=tmp_path)
    assert result.returncode == 2
    assert "deliver.push.signing_secrets[0]" in result.stderr and "cannot be read" in result.stderr
    (tmp_path / "nope").write_text("s3cret\n")
    result = _cli("check", "--config", str(path), cwd=tmp_path)
    assert result.returncode == 2
    assert "deliver.push.bearer_token" in result.stderr and "PW_TEST_UNSET_TOKEN" in result.stderr
    assert "s3cret" not in result.stderr + result.stdout
    # Readable is not enough: the secret must be usable as delivery uses it (check once passed both).
    result = _cli("check", "--config", str(path), cwd=tmp_path, PW_TEST_UNSET_TOKEN="t0ken\r\nX-Injected: 1")
    assert result.returncode == 2 and "deliver.push.bearer_token" in result.stderr
    assert "has characters a header cannot carry" in result.stderr and "t0ken" not in result.stderr
    (tmp_path / "nope").write_text("whsec_not base64!")
    result = _cli("check", "--config", str(path), cwd=tmp_path)
    assert result.returncode == 2 and "deliver.push.signing_secrets[0]: a whsec_ secret is not valid base64" in \
        result.stderr


def test_check_refuses_a_ca_file_that_cannot_be_used(tmp_path: Path):
    """A trust file that is missing or holds no certificate failed every TLS connection at run time,
    one retry after another; `check` passed it."""
    not_pem = tmp_path / "ca.txt"
    not_pem.write_text("not a certificate\n")
    for block, field, rule in (
            ({"pulsar": {"service_url": "pulsar+ssl://broker:6651", "tls_trust_certs_file": str(tmp_path / "no")}},
             "pulsar.tls_trust_certs_file", "cannot be read (No such file or directory"),
            ({"redis": {"mode": "cluster", "nodes": ["redis-0:6379"], "tls": True, "tls_ca_file": str(not_pem)}},
             "redis.tls_ca_file", "must hold PEM certificates")):
        path = tmp_path / "worker.yaml"
        path.write_text(yaml.safe_dump(block))
        result = _cli("check", "--config", str(path), cwd=tmp_path)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert f"config: {field}: {rule}" in result.stderr, result.stderr


def test_a_config_that_is_not_utf8_is_refused_in_one_line(tmp_path: Path):
    (tmp_path / "worker.yaml").write_bytes(b"\xff\xfesubscriptions: []")
    result = _cli("check", "--config", str(tmp_path / "worker.yaml"), cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "worker.yaml: is not UTF-8 text (byte 0)" in result.stderr


def test_the_readme_names_every_environment_variable_the_worker_reads():
    root = Path(__file__).resolve().parent.parent
    read = {name for path in (root / "worker").rglob("*.py") if "devtools" not in path.parts
            for name in re.findall(r"PUSH_WORKER_[A-Z_]+", path.read_text())}
    table = (root / "README.md").read_text().split("### Environment variables", 1)[1].split("\n## ", 1)[0]
    assert read and not {name for name in read if f"`{name}`" not in table}


@pytest.mark.parametrize(("redis_block", "field", "rule"), [
    ({"mode": "replicated"}, "redis.mode", "must be one of standalone, cluster, sentinel"),
    ({"mode": "cluster"}, "redis.nodes", "is required with redis.mode cluster"),
    ({"mode": "cluster", "nodes": ["a:6379", "b"]}, "redis.nodes[1]", "must be host:port"),
    ({"mode": "cluster", "nodes": "a:6379"}, "redis.nodes", "must be a list of host:port"),
    ({"nodes": ["a:6379"]}, "redis.nodes", "is for redis.mode cluster only"),
    ({"mode": "sentinel", "master_name": "m"}, "redis.sentinels", "is required with redis.mode sentinel"),
    ({"mode": "sentinel", "sentinels": ["s:26379"]}, "redis.master_name", "is required with redis.mode sentinel"),
    ({"mode": "sentinel", "sentinels": ["s:26379"], "master_name": "m", "url": "redis://x:1"}, "redis.url",
     "is not used with redis.mode sentinel"),
    ({"sentinels": ["s:26379"]}, "redis.sentinels", "is for redis.mode sentinel only"),
    ({"mode": "cluster", "nodes": ["a:6379"], "tls": "yes"}, "redis.tls", "must be true or false"),
    ({"url": "redis://a:6379", "tls": True}, "redis.tls", "standalone: a rediss:// URL"),
])
def test_redis_topology_rules_name_the_field(redis_block, field, rule):
    with pytest.raises(ConfigError) as err:
        parse_settings({"redis": redis_block}, env={})
    assert err.value.field == field and rule in str(err.value)


def test_redis_cluster_and_sentinel_settings_with_passwords_from_the_environment():
    s = parse_settings({"redis": {"mode": "cluster", "nodes": ["r-0:6379", "r-1:6379"]}},
                       env={"PUSH_WORKER_REDIS_PASSWORD": "pw"})
    assert (s.redis.mode, s.redis.nodes, s.redis.password) == ("cluster", ("r-0:6379", "r-1:6379"), "pw")
    assert "pw" not in repr(s)
    s = parse_settings({"redis": {"mode": "sentinel", "sentinels": ["s-0:26379"], "master_name": "main", "tls": True}},
                       env={"PUSH_WORKER_REDIS_SENTINEL_PASSWORD": "spw"})
    assert (s.redis.master_name, s.redis.sentinel_password, s.redis.tls, s.redis.url) == ("main", "spw", True, None)
    assert "spw" not in repr(s)


def test_an_empty_config_file_passes_with_a_warning_that_says_what_it_means(tmp_path: Path):
    """An empty file is a valid config (every default), but more often a wrong path or an empty mount:
    `check` says so rather than a bare "0 subscriptions"."""
    path = tmp_path / "worker.yaml"
    path.write_text("# nothing yet\n")
    result = _cli("check", "--config", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok: 0 push subscription(s)"
    assert result.stderr.strip() == (f"warning: {path} is empty: every setting is its default (the embedded "
                                     "broker and Redis, no subscriptions but the registry's)")
    path.write_text(yaml.safe_dump({"fleet": {"name": "a"}}))  # anything set: no warning
    result = _cli("check", "--config", str(path), cwd=tmp_path)
    assert result.returncode == 0 and result.stderr == "", result.stderr
