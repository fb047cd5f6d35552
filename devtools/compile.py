"""Compile the per-message path with mypyc, in place: `python -m devtools.compile [--clean]`.

The modules every message passes through are compiled from their own typed source (no second
implementation of anything): a delivery in a burst or backlog costs about a sixth less CPU
(docs/speed.md). The extension modules land beside their sources, where Python imports them
first. `make test` runs the suite on them, and the image ships them; the sources alone still run
as they are. Extensions older than any source of the package are refused at import
(`worker.compiled.check_fresh`), so an edit is never shadowed; they are built again only then (or
with --force).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from worker import compiled
from worker.compiled import COMPILED_MODULES, GROUP, PACKAGE_DIR, compiled_files


def clean() -> int:
    removed = compiled_files()
    for path in removed:
        path.unlink()
    return len(removed)


def compile_in_place() -> None:
    # Imported here: mypy is a build tool, absent where the compiled modules merely run (the image).
    from mypyc.build import mypycify
    from setuptools.dist import Distribution

    clean()
    options = ["--strict", "--ignore-missing-imports"]  # as `make test`'s mypy (pyproject.toml)
    with tempfile.TemporaryDirectory(prefix="push-worker-mypyc-") as build:
        # Built in a copy: mypy takes the directory above the package for user code, and where the
        # package is installed that is site-packages, whose modules it then refuses as user modules.
        root = Path(build) / "src"
        shutil.copytree(PACKAGE_DIR, root / "worker", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        here = Path.cwd()
        os.chdir(root)  # mypyc names modules by their paths from here
        try:
            sources = [f"worker/{name}.py" for name in COMPILED_MODULES]
            modules = mypycify(options + sources, group_name=GROUP, target_dir=str(Path(build) / "c"))
            dist = Distribution({"name": "push-worker-compiled", "ext_modules": modules})
            build_ext = dist.get_command_obj("build_ext")
            build_ext.inplace = True
            build_ext.build_temp = str(Path(build) / "temp")
            build_ext.build_lib = str(Path(build) / "lib")
            dist.run_command("build_ext")
        finally:
            os.chdir(here)
        for built in sorted((root / "worker").glob("*.so")):
            shutil.move(built, PACKAGE_DIR / built.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.compile", description=__doc__.split("\n")[0])
    parser.add_argument("--clean", action="store_true", help="remove the compiled modules instead")
    parser.add_argument("--force", action="store_true", help="build even when the compiled modules are up to date")
    parser.add_argument("--check", action="store_true", help="exit 1 unless every module runs compiled")
    args = parser.parse_args(argv)
    if args.check:
        state = compiled.state()
        print(f"per-message path: {state}")
        return 0 if compiled.loaded_compiled() == list(COMPILED_MODULES) else 1
    if args.clean:
        print(f"removed {clean()} compiled files from {PACKAGE_DIR}")
        return 0
    if compiled.fresh() and not args.force:
        print(f"compiled modules in {PACKAGE_DIR} are up to date (--force builds them again)")
        return 0
    compile_in_place()
    print(f"compiled {len(COMPILED_MODULES)} modules in {PACKAGE_DIR}: {', '.join(COMPILED_MODULES)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
