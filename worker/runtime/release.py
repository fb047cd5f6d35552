"""Which release this is: the package's version and the commit it was built from.

The package build records the commit in `worker/runtime/COMMIT` (setup.py; the image's build, which
has no git history, is given it); an editable install asks the checkout's git instead.
"""

from __future__ import annotations

import functools
import subprocess
from importlib import metadata
from pathlib import Path

RECORDED = Path(__file__).with_name("COMMIT")


def version() -> str:
    try:
        return metadata.version("push-worker")
    except metadata.PackageNotFoundError:  # the sources on the path, not installed
        return "unknown"


@functools.cache
def commit() -> str:
    """The full commit id (with `+dirty` for a build of uncommitted changes), or `unknown`."""
    try:
        return RECORDED.read_text().strip() or "unknown"
    except OSError:
        pass
    try:
        done = subprocess.run(["git", "-C", str(RECORDED.parent), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def describe() -> str:
    """`1.0.0 (commit 0123456789ab)`: what `push-worker --version` prints after the program's name."""
    return f"{version()} (commit {commit()[:12]})"
