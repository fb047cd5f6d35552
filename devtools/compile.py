"""The package as the image builds it, out of the checkout: `python -m devtools.compile [--clean|--check]`.

Builds a wheel of the package with its build hook on (setup.py: the per-message path, worker/core,
compiled with mypyc) and installs it into .build/compiled, which `make test` and `make bench` put
first on the path. Nothing is written into the package's sources, and the checkout's own install
stays pure Python. The build is made again whenever a source of the package differs from the copy
it was made from (`stale`): a test run never runs an edit's previous build.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from worker.runtime import compiled
from worker.runtime.compiled import COMPILED_MODULES

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / ".build"
COMPILED_DIR = BUILD / "compiled"  # the installed package, compiled: first on the path of compiled runs
WHEELS = BUILD / "wheels"
BUILD_VENV = BUILD / "venv"


BUILT = frozenset({"worker/runtime/COMMIT"})  # written by the build into the installed package (--version's commit)


def _sources(package_parent: Path) -> dict[str, Path]:
    """Every file the package ships, its data too: an edited template or style makes a build stale
    as an edited module does (a test run showed a page's previous template)."""
    return {name: path for path in (package_parent / "worker").rglob("*")
            if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".so", ".pyc")
            and (name := path.relative_to(package_parent).as_posix()) not in BUILT}


def stale(compiled_dir: Path = COMPILED_DIR, checkout: Path = ROOT) -> list[str]:
    """The package's sources that the compiled build does not hold as they are now (changed,
    added or removed since it was made); every one when there is no build."""
    here, there = _sources(checkout), _sources(compiled_dir) if compiled_dir.exists() else {}
    changed = sorted(name for name in here.keys() | there.keys()
                     if name not in here or name not in there or here[name].read_bytes() != there[name].read_bytes())
    version = tomllib.loads((checkout / "pyproject.toml").read_text())["project"]["version"]
    if there and not (compiled_dir / f"push_worker-{version}.dist-info").exists():  # a new version: --version says it
        changed.append("pyproject.toml")
    return changed


def clean() -> None:
    shutil.rmtree(BUILD, ignore_errors=True)  # the build venv too: made again with the next build
    for legacy in (ROOT / "worker").glob("*.so"):  # built in place by earlier versions of this tool
        legacy.unlink()


def _image_pin(name: str) -> str:
    """`name==version` as the image's build pins it (deploy/requirements.txt)."""
    found = re.search(rf"^({re.escape(name)}==\S+)", (ROOT / "deploy" / "requirements.txt").read_text(), re.M)
    assert found, f"{name} is not pinned in deploy/requirements.txt"
    return found.group(1)


def build_python() -> str:
    """The interpreter of a venv of its own to build in, as the image's build stage has one: the build
    backend the image builds with, mypy as requirements.lock pins it, and the runtime dependencies
    (mypy reads their types). The checkout's venv keeps the setuptools it came with."""
    python = BUILD_VENV / "bin" / "python"
    pyproject = (ROOT / "pyproject.toml").read_text()
    pins = (ROOT / "requirements.lock").read_text() + (ROOT / "deploy" / "requirements.txt").read_text()
    wanted = hashlib.sha256((pins + pyproject).encode()).hexdigest()
    stamp = BUILD_VENV / ".installed"
    if not stamp.exists() or stamp.read_text() != wanted:
        shutil.rmtree(BUILD_VENV, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(BUILD_VENV)], check=True)
        dependencies = tomllib.loads(pyproject)["project"]["dependencies"]
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        "-c", "requirements.lock", _image_pin("setuptools"), "mypy", "types-PyYAML", *dependencies],
                       check=True, cwd=ROOT)
        stamp.write_text(wanted)
    return str(python)


def build() -> None:
    """The wheel, by the package build with its hook on, installed into COMPILED_DIR."""
    shutil.rmtree(COMPILED_DIR, ignore_errors=True)
    shutil.rmtree(WHEELS, ignore_errors=True)
    # setuptools copies the package into its build directory and never removes what the sources no
    # longer hold: a moved module would ship twice. Its compiled objects (temp.*) are kept.
    for copied in (BUILD / "setuptools").glob("lib*"):
        shutil.rmtree(copied)
    env = {**os.environ, "PUSH_WORKER_COMPILE": "1"}
    subprocess.run([build_python(), "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(WHEELS), str(ROOT)], check=True, env=env, cwd=ROOT)
    [wheel] = WHEELS.glob("push_worker-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
                    "--no-compile", "--target", str(COMPILED_DIR), str(wheel)], check=True)
    built = [path.name for path in (COMPILED_DIR / "worker" / "core").glob("*.so")]
    if not built:  # the hook fell back to pure Python (no mypy here): not what was asked for
        raise SystemExit("devtools.compile: the build made no compiled module (is mypy installed?)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.compile", description=__doc__.split("\n")[0])
    parser.add_argument("--clean", action="store_true", help="remove the build instead")
    parser.add_argument("--force", action="store_true", help="build even when the build is up to date")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 unless this interpreter runs every per-message module compiled")
    args = parser.parse_args(argv)
    if args.check:
        state = compiled.state()
        print(f"per-message path: {state}")
        return 0 if compiled.loaded_compiled() == list(COMPILED_MODULES) else 1
    if args.clean:
        clean()
        print(f"removed {BUILD.relative_to(ROOT)}/")
        return 0
    if not stale() and not args.force:
        print(f"{COMPILED_DIR.relative_to(ROOT)} is up to date (--force builds it again)")
        return 0
    build()
    print(f"built {COMPILED_DIR.relative_to(ROOT)}: worker/core compiled ({', '.join(COMPILED_MODULES)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
