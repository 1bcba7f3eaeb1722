"""Memory accounting for the run metrics: peak process memory and the bytes a model holds.

``model_bytes`` counts what the weights occupy, not what they would in float32: parameters and
buffers at their stored dtype (tied tensors once) plus the side tensors of bitsandbytes layers
(4-bit block scales, nested scales and code books; 8-bit row scales). A Linear4bit's packed
uint8 weight is therefore counted at half a byte per weight plus its scales.
"""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch
from torch import nn


def peak_rss_mb() -> float:
    """This process's peak resident set size in MiB.

    Linux: VmHWM of /proc/self/status. ru_maxrss is not used there because the kernel carries
    it over from the parent through fork and exec: a run started by a process holding 800 MB
    would report at least 800 MB. Elsewhere ru_maxrss (KiB, or bytes on macOS).
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 2**10, 1)  # "VmHWM:  123456 kB"
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)


def peak_cuda_allocated_mb() -> float | None:
    """Peak memory allocated by torch on CUDA in MiB (all devices), or None without CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    total = sum(torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count()))
    return round(total / 2**20, 1)


def model_bytes(module: nn.Module) -> int:
    """Bytes held by ``module``'s parameters, buffers and quantisation side tensors."""
    seen: set[tuple[int, int]] = set()
    total = 0

    def add(tensor: Any) -> None:
        nonlocal total
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        key = (tensor.untyped_storage().data_ptr(), tensor.data_ptr())
        if key in seen:  # tied embeddings, shared code books
            return
        seen.add(key)
        total += tensor.numel() * tensor.element_size()

    for tensor in [*module.parameters(), *module.buffers()]:
        add(tensor)
        quant_state = getattr(tensor, "quant_state", None)  # bnb Params4bit
        if quant_state is not None:
            for value in _quant_state_tensors(quant_state):
                add(value)
        add(getattr(tensor, "SCB", None))  # bnb Int8Params: one float32 scale per row
    return total


def _quant_state_tensors(quant_state: Any) -> list[Any]:
    """The live tensors of a bnb QuantState: block scales, code book, and their nested level.

    Read from the attributes, not ``as_dict()``, which clones the nested code book: a freed
    clone's address can be reused by the next one and would then be skipped as "seen".
    """
    tensors = [quant_state.absmax, quant_state.code, getattr(quant_state, "offset", None)]
    nested = getattr(quant_state, "state2", None)
    if nested is not None:
        tensors += [nested.absmax, nested.code]
    return tensors


def memory_metrics(base_model_bytes: int) -> dict[str, float | int]:
    """The memory fields of the run metrics; the CUDA peak only where CUDA is in use."""
    metrics: dict[str, float | int] = {
        "peak_rss_mb": peak_rss_mb(),
        "model_bytes": int(base_model_bytes),
    }
    cuda = peak_cuda_allocated_mb()
    if cuda is not None:
        metrics["peak_cuda_allocated_mb"] = cuda
    return metrics
