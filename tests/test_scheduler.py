"""The fair share of the event loop across projects (core/scheduler.py): pure logic, on a real loop."""

from __future__ import annotations

import asyncio

import pytest

from worker.core import scheduler
from worker.core.scheduler import FairShare, cost_of

pytestmark = pytest.mark.broker_independent


async def test_one_project_alone_never_waits():
    share = FairShare(per_turn=4)
    for _ in range(1000):
        await share.turn("p-a")
    assert share.waited == 0


async def test_a_project_arriving_behind_a_flood_is_served_in_the_next_round():
    """p-noisy has 500 turns waiting; p-good's one turn is granted within the next turns of the loop
    (its task asks in the turn after it was made, and is served in the one after that), not after the 500."""
    share = FairShare(per_turn=8)
    order: list[str] = []
    told: list[int] = []
    share.on_wait = lambda: told.append(1)  # the worker counts them: pushworker_fair_share_waits_total

    async def work(project: str) -> None:
        await share.turn(project)
        order.append(project)

    await share.turn("p-good")  # both projects active: contended
    await share.turn("p-noisy")
    noisy = [asyncio.ensure_future(work("p-noisy")) for _ in range(500)]
    await asyncio.sleep(0)  # the flood is queued (or granted up to the turn's units)
    good = asyncio.ensure_future(work("p-good"))
    await asyncio.gather(good, *noisy)
    assert share.waited > 0 and len(told) == share.waited
    assert order.index("p-good") <= 3 * 8, order.index("p-good")


async def test_costs_are_paid_in_deficit_round_robin():
    """Two projects waiting, one with messages of cost 8, one of cost 1: per the same rounds, the
    cheap one is granted about eight turns for each of the other's."""
    share = FairShare(per_turn=16)
    order: list[str] = []

    async def work(project: str, cost: int) -> None:
        await share.turn(project, cost)
        order.append(project)

    await share.turn("p-large")
    await share.turn("p-small")
    share._granted = share.per_turn  # the turn's units used up: everything now queues
    tasks = [asyncio.ensure_future(work("p-large", 8)) for _ in range(20)]
    tasks += [asyncio.ensure_future(work("p-small", 1)) for _ in range(160)]
    await asyncio.gather(*tasks)
    first = order[:90]
    small, large = first.count("p-small"), first.count("p-large")
    assert large >= 1 and 6 <= small / large <= 10, (small, large)


async def test_a_cancelled_turn_leaves_no_waiter_behind():
    share = FairShare(per_turn=1)
    await share.turn("p-a")
    await share.turn("p-b")
    waiting = asyncio.ensure_future(share.turn("p-a"))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await share.turn("p-b")  # served, not stuck behind the cancelled one
    assert not share._queues


async def test_contention_ends_when_only_one_project_is_left(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(scheduler.time, "monotonic", lambda: clock[0])
    share = FairShare(per_turn=2)
    await share.turn("p-a")
    await share.turn("p-b")
    assert share.contended()
    clock[0] += scheduler.CONTENTION_SECONDS * 2
    for _ in range(100):
        await share.turn("p-b")
    assert share.waited == 0


def test_a_message_costs_one_unit_and_one_more_per_64_kib():
    assert cost_of(0) == 1 and cost_of(1024) == 1
    assert cost_of(64 << 10) == 2
    assert cost_of(4 << 20) == 65
