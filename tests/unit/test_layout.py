"""The house rules of the tree, checked from its files: one name per idea in the package, only
product code in it, no file over the size budget, and no import that edits sys.path."""

from __future__ import annotations

import ast
import collections
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = REPO / "megatron_het"
MAX_LINES = 600  # STYLE.md: aim under 400 lines a file, 600 at most
# Names every package may have once (a package's face and its `python -m` entry).
SHARED_NAMES = {"__init__.py", "__main__.py"}


def _package_files() -> list[pathlib.Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _python_files() -> list[pathlib.Path]:
    roots = [PACKAGE, REPO / "tools", REPO / "bench", REPO / "tests", REPO / "scripts"]
    files = [p for root in roots for p in root.rglob("*.py") if "__pycache__" not in p.parts]
    return sorted(files + [REPO / "pretrain_llama.py"])


def test_no_two_package_files_share_a_name() -> None:
    by_name = collections.defaultdict(list)
    for path in _package_files():
        if path.name not in SHARED_NAMES:
            by_name[path.name].append(str(path.relative_to(REPO)))
    clashes = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not clashes, f"one file name, one idea: {clashes}"


def test_the_package_imports_no_tool_benchmark_or_test() -> None:
    outside = ("bench", "tools", "tests")
    found = []
    for path in _package_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            found += [
                f"{path.relative_to(REPO)}: {name}"
                for name in names
                if name.split(".")[0] in outside
            ]
    assert not found, found


def test_package_files_stay_under_the_size_budget() -> None:
    over = {
        str(path.relative_to(REPO)): lines
        for path in _package_files()
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not over, f"split these by concept (at most {MAX_LINES} lines): {over}"


def test_nothing_edits_sys_path() -> None:
    """Tools and benchmarks import the installed package, tests import bench/ and tools/ as
    packages (pytest's pythonpath): no file inserts folders into sys.path."""
    edits = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("insert", "append")
                and ast.unparse(node.func.value) == "sys.path"
            ):
                edits.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not edits, edits
