"""No import circles: in the launcher and library, the operator and the test environment's
harness, no module imports (directly or through others) a module that imports it back,
counting imports inside functions and under TYPE_CHECKING too. The layers between packages
are .importlinter's contracts (`make lint`); this covers every module, not only the
packages the contracts name."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def circles(graph) -> list[list[str]]:  # noqa: ANN001 (a grimp.ImportGraph)
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


@pytest.mark.parametrize("package", ["transom", "transom_operator", "chaos", "testenv"])
def test_no_module_imports_one_that_imports_it_back(package, monkeypatch):
    import grimp  # import-linter's, in the dev venv only (the compat venv collects this file too)

    for path in ("launcher", "operator", "hack"):
        monkeypatch.syspath_prepend(str(ROOT / path))
    graph = grimp.build_graph(package, cache_dir=None)
    assert circles(graph) == []


def test_a_circle_is_found():
    import grimp

    graph = grimp.ImportGraph()
    for a, b in [("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d")]:
        graph.add_import(importer=a, imported=b)
    assert circles(graph) == [["p.a", "p.b", "p.c"]]
