"""The previous release of push-worker, run beside this one as a Kubernetes rollout does.

`PREVIOUS_RELEASE` is the commit of main that the last release shipped; the fixture
`previous_release` extracts its `worker` package from this repository's history. A worker or CLI
started with that directory as its working directory imports it instead of this checkout's (the
interpreter puts the working directory first on the path): same dependencies, the old code.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

PREVIOUS_RELEASE = "82f66859a0604e0ccf78c2d20b2fd4d3a7013c2d"  # main before the change log of registry changes
REPOSITORY = Path(__file__).resolve().parents[2]


def extract(where: Path) -> Path:
    """The previous release's `worker` package under `where`; fails saying how to get the history."""
    archive = subprocess.run(["git", "-C", str(REPOSITORY), "archive", "--format=tar", PREVIOUS_RELEASE, "worker"],
                             capture_output=True, timeout=120)
    if archive.returncode != 0:
        raise RuntimeError(f"the previous release {PREVIOUS_RELEASE[:12]} is not in this checkout's history "
                           f"({archive.stderr.decode().strip()}); the upgrade tests need a full clone "
                           "(git fetch --unshallow)")
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive.stdout, check=True, timeout=120)
    return where
