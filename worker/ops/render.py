"""Plain-text layout of operator output (every command also has --json)."""

from __future__ import annotations

from typing import Any


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    widths = {c: max([len(c)] + [len(str(r.get(c, ""))) for r in rows]) for c in columns}
    lines = ["  ".join(c.upper().ljust(widths[c]) for c in columns)]
    lines += ["  ".join(str(r.get(c, "")).ljust(widths[c]) for c in columns) for r in rows]
    return "\n".join(line.rstrip() for line in lines)
