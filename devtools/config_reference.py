"""The reference tables of docs/configuration.md, made from the fields' declarations (`worker.runtime.fields`).

`python -m devtools.config_reference` prints them; `--write` puts them into the page between its
markers (`make docs`); tests/test_docs.py checks that the page holds what this makes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from worker.model.config import Settings
from worker.model.subscriptions import Subscription
from worker.runtime.fields import Row, reference

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
BEGIN = "<!-- reference: made by `make docs` from the declarations (worker/runtime/fields.py); do not edit -->"
END = "<!-- end of reference -->"


def _cell(text: str) -> str:
    """Text a Markdown table cell shows as it is (`<project>` is not a tag, `|` not a column)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")


def _table(rows: list[Row]) -> str:
    lines = ["| setting | type | default | what it does |", "|---|---|---|---|"]
    lines += [f"| `{r.path}` | {_cell(r.kind)} | {f'`{r.default}`' if r.default else ''} | {_cell(r.help)} |"
              for r in rows]
    return "\n".join(lines)


def tables() -> str:
    """Both tables: worker.yaml's settings, and a subscription's fields."""
    worker = [row for row in reference(Settings) if not row.path.startswith("subscriptions[].")]
    return "\n".join([
        BEGIN, "", "**worker.yaml** (`push-worker check` validates it):", "", _table(worker), "",
        "**A subscription** (an item of `subscriptions:`, or a registry entry written by `subs apply`):", "",
        _table(list(reference(Subscription))), "", END])


def page_with_tables(page: str) -> str:
    """`page` with its reference replaced by the current one."""
    start, end = page.index(BEGIN), page.index(END) + len(END)
    return page[:start] + tables() + page[end:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write them into {PAGE.name}")
    if parser.parse_args().write:
        PAGE.write_text(page_with_tables(PAGE.read_text()))
    else:
        print(tables())


if __name__ == "__main__":
    main()
