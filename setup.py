"""The package build's one hook: the per-message path (worker/core/) compiled with mypyc.

Compiled where mypy is installed in the build environment (the image's build stage, `make
compile`) and PUSH_WORKER_COMPILE is not 0; otherwise the package is pure Python, the same sources
interpreted (`make install`'s editable install sets PUSH_WORKER_COMPILE=0, so that nothing compiled
lands in the checkout). Everything else is declared in pyproject.toml.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from setuptools import setup

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


setup(ext_modules=core_extensions())
