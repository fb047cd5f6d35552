"""Operator commands, run as a user runs them (`push-worker ...` processes) against a real broker,
Redis and workers: pause/resume, attempt history, dead-letter list/show/redrive."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest
import redis
import yaml
from aiohttp import web

from tests.support.builders import make_sub, push_sub, worker_yaml
from tests.support.endpoints import Endpoint
from tests.support.helpers import cli, eventually
from tests.support.pulsar_client import Client
from tests.support.redis_targets import ALL_REDIS, RedisTarget
from worker.core import keys
from worker.model.config import RedisSettings
from worker.model.subscriptions import RetryPolicy


@ALL_REDIS
async def test_pause_stops_delivery_keeps_the_backlog_and_resume_delivers_it(
        broker, start_worker, endpoint: Endpoint, client: Client, topic, redis_target: RedisTarget, tmp_path):
    sub = make_sub(topic, endpoint.url)
    control = make_sub(topic + "-control", endpoint.url)
    w = await start_worker(sub, control)
    where = ("--config", worker_yaml(tmp_path, broker.url, redis_target.config)[0])
    client.publish(topic, [b"before"])
    await eventually(lambda: len(endpoint.requests) == 1, what="first delivery")

    code, out, err = await cli("subs", "pause", sub.name, *where)
    assert code == 0, err
    assert out.strip() == f"{sub.key}: paused"
    assert sub.key not in w.dispatchers  # the command returned once the owner had stopped

    paused_ids = set(client.publish(topic, [b"while-paused-%d" % i for i in range(5)]))
    client.publish(topic + "-control", [b"control"])
    await eventually(lambda: any(r.body_payload == b"control" for r in endpoint.requests), what="control delivered")
    assert not paused_ids & set(endpoint.by_id())  # the worker is alive and delivering, but not this one

    code, out, _ = await cli("subs", "pause", sub.name, *where, "--json")
    assert code == 0 and json.loads(out)["result"] == "already paused"
    code, out, err = await cli("subs", "resume", sub.key, *where)
    assert code == 0 and out.strip() == f"{sub.key}: resumed", err
    await eventually(lambda: paused_ids <= set(endpoint.by_id()), what="backlog delivered after resume")
    assert all(len(endpoint.by_id()[m]) == 1 for m in paused_ids)
    # Its status says Active within a heartbeat of its serving again, not Starting until the next
    # periodic refresh (5 s).
    served_at = time.monotonic()

    async def state() -> str:
        code, out, err = await cli("subs", "list", *where, "--json")
        assert code == 0, err
        rows = json.loads(out)
        return next(str(r["state"]) for r in rows if (r["project"], r["name"]) == (sub.tenant, sub.name))

    while (current := await state()) != "Active":
        assert time.monotonic() - served_at < 3.0, f"still {current} 3 s after serving again"

    code, _, err = await cli("subs", "pause", "no-such-sub", *where)
    assert code == 3 and "no-such-sub" in err and "no such subscription" in err


@ALL_REDIS
async def test_show_lists_each_attempt_with_status_latency_and_worker(
        broker, start_worker, endpoint: Endpoint, client: Client, topic, redis_target: RedisTarget, tmp_path):
    where = ("--config", worker_yaml(tmp_path, broker.url, redis_target.config)[0])
    answers = iter([500, 204])
    endpoint.behaviour = lambda rec: web.Response(status=next(answers))
    sub = make_sub(topic, endpoint.url, retry=RetryPolicy(0.05, 0.05))
    w = await start_worker(sub)
    [message_id] = client.publish(topic, [b"x"])
    await eventually(lambda: w.dispatchers[sub.key].stats.acked == 1, what="delivered on the second attempt")

    code, out, err = await cli("show", sub.name, message_id, *where, "--json")
    assert code == 0, err
    history = json.loads(out)["history"]
    assert [(h["attempt"], h["result"], h["status"], h["worker"]) for h in history] == [
        (1, "nack", "500", "w0"), (2, "ack", "204", "w0")]
    assert all(h["latency_ms"] >= 0 and h["at_ms"] > 0 for h in history)

    # The order before 1.2.0 (MESSAGE_ID --subscription NAME) works, and says it is deprecated.
    code, out, err = await cli("show", message_id, "-s", sub.key, *where)
    assert code == 0 and "ATTEMPT" in out.splitlines()[1] and "nack" in out and "204" in out
    assert err == ("warning: `show MESSAGE_ID --subscription NAME` is deprecated since 1.2.0 and is removed in "
                   "2.0.0: use `show NAME MESSAGE_ID`\n"), err

    code, _, err = await cli("show", sub.name, "9:9:-1:-1", *where)
    assert code == 3 and "no attempt history" in err


@pytest.mark.parametrize("acked_ttl", [600, 0])
async def test_a_message_acked_first_time_keeps_its_history_briefly_and_a_retried_one_long(
        start_worker, endpoint: Endpoint, client: Client, topic, redis_url, acked_ttl):
    fails_once = {b"retried"}
    endpoint.behaviour = lambda rec: web.Response(status=500 if rec.body_payload in fails_once and not
                                                  fails_once.discard(rec.body_payload) else 204)
    sub = make_sub(topic, endpoint.url, retry=RetryPolicy(0.05, 0.05))
    w = await start_worker(sub, redis=RedisSettings(url=redis_url, history_ttl_seconds=7200,
                                                    acked_history_ttl_seconds=acked_ttl))
    first, retried = client.publish(topic, [b"first", b"retried"])
    await eventually(lambda: w.dispatchers[sub.key].stats.acked == 2, what="both delivered")
    r = redis.Redis.from_url(redis_url)
    try:
        # The settled record follows the ack (within a few ms): wait for both before reading them.
        await eventually(lambda: r.llen(keys.settled_key(sub.key)) == 2, what="both recorded as settled")
        assert 3600 < r.ttl(keys.history_key(sub.key, retried)) <= 7200
        # Acked first time, its history is kept with its settled mark (no list of its own), as long as
        # the longer of the mark's TTL (redis.settled_ttl_seconds, 600) and acked_history_ttl_seconds.
        assert not r.exists(keys.history_key(sub.key, first))
        code, out, err = await cli("show", sub.name, first, "--redis-url", redis_url)
        if acked_ttl:
            assert code == 0 and "ack" in out and "204" in out, (out, err)
        else:
            assert code == 3 and "no attempt history" in err
        assert [json.loads(e)["message_id"] for e in r.lrange(keys.settled_key(sub.key), 0, -1)] == [
            retried, first]  # both listed among the settled either way (`push-worker history`)
    finally:
        r.close()


@ALL_REDIS
async def test_dead_letters_are_listed_shown_and_redriven_to_their_subscription_only(
        broker, start_worker, endpoint: Endpoint, client: Client, topic, redis_target: RedisTarget, tmp_path):
    healthy = False
    endpoint.behaviour = lambda rec: web.Response(status=204 if healthy else 503)
    other = Endpoint()

    async def other_handler(request: web.Request) -> web.Response:
        other.requests.append(request.headers.get("Pubsub-Message-Id"))  # type: ignore[arg-type]
        return web.Response(status=204)

    from tests.support.endpoints import serve

    runner, other.url = await serve("/push", other_handler)
    config, settings = worker_yaml(tmp_path, broker.url, redis_target.config,
                                   push_sub("orders-push", topic, endpoint.url, dead_letter={"topic": topic + "-dlq"}),
                                   push_sub("bystander", topic, other.url))  # healthy: must never see a redrive
    sub, bystander = settings.subscriptions
    try:
        w = await start_worker(sub, bystander)
        ids = client.publish(topic, [b"m%d" % i for i in range(6)], properties={"origin": "test"})
        await eventually(lambda: w.dispatchers[sub.key].stats.dead_lettered == 6 and len(other.requests) == 6,
                         what="all dead-lettered; bystander delivered")
        args = ("--config", config)

        for _ in range(2):  # listing moves nothing
            code, out, err = await cli("dlq", "list", sub.name, *args, "--json")
            assert code == 0, err
            listed = json.loads(out)["messages"]
            assert sorted(m["message_id"] for m in listed) == sorted(ids)
            assert {(m["attempts"], m["last_status"]) for m in listed} == {("3", "503")}

        code, out, err = await cli("dlq", "show", sub.name, ids[3], *args, "--json")
        assert code == 0, err
        shown = json.loads(out)
        assert shown["data"] == "m3" and shown["attributes"]["origin"] == "test"
        assert [h.get("event") or h["result"] for h in shown["history"]] == ["nack", "nack", "nack", "dead-lettered"]

        healthy = True
        before = len(endpoint.requests)
        code, out, err = await cli("dlq", "redrive", sub.name, *args, "--rate", "50", "--max-messages", "2")
        assert code == 0, err
        assert "2 delivered" in out and "redriven" in err  # progress goes to stderr
        code, out, err = await cli("dlq", "redrive", sub.name, *args, "--rate", "10", "--json")  # resumes
        assert code == 0, err
        assert json.loads(out)["redriven"] == 4
        # --rate 10: the 4 requests of the second run come about 100 ms apart, not in a burst (arrival
        # times at the endpoint carry some scheduling jitter, ~10 ms seen: hence the 70 ms bound).
        times = sorted(r.at for r in endpoint.requests[-4:])
        assert all(b - a >= 0.07 for a, b in itertools.pairwise(times)), times

        redriven = endpoint.requests[before:]
        assert sorted(r.headers["Pubsub-Message-Id"] for r in redriven) == sorted(ids)  # each once, original id
        assert {r.headers["Pubsub-Delivery-Attempt"] for r in redriven} == {"1"}  # fresh counts
        assert {r.body_payload for r in redriven} == {b"m%d" % i for i in range(6)}
        assert len(other.requests) == 6  # the bystander got nothing more
        code, out, _ = await cli("dlq", "list", sub.name, *args, "--json")
        assert json.loads(out)["messages"] == []
    finally:
        await runner.cleanup()


async def test_redrive_that_fails_again_puts_the_message_back_and_ends(
        broker, start_worker, endpoint: Endpoint, client: Client, topic, redis_url, tmp_path):
    endpoint.behaviour = lambda rec: web.Response(status=500)
    config, settings = worker_yaml(tmp_path, broker.url, redis_url,
                                   push_sub("doomed-push", topic, endpoint.url, dead_letter={"topic": topic + "-dlq"}))
    [sub] = settings.subscriptions
    w = await start_worker(sub)
    [message_id] = client.publish(topic, [b"doomed"])
    await eventually(lambda: w.dispatchers[sub.key].stats.dead_lettered == 1, what="dead-lettered")
    args = ("--config", config, "--json")
    code, out, err = await cli("dlq", "redrive", sub.name, *args, "--rate", "50")
    assert code == 0, err
    assert json.loads(out)["dead_lettered_again"] == 1  # and the command ended: no loop over its own output
    code, out, _ = await cli("dlq", "list", sub.name, *args)
    [back] = json.loads(out)["messages"]
    assert back["message_id"] == message_id and back["last_status"] == "500"
    # A subscription a worker serves from its own file: every command finds it with that file, and
    # without it from the definition the worker publishes (`subs get`, `dlq list` and `queue --state
    # dead` said "invalid configuration" without the file); the registry's commands leave it alone.
    code, out, err = await cli("subs", "get", sub.name, *args)
    assert code == 0, err
    got = json.loads(out)  # one `source`, the status's, as in `subs list`; the definition as the file says it
    assert "source" not in got and got["status"]["source"] == "config" and got["status"]["name"] == sub.name
    assert got["definition"]["topic"] == topic and got["status"]["endpoint"] == "127.0.0.1"
    bare = ("--redis-url", redis_url, "--json")
    code, out, err = await cli("subs", "get", sub.name, *bare)
    assert code == 0, err
    got = json.loads(out)
    assert got["status"]["source"] == "worker" and got["definition"]["topic"] == topic
    assert got["status"]["name"] == sub.name and got["status"]["endpoint"] == "127.0.0.1"
    code, out, err = await cli("dlq", "list", sub.name, *bare, "--service-url", broker.url)
    assert code == 0, err
    assert [m["message_id"] for m in json.loads(out)["messages"]] == [message_id]
    code, out, err = await cli("queue", sub.name, "--state", "dead", *bare, "--service-url", broker.url)
    assert code == 0, err
    code, out, err = await cli("subs", "list", *bare)
    assert code == 0, err
    [row] = [r for r in json.loads(out) if r["name"] == sub.name]
    assert row["source"] == "worker" and row["type"] == "shared" and row["owner"] != "-"
    (tmp_path / "again.yaml").write_text(yaml.safe_dump({"subscriptions": [
        push_sub("doomed-push", topic, endpoint.url)]}))
    code, _, err = await cli("subs", "apply", "-f", str(tmp_path / "again.yaml"), "--redis-url", redis_url)
    assert code == 2 and "is a subscription of a worker's config file (read-only here)" in err, err
    code, _, err = await cli("subs", "delete", sub.key, "--redis-url", redis_url)
    assert code == 2 and "is a subscription of a worker's config file (read-only here)" in err, err


async def test_redrive_of_one_message_replays_it_and_leaves_the_others(
        broker, start_worker, endpoint: Endpoint, client: Client, topic, redis_url, tmp_path):
    healthy = False
    endpoint.behaviour = lambda rec: web.Response(status=204 if healthy else 500)
    config, settings = worker_yaml(tmp_path, broker.url, redis_url, push_sub(
        "replay-push", topic, endpoint.url, max_deliver=1, dead_letter={"topic": topic + "-dlq"}))
    [sub] = settings.subscriptions
    w = await start_worker(sub)
    ids = client.publish(topic, [b"a", b"b", b"c"])
    await eventually(lambda: w.dispatchers[sub.key].stats.dead_lettered == 3, what="all dead-lettered")
    healthy = True
    before = len(endpoint.requests)
    args = ("--config", config, "--json")
    code, out, err = await cli("dlq", "redrive", sub.name, "--message-id", ids[1], *args)
    assert code == 0, err
    assert json.loads(out)["redriven"] == 1
    assert [r.headers["Pubsub-Message-Id"] for r in endpoint.requests[before:]] == [ids[1]]
    code, out, _ = await cli("dlq", "list", sub.name, *args)
    assert sorted(m["message_id"] for m in json.loads(out)["messages"]) == sorted([ids[0], ids[2]])
    code, _, err = await cli("dlq", "redrive", sub.name, "--message-id", "9:9:-1:-1", *args)
    assert code == 3 and "no dead letter 9:9:-1:-1" in err


async def test_dead_letters_are_selected_by_when_they_failed_and_how_and_a_dry_run_moves_nothing(
        broker, start_worker, endpoint: Endpoint, client: Client, topic, redis_url, tmp_path):
    """Recovery by time and status, as Svix and Hermes offer: an outage's 503s and a later batch of
    404s; `--since`/`--until` select by when each was dead-lettered, `--status` by its last status
    (a class or a code); `--dry-run` counts and moves nothing; a redrive takes only what it selects."""
    healthy = False

    def answer(rec):
        if healthy:
            return web.Response(status=204)
        return web.Response(status=503 if rec.body_payload.startswith(b"outage") else 404)

    endpoint.behaviour = answer
    config, settings = worker_yaml(tmp_path, broker.url, redis_url,
                                   push_sub("recover", topic, endpoint.url, dead_letter={"topic": topic + "-dlq"}))
    [sub] = settings.subscriptions
    w = await start_worker(sub)
    outage = client.publish(topic, [b"outage-%d" % i for i in range(3)])
    await eventually(lambda: w.dispatchers[sub.key].stats.dead_lettered == 3, what="the outage's dead letters")
    between = int(time.time() * 1000)
    later = client.publish(topic, [b"refused-%d" % i for i in range(2)])
    await eventually(lambda: w.dispatchers[sub.key].stats.dead_lettered == 5, what="the later dead letters")
    args = ("--config", config, "--json")

    async def listed(*selection: str) -> list[str]:
        code, out, err = await cli("dlq", "list", sub.name, *args, *selection)
        assert code == 0, err
        return sorted(m["message_id"] for m in json.loads(out)["messages"])

    assert await listed("--status", "5xx") == sorted(outage)
    assert await listed("--status", "404") == sorted(later)
    assert await listed("--since", str(between)) == sorted(later)
    assert await listed("--until", str(between), "--status", "4xx", "--status", "5xx") == sorted(outage)
    code, out, err = await cli("dlq", "redrive", sub.name, *args, "--status", "5xx", "--dry-run")
    assert code == 0 and json.loads(out)["would_redrive"] == 3, (out, err)
    assert await listed() == sorted(outage + later)  # the dry run moved nothing

    healthy = True
    code, out, err = await cli("dlq", "redrive", sub.name, *args, "--status", "5xx", "--rate", "50")
    assert code == 0 and json.loads(out)["redriven"] == 3, (out, err)
    assert await listed() == sorted(later)  # the 404s stay for another decision
    code, _, err = await cli("dlq", "list", sub.name, "--config", config, "--since", "yesterday")
    assert code == 2 and "--since: must be an RFC 3339 time" in err, err


@pytest.mark.apache_pulsar  # pulsar-lite refuses (times out) a second consumer on the cursor while one holds messages
async def test_dlq_list_says_when_the_broker_holds_dead_letters_it_did_not_return(
        broker, client: Client, topic, redis_url, tmp_path):
    """Dead letters the cursor holds but the broker does not hand out (another consumer of the cursor
    took them here; pulsar-lite's stalls over its flow limit the same way) are counted from the
    broker's backlog: `dlq list` says so instead of "no dead letters", and lists them once returned."""
    import pulsar

    from tests.support import brokers
    from worker.broker.deadletter import DLQ_CURSOR

    dlq_topic = topic + "-dlq"
    config, _ = worker_yaml(tmp_path, broker.url, redis_url,
                            push_sub("held-push", topic, "https://example.com/push",
                                     dead_letter={"topic": dlq_topic}))
    doc = yaml.safe_load(Path(config).read_text())
    doc["pulsar"].update({"admin_url": brokers.admin_url(broker)} if brokers.admin_url(broker)
                         else {"metrics_url": broker.metrics_url})
    Path(config).write_text(yaml.safe_dump(doc))
    holder = client.client.subscribe(dlq_topic, DLQ_CURSOR, consumer_type=pulsar.ConsumerType.Shared,
                                     initial_position=pulsar.InitialPosition.Earliest, receiver_queue_size=100)
    props = {"pubsub.subscription": "held-push", "pubsub.original_topic": topic, "pubsub.last_status": "503"}
    client.publish(dlq_topic, [b"a", b"b", b"c"], properties=props)
    held = [holder.receive(timeout_millis=10_000) for _ in range(3)]  # taken, not acked: held by this consumer

    code, out, err = await cli("dlq", "list", "held-push", "--config", config)
    assert code == 0, err
    assert "no dead letters returned" in out and "holds 3 more message(s)" in out, out
    code, out, err = await cli("dlq", "list", "held-push", "--config", config, "--json")
    assert json.loads(out)["unreturned"] == 3 and json.loads(out)["messages"] == []

    holder.close()  # back to the cursor: listed now, nothing said of held ones
    code, out, err = await cli("dlq", "list", "held-push", "--config", config, "--json")
    assert code == 0, err
    listed = json.loads(out)
    assert len(listed["messages"]) == 3 and listed["unreturned"] == 0, listed
    assert len(held) == 3
