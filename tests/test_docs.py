"""The docs a user looks things up in agree with the code: every relative link and anchor of
README.md and docs/ resolves, every setting of configuration.md is one the worker reads (and every
one it reads is there), and every metric the observability page lists is exported (and every
exported one is listed)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

import worker.model.subscriptions as subscriptions
from devtools import config_reference
from worker.core.metrics import Metrics
from worker.model.config import Settings, load_settings
from worker.model.subscriptions import Subscription
from worker.runtime.fields import reference

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as dashes;
    a repeated heading gets -1, -2, ..."""
    out: set[str] = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        text = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", text.replace("`", "")).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in out:
            n += 1
            candidate = f"{slug}-{n}"
        out.add(candidate)
    return out


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links in code blocks are not links
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no such heading")
    assert not broken, broken


def _flatten(data: Any, prefix: str = "") -> set[str]:
    out: set[str] = set()
    if isinstance(data, dict):
        for key, value in data.items():
            out.add(prefix + str(key))
            out |= _flatten(value, f"{prefix}{key}.")
    elif isinstance(data, list):
        for item in data:
            out |= _flatten(item, prefix.rstrip(".") + "[].")
    return out


def documented_settings() -> tuple[str, set[str]]:
    """The first worker.yaml of configuration.md, and every setting path its YAML blocks show
    (a commented-out `key: value` line counts: it documents an alternative)."""
    doc = (ROOT / "docs" / "configuration.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", doc, re.S)
    paths: set[str] = set()
    commented = re.compile(r"^(\s*)# (\w+: .*)$")
    for block in blocks:
        lines = block.splitlines()
        variants = [block] + [  # each commented-out line uncommented alone (it replaces the key it repeats)
            "\n".join(commented.sub(r"\1\2", line) if i == n else line for i, line in enumerate(lines))
            for n, line in enumerate(lines) if commented.match(line)]
        for text in variants:
            for part in yaml.safe_load_all(text):
                paths |= _flatten(part)
    return blocks[0], paths


def read_settings(tmp_path: Path, example: str, monkeypatch) -> set[str]:
    """Every setting path the worker reads, as it loads `example`."""
    read: set[str] = set()
    reject_unknown = subscriptions.FieldReader.reject_unknown

    def record(self, allowed: set[str]) -> None:
        prefix = re.sub(r"\[\d+\]", "[]", self.prefix)
        if self.where != "config":
            prefix = "subscriptions[]." + prefix
        read.update(prefix + key for key in allowed)
        reject_unknown(self, allowed)

    monkeypatch.setattr(subscriptions.FieldReader, "reject_unknown", record)
    # The example with subscriptions more, using the settings it shows commented out (they exclude
    # others of the example: a CloudEvents body, OIDC or OAuth 2.0 instead of a bearer token).
    data = yaml.safe_load(example)
    data["subscriptions"].append({
        "name": "events-push", "topic": "persistent://p-demo/main/events",
        "deliver": {"mode": "push", "push": {
            "url": "https://example.com/events", "content": "cloudevents",
            "cloudevents": {"mode": "structured", "type": "t", "source": "s"},
            "oidc": {"audience": "https://example.com"}}}})
    data["subscriptions"].append({  # and one with a client certificate, OAuth 2.0 tokens and batches
        "name": "mtls-push", "topic": "persistent://p-demo/main/events",
        "deliver": {"mode": "push", "push": {
            "url": "https://example.com/mtls",
            "tls": {"client_certificate": {"secret": "c"}, "client_key": {"secret": "k"}},
            "oauth2": {"token_url": "https://auth.example.com/token", "client_id": "i",
                       "client_secret": {"secret": "s"}, "scope": "push", "audience": "a"},
            "batch": {"max_messages": 10, "max_bytes": 4096, "max_wait_ms": 5}}}})
    config = tmp_path / "worker.yaml"
    config.write_text(yaml.safe_dump(data))
    load_settings(config)
    return read


@pytest.mark.broker_independent
def test_the_configuration_reference_is_the_one_the_declarations_make():
    """docs/configuration.md#reference is made from the fields' declarations (`make docs`): a default,
    bound or help changed in the code and not in the page fails here, and so does an edit of the page."""
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert config_reference.page_with_tables(page) == page, "run `make docs`"
    declared_paths = {row.path for row in reference(Settings)} | {row.path for row in reference(Subscription)}
    assert "subscriptions[].deliver.push.batch.max_wait_ms" in declared_paths  # subscriptions in the worker's
    assert "deliver.push.batch.max_wait_ms" in page and "fleet.lease_seconds" in page


def test_every_setting_in_the_configuration_page_is_read_and_every_one_read_is_there(tmp_path, monkeypatch):
    example, documented = documented_settings()
    read = read_settings(tmp_path, example, monkeypatch)
    # Where a list's items are settings of their own (secret references), list indices are dropped.
    assert sorted(documented - read) == [], "documented but not read by the worker"
    assert sorted(read - documented) == [], "read by the worker but not in docs/configuration.md"


def test_every_metric_on_the_observability_page_is_exported_and_every_exported_one_is_there():
    page = (ROOT / "docs" / "observability.md").read_text()
    documented = set(re.findall(r"^\| `(pushworker_\w+)`", page, re.M))
    registry = CollectorRegistry()
    Metrics(registry)
    exported = set()
    for family in registry.collect():
        exported.add(family.name + ("_total" if family.type == "counter" else ""))
    assert sorted(documented - exported) == [], "documented but not exported"
    assert sorted(exported - documented) == [], "exported but not documented"


def test_the_design_page_names_every_module():
    """docs/design.md is the map of the code: a module it does not name is one a reader cannot find."""
    design = (ROOT / "docs" / "design.md").read_text()
    modules = [p for package in ("worker", "devtools") for p in sorted((ROOT / package).rglob("*.py"))
               if p.name != "__init__.py"]
    assert [str(p.relative_to(ROOT)) for p in modules if p.name not in design] == []


def test_the_configuration_page_shows_each_declared_setting_at_its_default():
    """worker.yaml's settings are declared once, with their defaults (worker.runtime.fields.setting): the
    example on the configuration page shows each at that default, so the page cannot drift from it."""
    from dataclasses import fields

    from worker.model import config

    example = yaml.safe_load(documented_settings()[0])
    sections = {"pulsar": config.PulsarSettings, "redis": config.RedisSettings, "fleet": config.FleetSettings,
                "": config.Settings}
    drift = []
    for name, section in sections.items():
        shown = example.get(name, {}) if name else example
        for f in fields(section):
            if f.metadata.get("by_hand") is False:
                path = (f.metadata["yaml"] or f.name).split(".")
                value = shown
                for part in path:
                    value = value.get(part) if isinstance(value, dict) else None
                if value != f.default:
                    drift.append(f"{name or 'config'}.{'.'.join(path)}: page {value!r}, declared {f.default!r}")
    assert drift == []


def test_every_test_a_page_names_exists():
    """A promise in the docs names the test that shows it (`test_x.py::test_name`, or a module): each
    one named must be there, so a renamed or removed test cannot leave a promise without its proof."""
    named = re.compile(r"\b(test_\w+\.py)(?:::(test_\w+))?")
    missing = []
    for page in PAGES:
        for module, function in named.findall(page.read_text()):
            path = ROOT / "tests" / module
            if not path.exists():
                missing.append(f"{page.name}: {module}")
            elif function and not re.search(rf"^(async )?def {function}\(", path.read_text(), re.M):
                missing.append(f"{page.name}: {module}::{function}")
    assert not missing, missing
