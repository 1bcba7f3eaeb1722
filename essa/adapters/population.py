"""Population-batched LoRA: every batch row of one forward pass carries its own candidate.

Per adapted linear (essa.md §5), with M = V_Bᵀ U_A fixed and only two length-r scalings
depending on the candidate c of a row:

    y = W0 x + gamma * U_B (s̃_B[c] ⊙ M (s̃_A[c] ⊙ (V_Aᵀ x)))

W0 x is computed by calling the original module, so quantised (bitsandbytes) linears work
unchanged. The extra cost per token is one LoRA's worth (n r + r² + m r multiply-adds) at
any population size. Rows are mapped to candidates once per batch by ``set_rows``; the
per-row singular values are gathered there (one gather for all modules), not per forward.

Precision: the candidate-specific path (V_Aᵀ x, the scalings, M, and U_B z added onto W0 x)
runs in float32 when the model is in bfloat16/float16, and the per-row singular values are kept
in float32. bf16 resolves about 0.4% of a value: CMA-ES offsets below that, once sigma has
shrunk, would round every candidate to the same model. W0 x stays in the model's dtype and the
sum is rounded to it once per linear. fp32 (and fp64) models run the path in their own dtype,
bit for bit as before.

One adapter, scored on its own (held-out scores, ``essa eval``), runs in PEFT's factor form
instead, whoever scores it: ``one_adapter`` puts a FactorLinear, y = W0 x + gamma B (A x) with
the same precision rule, on each target linear, from an SVD candidate's A', B' (what the export
writes) or from a PEFT model's own LoRA weights, so that the same adapter gives the same bits.

Deviations from the paper: none in the math (the paper does not describe its inference
path). gamma is folded into the gathered s̃_B.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from essa.adapters.svd import FactorSVD, SVDAdapter
from essa.types import Population


def candidate_rows(num_candidates: int, rows_per_candidate: int) -> torch.Tensor:
    """Candidate-major row map: rows [c * q, (c + 1) * q) belong to candidate c. (P * q,)"""
    return torch.arange(num_candidates).repeat_interleave(rows_per_candidate)


class PopulationLinear(nn.Module):
    """Wraps one target linear; adds the per-row candidate's low-rank update to base(x)."""

    def __init__(
        self, base: nn.Module, factor: FactorSVD, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.base = base
        self.rank = factor.r
        # Stored as F.linear weights: F.linear(x, W) = x @ Wᵀ.
        self.register_buffer(
            "basis_a", factor.v_a.T.to(device, dtype).contiguous(), persistent=False
        )  # (r, n)
        self.register_buffer("mix", factor.mix.to(device, dtype), persistent=False)  # (r, r)
        self.register_buffer("basis_b", factor.u_b.to(device, dtype), persistent=False)  # (m, r)
        # Views into PopulationLoRA's gathered rows, set by set_rows.
        self.scale_a: torch.Tensor | None = None  # (B, r) s̃_A of each row's candidate
        self.scale_b: torch.Tensor | None = None  # (B, r) gamma * s̃_B of each row's candidate

    @property
    def weight(self) -> torch.Tensor:
        # Some HF code reads proj.weight (dtype, device); answer for the wrapped module.
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # (B, T, m)
        if self.scale_a is None or self.scale_b is None:
            raise RuntimeError(
                "PopulationLoRA: call set_population() and set_rows() before forward"
            )
        rows = x.shape[0]
        if rows != self.scale_a.shape[0]:
            raise RuntimeError(
                f"batch has {rows} rows but set_rows() mapped {self.scale_a.shape[0]}; "
                "call set_rows() with one candidate index per batch row"
            )
        # (B, 1, r) for (B, T, n) input: the row's scaling broadcasts over the sequence.
        row_shape = (rows,) + (1,) * (x.dim() - 2) + (self.rank,)
        z = F.linear(x.to(self.basis_a.dtype), self.basis_a)  # (B, T, r) path dtype
        z = z * self.scale_a.view(row_shape)  # (B, T, r)
        z = F.linear(z, self.mix)  # (B, T, r)
        z = z * self.scale_b.view(row_shape)  # (B, T, r)
        # One fused GEMM adds U_B z onto the base output in the path dtype, rounded once to
        # the model's (no-op casts for fp32 models).
        out = torch.addmm(
            y.reshape(-1, y.shape[-1]).to(z.dtype),  # (B*T, m)
            z.reshape(-1, self.rank),  # (B*T, r)
            self.basis_b.T,  # (r, m)
        )
        return out.to(y.dtype).view(y.shape)


# Module path in the base model -> (A (r, n), B (m, r), gamma): one adapter in PEFT's form.
LoRAFactors = Mapping[str, tuple[torch.Tensor, torch.Tensor, float]]


class FactorLinear(nn.Module):
    """Wraps one target linear; adds one adapter's gamma B (A x) onto base(x).

    The LoRA term runs in the path dtype (float32 for half-precision models) and the sum is
    rounded to the model's dtype once, as in PopulationLinear; gamma is folded into B.
    """

    def __init__(
        self,
        base: nn.Module,
        a: torch.Tensor,
        b: torch.Tensor,
        gamma: float,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        a32, b32 = a.detach().to(device, torch.float32), b.detach().to(device, torch.float32)
        self.register_buffer("factor_a", a32.to(dtype).contiguous(), persistent=False)  # (r, n)
        # (r, m): addmm's right operand; gamma * B formed in float32 whatever the path dtype.
        self.register_buffer("factor_b", (gamma * b32).T.to(dtype), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # (B, T, m)
        z = F.linear(x.to(self.factor_a.dtype), self.factor_a)  # (B, T, r)
        out = torch.addmm(
            y.reshape(-1, y.shape[-1]).to(z.dtype), z.reshape(-1, z.shape[-1]), self.factor_b
        )  # (B*T, m) path dtype
        return out.to(y.dtype).view(y.shape)


@contextmanager
def one_adapter(model: nn.Module, factors: LoRAFactors) -> Iterator[nn.Module]:
    """Inside the block each named linear of ``model`` is a FactorLinear of its factors.

    ``model`` is a bare base model, or the base model of a PeftModel: a PEFT LoRA layer is
    replaced whole (its own LoRA path is not run) and its ``base_layer`` wrapped. The original
    modules are back after the block.
    """
    dtype = path_dtype(_floating_dtype(model))
    originals: dict[str, nn.Module] = {}
    try:
        for name, (a, b, gamma) in factors.items():
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            original = getattr(parent, leaf)
            inner = original.base_layer if hasattr(original, "lora_A") else original
            layer = FactorLinear(inner, a, b, gamma, dtype, _module_device(inner))
            originals[name] = original
            setattr(parent, leaf, layer)
        yield model
    finally:
        for name, original in originals.items():
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, leaf, original)


def peft_factors(
    model: Any,
) -> tuple[nn.Module, dict[str, tuple[torch.Tensor, torch.Tensor, float]]]:
    """(the model to run, its LoRA factors by module path in it): a PeftModel's base model and
    the active adapter of every LoRA linear. No factors (run the model as it is) for a model
    without LoRA layers, or when one layer is not a plain LoRA linear (DoRA, a LoRA bias, a
    merged or disabled adapter, several active adapters, an embedding or convolution)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for name, module in inner.named_modules():
        if not isinstance(getattr(module, "lora_A", None), nn.ModuleDict):
            continue
        adapter = _plain_lora_adapter(module)
        if adapter is None:
            return inner, {}
        if adapter not in module.lora_A:
            continue
        factors[name] = (
            module.lora_A[adapter].weight.detach(),  # (r, n)
            module.lora_B[adapter].weight.detach(),  # (m, r)
            float(module.scaling[adapter]),
        )
    return inner, factors


def _plain_lora_adapter(module: Any) -> str | None:
    """The single active adapter of a PEFT LoRA layer that computes W0 x + s B (A x); None
    when the layer computes anything else."""
    active = getattr(module, "active_adapters", None) or ["default"]
    active = [active] if isinstance(active, str) else list(active)
    if len(active) != 1 or getattr(module, "merged", False):
        return None
    if getattr(module, "disable_adapters", False) or getattr(module, "fan_in_fan_out", False):
        return None
    name = active[0]
    if name not in module.lora_A:
        return name
    plain = isinstance(module.lora_A[name], nn.Linear) and module.lora_B[name].bias is None
    return name if plain and not getattr(module, "use_dora", {}).get(name, False) else None


class PopulationLoRA:
    """Swap the adapter's target linears of a *base* HF model for PopulationLinear wrappers.

    Wrapping happens on construction; ``close()`` (or leaving the ``with`` block) puts the
    original modules back. Usage::

        with PopulationLoRA(model, adapter) as pop:
            pop.set_population(X)                        # (P, D) offsets
            pop.set_rows(candidate_rows(P, len(prompts)))  # (B,) candidate of each row
            model.generate(**batch_repeated_candidate_major)
    """

    def __init__(
        self, model: nn.Module, adapter: SVDAdapter, dtype: torch.dtype | None = None
    ) -> None:
        self.model = model
        self.adapter = adapter
        self.dtype = dtype or _floating_dtype(model)
        self.path_dtype = path_dtype(self.dtype)  # candidate path: never below float32
        self._originals: dict[str, nn.Module] = {}
        self._layers: dict[str, PopulationLinear] = {}
        # Column of each module's [s̃_A | gamma s̃_B] block in the flat (P, W) values.
        self._columns: dict[str, int] = {}
        self._values: dict[torch.device, torch.Tensor] = {}  # device -> (P, W)
        self._rows: torch.Tensor | None = None
        try:
            self._wrap()
        except Exception:
            self.close()
            raise

    def _wrap(self) -> None:
        column = 0
        for factor in self.adapter.modules:
            parent_name, _, leaf = factor.name.rpartition(".")
            parent = self.model.get_submodule(parent_name) if parent_name else self.model
            original = getattr(parent, leaf)
            if isinstance(original, PopulationLinear) or hasattr(original, "lora_A"):
                raise ValueError(
                    f"{factor.name} is already adapted; PopulationLoRA needs the bare base model"
                )
            layer = PopulationLinear(original, factor, self.path_dtype, _module_device(original))
            setattr(parent, leaf, layer)
            self._originals[factor.name] = original
            self._layers[factor.name] = layer
            self._columns[factor.name] = column
            column += 2 * factor.r

    @property
    def num_candidates(self) -> int:
        return next(iter(self._values.values())).shape[0] if self._values else 0

    def set_population(self, population: Population) -> None:
        """Load P candidates (P, D). Keeps the current row map if it still fits."""
        values = self.adapter.singular_values(population)
        blocks = [
            torch.cat([s_a, self.adapter.module(name).gamma * s_b], dim=1)  # (P, 2r)
            for name, (s_a, s_b) in values.items()
        ]
        flat = torch.cat(blocks, dim=1)  # (P, W) float64
        devices = {layer.basis_a.device for layer in self._layers.values()}
        self._values = {device: flat.to(device, self.path_dtype) for device in devices}
        if self._rows is not None and int(self._rows.max()) < flat.shape[0]:
            self.set_rows(self._rows)
        else:
            self._rows = None
            self._assign(None)

    def set_rows(self, candidates: torch.Tensor | np.ndarray | list[int]) -> None:
        """Map batch rows to candidates: ``candidates[b]`` is the candidate of row b. (B,)"""
        if not self._values:
            raise RuntimeError("call set_population() before set_rows()")
        rows = torch.as_tensor(candidates, dtype=torch.long).flatten().cpu()  # (B,)
        if rows.numel() == 0 or int(rows.min()) < 0 or int(rows.max()) >= self.num_candidates:
            raise ValueError(f"row candidates must lie in [0, {self.num_candidates})")
        self._rows = rows
        # One gather per device for all modules; the per-module scalings are views of it.
        gathered = {
            device: values.index_select(0, rows.to(device))  # (B, W)
            for device, values in self._values.items()
        }
        self._assign(gathered)

    def _assign(self, gathered: dict[torch.device, torch.Tensor] | None) -> None:
        for name, layer in self._layers.items():
            if gathered is None:
                layer.scale_a = layer.scale_b = None
                continue
            rows = gathered[layer.basis_a.device]
            column, r = self._columns[name], layer.rank
            layer.scale_a = rows[:, column : column + r]
            layer.scale_b = rows[:, column + r : column + 2 * r]

    def close(self) -> None:
        """Put the original modules back; safe to call twice."""
        for name, original in self._originals.items():
            parent_name, _, leaf = name.rpartition(".")
            parent = self.model.get_submodule(parent_name) if parent_name else self.model
            setattr(parent, leaf, original)
        self._originals.clear()
        self._layers.clear()
        self._values.clear()
        self._rows = None

    def __enter__(self) -> PopulationLoRA:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


HALF_DTYPES = (torch.bfloat16, torch.float16)


def path_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The candidate path's dtype: float32 for half-precision models, else the model's."""
    return torch.float32 if model_dtype in HALF_DTYPES else model_dtype


def _floating_dtype(model: nn.Module) -> torch.dtype:
    """The model's compute dtype: its first floating parameter (quantised weights are not)."""
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.float32


def _module_device(module: nn.Module) -> torch.device:
    for tensor in list(module.parameters()) + list(module.buffers()):
        return tensor.device
    return torch.device("cpu")
