"""The per-message path compiled with mypyc (`devtools.compile`): what runs, and stale builds."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from tests.support.helpers import spawn_worker, stop_worker, wait_sync
from worker import compiled

ROOT = Path(__file__).resolve().parent.parent


def test_the_suite_runs_the_form_it_was_asked_for():
    """`make test` compiles and sets PUSH_WORKER_TEST_COMPILED=1: a build that silently fell back to
    the sources would otherwise pass as the compiled one."""
    if os.environ.get("PUSH_WORKER_TEST_COMPILED") == "1":
        assert compiled.state() == "compiled (mypyc)"
    else:  # run by hand: either form, never a mix of a stale build and sources
        assert compiled.state() in ("compiled (mypyc)", "interpreted")


def test_the_worker_says_which_form_it_runs(broker, redis_url, tmp_path):
    """An operator reads from the start-up line whether the image's compiled modules are in use."""
    config = tmp_path / "w.yaml"
    config.write_text(yaml.safe_dump({"pulsar": {"service_url": broker.url}, "redis": {"url": redis_url},
                                      "http": {"port": 0}, "log": {"format": "json"}}))
    log = tmp_path / "worker.log"
    proc = spawn_worker(config, log)
    try:
        wait_sync(lambda: b'"worker started"' in log.read_bytes(), timeout=60, what="the worker")
        started = next(json.loads(line) for line in log.read_text().splitlines() if '"worker started"' in line)
        assert started["per_message_path"] == compiled.state()
    finally:
        assert stop_worker(proc, 30) == 0


def test_a_compiled_module_older_than_its_source_refuses_to_import(tmp_path):
    package = tmp_path / "worker"
    package.mkdir()
    for name in ("__init__.py", "compiled.py"):
        shutil.copy(ROOT / "worker" / name, package / name)
    source = package / "fake.py"
    source.write_text("X = 1\n")
    extension = package / "fake.cpython-311-x86_64-linux-gnu.so"
    extension.write_bytes(b"")  # never loaded: the package refuses before any module imports

    def import_package() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", "import worker"], cwd=tmp_path, capture_output=True,
                              text=True, timeout=60)

    for path in package.glob("*.py"):
        os.utime(path, (500_000, 500_000))
    os.utime(extension, (1_000_000, 1_000_000))
    os.utime(source, (2_000_000, 2_000_000))  # edited after it was compiled
    stale = import_package()
    assert stale.returncode == 2
    assert stale.stderr.count("\n") == 1 and "Traceback" not in stale.stderr
    assert "the compiled modules are older than worker/fake.py" in stale.stderr and "make compile" in stale.stderr

    os.utime(source, (500_000, 500_000))
    (package / "imported.py").write_text("LIMIT = 2\n")  # a module the compiled ones import changed
    os.utime(package / "imported.py", (2_000_000, 2_000_000))
    stale = import_package()
    assert stale.returncode == 2 and "worker/imported.py" in stale.stderr

    os.utime(extension, (3_000_000, 3_000_000))  # compiled again
    fresh = import_package()
    assert fresh.returncode == 0, fresh.stderr


def _assigned(statements: list[ast.stmt]) -> dict[str, int]:
    """Names and attribute chains (`self.x`) assigned anywhere in these statements, with a line."""
    found: dict[str, int] = {}
    for statement in statements:
        for node in ast.walk(statement):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor, ast.NamedExpr)):
                targets = [node.target]
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                targets = [item.optional_vars for item in node.items if item.optional_vars is not None]
            for target in targets:
                for part in ast.walk(target):
                    if isinstance(part, (ast.Name, ast.Attribute)) and isinstance(part.ctx, ast.Store):
                        found.setdefault(ast.unparse(part), node.lineno)
    return found


def _read(statements: list[ast.stmt]) -> set[str]:
    return {ast.unparse(node) for statement in statements for node in ast.walk(statement)
            if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load)}


def test_no_compiled_module_reads_in_a_finally_what_its_try_assigned():
    """mypyc (2.4.1) gives a variable in `finally` the type it was narrowed to by an assignment in
    the `try` body, even when that assignment raised: `x: T | None = None; try: x = await f()
    finally: use(x)` fails with "T object expected; got None" when f raises or is cancelled. Found
    by this suite (a cancelled delivery raised TypeError instead of CancelledError, and kept its
    endpoint slot); this keeps the pattern out of every compiled module."""
    offending = []
    for name in compiled.COMPILED_MODULES:
        path = ROOT / "worker" / f"{name}.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Try) and node.finalbody:
                assigned = _assigned(node.body)
                for read in sorted(_read(node.finalbody) & assigned.keys()):
                    offending.append(f"worker/{name}.py:{assigned[read]}: {read}")
    assert not offending, f"assigned in a try body and read in its finally: {offending}"
