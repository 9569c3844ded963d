"""The package's import graph: no cycles, the layer order, imports at the top of modules.

Read from the source (every ``import`` statement, also inside functions and under
``TYPE_CHECKING``), so a cycle hidden by a deferred import still fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dattri_llm"
LAYERS = {"cli": 4, "evaluation": 3, "attribution": 2, "gradient": 1, "utils": 0}
# Imports that may stay inside a function: optional dependencies, never our own modules.
DEFERRABLE = ("transformers", "dattri.", "torch.distributed.fsdp", "faiss.", "datasets.")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


def imported(node: ast.AST, known: set[str]) -> list[str]:
    """The package modules an import statement loads (a ``from x import sub`` loads ``x.sub``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in known]
    if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
        return []
    subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known]
    return subs or ([node.module] if node.module in known else [])


def graph(trees: dict[str, ast.Module], *, packages: bool) -> dict[str, set[str]]:
    """Module → modules it imports; ``packages=False`` leaves package ``__init__`` files out."""
    known = set(trees)
    keep = {m for m in known if packages or not _is_package(m)}
    return {
        m: {t for node in ast.walk(tree) for t in imported(node, known) if t in keep and t != m}
        for m, tree in trees.items()
        if m in keep
    }


def _is_package(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.is_dir()


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph (a list of modules), or ``None``."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_between_modules():
    assert find_cycle(graph(modules(), packages=False)) is None


def test_cycle_finder_can_fail():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def layer(name: str) -> int | None:
    parts = name.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_layers_import_downwards_only():
    """cli → attribution → gradient → utils: no module imports a higher one (type checking too)."""
    upward = [
        (m, t)
        for m, targets in graph(modules(), packages=True).items()
        for t in targets
        if layer(m) is not None and layer(t) is not None and layer(t) > layer(m)
    ]
    assert upward == []


def test_imports_inside_functions_are_optional_dependencies_only():
    deferred = []
    for name, tree in modules().items():
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.ImportFrom) and node.level == 0:
                    target = node.module or ""
                elif isinstance(node, ast.Import):
                    target = node.names[0].name
                else:
                    continue
                if not (target + ".").startswith(DEFERRABLE):
                    deferred.append(f"{name}:{node.lineno} imports {target}")
    assert deferred == []
