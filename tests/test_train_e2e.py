"""End to end through the real CLI on the bundled demo model: train, resume after kill -9, eval.

Small settings keep each run to seconds; the full demo is measured in bench/, not here.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.cli_runner import CliProcess, essa, start

SMALL = [
    "sft.steps=4",
    "data.sft_size=32",
    "data.batch_size=8",
    "data.test_size=40",
    "optimizer.population_size=4",
    "evaluation.every=2",
    "run.show_progress=false",
]


def sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def adapter_tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def assert_accuracy_over(n: int, accuracy: float) -> None:
    """An accuracy over n prompts is k / n: catches a mean of something else, or a wrong n."""
    assert 0.0 <= accuracy <= 1.0 and abs(n * accuracy - round(n * accuracy)) < 1e-9, (n, accuracy)


@pytest.fixture(scope="module")
def three_generations(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(run dir, stdout file) of one 3-generation run with stdout to a file (Slurm, nohup, CI),
    shared by the tests that only read it. ESSA_PROGRESS_SECONDS=0 makes every event of a
    phase due, so the progress test waits on nothing; progress never touches the numbers."""
    tmp = tmp_path_factory.mktemp("three-generations")
    run_dir, stdout = tmp / "run", tmp / "stdout.txt"
    shown = [s for s in SMALL if not s.startswith("run.show_progress")]
    overrides = sets(*shown, "run.generations=3", "evaluation.use_scale_baseline=true")
    proc = essa("train", "--run-dir", str(run_dir), *overrides, env={"ESSA_PROGRESS_SECONDS": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    stdout.write_text(proc.stdout)  # written to a file by the run, as under Slurm or nohup
    return run_dir, stdout


@pytest.mark.slow
def test_train_writes_run_dir_and_loadable_adapter(three_generations: tuple[Path, Path]) -> None:
    run_dir, stdout = three_generations
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in (
        "baseline_accuracy",
        "final_accuracy",
        "generations",
        "wall_seconds",
        "adapter_dir",
    ):
        assert key in summary
    assert summary["generations"] == 3 and summary["test_size"] == 40
    assert_accuracy_over(40, summary["final_accuracy"])
    assert_accuracy_over(40, summary["baseline_accuracy"])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    gens = [r for r in records if r.get("generation", -1) >= 0]
    assert [r["generation"] for r in gens] == [0, 1, 2]
    for r in gens:  # the mean over 4 candidates of an accuracy over 8 prompts: k / 32
        assert_accuracy_over(4 * 8, r["mean_fitness"])
    assert "val_accuracy" in gens[1] and "heldout_accuracy" not in gens[1]  # test: start, end

    # The exported adapter is a plain PEFT LoRA on the bundled base, and differs from the SFT one.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from essa.backends.models import resolve_model_path

    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin:demo"))
    model = PeftModel.from_pretrained(base, summary["adapter_dir"])
    assert sum("lora_A" in n for n, _ in model.named_parameters()) > 0
    sft = load_file(str(run_dir / "sft_adapter" / "adapter_model.safetensors"))
    final = adapter_tensors(run_dir)
    assert set(sft) == set(final)
    sft_delta = {k: v for k, v in sft.items()}
    moved = any(not torch.allclose(final[k], sft_delta[k]) for k in final)
    assert moved == (summary["exported"]["point"] != "SFT adapter"), summary["exported"]
    assert_drift_report(summary["drift"], k=4, items=40)
    assert "drift: off-task KL(base||tuned)" in stdout.read_text()
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert_pass_drift(recs)

    # `essa eval` of the run's adapters prints the same figures (PEFT path vs population rows).
    res = essa(
        "eval",
        str(run_dir / "config.yaml"),
        "--adapter",
        str(run_dir / "adapter"),
        "--sft-adapter",
        str(run_dir / "sft_adapter"),
        "--json",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    printed = json.loads(res.stdout)["drift"]
    assert_drift_report(printed, k=4, items=40)
    for key in ("kl_base", "kl_sft", "kl_base_sft"):
        assert printed[key] == pytest.approx(summary["drift"][key], rel=1e-4, abs=1e-7), key
    assert printed["retention"] == summary["drift"]["retention"]
    assert printed["samples"] == summary["drift"]["samples"]  # the same per-row streams


def assert_pass_drift(recs: list[dict], check: str = "val_accuracy") -> None:
    """Every check during training (ESSA's on validation, ``check`` the record's key) logs
    off-task KL and the update size; no other record."""
    passes = [r for r in recs if r.get("generation", -1) >= 0 and check in r]
    assert passes
    for r in recs:
        if r not in passes:
            assert not any(k.startswith("drift_") for k in r), r
    for r in passes:
        assert r["drift_kl_base"] > 0 and r["drift_kl_sft"] > 0 and r["drift_update"] > 0, r


def assert_drift_report(report: dict, k: int, items: int) -> None:
    """The figures of docs/drift.md, all present and in range, and flattened for the trackers."""
    from essa.tracking import scalars

    assert report["kl_base"] > 0 and report["kl_sft"] >= 0 and report["kl_base_sft"] > 0
    assert report["kl_prompts"] == 32 and report["kl_positions"] >= 32
    for adapter in ("sft", "final", "search"):
        size = report["update"][adapter]
        assert 0 < size["mean"] <= size["max"] and size["matrices"] > 0
    kept = report["retention"]  # the demo's auto choice; its changes from base and from SFT
    assert kept["source"] == "builtin:arithmetic_mixed" and kept["items"] == 64
    for model in ("base", "sft", "tuned"):
        assert_accuracy_over(64, kept[model])
    assert kept["change_from_base"] == pytest.approx(kept["tuned"] - kept["base"])
    assert kept["change_from_sft"] == pytest.approx(kept["tuned"] - kept["sft"])
    samples = report["samples"]
    assert samples["k"] == k and samples["items"] == items
    assert samples["pass@1"] <= samples[f"pass@{k}"] and samples["answer_entropy"] >= 0
    assert_accuracy_over(items * k, samples[f"mean@{k}"])
    flat = scalars({"drift": report})
    for key in ("kl_base", "retention/tuned", f"samples/pass@{k}", "update/final/mean"):
        assert f"drift/{key}" in flat, key


@pytest.mark.slow
def test_existing_run_dir_is_not_overwritten(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "precious.txt").write_text("keep me")
    res = essa("train", "--run-dir", str(run_dir), *sets(*SMALL, "run.generations=1"))
    assert res.returncode == 2
    assert "--resume" in res.stderr and "Traceback" not in res.stderr
    assert (run_dir / "precious.txt").read_text() == "keep me"


def _launch(run_dir: Path, *args: str, env: dict[str, str] | None = None) -> CliProcess:
    return start("train", *args, env=env)


def _wait_for(proc: CliProcess, ready: Callable[[], bool], what: str) -> None:
    """Poll until the run has written what ``ready`` looks for; fail if it ends first.

    The run's own files are the synchronisation; the timeout only bounds a hung run, generously.
    """
    deadline = time.monotonic() + 900
    while not ready():
        if proc.poll() is not None:
            err = proc.communicate()[1][-3000:]
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {what}: {err}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {what} after 900 s")
        time.sleep(0.02)  # a poll interval: nothing waits on time passing


def _checkpoint_generation(run_dir: Path) -> int:
    path = run_dir / "checkpoint.json"
    return json.loads(path.read_text())["optimizer"]["generation"] if path.exists() else 0


@pytest.mark.slow
def test_kill_and_resume_matches_uninterrupted(tmp_path: Path) -> None:
    """kill -9 at three points (start-up, inside a checkpoint write, between generations) and a
    full disk mid-run; every resume continues bit-exactly. Each kill is placed by a file the run
    writes (or by the run itself, ESSA_FAULT), never by a sleep."""
    generations = ["run.generations=5", "evaluation.use_scale_baseline=false"]
    ref = tmp_path / "ref"
    res = essa("train", "--run-dir", str(ref), *sets(*SMALL, *generations))
    assert res.returncode == 0, res.stderr[-3000:]

    run_dir = tmp_path / "killed"
    metrics = run_dir / "metrics.jsonl"
    # 1. kill -9 in start-up, as soon as the run directory's config.yaml is written (SFT next).
    proc = _launch(run_dir, "--run-dir", str(run_dir), *sets(*SMALL, *generations))
    _wait_for(proc, lambda: (run_dir / "config.yaml").exists(), "config.yaml")
    proc.kill()
    proc.wait()
    assert not (run_dir / "summary.json").exists(), "the run finished before it could be killed"

    # 2. kill -9 inside the next-but-one checkpoint write: temp file synced, not yet renamed.
    done = _checkpoint_generation(run_dir)
    assert done <= 2, f"{done} generations checkpointed before the start-up kill landed"
    proc = _launch(run_dir, "--resume", str(run_dir), env={"ESSA_FAULT": f"kill@{done + 2}"})
    proc.wait(timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.communicate()[1][-3000:]
    assert (run_dir / ".checkpoint.json.tmp").exists()  # the write it was killed in
    assert _checkpoint_generation(run_dir) == done + 1  # the previous checkpoint, intact

    # 3. The disk fills up while the next checkpoint is written: one line, exit 2, kept state.
    res = essa("train", "--resume", str(run_dir), env={"ESSA_FAULT": f"enospc@{done + 3}"})
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert res.stderr.strip().splitlines()[-1] == (
        f"error: cannot write {run_dir / 'checkpoint.json'}: no space left on device; stopped, "
        f"the last checkpoint ({done + 2} generations done) intact; free space and continue "
        f"with: essa train --resume {run_dir}"
    )
    assert _checkpoint_generation(run_dir) == done + 2
    assert not (run_dir / ".checkpoint.json.tmp").exists()

    # 4. kill -9 between generations, with files in the run directory that must never be run.
    marker = tmp_path / "pwned"
    (run_dir / "evil.py").write_text(f"import os\nos.mkdir({str(marker)!r})\n")
    (run_dir / "checkpoint.pt").write_bytes(
        b"cos\nmkdir\n(V" + str(marker).encode() + b"\ntR."  # pickle: os.mkdir(marker)
    )
    target = done + 2
    proc = _launch(run_dir, "--resume", str(run_dir))
    _wait_for(
        proc, lambda: f'"generation": {target},' in metrics.read_text(), f"generation {target}"
    )
    proc.kill()
    proc.wait()

    res = essa("train", "--resume", str(run_dir))
    assert res.returncode == 0, res.stderr[-3000:]
    assert not marker.exists()
    a, b = adapter_tensors(ref), adapter_tensors(run_dir)
    assert set(a) == set(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    ref_summary = json.loads((ref / "summary.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_accuracy"] == ref_summary["final_accuracy"]
    gens = [json.loads(line)["generation"] for line in metrics.read_text().splitlines()]
    assert gens == [-1, 0, 1, 2, 3, 4]
    # samples.jsonl is truncated on resume like the metrics: the same rows as the uninterrupted run
    assert (run_dir / "samples.jsonl").read_text() == (ref / "samples.jsonl").read_text()


@pytest.mark.slow
def test_eval_command(tmp_path: Path) -> None:
    out = tmp_path / "eval.json"
    res = essa("eval", "--output", str(out), *sets("data.test_size=30"))
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["n"] == 30
    assert_accuracy_over(30, result["pass@1"])
    res = essa(
        "eval", *sets("data.test_size=10", "generation.temperature=1.0"), "--samples", "3", "--json"
    )
    assert res.returncode == 0, res.stderr[-3000:]
    sampled = json.loads(res.stdout)
    assert set(sampled) >= {"avg@3", "pass@1", "pass@3", "maj@3"}
    assert sampled["pass@1"] <= sampled["pass@3"]
    res = essa("eval", "--samples", "3")
    assert res.returncode == 2 and "generation.temperature" in res.stderr


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("model.name_or_path=/nonexistent/model", "model.name_or_path: no such directory"),
        (
            "adapter.target_modules=[not_a_module]",
            "adapter.target_modules: ['not_a_module'] not found",
        ),
        ("adapter.path=/nonexistent/adapter", "is not a PEFT adapter directory"),
        ("data.source=EMPTY", "empty"),
        ("reward.name=no_such_reward", "reward.name: unknown reward"),
        ("data.template=no_such_template", "data.template: unknown prompt template"),
    ],
)
def test_bad_input_one_line_exit_2(tmp_path: Path, override: str, fragment: str) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    override = override.replace("EMPTY", str(empty))
    res = essa("train", "--run-dir", str(tmp_path / "run"), *sets(*SMALL, override))
    assert res.returncode == 2, res.stderr[-2000:]
    assert fragment in res.stderr
    assert "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_bad_progress_interval_one_line_exit_2(tmp_path: Path) -> None:
    res = essa("train", "--run-dir", str(tmp_path / "run"), env={"ESSA_PROGRESS_SECONDS": "soon"})
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.stderr.strip() == (
        "error: ESSA_PROGRESS_SECONDS=soon: expected a number of seconds, 0 or more"
    )
    assert not (tmp_path / "run").exists()  # refused before the run directory is made


def test_unwritable_run_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")  # root ignores permission bits, so block with a file instead
    res = essa("train", "--run-dir", str(blocker / "run"), *sets(*SMALL))
    assert res.returncode == 2
    assert res.stderr.strip().startswith(f"error: run.dir {blocker / 'run'}: not writable")


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_checkpoints_and_exits(tmp_path: Path, signum: int, code: int) -> None:
    run_dir = tmp_path / "run"
    proc = _launch(run_dir, "--run-dir", str(run_dir), *sets(*SMALL, "run.generations=50"))
    metrics = run_dir / "metrics.jsonl"
    _wait_for(
        proc,
        lambda: metrics.exists() and '"generation": 0,' in metrics.read_text(),
        "generation 0 in metrics.jsonl",
    )
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == code, err[-3000:]
    assert "essa train --resume" in out
    state = json.loads((run_dir / "checkpoint.json").read_text())
    done = state["optimizer"]["generation"]  # generations told before the checkpoint
    assert not (run_dir / "summary.json").exists()
    gens = [json.loads(line)["generation"] for line in metrics.read_text().splitlines()]
    assert gens[-1] + 1 == len(gens) - 1  # records -1..g, nothing torn
    assert done == gens[-1] + 1


@pytest.mark.slow
def test_train_on_local_gsm8k_jsonl(tmp_path: Path) -> None:
    """A GSM8K-format JSONL (`answer` ends with `#### N`) trains end to end with math_accuracy."""
    data = tmp_path / "gsm8k.jsonl"
    with open(data, "w") as f:
        for a in range(10, 40):
            for b in range(0, 90, 9):
                f.write(
                    json.dumps(
                        {"question": f"{a}+{b}=", "answer": f"{a}+{b}={a + b}\n#### {a + b}"}
                    )
                    + "\n"
                )
    run_dir = tmp_path / "run"
    res = essa(
        "train",
        "--run-dir",
        str(run_dir),
        *sets(*SMALL, f"data.source={data}", "reward.name=math_accuracy", "run.generations=2"),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["test_size"] == 40 and summary["generations"] == 2
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in records:  # math_accuracy over 8 prompts, averaged over 4 candidates
        if r["generation"] >= 0:
            assert_accuracy_over(4 * 8, r["mean_fitness"])


@pytest.mark.slow
def test_plain_progress_lines_when_stdout_is_a_file(three_generations: tuple[Path, Path]) -> None:
    """stdout to a file (Slurm, nohup, CI): every phase prints plain lines with its progress
    while it runs, and logs them to phases.jsonl."""
    run_dir, stdout = three_generations
    lines = stdout.read_text().splitlines()

    def so_far(name: str) -> list[str]:  # the phase's progress lines, not its closing one
        return [x for x in lines if x.startswith(f"{name}: ") and " s so far" in x]

    for name in ("model load", "export"):  # nothing to count: elapsed time
        assert so_far(name), name
    sft = so_far("SFT")
    for step in range(1, 5):
        line = next(x for x in sft if x.startswith(f"SFT: {step}/4 steps, "))
        assert ", eta " in line and ", loss " in line and ", tokens/s " in line, line
    for name in ("held-out baseline", "scale baseline", "final held-out"):
        rows = [x for x in so_far(name) if " rows, " in x]
        assert any(", eta " in x for x in rows), (name, rows)
        done, total = rows[-1].split(": ", 1)[1].split(" ", 1)[0].split("/")
        assert done == total, rows[-1]
    loop = so_far("generations")
    for g in range(1, 4):  # each generation's summary line
        line = next(x for x in loop if x.startswith(f"generations: {g}/3 generations, "))
        assert ", fitness mean " in line and ", best " in line, line
    assert so_far("  generation 1")  # the rows of one generation, as they are generated
    records = [json.loads(x) for x in (run_dir / "phases.jsonl").read_text().splitlines()]
    logged = {r["phase"] for r in records if r["event"] == "progress"}
    assert logged >= {"model load", "SFT", "held-out baseline", "generations", "export"}
