"""The Python API (essa.load_config, essa.train, essa.evaluate), the recipe registry the CLI and
the API dispatch through, and the GRPO presets' table as the config's list of losses."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

import essa
from essa import recipes
from essa.config import Config, ConfigError, load_config
from essa.errors import UserError
from essa.grpo_variants import VARIANTS

# A run of seconds on the bundled demo (tests/test_train_e2e.py's small settings). The tiny
# model may start at its validation floor, which stops a search before it starts: no
# validation split here, so the generations run and the test split alone scores them.
SMALL = [
    "sft.steps=4",
    "data.sft_size=32",
    "data.batch_size=8",
    "data.test_size=16",
    "data.val_size=0",
    "optimizer.population_size=4",
    "evaluation.every=0",
    "evaluation.drift.prompts=0",
    "evaluation.drift.items=0",
    "run.generations=2",
    "run.show_progress=false",
]


def test_importing_essa_loads_no_heavy_module() -> None:
    code = (
        "import sys, essa; heavy = ['torch', 'transformers', 'yaml', 'mpi4py', 'essa.config']; "
        "print([m for m in heavy if m in sys.modules], callable(essa.train))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]", "True"]


def test_load_config_applies_overrides_and_names_an_unknown_key() -> None:
    cfg = essa.load_config(None, overrides=["run.generations=7", "optimizer.sigma0=0.2"])
    assert isinstance(cfg, Config)
    assert (cfg.run.generations, cfg.optimizer.sigma0) == (7, 0.2)
    with pytest.raises(ConfigError, match=r"^--set optimizer\.sigma: optimizer\.sigma: unknown"):
        essa.load_config(None, overrides=["optimizer.sigma=0.2"])


def test_load_config_reads_a_file_and_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("run:\n  generations: 3\n  bogus: 1\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:3: run\.bogus: unknown key"):
        essa.load_config(path)
    path.write_text("run:\n  generations: 3\n")
    assert essa.load_config(str(path), ["run.seed=5"]).run.seed == 5


def test_a_config_object_is_checked_and_takes_no_overrides(tmp_path: Path) -> None:
    bad = dataclasses.replace(Config(), algorithm="nope")
    with pytest.raises(ConfigError, match="algorithm: expected one of 'essa' | 'grpo'"):
        essa.train(bad, run_dir=tmp_path / "run")
    with pytest.raises(ConfigError, match="overrides: apply to a config file"):
        essa.train(Config(), overrides=["run.seed=1"], run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()  # refused before anything is written


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """(run dir, summary) of one 2-generation ESSA run through essa.train."""
    run_dir = tmp_path_factory.mktemp("api") / "run"
    summary = essa.train(None, overrides=SMALL, run_dir=run_dir)
    return run_dir, summary


@pytest.mark.slow
def test_train_returns_the_summary_and_writes_the_run_dir(demo_run: tuple[Path, dict]) -> None:
    run_dir, summary = demo_run
    assert summary == json.loads((run_dir / "summary.json").read_text())
    assert summary["generations"] == 2 and summary["test_size"] == 16
    assert 0.0 <= summary["final_accuracy"] <= 1.0
    assert Path(summary["adapter_dir"]) == (run_dir / "adapter").resolve()
    assert (run_dir / "adapter" / "adapter_config.json").is_file()
    saved = load_config(run_dir / "config.yaml")  # the resolved config, written first
    assert saved == load_config(None, SMALL)
    with pytest.raises(UserError, match="exists"):  # an existing run dir is never replaced
        essa.train(None, overrides=SMALL, run_dir=run_dir)


@pytest.mark.slow
def test_evaluate_scores_the_trained_adapter(demo_run: tuple[Path, dict], tmp_path: Path) -> None:
    run_dir, summary = demo_run
    out = tmp_path / "eval.json"
    result = essa.evaluate(run_dir / "config.yaml", adapter=summary["adapter_dir"], output=out)
    assert result["n"] == 16 and result["samples"] == 1
    assert result["adapter"] == summary["adapter_dir"]
    # The final held-out pass and the evaluation score the same greedy completions.
    assert result["mean_score"] == pytest.approx(summary["final_accuracy"])
    assert json.loads(out.read_text()) == result
    assert len(Path(result["items"]).read_text().splitlines()) == 16
    with pytest.raises(UserError, match="--adapter .*: not a PEFT adapter directory"):
        essa.evaluate(run_dir / "config.yaml", adapter=tmp_path)


# ---------------------------------------------------------------------------------------------
# The recipe registry

TOY = """
import json

def run(cfg, run_dir, *, resume=False, console=None, comm=None):
    summary = {"baseline_accuracy": 0.25, "final_accuracy": 0.5, "improvement": 0.25,
               "generations": cfg.run.generations, "wall_seconds": 0.0,
               "heldout_metric": "toy", "adapter_dir": str(run_dir / "adapter"),
               "algorithm": cfg.algorithm, "resume": resume}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return summary
"""


@pytest.fixture
def toy_recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[recipes.Recipe]:
    """A recipe outside essa, registered as algorithm ``toy`` for the test."""
    (tmp_path / "toy_recipe.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = recipes.register("toy", "toy_recipe:run", section=None, unit="rounds")
    yield entry
    del recipes.RECIPES["toy"]


def test_the_registry_lists_the_four_algorithms() -> None:
    assert list(recipes.RECIPES) == ["essa", "grpo", "dpo", "scalebio"]
    sections = {name: entry.section for name, entry in recipes.RECIPES.items()}
    assert sections == {"essa": "optimizer", "grpo": "grpo", "dpo": "dpo", "scalebio": "scalebio"}
    assert recipes.recipe("essa").unit == "generations" and recipes.recipe("dpo").unit == "steps"
    with pytest.raises(UserError, match="algorithm: ppo is not a registered recipe"):
        recipes.recipe("ppo")
    with pytest.raises(ValueError, match="already registered"):
        recipes.register("grpo", "elsewhere:run")


def test_the_config_takes_the_registered_algorithms(toy_recipe: recipes.Recipe) -> None:
    assert load_config(None, ["algorithm=toy"]).algorithm == "toy"
    del recipes.RECIPES["toy"]
    try:
        with pytest.raises(ConfigError, match="--set algorithm: algorithm: expected one of"):
            load_config(None, ["algorithm=toy"])
    finally:
        recipes.RECIPES["toy"] = toy_recipe


def test_train_dispatches_to_a_registered_recipe(
    toy_recipe: recipes.Recipe, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    summary = essa.train(None, overrides=["algorithm=toy"], run_dir=run_dir)
    assert summary["algorithm"] == "toy" and summary["resume"] is False
    assert load_config(run_dir / "config.yaml").algorithm == "toy"
    resumed = essa.train(None, overrides=["run.generations=9"], run_dir=run_dir, resume=True)
    assert resumed["resume"] is True and resumed["generations"] == 9  # the saved config + set


def test_the_cli_dispatches_through_the_registry(
    toy_recipe: recipes.Recipe, tmp_path: Path
) -> None:
    from essa.cli import app

    run_dir = tmp_path / "run"
    sets = ["--set", "algorithm=toy", "--set", "run.generations=3"]
    args = ["train", *sets, "--run-dir", str(run_dir), "--json"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "held-out toy 0.250 -> 0.500 (+0.250) after 3 rounds" in res.output
    assert json.loads(res.output[res.output.index("{") :])["algorithm"] == "toy"
    res = CliRunner().invoke(app, ["train", "--set", "algorithm=ppo", "--run-dir", str(run_dir)])
    assert res.exit_code == 2
    assert "error: --set algorithm: algorithm: expected one of 'essa'" in res.output


# ---------------------------------------------------------------------------------------------
# GRPO's losses: one table


def test_a_preset_added_to_the_table_is_a_grpo_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="grpo.loss: expected one of .*'dcpo', got 'my_grpo'"):
        load_config(None, ["algorithm=grpo", "grpo.loss=my_grpo"])
    mine = dataclasses.replace(VARIANTS["grpo"], name="my_grpo", beta=0.0)
    monkeypatch.setitem(VARIANTS, "my_grpo", mine)
    cfg = load_config(None, ["algorithm=grpo", "grpo.loss=my_grpo"])
    from essa.gradient import losses

    assert losses.get_variant(cfg.grpo.loss) is mine and losses.beta(cfg.grpo) == 0.0
