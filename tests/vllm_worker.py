"""Run by tests/test_vllm.py with the vLLM venv's python (.venv-vllm): one engine, JSON out.

    python tests/vllm_worker.py REQUEST.json

REQUEST holds ``model`` (a directory), ``adapter`` (a PEFT LoRA directory), ``alpha``,
``prompts``, ``populations`` (a list of (P, D) lists, evaluated one after the other on the same
engine and slots), ``max_new_tokens`` and ``out``; the worker writes ``completions``
([population][candidate][prompt]), ``logprobs`` (same nesting, per token), ``nonfinite`` and
timings to ``out`` (vLLM logs to stdout, so the result goes to a file).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(request_path: str) -> None:
    import numpy as np
    from peft import PeftModel

    from essa.adapters import SVDAdapter
    from essa.backends.models import load_model
    from essa.backends.vllm import VLLMEvaluator
    from essa.config import load_config
    from essa.setup import evaluator_settings

    request = json.loads(Path(request_path).read_text())
    populations = [np.asarray(p, dtype=np.float64) for p in request["populations"]]
    slots = max(len(p) for p in populations)
    cfg = load_config(
        None,
        [
            "backend=vllm",
            f"model.name_or_path={request['model']}",
            f"generation.max_new_tokens={request['max_new_tokens']}",
            f"optimizer.population_size={slots}",
        ],
    )
    model, tokenizer = load_model(cfg.model)
    peft_model = PeftModel.from_pretrained(model, request["adapter"])
    adapter = SVDAdapter.from_peft_model(peft_model, alpha=request["alpha"])
    del model, peft_model
    start = time.perf_counter()
    settings = evaluator_settings(cfg)
    evaluator = VLLMEvaluator(settings, adapter, tokenizer, request["model"], slots=slots)
    init_seconds = time.perf_counter() - start
    completions, logprobs, nonfinite = [], [], []
    start = time.perf_counter()
    for population in populations:
        completions.append(evaluator.completions(population, request["prompts"]))
        logprobs.append(evaluator.last_logprobs)
        nonfinite.append(evaluator.nonfinite.tolist())
    result = {
        "completions": completions,
        "logprobs": logprobs,
        "nonfinite": nonfinite,
        "init_seconds": init_seconds,
        "eval_seconds": time.perf_counter() - start,
        "load_seconds": evaluator.load_seconds,
        "new_tokens": evaluator.stats.new_tokens,
    }
    evaluator.close()
    Path(request["out"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
