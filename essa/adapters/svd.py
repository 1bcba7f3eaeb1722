"""LoRA adapter in singular-value form: frozen bases per factor, searched singular values.

Each LoRA factor is decomposed on its own (essa.md §1.3): A = U_A diag(s_A) V_Aᵀ (A is r x n)
and B = U_B diag(s_B) V_Bᵀ (B is m x r). A search vector holds *offsets* added to the SFT
singular values at the top k = floor(alpha * r) positions of every factor (§1.4-1.6).

Layout of the search vector (written to the manifest): layer -> module (q, k, v, o: the
order of appearance in the model) -> factor (A, then B) -> singular index, largest first.

Deviations from the paper (ESSA, arXiv 2507.04453):
- The PEFT scaling gamma = lora_alpha / r is kept as a fixed constant outside the searched
  factors, W' = W0 + gamma * B'A' (the paper's Alg. 1 writes W + B'A').
- Offsets are not clipped; a negative singular value flips one rank-1 direction.
- Bases are stored in float32 (the SVD itself runs in float64); the SFT singular values are
  kept in float64 so that stds() and zero offsets are exact.
- A' is rebuilt as A + U_A diag(x_A) V_Aᵀ (the same matrix as U_A diag(s̃_A) V_Aᵀ), so that a
  zero offset gives the SFT factors bit for bit: the SFT adapter scores the same as itself.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from essa.adapters.export import export_peft
from essa.errors import UserError
from essa.types import AdapterVector, Population

LAYOUT_ORDER = "layer -> module -> factor (A, then B) -> singular index (largest first)"
# Within one layer, attention projections come first in this order (essa.md §1.5).
_PROJECTION_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj")
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class FactorSVD:
    """One LoRA module in SVD form. ``name`` is the module path in the *base* HF model."""

    name: str
    u_a: torch.Tensor  # (r, r) float32
    v_a: torch.Tensor  # (n, r) float32
    u_b: torch.Tensor  # (m, r) float32
    v_b: torch.Tensor  # (r, r) float32
    s_a: torch.Tensor  # (r,) float64, descending
    s_b: torch.Tensor  # (r,) float64, descending
    gamma: float  # PEFT scaling, lora_alpha / r
    k: int  # searched singular values per factor
    start: int  # first index of this module's slice in the search vector
    a: torch.Tensor | None = None  # (r, n) float32, the SFT factor A (A' at a zero offset)
    b: torch.Tensor | None = None  # (m, r) float32, the SFT factor B

    @property
    def r(self) -> int:
        return int(self.s_a.shape[0])

    @property
    def slice_a(self) -> slice:
        return slice(self.start, self.start + self.k)

    @property
    def slice_b(self) -> slice:
        return slice(self.start + self.k, self.start + 2 * self.k)

    @property
    def mix(self) -> torch.Tensor:
        """M = V_Bᵀ U_A (r, r): the fixed core between the two searched scalings (essa.md §5)."""
        return self.v_b.T @ self.u_a


def _thin_svd(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 thin SVD; returns (U, s, V) with s descending, V not transposed."""
    u, s, vh = torch.linalg.svd(weight.detach().to("cpu", torch.float64), full_matrices=False)
    return u, s, vh.T


def _layout_key(name: str, position: int) -> tuple[int, int, int]:
    """Sort key: layer index, then q/k/v/o, then the order the caller gave."""
    match = re.search(r"\.(\d+)\.", f".{name}.")
    layer = int(match.group(1)) if match else -1
    leaf = name.rsplit(".", 1)[-1]
    rank = _PROJECTION_ORDER.index(leaf) if leaf in _PROJECTION_ORDER else len(_PROJECTION_ORDER)
    return layer, rank, position


def _strip_peft_prefix(name: str) -> str:
    return name[len(_PEFT_PREFIX) :] if name.startswith(_PEFT_PREFIX) else name


class SVDAdapter:
    """Frozen SVD bases of an SFT LoRA plus the layout of the singular-value search vector."""

    def __init__(self, modules: list[FactorSVD], alpha: float) -> None:
        self.modules = modules
        self.alpha = float(alpha)
        self._by_name = {module.name: module for module in modules}

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_lora_state(
        cls,
        lora_a: Mapping[str, torch.Tensor],
        lora_b: Mapping[str, torch.Tensor],
        scaling: Mapping[str, float] | float,
        alpha: float,
    ) -> SVDAdapter:
        """Build from LoRA weights keyed by base-model module name.

        ``lora_a[name]`` is (r, n), ``lora_b[name]`` is (m, r); ``scaling`` is PEFT's
        lora_alpha / r, per module or shared. A leading ``base_model.model.`` is stripped.
        Modules are ordered by layer index, then q, k, v, o, then the mapping's order.
        """
        if set(lora_a) != set(lora_b):
            raise ValueError("lora_A and lora_B must name the same modules")
        given = list(lora_a)
        order = sorted(
            range(len(given)), key=lambda i: _layout_key(_strip_peft_prefix(given[i]), i)
        )
        modules: list[FactorSVD] = []
        start = 0
        for name in (given[i] for i in order):
            gamma = float(scaling[name] if isinstance(scaling, Mapping) else scaling)
            module = _decompose(
                _strip_peft_prefix(name), lora_a[name], lora_b[name], gamma, alpha, start
            )
            modules.append(module)
            start += 2 * module.k
        if not modules:
            raise ValueError("no LoRA modules given")
        return cls(modules, alpha)

    @classmethod
    def from_peft_model(cls, peft_model: nn.Module, alpha: float) -> SVDAdapter:
        """Build from a PEFT LoRA model (PeftModel, LoraModel, or an HF model with injected LoRA).

        Uses the single active adapter of every LoRA layer; module names are stored relative
        to the underlying HF model so they address the same linears in the bare base model.
        """
        lora_a: dict[str, torch.Tensor] = {}
        lora_b: dict[str, torch.Tensor] = {}
        scaling: dict[str, float] = {}
        for name, module in peft_model.named_modules():
            if not isinstance(getattr(module, "lora_A", None), nn.ModuleDict):
                continue
            adapter_name = _single_active_adapter(name, module)
            if adapter_name not in module.lora_A:
                continue
            if module.lora_B[adapter_name].bias is not None:
                raise ValueError(f"{name}: LoRA with lora_bias=True is not supported")
            lora_a[name] = module.lora_A[adapter_name].weight
            lora_b[name] = module.lora_B[adapter_name].weight
            scaling[name] = float(module.scaling[adapter_name])
        if not lora_a:
            raise ValueError("no LoRA layers found in the model; was it wrapped with PEFT?")
        return cls.from_lora_state(lora_a, lora_b, scaling, alpha)

    # ------------------------------------------------------------------ layout
    @property
    def dim(self) -> int:
        """D, the length of a search vector."""
        return sum(2 * module.k for module in self.modules)

    @property
    def module_names(self) -> list[str]:
        return [module.name for module in self.modules]

    def module(self, name: str) -> FactorSVD:
        return self._by_name[name]

    def stds(self) -> np.ndarray:
        """SFT singular values at the searched positions, (D,) float64: relative CMA steps."""
        parts = [
            torch.cat([module.s_a[: module.k], module.s_b[: module.k]]) for module in self.modules
        ]
        return torch.cat(parts).numpy().astype(np.float64)

    def searchable(self) -> np.ndarray:
        """(D,) bool: the coordinates a relative step can move, with an effect.

        A zero singular value has a zero relative step; and where a module's gamma, A or B is
        zero, B'A' stays zero whatever the other factor's values: its coordinates move nothing.
        """
        parts = []
        for module in self.modules:
            alive = module.gamma != 0 and bool(module.s_a[0] > 0) and bool(module.s_b[0] > 0)
            values = torch.cat([module.s_a[: module.k], module.s_b[: module.k]])  # (2k,)
            parts.append((values > 0).numpy() & alive)
        return np.concatenate(parts)

    def manifest(self) -> dict[str, Any]:
        """JSON-able description of the search-vector layout."""
        return {
            "format": "essa-svd-adapter/1",
            "order": LAYOUT_ORDER,
            "alpha": self.alpha,
            "dim": self.dim,
            "modules": [
                {
                    "name": module.name,
                    "r": module.r,
                    "k": module.k,
                    "gamma": module.gamma,
                    "shape_a": [module.r, int(module.v_a.shape[0])],
                    "shape_b": [int(module.u_b.shape[0]), module.r],
                    "slice_a": [module.slice_a.start, module.slice_a.stop],
                    "slice_b": [module.slice_b.start, module.slice_b.stop],
                }
                for module in self.modules
            ],
        }

    # ------------------------------------------------------------------ reconstruction
    def singular_values(
        self, population: Population | AdapterVector
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """s̃ = s_SFT + scatter(x) per module: name -> (SA (P, r), SB (P, r)), float64 CPU."""
        offsets = torch.from_numpy(np.atleast_2d(np.asarray(population, dtype=np.float64)))
        if offsets.shape[1] != self.dim:
            raise ValueError(
                f"population has {offsets.shape[1]} columns, adapter.dim is {self.dim}"
            )
        values: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for module in self.modules:
            s_a = module.s_a.expand(offsets.shape[0], -1).clone()  # (P, r)
            s_b = module.s_b.expand(offsets.shape[0], -1).clone()  # (P, r)
            s_a[:, : module.k] += offsets[:, module.slice_a]
            s_b[:, : module.k] += offsets[:, module.slice_b]
            values[module.name] = (s_a, s_b)
        return values

    def factors(self, vector: AdapterVector) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """A' = U_A diag(s̃_A) V_Aᵀ (r, n) and B' = U_B diag(s̃_B) V_Bᵀ (m, r), float32 CPU,
        formed as the SFT factor plus the offsets' part: exactly the SFT factors at zero."""
        vector = np.asarray(vector, dtype=np.float64)
        if vector.ndim != 1:
            raise ValueError(f"factors() takes one vector (D,), got shape {vector.shape}")
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, (s_a, s_b) in self.singular_values(vector).items():
            module = self._by_name[name]
            if module.a is None or module.b is None:
                a = (module.u_a * s_a[0].float()) @ module.v_a.T  # (r, n)
                b = (module.u_b * s_b[0].float()) @ module.v_b.T  # (m, r)
            else:
                d_a, d_b = (torch.zeros(module.r) for _ in "ab")  # (r,) offsets, zero past k
                d_a[: module.k] = torch.from_numpy(vector[module.slice_a]).float()
                d_b[: module.k] = torch.from_numpy(vector[module.slice_b]).float()
                a = module.a + (module.u_a * d_a) @ module.v_a.T  # (r, n)
                b = module.b + (module.u_b * d_b) @ module.v_b.T  # (m, r)
            out[name] = (a, b)
        return out

    def delta_weights(self, vector: AdapterVector) -> dict[str, torch.Tensor]:
        """gamma * B'A' (m, n) per module, float32 CPU."""
        return {
            name: self._by_name[name].gamma * (b @ a)
            for name, (a, b) in self.factors(vector).items()
        }

    def export_peft(
        self,
        vector: AdapterVector,
        out_dir: str | Path,
        base_model_name_or_path: str | None = None,
        **kwargs: Any,
    ) -> Path:
        """Write the candidate as a standard PEFT LoRA directory (see essa.adapters.export)."""
        return export_peft(self, vector, out_dir, base_model_name_or_path, **kwargs)


def _single_active_adapter(name: str, module: nn.Module) -> str:
    active = getattr(module, "active_adapters", None) or ["default"]
    if isinstance(active, str):
        active = [active]
    if len(active) != 1:
        raise ValueError(f"{name}: expected one active LoRA adapter, found {list(active)}")
    adapter_name = active[0]
    if getattr(module, "use_dora", {}).get(adapter_name, False):
        raise ValueError(f"{name}: DoRA adapters are not supported")
    if getattr(module, "fan_in_fan_out", False):
        raise ValueError(f"{name}: fan_in_fan_out (Conv1D) LoRA layers are not supported")
    return adapter_name


def _decompose(
    name: str, lora_a: torch.Tensor, lora_b: torch.Tensor, gamma: float, alpha: float, start: int
) -> FactorSVD:
    """SVD of A (r, n) and B (m, r) separately; k = floor(alpha * r)."""
    r, n = lora_a.shape
    m, r_b = lora_b.shape
    if r_b != r:
        raise ValueError(
            f"{name}: lora_A is {tuple(lora_a.shape)} but lora_B is {tuple(lora_b.shape)}"
        )
    if r > min(m, n):
        raise ValueError(f"{name}: rank r={r} exceeds min(m, n)={min(m, n)}")
    # The small epsilon keeps alpha * r = 2.9999999 from rounding 3 down to 2 by float error.
    k = min(r, int(np.floor(alpha * r + 1e-9)))
    if k <= 0:
        raise ValueError(
            f"adapter.alpha={alpha} with rank r={r} selects zero singular values "
            f"(k = floor(alpha * r) = 0); raise alpha to at least {1 / r:g}"
        )
    u_a, s_a, v_a = _thin_svd(lora_a)  # (r, r), (r,), (n, r)
    u_b, s_b, v_b = _thin_svd(lora_b)  # (m, r), (r,), (r, r)
    return FactorSVD(
        name=name,
        u_a=u_a.float(),
        v_a=v_a.float().contiguous(),
        u_b=u_b.float().contiguous(),
        v_b=v_b.float(),
        s_a=s_a,
        s_b=s_b,
        gamma=gamma,
        k=k,
        start=start,
        a=lora_a.detach().to("cpu", torch.float32).clone(),
        b=lora_b.detach().to("cpu", torch.float32).clone(),
    )


def svd_adapter(peft_model: Any, alpha: float) -> SVDAdapter:
    """The SVD form of the model's LoRA; a config that selects nothing is one UserError line."""
    try:
        return SVDAdapter.from_peft_model(peft_model, alpha=alpha)
    except ValueError as err:  # e.g. alpha * r selects no singular value of a given adapter
        raise UserError(f"adapter: {err}") from None
