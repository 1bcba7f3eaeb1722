"""Communicators: every rank holds the same optimizer state; only scalar fitness crosses ranks.

``get_comm()`` picks the communicator from ``ESSA_DIST`` (default ``auto``):

* ``auto``: MPI when a launcher (mpiexec/mpirun, srun) started more than one process, detected
  from its environment (PMI_SIZE, OMPI_COMM_WORLD_SIZE, MV2_COMM_WORLD_SIZE,
  SLURM_STEP_NUM_TASKS); otherwise the single-process communicator;
* ``local``: always single-process (each launched process would run alone: do not use under a
  launcher);
* ``mpi``: always MPI, even for one process.

See essa/dist/mpi.py for replica checks and fault handling, docs/scaling.md for launching.
"""

from __future__ import annotations

import os

from essa.dist.local import (
    Comm,
    LocalComm,
    ReplicaMismatchError,
    any_rank,
    check_replicas,
    place_rank,
    shard,
)
from essa.dist.mpi import abort_all_ranks, detect_mpi_launch
from essa.errors import UserError

__all__ = [
    "Comm",
    "LocalComm",
    "ReplicaMismatchError",
    "abort_all_ranks",
    "any_rank",
    "check_replicas",
    "get_comm",
    "place_rank",
    "shard",
]


def get_comm(mode: str | None = None) -> Comm:
    """The communicator for this process (``mode`` defaults to ESSA_DIST, then ``auto``)."""
    mode = mode or os.environ.get("ESSA_DIST") or "auto"
    if mode not in ("auto", "local", "mpi"):
        raise UserError(f"ESSA_DIST={mode}: expected auto, local or mpi")
    if mode == "local":
        return LocalComm()
    launch = detect_mpi_launch(os.environ)
    if mode == "auto" and launch is None:
        return LocalComm()
    from essa.dist.mpi import mpi_world_or_error

    return mpi_world_or_error(launch)
