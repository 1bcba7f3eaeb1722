"""`essa train` with algorithm: grpo through the real CLI on the bundled demo model.

Small settings keep each run to seconds; the demo's learning curve is measured in bench/.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import GRPO_SETS
from tests.test_train_e2e import assert_drift_report, assert_pass_drift, essa, sets

SMALL = [
    *GRPO_SETS,
    "sft.steps=4",
    "data.sft_size=32",
    "data.test_size=40",
    "evaluation.every=2",
    "run.show_progress=false",
]
ROOT = Path(__file__).resolve().parent.parent
SUMMARY_KEYS = ("baseline_accuracy", "final_accuracy", "generations", "wall_seconds", "adapter_dir")


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def lora_changed(run_dir: Path) -> bool:
    sft = load_file(str(run_dir / "sft_adapter" / "adapter_model.safetensors"))
    final = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    assert set(sft) == set(final)
    return any(not torch.allclose(final[k], sft[k]) for k in final)


def load_adapter(adapter_dir: str) -> torch.nn.Module:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from essa.backends.models import resolve_model_path

    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin:demo"))
    return PeftModel.from_pretrained(base, adapter_dir)


def train(run_dir: Path, *args: str) -> None:
    """`essa train ARGS --run-dir RUN_DIR`, which must succeed."""
    res = essa("train", *args, "--run-dir", str(run_dir))
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.slow
def test_grpo_train_writes_run_dir_and_loadable_adapter(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # model.dtype auto: the summary records the checkpoint's own dtype (the demo's float32)
    train(run_dir, *sets(*SMALL, "run.generations=3", "model.dtype=auto"))
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in SUMMARY_KEYS:
        assert key in summary
    assert summary["generations"] == 3 and summary["algorithm"] == "grpo"
    assert summary["variant"]["normaliser"] == "sequence_mean"  # the preset is recorded
    assert summary["compute"]["device"] == "cpu" and summary["compute"]["dtype"] == "float32"
    assert 0.0 <= summary["final_accuracy"] <= 1.0
    recs = records(run_dir)
    assert recs[0]["event"] == "baseline" and recs[0]["variant"]["name"] == "grpo"
    steps = [r for r in recs if r["generation"] >= 0]
    assert [r["generation"] for r in steps] == [0, 1, 2]
    for r in steps:
        assert 0.0 <= r["mean_reward"] <= 1.0 and r["new_tokens"] > 0 and r["seconds"] > 0
        assert all(k in r for k in ("loss", "kl", "clip_low", "clip_high", "grad_norm"))
        assert r["entropy"] > 0 and r["temperature"] == 1.0  # logged by every GRPO run
        assert "replayed" not in r  # replay is off by default
    assert "heldout_accuracy" in steps[1]
    model = load_adapter(summary["adapter_dir"])
    assert sum("lora_A" in n for n, _ in model.named_parameters()) > 0
    assert lora_changed(run_dir), "GRPO changed nothing"
    assert_drift_report(summary["drift"], k=4, items=40)
    assert summary["drift"]["kl_sft"] > 0  # GRPO moved the adapter off its SFT values
    assert_pass_drift(recs, "heldout_accuracy")  # GRPO checks on the test split


@pytest.mark.slow
def test_svd_grpo_dapo_exports_a_changed_adapter(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    svd_dapo = ["run.generations=2", "grpo.trainable=singular_values", "grpo.loss=dapo"]
    train(run_dir, *sets(*SMALL, *svd_dapo))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["dim"] == 256  # the singular values ESSA searches on the demo
    load_adapter(summary["adapter_dir"])
    assert lora_changed(run_dir)


# A constant LR: a schedule over run.generations would differ between a 2- and a 4-step run.
CONSTANT = [*SMALL, "grpo.lr_schedule=constant"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted 4-step run that both resume tests below must end bit-exactly on (run
    once; the tests only read it)."""
    ref = tmp_path_factory.mktemp("grpo-ref") / "ref"
    res = essa("train", "--run-dir", str(ref), *sets(*CONSTANT, "run.generations=4"))
    assert res.returncode == 0, res.stderr[-3000:]
    return ref


@pytest.mark.slow
def test_grpo_resume_matches_uninterrupted(tmp_path: Path, reference: Path) -> None:
    small, ref = CONSTANT, reference
    run_dir = tmp_path / "split"
    res = essa("train", "--run-dir", str(run_dir), *sets(*small, "run.generations=2"))
    assert res.returncode == 0, res.stderr[-3000:]
    res = essa("train", "--resume", str(run_dir), *sets("run.generations=4"))
    assert res.returncode == 0, res.stderr[-3000:]
    a = load_file(str(ref / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert [r["generation"] for r in records(run_dir)] == [-1, 0, 1, 2, 3]
    # the 2-step run's final samples are dropped on resume; the rows are the 4-step run's
    assert (run_dir / "samples.jsonl").read_text() == (ref / "samples.jsonl").read_text()


@pytest.mark.slow
def test_grpo_full_disk_mid_run_stops_then_resumes_exactly(tmp_path: Path, reference: Path) -> None:
    """ENOSPC while checkpointing step 3: one error line, step 2's checkpoint intact, resume exact."""
    small, ref = [*CONSTANT, "run.generations=4"], reference
    run_dir = tmp_path / "run"
    res = essa("train", "--run-dir", str(run_dir), *sets(*small), env={"ESSA_FAULT": "enospc@3"})
    assert res.returncode == 2, res.stderr[-3000:]
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr[-3000:]
    assert "no space left on device" in lines[0] and "essa train --resume" in lines[0]
    state = json.loads((run_dir / "checkpoint" / "state.json").read_text())
    assert state["step"] == 2  # the previous checkpoint, not a half-written one
    assert not (run_dir / ".checkpoint.tmp").exists()
    res = essa("train", "--resume", str(run_dir))
    assert res.returncode == 0, res.stderr[-3000:]
    a = load_file(str(ref / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert [r["generation"] for r in records(run_dir)] == [-1, 0, 1, 2, 3]


# RLEP replay, the entropy bonus, the ERA-style floor and a temperature stage at step 2, all on.
# Four training prompts drawn every step, so each prompt's successes come back as replays.
EXTENSIONS = [
    "grpo.lr_schedule=constant",
    "grpo.train_examples=4",
    "grpo.replay.capacity=12",
    "grpo.replay.ratio=0.5",
    "grpo.entropy.coef=0.01",
    "grpo.entropy.floor=0.2",
    "grpo.temperature_schedule=[[2,0.8]]",
]


@pytest.mark.slow
def test_grpo_replay_entropy_schedule_resume_after_kill(tmp_path: Path) -> None:
    """kill -9 inside step 3's checkpoint write; the resumed run redoes step 2 (the first at
    temperature 0.8) from step 2's checkpoint, buffer included, and ends bit-exactly."""
    small = [*SMALL, *EXTENSIONS, "run.generations=4"]
    ref = tmp_path / "ref"
    res = essa("train", "--run-dir", str(ref), *sets(*small))
    assert res.returncode == 0, res.stderr[-3000:]
    recs = [r for r in records(ref) if r["generation"] >= 0]
    assert [r["temperature"] for r in recs] == [1.0, 1.0, 0.8, 0.8]
    assert recs[0]["replayed"] == 0 and sum(r["replayed"] for r in recs) > 0
    sizes = [r["replay_buffer_size"] for r in recs]
    assert sizes == sorted(sizes) and 0 < sizes[-1] <= 12
    assert all(r["entropy"] > 0 for r in recs)
    lines = (ref / "replay.jsonl").read_text().splitlines()
    assert len(lines) == sizes[-1] and all(json.loads(x)["reward"] >= 1.0 for x in lines)

    run_dir = tmp_path / "killed"
    res = essa("train", "--run-dir", str(run_dir), *sets(*small), env={"ESSA_FAULT": "kill@3"})
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    state = json.loads((run_dir / "checkpoint" / "state.json").read_text())
    assert state["step"] == 2 and len(state["replay"]) == sizes[1]  # the buffer is checkpointed
    res = essa("train", "--resume", str(run_dir))
    assert res.returncode == 0, res.stderr[-3000:]
    a = load_file(str(ref / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert (run_dir / "replay.jsonl").read_text() == (ref / "replay.jsonl").read_text()
    resumed = [r for r in records(run_dir) if r["generation"] >= 0]
    keys = ("replayed", "replay_buffer_size", "temperature", "mean_reward", "loss")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in recs]


@pytest.mark.slow
def test_grpo_replay_seeded_from_a_first_phase(tmp_path: Path) -> None:
    """RLEP's two phases: a first run collects successes (ratio 0), a second replays them from
    its first step on."""
    first = tmp_path / "first"
    collect = [*SMALL, "grpo.train_examples=4", "grpo.replay.capacity=32", "run.generations=2"]
    res = essa("train", "--run-dir", str(first), *sets(*collect))
    assert res.returncode == 0, res.stderr[-3000:]
    assert all(r["replayed"] == 0 for r in records(first) if r["generation"] >= 0)
    seed = first / "replay.jsonl"
    stored = len(seed.read_text().splitlines())
    assert stored > 0
    second = tmp_path / "second"
    replaying = [*collect[:-1], "grpo.replay.ratio=0.5", f"grpo.replay.seed_file={seed}"]
    res = essa("train", "--run-dir", str(second), *sets(*replaying, "run.generations=1"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"replay: seeded {stored} verified completions from {seed}" in res.stdout + res.stderr
    (step,) = [r for r in records(second) if r["generation"] >= 0]
    assert step["replayed"] > 0


@pytest.mark.slow
def test_grpo_1shot_config_trains_on_one_example(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    small = ["run.generations=2", "data.test_size=40", "grpo.prompts_per_step=2"]
    train(
        run_dir, str(ROOT / "configs" / "grpo_1shot.yaml"), *sets(*small, "run.show_progress=false")
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["grpo"]["train_examples"] == 1 and summary["grpo"]["entropy"]["coef"] > 0
    assert lora_changed(run_dir)
