"""Which modules are compiled with mypyc (`devtools.compile`), and a guard against stale ones.

Python imports an extension module before the source beside it, so an extension built before a
source was edited would silently run the old code. The package refuses to import then.
"""

from __future__ import annotations

import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
GROUP = "worker._compiled"  # the shared library of the group: worker/_compiled__mypyc.*.so
# The per-message path: what a delivery runs through, from the consumer's message to the settled record.
COMPILED_MODULES = (
    "attempts", "backoff", "batches", "budgets", "delivery", "dispatcher", "endpoint_health", "flow", "history",
    "http1", "keys", "messages", "metrics", "redis_batch", "signing",
)


def compiled_files() -> list[Path]:
    return sorted(PACKAGE_DIR.glob("*.so")) + sorted(PACKAGE_DIR.glob("*.pyd"))


def newer_sources() -> list[str]:
    """The package's sources changed after its oldest compiled file was built. Any source counts, not
    only the compiled ones': a compiled module builds in what it imports (constants, signatures)."""
    built = compiled_files()
    if not built:
        return []
    oldest = min(path.stat().st_mtime for path in built)
    return sorted(str(path.relative_to(PACKAGE_DIR.parent)) for path in PACKAGE_DIR.rglob("*.py")
                  if path.stat().st_mtime > oldest)


def fresh() -> bool:
    """Every per-message module is compiled, and no source changed since."""
    names = {path.name.split(".", 1)[0] for path in compiled_files()}
    return set(COMPILED_MODULES) <= names and not newer_sources()


def check_fresh() -> None:
    if "devtools.compile" in sys.orig_argv:  # the tool that rebuilds or removes them
        return
    newer = newer_sources()
    if newer:
        shown = ", ".join(newer[:3]) + (f" and {len(newer) - 3} more" if len(newer) > 3 else "")
        sys.stderr.write(f"push-worker: the compiled modules are older than {shown}: run `make compile` "
                         "again, or `make uncompile` to run the source\n")
        raise SystemExit(2)


def loaded_compiled() -> list[str]:
    """The per-message modules this process runs compiled (importing them)."""
    import importlib

    return [name for name in COMPILED_MODULES
            if not str(importlib.import_module(f"worker.{name}").__file__).endswith(".py")]


def state() -> str:
    """`compiled (mypyc)`, `interpreted`, or which part is compiled."""
    done = loaded_compiled()
    if len(done) == len(COMPILED_MODULES):
        return "compiled (mypyc)"
    return "interpreted" if not done else f"partly compiled ({', '.join(done)})"
