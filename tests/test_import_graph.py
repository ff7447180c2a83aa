"""The packages' import graph (read from the source, function-level imports included) has no cycles and keeps
the layers (README, Layout): inference -> recipes -> lightning_swarm, never upwards."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("lightning_swarm", "recipes", "inference")  # each may import only the ones before it


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(depth: int) -> dict:
    """{node: nodes it imports}, a node being a module name cut to its first ``depth`` parts."""
    modules = {_module_name(p): p for layer in LAYERS for p in (REPO / layer).rglob("*.py")}

    def node(name: str) -> str:
        return ".".join(name.split(".")[:depth])

    graph = {}
    for name, path in modules.items():
        for statement in ast.walk(ast.parse(path.read_text())):
            if isinstance(statement, ast.Import):
                targets = [alias.name for alias in statement.names]
            elif isinstance(statement, ast.ImportFrom) and statement.module and statement.level == 0:
                targets = [statement.module] + [f"{statement.module}.{alias.name}" for alias in statement.names]
            else:
                continue
            for target in targets:
                if target in modules and node(target) != node(name):
                    graph.setdefault(node(name), set()).add(node(target))
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("depth", [2, 9], ids=["subpackages", "modules"])
def test_no_import_cycles(depth):
    assert cycles(import_graph(depth)) == []


def test_cycles_are_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_layers_import_only_downwards():
    for layer, imported in import_graph(1).items():
        assert all(LAYERS.index(other) < LAYERS.index(layer) for other in imported), f"{layer} imports {imported}"
