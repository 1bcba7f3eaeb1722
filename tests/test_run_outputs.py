"""What a run writes beside its metrics, for both recipes through the real CLI on the demo model:
the held-out metric (``evaluation.metric``) named in the summary, samples.jsonl at every
evaluation, and a TensorBoard event file read back.

The held-out split is cut to 4 items, the samples shown per evaluation, so the samples hold every
held-out completion and the summary's scores can be recomputed from them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from essa.harness import HELDOUT_RECORD_KEYS
from essa.rewards import get_reward
from tests.conftest import GRPO_SETS
from tests.test_train_e2e import essa, sets

TINY = [
    "sft.steps=4",
    "data.sft_size=32",
    "data.test_size=4",
    "evaluation.every=1",
    "run.generations=2",
    "run.show_progress=false",
    "run.report_to=[tensorboard]",
    "evaluation.metric=exact_match",
]
ESSA = ["data.batch_size=8", "optimizer.population_size=4"]
GRPO = GRPO_SETS
SAMPLE_KEYS = {"generation", "prompt", "completion", "extracted", "reference", "reward"}


def samples(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def check_samples_and_metric(run_dir: Path, summary: dict, checked: tuple[int, ...]) -> None:
    """Samples at the baseline, after each held-out check (``checked``: GRPO's; ESSA checks on
    validation, whose items are no samples) and at the end; scores recomputed."""
    rows = samples(run_dir)
    assert [r["generation"] for r in rows] == [g for g in (-1, *checked, 2) for _ in range(4)]
    assert all(set(r) == SAMPLE_KEYS for r in rows)
    assert all(r["reference"] is not None and r["prompt"] for r in rows)
    exact = get_reward("exact_match")
    for generation, key in ((-1, "baseline_accuracy"), (2, "final_accuracy")):
        at = [r for r in rows if r["generation"] == generation]
        texts, refs = [r["completion"] for r in at], [r["reference"] for r in at]
        recomputed = [s or 0.0 for s in exact(texts, refs, [r["prompt"] for r in at])]
        assert [r["reward"] for r in at] == recomputed
        assert summary[key] == pytest.approx(sum(recomputed) / len(recomputed))
    assert summary["heldout_metric"] == "exact_match"
    check_heldout_scores(run_dir, summary)


def check_heldout_scores(run_dir: Path, summary: dict) -> None:
    """Every held-out pass's per-item scores: their means are the reported accuracies."""
    passes = [
        json.loads(line) for line in (run_dir / "heldout_scores.jsonl").read_text().splitlines()
    ]
    sizes = {len(p["scores"]) for p in passes}
    assert sizes == {summary.get("test_size", next(iter(sizes)))} and 0 not in sizes
    baseline = next(
        p for p in passes if p["generation"] == -1 and not p.get("pass", "").startswith("scale")
    )
    final = next(p for p in passes if p["final"])
    for record, key in ((baseline, "baseline_accuracy"), (final, "final_accuracy")):
        assert sum(record["scores"]) / len(record["scores"]) == pytest.approx(summary[key])
    if summary["scale_baseline_ran"]:
        scale = next(p for p in passes if p.get("pass") == "scale baseline held-out")
        mean = sum(scale["scores"]) / len(scale["scores"])
        assert mean == pytest.approx(summary["scale_baseline"]["heldout_accuracy"])


@pytest.mark.parametrize(("metric", "expected"), [("math_accuracy", 1.0), ("exact_match", 0.0)])
def test_heldout_score_follows_evaluation_metric(
    tmp_path: Path, metric: str, expected: float
) -> None:
    """The same completions score differently under the two metrics; samples carry the score."""
    from essa.config import load_config
    from essa.dist import get_comm
    from essa.harness import Harness
    from essa.types import Example

    cfg = load_config(None, [f"evaluation.metric={metric}"])
    h = Harness(cfg, tmp_path, resume=False, console=None, comm=get_comm())
    with h:
        assert h.metric_name == metric
        examples = [Example("1/2 as a decimal?", "0.5"), Example("6/2?", "3")]
        texts = ["The answer is \\boxed{1/2}", "#### 3.0"]  # right, not written as the reference
        assert h.score(texts, examples, ["p1", "p2"], generation=-1) == expected
        assert (
            h.summary(baseline=0, final=0, steps=0, adapter_dir=tmp_path)["heldout_metric"]
            == metric
        )
    assert [r["reward"] for r in samples(tmp_path)] == [expected, expected]


def check_tensorboard(
    run_dir: Path, summary: dict, fitness_key: str, checked: tuple[int, ...]
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [(e.step, e.value) for e in events.Scalars(fitness_key)]
    assert logged == [
        (r["generation"] + 1, pytest.approx(r[fitness_key])) for r in metrics[1:]
    ]  # step = generations done; the baseline (no fitness) is step 0
    steps = [g + 1 for g in checked]
    assert [e.step for e in events.Scalars("heldout_accuracy")] == [0, *steps]
    if not checked:  # ESSA: the mean on validation after every generation (evaluation.every 1)
        assert [e.step for e in events.Scalars("val_accuracy")] == [1, 2]
    assert events.Scalars("summary/final_accuracy")[0].value == pytest.approx(
        summary["final_accuracy"]
    )
    text = {tag: events.Tensors(f"{tag}/text_summary") for tag in ("config", "samples", "summary")}
    assert b"exact_match" in text["summary"][0].tensor_proto.string_val[0]
    assert len(text["samples"]) == 2 + len(checked)  # baseline, held-out checks, final
    assert b"report_to" in text["config"][0].tensor_proto.string_val[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("recipe", "fitness_key", "checked"),
    [(ESSA, "mean_fitness", ()), (GRPO, "mean_reward", (0, 1))],
    ids=["essa", "grpo"],
)
def test_run_writes_samples_tracker_and_names_metric(
    tmp_path: Path, recipe: list[str], fitness_key: str, checked: tuple[int, ...]
) -> None:
    run_dir = tmp_path / "run"
    res = essa("train", "--run-dir", str(run_dir), *sets(*TINY, *recipe))
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert f"held-out exact_match {summary['baseline_accuracy']:.3f}" in res.stdout
    assert "samples (SFT start)" in res.stdout  # the compact console table
    assert Path(summary["adapter_dir"]).is_absolute()
    assert Path(summary["sft_adapter_dir"]).is_absolute()
    assert summary["scale_baseline_ran"] is (recipe is ESSA)  # the demo runs it; GRPO has none
    check_samples_and_metric(run_dir, summary, checked)
    check_tensorboard(run_dir, summary, fitness_key, checked)


def after_the_loop(stdout: str, unit: str) -> list[str]:
    """The lines a piped run prints after its loop's closing line (``generations: 2/2 ...``)."""
    lines = stdout.splitlines()
    end = max(i for i, x in enumerate(lines) if x.startswith(f"{unit}: ") and f" {unit} in " in x)
    return lines[end + 1 :]


@pytest.mark.slow
def test_every_recipe_ends_on_a_short_summary_and_writes_one_record_format(
    tmp_path: Path,
) -> None:
    """Piped, a run ends on a few lines (score from start to end, time, what was exported and
    the next commands); the summary is summary.json, on stdout only with --json. ESSA and GRPO
    write heldout_scores.jsonl in one format: the same keys and pass names."""
    records = {}
    for name, recipe, unit, flags in [
        ("essa", ESSA, "generations", []),
        ("grpo", GRPO, "steps", ["--json"]),
    ]:
        run_dir = tmp_path / name
        shown = sets(*TINY, *recipe, "run.show_progress=true")  # as a first run shows it
        res = essa("train", "--run-dir", str(run_dir), *flags, *shown)
        assert res.returncode == 0, res.stderr[-3000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        tail = after_the_loop(res.stdout, unit)
        if flags:  # --json: the summary, last, after the human lines
            start = tail.index("{")
            assert json.loads("\n".join(tail[start:])) == summary
            tail = tail[:start]
        assert "{" not in tail and len(tail) <= 15, "\n".join(tail)
        assert tail[-6].startswith(f"held-out exact_match {summary['baseline_accuracy']:.3f} -> ")
        assert tail[-6].endswith(f" after 2 {unit} in {summary['wall_seconds']:.0f} s")
        assert tail[-4].startswith(f"adapter:  {run_dir / 'adapter'}")
        assert tail[-3] == f"evaluate: essa eval {run_dir}/config.yaml --adapter {run_dir}/adapter"
        assert tail[-2].startswith(f"compare:  essa compare {run_dir} ")
        assert tail[-1] == f"export:   essa export {run_dir} --merged {run_dir}/merged"
        lines = (run_dir / "heldout_scores.jsonl").read_text().splitlines()
        records[name] = [json.loads(line) for line in lines]
    keys = {name: {frozenset(r) for r in rs} for name, rs in records.items()}
    assert keys["essa"] == keys["grpo"] == {frozenset(HELDOUT_RECORD_KEYS)}
    passes = {name: [r["pass"] for r in rs] for name, rs in records.items()}
    assert passes["grpo"] == ["held-out baseline", "held-out", "held-out", "final held-out"]
    # ESSA checks its search on a validation split; its one held-out pass of its own is the
    # no-search baseline (the SFT adapter scaled).
    assert passes["essa"] == ["held-out baseline", "scale baseline held-out", "final held-out"]


@pytest.mark.slow
def test_eval_prints_a_summary_and_the_json_only_when_asked(tmp_path: Path) -> None:
    out = tmp_path / "eval.json"
    res = essa("eval", "--output", str(out), *sets("data.test_size=4"))
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(out.read_text())
    lines = res.stdout.splitlines()
    assert lines[0] == (
        f"held-out math_accuracy on 4 items (builtin:demo): pass@1 {result['pass@1']:.3f}, "
        f"mean_score {result['mean_score']:.3f}"
    )
    assert lines[-1] == f"result:   {out} (items: {tmp_path / 'eval.items.jsonl'})"
    assert len(lines) <= 3 and "{" not in res.stdout
    res = essa("eval", "--json", *sets("data.test_size=4"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert {k: v for k, v in json.loads(res.stdout).items() if k != "items"} == {
        k: v for k, v in result.items() if k != "items"
    }


def test_a_phase_prints_its_first_plain_line_soon() -> None:
    """Off a terminal a phase's first progress line comes after ``first`` seconds, not a whole
    interval: a log never goes 30 s without a line while a model loads or SFT starts."""
    import io
    import time

    from rich.console import Console

    from essa.harness import FIRST_LINE_SECONDS, Reporter

    assert Reporter(None, interval=30).first == FIRST_LINE_SECONDS <= 10
    out = io.StringIO()
    reporter = Reporter(Console(file=out, width=200), interval=30, first=0.05)
    with reporter.phase("model load"):
        deadline = time.monotonic() + 20
        while "model load: " not in out.getvalue():  # the line is the event waited for
            assert time.monotonic() < deadline, "no first line within 20 s of a 30-s interval"
            time.sleep(0.01)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("model load: ") and lines[0].endswith(" s so far")
    assert lines[1].startswith("model load: in ") and len(lines) == 2  # then the interval


def test_library_bars_are_off_where_stderr_is_a_file() -> None:
    """tqdm bars (transformers' GGUF conversion draws one outside its own switch) redraw with
    carriage returns: in a log file they would be one long line, so the CLI turns them off."""
    import subprocess
    import sys

    code = (
        "from essa.cli import _setup_logging; _setup_logging(); from tqdm.auto import tqdm; "
        "list(tqdm(range(50), desc='Converting and de-quantizing GGUF tensors...'))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "\r" not in res.stderr and "GGUF" not in res.stderr, res.stderr


def test_trackers_close_when_the_run_fails(tmp_path: Path) -> None:
    """``with harness:`` flushes the event file even when the run raises (SummaryWriter would
    otherwise hold the record for up to two minutes)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from essa.config import load_config
    from essa.dist import get_comm
    from essa.harness import Harness

    cfg = load_config(None, ["run.report_to=[tensorboard]"])
    h = Harness(cfg, tmp_path, resume=False, console=None, comm=get_comm())
    with pytest.raises(RuntimeError), h:
        h.log({"generation": -1, "event": "baseline", "heldout_accuracy": 0.5})
        raise RuntimeError("model load failed")
    assert h.trackers.trackers == []
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("heldout_accuracy")] == [(0, 0.5)]
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["heldout_accuracy"] == 0.5
