"""``essa export RUN_DIR --merged OUT``: the chosen adapter merged into its base as a plain HF
checkpoint that transformers and vLLM load without PEFT.

OUT holds ``model.safetensors`` (W0 + gamma * B A in every adapted linear, PEFT's own merge),
``config.json``, the tokenizer files and a ``generation_config.json`` with the run's decoding
(greedy by default, stopping on the same tokens as the run's generation). A quantised base
(``model.quantization`` int8/int4) cannot hold an exact merge, so the adapter is merged into the
full-precision base instead, and the result says so. The directory is written to a temporary
sibling and renamed into place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from essa.config import GenerationConfig, ModelConfig
from essa.errors import UserError


@dataclass(frozen=True)
class MergedExport:
    out_dir: Path
    adapter_dir: Path
    base: str  # the base model's name_or_path
    dtype: str  # the merged weights' dtype
    note: str | None  # e.g. "merged into the full-precision base (the run used int4)"


def generation_config(gen: GenerationConfig, tokenizer: Any, model_config: Any = None) -> Any:
    """The run's decoding as a transformers GenerationConfig (greedy when temperature is 0).

    It stops where the run's generation stopped (essa.backends.stops): on the tokenizer's EOS
    and the base model's own stop ids (``model_config``, its GenerationConfig), so a chat
    model's end-of-turn token still ends a reply of the merged model.
    """
    from transformers import GenerationConfig as HFGenerationConfig

    from essa.backends.stops import stop_token_ids

    stops = stop_token_ids(tokenizer, model_config)
    eos: int | list[int] | None = stops if len(stops) > 1 else (stops[0] if stops else None)
    sampling = gen.temperature > 0
    return HFGenerationConfig(
        do_sample=sampling,
        temperature=gen.temperature if sampling else None,
        top_p=gen.top_p if sampling else None,
        # auto is resolved per run (essa.es.plan): the run's summary holds the number it used
        max_new_tokens=gen.max_new_tokens if isinstance(gen.max_new_tokens, int) else None,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )


def merge_adapter(base: Any, adapter_dir: Path) -> Any:
    """``PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()``; one-line errors."""
    from peft import PeftModel

    if not (adapter_dir / "adapter_config.json").exists():
        raise UserError(f"{adapter_dir}: not a PEFT adapter directory (no adapter_config.json)")
    try:
        peft_model = PeftModel.from_pretrained(base, str(adapter_dir))
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"{adapter_dir}: cannot load the adapter: {first}") from None
    return peft_model.merge_and_unload()


def export_merged(
    model: ModelConfig, gen: GenerationConfig, adapter_dir: Path, out_dir: Path
) -> MergedExport:
    """Merge ``adapter_dir`` into the base ``model`` and save it as a plain checkpoint that
    decodes as ``gen`` (the run's generation section)."""
    from essa.backends.models import load_model
    from essa.rundir import atomic_dir

    note = None
    model_cfg = model
    if model_cfg.quantization != "none":
        note = (
            f"merged into the full-precision base: the run used {model_cfg.quantization} "
            "weights, which cannot hold the merge exactly"
        )
        model_cfg = dataclasses.replace(model_cfg, quantization="none")
    elif model_cfg.gguf_file:
        note = "merged into the GGUF base as transformers dequantised it"
    model_cfg = dataclasses.replace(model_cfg, device="cpu")  # the merge needs no accelerator
    base, tokenizer = load_model(model_cfg)
    merged = merge_adapter(base, adapter_dir)
    merged.generation_config = generation_config(gen, tokenizer, merged.generation_config)
    with atomic_dir(out_dir) as tmp:
        merged.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
    dtype = str(next(merged.parameters()).dtype).removeprefix("torch.")
    return MergedExport(out_dir, adapter_dir, model.name_or_path, dtype, note)
