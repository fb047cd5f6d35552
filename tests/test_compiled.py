"""The per-message path compiled with mypyc (`devtools.compile`): what runs, and stale builds."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest
import yaml

from devtools.compile import stale
from tests.support.helpers import spawn_worker, stop_worker, wait_sync
from worker.runtime import compiled

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


@pytest.mark.broker_independent
def test_a_build_older_than_any_source_is_stale(tmp_path):
    """`make test` runs the copy in .build/compiled only when it was made from the sources as they
    are (conftest refuses it otherwise); `devtools.compile.stale` says which differ."""
    checkout, build = tmp_path / "checkout", tmp_path / "build"
    for where in (checkout, build):
        (where / "worker" / "core").mkdir(parents=True)
        (where / "worker" / "__init__.py").write_text("")
        (where / "worker" / "core" / "flow.py").write_text("LIMIT = 1\n")
    (build / "worker" / "core" / "flow.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")  # not a source
    (checkout / "pyproject.toml").write_text('[project]\nversion = "1.0.0"\n')
    (build / "push_worker-1.0.0.dist-info").mkdir()
    assert stale(build, checkout) == []
    (checkout / "pyproject.toml").write_text('[project]\nversion = "1.1.0"\n')  # a new version: built again
    assert stale(build, checkout) == ["pyproject.toml"]
    (build / "push_worker-1.1.0.dist-info").mkdir()
    (checkout / "worker" / "core" / "flow.py").write_text("LIMIT = 2\n")  # edited after the build
    (checkout / "worker" / "added.py").write_text("")
    (build / "worker" / "removed.py").write_text("")
    assert stale(build, checkout) == ["worker/added.py", "worker/core/flow.py", "worker/removed.py"]
    assert stale(tmp_path / "never-built", checkout) == ["worker/__init__.py", "worker/added.py",
                                                         "worker/core/flow.py"]
    (build / "worker" / "core" / "flow.py").write_text("LIMIT = 2\n")
    (checkout / "worker" / "added.py").unlink()
    (build / "worker" / "removed.py").unlink()
    (build / "worker" / "runtime").mkdir()
    (build / "worker" / "runtime" / "COMMIT").write_text("abc123\n")  # the build's own record: not a source
    for where, style in ((checkout, "a { color: red }"), (build, "a { color: blue }")):
        (where / "worker" / "static").mkdir()
        (where / "worker" / "static" / "console.css").write_text(style)
    assert stale(build, checkout) == ["worker/static/console.css"]  # package data counts as a source


@pytest.mark.broker_independent
def test_nothing_compiled_lives_in_the_checkouts_package():
    """The compiled form is made by the package build into .build/, never beside the sources."""
    assert sorted(str(p.relative_to(ROOT)) for p in (ROOT / "worker").rglob("*.so")) == []
    assert compiled.COMPILED_MODULES and all((ROOT / "worker" / "core" / f"{name}.py").exists()
                                             for name in compiled.COMPILED_MODULES)


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
        path = ROOT / "worker" / "core" / f"{name}.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Try) and node.finalbody:
                assigned = _assigned(node.body)
                for read in sorted(_read(node.finalbody) & assigned.keys()):
                    offending.append(f"worker/core/{name}.py:{assigned[read]}: {read}")
    assert not offending, f"assigned in a try body and read in its finally: {offending}"
