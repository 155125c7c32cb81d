"""The house's rules: floors of imports with no circles, and modules and functions short enough to read.

Floors, from the bottom (a module may import its own floor and those below):

    asyncrl.wire, asyncrl.extras      wire messages, ZeroMQ sockets, addresses; which extra a feature needs
    asyncrl.tasks                     prompts, rewards, datasets, a user's hooks
    asyncrl.envs                      multi-turn environments, tools, token-exact chat rendering
    asyncrl.config                    the typed config and its checks
    asyncrl.observe                   metrics, Prometheus, the trace, logs
    asyncrl.control, asyncrl.weights, the coordinator and staleness bound; every weight transport;
    asyncrl.run_folder                    who holds a run folder
    buffers                           replay buffers
    learners, generators              the two roles (never importing each other)
    asyncrl.launch                    CLI, local launcher, Ray, sweeps, model import: nothing below imports it

Imports inside functions count as much as those at the top; an import under ``if TYPE_CHECKING:`` is for
annotations only and does not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import ROOT

PACKAGES = ("asyncrl", "buffers", "generators", "learners")
FLOORS = [
    ["asyncrl.wire", "asyncrl.extras"],
    ["asyncrl.tasks"],
    ["asyncrl.envs"],
    ["asyncrl.config"],
    ["asyncrl.observe"],
    ["asyncrl.control", "asyncrl.weights", "asyncrl.run_folder"],
    ["buffers"],
    ["learners", "generators"],
    ["asyncrl.launch"],
]
APART = [("learners", "generators"), ("generators", "learners")]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.AST) -> set[ast.AST]:
    """Import nodes under ``if TYPE_CHECKING:``."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            found |= {n for stmt in node.body for n in ast.walk(stmt)}
    return found


def first_party_imports(path: Path, known: set[str]) -> set[str]:
    """The first-party modules ``path`` imports (``from pkg import module`` names the module)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_only(tree)
    found = set()
    for node in ast.walk(tree):
        if node in skip:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [
                f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module
                for alias in node.names
            ]
        else:
            continue
        found |= {n for n in names if n.split(".")[0] in PACKAGES}
    return found


def import_graph() -> dict[str, set[str]]:
    paths = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
    known = {module_name(p) for p in paths}
    graph = {}
    for path in paths:
        name = module_name(path)
        # A package's own __init__ is what Python runs first anyway: an import of a package means its __init__.
        graph[name] = {m for m in first_party_imports(path, known) if m in known and m != name}
    return graph


def floor(module: str) -> int:
    matches = [
        (len(prefix), i)
        for i, names in enumerate(FLOORS)
        for prefix in names
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert matches, f"{module} is on no floor: add its package to FLOORS (tests/test_layering.py)"
    return max(matches)[1]


GRAPH = import_graph()


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m != "asyncrl"))
def test_every_import_points_down_or_sideways(module):
    above = sorted(m for m in GRAPH[module] if m != "asyncrl" and floor(m) > floor(module))
    assert not above, f"{module} (floor {floor(module)}) imports a floor above its own: {above}"


@pytest.mark.parametrize("package, forbidden", APART)
def test_the_roles_never_import_each_other(package, forbidden):
    crossing = sorted(
        f"{m} -> {d}"
        for m, deps in GRAPH.items()
        if m.split(".")[0] == package
        for d in deps
        if d.split(".")[0] == forbidden
    )
    assert not crossing


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checks_catch_what_they_exist_for():
    """An upward import and a cycle, made up, are both caught."""
    assert floor("asyncrl.launch.local") > floor("learners.cli") > floor("asyncrl.control.coordinator")
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80  # not counting the docstring


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        lines -= first.end_lineno - first.lineno + 1
    return lines


@pytest.mark.parametrize("package", PACKAGES)
def test_modules_and_functions_stay_readable(package):
    """A module over 400 lines or a function over 80 has more than one job: split it by job."""
    too_long = []
    for path in sorted((ROOT / package).rglob("*.py")):
        text = path.read_text()
        where = path.relative_to(ROOT)
        if (lines := len(text.splitlines())) > MAX_MODULE_LINES:
            too_long.append(f"{where}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _code_lines(node) > MAX_FUNCTION_LINES:
                too_long.append(f"{where}:{node.lineno} {node.name}: {_code_lines(node)} lines")
    assert not too_long, too_long
