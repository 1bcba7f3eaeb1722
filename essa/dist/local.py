"""The communicator boundary and its single-process implementation."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Comm(Protocol):
    rank: int
    world_size: int

    def allgather_fitness(self, local: np.ndarray) -> np.ndarray:
        """Concatenate every rank's float64 fitness in rank order."""
        ...

    def allgather_str(self, value: str) -> list[str]:
        """Gather one short string (a checksum) from every rank."""
        ...


class LocalComm:
    """World size 1: gathers are identities."""

    rank = 0
    world_size = 1

    def allgather_fitness(self, local: np.ndarray) -> np.ndarray:
        return np.asarray(local, dtype=np.float64)

    def allgather_str(self, value: str) -> list[str]:
        return [value]


def shard(population_size: int, rank: int, world_size: int) -> slice:
    """Contiguous slice of candidates evaluated by ``rank`` (sizes differ by at most one)."""
    base, extra = divmod(population_size, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def get_comm() -> Comm:
    return LocalComm()
