"""No import circles between the project's modules (services/, shared/, inferno/): every import
counts, those inside functions and under TYPE_CHECKING too, so no arrow runs back up a floor."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("services", "shared", "inferno")


def project_modules() -> dict[str, Path]:
    """Dotted name → file, for every module of the project's packages."""
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports anywhere in its file. `from p import m` names the
    module p.m when there is one, else p; a package's own __init__ run by importing a submodule
    is not counted (every package would circle with the modules it re-exports)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[:len(package) - node.level + 1], *([node.module] if node.module else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    found.add(sub)
                elif base in modules:
                    found.add(base)
    found.discard(name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_imports_in_functions_and_under_type_checking_count(tmp_path):
    package = tmp_path / "p"
    package.mkdir()
    files = {"p": package / "__init__.py", "p.a": package / "a.py", "p.b": package / "b.py"}
    files["p"].write_text("from .a import *\n")
    files["p.a"].write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.b import Thing\n")
    files["p.b"].write_text("def later():\n    from . import a\n    import p\n")
    graph = {name: imported(name, path, files) for name, path in files.items()}
    assert graph == {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p.a", "p"}}
    assert cycles(graph) == [["p", "p.a", "p.b"]]


def test_no_module_imports_itself_back():
    modules = project_modules()
    graph = {name: imported(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 100  # the packages were found
    assert cycles(graph) == []
