"""Intake: messages taken from the consumer within the subscription's bounds (`max_ack_pending`
messages, held bytes), read, and handed on once each; and given back when settled."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from worker.core.budgets import LARGE_MESSAGE_BYTES, ByteBudget, prefetch_bytes, too_large
from worker.core.context import ConsumerLike, Shared
from worker.core.flow import Window
from worker.core.messages import Envelope, format_message_id, memory_per_payload_byte
from worker.core.scheduler import cost_of

INTAKE_PER_TURN = 32  # messages taken from the client in one turn of the loop


def _raw_id(message: Any) -> str:
    try:
        mid = message.message_id()
        return format_message_id(mid)
    except Exception:
        return f"unreadable-{id(message)}"


def _raw_data(message: Any) -> bytes:
    try:
        return bytes(message.data() or b"")
    except Exception:
        return b""


class Intake:
    """The receive loop and the bounds it keeps. Each message taken goes to `route` once: a copy the
    broker hands out again while one is in hand is given back at once."""

    def __init__(self, shared: Shared, consumer: ConsumerLike, to_envelope: Callable[[Any], Envelope],
                 route: Callable[[Any, Envelope], None], prefetch: int,
                 on_large_message: Callable[[int], None] | None) -> None:
        self._shared = shared
        self._consumer = consumer
        self._to_envelope = to_envelope
        self._route = route
        self.window = Window(shared.sub.max_ack_pending)
        ctx = shared.ctx
        self.held = ByteBudget(ctx.max_held_bytes, ctx.memory)  # its own bound, and its share of the worker's
        # Memory a message costs per payload byte; fixed for this dispatcher, so what a message gives
        # back is what it took even if the subscription's format changes meanwhile.
        self._held_per_byte = memory_per_payload_byte(shared.sub)
        # A message above this size tells `on_large_message` (once per size): the consumer's
        # prefetch holds too many bytes of such messages and is to be made smaller,
        self._on_large_message = on_large_message
        # or (the first of LARGE_MESSAGE_BYTES or more) that it is to move to a connection of its own.
        self._too_large = 1 << 62
        if on_large_message is not None:
            shrinks = too_large(prefetch, prefetch_bytes(ctx.max_held_bytes)) if prefetch > 1 else 1 << 62
            self._too_large = min(shrinks, LARGE_MESSAGE_BYTES - 1)
        self._reserved = 0  # 1 while the receive loop holds a slot for a message not yet received
        self._share = ctx.share
        self._project = shared.sub.tenant
        self.active: dict[str, int] = {}  # message ids taken and not yet settled: their publish times

    @property
    def unsettled(self) -> int:
        """Messages taken and not yet settled: the window's used slots, less the one the receive loop
        holds while it waits for the next message (which does not exist yet)."""
        return self.window.used - self._reserved

    @property
    def oldest_unsettled_ms(self) -> int | None:
        """The publish time of the oldest message taken and not yet settled (None: none held)."""
        return min((at for at in self.active.values() if at > 0), default=None)

    def settled(self, env: Envelope) -> None:
        """`env` is settled or handed back to the broker: its window slot and bytes are free."""
        self.active.pop(env.message_id, None)
        self._release(env)

    async def run(self) -> None:
        shared = self._shared
        while not shared.stopping.is_set():
            await self.window.acquire()
            self._reserved = 1
            try:
                message = await self._consumer.receive()
            except asyncio.CancelledError:
                self._reserved = 0
                self.window.release()
                raise
            except Exception as e:
                self._reserved = 0
                self.window.release()
                shared.m.broker_errors.labels("receive").inc()
                shared.log.warning("receive failed", error=type(e).__name__)
                await shared.pause(1.0)
                continue
            self._reserved = 0
            await self._take(message)
            # What the client already holds is taken in the same turn: one wake-up per burst, not per
            # message; but at most INTAKE_PER_TURN before other subscriptions get the loop: a window
            # of 1,000 taken in one turn held everyone else's messages for its whole length (another
            # project's p99 183 ms during a burst; 114 ms with the yield: `make bench --section neighbours`).
            taken = 1
            while True:
                if taken % INTAKE_PER_TURN == 0:
                    await asyncio.sleep(0)
                if not self.window.try_acquire():
                    break
                taken += 1
                message = self._consumer.receive_ready()
                if message is None:
                    self.window.release()
                    break
                await self._take(message)

    async def _take(self, message: Any) -> None:
        """A message received into a window slot: read, its bytes taken, its project's turn of the
        loop (`scheduler.FairShare`), then admitted. Stopped while waiting for its turn, it was never
        admitted: its slot and bytes are freed and closing the consumer returns it."""
        message, env = self._read(message)
        if not self.held.try_take(self._held(env)):
            await self._take_bytes(env)
        try:
            await self._share.turn(self._project, cost_of(len(env.data)))
        except asyncio.CancelledError:
            self._release(env)
            raise
        self._admit(message, env)

    def _admit(self, message: Any, env: Envelope) -> None:
        """On to `route`, unless a copy is in hand already."""
        if env.message_id in self.active:
            # A redelivery (e.g. after a broker reconnect) of a message already in hand: the copy in
            # hand settles it; a second loop would send it twice at once.
            self._release(env)
            return
        self.active[env.message_id] = env.publish_time_ms
        self._route(message, env)

    def _read(self, message: Any) -> tuple[Any, Envelope]:
        """What the worker reads of `message`, and what it keeps of the client's (the message, or
        just its id for an oversize payload, so that the client's copy is let go of now)."""
        try:
            env = self._to_envelope(message)
        except Exception as e:  # a message we cannot even read is dead-lettered with the reason, never a crash
            env = Envelope(message_id=_raw_id(message), data=_raw_data(message), topic=self._shared.sub.topic,
                           publish_time_ms=0, defect=f"unreadable message ({type(e).__name__})")
        if len(env.data) > self._too_large:
            self._too_large = len(env.data)
            assert self._on_large_message is not None
            self._on_large_message(len(env.data))
        if env.ack_handle is not None:
            message, env.ack_handle = env.ack_handle, None
        return message, env

    def _held(self, env: Envelope) -> int:
        """The bytes of memory `env` counts for in the subscription's and the worker's budgets."""
        return int(len(env.data) * self._held_per_byte)

    async def _take_bytes(self, env: Envelope) -> None:
        """Wait until the subscription holds few enough bytes for this message. Stopped meanwhile,
        it was never admitted: its slot is freed and closing the consumer returns it."""
        try:
            await self.held.take(self._held(env))
        except asyncio.CancelledError:
            self.window.release()
            raise

    def _release(self, env: Envelope) -> None:
        self.window.release()
        self.held.give_back(self._held(env))
