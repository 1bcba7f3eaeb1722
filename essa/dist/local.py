"""The communicator boundary, its single-process implementation and rank-independent helpers."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from essa.config import ModelConfig
from essa.errors import UserError


class Comm(Protocol):
    rank: int
    world_size: int
    local_rank: int  # rank among the processes of this node (picks the GPU)
    local_size: int  # processes on this node
    comm_bytes: int  # payload bytes received from other ranks so far

    def allgather_fitness(self, local: np.ndarray) -> np.ndarray:
        """Concatenate every rank's float64 fitness in rank order."""
        ...

    def allgather_str(self, value: str) -> list[str]:
        """Gather one short string (a checksum) from every rank."""
        ...

    def allgather_keys(self, local: np.ndarray) -> np.ndarray:
        """Stack every rank's (p, M) int64 answer keys in rank order: (P, M)."""
        ...

    def barrier(self) -> None:
        """Return once every rank has called it."""
        ...

    def abort(self, code: int) -> None:
        """End every rank now with exit status ``code``."""
        ...


class LocalComm:
    """World size 1: gathers are identities."""

    rank = 0
    world_size = 1
    local_rank = 0
    local_size = 1
    comm_bytes = 0

    def allgather_fitness(self, local: np.ndarray) -> np.ndarray:
        return np.asarray(local, dtype=np.float64)

    def allgather_str(self, value: str) -> list[str]:
        return [value]

    def allgather_keys(self, local: np.ndarray) -> np.ndarray:
        return np.asarray(local, dtype=np.int64)

    def barrier(self) -> None:
        return None

    def abort(self, code: int) -> None:
        raise SystemExit(code)


def shard(population_size: int, rank: int, world_size: int) -> slice:
    """Contiguous slice of candidates evaluated by ``rank`` (sizes differ by at most one).

    >>> [shard(5, r, 2) for r in range(2)]
    [slice(0, 3, None), slice(3, 5, None)]
    """
    base, extra = divmod(population_size, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


class ReplicaMismatchError(UserError):
    """Ranks hold different optimizer states: their environments differ (see docs/scaling.md)."""


def check_replicas(comm: Comm, opt: Any, generation: int) -> None:
    """Stop every rank with the same clear error when the optimizer checksums disagree.

    All ranks see the same gathered list, so all raise together; the message groups the ranks
    by digest so the odd ones out are named. A no-op (no checksum computed) on one rank.
    """
    if comm.world_size == 1:
        return
    digests = comm.allgather_str(opt.checksum())
    if len(set(digests)) == 1:
        return
    groups: dict[str, list[int]] = {}
    for rank, digest in enumerate(digests):
        groups.setdefault(digest, []).append(rank)
    parts = "; ".join(f"ranks {ranks} have {digest[:12]}" for digest, ranks in groups.items())
    raise ReplicaMismatchError(
        f"optimizer state differs across ranks after generation {generation}: {parts}. "
        "Every rank must run the same library versions (numpy, BLAS, pycma) with the same "
        "thread settings on the same CPU type; see docs/scaling.md"
    )


def place_rank(cfg: ModelConfig, comm: Comm) -> ModelConfig:
    """The model config for this rank: one rank per GPU; on CPU, the node's cores split.

    With several ranks, ``model.device`` ``auto`` (when CUDA is available) or ``cuda`` becomes
    ``cuda:{local_rank % device_count}``; an explicit ``cuda:N`` is kept. On CPU, unless
    ``model.num_threads`` or OMP_NUM_THREADS is set, each rank takes its share of the cores:
    ranks on one node would otherwise each start one torch thread per core and thrash.
    """
    if comm.world_size == 1:
        return cfg
    import torch

    if cfg.device in ("auto", "cuda") and torch.cuda.is_available():
        return replace(cfg, device=f"cuda:{comm.local_rank % torch.cuda.device_count()}")
    if cfg.num_threads is not None or "OMP_NUM_THREADS" in os.environ or comm.local_size == 1:
        return cfg
    cpus = os.cpu_count() or 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpus
    if cores == cpus:  # not bound by the launcher: the ranks of this node share every core
        cores //= comm.local_size
    return replace(cfg, num_threads=max(1, cores))


def any_rank(comm: Comm, flag: bool) -> bool:
    """True on every rank when ``flag`` is true on at least one (a collective stop decision)."""
    if comm.world_size == 1:
        return flag
    return "1" in comm.allgather_str("1" if flag else "0")
