"""Programs run by tests/test_mpi.py under ``mpiexec``, and test-only rewards.

``python tests/mpi_helpers.py allgather``: exercise MPIComm with uneven shards; each rank prints
one JSON line. ``python tests/mpi_helpers.py fault``: rank 1 raises inside the CLI's fault
handler while rank 0 waits in a collective.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np


def char_variety(
    completions: list[str], answers: list[str | None], prompts: list[str]
) -> list[float | None]:
    """Distinct characters per completion, scaled: a graded signal even from a random model."""
    return [len(set(text)) / 8.0 for text in completions]


def fail_on_rank(rank: int) -> Any:
    """A reward factory that raises on MPI rank ``rank`` (the fault is in the factory: the
    scoring call isolates errors by design)."""
    if os.environ.get("PMI_RANK") == str(rank):
        raise RuntimeError(f"injected fault on rank {rank}")
    return char_variety


class _FakeOptimizer:
    def __init__(self, digest: str) -> None:
        self.digest = digest

    def checksum(self) -> str:
        return self.digest


def allgather() -> None:
    from essa.dist import ReplicaMismatchError, check_replicas, get_comm, shard
    from essa.dist.mpi import MPIComm

    comm = get_comm()
    assert isinstance(comm, MPIComm), type(comm)
    population_size = 5
    mine = shard(population_size, comm.rank, comm.world_size)
    local = np.arange(population_size, dtype=np.float64)[mine] + 0.5  # (|mine|,)
    if comm.rank == 1:
        local[-1] = np.nan  # failed evaluations travel as NaN
    fitness = comm.allgather_fitness(local)
    bytes_fitness = comm.comm_bytes
    names = comm.allgather_str(f"rank-{comm.rank}")
    check_replicas(comm, _FakeOptimizer("same"), 0)
    try:
        check_replicas(comm, _FakeOptimizer("aaa" if comm.rank == 0 else "bbb"), 7)
        mismatch = ""
    except ReplicaMismatchError as err:
        mismatch = str(err)
    out = {
        "rank": comm.rank,
        "world_size": comm.world_size,
        "local_rank": comm.local_rank,
        "local_size": comm.local_size,
        "shard": [mine.start, mine.stop],
        "fitness": [None if np.isnan(f) else float(f) for f in fitness],
        "bytes_fitness": bytes_fitness,
        "names": names,
        "mismatch": mismatch,
    }
    comm.barrier()
    # One file per rank: the launcher's forwarded stdout can run two ranks' lines together.
    Path(os.environ["ESSA_TEST_OUT"], f"rank{comm.rank}.json").write_text(json.dumps(out))


def fault() -> None:
    from essa.cli import guarded
    from essa.dist import get_comm

    @guarded
    def work() -> None:
        comm = get_comm()
        comm.barrier()
        if comm.rank == 1:
            raise RuntimeError("injected fault on rank 1")
        comm.allgather_fitness(np.zeros(1))  # rank 0 blocks here until the abort

    work()


POOL_TEXTS = [  # completions[candidate][prompt] of a 5-candidate population on 3 prompts
    [r"\boxed{4}", "7", "no answer"],
    ["4.0", "8", "x"],
    ["5", "8", r"\boxed{1/2}"],
    ["4", "7", "0.5"],
    ["5", "9", r"\boxed{\frac{2}{4}}"],
]


def pool_vote() -> list[list[float]]:
    """Population-pool rewards of this rank's shard of POOL_TEXTS (keys cross ranks, not text)."""
    from essa.dist import get_comm, shard
    from essa.rewards.pool import agreement_rewards, answer_keys, population_majority

    comm = get_comm()
    mine = shard(len(POOL_TEXTS), comm.rank, comm.world_size)
    local = answer_keys(POOL_TEXTS[mine])  # (p, 3)
    keys = comm.allgather_keys(local)  # (5, 3)
    groups = [[0], [1], [2]]
    majority = population_majority(keys, groups)
    rewards = agreement_rewards(local, majority, groups).tolist()
    # One file per rank: mpiexec's forwarded stdout can run the ranks' lines together.
    out = Path(sys.argv[2]) / f"rank{comm.rank}.json"
    out.write_text(json.dumps({"rank": comm.rank, "rewards": rewards, "bytes": comm.comm_bytes}))
    return rewards


if __name__ == "__main__":
    {"allgather": allgather, "fault": fault, "pool": pool_vote}[sys.argv[1]]()
