"""Export one candidate as a standard PEFT LoRA directory (essa.md §1.10).

The directory holds ``adapter_config.json``, ``adapter_model.safetensors`` (A' and B' of
every module, keys ``base_model.model.<module>.lora_A.weight``) and ``essa_manifest.json``
(the search-vector layout and the exported vector). PEFT and vLLM load it as a plain LoRA.

Deviations from the paper: none. The directory is written to a temporary sibling and renamed
into place, so a reader never sees a half-written adapter.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from essa.rundir import atomic_dir
from essa.types import AdapterVector


class ExportedFactor(Protocol):
    """One adapted module as the export reads it (``essa.adapters.svd.FactorSVD``)."""

    @property
    def name(self) -> str: ...
    @property
    def r(self) -> int: ...
    @property
    def gamma(self) -> float: ...


class Exportable(Protocol):
    """What the export reads of an adapter (``essa.adapters.svd.SVDAdapter``, which calls this
    module: a protocol rather than an import keeps the dependency one-way)."""

    @property
    def modules(self) -> Sequence[ExportedFactor]: ...
    @property
    def module_names(self) -> list[str]: ...
    def manifest(self) -> dict[str, Any]: ...
    def factors(self, vector: AdapterVector) -> dict[str, tuple[torch.Tensor, torch.Tensor]]: ...


MANIFEST_NAME = "essa_manifest.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


def export_peft(
    adapter: Exportable,
    vector: AdapterVector,
    out_dir: str | Path,
    base_model_name_or_path: str | None = None,
    target_modules: Sequence[str] | None = None,
    lora_alpha: float | None = None,
    r: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write ``vector`` as a PEFT LoRA at ``out_dir`` (replaced if present); returns the path.

    Defaults: ``target_modules`` = the leaf names of the adapted modules (q_proj, ...),
    ``r`` and ``lora_alpha`` from the first module. Modules whose rank or gamma differ get
    ``rank_pattern`` / ``alpha_pattern`` entries, so PEFT's scaling always equals gamma.
    """
    from safetensors.torch import save_file

    vector = np.asarray(vector, dtype=np.float64)
    config = _lora_config(adapter, base_model_name_or_path, target_modules, lora_alpha, r)
    tensors: dict[str, torch.Tensor] = {}
    for name, (a, b) in adapter.factors(vector).items():
        tensors[f"{_PEFT_PREFIX}{name}.lora_A.weight"] = a.to(dtype).contiguous()  # (r, n)
        tensors[f"{_PEFT_PREFIX}{name}.lora_B.weight"] = b.to(dtype).contiguous()  # (m, r)
    manifest = adapter.manifest() | {
        "base_model_name_or_path": base_model_name_or_path,
        "vector": vector.tolist(),
    }

    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:  # the old directory stays until the new one is complete
        config.save_pretrained(str(tmp))
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    return out_dir


def _lora_config(
    adapter: Exportable,
    base_model_name_or_path: str | None,
    target_modules: Sequence[str] | None,
    lora_alpha: float | None,
    r: int | None,
) -> Any:
    """A LoraConfig whose per-module scaling lora_alpha / r equals each module's gamma."""
    from peft import LoraConfig

    first = adapter.modules[0]
    r = first.r if r is None else int(r)
    lora_alpha = first.gamma * first.r if lora_alpha is None else float(lora_alpha)
    rank_pattern = {m.name: m.r for m in adapter.modules if m.r != r}
    alpha_pattern = {
        m.name: m.gamma * m.r
        for m in adapter.modules
        if not np.isclose(m.gamma, lora_alpha / m.r, rtol=1e-12, atol=0.0)
    }
    if target_modules is None:
        target_modules = sorted({name.rsplit(".", 1)[-1] for name in adapter.module_names})
    return LoraConfig(
        r=r,
        lora_alpha=lora_alpha,  # type: ignore[arg-type]  # PEFT annotates int; floats work
        target_modules=list(target_modules),
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_name_or_path,
    )
