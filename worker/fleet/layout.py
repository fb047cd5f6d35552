"""The Redis layout: which key names and record formats the fleet's state follows.

Each release reads and writes one layout, `LAYOUT`, and records it in `pw:layout` where nothing is
recorded yet. A release that changes the layout raises the number and says in CHANGELOG.md whether
earlier releases can run beside it; a release started on a layout newer than its own refuses to
start, before it writes anything, with one line that says what to do (docs/upgrading.md#rollback).
Releases before 1.0.0 do not read the key: going back to one of them is safe only while the layout
is theirs (1).
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

from redis.exceptions import ResponseError

from worker.core import keys
from worker.runtime.errors import StartupError

LAYOUT = 1  # the layout of every release since the first (1.0.0): pw:{tenant/name}:... and pw:{fleet/...}:...


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
