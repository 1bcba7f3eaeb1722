"""essa export RUN_DIR --merged OUT: a plain HF checkpoint whose greedy completions equal the
base + PEFT adapter's, on the bundled demo model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.cli_runner import essa

SMALL = [
    "sft.steps=4",
    "data.sft_size=32",
    "data.batch_size=8",
    "data.test_size=16",
    "optimizer.population_size=4",
    "run.generations=2",
    "evaluation.every=0",
    "evaluation.use_scale_baseline=false",
    "run.show_progress=false",
]
PROMPTS = ["12+30=", "7+8=", "45+54=", "99+1=", "3+4=", "60+25="]


def greedy(model: torch.nn.Module, tokenizer: object, prompts: list[str]) -> list[str]:
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(
            **batch, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )  # (B, T + 6)
    return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("export") / "run"
    res = essa("train", "--run-dir", str(run_dir), *[a for s in SMALL for a in ("--set", s)])
    assert res.returncode == 0, res.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_merged_model_matches_adapter(run_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from essa.backends.models import resolve_model_path

    out = tmp_path / "merged"
    res = essa("export", str(run_dir), "--merged", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    assert str(out) in res.stdout
    files = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json"} <= files
    assert not any("adapter" in name for name in files)  # no PEFT left
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["do_sample"] is False and generation["max_new_tokens"] == 8

    tokenizer = AutoTokenizer.from_pretrained(out)
    merged = AutoModelForCausalLM.from_pretrained(out).eval()  # transformers alone
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin:demo"))
    with_adapter = PeftModel.from_pretrained(base, str(run_dir / "adapter")).eval()
    expected = greedy(with_adapter, tokenizer, PROMPTS)
    assert greedy(merged, tokenizer, PROMPTS) == expected
    plain = AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin:demo")).eval()
    deltas = [
        (a - b).abs().max().item()
        for a, b in zip(merged.state_dict().values(), plain.state_dict().values(), strict=True)
    ]
    assert max(deltas) > 0  # the adapter really is in the weights


def test_export_refusals(run_dir: Path, tmp_path: Path) -> None:
    res = essa("export", str(tmp_path), "--merged", str(tmp_path / "m"))
    assert res.returncode == 2 and "not a run directory" in res.stderr
    (tmp_path / "m").mkdir()
    res = essa("export", str(run_dir), "--merged", str(tmp_path / "m"))
    assert res.returncode == 2 and "pass --overwrite" in res.stderr
    res = essa("export", str(run_dir), "--merged", str(tmp_path / "n"), "--adapter", str(tmp_path))
    assert res.returncode == 2 and "not a PEFT adapter directory" in res.stderr
    assert res.stderr.count("\n") == 1


def test_quantised_base_merges_into_full_precision(run_dir: Path, tmp_path: Path) -> None:
    from essa.backends.merge_export import export_merged
    from essa.config import load_config

    cfg = load_config(run_dir / "config.yaml", ["model.quantization=int8"])
    result = export_merged(cfg.model, cfg.generation, run_dir / "adapter", tmp_path / "merged")
    assert result.note is not None and "full-precision base" in result.note
    assert result.dtype == "float32"


def test_merged_model_stops_where_generation_stops(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A model with its own end-of-turn id (generation_config.eos_token_id: [1, 5], the
    tokenizer's EOS being 1): the merged checkpoint stops on both, as the run's generation did."""
    import shutil

    from essa.backends.merge_export import export_merged
    from essa.backends.models import load_model
    from essa.backends.stops import stop_token_ids
    from essa.config import AdapterConfig, load_config
    from essa.gradient.sft import make_lora_model

    model_dir = tmp_path / "chat-model"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(
        json.dumps({**config, "eos_token_id": [1, 5]})
    )
    cfg = load_config(None, [f"model.name_or_path={model_dir}"])
    model, tokenizer = load_model(cfg.model)
    stops = stop_token_ids(tokenizer, model.generation_config)  # what generate_texts stops on
    assert stops == [1, 5]
    peft_model = make_lora_model(model, AdapterConfig(rank=2))
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    export_merged(cfg.model, cfg.generation, tmp_path / "adapter", tmp_path / "merged")
    saved = json.loads((tmp_path / "merged" / "generation_config.json").read_text())
    assert saved["eos_token_id"] == stops
