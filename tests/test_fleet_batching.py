"""The fleet's per-subscription Redis work at scale: a thousand leases renewed and a thousand
status reports written as batched script calls (`redis_batch`), on every Redis topology. As
separate commands they held a worker's event loop for about 100 ms every few seconds, and every
delivery waited (p99 latency of 60-100 ms with a thousand subscriptions)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis

from devtools.fleet_scale import SimulatedWorker, scale_subscription
from tests.support.helpers import eventually
from tests.support.redis_targets import ALL_REDIS, RedisTarget
from worker.core import keys
from worker.fleet import Fleet, seek
from worker.fleet.ownership import owners_now
from worker.model.config import FleetSettings, RedisSettings
from worker.state import redis_client

COUNT = 1000


def _script_calls(client: Any, mode: str) -> int:
    """EVAL and EVALSHA calls Redis received (the commands inside scripts are counted apart)."""
    nodes = client.info("commandstats", target_nodes="primaries").values() if mode == "cluster" else [
        client.info("commandstats")]
    return sum(int(n.get(f"cmdstat_{c}", {}).get("calls", 0)) for n in nodes for c in ("eval", "evalsha"))


def _commands(client: Any, mode: str) -> int:
    """Every command Redis ran, those inside scripts included."""
    nodes = client.info("commandstats", target_nodes="primaries").values() if mode == "cluster" else [
        client.info("commandstats")]
    return sum(int(stats["calls"]) for n in nodes for name, stats in n.items() if name.startswith("cmdstat_")
               and name not in ("cmdstat_info",))


@ALL_REDIS
async def test_a_thousand_subscriptions_are_taken_in_a_few_commands_and_cost_nothing_at_idle(redis_target: RedisTarget):
    # Layout 2 (a fresh Redis): an owner record each, written in batched script calls when taken,
    # and nothing per subscription afterwards: the heartbeat is the lease of all of them.
    subs = tuple(scale_subscription(i) for i in range(COUNT))
    client = redis_client.connect(redis_target.settings, socket_timeout=10)
    sync = redis_target.client()
    fleet = Fleet(SimulatedWorker("w-owner"), client,
                  FleetSettings(name=f"owner-{time.monotonic_ns()}", lease_seconds=6.0, heartbeat_seconds=1.0), subs)
    try:
        await fleet.tick()  # joins: it takes subscriptions once the members stayed the same for two rounds
        assert not fleet.leases
        await eventually(lambda: fleet._settled(), timeout=10, what="the members settled")
        before = _script_calls(sync, redis_target.mode)
        await fleet.tick()  # (the only member) takes every subscription and reports it
        calls = _script_calls(sync, redis_target.mode) - before
        assert len(fleet.leases) == COUNT and not sync.exists(keys.lease_key(subs[0].key))
        assert owners_now(sync, fleet.settings.name, [s.key for s in subs[::97]]) == {
            s.key: ["w-owner"] for s in subs[::97]}
        # Taken and reported: one script call per 200 of each on one server (and the heartbeat); on a
        # Cluster one per subscription of each (a script call stays within one slot), and the take
        # and the report twice there: their scripts are not loaded yet (NOSCRIPT, then EVAL).
        limit = 4 * COUNT + 10 if redis_target.mode == "cluster" else 2 * COUNT // 200 + 10
        assert calls <= limit, f"{calls} script calls to take {COUNT} subscriptions"

        commands = _commands(sync, redis_target.mode)
        for _ in range(3):
            await fleet.tick()
        idle = _commands(sync, redis_target.mode) - commands
        # A round's own: the heartbeat script (7 commands), the layout's GET, now and then the
        # registry's version and the `reads` key.
        assert idle <= 3 * 12, f"{idle} commands in three idle rounds with {COUNT} subscriptions"
        assert all(lease.valid() for lease in fleet.leases.values())
    finally:
        await fleet.batch.close()
        await client.aclose()
        sync.close()


@ALL_REDIS
async def test_a_thousand_layout_1_leases_renew_and_report_in_a_few_commands(redis_target: RedisTarget):
    subs = tuple(scale_subscription(i) for i in range(COUNT))
    client = redis_client.connect(redis_target.settings, socket_timeout=10)
    sync = redis_target.client()
    sync.set(keys.layout_key(), 1)  # a Redis 1.1.0 ran on, not switched yet
    fleet = Fleet(SimulatedWorker("w-batch"), client,
                  FleetSettings(name=f"batch-{time.monotonic_ns()}", lease_seconds=6.0, heartbeat_seconds=1.0), subs)
    try:
        await fleet.tick()  # joins, and (the only member) acquires every lease and reports it
        assert len(fleet.leases) == COUNT
        for sub in subs[::97]:
            status = sync.hgetall(keys.status_key(sub.key))
            assert status[b"owner"] == b"w-batch" and status[b"state"] == b"Starting"
            assert sync.pttl(keys.status_key(sub.key)) > 0

        for lease in fleet.leases.values():
            lease.valid_until = time.monotonic()  # due: this round loads the script (NOSCRIPT, then EVAL)
        await fleet.tick()

        # Someone else holds one lease now (it lapsed and was taken): that one is lost, not renewed.
        taken = subs[5].key
        sync.set(keys.lease_key(taken), "w-other", px=6000)
        for lease in fleet.leases.values():
            lease.valid_until = time.monotonic()  # every lease due for renewal
        sync.pexpire(keys.lease_key(subs[7].key), 3000)  # short of the full TTL, not lapsing under load
        fleet.status._at = 0.0  # the status reports are due too
        before = _script_calls(sync, redis_target.mode)
        await fleet.tick()
        calls = _script_calls(sync, redis_target.mode) - before

        assert taken not in fleet.leases and len(fleet.leases) == COUNT - 1
        assert sync.get(keys.lease_key(taken)) == b"w-other"
        assert sync.pttl(keys.lease_key(subs[7].key)) > 5000  # renewed to the full TTL
        assert all(lease.valid() for lease in fleet.leases.values())
        # One script call per 200 renewals on one server (and the heartbeat); on a Cluster one per
        # subscription: a script call stays within one slot, and each subscription has its own.
        limit = COUNT + 2 if redis_target.mode == "cluster" else 10
        assert calls <= limit, f"{calls} script calls for {COUNT} renewals"
    finally:
        sync.delete(keys.layout_key())
        await fleet.batch.close()
        await client.aclose()
        sync.close()


async def test_a_lease_released_while_its_renewal_was_out_does_not_fail_the_round(redis_url: str):
    # Hand-overs drain in the background and drop their lease when they end, which can fall between
    # a round sending its renewals and reading the answers. The round looked the lease up again
    # and failed (KeyError): the fleet loop, heartbeat and renewals of every other lease with it.
    subs = tuple(scale_subscription(i) for i in range(2))
    client = redis_client.connect(RedisSettings(url=redis_url), socket_timeout=10)
    sync = redis.Redis.from_url(redis_url)
    sync.set(keys.layout_key(), 1)  # layout 1: a lease each, renewed
    fleet = Fleet(SimulatedWorker("w-race"), client,
                  FleetSettings(name=f"race-{time.monotonic_ns()}", lease_seconds=6.0, heartbeat_seconds=1.0), subs)
    try:
        await fleet.tick()
        assert len(fleet.leases) == 2
        for lease in fleet.leases.values():
            lease.valid_until = time.monotonic()  # both due for renewal this round
        sync.execute_command("CLIENT", "PAUSE", 500, "ALL")  # the renewals wait in Redis
        round_ = asyncio.create_task(fleet.tick())
        await eventually(lambda: fleet.batch._flusher is not None and not fleet.batch._flusher.done(),
                         what="the renewals sent")
        released = subs[0].key
        del fleet.leases[released]  # what a hand-over does when its drain ends
        await asyncio.wait_for(round_, timeout=10)
        assert fleet.leases[subs[1].key].valid(), "the other lease was renewed"
    finally:
        sync.delete(keys.layout_key())
        await fleet.batch.close()
        await client.aclose()
        sync.close()


async def test_a_seek_asked_while_nobody_served_the_subscription_is_made_by_its_next_owner(redis_url: str):
    # Layout 2 (a fresh Redis): the worker that takes the subscription carries out the pending request.
    sub = scale_subscription(0)
    client = redis_client.connect(RedisSettings(url=redis_url))
    sync = redis.Redis.from_url(redis_url)
    fleet = Fleet(SimulatedWorker("w-seek"), client,
                  FleetSettings(name=f"seek-{time.monotonic_ns()}", lease_seconds=6.0, heartbeat_seconds=1.0), (sub,))
    try:
        await seek.request_seek(client, fleet.registry.channel, sub.key, seek.SeekTarget("earliest"), "r-1")
        await fleet.tick()
        await eventually(lambda: fleet._settled(), timeout=10, what="the members settled")
        await fleet.tick()  # takes it, and with it the request
        assert sub.key in fleet.leases
        await eventually(lambda: sync.exists(keys.seek_result_key(sub.key)), timeout=10, what="the seek's result")
        result = await seek.seek_result(client, sub.key, "r-1")
        assert result is not None and result["status"] == "done" and result["worker"] == "w-seek", result
        assert not sync.exists(keys.seek_key(sub.key))
    finally:
        await asyncio.gather(*fleet._seeks, return_exceptions=True)
        await fleet.batch.close()
        await client.aclose()
        sync.close()
