"""The previous release of push-worker, run beside this one as a Kubernetes rollout does.

Which release that is comes from CHANGELOG.md's record (devtools/releases.py: the newest recorded
release that is an ancestor of this checkout and not the checkout itself). The fixture
`previous_release` extracts its `worker` package from this repository's history; a worker or CLI
started with that directory as its working directory imports it instead of this checkout's (the
interpreter puts the working directory first on the path): same dependencies, the old code.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from devtools.releases import ROOT, Release, previous


def extract(where: Path) -> tuple[Release, Path]:
    """The previous release, and its `worker` package under `where`."""
    release = previous()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", release.commit, "worker"],
                             capture_output=True, timeout=120, check=True)
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive.stdout, check=True, timeout=120)
    return release, where
