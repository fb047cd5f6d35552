"""Subscription filters (Google Pub/Sub filter syntax): parsed, evaluated, enforced by the worker."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.builders import push_sub, worker_yaml
from tests.support.endpoints import Endpoint
from tests.support.helpers import cli, eventually
from tests.support.pulsar_client import Client
from worker.model.filters import FilterError, parse_filter
from worker.model.subscriptions import parse_subscription
from worker.runtime.errors import ConfigError

# -- the evaluator against a reference evaluation ---------------------------------------------------

KEYS = ["kind", "region", "a b", 'q"k']
VALUES = ["", "order", "eu", "eu-west", 'x"y', "ü"]


@dataclass(frozen=True)
class Node:
    op: str
    args: tuple[Any, ...]


def quote(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def key_text(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() and key.isascii() else quote(key)


def render(node: Node) -> str:
    op, a = node.op, node.args
    if op == "=":
        return f"attributes.{key_text(a[0])} = {quote(a[1])}"
    if op == "!=":
        return f"attributes.{key_text(a[0])} != {quote(a[1])}"
    if op == "has":
        return f"attributes:{key_text(a[0])}"
    if op == "prefix":
        return f"hasPrefix(attributes.{key_text(a[0])}, {quote(a[1])})"
    if op == "not":
        return f"NOT {render(a[0])}"
    if op == "-":  # Google's other spelling of NOT
        return f"-{render(a[0])}"
    return "(" + f" {op} ".join(render(x) for x in a) + ")"


def reference(node: Node, attributes: dict[str, str]) -> bool:
    op, a = node.op, node.args
    if op == "=":
        return attributes.get(a[0]) == a[1]
    if op == "!=":
        return attributes.get(a[0]) != a[1]
    if op == "has":
        return a[0] in attributes
    if op == "prefix":
        return a[0] in attributes and attributes[a[0]].startswith(a[1])
    if op in ("not", "-"):
        return not reference(a[0], attributes)
    results = [reference(x, attributes) for x in a]
    return all(results) if op == "AND" else any(results)


leaves = st.one_of(
    st.builds(lambda k, v: Node("=", (k, v)), st.sampled_from(KEYS), st.sampled_from(VALUES)),
    st.builds(lambda k, v: Node("!=", (k, v)), st.sampled_from(KEYS), st.sampled_from(VALUES)),
    st.builds(lambda k: Node("has", (k,)), st.sampled_from(KEYS)),
    st.builds(lambda k, v: Node("prefix", (k, v)), st.sampled_from(KEYS), st.sampled_from(VALUES)),
)
expressions = st.recursive(leaves, lambda inner: st.one_of(
    st.builds(lambda x: Node("not", (x,)), inner),
    st.builds(lambda x: Node("-", (x,)), inner),
    st.builds(lambda xs: Node("AND", tuple(xs)), st.lists(inner, min_size=2, max_size=3)),
    st.builds(lambda xs: Node("OR", tuple(xs)), st.lists(inner, min_size=2, max_size=3)),
), max_leaves=8)
attribute_maps = st.dictionaries(st.sampled_from(KEYS), st.sampled_from(VALUES), max_size=4)


@settings(max_examples=400, deadline=None)
@given(expressions, st.lists(attribute_maps, min_size=1, max_size=5))
def test_the_evaluator_agrees_with_a_reference_evaluation(expression: Node, maps: list[dict[str, str]]):
    text = render(expression)
    if len(text) > 256:
        return
    compiled = parse_filter(text)
    for attributes in maps:
        assert compiled.matches(attributes) == reference(expression, attributes), (text, attributes)


def test_and_and_or_without_parentheses_are_refused_naming_the_column():
    """Google refuses a filter that mixes AND and OR without parentheses, and its emulator binds them
    the other way from this worker: `a AND b OR c` would match other messages there."""
    for text, column in [('attributes:a AND attributes:b OR attributes:c', 1),
                         ('attributes:a OR attributes:b AND attributes:c', 17),
                         ('NOT (attributes:x) OR attributes:a AND attributes:b', 23)]:
        with pytest.raises(FilterError) as e:
            parse_filter(text)
        assert f"mixes AND and OR without parentheses at column {column}" in str(e.value), str(e.value)
        assert "(a AND b) OR c" in str(e.value)
    for text in ['(attributes:a AND attributes:b) OR attributes:c', 'attributes:a AND (attributes:b OR attributes:c)',
                 'attributes:a AND attributes:b AND attributes:c', 'attributes:a OR attributes:b OR attributes:c']:
        parse_filter(text)


def test_precedence_is_not_then_and_then_or_for_a_filter_stored_before_that_rule():
    f = parse_filter('attributes:a OR attributes:b AND NOT attributes:c', mixed=True)
    assert f.matches({"a": "1", "c": "1"})  # a OR (b AND NOT c)
    assert not f.matches({"b": "1", "c": "1"})
    assert f.matches({"b": "1"})


def test_minus_is_another_spelling_of_not():
    """Google's filter syntax (AIP-160) takes `-` for NOT, as in its emulator's own tests."""
    f = parse_filter('attributes.name = "com" AND -attributes:"lang"')
    assert f.matches({"name": "com"}) and not f.matches({"name": "com", "lang": "en"})
    assert parse_filter('-(attributes:a OR attributes:b)').matches({"c": "1"})
    assert not parse_filter('-(attributes:a OR attributes:b)').matches({"b": "1"})
    assert parse_filter("attributes:-k").matches({"-k": "1"})  # in a key it is still a key's character


@pytest.mark.parametrize(("text", "column"), [
    ('attributes.kind = order', 19), ('attributes.kind == "x"', 18), ('attributes:x AND', 14),
    ('hasPrefix(attributes.kind "x")', 27),
])
def test_a_bad_filter_is_refused_with_its_position(text, column):
    with pytest.raises(FilterError, match=rf"syntax error at column {column}\b"):
        parse_filter(text)
    doc = {"name": "f", "topic": "persistent://p-a/main/t", "filter": text,
           "deliver": {"mode": "push", "push": {"url": "https://example.com/h"}}}
    with pytest.raises(ConfigError, match=rf"filter: syntax error at column {column}"):
        parse_subscription(doc)


@pytest.mark.parametrize(("literal", "value"), [
    (r'"a\"b\\c"', 'a"b\\c'), (r'"tab\there\n"', "tab\there\n"), (r'"caf\u00e9"', "café"),
    (r'"\x41\x42"', "AB"), (r'"\101\102"', "AB"), (r'"\U0001F600"', "\U0001F600"), (r"'x'", None),
    (r'"\ud83d\ude00"', "\U0001F600"),  # a JSON surrogate pair, as filters stored before were read
])
def test_string_literals_take_googles_escapes(literal, value):
    """Google's filter strings take Unicode, hexadecimal and octal escapes; hexadecimal and octal
    were refused as invalid (the literal was read as JSON)."""
    if value is None:  # single quotes are not Google's
        with pytest.raises(FilterError, match="syntax error"):
            parse_filter(f"attributes.k = {literal}")
        return
    f = parse_filter(f"attributes.k = {literal}")
    assert f.matches({"k": value}) and not f.matches({"k": value + "x"})
    assert parse_filter(f"attributes.{literal} = \"1\"").matches({value: "1"})  # a quoted key, the same way


@pytest.mark.parametrize("literal", [r'"\q"', r'"\x4"', r'"\ud800"', r'"\U00110000"'])
def test_an_unknown_escape_is_refused_and_names_the_known_ones(literal):
    with pytest.raises(FilterError, match=r"invalid escape .*\\xHH, \\ooo, \\uHHHH"):
        parse_filter(f"attributes.k = {literal}")


def test_limits_of_a_filter():
    with pytest.raises(FilterError, match="at most 256 characters"):
        parse_filter("attributes:" + "k" * 300)
    with pytest.raises(FilterError, match="must not be empty"):
        parse_filter("  ")


# -- enforced by a worker ------------------------------------------------------------------------

async def test_messages_the_filter_does_not_match_are_acked_unsent_counted_and_in_history(
        start_worker, endpoint: Endpoint, client: Client, topic, redis_url, broker, tmp_path):
    definition = push_sub("orders-only", topic, endpoint.url,
                          filter='attributes.kind = "order" AND NOT attributes:test')
    config, settings_ = worker_yaml(tmp_path, broker.url, redis_url, definition)
    [sub] = settings_.subscriptions
    w = await start_worker(sub)
    [wanted] = client.publish(topic, [b"yes"], properties={"kind": "order"})
    skipped = client.publish(topic, [b"no"], properties={"kind": "refund"})
    skipped += client.publish(topic, [b"test"], properties={"kind": "order", "test": "1"})
    skipped += client.publish(topic, [b"bare"])
    stats = w.dispatchers[sub.key].stats
    await eventually(lambda: stats.acked == 1 and stats.filtered == 3, what="1 delivered, 3 filtered")
    assert [r.headers["Pubsub-Message-Id"] for r in endpoint.requests] == [wanted]
    assert w.metrics.registry.get_sample_value("pushworker_messages_filtered_total",
                                               {"project": sub.tenant, "subscription": sub.name}) == 3
    code, out, err = await cli("history", sub.name, "--config", config, "--json")
    assert code == 0, err
    outcomes = {e["message_id"]: e.get("event") or e.get("result") for e in json.loads(out)["messages"]}
    assert {outcomes[m] for m in skipped} == {"filtered"} and outcomes[wanted] == "ack"


async def test_a_mixed_filter_is_refused_by_check_and_apply_and_a_stored_one_keeps_its_reading(redis_url, tmp_path):
    import redis.asyncio as aioredis

    from worker.fleet.registry import Registry

    mixed = 'attributes:a AND attributes:b OR attributes:c'
    definition = push_sub("mixed", "persistent://p-a/main/t", "https://example.com/h", filter=mixed)
    path = tmp_path / "subs.yaml"
    path.write_text(yaml.safe_dump({"subscriptions": [definition]}))
    code, _, err = await cli("subs", "apply", "-f", str(path), "--redis-url", redis_url)
    assert code == 2 and "filter: mixes AND and OR without parentheses at column 1" in err, err
    (tmp_path / "worker.yaml").write_text(yaml.safe_dump({"subscriptions": [definition]}))
    code, _, err = await cli("check", "--config", str(tmp_path / "worker.yaml"))
    assert code == 2 and "filter: mixes AND and OR" in err, err

    # Written before the rule (here: straight into the registry): served with today's reading, and
    # `subs get` says so.
    client = aioredis.Redis.from_url(redis_url)
    registry = Registry(client, "default")
    await client.hset(registry.hash, "p-a/mixed", json.dumps(definition))
    await client.incr(registry.version_key)
    valid, invalid = await registry.read()
    await client.aclose()
    assert "p-a/mixed" in valid and "p-a/mixed" not in invalid
    assert valid["p-a/mixed"].filter is not None and valid["p-a/mixed"].filter.matches({"c": "1"})
    code, out, err = await cli("subs", "get", "p-a/mixed", "--redis-url", redis_url)
    assert code == 0, err
    assert "mixes AND and OR without parentheses" in out + err and "(a AND b) OR c" in out + err


async def test_a_filter_is_immutable_after_creation(redis_url, tmp_path):
    path = tmp_path / "subs.yaml"

    def apply(filter_text: str) -> tuple[int, str, str]:
        path.write_text(yaml.safe_dump({"subscriptions": [
            push_sub("filtered", "persistent://p-a/main/t", "https://example.com/h", filter=filter_text)]}))
        return cli("subs", "apply", "-f", str(path), "--redis-url", redis_url)

    code, out, err = await apply("attributes:a")
    assert code == 0 and "created" in out, err
    code, _, err = await apply("attributes:b")
    assert code == 2 and "filter: is immutable after creation" in err
