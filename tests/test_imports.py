"""No import cycles in tierkv, lazy (function-level) imports included: the daemon never
imports the CLI, and hf/config.py stays a leaf (issue 10, item 4). Imports under
``if TYPE_CHECKING:`` are annotations only and do not count."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "tierkv"


def modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else [])) if node.level else (node.module or "")
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    dest = full if full in mods else target
                    if dest in mods and dest != name:
                        edges[name].add(dest)
            else:
                for alias in node.names:
                    if alias.name in mods and alias.name != name:
                        edges[name].add(alias.name)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            strong(v)
    return out


def test_no_import_cycles():
    # A package's __init__ importing its own modules is not a cycle a reader trips over:
    # drop edges into a package from its own submodules (``from . import x`` in a module).
    edges = graph()
    for name in edges:
        edges[name] = {d for d in edges[name] if not name.startswith(d + ".")}
    assert cycles(edges) == []


def test_the_daemon_does_not_import_the_cli():
    edges = graph()
    bad = sorted((m, d) for m, ds in edges.items() if m.startswith("tierkv.daemon") for d in ds
                 if d.startswith("tierkv.cli"))
    assert bad == []


def test_hf_config_is_a_leaf_of_hf():
    assert not {d for d in graph()["tierkv.hf.config"] if d.startswith("tierkv.hf")}


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _all_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import, those under ``if TYPE_CHECKING:`` too: an annotation names the
    daemon's surface as much as a call does."""
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def daemon_internals_imported() -> list[tuple[str, str]]:
    """(module, what it imports) for each import of a tierkv.daemon submodule by a module
    outside tierkv.daemon, relative or absolute: ``from .daemon.client import Client``,
    ``from ..daemon import client``, ``import tierkv.daemon.server``."""
    mods = modules()
    bad: list[tuple[str, str]] = []
    for name, path in mods.items():
        if name == "tierkv.daemon" or name.startswith("tierkv.daemon."):
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _all_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                bad += [(name, a.name) for a in node.names if a.name.startswith("tierkv.daemon.")]
                continue
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("tierkv.daemon."):
                bad.append((name, target))
            elif target == "tierkv.daemon":
                bad += [(name, f"{target}.{a.name}") for a in node.names if f"{target}.{a.name}" in mods]
    return sorted(bad)


def test_only_the_daemon_imports_its_submodules():
    # The daemon's public surface is tierkv/daemon/__init__.py (issue #32): the rest of
    # tierkv imports `from tierkv.daemon import Client`, never the module that defines it.
    assert daemon_internals_imported() == []
