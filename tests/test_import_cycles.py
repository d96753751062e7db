"""No import cycles among the modules of ``training/syncswitch/`` and ``plugins/syncswitch_airflow/``.

The graph is read from the source with ``ast``, nothing is imported. Its nodes are the two packages'
modules (a package is its ``__init__``); an edge is an import statement naming another of them:

- every import statement counts, at module level, inside a function (a lazy import) and under an
  ``if`` (``TYPE_CHECKING`` too): a cycle through a lazy import still makes the reader hold both
  modules at once, it only moves the failure from import time to run time;
- ``from a.b import c`` names ``a.b.c`` where that is a module, else ``a.b``; relative imports are
  resolved against the importing module's package;
- the parent packages that Python initializes on the way to a submodule are not edges: every
  module would then depend on its package's ``__init__``, and a package that re-exports its own
  submodules would be a cycle by construction;
- names in strings (the registry's ``module:attr`` references, ``importlib``) are not imports.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = (REPO / "training" / "syncswitch", REPO / "plugins" / "syncswitch_airflow")

Graph = dict[str, set[str]]


def module_files(package_dir: Path) -> dict[str, Path]:
    """Every module of the package in ``package_dir``, by dotted name (``__pycache__`` left out)."""
    root = package_dir.parent
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(tree: ast.AST, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that the import statements anywhere in ``tree`` name."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:  # ``from a import b``: the submodule a.b if it is one, else a
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return (found & modules) - {module}


def import_graph(package_dirs: Iterable[Path]) -> Graph:
    """Module -> the modules of these packages it imports (see the module docstring)."""
    files: dict[str, Path] = {}
    for package_dir in package_dirs:
        files |= module_files(package_dir)
    graph: Graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[module] = imported_modules(tree, module, path.name == "__init__.py", set(files))
    return graph


def cycle_groups(graph: Graph) -> list[frozenset[str]]:
    """The groups of modules that import each other, each through the others (the graph's strongly
    connected components of more than one module: Tarjan's algorithm), in name order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(frozenset(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(groups, key=min)


def cycles(graph: Graph) -> list[list[str]]:
    """One cycle through each group of :func:`cycle_groups`, as the path that closes it: [a, b, a]."""
    return [cycle_in(graph, group) for group in cycle_groups(graph)]


def cycle_in(graph: Graph, group: frozenset[str]) -> list[str]:
    """The shortest cycle through the group's first module (by name), within the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first: each module reached by its shortest path from ``start``
        following = []
        for node in frontier:
            for target in sorted(graph[node] & group):
                if target == start:
                    return [*paths[node], start]
                if target not in paths:
                    paths[target] = [*paths[node], target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"{sorted(group)} is not strongly connected")


# ---- the tree ------------------------------------------------------------------------------------------


def test_no_module_imports_itself_back_through_others() -> None:
    graph = import_graph(PACKAGES)
    cycles = [_shown(cycle_in(graph, group), group) for group in cycle_groups(graph)]
    assert not cycles, "import cycles (cut each one):\n" + "\n".join(cycles)


def _shown(cycle: list[str], group: frozenset[str]) -> str:
    """The cycle, and the group's other modules where more cycles go through them."""
    others = sorted(group - set(cycle))
    return " -> ".join(cycle) + (f" (its group also holds {', '.join(others)})" if others else "")


# ---- the checker, on trees made for it -------------------------------------------------------------------


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        pytest.param(
            {"pkg/__init__.py": "", "pkg/a.py": "import pkg.b\n", "pkg/b.py": "from pkg import a\n"},
            [["pkg.a", "pkg.b", "pkg.a"]],
            id="module-level",
        ),
        pytest.param(
            {
                "pkg/__init__.py": "",
                "pkg/a.py": "from pkg.b import thing\n",
                "pkg/b.py": "def f():\n    from pkg.c import other\n",
                "pkg/c.py": "if True:\n    from . import a\n",
            },
            [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]],
            id="through-a-lazy-and-a-relative-import",
        ),
        pytest.param(
            {
                "pkg/__init__.py": "from pkg.sub import x\n",
                "pkg/sub/__init__.py": "from ..sub.y import z\n",
                "pkg/sub/y.py": "from pkg import sub\n",
            },
            [["pkg.sub", "pkg.sub.y", "pkg.sub"]],
            id="packages-and-two-dots",
        ),
        pytest.param(
            {
                "pkg/__init__.py": "from pkg.a import f\n",
                "pkg/a.py": "from pkg.b import g\nimport json\n",
                "pkg/b.py": "import pkg.c as c\n",
                "pkg/c.py": "'pkg.a'\n",
            },
            [],
            id="a-package-re-exporting-its-modules-is-no-cycle",
        ),
    ],
)
def test_the_checker_finds_every_cycle_and_only_cycles(
    tmp_path: Path, files: dict[str, str], expected: list[list[str]]
) -> None:
    assert cycles(import_graph([_tree(tmp_path, files)])) == expected


def test_a_cycle_that_grows_is_a_new_group() -> None:
    """Known cycles are matched by their whole group: a module that joins one is found."""
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": {"a"}, "d": {"a"}}
    assert cycle_groups(graph) == [frozenset({"a", "b", "c"})]
    assert cycles(graph) == [["a", "b", "a"]]
