"""One adapter, one held-out score: ESSA's held-out pass, GRPO's and ``essa eval`` agree item by
item, in bfloat16 as in float32.

bf16 rounds every sum to 8 bits, so two computations of the same adapter that differ only in
rounding order (the LoRA term's factor form, the batch a row sits in, a prefix cache) turn
near-tied greedy tokens the other way. Before the held-out path was shared, the bundled demo
model in bf16 with the adapter below gave different completions on 6 of these 96 items for the
SFT adapter and on 4 for an exported candidate (0 in float32).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from essa.config import GenerationConfig
from tests.cli_runner import essa

ITEMS = 96
SETS = [f"data.test_size={ITEMS}", "generation.max_new_tokens=16"]


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A rank-8 LoRA on the demo model with large random B: its greedy tokens are often near
    ties, where a rounding difference shows."""
    from essa.backends.models import load_model
    from essa.config import load_config
    from essa.gradient.sft import make_lora_model

    cfg = load_config(None, SETS)
    model, _ = load_model(cfg.model)
    peft_model = make_lora_model(model, cfg.adapter)
    gen = torch.Generator().manual_seed(1)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            param.data = 0.5 * torch.randn(param.shape, generator=gen)
    out = tmp_path_factory.mktemp("sft") / "adapter"
    peft_model.save_pretrained(str(out))
    return out


def essa_eval_completions(adapter: Path, dtype: str, out: Path) -> list[str]:
    """Per-item completions of ``essa eval --adapter`` (its items file)."""
    sets = [arg for s in [*SETS, f"model.dtype={dtype}"] for arg in ("--set", s)]
    res = essa("eval", "--adapter", str(adapter), "--output", str(out / "eval.json"), *sets)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = (out / "eval.items.jsonl").read_text().splitlines()
    return [json.loads(line)["completion"] for line in lines]


class EssaHeldout:
    """ESSA's held-out pass as the recipe builds it: the SFT adapter in SVD form over the bare
    base model, one greedy candidate through the population evaluator."""

    def __init__(self, sft: Path, dtype: str) -> None:
        from essa.adapters.svd import svd_adapter
        from essa.backends.evaluator import PopulationEvaluator
        from essa.backends.models import load_model
        from essa.config import load_config
        from essa.data.task import load_task, render_splits
        from essa.setup import load_peft_adapter

        cfg = load_config(None, [*SETS, f"model.dtype={dtype}"])
        model, tokenizer = load_model(cfg.model)
        task = load_task(cfg.data, cfg.run.seed)
        _, self.prompts = render_splits(task, cfg.data, tokenizer)
        self.peft_model = load_peft_adapter(model, str(sft), "--adapter").eval()
        self.adapter = svd_adapter(self.peft_model, cfg.adapter.alpha)
        self.cfg, self.tokenizer = cfg, tokenizer
        self.evaluator = PopulationEvaluator(
            self.peft_model.unload(), tokenizer, self.adapter, cfg.generation, cfg.evaluation
        )

    def completions(self, vector: np.ndarray) -> list[str]:
        (texts,) = self.evaluator.completions(vector[None, :], self.prompts, greedy=True)
        return texts

    def candidate(self) -> np.ndarray:
        """A searched point: offsets of 0.3 x the SFT singular values."""
        noise = np.random.default_rng(3).normal(size=self.adapter.dim)
        return 0.3 * noise * self.adapter.stds()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_essa_heldout_and_essa_eval_give_the_same_completions(
    sft_dir: Path, tmp_path: Path, dtype: str
) -> None:
    """The SFT adapter (ESSA's baseline) and an exported candidate (ESSA's final score), each
    scored by ESSA's held-out pass and by ``essa eval`` on its PEFT directory: every item's
    completion is the same string."""
    heldout = EssaHeldout(sft_dir, dtype)
    assert heldout.evaluator.half == (dtype == "bfloat16")
    baseline = heldout.completions(np.zeros(heldout.adapter.dim))
    (tmp_path / "sft").mkdir()
    assert essa_eval_completions(sft_dir, dtype, tmp_path / "sft") == baseline
    point = heldout.candidate()
    final = heldout.completions(point)
    assert final != baseline  # the candidate is another model: the comparison says something
    exported = heldout.adapter.export_peft(point, tmp_path / "final" / "adapter")
    assert essa_eval_completions(exported, dtype, tmp_path / "final") == final


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gradient_heldout_path_scores_a_peft_model_as_essa_does(sft_dir: Path, dtype: str) -> None:
    """GRPO's held-out pass hands its PeftModel to heldout_completions: it decodes the LoRA as
    ESSA's held-out pass decodes the same adapter's SVD form at a zero offset."""
    from essa.backends.evaluator import heldout_completions
    from essa.backends.models import load_model
    from essa.setup import load_peft_adapter

    heldout = EssaHeldout(sft_dir, dtype)
    model, tokenizer = load_model(heldout.cfg.model)
    peft_model = load_peft_adapter(model, str(sft_dir), "--adapter").eval()
    texts, _ = heldout_completions(
        peft_model,
        tokenizer,
        heldout.prompts,
        heldout.cfg.generation,
        micro_batch_size=heldout.cfg.evaluation.micro_batch_size,
    )
    assert texts == heldout.completions(np.zeros(heldout.adapter.dim))
    # The PEFT layers are back: the model is the PeftModel it was.
    assert all(hasattr(peft_model.get_submodule(n), "lora_A") for n in _lora_names(peft_model))


def _lora_names(peft_model: torch.nn.Module) -> list[str]:
    return [name for name, module in peft_model.named_modules() if hasattr(module, "lora_A")]


PROMPTS = ["12+3=", "7+45=", "1+1=", "99+99=", "5+60="]  # lengths differ: rows get reordered


def test_heldout_completions_come_back_in_prompt_order(tiny_lora) -> None:  # type: ignore[no-untyped-def]
    """Rows run shortest first; each completion is returned at its prompt's place, the same
    text as generating that prompt alone (float32, where row order changes no token)."""
    from essa.backends.evaluator import heldout_completions
    from essa.backends.generate import generate_texts

    peft_model, tokenizer = tiny_lora
    gen = GenerationConfig(max_new_tokens=6)
    texts, _ = heldout_completions(peft_model, tokenizer, PROMPTS, gen, micro_batch_size=2)
    alone = [
        generate_texts(peft_model, tokenizer, [p], gen, micro_batch_size=1)[0][0] for p in PROMPTS
    ]
    assert texts == alone
    assert len(set(texts)) > 1  # the prompts get different completions: the order is checked


def test_a_lora_layer_that_is_not_plain_runs_as_peft_computes_it(tiny_model_dir: Path) -> None:
    """A DoRA adapter is not W0 x + s B (A x): it is read as no factors and decoded by PEFT's
    own layers, not scored as a plain LoRA of its A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from essa.adapters.population import peft_factors
    from essa.backends.evaluator import heldout_completions
    from essa.backends.generate import generate_texts

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True)
    dora = get_peft_model(base, lora).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in dora.named_parameters():
            if "lora_B" in name or "magnitude" in name:
                param.add_(0.5 * torch.randn(param.shape, generator=generator))
    _, factors = peft_factors(dora)
    assert factors == {}
    gen = GenerationConfig(max_new_tokens=6)
    texts, _ = heldout_completions(dora, tokenizer, PROMPTS, gen, micro_batch_size=8)
    alone = [generate_texts(dora, tokenizer, [p], gen, micro_batch_size=1)[0][0] for p in PROMPTS]
    assert texts == alone
