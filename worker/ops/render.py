"""Plain-text layout of operator output (every command also has --json)."""

from __future__ import annotations

import io
import json
import re
import unicodedata
from dataclasses import dataclass
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table
from rich.text import Text


@dataclass(frozen=True)
class Output:
    """What an operator command produced: `data` for --json, `text` for a person."""

    data: Any
    text: str


# C0 controls (newlines and tabs too: a payload must not forge lines of the output), DEL and C1.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _escape(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _unsafe(ch: str) -> bool:
    """A control character, or one that is invisible or reorders what follows: Unicode format
    characters (category Cf: bidi overrides and isolates like U+202E and U+2066, zero-width
    spaces and joiners) and the line and paragraph separators (U+2028, U+2029)."""
    return bool(_CONTROL.match(ch)) or unicodedata.category(ch) in ("Cf", "Zl", "Zp")


def inert(text: str, keep_lines: bool = False) -> str:
    """`text` from data (payloads, keys, attributes, names, endpoints' answers) safe to print on an
    operator's terminal or page: every control, format or separator character is written as its
    escape (`\\x1b`, `\\u202e`), so none can move the cursor, retitle the window, clear the screen,
    forge a line, or make text read otherwise than it is. `keep_lines`: newlines and tabs stay (a
    page's preformatted text, where they are only layout)."""
    def shown(ch: str) -> str:
        return ch if keep_lines and ch in "\n\t" else _escape(ch)

    if text.isascii():
        return _CONTROL.sub(lambda m: shown(m.group()), text)
    return "".join(shown(ch) if _unsafe(ch) else ch for ch in text)


def render(output: Output, as_json: bool) -> str:
    return json.dumps(output.data) if as_json else output.text


def table(rows: list[dict[str, Any]], columns: list[str], right: tuple[str, ...] = ()) -> str:
    """Aligned columns under upper-case headers, as plain text (no colour, no wrapping: the output
    goes to terminals, files and pipes alike). Numbers, and the columns named in `right`, align right."""
    grid = Table(box=None, pad_edge=False, show_edge=False, padding=(0, 1), header_style="", highlight=False)
    for column in columns:
        numeric = bool(rows) and all(isinstance(r.get(column), int | float) and not isinstance(r.get(column), bool)
                                     for r in rows)
        grid.add_column(column.upper(), no_wrap=True,
                        justify="right" if numeric or column in right else "left")
    for row in rows:
        grid.add_row(*(Text(inert(str(row.get(c, "")))) for c in columns))  # Text: no markup is interpreted
    out = io.StringIO()
    Console(file=out, width=100_000, color_system=None, force_terminal=False, highlight=False).print(grid)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines())


class _PeopleDumper(yaml.SafeDumper):
    """YAML for a person: a list of numbers (a series, such as the last five minutes in steps of 10 s)
    on one line, not a line per number."""


def _numbers_inline(dumper: yaml.SafeDumper, items: list[Any]) -> yaml.Node:
    flow = bool(items) and all(isinstance(item, int | float) and not isinstance(item, bool) for item in items)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", items, flow_style=flow or None)


_PeopleDumper.add_representer(list, _numbers_inline)


def people_yaml(data: Any) -> str:
    """`data` as YAML for a person (see `_PeopleDumper`), in the order given."""
    return yaml.dump(data, Dumper=_PeopleDumper, sort_keys=False, width=10_000).rstrip()
