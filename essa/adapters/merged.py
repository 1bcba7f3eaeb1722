"""Merged strategy: fold one candidate into the base weights, run, restore bit-exactly.

W' = W0 + gamma * B'A' (essa.md §1.6). The restore copies a snapshot back instead of
subtracting the delta, because subtraction drifts in bf16 and would corrupt W0 over many
candidates. The sum is formed in float32 and rounded once to the weight's dtype.

Deviations from the paper: none. The project default is the population-batched path
(essa.adapters.population); this strategy serves tests, references and engines without it.
Quantised (non-floating) weights are refused rather than dequantised.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from essa.adapters.svd import SVDAdapter
from essa.types import AdapterVector


@contextmanager
def merged_candidate(
    model: nn.Module, adapter: SVDAdapter, vector: AdapterVector
) -> Iterator[nn.Module]:
    """Inside the block the base model's target weights hold W0 + gamma * B'A' of ``vector``."""
    deltas = adapter.delta_weights(vector)  # name -> (m, n) float32
    snapshots: dict[str, torch.Tensor] = {}
    try:
        for name, delta in deltas.items():
            weight = model.get_submodule(name).weight
            if not weight.is_floating_point():
                raise TypeError(
                    f"{name}: merged strategy needs a floating weight, got {weight.dtype}"
                )
            snapshot = weight.detach().clone()  # (m, n) bit-exact copy of W0
            snapshots[name] = snapshot
            merged = snapshot.float() + delta.to(weight.device)  # (m, n)
            weight.data.copy_(merged)
        yield model
    finally:
        for name, snapshot in snapshots.items():
            model.get_submodule(name).weight.data.copy_(snapshot)
