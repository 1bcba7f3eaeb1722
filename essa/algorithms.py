"""The algorithm registry's table: algorithm name -> where its recipe is and what it reads.

``algorithm: NAME`` in a config is one of this table's names; ``essa.recipes.recipe(NAME)``
finds the entry and ``load()`` imports its ``run``. The table holds import paths, not
functions: a recipe imports torch, transformers and its toolkit, and the config schema reads the
names without loading any of them. This module imports nothing of essa, so the schema (the
bottom layer) and the registry (:mod:`essa.recipes`, which re-exports these names) both read it
without a dependency between them. A new algorithm is one :func:`register` call (one line in
the table below for a shipped one).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
