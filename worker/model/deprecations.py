"""Config keys under an old spelling (docs/upgrading.md#deprecation-policy).

A key that is renamed keeps working under its old spelling for the rest of its major version: the
value moves to the new key, and every start and every `push-worker check` says so in one warning
line naming both spellings and the release that removes the old one (the next major). A file that
spells both is refused: which one was meant is not ours to guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from worker.runtime.errors import ConfigError


@dataclass(frozen=True)
class Renamed:
    old: str  # a dotted path in worker.yaml: `fleet.lease_seconds`
    new: str
    since: str  # the release that deprecated the old spelling
    removed_in: str  # the next major release


RENAMED: tuple[Renamed, ...] = ()  # none in 1.x so far


def _parent(data: dict[str, Any], path: list[str]) -> dict[str, Any] | None:
    for part in path:
        data = data.get(part)  # type: ignore[assignment]
        if not isinstance(data, dict):
            return None
    return data


def respell(data: dict[str, Any], renamed: tuple[Renamed, ...] = RENAMED) -> tuple[dict[str, Any], tuple[str, ...]]:
    """`data` with every deprecated key under its new spelling, and a warning line for each moved."""
    warnings = []
    for rename in renamed:
        *old_path, old_name = rename.old.split(".")
        *new_path, new_name = rename.new.split(".")
        holder = _parent(data, old_path)
        if holder is None or old_name not in holder:
            continue
        target = _parent(data, new_path)
        if target is not None and new_name in target:
            raise ConfigError("config", rename.old, f"is the deprecated spelling of {rename.new}, which is set "
                                                    "too: remove it")
        data = _moved(data, old_path, old_name, new_path, new_name)
        warnings.append(f"config: {rename.old} is deprecated since {rename.since} and is removed in "
                        f"{rename.removed_in}: use {rename.new}")
    return data, tuple(warnings)


def _moved(data: dict[str, Any], old_path: list[str], old_name: str, new_path: list[str],
           new_name: str) -> dict[str, Any]:
    """A copy of `data` with the value at old_path.old_name at new_path.new_name (the input unchanged)."""
    def copy_along(node: dict[str, Any], path: list[str]) -> dict[str, Any]:
        node = dict(node)
        if path:
            child = node.get(path[0])
            node[path[0]] = copy_along(child if isinstance(child, dict) else {}, path[1:])
        return node

    out = copy_along(copy_along(data, old_path), new_path)
    holder = out
    for part in old_path:
        holder = holder[part]
    value = holder.pop(old_name)
    target = out
    for part in new_path:
        target = target[part]
    target[new_name] = value
    return out
