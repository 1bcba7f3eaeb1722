"""The algorithms: one module per paper's loop, and the registry that names them.

``algorithm: NAME`` in a config runs ``recipe(NAME).load()``, the recipe's ``run``; the config's
``algorithm`` choices are this table's names, so a new algorithm is one :func:`register` call
(one line in the table below for a shipped one). The table holds import paths, not functions:
a recipe imports torch, transformers and its toolkit, and the config schema reads the names
without loading any of them. This module imports nothing of essa but its errors, so anything
may read the table; the recipe modules themselves are imported here alone (lazily), never by
the code below them (tests/test_architecture.py).

A recipe's ``run`` has one signature::

    run(cfg: Config, run_dir: Path, *, resume: bool = False, console: Any = None,
        comm: Comm | None = None) -> dict[str, Any]   # the summary (summary.json)

It is called on every rank under MPI, after the run directory is prepared and config.yaml is
written (essa.api.train); rank 0 alone writes and prints.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from essa.errors import UserError

# cfg, run_dir, *, resume, console, comm -> summary. Typed loosely here because this module
# must not import the schema (the schema reads this table).
RunFn = Callable[..., dict[str, Any]]


@dataclass(frozen=True)
class Recipe:
    """One algorithm: where its ``run`` is and what it reads."""

    name: str  # the config's ``algorithm`` value
    target: str  # "package.module:function", imported on first use
    section: str | None = None  # the config section of its own settings (None: shared ones only)
    unit: str = "steps"  # what run.generations counts: the closing line's word

    def load(self) -> RunFn:
        """Import the recipe's module and return its ``run`` function."""
        module, _, function = self.target.partition(":")
        run: RunFn = getattr(importlib.import_module(module), function or "run")
        return run


RECIPES: dict[str, Recipe] = {}


def register(name: str, target: str, section: str | None = None, unit: str = "steps") -> Recipe:
    """Add an algorithm: ``algorithm: NAME`` then runs ``target`` ("package.module:function";
    the function defaults to ``run``). ``section``: the config section the recipe reads for its
    own settings, if any. A name is registered once (a ValueError says so)."""
    if name in RECIPES:
        raise ValueError(f"recipe {name!r} is already registered ({RECIPES[name].target})")
    RECIPES[name] = entry = Recipe(name, target, section, unit)
    return entry


register("essa", "essa.recipes.essa_es:run", "optimizer", unit="generations")
register("grpo", "essa.recipes.grpo:run", "grpo")
register("dpo", "essa.recipes.dpo:run", "dpo")
register("scalebio", "essa.recipes.scalebio:run", "scalebio")


def recipe(name: str) -> Recipe:
    """The registered recipe ``name``; a UserError names the known ones."""
    if name not in RECIPES:
        known = ", ".join(RECIPES)
        raise UserError(f"algorithm: {name} is not a registered recipe (known: {known})")
    return RECIPES[name]
