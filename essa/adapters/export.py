"""Export one candidate as a standard PEFT LoRA directory (essa.md §1.10).

The directory holds ``adapter_config.json``, ``adapter_model.safetensors`` (A' and B' of
every module, keys ``base_model.model.<module>.lora_A.weight``) and ``essa_manifest.json``
(the search-vector layout and the exported vector). PEFT and vLLM load it as a plain LoRA.

Deviations from the paper: none. The directory is written to a temporary sibling and renamed
into place, so a reader never sees a half-written adapter.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from essa.adapters.svd import SVDAdapter
from essa.types import AdapterVector

MANIFEST_NAME = "essa_manifest.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


def export_peft(
    adapter: SVDAdapter,
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
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex}"
    tmp.mkdir(parents=True)
    try:
        config.save_pretrained(str(tmp))
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
        _fsync_tree(tmp)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _lora_config(
    adapter: SVDAdapter,
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
        lora_alpha=lora_alpha,
        target_modules=list(target_modules),
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_name_or_path,
    )


def _fsync_tree(directory: Path) -> None:
    for path in directory.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    """Rename ``tmp`` onto ``out_dir``; an existing directory is moved aside first."""
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex}"
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
