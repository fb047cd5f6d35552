"""A worker cut off from its broker, while Redis still answers it.

A partition does not fail anything: the connection hangs, no message arrives, acks go nowhere,
and the worker goes on holding its leases, so no other worker takes its subscriptions. The watch
asks the broker a question every PROBE_EVERY seconds (a topic lookup, which travels the same
connection); after `fleet.broker_lost_after_seconds` without an answer, the worker steps out of the
fleet (`Fleet.step_out`: its subscriptions go to workers that reach the broker) until one comes.
A refusal is an answer: only silence counts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from worker.broker import consumer as pulsar_adapter
from worker.runtime.aio import wait_event

PROBE_EVERY = 2.0  # seconds between lookups
PROBE_TIMEOUT = 5.0  # seconds a lookup may take before it counts as unanswered


class BrokerWatch:
    def __init__(self, pulsar: Any, topic: Callable[[], str], lost_after: float,
                 step_out: Callable[[str], Awaitable[None]], step_in: Callable[[], None],
                 stop: asyncio.Event) -> None:
        self.pulsar = pulsar
        self.topic = topic  # a topic to look up: one this worker serves ("" when none: nothing to lose)
        self.lost_after = lost_after
        self.step_out, self.step_in = step_out, step_in
        self.stop = stop
        self.silent_since: float | None = None
        self.out = False

    async def run(self) -> None:
        last_topic = ""
        while not await wait_event(self.stop, PROBE_EVERY):
            last_topic = self.topic() or last_topic  # stepped out, it serves nothing: ask about the last
            if last_topic:
                await self.probe(last_topic)

    async def probe(self, topic: str) -> None:
        try:
            await asyncio.wait_for(self.pulsar.get_topic_partitions(topic), timeout=PROBE_TIMEOUT)
            answered = True
        except Exception as e:  # a timeout, or the client's error
            answered = pulsar_adapter.answered_by_broker(e)
        now = time.monotonic()
        if answered:
            self.silent_since = None
            if self.out:
                self.out = False
                self.step_in()
            return
        self.silent_since = self.silent_since or now
        if not self.out and now - self.silent_since >= self.lost_after:
            self.out = True
            await self.step_out(f"the broker has not answered for {now - self.silent_since:.0f} s")
