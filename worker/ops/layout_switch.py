"""`push-worker layout`: which Redis layout the fleet's records follow, and the switch from layout 1
(every release up to 1.1.0) to layout 2 once every worker of the fleet reads it
(docs/upgrading.md#redis-layout).

The switch holds new attempts for a moment so that no worker counts in layout 1 after another has
counted in layout 2: it marks the switch (`pw:layout:next`, expiring), waits until every live member
says it holds, records layout 2 and when, and waits until every member follows. A member that does
not answer in time ends the switch with nothing changed (the mark expires; the workers go on in
layout 1).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from worker.core import keys
from worker.fleet import layout
from worker.ops.render import Output, table
from worker.runtime.errors import PushWorkerError
from worker.state.redis_client import AsyncClient, safe_text

NEXT_TTL_SECONDS = 60  # a switch whose command died leaves the fleet holding for at most this long
POLL_SECONDS = 0.2


class SwitchRefused(PushWorkerError):
    """The fleet cannot switch now (a member of an older release, or one that did not follow)."""


async def _members(client: AsyncClient, fleet: str) -> dict[str, str]:
    """The live members of the fleet and what each says of the layouts ('' for an older release)."""
    seconds, micros = await client.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    found: list[Any] = await client.zrangebyscore(keys.fleet_key(fleet, "members"), now_ms, "+inf")
    members = [safe_text(m) for m in found]
    if not members:
        return {}
    reads = await client.mget([keys.fleet_key(fleet, f"reads:{m}") for m in members])
    return {m: safe_text(r) if r is not None else "" for m, r in zip(members, reads, strict=True)}


def _said(reads: str) -> str:
    return {"": "layout 1 only (a release before 1.2.0)", "1": "layout 1, can switch", "hold": "switching",
            "2": "layout 2"}.get(reads, f"unknown ({reads[:20]!r})")


async def status(client: AsyncClient, fleet: str, attempts_ttl_seconds: int) -> Output:
    state = await layout.current(client)
    members = await _members(client, fleet)
    data: dict[str, Any] = {"layout": state.layout, "switching": state.switching,
                            "since_ms": state.since_ms or None,
                            "layout_1_read_until_ms": int(1000 * state.layout_1_until(attempts_ttl_seconds)) or None,
                            "members": [{"worker": m, "reads": r or None} for m, r in sorted(members.items())]}
    head = f"redis layout {state.layout}" + (" (a switch to 2 under way)" if state.switching else "")
    if state.since_ms:
        until = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(state.layout_1_until(attempts_ttl_seconds)))
        head += f"; layout 1's attempt records read beside it until {until}"
    rows = [{"worker": m, "reads": _said(r)} for m, r in sorted(members.items())]
    listed = table(rows, ["worker", "reads"]) if rows else f"no live member of fleet {fleet}"
    return Output(data, f"{head}\n{listed}")


async def _wait_for(client: AsyncClient, fleet: str, ready: set[str], seconds: float) -> list[str]:
    """Members not saying one of `ready` after `seconds` (empty: all did)."""
    deadline = time.monotonic() + seconds
    while True:
        behind = sorted(m for m, r in (await _members(client, fleet)).items() if r not in ready)
        if not behind or time.monotonic() >= deadline:
            return behind
        await asyncio.sleep(POLL_SECONDS)  # polling the members' own reports: nothing to wake us


async def upgrade(client: AsyncClient, fleet: str, attempts_ttl_seconds: int, wait_seconds: float = 15.0) -> Output:
    """Switch Redis to layout 2: refused while a live member of `fleet` runs a release before 1.2.0."""
    await layout.writable(client)
    state = await layout.current(client)
    if state.layout == 2:
        return Output({"layout": 2, "result": "already"}, "redis holds layout 2 already: nothing to do")
    old = sorted(m for m, r in (await _members(client, fleet)).items() if r == "")
    if old:
        raise SwitchRefused(f"fleet {fleet}: {len(old)} member(s) run a release that reads layout 1 only "
                            f"({', '.join(old[:5])}{', ...' if len(old) > 5 else ''}): finish the rollout first; "
                            "nothing changed")
    token = uuid.uuid4().hex
    await client.set(keys.layout_next_key(), token, ex=NEXT_TTL_SECONDS)
    try:
        behind = await _wait_for(client, fleet, {"hold", "2"}, wait_seconds)
        if behind:
            raise SwitchRefused(f"fleet {fleet}: {len(behind)} member(s) did not hold new attempts within "
                                f"{wait_seconds:g} s ({', '.join(behind[:5])}): nothing changed")
        if await client.get(keys.layout_next_key()) != token.encode():
            raise SwitchRefused("the switch's mark expired or was replaced (another switch?): nothing changed")
        await client.set(keys.layout_since_key(), layout.now_ms())
        await client.set(keys.layout_key(), 2)
    finally:
        await client.delete(keys.layout_next_key())
    behind = await _wait_for(client, fleet, {"2"}, wait_seconds)
    until = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(time.time() + attempts_ttl_seconds))
    text = (f"redis holds layout 2: releases before 1.2.0 refuse to start on it from now on; layout 1's attempt "
            f"records are read beside it until {until}")
    if behind:
        text += f"\nstill following: {', '.join(behind[:5])} (each follows at its next fleet round)"
    return Output({"layout": 2, "result": "switched", "still_following": behind}, text)
