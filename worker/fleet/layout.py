"""The Redis layout: which key names and record formats the fleet's state follows.

This release reads and writes layouts 1 and 2 (`LAYOUT`, the newest): a fresh Redis is recorded as
2 in `pw:layout`; on a Redis that holds 1 (releases up to 1.1.0 ran on it) it keeps writing layout 1
until an operator switches (`ops/layout_switch.py`), which workers follow within a fleet round. A
release started on a layout newer than its own refuses to start, before it writes anything, with
one line that says what to do (docs/upgrading.md#rollback). Releases before 1.0.0 do not read the
key: going back to one of them is safe only while the layout is theirs (1).
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError

from worker.core import keys
from worker.runtime.errors import StartupError

LAYOUT = 2  # the newest layout this release reads and writes (1: every release from 1.0.0 to 1.1.0)


class LayoutTooNew(StartupError):
    """Redis holds a layout this release cannot read or write without corrupting it."""


DECIMAL = re.compile(r"[1-9][0-9]{0,8}")  # ASCII digits only: '²' and '٣' are digits to str.isdigit()


def _number(raw: Any) -> int:
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    if not DECIMAL.fullmatch(text):
        raise LayoutTooNew(f"redis: {keys.layout_key()} holds {text[:40]!r}, not a layout number; this release "
                           f"writes layout {LAYOUT} and changed nothing (docs/upgrading.md#redis-layout)")
    return int(text)


def check(raw: Any) -> int:
    """The layout a value read from `pw:layout` names (None: none recorded, ours); LayoutTooNew if it
    is newer than ours or not a plain decimal number."""
    if raw is None:
        return LAYOUT
    found = _number(raw)
    if found > LAYOUT:
        raise LayoutTooNew(f"redis holds layout {found}, written by a later release; this release reads layout "
                           f"{LAYOUT} only and changed nothing: run a release that reads layout {found} "
                           "(docs/upgrading.md#rollback)")
    return found


async def claim(client: Any) -> int:
    """The layout Redis holds, recorded as ours when none was; LayoutTooNew if newer than ours."""
    # A full or read-only Redis refuses the write: it is read all the same, and recorded by a later start.
    with contextlib.suppress(ResponseError):
        await client.set(keys.layout_key(), LAYOUT, nx=True)
    return check(await client.get(keys.layout_key()))


async def writable(client: Any) -> None:
    """Before a write: Redis holds no layout newer than ours (read each time: a running process must
    notice a newer release's layout before its next write, not only at its start)."""
    check(await client.get(keys.layout_key()))


@dataclass(frozen=True)
class LayoutState:
    """What Redis says of its layout: the number, when it was switched to 2 (ms; 0: it began there
    or is 1), and whether a switch to 2 is under way."""

    layout: int
    since_ms: int = 0
    switching: bool = False

    def layout_1_until(self, attempts_ttl_seconds: int) -> float:
        """Until when (unix time) layout 1's attempt records may still count: read beside layout 2's."""
        return self.since_ms / 1000 + attempts_ttl_seconds if self.layout == 2 and self.since_ms else 0.0


def _ms(raw: Any) -> int:
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw or "")
    return int(text) if text.isascii() and text.isdigit() else 0


def state_of(layout_raw: Any, since_raw: Any, next_raw: Any) -> LayoutState:
    """The layout state from the three keys as read (LayoutTooNew as `check`)."""
    found = check(layout_raw)
    return LayoutState(found, _ms(since_raw) if found == 2 else 0, found == 1 and next_raw is not None)


async def current(client: Any) -> LayoutState:
    """The layout state Redis holds now (nothing recorded: this release's own)."""
    raw, since, switching = [await client.get(k) for k in (keys.layout_key(), keys.layout_since_key(),
                                                             keys.layout_next_key())]
    return state_of(raw, since, switching)


def now_ms() -> int:
    return int(time.time() * 1000)
