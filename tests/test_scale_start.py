"""optimizer.start: scale_baseline: the search starts at the no-search baseline's scaled adapter.

On the demo model (the scale baseline is cheap there): with zero generations the exported
adapter is the start itself, so its held-out pass must reproduce the scale baseline's item by
item; a killed run resumes onto the same start and the same trajectory.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.test_train_e2e import adapter_tensors, essa, sets

SMALL = [
    "sft.steps=6",
    "data.sft_size=16",
    "data.test_size=24",
    "data.batch_size=8",
    "optimizer.population_size=4",
    "evaluation.every=0",
    "run.show_progress=false",
    "optimizer.start=scale_baseline",
    "evaluation.use_scale_baseline=false",  # implied by the start
]


def passes(run_dir: Path) -> dict[str, list[float]]:
    out = {}
    for line in (run_dir / "heldout_scores.jsonl").read_text().splitlines():
        record = json.loads(line)
        out["final" if record["final"] else record.get("pass", "")] = record["scores"]
    return out


@pytest.mark.slow
def test_zero_generations_export_the_scale_baselines_adapter(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    res = essa("train", "--run-dir", str(run_dir), *sets(*SMALL, "run.generations=0"))
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["scale_baseline_ran"] is True
    factor = summary["scale_baseline"]["factor"]
    assert f"the search starts at the SFT adapter x{factor:g}" in res.stdout
    scores = passes(run_dir)
    assert scores["final"] == scores["scale baseline held-out"]
    assert factor != 1.0, "the demo's scale baseline chose x1: the test would prove nothing"
    sft = load_file(str(Path(summary["sft_adapter_dir"]) / "adapter_model.safetensors"))
    out = adapter_tensors(run_dir)  # the start, exported: not the SFT adapter (offsets 0)
    assert any(not torch.allclose(sft[k], out[k]) for k in out if k in sft)


@pytest.mark.slow
def test_resume_after_a_kill_keeps_the_start(tmp_path: Path) -> None:
    args = sets(*SMALL, "run.generations=4")
    ref = tmp_path / "ref"
    res = essa("train", "--run-dir", str(ref), *args)
    assert res.returncode == 0, res.stderr[-3000:]
    killed = tmp_path / "killed"
    res = essa("train", "--run-dir", str(killed), *args, env={"ESSA_FAULT": "kill@2"})
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    res = essa("train", "--resume", str(killed))
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = adapter_tensors(ref), adapter_tensors(killed)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert passes(ref)["final"] == passes(killed)["final"]
    factor = json.loads((ref / "summary.json").read_text())["scale_baseline"]["factor"]
    for run_dir in (ref, killed):  # the optimizer's recorded start is the scaled adapter
        x0 = json.loads((run_dir / "checkpoint.json").read_text())["optimizer"]["config"]["x0"]
        assert bool(np.any(np.asarray(x0) != 0.0)) is (factor != 1.0)
