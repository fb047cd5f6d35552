"""Small asyncio helpers the worker's loops share."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any


async def wait_event(event: asyncio.Event, seconds: float) -> bool:
    """Wait until `event` is set or `seconds` pass; True if it was set.

    Not `asyncio.wait_for(event.wait(), ...)`: on Python 3.11 that swallows a cancellation that
    arrives as the event fires (gh-86296), and a loop that misses its cancellation never stops (a
    worker hung in shutdown this way while registry events were arriving)."""
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def wait_any(*events: asyncio.Event, seconds: float) -> None:
    """Wait until one of `events` is set or `seconds` pass."""
    waiters = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


async def cancel_within(tasks: Iterable[asyncio.Task[Any]], seconds: float) -> set[asyncio.Task[Any]]:
    """Cancel `tasks` and wait up to `seconds` for them to end; returns those that did not. Every
    stop waits this way: a task that does not end on its cancel (a client call that never returns)
    must not hold up a shutdown."""
    pending = set(tasks)
    for task in pending:
        task.cancel()
    if not pending:
        return pending
    _, stuck = await asyncio.wait(pending, timeout=seconds)
    return stuck
