"""Communicators: every rank holds the same optimizer state; only scalar fitness crosses ranks.

``get_comm()`` returns the single-process communicator unless launched under MPI.
"""

from essa.dist.local import Comm, LocalComm, get_comm

__all__ = ["Comm", "LocalComm", "get_comm"]
