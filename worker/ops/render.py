"""Plain-text layout of operator output (every command also has --json)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Output:
    """What an operator command produced: `data` for --json, `text` for a person."""

    data: Any
    text: str


def render(output: Output, as_json: bool) -> str:
    return json.dumps(output.data) if as_json else output.text


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    widths = {c: max([len(c)] + [len(str(r.get(c, ""))) for r in rows]) for c in columns}
    lines = ["  ".join(c.upper().ljust(widths[c]) for c in columns)]
    lines += ["  ".join(str(r.get(c, "")).ljust(widths[c]) for c in columns) for r in rows]
    return "\n".join(line.rstrip() for line in lines)
