"""Which modules run compiled (mypyc): the per-message path, `worker.core`, as the package build made it."""

from __future__ import annotations

import importlib
from pathlib import Path

CORE_DIR = Path(__file__).resolve().parent.parent / "core"
# The per-message path: what a delivery runs through, from the consumer's message to the settled record.
COMPILED_MODULES = tuple(sorted(path.stem for path in CORE_DIR.glob("*.py") if path.stem != "__init__"))


def loaded_compiled() -> list[str]:
    """The per-message modules this process runs compiled (importing them)."""
    return [name for name in COMPILED_MODULES
            if not str(importlib.import_module(f"worker.core.{name}").__file__).endswith(".py")]


def state() -> str:
    """`compiled (mypyc)`, `interpreted`, or which part is compiled."""
    done = loaded_compiled()
    if len(done) == len(COMPILED_MODULES):
        return "compiled (mypyc)"
    return "interpreted" if not done else f"partly compiled ({', '.join(done)})"
