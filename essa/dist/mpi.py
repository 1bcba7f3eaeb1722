"""The mpi4py communicator: one population over many ranks; only fitness and checksums cross.

Every rank runs the whole ESSA loop on a replicated optimizer state (spec essa.md §1.9): all ask
the same population, each evaluates its :func:`~essa.dist.local.shard`, the float64 fitness is
all-gathered (``Iallgatherv``, counts gathered first) and every rank runs the same ``tell``.
Collectives are nonblocking and polled with short sleeps: MPI's blocking calls spin, and a rank
waiting on rank 0 would take a core from the ranks at work.

Replica consistency: after every ``tell`` the ranks all-gather ``opt.checksum()``. On a mismatch
every rank stops with :class:`~essa.dist.local.ReplicaMismatchError` naming the ranks per digest.
We stop rather than rebroadcast rank 0's state (the spec's other option): a mismatch means the
ranks run different library versions, thread settings or CPU types, and silently overwriting the
state would hide that and make the run impossible to reproduce on one process.

Faults: :func:`abort_all_ranks` (called by the CLI on any exception) prints the error and calls
``MPI_Abort``, so one failing rank ends the job instead of leaving the others blocked in a
collective. Ranks other than 0 wait :data:`ABORT_GRACE_SECONDS` before printing: when every rank
hits the same error, rank 0's abort kills them first and the error is printed once.

mpi4py is imported only here and only when a communicator is asked for (``pip install
'essa-align[mpi]'``).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from essa.errors import UserError

ABORT_GRACE_SECONDS = 2.0
OUTPUT_DRAIN_SECONDS = 0.5
POLL_SECONDS = 0.001

# World-size variables set by launchers for each process they start. SLURM_STEP_NUM_TASKS is set
# by srun but not in the batch script itself, which may run on a multi-task allocation.
_SIZE_VARIABLES = (
    "PMI_SIZE",  # MPICH / Intel MPI hydra, srun --mpi=pmi2
    "OMPI_COMM_WORLD_SIZE",  # Open MPI mpirun
    "MV2_COMM_WORLD_SIZE",  # MVAPICH
    "SLURM_STEP_NUM_TASKS",  # srun (--mpi=pmix sets PMIX_RANK but no size)
)

INSTALL_HINT = (
    "pip install 'essa-align[mpi]' (mpi4py + the MPICH wheel), or build mpi4py against the site MPI"
)


def detect_mpi_launch(environ: Mapping[str, str]) -> str | None:
    """``"NAME=size"`` of the first launcher variable announcing more than one process, else None.

    >>> detect_mpi_launch({"PMI_RANK": "0", "PMI_SIZE": "2"})
    'PMI_SIZE=2'
    >>> detect_mpi_launch({"PMI_SIZE": "1"}) is None
    True
    """
    for name in _SIZE_VARIABLES:
        value = environ.get(name, "")
        if value.isdigit() and int(value) > 1:
            return f"{name}={value}"
    return None


class MPIComm:
    """COMM_WORLD through mpi4py; ``local_rank`` comes from a shared-memory split of the world."""

    def __init__(self) -> None:
        try:
            from mpi4py import MPI
        except (ImportError, RuntimeError) as err:  # no mpi4py, or no libmpi for it to load
            raise UserError(
                f"MPI requested but mpi4py cannot load ({err}): {INSTALL_HINT}"
            ) from None
        self._mpi = MPI
        self._world = MPI.COMM_WORLD
        self.rank: int = self._world.Get_rank()
        self.world_size: int = self._world.Get_size()
        node = self._world.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank: int = node.Get_rank()
        self.local_size: int = node.Get_size()
        node.Free()
        self.comm_bytes = 0

    def allgather_fitness(self, local: np.ndarray) -> np.ndarray:
        fitness, _ = self._allgatherv(np.ascontiguousarray(local, dtype=np.float64).ravel())
        return fitness  # (P,)

    def allgather_str(self, value: str) -> list[str]:
        data, sizes = self._allgatherv(np.frombuffer(value.encode(), dtype=np.uint8))
        ends = np.cumsum(sizes).tolist()
        return [
            data[end - size : end].tobytes().decode() for size, end in zip(sizes, ends, strict=True)
        ]

    def allgather_keys(self, local: np.ndarray) -> np.ndarray:
        local = np.ascontiguousarray(local, dtype=np.int64)  # (p, M)
        width = local.shape[1]
        keys, _ = self._allgatherv(local.ravel())
        return keys.reshape(-1, width)  # (P, M): 8 bytes per answer, never text

    def barrier(self) -> None:
        self._wait(self._world.Ibarrier())

    def _allgatherv(self, local: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """Each rank's 1-D ``local`` concatenated in rank order, and the per-rank counts."""
        counts = np.empty(self.world_size, dtype=np.int64)
        self._wait(self._world.Iallgather(np.array([local.size], dtype=np.int64), counts))
        sizes = counts.tolist()
        displacements = np.cumsum([0, *sizes[:-1]]).tolist()
        gathered = np.empty(sum(sizes), dtype=local.dtype)
        self._wait(self._world.Iallgatherv(local, [gathered, (sizes, displacements)]))
        self.comm_bytes += counts.itemsize * (self.world_size - 1)
        self.comm_bytes += gathered.itemsize * (gathered.size - local.size)
        return gathered, sizes

    @staticmethod
    def _wait(request: Any) -> None:
        # MPI's blocking calls spin; a rank waiting on rank 0 (SFT, held-out evaluation) would
        # take a core from the ranks at work on a shared or oversubscribed node.
        while not request.Test():
            time.sleep(POLL_SECONDS)

    def abort(self, code: int) -> None:
        _abort(self._world, code)


def abort_all_ranks(message: str, code: int) -> None:
    """Print ``message`` and end every rank when this process is in an MPI world of two or more.

    Returns (doing nothing) otherwise, so the caller can fail the ordinary way.
    """
    mpi: Any = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return
    world = mpi.COMM_WORLD
    if world.Get_size() == 1:
        return
    rank = world.Get_rank()
    if rank != 0:
        time.sleep(ABORT_GRACE_SECONDS)
    sys.stdout.flush()
    print(message if rank == 0 else f"[rank {rank}] {message}", file=sys.stderr, flush=True)
    _abort(world, code)


def _abort(world: Any, code: int) -> None:
    """MPI_Abort, made reliable for the pip MPICH (hydra) launcher.

    Hydra forwards rank output asynchronously and stops forwarding once it tears the job down,
    so the message gets a moment to pass through first; and its MPI_Abort can return before
    the launcher kills this process, so the process then ends itself without running Python's
    exit handlers (which would print the traceback a second time).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(OUTPUT_DRAIN_SECONDS)
    world.Abort(code)
    os._exit(code)


def mpi_world_or_error(launch: str | None) -> MPIComm:
    """The MPI communicator; a UserError when the launcher's world and MPI's disagree."""
    if launch is not None and "mpi4py" not in sys.modules:
        try:
            import mpi4py  # noqa: F401
        except ImportError:
            raise UserError(
                f"launched under MPI ({launch}) but mpi4py is not installed: {INSTALL_HINT}"
            ) from None
    comm = MPIComm()
    if launch is not None and comm.world_size == 1:
        raise UserError(
            f"launched as several processes ({launch}) but MPI sees a world of one: the launcher "
            "and mpi4py's MPI library differ (use the mpiexec next to mpi4py, or srun --mpi=pmix)"
        )
    return comm
