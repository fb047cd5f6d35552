"""The import graph: no circle in the product or the development tools, not even under
TYPE_CHECKING or inside a function (an import there is still an arrow between two rooms)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.broker_independent

ROOT = Path(__file__).resolve().parent.parent


def _modules(package: str) -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that `name` imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, `level` - 1 packages up
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *([base] if base else [])])
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name}


def _circle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of the graph, or []."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


@pytest.mark.parametrize("package", ["worker", "devtools"])
def test_no_import_circle(package):
    modules = _modules(package)
    known = set(modules) | set(_modules("worker"))
    graph = {name: {m for m in _imports(name, path, known) if m in modules} for name, path in modules.items()}
    assert _circle(graph) == []


# The layers of the shipped package, lowest first: a package imports only those below it (and
# itself). docs/design.md#packages draws the same picture; the test below keeps the two together.
LAYERS = ("runtime", "endpoint", "model", "state", "core", "telemetry", "broker", "fleet", "ops", "api", "process",
          "cli")
ENTRY_POINTS = {"worker": set(), "worker.__main__": {"cli"}}  # all that stays at the package root


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else module


def test_each_package_imports_only_the_layers_below_it():
    modules = _modules("worker")
    known = set(modules)
    wrong = []
    for name, path in modules.items():
        own = _package(name)
        allowed = ENTRY_POINTS[own] if own in ENTRY_POINTS else set(LAYERS[: LAYERS.index(own) + 1])
        for imported in sorted(_imports(name, path, known)):
            if _package(imported) not in allowed:
                wrong.append(f"{name} imports {imported}")
    assert wrong == []


def test_the_package_root_holds_only_entry_points_and_the_layers():
    root = ROOT / "worker"
    modules = {p.stem for p in root.glob("*.py")}
    packages = {p.name for p in root.iterdir() if (p / "__init__.py").exists()}
    assert modules == {"__init__", "__main__"}
    assert packages == set(LAYERS)


def test_design_md_draws_the_layers_the_test_keeps():
    """docs/design.md#packages: one line per package, lowest first, as `- **name/**: ...`."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Packages", 1)[1].split("\n## ", 1)[0]
    drawn = [line.split("**")[1].rstrip("/") for line in section.splitlines() if line.startswith("- **")]
    assert tuple(drawn) == LAYERS


def test_every_package_the_product_imports_is_declared_in_pyproject():
    """`worker/api/console.py` imported markupsafe, which pyproject.toml did not declare (it came as
    jinja2's dependency). Every third-party module the shipped package imports must belong to a
    distribution pyproject.toml names: in `dependencies`, or in an extra for code that runs only
    with it (the embedded broker and Redis)."""
    import importlib.metadata
    import re
    import sys
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values()
                                                for r in extra)]

    def normal(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    declared = {normal(re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0]) for r in requirements}
    owners = importlib.metadata.packages_distributions()
    undeclared: dict[str, str] = {}
    for name, path in _modules("worker").items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                tops = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                tops = [node.module.split(".")[0]]
            else:
                continue
            for top in tops:
                if top in sys.stdlib_module_names or top in ("worker", "__future__", "_typeshed"):  # _typeshed: stubs
                    continue
                distributions = {normal(d) for d in owners.get(top, [top])}
                if not distributions & declared:
                    undeclared[top] = name
    assert undeclared == {}, f"imported, not declared in pyproject.toml: {undeclared}"
