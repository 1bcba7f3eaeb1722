"""The algorithms: one module per paper's loop, and the registry that names them.

``algorithm: NAME`` in a config runs ``recipe(NAME).load()``, the recipe's ``run``. The table
of names, import paths and sections is :mod:`essa.algorithms` (re-exported here:
:class:`Recipe`, :data:`RECIPES`, :func:`register`), a module that imports nothing of essa, so
the config schema reads the names without depending on this package. This module imports
nothing of essa but that table and its errors; the recipe modules themselves are imported here
alone (lazily, by the table's paths), never by the code below them
(tests/test_architecture.py).

A recipe's ``run`` has one signature::

    run(cfg: Config, run_dir: Path, *, resume: bool = False, console: Any = None,
        comm: Comm | None = None) -> dict[str, Any]   # the summary (summary.json)

It is called on every rank under MPI, after the run directory is prepared and config.yaml is
written (essa.api.train); rank 0 alone writes and prints.
"""

from __future__ import annotations

from essa.algorithms import RECIPES, Recipe, RunFn, register
from essa.errors import UserError

__all__ = ["RECIPES", "Recipe", "RunFn", "recipe", "register"]


def recipe(name: str) -> Recipe:
    """The registered recipe ``name``; a UserError names the known ones."""
    if name not in RECIPES:
        known = ", ".join(RECIPES)
        raise UserError(f"algorithm: {name} is not a registered recipe (known: {known})")
    return RECIPES[name]
