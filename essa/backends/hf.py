"""Hugging Face transformers backend: model loading and batched generation.

Loads any causal LM that transformers loads from a local directory or a hub id, a GGUF file
(``model.gguf_file``), or the bundled demo model (``builtin:demo``). ``trust_remote_code`` is
off unless the config sets it, and then it is logged loudly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from essa.config import GenerationConfig, ModelConfig
from essa.errors import UserError

log = logging.getLogger(__name__)

BUILTIN_MODELS = {"builtin:demo": Path(__file__).resolve().parent.parent / "data" / "demo"}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(name_or_path: str) -> str:
    """Map ``builtin:NAME`` to the bundled directory; check that local-looking paths exist."""
    if name_or_path.startswith("builtin:"):
        if name_or_path not in BUILTIN_MODELS:
            known = ", ".join(BUILTIN_MODELS)
            raise UserError(
                f"model.name_or_path: unknown builtin model {name_or_path!r} (known: {known})"
            )
        path = BUILTIN_MODELS[name_or_path]
        if not (path / "config.json").exists():
            raise UserError(f"bundled model missing at {path}: reinstall essa-align")
        return str(path)
    expanded = Path(name_or_path).expanduser()
    if expanded.exists():
        return str(expanded)
    # Hub ids are "name" or "org/name"; anything else that does not exist is a missing path.
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise UserError(f"model.name_or_path: no such directory: {name_or_path}")
    return name_or_path  # a hub id; transformers resolves (or fails offline) below


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"model.device: {device} requested but CUDA is not available")
    return torch.device(device)


def load_tokenizer(cfg: ModelConfig) -> Any:
    from transformers import AutoTokenizer

    path = resolve_model_path(cfg.name_or_path)
    kwargs: dict[str, Any] = {"trust_remote_code": cfg.trust_remote_code}
    if cfg.gguf_file:
        kwargs["gguf_file"] = cfg.gguf_file
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    except OSError as err:
        raise UserError(
            f"model.name_or_path: cannot load tokenizer from {path}: {_first_line(err)}"
        ) from None
    if tokenizer.pad_token_id is None:
        # Decoder-only models often ship without a pad token; eos is the usual stand-in.
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # generation appends on the right
    return tokenizer


def load_model(cfg: ModelConfig) -> tuple[Any, Any]:
    """Load (model, tokenizer) in eval mode on the configured device."""
    from transformers import AutoModelForCausalLM

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    if cfg.trust_remote_code:
        log.warning(
            "model.trust_remote_code is TRUE: code shipped with %s will run", cfg.name_or_path
        )
    device = pick_device(cfg.device)
    kwargs: dict[str, Any] = {"trust_remote_code": cfg.trust_remote_code}
    if cfg.quantization != "none":
        # Checked before the tokenizer and weights load: a mode that cannot run fails fast.
        kwargs["quantization_config"] = quantization_config(cfg, device)
        kwargs["device_map"] = {"": device}  # bnb quantises while loading, on the target device
    path = resolve_model_path(cfg.name_or_path)
    tokenizer = load_tokenizer(cfg)
    if cfg.dtype != "auto":
        kwargs["dtype"] = _DTYPES[cfg.dtype]
    if cfg.gguf_file:
        kwargs["gguf_file"] = cfg.gguf_file
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as err:
        raise UserError(
            f"model.name_or_path: cannot load model from {path}: {_first_line(err)}"
        ) from None
    if cfg.quantization == "none":
        model.to(device)  # quantised models are placed by device_map (8-bit ones refuse .to)
    else:
        disable_cpu_weight_packing(model)
    model.eval()
    return model, tokenizer


def quantization_config(cfg: ModelConfig, device: torch.device) -> Any:
    """A BitsAndBytesConfig for ``cfg.quantization``, after checking it runs on ``device``."""
    from transformers import BitsAndBytesConfig

    bnb = _import_bitsandbytes(cfg.quantization)
    compute = _DTYPES.get(cfg.dtype, torch.float32)
    if cfg.compute_dtype != "auto":
        compute = _DTYPES[cfg.compute_dtype]
    _check_quantization_runs(bnb, cfg, device, compute)
    if cfg.quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=cfg.quant_type,
        bnb_4bit_compute_dtype=compute,
        bnb_4bit_use_double_quant=cfg.use_double_quant,
    )


def _import_bitsandbytes(mode: str) -> Any:
    # bitsandbytes warns on import about an optional `kernels` package and, in 8-bit, on every
    # matmul about an fp16 cast; both are harmless and would bury the progress output.
    bnb_logger = logging.getLogger("bitsandbytes")
    if bnb_logger.level == logging.NOTSET:
        bnb_logger.setLevel(logging.ERROR)
    try:
        import bitsandbytes
    except ImportError:
        raise UserError(
            f"model.quantization={mode} needs bitsandbytes: pip install 'essa-align[quant]'"
        ) from None
    except Exception as err:  # a broken native library raises RuntimeError/OSError on import
        raise UserError(
            f"model.quantization={mode}: bitsandbytes failed to load: {_first_line(err)}"
        ) from None
    return bitsandbytes


def _check_quantization_runs(
    bnb: Any, cfg: ModelConfig, device: torch.device, compute: torch.dtype
) -> None:
    """Quantise and run one 64 x 64 layer on ``device``; raise UserError if that fails."""
    mode = cfg.quantization
    if device.type not in ("cpu", "cuda", "xpu"):
        raise UserError(
            f"model.quantization={mode}: bitsandbytes does not run on {device.type}; "
            "use model.device=cpu or cuda, or model.quantization=none"
        )
    version = tuple(int(p) for p in bnb.__version__.split(".")[:2] if p.isdigit())
    if device.type == "cpu" and version < (0, 48):
        raise UserError(
            f"model.quantization={mode} on CPU needs bitsandbytes>=0.48 "
            f"(found {bnb.__version__}): pip install -U 'essa-align[quant]'"
        )
    try:
        if mode == "int8":
            layer = bnb.nn.Linear8bitLt(64, 64, bias=False, has_fp16_weights=False)
        else:
            layer = bnb.nn.Linear4bit(
                64, 64, bias=False, compute_dtype=compute, quant_type=cfg.quant_type
            )
        layer = layer.to(device)  # bnb quantises when the weight moves to a device
        with torch.no_grad():
            out = layer(torch.ones(2, 64, device=device, dtype=compute))  # (2, 64)
        if not bool(torch.isfinite(out).all()):
            raise RuntimeError("non-finite output")
    except Exception as err:
        raise UserError(
            f"model.quantization={mode} (compute dtype {str(compute).removeprefix('torch.')}) "
            f"cannot run on {device}: {_first_line(err)}"
        ) from None


def disable_cpu_weight_packing(model: Any) -> None:
    """Keep bitsandbytes 4-bit layers off their CPU inference repacking.

    On CPUs with AVX512-BF16, bnb >= 0.48 repacks a Linear4bit's weight the first time it runs
    in eval mode under no_grad, and from then on computes that layer in bfloat16 (whatever the
    compute dtype) through a path without autograd; a later training forward then fails
    (infra.md §4, "eval/no_grad, then train"). Turning it off keeps the configured compute
    dtype, the same numerics on every CPU, and training possible after evaluation.
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def undo_cpu_weight_packing(model: Any) -> int:
    """Unpack 4-bit weights that bnb repacked for CPU inference; returns how many it unpacked.

    A no-op for models from :func:`load_model` (which turns the packing off); for others it
    makes training possible after an evaluation pass under no_grad.
    """
    packed = [
        module
        for module in model.modules()
        if getattr(
            getattr(getattr(module, "weight", None), "quant_state", None),
            "packing_format_for_cpu",
            False,
        )
    ]
    if packed:
        from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

        for module in packed:
            module.weight.data, module.weight.quant_state = _convert_weight_packed_for_cpu_inverse(
                module.weight.data, module.weight.quant_state
            )
    disable_cpu_weight_packing(model)
    return len(packed)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def model_device(model: Any) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def generate_texts(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    gen: GenerationConfig,
    *,
    micro_batch_size: int,
    before_chunk: Callable[[int, int], None] | None = None,
    seed: int | None = None,
) -> tuple[list[str], int]:
    """Generate one completion per prompt, in micro-batches of rows.

    ``before_chunk(start, stop)`` runs before each micro-batch, so a population wrapper can
    tell its layers which candidate each row carries. Returns (completions, new_tokens).
    """
    device = model_device(model)
    completions: list[str] = []
    new_tokens = 0
    if seed is not None and gen.temperature > 0:
        torch.manual_seed(seed)  # HF sampling draws from the global torch RNG
    for start in range(0, len(prompts), micro_batch_size):
        stop = min(start + micro_batch_size, len(prompts))
        if before_chunk is not None:
            before_chunk(start, stop)
        batch = tokenizer(
            list(prompts[start:stop]), return_tensors="pt", padding=True, add_special_tokens=False
        ).to(device)
        out = model.generate(**batch, **_generate_kwargs(gen, tokenizer))
        new = out[:, batch["input_ids"].shape[1] :]  # (B, T_new)
        new_tokens += int((new != tokenizer.pad_token_id).sum())
        completions.extend(tokenizer.batch_decode(new, skip_special_tokens=True))
    return completions, new_tokens


def _generate_kwargs(gen: GenerationConfig, tokenizer: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "max_new_tokens": gen.max_new_tokens,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    if gen.temperature > 0:
        kwargs.update(do_sample=True, temperature=gen.temperature, top_p=gen.top_p)
    else:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    return kwargs
