"""The package's import graph: no cycles between modules, and emulation stays a layer.

Read from the modules' syntax trees, so every import counts: inside functions and under
``TYPE_CHECKING`` too (a deferred import that closes a cycle is still a cycle in the design).
``megatron_het.x.y`` imported through a package ``__init__`` counts as the package.
"""

from __future__ import annotations

import ast
import functools
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "megatron_het"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.lru_cache(maxsize=1)  # parsed once for every test here (the tree does not change)
def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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
            visit(node)
    return found


def _without_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's ``__init__`` re-exports its modules; a module importing a sibling through the
    package name is an edge to the package, not a cycle through it."""
    return {
        name: {t for t in targets if not name.startswith(t + ".")}
        for name, targets in graph.items()
    }


def test_no_import_cycles() -> None:
    assert cycles(_without_package_inits(import_graph())) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The composition roots that wire a run (and a dry run) are the only training modules that may
# reach into emulation; everything else in the product knows only the hooks.
COMPOSITION_ROOTS = {"megatron_het.training.run", "megatron_het.training.dry_run"}


@pytest.mark.parametrize(
    "package",
    [
        "comm",
        "pipeline",
        "perf",
        "cluster",
        "training",
        "parallel",
        "optim",
        "checkpoint",
        "planner",
        "model",
        "trace",
    ],
)
def test_product_packages_do_not_import_emulation(package: str) -> None:
    graph = import_graph()
    prefix = f"megatron_het.{package}"
    offenders = {
        name: sorted(t for t in targets if t.startswith("megatron_het.emulation"))
        for name, targets in graph.items()
        if (name == prefix or name.startswith(prefix + ".")) and name not in COMPOSITION_ROOTS
    }
    assert {name: found for name, found in offenders.items() if found} == {}
