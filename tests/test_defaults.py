"""The defaults split: the schema suits a real chat model, builtin:demo keeps the demo's values,
and a real model with a tiny SFT of its own gets one warning line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from essa.config import Config, load_config, tiny_sft_warning
from essa.config.loader import DEMO_DEFAULTS
from tests.cli_runner import essa

ROOT = Path(__file__).resolve().parent.parent
REAL = "model.name_or_path=HuggingFaceTB/SmolLM2-135M-Instruct"


def values(cfg: Config) -> dict[str, object]:
    return {k: getattr(getattr(cfg, k.split(".")[0]), k.split(".")[1]) for k in DEMO_DEFAULTS}


def test_demo_keeps_its_values() -> None:
    expected = dict(DEMO_DEFAULTS)
    assert expected == {
        "sft.steps": 4,
        "sft.batch_size": 100,
        "optimizer.sigma0": 1.0,
        "data.template": "raw",
        "data.sft_size": 100,
        "generation.max_new_tokens": 8,
        "evaluation.use_scale_baseline": True,
    }
    assert values(load_config(None)) == expected
    assert values(load_config(None, ["run.generations=3", "data.batch_size=8"])) == expected
    assert values(load_config(ROOT / "configs" / "demo.yaml")) == expected
    grpo = load_config(ROOT / "configs" / "grpo_demo.yaml")
    assert values(grpo) == expected and grpo.algorithm == "grpo"


def test_real_model_gets_schema_defaults() -> None:
    cfg = load_config(None, [REAL])
    assert values(cfg) == values(Config())
    assert cfg.generation.max_new_tokens == "auto" and cfg.optimizer.sigma0 == 0.1
    assert cfg.data.template == "auto" and cfg.evaluation.use_scale_baseline is False
    assert cfg.sft.steps * cfg.sft.batch_size >= cfg.data.sft_size  # at least one pass


def test_explicit_values_win_on_the_demo(tmp_path: Path) -> None:
    cfg = load_config(None, ["generation.max_new_tokens=12", "optimizer.sigma0=0.5"])
    assert cfg.generation.max_new_tokens == 12 and cfg.optimizer.sigma0 == 0.5
    assert cfg.sft.steps == 4  # the rest stays the demo's
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  name_or_path: /models/x\nsft:\n  steps: 4\n")
    real = load_config(path)
    assert real.sft.steps == 4 and real.generation.max_new_tokens == "auto"


def test_the_demo_defaults_taken_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="essa.config"):
        load_config(None, ["optimizer.sigma0=0.5"])
        load_config(None, [REAL])
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "builtin:demo: keys left unset take the model's own defaults: sft.steps=4, "
        "sft.batch_size=100, data.template=raw, data.sft_size=100, generation.max_new_tokens=8, "
        "evaluation.use_scale_baseline=True"
    ]


def test_tiny_sft_warning() -> None:
    assert tiny_sft_warning(load_config(None)) is None  # the demo's tiny SFT is the point
    line = tiny_sft_warning(load_config(None, [REAL, "sft.steps=4"]))
    assert line is not None and line.startswith("warning: sft.steps=4") and "\n" not in line
    assert tiny_sft_warning(load_config(None, [REAL])) is None
    assert tiny_sft_warning(load_config(None, [REAL, "sft.steps=4", "adapter.path=/a"])) is None
    one_pass_short = [REAL, "sft.steps=30", "sft.batch_size=2", "data.sft_size=1000"]
    assert tiny_sft_warning(load_config(None, one_pass_short)) is not None


def test_train_warns_once_on_stderr(tmp_path: Path, tiny_model_dir: Path) -> None:
    sets = [
        f"model.name_or_path={tiny_model_dir}",
        "sft.steps=2",
        "data.sft_size=8",
        "data.test_size=4",
        "data.batch_size=2",
        "optimizer.population_size=2",
        "generation.max_new_tokens=2",
        "run.generations=0",
        "evaluation.every=0",
        "run.show_progress=false",
    ]
    args = [a for s in sets for a in ("--set", s)]
    res = essa("train", "--run-dir", str(tmp_path / "run"), *args, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.count("warning: sft.steps=2") == 1


@pytest.mark.parametrize("template", ["auto"])
def test_auto_template_follows_the_tokenizer(template: str) -> None:
    from essa.data.templates import render_prompt
    from tests.conftest import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    assert render_prompt(template, "1+1=", tokenizer) == "1+1="  # no chat template: raw
    tokenizer.chat_template = "{% for m in messages %}<{{ m.content }}>{% endfor %}"
    assert render_prompt(template, "1+1=", tokenizer) == "<1+1=>"
