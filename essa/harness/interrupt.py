"""SIGINT/SIGTERM during a run: finish the step, checkpoint, exit; agreed across ranks."""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

from essa.dist import Comm


class Interrupt:
    """SIGINT/SIGTERM set ``signum``; the loop finishes its step, checkpoints and exits.

    A second signal acts at once (KeyboardInterrupt / default termination); the last
    checkpoint on disk is then still complete, because every write is atomic.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        self.signum = signum

    def __enter__(self) -> Interrupt:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def agree(self, comm: Comm) -> int | None:
        """The signal every rank stops for: the first rank's (in rank order) that caught one.

        A collective, called by every rank at the same point of every step: a signal that
        reached one rank only (``kill`` of one process, a scheduler signalling one task) stops
        them all after the same step, where a rank deciding alone would leave the others
        blocked in the next step's exchange.
        """
        if comm.world_size == 1:
            return self.signum
        caught = [int(s) for s in comm.allgather_str(str(self.signum or 0)) if s != "0"]
        return caught[0] if caught else None
