"""The package rules of docs/architecture.md, checked on the source: imports, seams, mypy.

Imports are read with ast, lazy ones inside functions included: a rule such as "optimizers
import no torch" must hold for every line that can run, not only the module headers.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.conftest import EarlyRun

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "essa"

# package -> import prefixes it must never import (at any depth of its code)
FORBIDDEN = {
    "essa.optimizers": (
        "torch",
        "transformers",
        "peft",
        "essa.backends",
        "essa.adapters",
        "essa.recipes",
        "essa.rewards",
        "essa.harness",
    ),
    "essa.rewards": ("essa.backends", "essa.recipes", "essa.harness"),
    "essa.adapters": ("essa.recipes", "essa.harness"),
    "essa.data": ("essa.recipes", "essa.harness"),
    "essa.protocols": ("torch", "essa.backends", "essa.recipes"),
    # The sandbox is standalone: no models, no numeric stack.
    "essa.tools": (
        "torch",
        "transformers",
        "peft",
        "numpy",
        "essa.backends",
        "essa.adapters",
        "essa.recipes",
        "essa.rewards",
        "essa.harness",
    ),
}
# Parameter names that may stay `Any` in the recipes: objects of untyped external libraries.
EXTERNAL = {"model", "peft_model", "tokenizer", "console"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, *, runtime_only: bool = False) -> set[str]:
    """Modules imported by ``path``; runtime_only skips TYPE_CHECKING blocks."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if (
                runtime_only
                and isinstance(child, ast.If)
                and "TYPE_CHECKING" in ast.unparse(child.test)
            ):
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                found.add(child.module)
                found.update(f"{child.module}.{alias.name}" for alias in child.names)
            visit(child)

    visit(tree)
    return found


def sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_rules(package: str) -> None:
    broken = []
    for path in sources():
        name = module_name(path)
        if name != package and not name.startswith(package + "."):
            continue
        for imported in imports(path):
            for prefix in FORBIDDEN[package]:
                if imported == prefix or imported.startswith(prefix + "."):
                    broken.append(f"{path.relative_to(ROOT)} imports {imported}")
    assert not broken, "\n".join(broken)


# Components take the config sections they read; only recipes, set-up and the CLI take it whole.
SECTIONS_ONLY = (
    "essa.es",
    "essa.backends",
    "essa.rewards",
    "essa.data",
    "essa.adapters",
    "essa.optimizers",
    "essa.dist",
    "essa.tools",
)


@pytest.mark.parametrize("package", SECTIONS_ONLY)
def test_components_never_take_the_whole_config(package: str) -> None:
    whole = []
    for path in sources():
        name = module_name(path)
        inside = name == package or name.startswith(package + ".")
        if inside and "essa.config.Config" in imports(path):  # TYPE_CHECKING ones too
            whole.append(str(path.relative_to(ROOT)))
    assert not whole, "\n".join(whole)


@pytest.mark.parametrize(
    "package", ["essa.adapters", "essa.optimizers", "essa.rewards", "essa.data"]
)
def test_no_import_cycles_inside_a_package(package: str) -> None:
    """Runtime imports (lazy ones too) between a package's modules form no cycle.

    adapters.export <-> adapters.svd was one: a lazy import inside a method hid it.
    """
    names = {module_name(p): p for p in sources() if module_name(p).startswith(package + ".")}
    graph = {
        name: {m for m in imports(path, runtime_only=True) if m in names and m != name}
        for name, path in names.items()
    }
    for name in graph:  # a package's __init__ importing its own modules is not a cycle
        graph[name] = {m for m in graph[name] if not name.startswith(m + ".")}
    state: dict[str, int] = {}

    def cycle_from(node: str, trail: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*trail, node, nxt]
            if nxt not in state and (found := cycle_from(nxt, [*trail, node])):
                return found
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            found = cycle_from(name, [])
            assert found is None, " -> ".join(found)


def test_recipes_take_no_any_parameters_of_our_own_types() -> None:
    loose = []
    for path in sorted((PACKAGE / "recipes").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            for arg in args:
                annotation = "" if arg.annotation is None else ast.unparse(arg.annotation)
                if annotation == "Any" and arg.arg not in EXTERNAL:
                    loose.append(f"{path.name}:{node.lineno} {node.name}({arg.arg}: Any)")
    assert not loose, "\n".join(loose)


def test_seams_have_no_any() -> None:
    text = (PACKAGE / "protocols.py").read_text()
    assert "Any" not in text


@pytest.mark.slow
@pytest.mark.early(sys.executable, "-m", "mypy", "essa")  # beside the suite (tests/conftest.py)
def test_mypy_passes_on_the_package(early_run: EarlyRun) -> None:
    assert early_run.returncode == 0, early_run.output[-7000:]
