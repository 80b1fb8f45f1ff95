"""kvstore's modules import each other without a circle, and `tiers` (the configuration every other
kvstore module reads) imports none of them.

Why: a circle closed by a function-level import works until someone moves the import to the top or
imports the modules in another order; a configuration leaf can be read by the engine, the node's
server and the router without pulling in processes, Ray actors or each other."""

from __future__ import annotations

import ast

from paths import REPO_ROOT

KVSTORE = REPO_ROOT / "kvstore"
PACKAGE = "kvmesh.kvstore"


def import_graph() -> dict[str, set[str]]:
    """module -> the kvstore modules it imports anywhere in its body (function-level imports included)."""
    modules = {p.stem for p in KVSTORE.glob("*.py") if p.stem != "__init__"}
    graph = {}
    for name in modules:
        deps = set()
        for node in ast.walk(ast.parse((KVSTORE / f"{name}.py").read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            deps |= {t.removeprefix(PACKAGE + ".") for t in targets if t.startswith(PACKAGE + ".")} & modules
        graph[name] = deps - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path (first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
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


def test_find_cycle_sees_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_kvstore_has_no_import_cycle():
    graph = import_graph()
    assert {"tiers", "node_server", "lmcache_server"} <= set(graph)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_tiers_is_a_configuration_leaf():
    """tiers imports no other kvstore module, and nothing that starts processes or talks to Ray."""
    assert import_graph()["tiers"] == set()
    tree = ast.parse((KVSTORE / "tiers.py").read_text(encoding="utf-8"))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"kvmesh", "ray", "subprocess", "socket", "lmcache", "vllm", "requests"}
