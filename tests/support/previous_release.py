"""The previous release of push-worker, run beside this one as a Kubernetes rollout does.

Which release that is comes from CHANGELOG.md's record (devtools/releases.py: the newest recorded
release that is an ancestor of this checkout and not the checkout itself). The fixture
`previous_release` extracts its `worker` package from this repository's history and installs the
locks it shipped (its `requirements.lock`) into an environment of its own, kept under
`.build/previous/<commit>` for later runs: a worker or CLI started with that directory as its code
(`helpers.python_for`, `helpers.code_path`) runs the old code on the old dependencies.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path

from devtools.releases import ROOT, Release, previous
from tests.support.helpers import PREVIOUS_PYTHON

ENVIRONMENTS = ROOT / ".build" / "previous"


def extract(where: Path) -> tuple[Release, Path]:
    """The previous release, and its `worker` package under `where` (with its interpreter)."""
    release = previous()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", release.commit, "worker"],
                             capture_output=True, timeout=120, check=True)
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive.stdout, check=True, timeout=120)
    (where / PREVIOUS_PYTHON).write_text(str(environment(release)))  # a path: a symlink would lose the venv
    return release, where


def environment(release: Release) -> Path:
    """The interpreter of an environment holding exactly the release's locked dependencies, made once
    per commit (test processes running at once wait for the one that makes it)."""
    home = ENVIRONMENTS / release.commit
    python, done = home / "bin" / "python", home / ".installed"
    ENVIRONMENTS.mkdir(parents=True, exist_ok=True)
    with open(ENVIRONMENTS / f"{release.commit}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(home)], check=True, timeout=300)
            locked = subprocess.run(["git", "-C", str(ROOT), "show", f"{release.commit}:requirements.lock"],
                                    capture_output=True, check=True, timeout=60).stdout
            (home / "requirements.lock").write_bytes(locked)
            subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                            "-r", str(home / "requirements.lock")], check=True, timeout=900)
            done.touch()
    return python
