"""The admin process's shared reads (worker/api/shared_reads.py): pure logic, a fake clock."""

from __future__ import annotations

import asyncio

import pytest

from worker.api.shared_reads import SharedReads


async def test_callers_at_once_share_one_read_and_it_serves_for_a_second_then_is_read_again():
    now = [0.0]
    reads = SharedReads(ttl=1.0, clock=lambda: now[0])
    loads = 0
    gate = asyncio.Event()

    async def load() -> list[int]:
        nonlocal loads
        loads += 1
        await gate.wait()
        return [loads]

    callers = [asyncio.ensure_future(reads.get("list", load)) for _ in range(50)]
    await asyncio.sleep(0)
    gate.set()
    answers = await asyncio.gather(*callers)
    assert loads == 1 and all(a == [1] for a in answers)
    answers[0].append(99)  # a caller's copy is its own
    assert await reads.get("list", load) == [1] and loads == 1
    now[0] = 1.5
    assert await reads.get("list", load) == [2]
    reads.clear()  # a change: read again at once
    assert await reads.get("list", load) == [3]


async def test_a_failed_read_is_no_answer_and_one_caller_giving_up_cancels_nobody_elses():
    reads = SharedReads()
    gate = asyncio.Event()

    async def failing() -> int:
        raise ConnectionError("redis down")

    with pytest.raises(ConnectionError):
        await reads.get("k", failing)

    async def slow() -> int:
        await gate.wait()
        return 7

    first = asyncio.ensure_future(reads.get("k", slow))
    second = asyncio.ensure_future(reads.get("k", slow))
    await asyncio.sleep(0)
    first.cancel()
    gate.set()
    assert await second == 7
