"""Fields of the worker's config and of subscriptions: read from untrusted mappings, declared once.

A field is declared where its value lives (a frozen dataclass of settings or of a subscription's
policy) with `setting(default, low, high, help=...)`: its default, its bounds and what it does. The
readers (`declared`, `read`) validate by that declaration, and `reference` lists every declared
field for the configuration page (docs/configuration.md#reference), so a default, a bound or a help
text is written in one place.
"""

from __future__ import annotations

import dataclasses
import re
import time
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from worker.runtime.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance  # a type for checking only: typeshed has no runtime module

T = TypeVar("T", bound="DataclassInstance")


class FieldReader:
    """Reads typed fields from an untrusted mapping, raising `ConfigError` naming the field path."""

    def __init__(self, where: str, data: Any, prefix: str = "") -> None:
        if not isinstance(data, dict):
            raise ConfigError(where, prefix.rstrip(".") or "subscription", "must be a mapping")
        self.where, self.data, self.prefix = where, data, prefix

    def fail(self, name: str, rule: str) -> ConfigError:
        return ConfigError(self.where, self.prefix + name, rule)

    def sub(self, name: str) -> FieldReader:
        value = self.data.get(name)
        return FieldReader(self.where, {} if value is None else value, f"{self.prefix}{name}.")

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def text(self, name: str, default: str | None = None) -> str:
        value = self.data.get(name, default)
        if value is None:
            raise self.fail(name, "is required")
        if not isinstance(value, str) or not value:
            raise self.fail(name, "must be a non-empty string")
        return value

    def choice(self, name: str, options: tuple[str, ...], default: str) -> str:
        value = self.text(name, default)
        if value not in options:
            raise self.fail(name, f"must be one of {', '.join(options)} (got {value!r})")
        return value

    def integer(self, name: str, default: int, low: int, high: int) -> int:
        value = self.data.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(name, f"must be an integer in {low}..{high}")
        if not low <= value <= high:
            raise self.fail(name, f"must be in {low}..{high} (got {value})")
        return value

    def number(self, name: str, default: float, low: float, high: float) -> float:
        value = self.data.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(name, f"must be a number in {low:g}..{high:g}")
        if not low <= value <= high:
            raise self.fail(name, f"must be in {low:g}..{high:g} (got {value})")
        return float(value)

    def reject_unknown(self, allowed: set[str]) -> None:
        # repr() for keys that would not read clearly in a message (empty, spaces, not a string)
        unknown = sorted(k if isinstance(k, str) and re.fullmatch(r"[\w.-]+", k) else repr(k)
                         for k in self.data if k not in allowed)
        if unknown:
            raise self.fail(unknown[0], f"is not a known field (known: {', '.join(sorted(allowed))})")


def setting(default: Any = dataclasses.MISSING, low: float | None = None, high: float | None = None, *,
            help: str, choices: tuple[str, ...] = (), read_by_hand: bool = False, yaml: str = "", kind: str = "",
            section: bool = False, hidden: bool = False, shown_default: str = "") -> Any:
    """A field declared once: its default, bounds (numbers) or `choices` (words), and what it does.
    `read_by_hand`: read by code of its own (URLs, secrets, fields that depend on others), declared
    here for the reference; `yaml`: its path in the mapping when it differs from its name; `kind`:
    its type as the reference shows it, when the annotation does not say it well; `section`: a
    mapping of declared fields of its own (its dataclass is the annotation's; `default` its factory).
    No default: a required field. `hidden`: left out of the value's repr (it may hold a password);
    `shown_default`: the default as the reference says it, when it is worked out from other fields."""
    meta = {"low": low, "high": high, "by_hand": read_by_hand or section, "help": help, "choices": choices,
            "yaml": yaml, "kind": kind, "section": section,
            "shown_default": shown_default}
    if isinstance(default, (list, dict, set)) or (dataclasses.is_dataclass(default) and not isinstance(default, type)):
        raise TypeError("a mutable default: give a section's dataclass, whose defaults are its fields'")
    if section and isinstance(default, type):
        return field(default_factory=default, metadata=meta, repr=not hidden)
    return field(default=default, metadata=meta, repr=not hidden)


def yaml_fields(section: type, under: str = "") -> set[str]:
    """The names a mapping of `section` may hold: its declared fields (the first name of each `yaml`
    path); `under`: those of the mapping at that path (`deliver.push`)."""
    prefix = under + "." if under else ""
    paths = [f.metadata["yaml"] or f.name for f in fields(section) if "help" in f.metadata]
    return {path[len(prefix):].split(".")[0] for path in paths if path.startswith(prefix)}


def bounds(section: type, name: str) -> tuple[int, int]:
    """The bounds a setting is declared with, for one read by hand."""
    meta = _meta(section, name)
    return int(meta["low"]), int(meta["high"])


def default(section: type, name: str) -> Any:
    """A field's declared default."""
    f = next(f for f in fields(section) if f.name == name)
    if f.default is not dataclasses.MISSING:
        return f.default
    assert f.default_factory is not dataclasses.MISSING, f"{name} is required: it has no default"
    return f.default_factory()


def _meta(section: type, name: str) -> Any:
    return next(f.metadata for f in fields(section) if f.name == name)


def read(section: type, r: FieldReader, name: str) -> Any:
    """One declared field of `section` from `r` (an integer, a number or a word), or its default; `r`
    reads the mapping that holds it (the last part of its `yaml` path)."""
    meta, value = _meta(section, name), default(section, name)
    key = (meta["yaml"] or name).rsplit(".", 1)[-1]
    if meta["choices"]:
        return r.choice(key, meta["choices"], value)
    if isinstance(value, int) and not isinstance(value, bool):
        return r.integer(key, value, int(meta["low"]), int(meta["high"]))
    assert isinstance(value, float), name  # a field read by its declaration is an integer, a number or a word
    return r.number(key, value, meta["low"], meta["high"])


def declared(section: type[T], r: FieldReader, **by_hand: Any) -> T:
    """A mapping of `section` read from `r` by its declarations: every field not read by hand by its
    declaration, the others from `by_hand`; a name not declared is refused."""
    r.reject_unknown(yaml_fields(section))
    values = dict(by_hand)
    for f in fields(section):
        if f.name not in values and "help" in f.metadata and not f.metadata["by_hand"]:
            values[f.name] = read(section, r, f.name)
    return section(**values)


# -- the reference --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    """One declared field as the configuration page lists it."""

    path: str
    kind: str
    default: str
    help: str


def reference(section: type, prefix: str = "") -> Iterator[Row]:
    """Every declared field of `section` and of its sections, in declaration order."""
    hints = typing.get_type_hints(section)
    for f in fields(section):
        meta = f.metadata
        if "help" not in meta:
            continue
        path = prefix + (meta["yaml"] or f.name)
        inner = _dataclass_of(hints[f.name]) if meta["section"] and not meta["kind"] else None
        if inner is None:
            yield Row(path, meta["kind"] or _kind(hints[f.name], meta), meta["shown_default"] or _default_text(f),
                      meta["help"])
            continue
        sequence = _is_sequence(hints[f.name])
        # A section's default is its fields' (or `none`: an optional section, absent unless written).
        yield Row(path, "list" if sequence else "mapping", "none" if f.default is None else "", meta["help"])
        yield from reference(inner, path + ("[]." if sequence else "."))


def _dataclass_of(hint: Any) -> type | None:
    for candidate in (hint, *typing.get_args(hint)):
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    return None


def _is_sequence(hint: Any) -> bool:
    return typing.get_origin(hint) in (tuple, list)


def _kind(hint: Any, meta: Any) -> str:
    if meta["choices"]:
        return " | ".join(meta["choices"])
    base = [a for a in typing.get_args(hint) if a is not type(None)] if isinstance(hint, types.UnionType) else [hint]
    name = getattr(base[0], "__name__", str(base[0])) if len(base) == 1 else str(hint)
    words = {"int": "integer", "float": "number", "bool": "true | false", "str": "text", "Path": "path"}
    text = words.get(name, name)
    if meta["low"] is not None and meta["high"] is not None:
        text += f" {_number(meta['low'])}..{_number(meta['high'])}"
    return text


def _number(value: float) -> str:
    return f"{int(value)}" if float(value).is_integer() else f"{value:g}"


def _default_text(f: dataclasses.Field[Any]) -> str:
    if f.default is dataclasses.MISSING:
        return "required" if f.default_factory is dataclasses.MISSING else ""
    value = f.default
    if value is None or value == ():
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return _number(value)
    return str(value)


AGO_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400}
_AGO = re.compile(r"([0-9]{1,9}(?:\.[0-9]{1,3})?)([smhd])")


def parse_moment(value: str) -> int:
    """An RFC 3339 time with its zone, ms since the epoch, or a time before now (`30m`, `1h`, `2d`,
    `90s`), as ms since the epoch; ValueError says why not."""
    if re.fullmatch(r"[0-9]{1,15}", value):  # ms since the epoch, up to the year 33658 (`isdigit` takes '²')
        return int(value)
    ago = _AGO.fullmatch(value)
    if ago:
        return max(0, int(time.time() * 1000 - float(ago.group(1)) * AGO_UNITS[ago.group(2)] * 1000))
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"must be an RFC 3339 time, ms since the epoch, or a time before now like 30m, 1h "
                         f"or 2d (got {value!r})") from None
    if when.tzinfo is None:
        raise ValueError("must carry a time zone, e.g. 2026-11-30T08:00:00Z")
    ms = int(when.timestamp() * 1000)
    if ms < 0:
        raise ValueError(f"must not be before 1970-01-01T00:00:00Z (got {value!r})")
    return ms
