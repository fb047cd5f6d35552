"""Seek (state Seeking), both halves: the operator's command and the worker holding the subscription.

An operator writes a request (`pw:{sub}:seek`) and announces it on the fleet channel; the
worker holding the subscription's lease closes its consumer, moves the cursor, forgets the attempt
counts (the messages come again as new), subscribes again and writes the result
(`pw:{sub}:seek-result`). When no worker
holds the lease (paused, unowned), the operator's command does the same with a consumer of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
import pulsar.asyncio as pulsar_async

from worker.core import keys
from worker.fleet import leases, ownership
from worker.fleet.registry import delete_matching
from worker.model.config import PulsarSettings
from worker.model.subscriptions import Subscription
from worker.runtime.errors import PushWorkerError
from worker.state.redis_client import AsyncClient

SEEK_TTL_SECONDS = 300
SEEK_TRIES = 3
DRAIN_QUIET_SECONDS = 1.0  # no message for this long: the backlog is drained
SEEK_COMMAND = "seek-command-"  # how a lease held by a seek or purge command (not a worker) starts


@dataclass(frozen=True)
class SeekTarget:
    """Where to move the cursor: `earliest`, `latest`, or a publish time in ms since the epoch."""

    to: str | int

    def publish_time_ms(self) -> int:
        """`earliest` or a time, as a publish time: seeking by time works the same on Apache Pulsar
        and pulsar-lite (whose seek to MessageId.earliest fails with a disconnect)."""
        return 0 if self.to == "earliest" else int(self.to)

    def describe(self) -> str:
        if isinstance(self.to, int):
            from worker.core.messages import rfc3339

            return rfc3339(self.to)
        return str(self.to)


async def seek_with_own_consumer(client: pulsar_async.Client, sub: Subscription, target: SeekTarget) -> None:
    """Move the subscription's cursor through a consumer of our own. Call it while no other consumer
    of the subscription is attached: the next consumer to attach starts from the new position.

    Both targets go by publish time, the broker's own seek: `earliest` is time 0, `latest` is now
    (past every message published so far, in one step whatever the backlog), and so is a time
    still to come. pulsar-lite refuses a seek past its last message (it drops the connection and
    leaves the cursor): then `latest` acknowledges the backlog up to now instead (Shared
    subscriptions cannot ack cumulatively)."""
    from worker.broker import consumer as pulsar_adapter

    cutoff = int(time.time() * 1000)
    position = cutoff if target.to == "latest" else min(target.publish_time_ms(), cutoff)
    consumer = await pulsar_adapter.subscribe(client, sub, "push-worker-seek", receiver_queue_size=1)
    try:
        await consumer.seek(position)
        return
    except pulsar_async.PulsarException:
        if position != cutoff:
            raise
    finally:
        with contextlib.suppress(Exception):  # after a refused seek the broker may have dropped it already
            await asyncio.wait_for(consumer.close(), timeout=5.0)
    await _acknowledge_until(client, sub, cutoff)


async def _acknowledge_until(client: pulsar_async.Client, sub: Subscription, cutoff_ms: int) -> None:
    """Acknowledge every message published before `cutoff_ms`; newer ones stay for delivery."""
    from worker.broker import consumer as pulsar_adapter

    consumer = await pulsar_adapter.subscribe(client, sub, "push-worker-purge", receiver_queue_size=1000)
    try:
        while True:
            try:
                message = await asyncio.wait_for(consumer.receive(), DRAIN_QUIET_SECONDS)
            except TimeoutError:
                return
            if message.publish_timestamp() > cutoff_ms:
                return
            await consumer.acknowledge(message)
    finally:
        await asyncio.wait_for(consumer.close(), timeout=5.0)


async def forget_attempts(client: AsyncClient, sub_key: str) -> int:
    """Delete the attempt counters of one subscription, of both layouts, and layout 2's buckets of
    messages acked at their first attempt (a message sought back is delivered again); histories stay.
    Returns how many counters went."""
    counted = await delete_matching(client, keys.message_pattern(sub_key))
    counted += await delete_matching(client, keys.attempt_pattern(sub_key))
    await delete_matching(client, keys.acked_pattern(sub_key))
    return counted


async def request_seek(client: AsyncClient, channel: str, sub_key: str, target: SeekTarget, request_id: str) -> None:
    await client.set(keys.seek_key(sub_key), orjson.dumps({"id": request_id, "to": target.to}), ex=SEEK_TTL_SECONDS)
    await client.delete(keys.seek_result_key(sub_key))
    await client.publish(channel, b"seek " + sub_key.encode())


class UnreadableSeekRequest(ValueError):
    """The pending seek request is not one a command wrote (it was removed all the same)."""


async def run_seek_request(client: AsyncClient, sub_key: str, worker_id: str,
                           seek: Callable[[str, SeekTarget], Awaitable[int]], log: Any) -> None:
    """Carry out the subscription's pending seek request, if any, with `seek` (the worker's: it
    stops the dispatcher, moves the cursor, forgets the counts, serves again), and write the result
    for the operator's command."""
    try:
        request = await take_seek_request(client, sub_key)
    except (ValueError, TypeError, KeyError) as e:
        raise UnreadableSeekRequest(f"{type(e).__name__}: {e}") from None
    if request is None:
        return
    request_id, target = request
    from worker.broker.consumer import broker_error_text, transient

    log.info("seeking", subscription=sub_key, to=target.describe())
    attempt = 0
    try:
        async with asyncio.timeout(60):
            for attempt in range(1, SEEK_TRIES + 1):
                try:
                    forgotten = await seek(sub_key, target)
                    break
                except Exception as e:
                    if attempt == SEEK_TRIES or not transient(e):  # a dropped connection: the next try may pass
                        raise
                    log.warning("seek interrupted; trying again", subscription=sub_key, error=broker_error_text(e))
                    await asyncio.sleep(0.5 * attempt)
    except Exception as e:
        log.warning("seek failed", subscription=sub_key, error=broker_error_text(e))
        await write_seek_result(client, sub_key, request_id, status="failed", worker=worker_id,
                                error=broker_error_text(e), tries=attempt)
        return
    await write_seek_result(client, sub_key, request_id, status="done", worker=worker_id,
                            forgotten_attempts=forgotten)
    log.info("seek done", subscription=sub_key, to=target.describe())


async def take_seek_request(client: AsyncClient, sub_key: str) -> tuple[str, SeekTarget] | None:
    """The pending request for this subscription, removed so that it runs once."""
    raw = await client.getdel(keys.seek_key(sub_key))
    if raw is None:
        return None
    data = orjson.loads(raw)
    to = data["to"]
    if to not in ("earliest", "latest") and not (type(to) is int and 0 <= to < 2**63):
        raise ValueError(f"no seek target: {to!r}")
    return str(data["id"]), SeekTarget(to)


async def write_seek_result(client: AsyncClient, sub_key: str, request_id: str, **fields: Any) -> None:
    await client.set(keys.seek_result_key(sub_key), orjson.dumps({"id": request_id, **fields}), ex=SEEK_TTL_SECONDS)


async def seek_result(client: AsyncClient, sub_key: str, request_id: str) -> dict[str, Any] | None:
    raw = await client.get(keys.seek_result_key(sub_key))
    if raw is None:
        return None
    data: dict[str, Any] = orjson.loads(raw)
    return data if data.get("id") == request_id else None


# -- the operator's half ------------------------------------------------------------------------

async def seek_by_command(client: AsyncClient, fleet: str, channel: str, key: str, target: SeekTarget,
                          definition: Callable[[], Awaitable[Subscription]], pulsar: PulsarSettings,
                          lease_seconds: float, wait: float) -> dict[str, Any]:
    """Have the cursor moved and the attempt counts forgotten: by the worker serving it, or, when
    none does, by this command under the lease. Returns the result (`status` `done` or not)."""
    request_id = uuid.uuid4().hex
    deadline = time.monotonic() + wait
    while True:
        owner = (await ownership.owners(client, fleet, key, 1))[0]
        if not owner:
            # The command holds the lease while it seeks: a worker starting meanwhile would attach a
            # consumer before the cursor moved and deliver what it took from the old position (layout
            # 2's owners refuse a held lease too; one that took its record just before goes first).
            async with leases.hold(client, key, SEEK_COMMAND + request_id[:8], lease_seconds) as held:
                if held and (await ownership.record_owners(client, fleet, key, 1))[0]:
                    continue  # a worker took it just now: asked of that worker, next time round
                if held:
                    await _seek_directly(await definition(), target, pulsar)
                    return {"status": "done", "worker": "this command (no worker serves it)",
                            "forgotten_attempts": await forget_attempts(client, key)}
        elif not owner.startswith(SEEK_COMMAND):
            return await _seek_by_worker(client, channel, key, target, request_id, owner, deadline, wait)
        elif time.monotonic() > deadline:
            raise PushWorkerError(f"{key}: another seek or purge of it ({owner}) did not end "
                                  f"within {wait:g}s; run the command again once it has")
        else:  # another seek or purge command is moving the cursor: this one goes after it
            await asyncio.sleep(0.2)


async def _seek_by_worker(client: AsyncClient, channel: str, key: str, target: SeekTarget, request_id: str,
                          owner: str, deadline: float, wait: float) -> dict[str, Any]:
    await request_seek(client, channel, key, target, request_id)
    while (result := await seek_result(client, key, request_id)) is None:
        if time.monotonic() > deadline:
            raise PushWorkerError(f"{key}: worker {owner} did not answer the seek within {wait:g}s (the request "
                                  f"stays for {SEEK_TTL_SECONDS}s)")
        await asyncio.sleep(0.2)
    return result


async def _seek_directly(sub: Subscription, target: SeekTarget, settings: PulsarSettings) -> None:
    from worker.broker.consumer import open_client

    async with open_client(settings) as client:
        await seek_with_own_consumer(client, sub, target)
