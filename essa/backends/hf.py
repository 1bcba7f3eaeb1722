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
    if cfg.quantization != "none":
        raise UserError(f"model.quantization={cfg.quantization}: not supported yet; use none")
    path = resolve_model_path(cfg.name_or_path)
    tokenizer = load_tokenizer(cfg)
    kwargs: dict[str, Any] = {"trust_remote_code": cfg.trust_remote_code}
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
    model.to(pick_device(cfg.device))
    model.eval()
    return model, tokenizer


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
