"""A subscription's breaker (`deliver.push.breaker`): an endpoint that fails every attempt for
`open_after_seconds` suspends the subscription; then only a probe goes every
`probe_interval_seconds`, the messages wait uncounted, nothing is dead-lettered because the
endpoint was down, and the first acked probe (or `subs resume`) closes it."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiohttp import web

from tests.support.builders import push_sub
from tests.support.endpoints import Endpoint, Received
from tests.support.helpers import cli, eventually
from tests.support.pulsar_client import Client
from worker.core.breaker import Breaker
from worker.core.endpoint_health import EndpointHealth
from worker.fleet.registry import Registry
from worker.model.subscriptions import BreakerPolicy, State, parse_subscription
from worker.runtime.errors import ConfigError


async def suspended(start_worker, client: Client, redis: aioredis.Redis, definition: dict, messages: int,
                    breaker: dict) -> tuple[Any, Any]:
    """Apply `definition` with `breaker`, publish `messages`, start a worker; returns its dispatcher
    once the breaker has opened."""
    definition["deliver"]["push"]["breaker"] = breaker
    await Registry(redis, "default").apply_all([definition])
    client.publish(definition["topic"], [b"m%d" % i for i in range(messages)])
    w = await start_worker()
    key = "p-test/" + definition["name"]
    await eventually(lambda: key in w.dispatchers and w.dispatchers[key].state is State.SUSPENDED, timeout=30,
                     what="the breaker opens")
    return w, w.dispatchers[key]


def down_for(seconds: float) -> tuple[Any, list[float]]:
    """An endpoint behaviour answering 503 for `seconds` from its first request, then 204; and the
    list that gets the moment it comes back."""
    down_until: list[float] = []

    def behaviour(r: Received) -> web.Response:
        if not down_until:
            down_until.append(r.at + seconds)
        return web.Response(status=503 if r.at < down_until[0] else 204)

    return behaviour, down_until


def failing_for(health: EndpointHealth, seconds: float, failures: int = 3) -> None:
    for _ in range(failures):
        health.record(False, "503")
    health.failing_since -= seconds


@pytest.mark.broker_independent
async def test_the_breaker_opens_after_a_failing_streak_and_hands_the_probe_to_the_oldest_message():
    health = EndpointHealth()
    changes: list[bool] = []
    breaker = Breaker(health, BreakerPolicy(open_after_seconds=10, probe_interval_seconds=0.05),
                      on_change=lambda: changes.append(breaker.is_open))
    failing_for(health, 9)
    assert not breaker.holds()  # failing, but not for 10 s yet
    failing_for(health, 1)
    assert breaker.holds() and breaker.is_open and changes == [True]

    young, old = asyncio.create_task(breaker.turn(2_000)), asyncio.create_task(breaker.turn(1_000))
    done, _ = await asyncio.wait({young, old}, return_when=asyncio.FIRST_COMPLETED)
    assert done == {old} and old.result() != 0  # the oldest message probes; the other waits
    assert not young.done()
    breaker.probed(old.result(), False)  # the probe failed: the next one goes an interval later, to the next oldest
    breaker.probed(old.result(), None)  # a second word on the same probe changes nothing
    second = await young
    assert second not in (0, old.result())
    breaker.probed(second, True)  # acked: closed, and whoever waits goes on as usual
    assert not breaker.is_open and changes == [True, False]
    assert health.failures_in_row == 0 and not breaker.holds()


@pytest.mark.broker_independent
async def test_an_open_breaker_releases_every_waiter_when_closed_by_hand_or_turned_off():
    health = EndpointHealth()
    breaker = Breaker(health, BreakerPolicy(open_after_seconds=1, probe_interval_seconds=3600))
    failing_for(health, 2)
    assert breaker.holds()
    waiting = [asyncio.create_task(breaker.turn(i)) for i in range(5)]
    await asyncio.sleep(0)
    assert not any(t.done() for t in waiting)  # no probe for an hour
    breaker.close()
    assert await asyncio.gather(*waiting) == [0] * 5  # none of them a probe: they go on as usual
    failing_for(health, 2)
    assert breaker.holds()
    breaker.set_policy(None)  # `breaker: off` by a live edit
    assert not breaker.is_open and not breaker.holds()


@pytest.mark.broker_independent
def test_the_breaker_is_on_by_default_and_checked_at_load():
    def parsed(breaker: object):
        push = {"url": "https://example.com/h"} if breaker is None else {"url": "https://example.com/h",
                                                                         "breaker": breaker}
        return parse_subscription(push_sub("s", "persistent://p-a/main/t", "https://example.com/h")
                                  | {"deliver": {"mode": "push", "push": push}}).breaker

    assert parsed(None) == BreakerPolicy(300, 30)
    assert parsed("off") is None and parsed(False) is None  # YAML reads a bare `off` as false
    assert parsed({"open_after_seconds": 10}) == BreakerPolicy(10, 30)
    for bad, says in (("on", "breaker: must be off or"), ({"open_after_seconds": 0}, "open_after_seconds: must be in"),
                      ({"probe_interval_seconds": "5"}, "probe_interval_seconds: must be a number"),
                      ({"open_after": 5}, "open_after: is not a known field")):
        with pytest.raises(ConfigError, match=says):
            parsed(bad)


@pytest.mark.timeout(240)  # the outage alone is two minutes
@pytest.mark.broker_independent  # the breaker's timing: no broker difference touches it (lane time bounded)
async def test_an_endpoint_down_for_two_minutes_dead_letters_nothing_and_gets_only_probes(
        start_worker, endpoint: Endpoint, client: Client, topic, redis_url):
    """Down for 120 s with S = 10 and P = 5: the subscription is Suspended (state, reason, metric),
    once open only probes reach the endpoint (one per P), nothing is dead-lettered, and every
    message is delivered once it is back; the probes used up no attempts."""
    endpoint.behaviour, down_until = down_for(120)
    definition = push_sub("flaky", topic, endpoint.url, max_deliver=6, dead_letter={"topic": topic + "-dlq"},
                          retry={"min_backoff_seconds": 3, "max_backoff_seconds": 3})
    # Attempts at 0, 3, 6, 9 s fail; the breaker opens at 10 s, before the 6th and last attempt.
    redis = aioredis.Redis.from_url(redis_url)
    w, dispatcher = await suspended(start_worker, client, redis, definition, 20,
                                    {"open_after_seconds": 10, "probe_interval_seconds": 5})
    opened_at = dispatcher.breaker.opened_at
    assert opened_at is not None and "breaker open since" in dispatcher.state_reason
    assert w.metrics.registry.get_sample_value("pushworker_subscription_state", {
        "project": "p-test", "subscription": "flaky", "state": "Suspended"}) == 1
    code, out, _ = await cli("subs", "get", "flaky", "--redis-url", redis_url, "--json")
    assert code == 0 and json.loads(out)["breaker"] == {"open_after_seconds": 10, "probe_interval_seconds": 5}

    await eventually(lambda: len({r.body for r in endpoint.requests if r.acked}) == 20, timeout=180,
                     what="every message delivered once the endpoint is back")
    back = down_until[0]
    # Once open, only probes reached the endpoint: at most one per interval until it came back (the
    # requests sent before it opened all arrived before it did).
    during = [r for r in endpoint.requests if opened_at < r.at < back]
    assert 0 < len(during) <= (back - opened_at) / 5 + 1, len(during)
    assert all(r.headers["Pubsub-Subscription"] == "flaky" for r in during)
    assert dispatcher.stats.dead_lettered == 0 and not w.metrics.registry.get_sample_value(
        "pushworker_messages_dead_lettered_total", {"project": "p-test", "subscription": "flaky"})
    # Probes are numbered like any attempt (a message's numbers only go up) but used up none: the
    # probed messages went past max_deliver and were still delivered, not dead-lettered.
    for copies in endpoint.by_id().values():
        numbers = [int(r.headers["Pubsub-Delivery-Attempt"]) for r in copies]
        assert numbers == sorted(set(numbers)), numbers
    assert max(int(r.headers["Pubsub-Delivery-Attempt"]) for r in endpoint.requests) > 6
    await eventually(lambda: dispatcher.state is State.ACTIVE, what="closed again")
    await redis.aclose()


async def test_subs_resume_closes_an_open_breaker_at_once(start_worker, endpoint: Endpoint, client: Client, topic,
                                                          redis_url):
    """A breaker that would not probe for an hour: `subs list` shows the subscription Suspended with
    the reason, and `subs resume` closes it within a heartbeat; the messages go at once."""
    endpoint.behaviour = lambda r: web.Response(status=500)
    definition = push_sub("held", topic, endpoint.url, max_deliver=-1)
    redis = aioredis.Redis.from_url(redis_url)
    _, dispatcher = await suspended(start_worker, client, redis, definition, 10,
                                    {"open_after_seconds": 1, "probe_interval_seconds": 3600})

    async def listed() -> dict:
        code, out, _ = await cli("subs", "list", "--redis-url", redis_url, "--json")
        assert code == 0
        return next(row for row in json.loads(out) if row["name"] == "held")

    async def shows_suspended() -> bool:
        row = await listed()
        return row["state"] == "Suspended" and "breaker open since" in row["reason"]

    await eventually(shows_suspended, timeout=20, what="subs list shows it Suspended")
    endpoint.behaviour = None  # back; but no probe would come for an hour
    sent = len(endpoint.requests)
    code, out, err = await cli("subs", "resume", "held", "--redis-url", redis_url)
    assert code == 0 and "breaker closed" in out, (out, err)
    resumed = time.monotonic()
    await eventually(lambda: len({r.body for r in endpoint.requests[sent:] if r.acked}) == 10,
                     what="delivered after the resume")
    assert time.monotonic() - resumed < 10
    assert dispatcher.state is State.ACTIVE
    await redis.aclose()


@pytest.mark.timeout(180)
async def test_the_breaker_decides_before_an_outage_dead_letters_anything(
        start_worker, endpoint: Endpoint, client: Client, topic):
    """An endpoint that goes down as 100 messages arrive, `max_deliver: 3`, backoff 0.2-1 s, a breaker
    of 5 s / 2 s: every message's last attempt waits for the breaker, which opens; none is dead-lettered,
    only probes reach the endpoint while it is open, and everything is delivered once it is back.
    Before, all 100 were dead-lettered within 2 s of the outage's start."""
    endpoint.behaviour, down_until = down_for(15)
    definition = push_sub("outage", topic, endpoint.url, max_deliver=3, dead_letter={"topic": topic + "-dlq"},
                          retry={"min_backoff_seconds": 0.2, "max_backoff_seconds": 1})
    definition["deliver"]["push"]["breaker"] = {"open_after_seconds": 5, "probe_interval_seconds": 2}
    sub = parse_subscription(definition, trusted=True)
    w = await start_worker(sub)
    client.publish(topic, [b"m%d" % i for i in range(100)])
    dispatcher = w.dispatchers[sub.key]
    await eventually(lambda: dispatcher.breaker.is_open, timeout=30, what="the breaker opens")
    opened_at = time.monotonic()
    await eventually(lambda: len({r.body for r in endpoint.requests if r.acked}) == 100, timeout=120,
                     what="every message delivered once the endpoint is back")
    assert dispatcher.stats.dead_lettered == 0
    back = down_until[0]
    sent_while_open = [r for r in endpoint.requests if opened_at + 0.5 < r.at < back]  # after its last in flight
    assert len(sent_while_open) <= (back - opened_at) / 2 + 1, len(sent_while_open)
    for copies in endpoint.by_id().values():  # numbers only go up, whatever was held back unsent
        numbers = [int(r.headers["Pubsub-Delivery-Attempt"]) for r in copies]
        assert numbers == sorted(set(numbers)), numbers


async def test_a_message_that_fails_alone_is_dead_lettered_on_time(start_worker, endpoint: Endpoint, client: Client,
                                                                    topic):
    """Its endpoint acks the other messages: the breaker (on, by default) has nothing to decide, and the
    message is dead-lettered after its max_deliver attempts, within its backoff's time."""
    endpoint.behaviour = lambda r: web.Response(status=500 if r.body_payload == b"poison" else 204)
    definition = push_sub("alone", topic, endpoint.url, max_deliver=3, dead_letter={"topic": topic + "-dlq"},
                          retry={"min_backoff_seconds": 0.2, "max_backoff_seconds": 1})
    del definition["deliver"]["push"]["breaker"]  # the product's default: on
    sub = parse_subscription(definition, trusted=True)
    assert sub.breaker == BreakerPolicy(300, 30)
    w = await start_worker(sub)
    dispatcher = w.dispatchers[sub.key]
    client.publish(topic, [b"poison"])
    began = time.monotonic()
    while dispatcher.stats.dead_lettered == 0 and time.monotonic() - began < 30:
        client.publish(topic, [b"healthy"])  # the others keep being acked meanwhile
        await asyncio.sleep(0.1)
    took = time.monotonic() - began
    assert dispatcher.stats.dead_lettered == 1 and took < 3.5, took  # backoffs 0.2 + 0.4 s, and the stream's pace
    poisoned = [r for r in endpoint.requests if r.body_payload == b"poison"]
    assert [int(r.headers["Pubsub-Delivery-Attempt"]) for r in poisoned] == [1, 2, 3]
