"""The package rules of docs/architecture.md, checked on the source: imports, seams, mypy.

Imports are read with ast, lazy ones inside functions included: a rule such as "optimizers
import no torch" must hold for every line that can run, not only the module headers.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from essa import seeding
from essa.optimizers import OPTIMIZERS, EsOptimizerSpec, EsOptions, register
from essa.optimizers.base import (
    BestSoFar,
    as_fitness,
    as_vector,
    canonical_json,
    check_common_args,
    check_population,
    check_same_config,
    check_state_header,
    fitness_metrics,
    sha256_hex,
)

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


def imports(path: Path) -> set[str]:
    """Modules (and ``module.name``s) imported by ``path``, at any depth, TYPE_CHECKING too."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
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


def module_edges(path: Path, names: set[str]) -> set[str]:
    """The essa modules ``path`` imports: ``from pkg import mod`` depends on ``pkg.mod``,
    ``from pkg import name`` on ``pkg``'s ``__init__``; lazy and TYPE_CHECKING imports included."""
    edges: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            edges.update(alias.name for alias in node.names if alias.name in names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                edges.add(full if full in names else node.module)
    return edges & names


def module_graph() -> dict[str, set[str]]:
    """essa's modules -> the essa modules they import (see :func:`module_edges`)."""
    names = {module_name(p) for p in sources()}
    graph: dict[str, set[str]] = {}
    for path in sources():
        name = module_name(path)
        graph[name] = module_edges(path, names) - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

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
        if name not in state and (found := cycle_from(name, [])):
            return found
    return None


def test_no_import_cycles() -> None:
    """No two modules of essa import each other, through any chain: lazy imports inside
    functions and TYPE_CHECKING imports count too (a lazy import hid adapters.export <->
    adapters.svd; hf <-> teacher was another)."""
    found = find_cycle(module_graph())
    assert found is None, " -> ".join(found or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` collapsed to packages: ``essa.config.schema`` counts as ``essa.config``, a
    top-level module (``essa.cli``) as itself; an edge inside one package is dropped."""

    def package(name: str) -> str:
        return ".".join(name.split(".")[:2])

    packages: dict[str, set[str]] = {}
    for name, targets in graph.items():
        edges = packages.setdefault(package(name), set())
        edges.update(package(t) for t in targets if package(t) != package(name))
    for targets in list(packages.values()):
        for target in targets:
            packages.setdefault(target, set())
    return packages


def test_no_two_way_package_dependencies() -> None:
    """No two packages of essa import each other, through any chain of packages: what both need
    lives in the lower one or in a leaf module below both (essa.sources, essa.algorithms,
    essa.grpo_variants), so each package has a place in one order of layers. Lazy and
    TYPE_CHECKING imports count, as in :func:`test_no_import_cycles`."""
    found = find_cycle(package_graph(module_graph()))
    assert found is None, " -> ".join(found or [])


def test_package_graph_finds_a_two_way_dependency() -> None:
    graph = {
        "essa.a": set(),
        "essa.a.x": {"essa.b.y"},
        "essa.a.z": {"essa.a.x"},  # inside one package: no edge
        "essa.b.y": {"essa.a", "essa.leaf"},
        "essa.leaf": set(),
    }
    packages = package_graph(graph)
    assert packages == {"essa.a": {"essa.b"}, "essa.b": {"essa.a", "essa.leaf"}, "essa.leaf": set()}
    assert find_cycle(packages) == ["essa.a", "essa.b", "essa.a"]
    del graph["essa.b.y"]  # no module of essa.b imports essa.a any more
    assert find_cycle(package_graph(graph)) is None


def test_the_config_is_the_bottom_layer() -> None:
    """essa.config imports, outside itself, only modules of packages that import nothing of
    essa but leaf modules (those importing nothing of essa): the tables it checks names
    against (essa.algorithms, essa.grpo_variants, essa.sources) and the numpy-only optimizer
    registry, whose options are the optimizer section's keys."""
    graph = module_graph()
    packages = package_graph(graph)
    leaves = {name for name, targets in graph.items() if not targets}
    below = packages["essa.config"]
    assert below, "the config reads the tables below it"
    broken = [
        f"essa.config -> {package} -> {', '.join(sorted(packages[package] - leaves))}"
        for package in sorted(below)
        if packages[package] - leaves
    ]
    assert not broken, "\n".join(broken)


def test_recipes_are_imported_only_by_the_registry() -> None:
    """A recipe is its paper's loop: no module imports a recipe module (no recipe another, and
    nothing below the recipes one; shared machinery lives in the toolkits). The registry
    (essa.recipes) imports them lazily, by the paths in its table; the table is essa.algorithms,
    which imports nothing of essa, so the schema reads its names (the algorithm choices)
    without depending on the recipes. The registry imports nothing of essa but the table and
    its errors, and only the public API and the CLI read it."""
    from essa.recipes import RECIPES

    graph = module_graph()
    broken = [
        f"{name} imports {target}"
        for name, targets in sorted(graph.items())
        for target in sorted(targets)
        if target.startswith("essa.recipes.")
    ]
    assert not broken, "\n".join(broken)
    assert graph["essa.algorithms"] == set()
    assert graph["essa.recipes"] <= {"essa.algorithms", "essa.errors"}
    readers = {name for name, targets in graph.items() if "essa.recipes" in targets}
    assert readers <= {"essa.api", "essa.cli"}, readers
    for entry in RECIPES.values():  # each shipped algorithm is a module of essa/recipes
        module = entry.target.partition(":")[0]
        assert module.startswith("essa.recipes."), entry
        assert (PACKAGE / "recipes" / f"{module.rsplit('.', 1)[1]}.py").is_file(), entry


# A recipe is its paper's loop on one screen: run() reads as the paper's steps, and what a
# feature adds lives in a component below it (essa/es, essa/gradient).
RUN_LINES = 60
RECIPE_LINES = 300
# Recipes that were longer when these limits came in: their ceilings only come down.
RUN_CEILINGS: dict[str, int] = {}
RECIPE_CEILINGS = {"grpo": 313}


def recipe_sizes(path: Path) -> tuple[int, int | None]:
    """(lines of the module, lines of its ``run()``; None without one)."""
    source = path.read_text()
    runs = [
        node.end_lineno - node.lineno + 1
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef) and node.name == "run" and node.end_lineno
    ]
    return len(source.splitlines()), (runs[0] if runs else None)


def test_recipes_fit_on_one_screen() -> None:
    """Every recipe's run() within RUN_LINES and its module within RECIPE_LINES (or the
    recipe's own ceiling)."""
    broken = []
    for path in sorted((PACKAGE / "recipes").glob("*.py")):
        if path.name == "__init__.py":  # the registry, not a recipe
            continue
        lines, run = recipe_sizes(path)
        run_limit = RUN_CEILINGS.get(path.stem, RUN_LINES)
        module_limit = RECIPE_CEILINGS.get(path.stem, RECIPE_LINES)
        if run is None:
            broken.append(f"{path.name}: no run()")
        elif run > run_limit:
            broken.append(f"{path.name}: run() is {run} lines, the limit {run_limit}")
        if lines > module_limit:
            broken.append(f"{path.name}: {lines} lines, the limit {module_limit}")
    assert not broken, "\n".join(broken)


def test_recipe_sizes_reads_run(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def run():\n    x = 1\n\n    return x\n\n\ndef _other():\n    pass\n")
    assert recipe_sizes(probe) == (8, 4)
    probe.write_text("def train():\n    pass\n")
    assert recipe_sizes(probe) == (2, None)


# The run harness is split by concern (the run and its loop, signals, progress, held-out
# records, the JSON checkpoint); no module of it grows back into one long file.
HARNESS_MODULE_LINES = 400


def test_harness_modules_stay_small() -> None:
    """Every module of essa/harness within HARNESS_MODULE_LINES lines."""
    paths = sorted((PACKAGE / "harness").glob("*.py"))
    assert len(paths) >= 5, paths  # the package, not a single module
    broken = [
        f"{path.name}: {lines} lines, the limit {HARNESS_MODULE_LINES}"
        for path in paths
        if (lines := len(path.read_text().splitlines())) > HARNESS_MODULE_LINES
    ]
    assert not broken, "\n".join(broken)


TOOLKITS = (
    "essa.adapters",
    "essa.backends",
    "essa.data",
    "essa.dist",
    "essa.drift",
    "essa.es",
    "essa.gradient",
    "essa.optimizers",
    "essa.rewards",
    "essa.tools",
)


@pytest.mark.parametrize("package", TOOLKITS)
def test_toolkits_take_their_sections_not_the_whole_config(package: str) -> None:
    """Below the recipes a component reads its own config section (``GRPOConfig``,
    ``GenerationConfig``, ...), so the whole schema (``essa.config.Config``) is never imported
    there, not even for a type; nor is a recipe."""
    broken = []
    for path in sources():
        if not module_name(path).startswith(package + "."):
            continue
        for imported in imports(path):
            if imported == "essa.config.Config" or imported.startswith("essa.recipes"):
                broken.append(f"{path.relative_to(ROOT)} imports {imported}")
    assert not broken, "\n".join(broken)


def private_uses(path: Path) -> list[str]:
    """``from essa.x import _name`` and ``module._name`` on an imported essa module."""
    tree = ast.parse(path.read_text())
    modules: set[str] = set()  # local names bound to essa modules
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("essa"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{path.name}:{node.lineno} imports {node.module}.{alias.name}")
                if (ROOT / node.module.replace(".", "/") / f"{alias.name}.py").exists() or (
                    ROOT / node.module.replace(".", "/") / alias.name / "__init__.py"
                ).exists():
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("essa"):
                    modules.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and ast.unparse(node.value) in modules
        ):
            found.append(f"{path.name}:{node.lineno} uses {ast.unparse(node)}")
    return found


def test_no_private_name_is_used_across_modules() -> None:
    """A leading underscore means "this module only": the package and the benchmarks never
    reach into another module's private names (a name others need is public, and documented)."""
    paths = [*sources(), *sorted((ROOT / "bench").rglob("*.py"))]
    broken = [use for path in paths for use in private_uses(path)]
    assert not broken, "\n".join(broken)


def test_private_uses_sees_both_forms(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("from essa.backends import decode\nfrom essa.rundir import _x\ndecode._y\n")
    assert private_uses(probe) == ["probe.py:2 imports essa.rundir._x", "probe.py:3 uses decode._y"]


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
def test_mypy_passes_on_the_package() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "mypy", "essa"], cwd=ROOT, capture_output=True, text=True
    )
    assert res.returncode == 0, (res.stdout + res.stderr)[-7000:]


# ------------------------------------------------------------------ an ES optimizer is one module

HILL_SAMPLES = "toy_hill.samples"


@dataclass(frozen=True)
class HillOptions(EsOptions):
    """The toy's one config key, ``optimizer.step``."""

    step: float = 1.0  # candidates' spread, in units of sigma0

    def check(self, population_size: int, *, layerwise: bool) -> None:
        if self.step <= 0:
            raise ValueError(f"step: must be > 0, got {self.step}")


class Hill(BestSoFar):
    """A toy ES defined outside essa: candidates scattered around the mean; the mean jumps to
    the generation's best finite candidate (NaN = failed, never chosen)."""

    name = "toy_hill"

    def __init__(
        self,
        dim: int,
        *,
        population_size: int,
        sigma0: float,
        seed: int,
        stds: np.ndarray | None = None,
        x0: np.ndarray | None = None,
        step: float = 1.0,
    ) -> None:
        check_common_args(dim, population_size, sigma0, seed)
        self._dim, self._population_size, self._seed = dim, population_size, seed
        self._spread = sigma0 * step * (np.ones(dim) if stds is None else np.asarray(stds))
        self._mean = np.zeros(dim) if x0 is None else as_vector(x0, dim, "x0")
        self._config = {"dim": dim, "population_size": population_size, "seed": seed}
        self._generation = 0

    dim = property(lambda self: self._dim)
    population_size = property(lambda self: self._population_size)
    mean = property(lambda self: self._mean.copy())
    sigma = property(lambda self: float(self._spread.mean()))
    generation = property(lambda self: self._generation)

    def ask(self) -> np.ndarray:
        rng = seeding.rng(self._seed, HILL_SAMPLES, self._generation)  # same on every rank
        return self._mean + self._spread * rng.standard_normal((self._population_size, self._dim))

    def tell(self, population: np.ndarray, fitness: np.ndarray) -> dict[str, float]:
        fitness = as_fitness(fitness, self._population_size)
        check_population(population, self.ask())
        if not np.all(np.isnan(fitness)):
            self._update_best(population, fitness)
            self._mean = population[int(np.nanargmax(fitness))].copy()
        self._generation += 1
        return {**fitness_metrics(fitness), "sigma": self.sigma}

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.name,
            "format": 1,
            "config": self._config,
            "generation": self._generation,
            "mean": self._mean.tolist(),
            **self._best_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state_header(state, self.name, 1)
        check_same_config(state["config"], self._config, self.name)
        self._generation = int(state["generation"])
        self._mean = as_vector(state["mean"], self._dim, "mean")
        self._load_best(state)

    def checksum(self) -> str:
        return sha256_hex(canonical_json(self.state_dict()).encode())


@pytest.fixture
def hill() -> Iterator[EsOptimizerSpec]:
    """The toy registered through the public registry, and taken out again afterwards."""
    spec = EsOptimizerSpec(
        name=Hill.name, factory=Hill, options=HillOptions, seed_domains={HILL_SAMPLES: 9001}
    )
    register(spec)
    try:
        yield spec
    finally:
        OPTIMIZERS.pop(spec.name)
        seeding.DOMAINS.pop(HILL_SAMPLES)


@pytest.mark.slow
def test_an_optimizer_registered_outside_essa_runs_a_search(
    hill: EsOptimizerSpec, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """One register() call is all an ES optimizer needs: its config key loads and is checked,
    and ``essa train``'s ESSA recipe searches with it and checkpoints its state."""
    from essa.config import ConfigError, load_config
    from essa.recipes import essa_es

    small = [
        f"model.name_or_path={tiny_model_dir}",
        "sft.steps=10",
        "sft.lr=0.01",
        "sft.batch_size=100",
        "data.sft_size=16",
        "data.batch_size=4",
        "data.test_size=8",
        "data.val_size=0",  # the random model is at the validation floor
        "optimizer.population_size=4",
        "optimizer.sigma0=3.0",
        "evaluation.every=0",
        "evaluation.use_scale_baseline=false",
        "generation.max_new_tokens=8",
        "reward.name=mpi_helpers:char_variety",  # graded: candidates differ on a random model
        "run.show_progress=false",
        "run.generations=2",
        f"optimizer.name={hill.name}",
    ]
    with pytest.raises(ConfigError, match=r"optimizer.step: must be > 0, got -1.0"):
        load_config(None, [*small, "optimizer.step=-1"])
    cfg = load_config(None, [*small, "optimizer.step=0.5"])
    assert cfg.optimizer.options == HillOptions(step=0.5)
    essa_es.run(cfg, tmp_path)
    state = json.loads((tmp_path / "checkpoint.json").read_text())["optimizer"]
    state = state.get("inner", state)  # held zero singular values wrap it in a Subspace
    assert (state["optimizer"], state["generation"]) == (hill.name, 2)
    assert np.any(np.asarray(state["mean"]) != 0.0)  # it moved off the SFT adapter
    assert json.loads((tmp_path / "summary.json").read_text())
