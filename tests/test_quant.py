"""Quantised (bitsandbytes int8 / int4) base weights: batched evaluation, QLoRA SFT, export, memory.

Everything runs on CPU (bitsandbytes >= 0.48) on the tiny in-process Qwen2 or the bundled demo
model. Tests that need bitsandbytes are skipped, with the reason, when it cannot be imported; the
missing-bitsandbytes message is tested by simulating the failed import.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from essa.config import AdapterConfig, EvaluationConfig, GenerationConfig, ModelConfig, SFTConfig
from tests.conftest import requires


def _bnb_missing_reason() -> str | None:
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # an optional-package notice
    try:
        import bitsandbytes  # noqa: F401
    except Exception as err:  # ImportError, or a native library that fails to load
        return f"bitsandbytes cannot be imported ({type(err).__name__}: {err})"
    return None


_MISSING = _bnb_missing_reason()
needs_bnb = requires("bnb", _MISSING)

PROMPTS = ["12+3=", "7+45=", "1+1=", "99+99="]
MODES = ["int8", "int4"]
# Relative tolerance (max |Δlogit| / max |logit|) per mode; see test_batched_matches_per_candidate.
RTOL = {"int4": 1e-4, "int8": 1e-3}


def _lora_on(model, seed: int = 1):  # type: ignore[no-untyped-def]
    """A PEFT LoRA on q/k/v/o with random non-zero B (a trained adapter's B is not zero)."""
    from essa.gradient.sft import make_lora_model

    peft_model = make_lora_model(model, AdapterConfig(rank=4, lora_alpha=8))
    gen = torch.Generator().manual_seed(seed)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=gen) * 0.3
    return peft_model


@pytest.fixture(scope="module", params=MODES)
def quantized(request, tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    """(mode, quantised base model, tokenizer, SVD adapter, population (4, D))."""
    if _MISSING is not None:
        pytest.skip(_MISSING)
    from essa.adapters import SVDAdapter
    from essa.backends.models import load_model

    model, tokenizer = load_model(
        ModelConfig(name_or_path=str(tiny_model_dir), quantization=request.param)
    )
    peft_model = _lora_on(model)
    adapter = SVDAdapter.from_peft_model(peft_model, alpha=1.0)
    population = np.random.default_rng(0).normal(size=(4, adapter.dim)) * adapter.stds() * 2.0
    return request.param, peft_model.unload(), tokenizer, adapter, population


def _masked_rel_diff(got: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> float:
    return float((got - ref)[mask].abs().max() / ref[mask].abs().max())


@needs_bnb
def test_batched_matches_per_candidate(quantized, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Population-batched logits equal per-candidate PEFT LoRAs on the same quantised base.

    Reference: each candidate exported to its own PEFT LoRA (A', B'), loaded on the *same*
    quantised model (PEFT's bnb LoRA layers) and applied to that candidate's rows with PEFT's
    mixed-batch ``adapter_names``. Both paths call the same bnb layers for W0·x on the same batch,
    so the quantised W0 contributes identically and the paths differ only in the order of the
    fp32 low-rank arithmetic (U_B(s_B ⊙ M(s_A ⊙ V_Aᵀx)) against B'(A'x)): ~1e-6 relative.

    Tolerances: int4 1e-4 relative (measured 2-3e-6). int8 1e-3 (measured 1e-5 to 6e-5):
    LLM.int8 rounds each activation row to fp16, then to int8 with a per-row scale, so a 1e-7
    difference entering a later layer can flip one rounding step and move that output by about
    one quantisation step of one element; still far below the spread between candidates (~1).
    The same reference built with the rows' batch composition matters for int8: with
    bitsandbytes' outlier threshold (6.0) the fp16 outlier columns are chosen over the whole
    batch, so one candidate run alone would differ by ~1e-2 from the same rows in a batch.
    """
    from peft import PeftModel

    from essa.adapters import PopulationLoRA, candidate_rows

    mode, model, tokenizer, adapter, population = quantized
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    rows = {k: v.repeat(len(population), 1) for k, v in batch.items()}  # candidate-major
    with torch.no_grad(), PopulationLoRA(model, adapter) as pop:
        pop.set_population(population)
        pop.set_rows(candidate_rows(len(population), len(PROMPTS)))
        got = model(**rows).logits  # (P*N, T, V)

    names = [f"c{c}" for c in range(len(population))]
    for name, vector in zip(names, population, strict=True):
        adapter.export_peft(vector, tmp_path / name)
    peft_model = PeftModel.from_pretrained(model, str(tmp_path / names[0]), adapter_name=names[0])
    for name in names[1:]:
        peft_model.load_adapter(str(tmp_path / name), adapter_name=name)
    peft_model.eval()
    try:
        with torch.no_grad():
            ref = peft_model(**rows, adapter_names=[n for n in names for _ in PROMPTS]).logits
    finally:
        peft_model.unload()  # the module fixture's base model is shared with later tests
    mask = rows["attention_mask"].bool()
    assert _masked_rel_diff(got, ref, mask) < RTOL[mode]
    assert torch.equal(got.argmax(-1)[mask], ref.argmax(-1)[mask])
    spread = (ref[: len(PROMPTS)] - ref[len(PROMPTS) : 2 * len(PROMPTS)]).abs().max()
    assert spread > 100 * RTOL[mode] * ref.abs().max(), "candidates should differ"


@needs_bnb
def test_evaluator_on_quantized_base_is_batched(quantized) -> None:  # type: ignore[no-untyped-def]
    """`auto` picks batched on int8/int4 weights and completions match the logits test's path;
    `merged` is refused with a one-line user error (and at config load)."""
    from essa.backends.evaluator import PopulationEvaluator
    from essa.config import ConfigError, load_config
    from essa.errors import UserError

    mode, model, tokenizer, adapter, population = quantized
    gen = GenerationConfig(max_new_tokens=4)
    evaluator = PopulationEvaluator(
        model, tokenizer, adapter, gen, EvaluationConfig(strategy="auto")
    )
    texts = evaluator.completions(population, PROMPTS)
    assert evaluator.chosen == {len(PROMPTS): "batched"}
    assert len(texts) == len(population) and all(len(t) == len(PROMPTS) for t in texts)
    assert "PopulationLinear" not in {type(m).__name__ for m in model.modules()}
    with pytest.raises(UserError, match="merged cannot fold"):
        PopulationEvaluator(model, tokenizer, adapter, gen, EvaluationConfig(strategy="merged"))
    with pytest.raises(ConfigError, match="merged cannot fold"):
        load_config(None, [f"model.quantization={mode}", "evaluation.strategy=merged"])


def _packed_layers(model) -> int:  # type: ignore[no-untyped-def]
    return sum(
        bool(getattr(getattr(m.weight, "quant_state", None), "packing_format_for_cpu", False))
        for m in model.modules()
        if hasattr(m, "weight")
    )


@needs_bnb
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("repacked", [False, True], ids=["load_model", "bnb-cpu-repacking"])
def test_qlora_sft_after_no_grad_eval(tiny_model_dir: Path, mode: str, repacked: bool) -> None:
    """The infra.md §4 pitfall: an eval forward under no_grad, then SFT on the quantised base.

    ``repacked`` turns bnb's CPU inference repacking back on (as for a model not loaded through
    load_model); on CPUs with AVX512-BF16 the eval pass then repacks the 4-bit weights and
    train_sft must undo it. Elsewhere that case runs like the first.
    """
    from essa.backends.models import load_model
    from essa.gradient.sft import make_lora_model, train_sft
    from essa.types import Example

    model, tokenizer = load_model(ModelConfig(name_or_path=str(tiny_model_dir), quantization=mode))
    if repacked:
        from bitsandbytes.nn import modules as bnb_modules

        for module in model.modules():
            if hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = bnb_modules.has_avx512bf16()
    peft_model = make_lora_model(model, AdapterConfig(rank=4, lora_alpha=8))
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    peft_model.eval()
    with torch.no_grad():
        peft_model(**batch)
    if repacked and mode == "int4":
        from bitsandbytes.nn import modules as bnb_modules

        # On this CPU the pitfall is live: the eval pass has repacked every 4-bit layer.
        assert (_packed_layers(peft_model) > 0) == bnb_modules.has_avx512bf16()
    else:
        assert _packed_layers(peft_model) == 0
    examples = [Example(prompt=p, answer=str(eval(p[:-1]))) for p in PROMPTS]  # noqa: S307
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    losses = train_sft(
        peft_model, tokenizer, examples, PROMPTS, SFTConfig(steps=2, batch_size=4, lr=1e-2), 0
    )
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert _packed_layers(peft_model) == 0
    changed = [n for n, p in peft_model.named_parameters() if n in before]
    assert any(not torch.equal(dict(peft_model.named_parameters())[n], before[n]) for n in changed)


@needs_bnb
@pytest.mark.parametrize("quantized", ["int4"], indirect=True)  # export reads only the SVD factors
def test_export_from_int4_loads_on_fp32_base(quantized, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The exported candidate is a plain PEFT LoRA: on the fp32 base it adds gamma·B'A'."""
    from peft import PeftModel

    from essa.adapters import merged_candidate
    from essa.backends.models import load_model

    _, model, tokenizer, adapter, population = quantized
    out = adapter.export_peft(population[0], tmp_path / "adapter", base_model_name_or_path="x")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA"
    base_path = model.config._name_or_path
    fp32, _ = load_model(ModelConfig(name_or_path=base_path))
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad(), merged_candidate(fp32, adapter, population[0]):
        ref = fp32(**batch).logits
    peft_model = PeftModel.from_pretrained(fp32, str(out)).eval()
    assert all(p.is_floating_point() for p in peft_model.parameters())
    with torch.no_grad():
        got = peft_model(**batch).logits
    # fp32 on both sides; merged (W0 + gamma·B'A' rounded once) against unmerged (W0x + B'(A'x))
    # differ only in summation order: 1e-6 to 3e-5 relative measured, across thread counts.
    assert _masked_rel_diff(got, ref, batch["attention_mask"].bool()) < 1e-4


@needs_bnb
def test_model_bytes_int4_at_most_035_of_fp32() -> None:
    """Quantised layers (every *_proj of the demo model) in packed storage plus their scales."""
    from essa.backends.memory import model_bytes
    from essa.backends.models import load_model

    sizes = {}
    for mode in ("none", "int8", "int4"):
        model, _ = load_model(ModelConfig(quantization=mode))
        names = [n for n, _ in model.named_modules() if n.endswith("_proj")]
        sizes[mode] = sum(model_bytes(model.get_submodule(n)) for n in names)
        if mode == "int4":
            assert all(type(model.get_submodule(n)).__name__ == "Linear4bit" for n in names), (
                "every projection should be quantised"
            )
    assert sizes["int4"] <= 0.35 * sizes["none"]
    assert sizes["int8"] <= 0.30 * sizes["none"]


def test_missing_bitsandbytes_is_one_line_exit_2(tmp_path: Path) -> None:
    """Simulated absence: ``sys.modules['bitsandbytes'] = None`` makes its import fail, then the
    real CLI runs; the user gets one line naming the extra to install, and exit code 2."""
    code = (
        "import sys; sys.modules['bitsandbytes'] = None\n"
        "from essa.cli import main\n"
        "sys.exit(main())"
    )
    args = ["eval", "--set", "model.quantization=int4", "--set", "data.test_size=4"]
    res = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=tmp_path,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert lines == [
        "error: model.quantization=int4 needs bitsandbytes: pip install 'essa-align[quant]'"
    ]


def test_missing_bitsandbytes_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same check without the CLI, for API users; simulated with a None sys.modules entry."""
    from essa.backends.models import load_model
    from essa.errors import UserError

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(
        UserError, match=r"int8 needs bitsandbytes: pip install 'essa-align\[quant\]'"
    ):
        load_model(ModelConfig(quantization="int8"))


@needs_bnb
def test_unsupported_device_fails_before_loading() -> None:
    from essa.backends.models import load_model
    from essa.errors import UserError

    with pytest.raises(UserError, match="bitsandbytes does not run on meta"):
        load_model(ModelConfig(quantization="int4", device="meta"))


@needs_bnb
@pytest.mark.slow
def test_train_int4_end_to_end_records_memory(tmp_path: Path) -> None:
    """`essa train --set model.quantization=int4`: SFT on the 4-bit base, batched ESSA, memory in
    summary.json and the baseline record, and an adapter that loads on the fp32 base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from essa.backends.models import resolve_model_path

    run_dir = tmp_path / "run"
    small = [
        "model.quantization=int4",
        "sft.steps=2",
        "data.sft_size=16",
        "data.batch_size=8",
        "data.test_size=24",
        "optimizer.population_size=4",
        "evaluation.every=0",
        "evaluation.use_scale_baseline=false",
        "run.generations=2",
        "run.show_progress=false",
    ]
    sets = [arg for item in small for arg in ("--set", item)]
    res = subprocess.run(
        [sys.executable, "-m", "essa.cli", "train", "--run-dir", str(run_dir), *sets],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "kernels" not in res.stderr  # bnb's optional-package notice is silenced
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    baseline = next(r for r in records if r.get("event") == "baseline")
    for record in (summary, baseline):
        assert record["peak_rss_mb"] > 0
        assert 0 < record["model_bytes"] < 2_000_000  # the fp32 demo model holds 10.5 MB
    assert {r["strategy"] for r in records if r.get("generation", -1) >= 0} == {"batched"}
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin:demo"))
    model = PeftModel.from_pretrained(base, summary["adapter_dir"])
    assert sum("lora_A" in n for n, _ in model.named_parameters()) > 0
