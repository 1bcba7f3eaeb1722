"""Config schema: strict loading, error messages with file:line:key, overrides, shipped configs."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest
import yaml

from essa.config import Config, ConfigError, dump_config, load_config
from essa.config.loader import DEMO_DEFAULTS
from tests.cli_runner import essa

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted(ROOT.glob("configs/**/*.yaml"))


def test_shipped_configs_found_and_valid() -> None:
    # Recursive glob with an asserted count, so a moved or skipped file is noticed.
    assert len(SHIPPED) == 11, [str(p) for p in SHIPPED]
    for path in SHIPPED:
        load_config(path)


def test_default_config_is_demo() -> None:
    cfg = load_config(None)
    assert cfg.model.name_or_path == "builtin:demo"
    assert cfg == load_config(ROOT / "configs" / "demo.yaml")
    # The schema's defaults are a real model's; the demo's own values fill in for builtin:demo.
    assert cfg == replace_keys(Config(), DEMO_DEFAULTS)


def replace_keys(cfg: Config, values: dict[str, object]) -> Config:
    import dataclasses

    for dotted, value in values.items():
        section, key = dotted.split(".")
        part = dataclasses.replace(getattr(cfg, section), **{key: value})
        cfg = dataclasses.replace(cfg, **{section: part})
    return cfg


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_unknown_key_names_file_line_and_path(tmp_path: Path) -> None:
    path = write(tmp_path, "model:\n  dtype: float32\noptimizer:\n  sigma: 0.2\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}:4: optimizer.sigma: unknown key")
    assert "sigma0" in msg  # lists the known keys


def test_unknown_section(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r":1: trainer: unknown key"):
        load_config(write(tmp_path, "trainer: {}\n"))


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (
            "optimizer:\n  population_size: many\n",
            ":2: optimizer.population_size: expected an integer",
        ),
        ("optimizer:\n  sigma0: [1]\n", ":2: optimizer.sigma0: expected a number"),
        ("run:\n  show_progress: 1\n", ":2: run.show_progress: expected true/false"),
        (
            "optimizer:\n  name: adam\n",
            ":2: optimizer.name: expected one of 'cma_es' | 'openai_es' | 'snes', got 'adam'",
        ),
        ("adapter:\n  target_modules: q_proj\n", ":2: adapter.target_modules: expected a list"),
        ("model: 3\n", ":1: model: expected a mapping"),
        ("optimizer:\n  population_size: 0\n", ":2: optimizer.population_size: must be >= 2"),
        ("optimizer:\n  population_size: 1\n", ":2: optimizer.population_size: must be >= 2"),
        ("run:\n  seed: -1\n", ":2: run.seed: must be an integer in [0, 4294967295], got -1"),
        ("run:\n  seed: 4294967296\n", ":2: run.seed: must be an integer in [0, 4294967295]"),
        ("generation:\n  top_p: 0\n", ":2: generation.top_p: must be in (0, 1], got 0.0"),
        ("generation:\n  top_p: -0.5\n", ":2: generation.top_p: must be in (0, 1]"),
        ("generation:\n  top_p: 1.5\n", ":2: generation.top_p: must be in (0, 1]"),
        ("run:\n  max_wall_seconds: 0\n", ":2: run.max_wall_seconds: must be > 0"),
        ("model:\n  num_threads: 0\n", ":2: model.num_threads: must be >= 1"),
        ("sft:\n  weight_decay: -1\n", ":2: sft.weight_decay: must be >= 0"),
        ("adapter:\n  lora_alpha: 0\n", ":2: adapter.lora_alpha: must be > 0"),
        # checked whatever the algorithm/backend: a value out of range is a typo even if unused
        ("scalebio:\n  lr: -1\n", ":2: scalebio.lr: must be > 0"),
        ("vllm:\n  gpu_memory_utilization: 2\n", ":2: vllm.gpu_memory_utilization: must be in"),
        ("dpo:\n  max_grad_norm: -1\n", ":2: dpo.max_grad_norm: must be >= 0, got -1.0"),
        ("data:\n  train_size: 0\n", ":2: data.train_size: must be >= 1 or null, got 0"),
        (
            "optimizer:\n  name: openai_es\n  escape_flat_reward: true\n",
            ":3: optimizer.escape_flat_reward: applies to cma_es, not openai_es (openai_es's own "
            "keys: lr, step)",
        ),
        (
            "optimizer:\n  layerwise:\n    active_layers: 1\n  escape_flat_reward: true\n",
            ":4: optimizer.escape_flat_reward: applies to cma_es without layerwise",
        ),
        ("optimizer:\n  lr: 0.5\n", ":2: optimizer.lr: applies to openai_es, not cma_es"),
        ("optimizer:\n  name: snes\n  eta_sigma: 0\n", ":3: optimizer.eta_sigma: must be > 0"),
        ("optimizer:\n  mirrored: true\n  population_size: 5\n", "mirrored pairs need an even"),
        (
            "adapter:\n  rank: 8\n  alpha: 0.1\n",
            ":3: adapter.alpha: 0.1 with adapter.rank=8 selects zero",
        ),
        ("optimizer:\n  name: openai_es\n  population_size: 15\n", "even population"),
        ("model: [unclosed\n", "invalid YAML"),
        ("- a\n- b\n", "top level must be a mapping"),
    ],
)
def test_wrong_values(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_int_widens_to_float_and_null_allowed(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "optimizer:\n  sigma0: 1\nmodel:\n  gguf_file: null\n"))
    assert cfg.optimizer.sigma0 == 1.0 and isinstance(cfg.optimizer.sigma0, float)
    # YAML 1.1 reads 3e-4 as a string; users mean the number.
    assert load_config(write(tmp_path, "sft:\n  lr: 3e-4\n")).sft.lr == 3e-4
    with pytest.raises(ConfigError, match="sft.lr: expected a number"):
        load_config(write(tmp_path, "sft:\n  lr: fast\n"))


def test_overrides() -> None:
    cfg = load_config(
        None,
        [
            "optimizer.sigma0=0.2",
            "adapter.target_modules=[q_proj, v_proj]",
            "model.gguf_file=m.gguf",
        ],
    )
    assert cfg.optimizer.sigma0 == 0.2
    assert cfg.adapter.target_modules == ("q_proj", "v_proj")
    assert cfg.model.gguf_file == "m.gguf"
    with pytest.raises(ConfigError, match=r"^--set optimizer.sigma: optimizer.sigma: unknown key"):
        load_config(None, ["optimizer.sigma=0.2"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(None, ["optimizer.sigma0"])


def test_dump_round_trip(tmp_path: Path) -> None:
    cfg = load_config(None, ["optimizer.sigma0=0.3", "run.seed=5"])
    assert load_config(write(tmp_path, dump_config(cfg))) == cfg


@pytest.mark.parametrize("name", ["cma_es", "openai_es", "snes"])
def test_optimizer_keys_sit_flat_and_round_trip(tmp_path: Path, name: str) -> None:
    """The chosen optimizer's own keys are read flat, dumped flat, and load back equal."""
    cfg = load_config(None, [f"optimizer.name={name}", "optimizer.population_size=8"])
    assert load_config(write(tmp_path, dump_config(cfg))) == cfg
    section = yaml.safe_load(dump_config(cfg))["optimizer"]
    assert set(section) - {"name", "population_size", "sigma0", "use_relative_steps", "start",
                           "layerwise", "drift_budget"} == {
        f.name for f in dataclasses.fields(cfg.optimizer.options)
    }  # fmt: skip


def test_a_config_listing_every_optimizers_keys_at_their_defaults_loads(tmp_path: Path) -> None:
    """Other optimizers' keys are ignored at their defaults; set to anything else they fail."""
    every = (
        "optimizer:\n  name: openai_es\n  lr: 0.3\n  step: sgd\n  variant: auto\n"
        "  sep_above_dim: 2000\n  mirrored: false\n  escape_flat_reward: false\n"
        "  eta_mu: 1.0\n  eta_sigma: null\n"
    )
    o = load_config(write(tmp_path, every)).optimizer
    assert (o.name, o.options.kwargs()) == ("openai_es", {"lr": 0.3, "step": "sgd"})
    with pytest.raises(ConfigError, match=r":3: optimizer.variant: applies to cma_es, not snes"):
        load_config(write(tmp_path, "optimizer:\n  name: snes\n  variant: full\n"))
    with pytest.raises(ConfigError, match=r"unknown key \(known: .*, eta_mu, eta_sigma, start"):
        load_config(write(tmp_path, "optimizer:\n  name: snes\n  popsize: 8\n"))


def test_config_is_frozen() -> None:
    cfg = Config()
    with pytest.raises(AttributeError):
        cfg.run.seed = 3  # type: ignore[misc]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return essa(*args, timeout=120)


def test_cli_validate_shipped_and_bad(tmp_path: Path) -> None:
    ok = run_cli("config", "validate", *map(str, SHIPPED))
    assert ok.returncode == 0, ok.stderr
    bad = write(tmp_path, "optimizer:\n  popsize: 8\n")
    res = run_cli("config", "validate", str(bad))
    assert res.returncode == 2
    assert res.stderr.strip() == (
        f"error: {bad}:2: optimizer.popsize: unknown key (known: name, population_size, sigma0, "
        "use_relative_steps, variant, sep_above_dim, mirrored, escape_flat_reward, start, "
        "layerwise, drift_budget)"
    )


def test_cli_train_bad_config_exits_2_without_traceback(tmp_path: Path) -> None:
    bad = write(tmp_path, "run:\n  generations: -1\n")
    res = run_cli("train", str(bad))
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert res.stderr.strip() == f"error: {bad}:2: run.generations: must be >= 0, got -1"


def test_cli_config_show_applies_override() -> None:
    res = run_cli("config", "show", "--set", "optimizer.sigma0=0.25")
    assert res.returncode == 0, res.stderr
    assert "sigma0: 0.25" in res.stdout


@pytest.mark.parametrize(
    ("sets", "fragment"),
    [
        (["reward.reference_weight=-1"], "reward.reference_weight: must be a finite number >= 0"),
        (["reward.reference_weight=0.1", "algorithm=grpo"], "part of the ESSA fitness"),
        (["reward.reference_weight=0.1", "backend=vllm"], "HF decode loop's prefill"),
    ],
)
def test_reference_weight_refusals(sets: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError, match="reward.reference_weight") as err:
        load_config(None, sets)
    assert fragment in str(err.value) and "\n" not in str(err.value)
    assert load_config(None, ["reward.reference_weight=0.25"]).reward.reference_weight == 0.25


def test_prime_with_replay_is_one_clear_line() -> None:
    with pytest.raises(ConfigError, match="does not combine with grpo.replay") as err:
        load_config(
            None,
            ["algorithm=grpo", "grpo.prime.enabled=true", "grpo.replay.capacity=16",
             "grpo.replay.ratio=0.25"],
        )  # fmt: skip
    assert "\n" not in str(err.value)
