"""Fault injection for the reliability tests (docs/reliability.md), outside the package.

A test that sets ``ESSA_FAULT`` runs the CLI with this directory on ``PYTHONPATH``
(tests/test_train_e2e.py: ``essa``, ``_launch``), so Python imports this module at start-up and
it installs :func:`checkpoint_fault` as ``essa.rundir.checkpoint_hook``. Production runs never
import it.

``ESSA_FAULT=KIND@N`` makes a run fail while it writes the checkpoint of N (ES: generations
told, as stored in ``checkpoint.json``; the gradient recipes: steps done), after the temporary
file or directory is written and before it replaces the previous checkpoint:

* ``kill@N``: the process sends itself SIGKILL (a crash in the middle of a checkpoint write);
* ``enospc@N``: the write fails with ``OSError(ENOSPC)`` (a full disk in the middle of a run).

Stateless on purpose (a pure function of the environment and N), so a resumed run with the same
variable fails at the same place.
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Callable

ENV = "ESSA_FAULT"


def checkpoint_fault(step: int) -> Callable[[], None] | None:
    """The hook to run before the checkpoint of ``step`` is renamed into place, or None."""
    spec = os.environ.get(ENV, "")
    kind, _, at = spec.partition("@")
    if not spec or not at.strip().isdigit() or int(at) != step:
        return None
    if kind == "kill":
        return lambda: os.kill(os.getpid(), signal.SIGKILL)
    if kind == "enospc":

        def enospc() -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        return enospc
    return None


def install() -> None:
    import essa.rundir

    essa.rundir.checkpoint_hook = checkpoint_fault


if os.environ.get(ENV):
    install()
