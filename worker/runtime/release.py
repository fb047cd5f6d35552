"""Which release this is: the package's version, the commit it was built from, and how many commits
past its release that commit is.

The package build records the commit in `worker/runtime/COMMIT` (setup.py; the image's build, which
has no git history, is given it), with the commits since the version's release on a second line
(`since N`); an editable install asks the checkout's git and CHANGELOG.md's record instead. A build
past its release says so: `1.1.0+3.gaf654e6` is three commits after 1.1.0, at af654e6.
"""

from __future__ import annotations

import functools
import re
import subprocess
from importlib import metadata
from pathlib import Path

RECORDED = Path(__file__).with_name("COMMIT")
CHECKOUT = Path(__file__).resolve().parents[2]


def version() -> str:
    try:
        return metadata.version("push-worker")
    except metadata.PackageNotFoundError:  # the sources on the path, not installed
        return "unknown"


def _recorded() -> list[str]:
    try:
        return RECORDED.read_text().split("\n")
    except OSError:
        return []


def _git(*args: str, root: Path = CHECKOUT) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


@functools.cache
def commit() -> str:
    """The full commit id (with `+dirty` for a build of uncommitted changes), or `unknown`."""
    recorded = _recorded()
    if recorded:
        return recorded[0].strip() or "unknown"
    return _git("rev-parse", "HEAD", root=RECORDED.parent) or "unknown"


def commits_since(release: str, root: Path = CHECKOUT) -> int | None:
    """How many commits the checkout's HEAD is past `release`'s commit (CHANGELOG.md's record, `[1.1.0]:
    <commit>`); None when the release is not recorded (its own commit, before the record) or unknown."""
    try:
        text = (root / "CHANGELOG.md").read_text()
    except OSError:
        return None
    found = re.search(rf"^\[{re.escape(release)}\]: ([0-9a-f]{{40}})$", text, re.M)
    if found is None:
        return None
    count = _git("rev-list", "--count", f"{found[1]}..HEAD", root=root)
    return int(count) if count and count.isdigit() else None


@functools.cache
def since_release() -> int | None:
    for line in _recorded()[1:]:
        if line.startswith("since ") and line[6:].strip().isdigit():
            return int(line[6:])
    if _recorded():
        return None  # a build that could not tell (no history): said as the release
    return commits_since(version())


def described_version() -> str:
    """The version, marked when the build is past its release: `1.1.0+3.gaf654e6`."""
    since = since_release()
    if not since:
        return version()
    return f"{version()}+{since}.g{commit()[:7]}"


def describe() -> str:
    """`1.0.0 (commit 0123456789ab)`: what `push-worker --version` prints after the program's name."""
    return f"{described_version()} (commit {commit()[:12]})"
