"""The library's shape: no import circles among its modules, and no module over 400 lines.

Why: a circle makes import order matter (a name is missing if the other side loads first) and
hides which module is the lower layer; a long module mixes concerns (DESIGN.md §2 budgets
~400 lines). Both drift back one small change at a time, so a test holds the line.

Imports are read with `ast`, not by importing. Every import statement counts, including one
deferred into a function body: moving an import into a function hides a circle from the
interpreter but not from a reader, who still cannot tell which module is the lower layer. Only
imports under `if TYPE_CHECKING:` are left out (they never run; annotations only).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("rollouts", "training", "engines", "plumbing")
MAX_LINES = 400


def _library_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in `node`, wherever it sits, except under `if TYPE_CHECKING:`."""
    if isinstance(node, ast.Import | ast.ImportFrom):
        return [node]
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        return [i for child in node.orelse for i in _imports(child)]
    return [i for child in ast.iter_child_nodes(node) for i in _imports(child)]


def import_graph() -> dict[str, set[str]]:
    """Module name -> the project modules it imports (at load time or later, in a function)."""
    files = _library_files()
    modules = {_module_name(p): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import sub` imports the submodule when `sub` is one.
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            edges.update(t for t in targets if t in modules and t != name)
        graph[name] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_library_has_no_import_cycles():
    cycles = import_cycles(import_graph())
    assert not cycles, f"{len(cycles)} import circle(s) among library modules: {cycles}"


def test_import_graph_sees_known_edges():
    # Guards the test itself: a parser that found no edges would pass the cycle test vacuously.
    graph = import_graph()
    assert "engines.types" in graph["engines.client"] or "engines.http" in graph["engines.client"]
    assert sum(len(edges) for edges in graph.values()) > 100


def test_engines_and_plumbing_import_no_package_above_them():
    # `plumbing` (errors, nursery, OpenMP set-up) is below everything; `engines` talks to
    # servers and needs neither the rollout side nor the trainer (before, `import engines`
    # loaded all of `rollouts` to get `EngineError`).
    above = {"engines": ("rollouts", "training"), "plumbing": ("rollouts", "training", "engines")}
    wrong = {
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        for target in targets
        if module.split(".")[0] in above and target.split(".")[0] in above[module.split(".")[0]]
    }
    assert not wrong, f"imports from a package above: {sorted(wrong)}"


def test_every_library_module_is_under_400_lines():
    too_long = {
        str(p.relative_to(ROOT)): n
        for p in _library_files()
        if (n := len(p.read_text().splitlines())) >= MAX_LINES
    }
    assert not too_long, f"library modules of {MAX_LINES}+ lines: {too_long}"


def test_errors_users_catch_from_rollouts_are_the_plumbing_classes():
    # The hierarchy lives in plumbing/ (engines must not import rollouts); users import it from
    # `rollouts.errors` / `rollouts`, so those names must be the very same objects.
    import plumbing.errors
    import rollouts
    import rollouts.errors

    defined = [
        name
        for name, obj in vars(plumbing.errors).items()
        if getattr(obj, "__module__", None) == "plumbing.errors" and not name.startswith("_")
    ]
    assert "EngineError" in defined and "DropSample" in defined
    for name in defined:
        assert getattr(rollouts.errors, name) is getattr(plumbing.errors, name), name
    assert rollouts.EngineError is plumbing.errors.EngineError
