"""Releases: the version and commit a build says, the changelog's record of releases, the Redis
layout a release refuses when it is newer than its own, and config keys under a deprecated spelling
(docs/upgrading.md)."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import yaml

from devtools import releases
from tests.support.builders import push_sub
from tests.support.helpers import code_path, eventually
from worker.core.keys import fleet_key, layout_key
from worker.fleet.layout import LAYOUT
from worker.model import deprecations
from worker.model.config import parse_settings
from worker.model.deprecations import Renamed
from worker.runtime.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def push_worker(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "worker.cli", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env={**os.environ, **code_path()}, stdin=subprocess.DEVNULL)


@pytest.mark.broker_independent
def test_version_prints_the_release_and_the_commit_it_was_built_from():
    done = push_worker("--version")
    assert done.returncode == 0, done.stderr
    match = re.fullmatch(r"push-worker (\S+) \(commit ([0-9a-f]{12})\)\n", done.stdout)
    assert match, done.stdout
    # Past its release, a build says how far, and where: 1.1.0+3.gaf654e6 (the release itself: 1.1.0).
    since = subprocess.run(["git", "-C", str(ROOT), "rev-list", "--count",  # to the commit it was built from
                            f"{releases.previous().commit}..{match[2]}"], capture_output=True, text=True,
                           check=True).stdout.strip()
    plain = releases.project_version() != releases.previous().version or since == "0"  # a release itself
    expected = releases.project_version() if plain else f"{releases.project_version()}+{since}.g{match[2][:7]}"
    assert match[1] == expected, (match[1], expected)
    # A commit of this repository (the build's HEAD: CI builds the checkout it tests).
    assert subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{match[2]}^{{commit}}"]).returncode == 0


@pytest.mark.broker_independent
def test_the_changelog_has_a_dated_section_with_three_headings_for_every_release_and_the_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    found = releases.sections(text)
    recorded = releases.recorded(text)
    assert recorded, "no release recorded"
    for version in [r.version for r in recorded] + [releases.project_version()]:
        assert version in found, f"no section for {version}"
        date, body = found[version]
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date), version
        assert re.findall(r"^### (.+)$", body, re.M) == list(releases.HEADINGS), version
    # The previous release is an ancestor of the checkout (the upgrade tests run it).
    previous = releases.previous()
    ancestor = subprocess.run(["git", "-C", str(ROOT), "merge-base", "--is-ancestor", previous.commit, "HEAD"])
    assert ancestor.returncode == 0


@pytest.mark.broker_independent
def test_a_release_check_names_what_disagrees():
    good = ("## [Unreleased]\n\n### For operators\n\n## [1.1.0] - 2026-12-07\n### For operators\n- a\n"
            "### For endpoint owners\n- b\n### Compatibility\n- c\n\n## [1.0.0] - 2026-12-06\n"
            "[1.0.0]: " + "a" * 40 + "\n")
    assert releases.check(good, "1.1.0") == []
    assert releases.check(good, "1.2.0") == ["CHANGELOG.md has no section `## [1.2.0] - YYYY-MM-DD`"]
    assert any("already released" in p for p in releases.check(good, "1.0.0"))
    assert any("not a semantic version" in p for p in releases.check(good, "1.1"))
    unreleased = good.replace("### For operators\n\n## [1.1.0]", "### For operators\n- pending\n\n## [1.1.0]")
    assert any("Unreleased section still lists changes" in p for p in releases.check(unreleased, "1.1.0"))
    two_headings = good.replace("### For endpoint owners\n- b\n", "")
    assert any("headings" in p for p in releases.check(two_headings, "1.1.0"))


@pytest.mark.broker_independent
def test_a_deprecated_config_key_works_and_says_so_and_both_spellings_are_refused(monkeypatch, tmp_path):
    renamed = (Renamed("fleet.lease_secs", "fleet.lease_seconds", since="1.1.0", removed_in="2.0.0"),)
    monkeypatch.setattr(deprecations, "RENAMED", renamed)
    monkeypatch.setattr(deprecations.respell, "__defaults__", (renamed,))
    settings = parse_settings({"fleet": {"lease_secs": 7}}, env={})
    assert settings.fleet.lease_seconds == 7
    assert settings.deprecated == ("config: fleet.lease_secs is deprecated since 1.1.0 and is removed in 2.0.0: "
                                   "use fleet.lease_seconds",)
    both = re.escape("fleet.lease_secs: is the deprecated spelling of fleet.lease_seconds")
    with pytest.raises(ConfigError, match=both):
        parse_settings({"fleet": {"lease_secs": 7, "lease_seconds": 8}}, env={})
    assert parse_settings({"fleet": {"lease_seconds": 8}}, env={}).deprecated == ()


@pytest.mark.broker_independent
def test_check_prints_a_warning_line_for_each_deprecated_key(tmp_path):
    """The same, through `push-worker check` in a process of its own: a sitecustomize adds the
    renamed key, as a later release would."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "from worker.model import deprecations\n"
        "renamed = (deprecations.Renamed('fleet.lease_secs', 'fleet.lease_seconds', '1.1.0', '2.0.0'),)\n"
        "deprecations.respell.__defaults__ = (renamed,)\n")
    config = tmp_path / "worker.yaml"
    config.write_text(yaml.safe_dump({"fleet": {"lease_secs": 7}}))
    env = code_path()
    done = subprocess.run([sys.executable, "-m", "worker.cli", "check", "--config", str(config)], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **env,
                                                      "PYTHONPATH": f"{hook}{os.pathsep}{env['PYTHONPATH']}"})
    assert done.returncode == 0, done.stderr
    assert done.stderr == ("warning: config: fleet.lease_secs is deprecated since 1.1.0 and is removed in 2.0.0: "
                           "use fleet.lease_seconds\n")


@pytest.mark.parametrize("recorded", [str(LAYOUT + 1), "\u00b2", "\u0663", "0", "1x"])
def test_a_release_refuses_a_newer_redis_layout_with_one_line_and_writes_nothing(tmp_path, redis_url, recorded):
    """Redis marked with a layout above this release's (as a later release that changed it would
    mark it), or with anything but a plain decimal number (a superscript two and an Arabic-Indic three
    are digits to Python, 0 is no layout): the worker does not start, and `subs apply` and `dlq
    redrive` write nothing, each with one line."""
    client = redis.Redis.from_url(redis_url)
    try:
        client.set(layout_key(), recorded.encode())
        config = tmp_path / "worker.yaml"
        config.write_text(yaml.safe_dump({"redis": {"url": redis_url}, "pulsar": {"service_url": "pulsar://127.0.0.1:1"},
                                          "state_dir": str(tmp_path / "state"),
                                          "http": {"host": "127.0.0.1", "port": 0},
                                          "subscriptions": [push_sub("dead", "persistent://p-one/main/d",
                                                                     "https://example.com/push",
                                                                     dead_letter={"topic": "persistent://p-one/main/dl"})]
                                          }))
        subs = tmp_path / "subs.yaml"
        subs.write_text(yaml.safe_dump({"subscriptions": [
            push_sub("s", "persistent://p-one/main/t", "https://example.com/push")]}))
        said = (f"redis holds layout {LAYOUT + 1}, written by a later release; this release reads layout {LAYOUT}"
                if recorded == str(LAYOUT + 1) else "not a layout number")
        for argv in (["run", "--config", str(config)], ["subs", "apply", "-f", str(subs), "--config", str(config)],
                     ["dlq", "redrive", "dead", "--config", str(config)]):
            done = push_worker(*argv, cwd=tmp_path)
            assert done.returncode == 1, (argv, done.stderr)
            refusal = [line for line in done.stderr.splitlines() if "layout" in line]
            assert len(refusal) == 1 and said in refusal[0] and "Traceback" not in done.stderr, (argv, done.stderr)
        assert client.keys("*") == [layout_key().encode()]  # nothing else written
        assert client.get(layout_key()) == recorded.encode()
    finally:
        client.close()


async def test_a_running_worker_stops_at_once_when_a_newer_layout_appears(tmp_path, redis_url, broker):
    """A layout is read every fleet round, not only at start: a worker running when Redis comes to
    hold a newer release's layout stops within a round or two, with exit code 1 and one line, as it
    would refuse to start."""
    client = redis.Redis.from_url(redis_url)
    config = tmp_path / "worker.yaml"
    fleet = f"layout-{os.getpid()}"
    config.write_text(yaml.safe_dump({"redis": {"url": redis_url}, "pulsar": {"service_url": broker.url},
                                      "http": {"host": "127.0.0.1", "port": 0}, "log": {"format": "json"},
                                      "fleet": {"name": fleet, "heartbeat_seconds": 0.2, "lease_seconds": 2}}))
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:  # a file, not a pipe: a pipe nobody reads fills and stops the worker
        proc = subprocess.Popen([sys.executable, "-m", "worker.cli", "run", "--config", str(config)], cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=out, env={**os.environ, **code_path()})
    try:
        members = fleet_key(fleet, "members")
        await eventually(lambda: client.zcard(members) == 1, timeout=60, what="the worker in its fleet")
        client.set(layout_key(), LAYOUT + 1)
        code = await asyncio.to_thread(proc.wait, 30)
        stderr = log.read_text()
        assert code == 1, stderr
        said = [line for line in stderr.splitlines() if line.startswith("push-worker: ")]
        assert said == [f"push-worker: redis holds layout {LAYOUT + 1}, written by a later release; this release "
                        f"reads layout {LAYOUT} only and changed nothing: run a release that reads layout "
                        f"{LAYOUT + 1} (docs/upgrading.md#rollback)"], stderr
        assert "Traceback" not in stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        client.set(layout_key(), LAYOUT)
        client.close()
