"""Fault injection for the reliability tests (docs/reliability.md); inert unless ESSA_FAULT is set.

``ESSA_FAULT=KIND@GENERATION`` makes the ESSA recipe fail while it writes the checkpoint of that
generation (the number of generations told, as stored in ``checkpoint.json``; for the GRPO
recipe the number of steps done), after the temporary file is written and before it replaces
the previous checkpoint:

* ``kill@G``: the process sends itself SIGKILL (a crash in the middle of a checkpoint write);
* ``enospc@G``: the write fails with ``OSError(ENOSPC)`` (a full disk in the middle of a run).

Stateless on purpose (a pure function of the environment and the generation), so a resumed run
with the same variable fails at the same place, and production runs never pay for it.
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Callable

ENV = "ESSA_FAULT"


def checkpoint_fault(generation: int) -> Callable[[], None] | None:
    """The hook to run before the checkpoint of ``generation`` is renamed into place, or None."""
    spec = os.environ.get(ENV, "")
    kind, _, at = spec.partition("@")
    if not spec or not at.strip().isdigit() or int(at) != generation:
        return None
    if kind == "kill":
        return lambda: os.kill(os.getpid(), signal.SIGKILL)
    if kind == "enospc":

        def enospc() -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        return enospc
    return None
