"""Update size: ``||dW||_F / ||W0||_F`` per adapted matrix, for the SFT adapter, the tuned one
and the search (their difference), read from an SVD adapter's vectors or a PEFT model."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from essa.types import AdapterVector

if TYPE_CHECKING:
    from essa.adapters.svd import SVDAdapter


def update_size(deltas: Mapping[str, torch.Tensor], bases: Mapping[str, torch.Tensor]) -> dict:
    """``||dW||_F / ||W0||_F`` per adapted matrix: mean, max and count.

    >>> update_size({"w": torch.ones(2, 2)}, {"w": 2 * torch.ones(2, 2)})
    {'mean': 0.5, 'max': 0.5, 'matrices': 1}
    """
    ratios = [
        float(torch.linalg.norm(delta.double()) / torch.linalg.norm(bases[name].double()))
        for name, delta in deltas.items()
    ]
    return {"mean": float(np.mean(ratios)), "max": float(np.max(ratios)), "matrices": len(ratios)}


def base_weights(model: Any, names: Sequence[str]) -> dict[str, torch.Tensor] | None:
    """W0 of the named linears of ``model`` (float32 CPU); None when quantised (no W0 to read)."""
    weights = {name: model.get_submodule(name).weight for name in names}
    if any(not w.is_floating_point() for w in weights.values()):
        return None
    return {name: w.detach().float().cpu() for name, w in weights.items()}


def peft_deltas(peft_model: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(gamma * B A, W0)`` per LoRA module of a PEFT model, keyed by its base-model name."""
    deltas, bases = {}, {}
    for name, module in peft_model.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if not isinstance(lora_a, torch.nn.ModuleDict) or not lora_a:
            continue
        (adapter,) = module.active_adapters
        a = module.lora_A[adapter].weight.detach().float().cpu()  # (r, n)
        b = module.lora_B[adapter].weight.detach().float().cpu()  # (m, r)
        key = name.removeprefix("base_model.model.")
        deltas[key] = float(module.scaling[adapter]) * (b @ a)
        weight = module.base_layer.weight.detach()
        bases[key] = weight.float().cpu() if weight.is_floating_point() else weight
    return deltas, bases


def peft_updates(
    peft_model: Any, sft: Callable[[], contextlib.AbstractContextManager[Any]] | None
) -> dict[str, Any] | None:
    """Update sizes of a PEFT model's adapter (``final``) and, with ``sft`` (a context that
    loads the SFT values), of the SFT adapter and the change from it (``search``); None when
    the base weights are quantised."""
    final, w0 = peft_deltas(peft_model)
    if any(not w.is_floating_point() for w in w0.values()):
        return None
    report = {"final": update_size(final, w0)}
    if sft is not None:
        with sft():
            start, _ = peft_deltas(peft_model)
        report["sft"] = update_size(start, w0)
        report["search"] = update_size({n: final[n] - start[n] for n in final}, w0)
    return report


def adapter_updates(
    model: Any, adapter: SVDAdapter, vector: AdapterVector
) -> dict[str, dict[str, Any]] | None:
    """Update sizes of the SFT adapter, of ``vector``'s and of the search (their difference),
    relative to the base weights of ``model``; None when they cannot be read (quantised)."""
    w0 = base_weights(model, adapter.module_names)
    if w0 is None:
        return None
    sft, final = adapter.delta_weights(np.zeros(adapter.dim)), adapter.delta_weights(vector)
    search = {name: final[name] - sft[name] for name in final}
    return {
        "sft": update_size(sft, w0),
        "final": update_size(final, w0),
        "search": update_size(search, w0),  # the final adapter's change from SFT
    }
