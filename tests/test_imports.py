"""No import circles in pp_offload: a static walk of every module's imports (milliseconds, no import runs).

Why static: a circle that works today (one side imports the other inside a function) breaks the day someone
moves that import to the top, and with `from x import name` it fails only in the order modules happen to be
imported first. So imports inside functions count too: issue 32 found one circle closed by a lazy import in
pp_offload/data (embedded -> tokenizer -> packing -> loading -> embedded), and two more were untied later
(models.split <-> models.verify, recipe.auto -> pipeline -> offload_figures -> auto).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "pp_offload"


def _modules() -> dict[str, Path]:
    modules = {}
    for file in ROOT.rglob("*.py"):
        parts = list(file.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = file
    return modules


MODULES = _modules()


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(name: str, *, lazy: bool) -> set[str]:
    """The pp_offload modules ``name`` imports (inside functions too when ``lazy``), without the
    ``if TYPE_CHECKING:`` ones and without its own parent packages (always imported before it)."""
    file = MODULES[name]
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    parents = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    found: set[str] = set()

    def targets(node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [alias.name for alias in node.names]
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        # `from package import submodule` imports the submodule; `from module import name` the module.
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                if lazy or not in_function:
                    found.update(t for t in targets(child) if t in MODULES and t != name and t not in parents)
                continue
            scope = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, in_function or scope)

    visit(ast.parse(file.read_text()), False)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each holds at least one circle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm; the package is small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            component.append(v)
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_no_module_level_import_circle_in_pp_offload() -> None:
    graph = {name: imports_of(name, lazy=False) for name in MODULES}
    assert circles(graph) == []


def test_no_import_circle_even_through_lazy_imports() -> None:
    graph = {name: imports_of(name, lazy=True) for name in MODULES}
    assert circles(graph) == []


def test_the_walk_sees_circles_lazy_and_relative(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The checker itself must be able to fail: a lazy circle and a relative-import circle in a fake package.
    package = tmp_path / "pp_offload"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from pp_offload.sub import a\n")
    (package / "sub" / "a.py").write_text("def f():\n    from pp_offload.sub import b\n")
    (package / "sub" / "b.py").write_text("from . import a\nfrom typing import TYPE_CHECKING\n")
    (package / "sub" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pp_offload.sub.a\n"
    )
    monkeypatch.setitem(globals(), "ROOT", package)
    monkeypatch.setitem(globals(), "MODULES", _modules())
    lazy = {name: imports_of(name, lazy=True) for name in MODULES}
    assert circles(lazy) == [["pp_offload.sub.a", "pp_offload.sub.b"]]
    assert lazy["pp_offload.sub.c"] == set()  # TYPE_CHECKING imports do not count
    assert circles({name: imports_of(name, lazy=False) for name in MODULES}) == []
