"""The gradient recipes' checkpoint: RUN_DIR/checkpoint/, one format for GRPO, DPO and ScaleBiO.

``tensors.safetensors`` holds every trained set's tensors and AdamW moments
(``{name}.param.{i}``, ``{name}.exp_avg.{i}``, ``{name}.exp_avg_sq.{i}``); ``state.json`` holds
the recipe's state plus, per set, the AdamW step counts and LISA's optimizer steps (which fix
its layer schedule). Nothing else is random across steps: every draw of the recipes derives
from (run.seed, step), so this is all a bit-exact resume needs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from essa import rundir
from essa.errors import UserError

STATE = "state.json"
TENSORS = "tensors.safetensors"


@dataclass(frozen=True)
class Trained:
    """One trained set: its tensors and the AdamW (torch's or :class:`LisaOptimizer`) moving them.

    ``missing`` is the resume error's reason when a checkpoint lacks the set.
    """

    name: str
    params: list[torch.Tensor]
    optimizer: Any
    missing: str = "the checkpoint does not match this model/adapter"


def save(run_dir: Path, parts: Sequence[Trained], state: dict[str, Any]) -> None:
    """Write RUN_DIR/checkpoint/ for ``state["step"]`` steps done, replaced atomically.

    On a failed write (full disk) the previous checkpoint stays and
    :class:`~essa.rundir.StorageError` names the directory.
    """
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    optimizers: dict[str, Any] = {}
    for part in parts:
        adam_steps = []
        for i, param in enumerate(part.params):
            tensors[f"{part.name}.param.{i}"] = param.detach().cpu().contiguous()
            moments = part.optimizer.state.get(param, {})
            if moments:
                tensors[f"{part.name}.exp_avg.{i}"] = moments["exp_avg"].cpu().contiguous()
                tensors[f"{part.name}.exp_avg_sq.{i}"] = moments["exp_avg_sq"].cpu().contiguous()
            adam_steps.append(float(moments["step"]) if moments else 0.0)
        lisa_steps = getattr(part.optimizer, "steps", None)
        optimizers[part.name] = {"adam_steps": adam_steps, "lisa_steps": lisa_steps}
    fault = rundir.before_checkpoint(state["step"])
    path = run_dir / "checkpoint"
    try:
        with rundir.atomic_dir(path) as tmp:
            save_file(tensors, str(tmp / TENSORS))
            (tmp / STATE).write_text(json.dumps({**state, "optimizers": optimizers}))
            if fault is not None:
                fault()
    except OSError as err:
        raise rundir.storage_error(path, err) from None


def load(run_dir: Path, parts: Sequence[Trained]) -> dict[str, Any] | None:
    """Restore every part from RUN_DIR/checkpoint/ and return the recipe's state (None: none)."""
    from safetensors.torch import load_file

    path = run_dir / "checkpoint"
    rundir.recover(path)
    if not (path / STATE).exists():
        return None
    state = json.loads((path / STATE).read_text())
    saved = state.pop("optimizers")
    tensors = load_file(str(path / TENSORS))
    for part in parts:
        steps = saved.get(part.name)
        if steps is None or len(steps["adam_steps"]) != len(part.params):
            raise UserError(f"--resume {run_dir}: {part.missing}")
        if steps["lisa_steps"] is not None:  # LISA: reactivate the saved interval's blocks first
            part.optimizer.restore(steps["lisa_steps"])
        _restore(part, tensors, steps["adam_steps"])
    return state


def _restore(part: Trained, tensors: dict[str, torch.Tensor], adam_steps: list[float]) -> None:
    name = part.name
    with torch.no_grad():
        for i, param in enumerate(part.params):
            param.copy_(tensors[f"{name}.param.{i}"])
            if f"{name}.exp_avg.{i}" in tensors:
                part.optimizer.state[param] = {
                    "step": torch.tensor(adam_steps[i]),
                    "exp_avg": tensors[f"{name}.exp_avg.{i}"].to(param.device),
                    "exp_avg_sq": tensors[f"{name}.exp_avg_sq.{i}"].to(param.device),
                }
