"""A short mutation pass over essa/optimizers, essa/adapters and essa/rewards (docs/testing.md).

    nice -n 10 python -m bench.studies.mutation [--per-module 5] [--seed 0] [--timeout 60]
                                        [--packages optimizers adapters rewards] [--only PATH]

Hand-written, numpy/pytest only (no mutmut). For each module, every mutation site is listed from
the AST (operators below), and a fixed, seeded sample of ``--per-module`` sites is tried. Each
mutant is one changed node in a scratch copy of the repository (the working tree is never
touched), run against that package's test subset (TESTS) plus the module's doctests with
``pytest -x -q``. A mutant is *killed* when that run fails, *timed out* (counted as killed, shown
apart) when it runs past ``--timeout`` seconds, and *survives* when the tests pass. ``--only
PATH...`` re-runs those modules' mutants (the same ones: the sample is seeded per path) and
merges them into the recorded ``--output``, listing them under ``rerun``.

Speed: the parent process imports the heavy libraries once (torch, transformers, peft, cma,
pytest) but never ``essa``; each mutant runs in a forked child that imports the mutated tree, so
a mutant costs its tests' run time, not an interpreter start-up. Writes
bench/results/mutation.json (every mutant, its outcome and seconds) and prints the survivors.

Operators: comparison (``<`` <-> ``<=``, ``>`` <-> ``>=``, ``==`` <-> ``!=``, ``is`` <-> ``is not``,
``in`` <-> ``not in``), arithmetic (``+`` <-> ``-``, ``*`` <-> ``/``, ``//`` -> ``/``, ``**`` ->
``*``), boolean (``and`` <-> ``or``, ``not x`` -> ``x``), an ``if``/``while`` test negated,
constants (``0`` <-> ``1``, other numbers n -> n + 1, ``True`` <-> ``False``), and a ``return``
value replaced by ``None``. Docstrings, annotations, string constants and ``__all__`` are left
alone.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("optimizers", "adapters", "rewards")
# Per package: the fast tests that exercise it (slow/mpi end-to-end runs excluded).
TESTS: dict[str, list[str]] = {
    "optimizers": [
        "tests/test_optimizers.py", "tests/test_layerwise_es.py", "-m", "not slow and not mpi",
        "-k", "not import_does_not_pull and not 2000",
    ],
    "adapters": [
        "tests/test_adapters.py", "tests/test_layerwise_es.py", "-m", "not slow and not mpi",
    ],
    "rewards": [
        "tests/test_rewards.py", "tests/test_rewards_group.py", "tests/test_rewards_model.py",
        "tests/test_extract_table.py",
        "tests/test_data_generators.py",  # the reasoning-gym reward
        # worker_thread grades with a 1 s budget that a loaded machine can exceed
        "-m", "not slow", "-k", "not worker_thread",
    ],
}  # fmt: skip
COMPARE_SWAP = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In,
}  # fmt: skip
BINOP_SWAP = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
    ast.FloorDiv: ast.Div, ast.Pow: ast.Mult,
}  # fmt: skip
HEAVY = ("numpy", "torch", "transformers", "peft", "cma", "safetensors", "pytest", "yaml")


@dataclass
class Mutant:
    path: str  # relative to the repository
    site: int  # index among the module's mutation sites
    line: int
    operator: str
    before: str
    after: str
    outcome: str = ""  # killed | timeout | survived
    seconds: float = 0.0


def _skipped_nodes(tree: ast.AST) -> set[int]:
    """ids of nodes never mutated: docstrings, annotations, __all__, decorators."""
    skip: set[int] = set()

    def mark(node: ast.AST | None) -> None:
        if node is not None:
            skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            mark(first)  # a docstring (or a bare constant: nothing to mutate either)
        if isinstance(node, ast.AnnAssign):
            mark(node.annotation)
        if isinstance(node, ast.arg):
            mark(node.annotation)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            mark(node.returns)
            for decorator in node.decorator_list:
                mark(decorator)
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            mark(node)
    return skip


def _mutations(node: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    """(operator name, replacement node) for each way this node can be mutated."""
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in COMPARE_SWAP:
        new: Any = copy.deepcopy(node)
        new.ops = [COMPARE_SWAP[type(node.ops[0])]()]
        yield "compare", new
    elif isinstance(node, ast.BinOp) and type(node.op) in BINOP_SWAP:
        new = copy.deepcopy(node)
        new.op = BINOP_SWAP[type(node.op)]()
        yield "arith", new
    elif isinstance(node, ast.BoolOp):
        new = copy.deepcopy(node)
        new.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        yield "bool", new
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        yield "drop-not", copy.deepcopy(node.operand)
    elif isinstance(node, ast.If | ast.While | ast.IfExp):
        new = copy.deepcopy(node)
        new.test = ast.UnaryOp(op=ast.Not(), operand=new.test)
        yield "negate-if", new
    elif isinstance(node, ast.Constant) and type(node.value) in (bool, int, float):
        value: Any = node.value
        if isinstance(value, bool):
            replacement: Any = not value
        elif value in (0, 1):
            replacement = type(value)(1 - value)
        else:
            replacement = value + 1
        yield "constant", ast.Constant(value=replacement)
    elif isinstance(node, ast.Return) and not (
        node.value is None or (isinstance(node.value, ast.Constant) and node.value.value is None)
    ):
        yield "return-none", ast.Return(value=None)


class _Replace(ast.NodeTransformer):
    def __init__(self, target: ast.AST, replacement: ast.AST) -> None:
        self.target, self.replacement = target, replacement

    def visit(self, node: ast.AST) -> ast.AST:
        if node is self.target:
            return ast.copy_location(self.replacement, node)
        return super().visit(node)


def sites(tree: ast.AST) -> list[tuple[ast.AST, str, ast.AST]]:
    """Every (node, operator, replacement) of a parsed module, in a stable (walk) order."""
    skip = _skipped_nodes(tree)
    out: list[tuple[ast.AST, str, ast.AST]] = []
    for node in ast.walk(tree):
        if id(node) not in skip:
            out.extend((node, op, new) for op, new in _mutations(node))
    return out


def mutate(source: str, site: int) -> tuple[str, Mutant]:
    """The module's source with mutation ``site`` applied, and the mutant's description."""
    tree = ast.parse(source)
    node, operator, replacement = sites(tree)[site]
    before = ast.unparse(node).splitlines()[0][:80]
    after = ast.unparse(replacement).splitlines()[0][:80]
    line = getattr(node, "lineno", 0)
    mutated = ast.unparse(ast.fix_missing_locations(_Replace(node, replacement).visit(tree)))
    return mutated, Mutant("", site, line, operator, before, after)


def scratch_copy() -> Path:
    """The parts of the repository the tests read, copied without bytecode caches."""
    root = Path(tempfile.mkdtemp(prefix="essa-mutation-"))
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "results")
    for name in ("essa", "tests", "bench", "configs"):
        if (REPO / name).exists():
            shutil.copytree(REPO / name, root / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, root / name)
    return root


def run_tests(root: Path, args: list[str], timeout: float) -> tuple[str, float]:
    """Run pytest on ``args`` in a forked child importing from ``root``; (outcome, seconds)."""
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # child: quiet, import the scratch tree, exit with pytest's code
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            os.chdir(root)
            sys.path.insert(0, str(root))
            os.environ["PYTHONPATH"] = str(root)  # for tests that start subprocesses
            import pytest

            code = pytest.main(["-x", "-q", "-p", "no:cacheprovider", *args])
            os._exit(int(code))
        except BaseException:
            os._exit(99)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            return ("survived" if code == 0 else "killed"), time.perf_counter() - start
        if time.perf_counter() - start > timeout:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout", time.perf_counter() - start
        time.sleep(0.02)


def modules(packages: list[str]) -> list[Path]:
    return [
        p.relative_to(REPO)
        for package in packages
        for p in sorted((REPO / "essa" / package).glob("*.py"))
        if p.name != "__init__.py" or package == "optimizers"
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-module", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--packages", nargs="+", default=list(PACKAGES), choices=PACKAGES)
    parser.add_argument(
        "--only",
        nargs="*",
        default=None,
        help="re-run these module paths only and merge them into the recorded --output",
    )
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "mutation.json")
    args = parser.parse_args(argv)
    sys.dont_write_bytecode = True  # a mutant must never run from a stale .pyc
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for name in HEAVY:  # imported once here; the forked children share them
        __import__(name)
    root = scratch_copy()
    results: list[Mutant] = []
    baseline: dict[str, float] = {}
    try:
        for package in args.packages:
            outcome, seconds = run_tests(root, TESTS[package], args.timeout * 5)
            if outcome != "survived":
                print(f"error: the unmutated {package} tests do not pass ({outcome})")
                return 1
            baseline[package] = round(seconds, 1)
            print(f"{package}: unmutated tests pass in {seconds:.1f} s", flush=True)
        for path in modules(args.packages):
            if args.only and str(path) not in args.only:
                continue
            results += run_module(root, path, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(results, baseline, args)
    return 0


def run_module(root: Path, path: Path, args: argparse.Namespace) -> list[Mutant]:
    """The seeded sample of ``path``'s mutants, each run against its package's tests."""
    source = (REPO / path).read_text()
    package = path.parts[1]
    n_sites = len(sites(ast.parse(source)))
    rng = random.Random(f"{args.seed}:{path}")
    chosen = sorted(rng.sample(range(n_sites), min(args.per_module, n_sites)))
    out: list[Mutant] = []
    for site in chosen:
        mutated, mutant = mutate(source, site)
        mutant.path = str(path)
        (root / path).write_text(mutated)
        try:
            tests = [*TESTS[package], "--doctest-modules", str(path)]
            mutant.outcome, seconds = run_tests(root, tests, args.timeout)
        finally:
            (root / path).write_text(source)
        mutant.seconds = round(seconds, 2)
        out.append(mutant)
        print(
            f"{mutant.outcome:8s} {path}:{mutant.line} {mutant.operator}: "
            f"{mutant.before!r} -> {mutant.after!r} ({seconds:.1f} s)",
            flush=True,
        )
    return out


def _merged(results: list[Mutant], args: argparse.Namespace) -> tuple[list[Mutant], list[str]]:
    """With --only: the recorded run's mutants, those of the re-run modules replaced."""
    if not args.only or not args.output.exists():
        return results, []
    recorded = json.loads(args.output.read_text())
    kept = [Mutant(**m) for m in recorded["results"] if m["path"] not in args.only]
    order = {
        path: i for i, path in enumerate(dict.fromkeys(m["path"] for m in recorded["results"]))
    }
    merged = sorted([*kept, *results], key=lambda m: (order.get(m.path, len(order)), m.site))
    return merged, sorted(set(recorded.get("rerun", [])) | set(args.only))


def report(results: list[Mutant], baseline: dict[str, float], args: argparse.Namespace) -> None:
    results, rerun = _merged(results, args)
    survivors = [m for m in results if m.outcome == "survived"]
    total = len(results)
    share = len(survivors) / total if total else 0.0
    command = (
        f"python -m bench.studies.mutation --per-module {args.per_module} --seed {args.seed} "
        f"--timeout {args.timeout:g} --packages {' '.join(args.packages)}"
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "command": command, "rerun": rerun, "baseline_seconds": baseline, "mutants": total,
        "survived": len(survivors), "survived_share": round(share, 4),
        "results": [asdict(m) for m in results],
    }, indent=1) + "\n")  # fmt: skip
    print(f"\n{total} mutants, {len(survivors)} survived ({100 * share:.1f}%); {command}")
    for m in survivors:
        print(f"  {m.path}:{m.line} {m.operator}: {m.before!r} -> {m.after!r}")


if __name__ == "__main__":
    sys.exit(main())
