"""Samples to read (RUN_DIR/samples.jsonl, the console table) and essa eval's per-item records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from essa.samples import print_samples, sample_rows, samples_log, write_samples
from tests.cli_runner import essa


def test_sample_rows_log_and_resume_truncation(tmp_path: Path) -> None:
    questions = ["12+30=", "7+8=", "1+1=", "5+5=", "9+9="]
    completions = ["42", "16", "2\nmore", "x", "18"]
    answers = ["42", "15", "2", "10", "18"]
    log = samples_log(tmp_path)
    for g in (-1, 9, 19):
        write_samples(
            log, sample_rows(g, questions, completions, answers, [1.0, 0.0, 1.0, None, 1.0])
        )
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 12  # 4 per evaluation, the same prompts each time
    assert rows[1] == {
        "generation": -1,
        "prompt": "7+8=",
        "completion": "16",
        "extracted": "16",
        "reference": "15",
        "reward": 0.0,
    }
    assert rows[3]["extracted"] is None and rows[3]["reward"] is None
    log.truncate_after(9)  # resume from the checkpoint after generation 9
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert {r["generation"] for r in rows} == {-1, 9}


def test_console_table_is_compact() -> None:
    from rich.console import Console

    console = Console(record=True, width=100, force_terminal=False)
    long = "What is " + "very " * 30 + "long?"
    rows = sample_rows(9, ["12+30=", long], ["42", "a\nb"], ["42", "7"], [1.0, 0.0])
    print_samples(console, rows)
    text = console.export_text()
    lines = text.splitlines()
    assert lines[0].rstrip() == "samples after generation 9"
    assert len(lines) == 4 and all(len(line) <= 100 for line in lines)  # one line per sample
    assert "12+30=" in text and "1.00" in text and "…" in text and "a⏎ b" in text
    print_samples(None, rows)  # no console (other MPI ranks): nothing


@pytest.mark.slow
def test_eval_output_writes_items_beside_aggregate(tmp_path: Path) -> None:
    out = tmp_path / "eval.json"
    res = essa("eval", "--output", str(out), "--set", "data.test_size=6")
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["metric"] == "math_accuracy" and result["items"] == str(
        tmp_path / "eval.items.jsonl"
    )
    items = [json.loads(line) for line in (tmp_path / "eval.items.jsonl").read_text().splitlines()]
    assert len(items) == 6
    assert set(items[0]) == {"prompt", "completion", "extracted", "reference", "reward", "sample"}
    assert "+" in items[0]["prompt"] and "<" not in items[0]["prompt"]  # the question itself
    assert result["pass@1"] == pytest.approx(sum(i["reward"] or 0 for i in items) / 6)
    res = essa(
        "eval",
        "--output",
        str(out),
        "--set",
        "data.test_size=6",
        "--set",
        "evaluation.metric=exact_match",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    exact = json.loads(out.read_text())
    assert exact["metric"] == "exact_match"
    items = [json.loads(line) for line in (tmp_path / "eval.items.jsonl").read_text().splitlines()]
    assert exact["pass@1"] == pytest.approx(sum(i["reward"] or 0 for i in items) / 6)


def test_eval_pass_at_1_counts_full_credit_and_mean_score_keeps_partial() -> None:
    """A graded held-out metric (gym_score gives partial credit): pass@1 is the share of items
    with full credit, mean_score the mean as training reports it."""
    from essa.api import heldout_samples
    from essa.backends.models import load_model
    from essa.config import load_config
    from essa.data.task import load_task

    cfg = load_config(None, ["data.test_size=4", "generation.max_new_tokens=2"])
    model, tokenizer = load_model(cfg.model)
    examples = load_task(cfg.data, 0).test

    def graded(texts: list[str], answers: list, rows: list[str]) -> list[float | None]:
        return [1.0, 0.5, 0.25, None][: len(texts)]

    metrics, items = heldout_samples(cfg, model, tokenizer, examples, 1, graded)
    assert metrics == {"pass@1": 0.25, "mean_score": pytest.approx(1.75 / 4)}
    assert [i["reward"] for i in items] == [1.0, 0.5, 0.25, None]
