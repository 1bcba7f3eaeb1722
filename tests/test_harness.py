"""The run harness (essa/harness/): signals, budget, cadence, phases; GRPO signal and resume.

The model-free tests drive the real ESSA generation step (ask, evaluate, tell) with the fake
evaluator of tests/fakes.py; the slow ones run the real CLI on the bundled demo model.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from essa.config import Config, load_config
from essa.dist import get_comm
from essa.es import checkpoint as es_checkpoint
from essa.es.loop import Search, shown
from essa.es.settings import RunSettings
from essa.harness import Harness, Reporter
from essa.protocols import Evaluator, Optimizer
from essa.rewards import Reward
from essa.setup import plan_inputs
from essa.types import Example
from tests.cli_runner import essa, start
from tests.conftest import GRPO_SETS
from tests.fakes import FakeEvaluator

TRAIN = [Example(prompt=f"{i}+{4 - i}=", answer="4") for i in range(5)]
PROMPTS = [e.prompt for e in TRAIN]


def _config(*overrides: str) -> Config:
    base = ["optimizer.population_size=4", "data.batch_size=3", "run.show_progress=false"]
    return load_config(None, [*base, *overrides])


def _fake_run(
    cfg: Config, run_dir: Path, *, resume: bool = False, interrupt_at: int | None = None
) -> tuple[Optimizer, Harness]:
    """The ESSA loop of essa.recipes.essa_es.run on a 4-dimensional search with the fake
    evaluator."""
    from essa.optimizers import make_optimizer

    run_dir.mkdir(exist_ok=True)
    comm = get_comm("local")
    h = Harness(cfg, run_dir, resume=resume, console=None, comm=comm)
    evaluator = FakeEvaluator()
    reward = Reward("exact", lambda c, a, p: [float(x == y) for x, y in zip(c, a, strict=True)])

    def build(saved: object) -> Optimizer:  # the recipe's builder: no scale-baseline start here
        return make_optimizer("cma_es", 4, population_size=4, sigma0=0.5, seed=cfg.run.seed)

    restored, loaded = es_checkpoint.load(run_dir, build) if resume else (None, None)
    opt = restored if restored is not None else build(None)
    state = h.restore(loaded, done=opt.generation)
    if state is None:
        state = {"baseline_accuracy": 0.0, "best_fitness": None, "best_vector": None}
        h.metrics.write({"generation": -1, "event": "baseline"})
    settings = RunSettings.planned(plan_inputs(cfg), cfg.reward, None, h.say, state)
    search = Search(settings, opt, evaluator, reward, TRAIN, PROMPTS, comm, state)
    for step in h.steps(opt.generation, show=shown):
        record = search.generation(step.index, step.progress)
        if step.index == interrupt_at:
            signal.raise_signal(signal.SIGINT)  # as if Ctrl-C came during this generation
        state["elapsed"] = h.elapsed
        step.finish(record, lambda: es_checkpoint.save(run_dir, opt, state))
    return opt, h


def _generations(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["generation"] for line in lines]


def test_fake_evaluator_and_optimizers_satisfy_the_seams() -> None:
    from essa.optimizers import make_optimizer
    from essa.optimizers.layerwise import LayerwiseES

    assert isinstance(FakeEvaluator(), Evaluator)
    for name in ("cma_es", "openai_es"):
        assert isinstance(make_optimizer(name, 3, population_size=4, sigma0=0.1, seed=0), Optimizer)
    layerwise = LayerwiseES(
        4,
        layer_indices=[[0, 1], [2, 3]],
        active_layers=1,
        interval=2,
        base="cma_es",
        population_size=4,
        sigma0=0.1,
        seed=0,
    )
    assert isinstance(layerwise, Optimizer)


def test_sigint_checkpoints_and_resume_is_bit_exact(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN where the suite runs in the background
    cfg = _config("run.generations=6")
    ref, _ = _fake_run(cfg, tmp_path / "ref")
    run_dir = tmp_path / "split"
    with pytest.raises(SystemExit) as info:
        _fake_run(cfg, run_dir, interrupt_at=2)
    assert info.value.code == 130
    assert json.loads((run_dir / "checkpoint.json").read_text())["optimizer"]["generation"] == 3
    assert _generations(run_dir) == [-1, 0, 1, 2]
    assert signal.getsignal(signal.SIGINT) is before  # the caller's handler is restored
    resumed, _ = _fake_run(cfg, run_dir, resume=True)
    assert resumed.checksum() == ref.checksum()
    assert _generations(run_dir) == [-1, 0, 1, 2, 3, 4, 5]


def test_wall_clock_budget_stops_after_a_checkpointed_step(tmp_path: Path) -> None:
    cfg = _config("run.generations=6", "run.max_wall_seconds=1e-9")
    opt, _ = _fake_run(cfg, tmp_path)
    assert opt.generation == 1
    assert json.loads((tmp_path / "checkpoint.json").read_text())["optimizer"]["generation"] == 1


def test_budget_stops_before_a_step_that_would_end_past_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps of 10 s on a 35 s budget: after 3 steps (30 s) the next would end at 40 s, so the
    loop stops there, not after a 4th step that passes the budget (a fake clock, no sleeps)."""
    import essa.harness.run

    clock = [1000.0]
    monkeypatch.setattr(essa.harness.run.time, "perf_counter", lambda: clock[0])
    cfg = _config("run.generations=10", "run.max_wall_seconds=35")
    h = Harness(cfg, tmp_path, resume=False, console=None, comm=get_comm("local"))
    done = []
    for step in h.steps(0, show=lambda record: {}):
        clock[0] += 10.0
        step.finish({"generation": step.index}, lambda: None)
        done.append(step.index)
    assert done == [0, 1, 2]
    assert h.elapsed == pytest.approx(30.0) and h.elapsed <= 35


def test_a_step_that_ends_in_a_pass_is_forecast_as_the_steps_that_did(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps of 10 s, every third ending in a 20-s held-out pass, on an 85-s budget: after
    step 5 (70 s) the next ends in a pass (30 s, to 100 s), so the loop stops there; a median
    over all steps (10 s) would have run it past the budget (a fake clock, no sleeps)."""
    import essa.harness.run

    clock = [1000.0]
    monkeypatch.setattr(essa.harness.run.time, "perf_counter", lambda: clock[0])
    cfg = _config("run.generations=10", "run.max_wall_seconds=85", "evaluation.every=3")
    h = Harness(cfg, tmp_path, resume=False, console=None, comm=get_comm("local"))
    done = []
    for step in h.steps(0, show=lambda record: {}):
        record: dict = {"generation": step.index}
        clock[0] += 10.0
        if h.due(step.index, 3):
            clock[0] += 20.0
            record["heldout_accuracy"] = 0.5
        step.finish(record, lambda: None)
        done.append(step.index)
    assert done == [0, 1, 2, 3, 4]
    assert h.elapsed == pytest.approx(70.0)
    assert "would be passed by the next generation" in (h.stop_reason or "")


def test_the_budget_keeps_the_passes_after_the_loop_inside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps of 10 s on a 65 s budget with 20 s kept for the final pass and the drift report:
    the loop stops after 4 steps (40 s; a 5th would leave 5 s for 20 s of passes), says so
    with the seconds kept, and the summary records why it stopped (a fake clock, no sleeps)."""
    import essa.harness.run

    clock = [1000.0]
    monkeypatch.setattr(essa.harness.run.time, "perf_counter", lambda: clock[0])
    cfg = _config("run.generations=10", "run.max_wall_seconds=65")
    h = Harness(cfg, tmp_path, resume=False, console=None, comm=get_comm("local"))
    h.end_reserve = 20.0
    done = []
    for step in h.steps(0, show=lambda record: {}):
        clock[0] += 10.0
        step.finish({"generation": step.index}, lambda: None)
        done.append(step.index)
    assert done == [0, 1, 2, 3]
    assert h.elapsed + h.end_reserve <= 65
    reason = "would be passed by the next generation and the passes after the generations"
    assert reason in (h.stop_reason or "") and "(20 s kept for them)" in (h.stop_reason or "")
    summary = h.summary(baseline=0.0, final=0.0, steps=4, adapter_dir=tmp_path, stop_reason=None)
    assert summary["stop_reason"] == h.stop_reason
    kept = h.summary(baseline=0.0, final=0.0, steps=4, adapter_dir=tmp_path, stop_reason="mine")
    assert kept["stop_reason"] == "mine"  # the recipe's own reason comes first


def test_a_resumed_run_keeps_the_seconds_it_reserved(tmp_path: Path) -> None:
    cfg = _config("run.generations=3")
    h = Harness(cfg, tmp_path, resume=False, console=None, comm=get_comm("local"))
    h.restore({"elapsed": 12.0, "end_reserve": 7.5}, done=1)
    assert h.end_reserve == 7.5 and h.elapsed >= 12.0


def test_checkpoint_cadence_saves_every_nth_step_and_the_last(tmp_path: Path) -> None:
    cfg = _config("run.generations=5")
    h = Harness(cfg, tmp_path, resume=False, console=None, comm=get_comm("local"))
    h.checkpoint_every = 2
    saved: list[int] = []
    for step in h.steps(0, show=lambda record: {}):
        step.finish({"generation": step.index}, lambda i=step.index: saved.append(i + 1))
    assert saved == [2, 4, 5]


def test_phase_prints_one_closing_line_and_writes_a_phase_record(tmp_path: Path) -> None:
    from rich.console import Console

    from essa.rundir import MetricsLog

    out = io.StringIO()
    reporter = Reporter(
        Console(file=out, width=200), show_progress=True, log=MetricsLog(tmp_path / "p.jsonl")
    )
    with reporter.phase("SFT", 3, unit="steps") as bar:
        for loss in (0.5, 0.4, 0.3):
            bar.advance(1, loss=loss)
        with reporter.phase("held-out", 10, unit="rows") as inner:  # nested: one live display
            inner.advance(10)
    lines = out.getvalue().strip().splitlines()
    assert lines[0].startswith("held-out: 10/10 rows in ")
    assert lines[1].startswith("SFT: 3/3 steps in ") and lines[1].endswith(", loss 0.3")
    records = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in records] == ["held-out", "SFT"]
    assert all(r["event"] == "phase" and r["seconds"] >= 0 for r in records)
    assert records[1]["done"] == 3 and records[1]["total"] == 3 and records[1]["loss"] == 0.3
    # the process peak so far, never falling: the phase that set a run's peak is readable
    assert 0 < records[0]["peak_rss_mb"] <= records[1]["peak_rss_mb"]


def test_phases_without_a_console_only_record(tmp_path: Path) -> None:
    from essa.rundir import MetricsLog

    reporter = Reporter(None, log=MetricsLog(tmp_path / "p.jsonl"))
    with reporter.phase("model load"):
        pass
    (record,) = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert record["phase"] == "model load" and record["total"] is None


def test_plain_progress_lines_off_a_terminal(tmp_path: Path) -> None:
    """Off a terminal (a file: Slurm, nohup) phases print plain lines as they go, with done/total,
    elapsed, ETA and the latest fields, and log them as progress records; interval 0: every
    event of a phase is due."""
    from rich.console import Console

    from essa.rundir import MetricsLog

    out = io.StringIO()
    log = MetricsLog(tmp_path / "p.jsonl")
    reporter = Reporter(Console(file=out, width=200), log=log, interval=0)
    with reporter.phase("SFT", 2, unit="steps") as bar:
        bar.advance(1, loss=0.5, **{"tokens/s": 100.0})
        bar.advance(1, loss=0.25, **{"tokens/s": 120.0})
    lines = out.getvalue().strip().splitlines()
    assert len(lines) == 4, lines
    assert lines[0].startswith("SFT: 0/2 steps, ") and lines[0].endswith(" s so far")
    assert lines[1].startswith("SFT: 1/2 steps, ") and ", eta " in lines[1]
    assert lines[1].endswith(", loss 0.5, tokens/s 100")
    assert lines[2].startswith("SFT: 2/2 steps, ") and lines[2].endswith(
        ", loss 0.25, tokens/s 120"
    )
    assert lines[3].startswith("SFT: 2/2 steps in ")  # the closing line, as before
    records = [json.loads(line) for line in log.path.read_text().splitlines()]
    assert [(r["event"], r["done"]) for r in records] == [
        ("progress", 0),
        ("progress", 1),
        ("progress", 2),
        ("phase", 2),
    ]
    assert records[1]["loss"] == 0.5 and records[1]["eta_seconds"] >= 0


def test_loop_prints_every_step_and_no_record_before_one_is_due(tmp_path: Path) -> None:
    """The loop's phase prints each step's line off a terminal even inside the interval; its
    progress records wait for the interval (metrics.jsonl has every step already)."""
    from rich.console import Console

    from essa.rundir import MetricsLog

    out = io.StringIO()
    log = MetricsLog(tmp_path / "p.jsonl")
    reporter = Reporter(Console(file=out, width=200), log=log, interval=3600)
    with reporter.phase("generations", 3, unit="generations", start=1, every=True) as bar:
        bar.advance(1, best=0.5)
        bar.advance(1, best=0.75)
    lines = out.getvalue().strip().splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "generations: 2/3 generations",
        "generations: 3/3 generations",
        "generations: 3/3 generations in 0.0 s",
    ]
    assert lines[1].endswith(", best 0.75") and ", eta 0 s" in lines[1]
    records = [json.loads(line) for line in log.path.read_text().splitlines()]
    assert [r["event"] for r in records] == ["phase"]


def test_heartbeat_prints_a_quiet_phase(tmp_path: Path) -> None:
    """A phase with nothing to advance (a model loading) still prints a line once the interval
    has passed: the heartbeat thread's, not the phase's own."""
    from rich.console import Console

    from essa.rundir import MetricsLog

    out = io.StringIO()
    log = MetricsLog(tmp_path / "p.jsonl")
    reporter = Reporter(Console(file=out, width=200), log=log, interval=0.01)
    with reporter.phase("model load"):
        deadline = time.monotonic() + 60
        while "model load: " not in out.getvalue():  # the line is the event waited for
            assert time.monotonic() < deadline, "no heartbeat line in 60 s"
            time.sleep(0.01)
    first = out.getvalue().splitlines()[0]
    assert first.startswith("model load: ") and first.endswith(" s so far"), first
    assert json.loads(log.path.read_text().splitlines()[0])["event"] == "progress"
    assert reporter._beat is None  # stopped with the last phase


def test_terminal_view_has_no_plain_lines() -> None:
    from rich.console import Console

    out = io.StringIO()
    reporter = Reporter(
        Console(file=out, width=200, force_terminal=True, color_system=None), interval=0
    )
    with reporter.phase("SFT", 2, unit="steps") as bar:
        bar.advance(2, loss=0.5)
    assert "so far" not in out.getvalue()
    assert "SFT: 2/2 steps in " in out.getvalue()  # the closing line, as before


def test_progress_interval_from_the_environment() -> None:
    from essa.errors import UserError
    from essa.harness import PROGRESS_SECONDS, progress_interval

    assert progress_interval({}) == PROGRESS_SECONDS == 30
    assert progress_interval({"ESSA_PROGRESS_SECONDS": "0"}) == 0
    assert progress_interval({"ESSA_PROGRESS_SECONDS": " 2.5 "}) == 2.5
    for bad in ("soon", "-1", "nan", "inf"):
        with pytest.raises(UserError, match=f"ESSA_PROGRESS_SECONDS={bad}: expected"):
            progress_interval({"ESSA_PROGRESS_SECONDS": bad})


# --------------------------------------------------------------------------- GRPO, real CLI

GRPO = [
    *GRPO_SETS,
    "sft.steps=4",
    "data.sft_size=32",
    "data.test_size=40",
    "evaluation.every=0",
    "grpo.lr_schedule=constant",  # a schedule over run.generations would differ on resume
    "run.show_progress=false",
    "run.generations=6",
]


def _cli(*args: str, **kwargs: object) -> list[str]:
    return [sys.executable, "-m", "essa.cli", *args]


def _sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


@pytest.mark.slow
def test_grpo_sigint_checkpoints_exits_130_and_resumes_bit_exactly(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    ref = tmp_path / "ref"
    res = essa("train", "--run-dir", str(ref), *_sets(GRPO))
    assert res.returncode == 0, res.stderr[-3000:]

    run_dir = tmp_path / "run"
    proc = start("train", "--run-dir", str(run_dir), *_sets(GRPO))
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:  # the run's own file says when
        if metrics.exists() and '"generation": 0,' in metrics.read_text():
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert f"continue with: essa train --resume {run_dir}" in out
    assert not (run_dir / "summary.json").exists()
    state = json.loads((run_dir / "checkpoint" / "state.json").read_text())
    gens = [json.loads(line)["generation"] for line in metrics.read_text().splitlines()]
    assert 1 <= state["step"] < 6 and gens == list(range(-1, state["step"]))

    res = essa("train", "--resume", str(run_dir))
    assert res.returncode == 0, res.stderr[-3000:]
    a = load_file(str(ref / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    assert set(a) == set(b)
    for key in a:
        assert (a[key] == b[key]).all(), key
    gens = [json.loads(line)["generation"] for line in metrics.read_text().splitlines()]
    assert gens == [-1, 0, 1, 2, 3, 4, 5]
    phases = [
        json.loads(line)["phase"] for line in (run_dir / "phases.jsonl").read_text().splitlines()
    ]
    assert phases.count("model load") == 2 and "export" in phases and "SFT" in phases


# --------------------------------------------------------------------------- demo bytes

# sha256 of adapter/adapter_model.safetensors after `essa train --set run.generations=6` (the
# demo config, seed 0), with the held-out accuracies of that run, per numeric stack it was
# recorded on. The bytes depend on the float kernels (CPU ISA, torch) and on the libraries that
# compute the run (transformers, peft, numpy, cma): CI installs their newest releases, and
# transformers 5.24 / peft 0.21.2 moved the bytes of an earlier record while every accuracy stayed
# the same. So the pin applies only on a recorded stack; on any other the test runs the demo
# twice and asserts the bytes are reproducible there and that ESSA still lifts the demo.
DEMO_RECORDS: dict[tuple[str, ...], tuple[str, tuple[float, float, float]]] = {
    # On an AVX-512 CPU (transformers 5.24.0).
    ("x86_64", "AVX512", "2.13.0+cpu", "5.24.0", "0.21.2", "2.4.6", "4.5.0"): (
        "65caead42538d94f3502a06f648a0a4102a182a3eab498d6850e146234e29267",
        (0.598, 0.828, 0.863),
    ),
    # An AVX2 CPU (transformers 5.25.0, what a fresh install gets from 2026-12): its kernels
    # round differently, and the demo's search ends elsewhere.
    ("x86_64", "AVX2", "2.13.0+cpu", "5.25.0", "0.21.2", "2.4.6", "4.5.0"): (
        "e51f9cc12b8ec25fb9ab6f9d9329c55635b2e71e415b7f2bef8b62a540bc5afd",
        (0.598, 0.817, 0.863),
    ),
}


def _numeric_stack() -> tuple[str, ...]:
    import platform

    import cma
    import numpy
    import peft
    import torch
    import transformers

    return (
        platform.machine(),
        torch.backends.cpu.get_cpu_capability(),
        torch.__version__,
        transformers.__version__,
        peft.__version__,
        numpy.__version__,
        cma.__version__.split()[0],
    )


# `essa train --set run.generations=6` on the demo config, seed 0: the run the pin is for.
DEMO_ARGS = ("train", "--set", "run.generations=6", "--set", "run.show_progress=false")


def _demo_result(run_dir: Path) -> tuple[str, tuple[float, float, float]]:
    import hashlib

    data = (run_dir / "adapter" / "adapter_model.safetensors").read_bytes()
    summary = json.loads((run_dir / "summary.json").read_text())
    accuracies = (
        summary["baseline_accuracy"],
        summary["final_accuracy"],
        summary["scale_baseline"]["heldout_accuracy"],
    )
    return hashlib.sha256(data).hexdigest(), accuracies


def _demo_run(run_dir: Path) -> tuple[str, tuple[float, float, float]]:
    res = subprocess.run(
        _cli(*DEMO_ARGS, "--run-dir", str(run_dir)),
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return _demo_result(run_dir)


@pytest.mark.slow
def test_demo_adapter_bytes_unchanged_for_seed_0(tmp_path: Path) -> None:
    """In a fresh interpreter, as a user runs it (not forked from the tests' preloaded server)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the demo record is for CPU kernels")
    digest, accuracies = _demo_run(tmp_path / "demo")
    record = DEMO_RECORDS.get(_numeric_stack())
    if record is not None:
        assert (digest, accuracies) == record
        return
    # Not a recorded stack: the run must still be bit-reproducible across processes here, and
    # the 6 generations must still lift the demo well above its SFT start (recorded: +0.23).
    again, accuracies_again = _demo_run(tmp_path / "again")
    assert (again, accuracies_again) == (digest, accuracies), _numeric_stack()
    baseline, final, _ = accuracies
    assert final >= baseline + 0.1, (accuracies, _numeric_stack())
