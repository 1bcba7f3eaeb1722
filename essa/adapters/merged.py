"""Merged strategy: fold one candidate into the base weights, run, restore bit-exactly.

W' = W0 + gamma * B'A' (essa.md §1.6). The restore copies a snapshot back instead of
subtracting the delta, because subtraction drifts in bf16 and would corrupt W0 over many
candidates. The delta is formed on the weight's device from the small factors (A' is r x n,
B' is m x r), the sum in float32, rounded once to the weight's dtype.

Deviations from the paper: none. The project default is the population-batched path
(essa.adapters.population); this strategy serves tests, references and engines without it.
Quantised (non-floating) weights are refused rather than dequantised, and so are bfloat16 and
float16 weights: rounding W0 + dW to half precision keeps about 3 significant digits of W0,
while the part of dW that differs between candidates is near that rounding step, so candidates
would collapse into the same model (the population-batched path keeps them in float32).
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
    factors = adapter.factors(vector)  # name -> (A' (r, n), B' (m, r)) float32 CPU
    snapshots: dict[str, torch.Tensor] = {}
    try:
        for name, (a, b) in factors.items():
            weight = model.get_submodule(name).weight
            check_mergeable(name, weight.dtype)
            # Built where the weight lives: only the factors cross to the device.
            delta = adapter.module(name).gamma * (b.to(weight.device) @ a.to(weight.device))
            snapshot = weight.detach().clone()  # (m, n) bit-exact copy of W0
            snapshots[name] = snapshot
            weight.data.copy_(snapshot.float() + delta)  # (m, n)
        yield model
    finally:
        for name, snapshot in snapshots.items():
            model.get_submodule(name).weight.data.copy_(snapshot)


def check_mergeable(name: str, dtype: torch.dtype) -> None:
    """TypeError unless a weight of ``dtype`` can hold W0 + dW without losing the candidate."""
    if not dtype.is_floating_point:
        raise TypeError(f"{name}: merged strategy needs a floating weight, got {dtype}")
    if dtype in (torch.bfloat16, torch.float16):
        raise TypeError(
            f"{name}: merged strategy refuses {dtype} weights: rounding W0 + dW to half "
            "precision loses the part of dW that differs between candidates; use batched"
        )
