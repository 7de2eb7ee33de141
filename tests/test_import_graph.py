"""The package's module import graph (read from the source with ``ast``, nothing imported): no circle among
the imports that run when a module is imported, and a report of the circles that only close through imports
inside functions (deferred until the function runs, so Python never sees them half-initialised)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "k2lab"


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> Iterator[tuple[str, bool]]:
    """``(imported module, at top level)`` for each import of a package module in ``path``: an import in a
    function body is not top level; one under ``if TYPE_CHECKING:`` never runs and is left out."""

    def resolve(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    def targets(node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [alias.name for alias in node.names]
        base = node.module or ""
        if node.level:
            package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join([*package, base] if base else package)
        # ``from a import b``: the submodule a.b when there is one, else the module a
        return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]

    def walk(node: ast.AST, top: bool) -> Iterator[tuple[str, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                yield from (item for branch in child.orelse for item in walk(branch, top))
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in targets(child):
                    module = resolve(target) if target.startswith("k2lab") else None
                    if module is not None and module != name:
                        yield module, top
            inner = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from walk(child, top and not inner)

    yield from walk(ast.parse(path.read_text(encoding="utf-8")), True)


def import_graph(top_level_only: bool) -> dict[str, set[str]]:
    """Module -> the package modules it imports (only the top-level imports when ``top_level_only``)."""
    modules = module_files()
    return {
        name: {target for target, top in imports_of(name, path, modules) if top or not top_level_only}
        for name, path in modules.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted; every import circle
    lies inside one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(found)


def test_the_walker_sees_both_kinds_of_import(tmp_path):
    package = tmp_path / "k2lab"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from k2lab.sub import b\n")
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nfrom . import c\nif TYPE_CHECKING:\n    from k2lab import a\n"
    )
    (package / "sub" / "c.py").write_text("def f():\n    from k2lab.sub.b import g\n")
    (package / "a.py").write_text("import k2lab.sub.c\n")
    modules = module_files(package)
    assert sorted(imports_of("k2lab.sub.b", modules["k2lab.sub.b"], modules)) == [("k2lab.sub.c", True)]
    assert list(imports_of("k2lab.sub.c", modules["k2lab.sub.c"], modules)) == [("k2lab.sub.b", False)]
    assert list(imports_of("k2lab.sub", modules["k2lab.sub"], modules)) == [("k2lab.sub.b", True)]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_among_top_level_imports():
    assert cycles(import_graph(top_level_only=True)) == []


def test_report_circles_through_function_level_imports(capsys):
    """Not a failure: a function-level import closes its circle only when called. Printed for the record
    (``pytest -s``); the trainer's loop and its recipe's config are in none of them."""
    found = cycles(import_graph(top_level_only=False))
    with capsys.disabled():
        print(f"\n{len(found)} import circle(s) through function-level imports")
        for component in found:
            print("  " + " <-> ".join(component))
    for component in found:
        assert "k2lab.train.config" not in component and "k2lab.train.data" not in component


@pytest.mark.parametrize("module", ["k2lab.train.trainer", "k2lab.train.config"])
def test_the_trainer_and_its_config_do_not_import_agentic_or_vision(module):
    graph = import_graph(top_level_only=False)
    assert not {m for m in graph[module] if m.startswith(("k2lab.agentic", "k2lab.vision"))}
