"""The model layer's import graph: no cycles, and the two decoder stacks independent of each other.

Read from the sources (every `import` statement, module-level or inside a function), so a cycle is
found even where a lazy import hides it at run time."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("inference_service", "kernels")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (`from a.b import c` counts a.b, or a.b.c when that is a module)."""
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph = {}
    for name, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.update(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in files
                               else node.module for alias in node.names)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]], within: str) -> list[str] | None:
    """A cycle among the modules under `within`, as the list of modules around it; None if there is none."""
    nodes = {n for n in graph if n.startswith(within)}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node] & nodes):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(nodes):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle():
    graph = import_graph()
    for package in PACKAGES:
        assert find_cycle(graph, package) is None, package


def test_the_stacks_import_the_parameters_and_not_each_other():
    graph = import_graph()
    eager, fused = "inference_service.model.eager_stack", "inference_service.model.fused_stack"
    layers = "inference_service.model.layers"
    assert layers in graph[eager] and layers in graph[fused]
    assert fused not in graph[eager] and eager not in graph[fused]
    assert not {eager, fused, "inference_service.model.decoder"} & graph[layers]


def test_the_cycle_finder_finds_a_cycle():
    graph = {"m.a": {"m.b"}, "m.b": {"m.c"}, "m.c": {"m.a"}, "m.d": set()}
    assert find_cycle(graph, "m") == ["m.a", "m.b", "m.c", "m.a"]
    assert find_cycle({"m.a": {"m.b"}, "m.b": set()}, "m") is None
