"""The product packages' import graph, read from the source with ast: no import cycle, and the runtime
packages never import the build tooling (model_build imports models/, not the other way round)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("serve_app", "models", "model_build", "facesearch_client")
RUNTIME = ("serve_app", "models")


def _module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    files = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """module -> the modules of `packages` it imports anywhere in its source (function bodies included)."""
    files = _module_files(root, packages)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: list[str] = []
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod.
                targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
        edges = set()
        for target in targets:
            while target and target not in files:
                target = target.rpartition(".")[0]
            # A package's __init__ runs before its submodules: an edge to it is not a loop back.
            if target and target != module and not module.startswith(target + "."):
                edges.add(target)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_the_product_packages_have_no_import_cycle() -> None:
    graph = import_graph(REPO, PRODUCT)
    assert {"models.runners", "model_build.fetch", "serve_app.launch.cli"} <= set(graph)
    assert cycles(graph) == []


def test_the_runtime_never_imports_the_build_tooling() -> None:
    graph = import_graph(REPO, PRODUCT)
    assert "models.weights" in graph["model_build.fetch"]  # the build reads the runtime's records
    into_build = {
        module: sorted(target for target in targets if target.startswith("model_build"))
        for module, targets in graph.items()
        if module.startswith(RUNTIME)
    }
    assert {module: targets for module, targets in into_build.items() if targets} == {}


def test_a_cycle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    # The checks above can fail: the loop that models.convert and models.age_v2 formed (one side imported
    # inside a function) is seen, and a `from package import module` edge resolves to the module.
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "convert.py").write_text("def main() -> None:\n    from pkg.age import fetch\n")
    (package / "age.py").write_text("from pkg import convert\n")
    (package / "leaf.py").write_text("from . import age\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.leaf"] == {"pkg.age"}
    assert cycles(graph) == [["pkg.age", "pkg.convert"]]
