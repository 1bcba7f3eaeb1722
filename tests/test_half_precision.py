"""bf16 on CPU: candidates stay apart and match an fp32 reference; merged is refused in bf16.

bf16 keeps 8 significant bits (a step of 2^-8, about 0.4%, of a value). Stored in bf16, two
candidates whose singular values differ by less than that are the same model; the batched
path keeps them (and the whole candidate path) in float32 and rounds once per linear.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from essa.adapters import PopulationLoRA, SVDAdapter, candidate_rows, merged_candidate
from essa.config import EvaluationConfig, GenerationConfig
from essa.errors import UserError
from tests.conftest import svd_setup

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module, SVDAdapter]:
    """(fp32 base, bf16 copy of it, SVDAdapter of a random rank-4 LoRA with non-zero B)."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    base = Qwen2ForCausalLM(config).eval()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)
    peft_model = get_peft_model(copy.deepcopy(base), lora).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.2 * torch.randn(parameter.shape, generator=generator))
    adapter = SVDAdapter.from_peft_model(peft_model, alpha=1.0)
    return base, copy.deepcopy(base).to(torch.bfloat16), adapter


IDS = torch.tensor([[0, 0, 5, 17, 33, 9, 41], [11, 23, 7, 64, 3, 99, 12]])  # (2, 7)
MASK = (IDS != 0).long()


@torch.no_grad()
def batched_logits(model: torch.nn.Module, adapter: SVDAdapter, x: np.ndarray) -> torch.Tensor:
    """Logits (P * 2, T, V) in float32 of the two prompts under each of the P candidates."""
    with PopulationLoRA(model, adapter) as pop:
        pop.set_population(x)
        pop.set_rows(candidate_rows(len(x), 2))
        out = model(input_ids=IDS.repeat(len(x), 1), attention_mask=MASK.repeat(len(x), 1))
    return out.logits.float()


def candidates(adapter: SVDAdapter, relative: float) -> np.ndarray:
    """Two candidates (2, D) whose offsets differ by ``relative`` x the SFT singular values."""
    first = np.random.default_rng(2).normal(size=adapter.dim) * 0.3 * adapter.stds()
    return np.stack([first, first + relative * adapter.stds()])


@pytest.mark.parametrize("relative", [1e-3, 1e-4])
def test_close_candidates_stay_apart_in_bf16(models, relative: float) -> None:  # type: ignore[no-untyped-def]
    """Singular values stored in bf16 made 1e-4-relative candidates bit-identical models."""
    _, bf16, adapter = models
    logits = batched_logits(bf16, adapter, candidates(adapter, relative))
    assert not torch.equal(logits[:2], logits[2:])
    with PopulationLoRA(bf16, adapter) as pop:
        pop.set_population(candidates(adapter, relative))
        pop.set_rows([0, 1])
        layer = bf16.get_submodule(adapter.module_names[0])
        assert layer.scale_a.dtype == layer.basis_a.dtype == torch.float32
        assert bool((layer.scale_a[0] != layer.scale_a[1]).all())


def test_bf16_batched_matches_fp32_reference(models) -> None:  # type: ignore[no-untyped-def]
    """Tolerance: no worse than plain bf16 inference of the same candidate merged into W.

    The residual stream itself is bf16, so the logits carry bf16 rounding amplified through
    the layers (here up to ~0.02 on logits of scale ~0.6) whatever the adapter path does. The
    reference for "how close can bf16 get" is W0 + dW rounded to bf16 (what PEFT's merged
    bf16 model computes); batched must stay within 1.25x its mean and 2x its max error.
    """
    fp32, bf16, adapter = models
    x = candidates(adapter, 1e-3)
    reference = batched_logits(fp32, adapter, x)  # fp32 path, fp32 model
    error = (batched_logits(bf16, adapter, x) - reference).abs()
    merged_errors = []
    for c, vector in enumerate(x):
        merged = copy.deepcopy(fp32)
        with torch.no_grad():
            for name, delta in adapter.delta_weights(vector).items():
                merged.get_submodule(name).weight.add_(delta)
            logits = merged.to(torch.bfloat16)(input_ids=IDS, attention_mask=MASK).logits
        merged_errors.append(logits.float() - reference[2 * c : 2 * c + 2])
    merged_error = torch.cat(merged_errors).abs()
    assert error.mean() <= 1.25 * merged_error.mean()
    assert error.max() <= 2 * merged_error.max()
    assert error.max() <= 0.05


def test_fp32_path_unchanged_for_fp32_models(models) -> None:  # type: ignore[no-untyped-def]
    fp32, _, adapter = models
    with PopulationLoRA(fp32, adapter) as pop:
        assert pop.path_dtype == torch.float32
        pop.set_population(candidates(adapter, 1e-3))
        pop.set_rows([0, 1])
        assert fp32.get_submodule(adapter.module_names[0]).scale_a.dtype == torch.float32


def test_merged_candidate_refuses_bf16(models) -> None:  # type: ignore[no-untyped-def]
    _, bf16, adapter = models
    before = {k: v.clone() for k, v in bf16.state_dict().items()}
    with (
        pytest.raises(TypeError, match="half"),
        merged_candidate(bf16, adapter, np.zeros(adapter.dim)),
    ):
        pass
    assert all(torch.equal(bf16.state_dict()[k], v) for k, v in before.items())


@pytest.fixture(scope="module")
def bf16_setup(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    model, tokenizer, adapter = svd_setup(tiny_model_dir)
    return model.to(torch.bfloat16), tokenizer, adapter


def test_evaluator_refuses_merged_and_auto_is_batched_in_bf16(bf16_setup, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from essa.backends.evaluator import PopulationEvaluator

    model, tokenizer, adapter = bf16_setup
    gen = GenerationConfig(max_new_tokens=4)
    with pytest.raises(UserError, match="half precision"):
        PopulationEvaluator(model, tokenizer, adapter, gen, EvaluationConfig(strategy="merged"))
    auto = PopulationEvaluator(model, tokenizer, adapter, gen, EvaluationConfig(strategy="auto"))
    monkeypatch.setattr(auto, "_merged", lambda *a: pytest.fail("auto ran merged in bf16"))
    x = np.random.default_rng(0).normal(size=(3, adapter.dim)) * adapter.stds()
    prompts = ["12+3=", "7+45="]
    out = auto.completions(x, prompts)
    assert auto.chosen == {len(prompts): "batched"}
    assert len(out) == 3 and all(len(c) == len(prompts) for c in out)


@pytest.mark.parametrize(("avx512_bf16", "amx", "chosen"), [
    (True, False, "bfloat16"), (False, True, "bfloat16"), (False, False, "float32"),
])  # fmt: skip
def test_fast_dtype_is_bf16_only_on_a_cpu_that_multiplies_it(  # type: ignore[no-untyped-def]
    monkeypatch, tiny_model_dir: Path, avx512_bf16: bool, amx: bool, chosen: str
) -> None:
    """``model.dtype: fast`` loads the base in bfloat16 where the CPU has bf16 matmul
    instructions and in float32 where they would be emulated. The CPU's answer is what cannot
    be chosen here, so the two flags torch reads are set."""
    from essa.backends.models import dtype_choice, load_model
    from essa.config import ModelConfig

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    cfg = ModelConfig(name_or_path=str(tiny_model_dir), dtype="fast", device="cpu")
    model, _ = load_model(cfg)
    assert {p.dtype for p in model.parameters()} == {getattr(torch, chosen)}
    line = dtype_choice(cfg)
    assert line is not None and line.startswith(f"model.dtype fast: {chosen} ")
    assert dtype_choice(ModelConfig(dtype="bfloat16")) is None  # only fast is announced
