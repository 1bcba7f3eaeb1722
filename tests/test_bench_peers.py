"""bench/studies/trl_grpo.py, bench/studies/peers.py and bench/benchmarks/peers_memory.py end to end on the tiny model.

The TRL mapping is checked against TRL's own GRPOConfig validation; the runners are run for one
or two steps on the in-process tiny Qwen2 (tests/conftest.py) and their outputs are checked for
the fields the report (bench/suite.py -> docs/performance.md) reads.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from essa.config import load_config
from essa.errors import UserError

pytestmark = pytest.mark.component("trl")


@pytest.fixture(autouse=True)
def _trl() -> None:
    """Skip (a failure under ESSA_REQUIRE=trl) without TRL, a bench-only dependency."""
    pytest.importorskip("trl", reason="TRL is a bench-only dependency")


ROW_KEYS = {"row", "value", "target", "met", "note"}
TINY = [
    "algorithm=grpo",
    "sft.steps=2",
    "data.sft_size=16",
    "data.test_size=8",
    "grpo.prompts_per_step=2",
    "grpo.group_size=2",
    "generation.max_new_tokens=4",
    "evaluation.every=1",
    "run.generations=2",
    "run.show_progress=false",
]


def tiny_sets(model_dir: Path) -> list[str]:
    return [f"model.name_or_path={model_dir}", "model.num_threads=1", *TINY]


@pytest.mark.parametrize(
    ("loss", "beta", "scale", "eps_high", "masked"),
    [("grpo", 0.04, "group", 0.2, False), ("dr_grpo", 0.0, "none", 0.2, False),
     ("dapo", 0.0, "group", 0.28, True)],
)  # fmt: skip
def test_trl_arguments_match_our_presets_and_pass_trl_validation(
    tmp_path: Path, loss: str, beta: float, scale: str, eps_high: float, masked: bool
) -> None:
    from trl import GRPOConfig

    from bench.studies.trl_grpo import trl_arguments

    cfg = load_config("configs/grpo_demo.yaml", [f"grpo.loss={loss}"])
    args = trl_arguments(cfg, tmp_path)
    assert args["loss_type"] == loss and args["beta"] == beta
    assert args["scale_rewards"] == scale and args["epsilon_high"] == eps_high
    assert args["mask_truncated_completions"] is masked
    # 64 prompts x G=16 per step: one optimizer step over 1024 completions, as our recipe.
    assert args["num_generations"] == 16 and args["per_device_train_batch_size"] == 1024
    assert args["max_steps"] == 150 and args["learning_rate"] == cfg.grpo.lr
    config = GRPOConfig(**args)  # TRL's own checks (batch divisible by G, ...) accept it
    assert config.generation_batch_size == 1024 and not config.use_vllm


def test_trl_arguments_refuse_what_trl_cannot_run(tmp_path: Path) -> None:
    from bench.studies.trl_grpo import trl_arguments

    with pytest.raises(UserError, match="grpo.loss=ngrpo"):
        trl_arguments(load_config(None, ["algorithm=grpo", "grpo.loss=ngrpo"]), tmp_path)
    odd = load_config(
        None,
        [
            "algorithm=grpo",
            "grpo.group_size=3",
            "grpo.prompts_per_step=3",
            "grpo.grad_accumulation=2",
        ],
    )
    with pytest.raises(UserError, match="grad_accumulation"):
        trl_arguments(odd, tmp_path)


@pytest.mark.slow
def test_trl_runner_end_to_end(tmp_path: Path, tiny_model_dir: Path) -> None:
    from bench.studies.trl_grpo import report_rows, run

    # A random 0/1 reward: the untrained tiny model is never right, and groups need a spread.
    cfg = load_config(None, [*tiny_sets(tiny_model_dir), "reward.name=random"])
    summary = run(cfg, tmp_path / "trl", console=lambda _: None)
    for key in ("baseline_accuracy", "final_accuracy", "wall_seconds", "peak_rss_mb", "label"):
        assert key in summary
    assert summary["trl_arguments"]["beta"] == 0.04 and summary["mismatches"]
    records = [json.loads(x) for x in (tmp_path / "trl" / "metrics.jsonl").read_text().split("\n")
               if x]  # fmt: skip
    assert records[0]["event"] == "baseline"
    steps = [r for r in records if r["generation"] >= 0]
    assert [r["generation"] for r in steps] == [0, 1]
    for record in steps:  # 2 prompts x G=2 completions of 1 to 4 tokens each
        assert 4 <= record["new_tokens"] <= 16 and record["seconds"] > 0
        assert 0.0 <= record["mean_reward"] <= 1.0 and "heldout_accuracy" in record
    sft = load_file(str(tmp_path / "trl" / "sft_adapter" / "adapter_model.safetensors"))
    final = load_file(str(tmp_path / "trl" / "adapter" / "adapter_model.safetensors"))
    assert set(final) == set(sft)  # the "ref" copy TRL adds is not exported
    assert any(not torch.equal(final[k], sft[k]) for k in final), "TRL changed nothing"
    from essa.compare import load_run

    assert load_run(tmp_path / "trl").label == "trl grpo (grpo, lora)"
    assert all(set(r) == ROW_KEYS for r in report_rows({"summary": summary}))


@pytest.mark.slow
def test_peers_runs_three_trainers_from_one_sft_adapter(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    from bench.studies.peers import report_rows, run_seed, summarize

    overrides = [s for s in tiny_sets(tiny_model_dir) if s != "algorithm=grpo"]
    overrides += [
        "optimizer.population_size=2",
        "data.batch_size=2",
        "evaluation.use_scale_baseline=false",
        "run.on_no_signal=search",  # the tiny model is at the floor: ESSA searches all the same
    ]
    args = argparse.Namespace(
        essa_config=Path("configs/demo.yaml"), grpo_config=None, overrides=overrides,
        threads=1, runs=tmp_path, target=0.5, seeds=[0], output=tmp_path / "out",
    )  # fmt: skip
    seed = run_seed(args, 0)
    runs = seed["runs"]
    assert set(runs) == {"essa", "grpo", "trl"}
    starts = {name: run["sft_start"] for name, run in runs.items()}
    assert len(set(starts.values())) == 1, starts  # the same SFT adapter, the same split
    for run in runs.values():
        assert run["tokens"] > 0 and run["peak_rss_mb"] > 0 and run["final"] is not None
    assert (tmp_path / "out" / "peers.png").stat().st_size > 0
    assert "trl grpo (grpo, lora)" in (tmp_path / "out" / "peers.md").read_text()
    result = {"summary": summarize([seed]), "target": 0.5}
    rows = report_rows(result)
    assert rows and all(set(r) == ROW_KEYS for r in rows)


@pytest.mark.slow
def test_peers_memory_reports_ratio_and_breakdown(tmp_path: Path, tiny_model_dir: Path) -> None:
    from bench.benchmarks.peers_memory import measure, report_rows

    args = argparse.Namespace(
        generations=1, rows=4, population=2, group_size=2, max_new_tokens=4, repeats=1,
        threads=1, runs=tmp_path, template="raw",
    )  # fmt: skip
    result = measure(args, tiny_model_dir)
    peaks = result["peak_rss_mb"]
    for name in ("floor", "essa", "grpo"):
        assert peaks[name]["median"] > 50  # a real process with torch loaded
    # Both training processes load what the floor process loads, and more.
    assert peaks["essa"]["median"] >= peaks["floor"]["median"] * 0.95
    ratio = result["ratio_essa_over_grpo"]["median"]
    assert ratio == pytest.approx(peaks["essa"]["median"] / peaks["grpo"]["median"])
    assert result["lora_parameters"] > 0 and result["essa_dim"] > 0
    assert result["breakdown"]["grpo"]["adamw_moments"] > 0  # sizes: test_state_sizes_...
    rows = report_rows(result)
    assert rows[0]["target"] == "<= 0.5x" and isinstance(rows[0]["met"], bool)
    assert all(set(r) == ROW_KEYS for r in rows)


def test_state_sizes_match_real_optimizer_state() -> None:
    """The breakdown's formulas against what torch's AdamW and pycma really allocate."""
    import cma
    import numpy as np

    from bench.benchmarks.peers_memory import MB, state_sizes

    numel, dim, population = 3000, 40, 6
    params = [torch.nn.Parameter(torch.zeros(1000)) for _ in range(3)]  # 3000 LoRA weights
    adamw = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    adamw.step()
    moments = sum(
        t.nbytes for state in adamw.state.values() for k, t in state.items() if k != "step"
    )
    grads = sum(p.grad.nbytes for p in params)
    sizes = state_sizes(numel, dim, population)
    assert sizes["grpo"]["adamw_moments"] * MB == moments
    assert sizes["grpo"]["lora_gradients"] * MB == grads == sizes["grpo"]["sft_reference_copy"] * MB
    es = cma.CMAEvolutionStrategy(np.zeros(dim), 0.5, {"verbose": -9, "popsize": population})
    es.tell(es.ask(), list(range(population)))
    # C and its eigenvectors B, float64 D x D each; C^-1/2, the third, is built on demand.
    assert sizes["essa"]["cma_es_matrices"] * MB == 1.5 * (es.sm.C.nbytes + es.sm.B.nbytes)
