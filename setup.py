"""The package build's hooks: the per-message path (worker/core/) compiled with mypyc, and the
commit the package is built from recorded beside it (`push-worker --version` prints it).

Compiled where mypy is installed in the build environment (the image's build stage, `make
compile`) and PUSH_WORKER_COMPILE is not 0; otherwise the package is pure Python, the same sources
interpreted (`make install`'s editable install sets PUSH_WORKER_COMPILE=0, so that nothing compiled
lands in the checkout). Everything else is declared in pyproject.toml.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_py import build_py

CORE = Path("worker") / "core"
GROUP = "worker.core._compiled"  # the group's shared library: worker/core/_compiled__mypyc.*.so


def core_extensions() -> list[Any]:
    if os.environ.get("PUSH_WORKER_COMPILE", "1") == "0":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        sys.stderr.write("push-worker: mypy is not installed where the package is built: worker/core is "
                         "installed as pure Python\n")
        return []
    sources = sorted(str(path) for path in CORE.glob("*.py") if path.name != "__init__.py")
    # The options of `make lint`'s mypy (pyproject.toml); the generated C goes to .build/, not the tree.
    return list(mypycify(["--strict", "--ignore-missing-imports", *sources], group_name=GROUP,
                         target_dir=str(Path(".build") / "mypyc")))


def built_commit() -> str:
    """PUSH_WORKER_COMMIT (the image's build has no git history), else the checkout's HEAD, marked
    `+dirty` when the sources differ from it."""
    if given := os.environ.get("PUSH_WORKER_COMMIT", "").strip():
        return given
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "worker", "pyproject.toml", "setup.py"],
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def built_since_release() -> int | None:
    """PUSH_WORKER_SINCE_RELEASE (the image's build), else the commits since the version's release as
    the checkout's git and CHANGELOG.md's record say (worker/runtime/release.py)."""
    given = os.environ.get("PUSH_WORKER_SINCE_RELEASE", "").strip()
    if given:
        return int(given) if given.isdigit() else None
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from worker.runtime.release import commits_since

    text = Path("pyproject.toml").read_text()
    found = re.search(r'^version = "([^"]+)"', text, re.M)
    return commits_since(found[1], Path(__file__).resolve().parent) if found else None


class RecordCommit(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):  # an editable install copies nothing: release.py asks git
            return
        recorded = Path(self.build_lib) / "worker" / "runtime" / "COMMIT"
        recorded.parent.mkdir(parents=True, exist_ok=True)
        since = built_since_release()
        recorded.write_text(built_commit() + "\n" + (f"since {since}\n" if since is not None else ""))


setup(ext_modules=core_extensions(), cmdclass={"build_py": RecordCommit})
