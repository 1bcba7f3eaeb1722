"""The benchmark suite: each new bench module at toy size, report rows, and the rendered report.

Timings here are real but tiny; the tests check structure and invariants (same completions,
counts, the report naming every benchmark), never speed.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from bench import suite
from bench.benchmarks import generation_overhead, optimizer_timing, strategies
from bench.common import median_spread, read_result, record_json, write_result

REPO = Path(__file__).resolve().parent.parent
ROW_KEYS = {"row", "value", "target", "met", "note"}


def check_rows(rows: list[dict]) -> None:
    assert rows
    for r in rows:
        assert set(r) == ROW_KEYS
        assert isinstance(r["value"], str) and r["value"]
        assert r["met"] is None or isinstance(r["met"], bool)


def test_median_spread() -> None:
    assert median_spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}


def test_write_result_adds_provenance(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    write_result("toy", {"cells": [1]}, "python -m bench.toy --x 1")
    result = read_result("toy")
    assert result is not None
    assert result["command"] == "python -m bench.toy --x 1"
    assert result["cells"] == [1]
    assert result["machine"]["cpu_count"] >= 1
    assert result["versions"]["essa-align"] is not None
    assert read_result("missing") is None


@pytest.mark.parametrize("method", list(optimizer_timing.METHODS))
def test_optimizer_timing_cell(method: str) -> None:
    cell = optimizer_timing.time_optimizer(method, 30, 8, iterations=3, max_seconds=60)
    assert cell["iterations"] == 3 and not cell["capped"]
    assert 0 < cell["ask_tell_seconds"]["min"] <= cell["ask_tell_seconds"]["max"]
    assert (cell["eigen_updates"] is None) == (method != "cma_es full")


def test_optimizer_timing_cap_stops_early() -> None:
    cell = optimizer_timing.time_optimizer("cma_es sep", 20, 8, iterations=1000, max_seconds=0.0)
    assert cell["iterations"] == 1 and cell["capped"]


@pytest.mark.slow
def test_optimizer_timing_rows_with_a_measured_generation() -> None:
    result = {
        "cells": [optimizer_timing.time_optimizer("openai_es", 50, 4, 2, 60)],
        "generation": [optimizer_timing.generation_seconds(4, repeats=1)],
    }
    rows = optimizer_timing.report_rows(result)
    check_rows(rows)
    assert "% of a demo generation" in rows[0]["value"]


def test_strategies_cell_agrees_and_reports() -> None:
    setup = strategies.build()
    cell = strategies.time_cell(setup, population=4, n_prompts=4, repeats=1, merged_candidates=2)
    assert cell["same_completions"]
    # auto chose the strategy its own probes measured as cheaper per candidate (not the slower).
    probe = cell["auto_probe_per_candidate"]
    assert probe["batched"] > 0 and probe["merged"] > 0
    assert cell["auto_choice"] == ("batched" if probe["batched"] <= probe["merged"] else "merged")
    assert 1 <= cell["auto_probes"] <= 3
    rows = strategies.report_rows({"cells": [cell], "skipped": ["P=64/N=256"]})
    check_rows(rows)
    assert "P=64/N=256" in rows[-1]["note"]


def _cell(choice: str, batched: float, merged: float) -> dict:
    """A strategies cell with given medians (s), as time_cell writes it."""
    seconds = {"batched": median_spread([batched]), "merged": median_spread([merged])}
    best = min(seconds, key=lambda k: seconds[k]["median"])
    return {
        "population": 8, "prompts": 16, "seconds": seconds, "merged_extrapolated": False,
        "batched_speedup": merged / batched, "better": best, "auto_choice": choice,
        "auto_vs_best": seconds[choice]["median"] / seconds[best]["median"],
        "auto_probe_seconds": 0.1, "auto_probes": 1, "same_completions": True,
        "auto_probe_per_candidate": {"batched": batched, "merged": merged},
    }  # fmt: skip


def test_strategies_report_flags_auto_choosing_the_slower_strategy() -> None:
    good = strategies.report_rows({"cells": [_cell("batched", 1.0, 2.0)]})
    assert good[0]["met"] is True and good[-1]["met"] is True
    assert "x1.00 of best" in good[0]["value"]
    bad = strategies.report_rows({"cells": [_cell("batched", 1.0, 2.0), _cell("merged", 1.0, 2.0)]})
    assert bad[0]["met"] is True and bad[1]["met"] is False and bad[-1]["met"] is False
    assert "x2.00 of best" in bad[1]["value"] and "missed: auto chose merged" in bad[1]["note"]
    assert bad[-1]["value"].startswith("worst x2.00")


def test_generation_overhead_demo_cell() -> None:
    cell = generation_overhead.measure("demo", repeats=1, seed=0, shape=(2, 4, 3))
    assert cell["sequences"] == 8
    assert set(cell["seconds"]) == {"essa", "plain peft", "plain merged"}
    assert cell["auto_choice"] in ("batched", "merged")
    assert all(tokens > 0 for tokens in cell["new_tokens"].values())
    rows = generation_overhead.report_rows({"cells": [cell], "skipped": {}})
    check_rows(rows)
    assert [r["target"] for r in rows] == ["<= 1.15x", "<= 1.15x"]


def test_recorded_results_render() -> None:
    """Every suite module has a recorded bench/results/<name>.json, and every recorded result of
    a listed module renders its own rows (not the "unreadable result" fallback)."""
    recorded = set()
    for name, _, in_suite in suite.known():
        path = REPO / "bench" / "results" / f"{name}.json"
        if not path.exists():
            assert not in_suite, f"{name} is in the suite but has no recorded result"
            continue
        rows = suite.rows_for(name, json.loads(path.read_text()))
        check_rows(rows)
        assert rows[0]["value"] != "unreadable result", rows[0]["note"]
        recorded.add(name)
    assert {"strategies", "optimizer_timing", "generation_overhead"} <= recorded


def test_report_only_lists_every_benchmark(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cell = optimizer_timing.time_optimizer("openai_es", 10, 4, 2, 60)
    gen = {"population": 4, "prompts": 64, "seconds": median_spread([0.5, 0.6])}
    write_result("optimizer_timing", {"cells": [cell], "generation": [gen]}, "python -m x")
    assert suite.main(["--report-only"]) == 0
    text = (tmp_path / "docs" / "performance.md").read_text()
    assert "`python -m x`" in text
    assert "| openai_es ask+tell, D=10 | P=4: " in text
    for name, _, _ in suite.known():
        assert f"### {name}" in text
    assert text.count("not run yet") == len(suite.known()) - 1


def test_results_page_tables_are_the_studies_own() -> None:
    """The results pages' tables are copied from the studies' files, so they cannot drift."""
    pages = [REPO / "docs" / name for name in ("results.md", "results-demo.md")]
    texts = [page.read_text() for page in pages]
    blocks = [b for text in texts for b in suite.TABLE_BLOCK.findall(text)]
    assert len(blocks) >= 8
    named = {b[1] for b in blocks}
    assert {"bench/results/demo.json", "bench/results/label_free.json"} <= named
    assert {"bench/results/real_model_table.md", "bench/results/tools.md"} <= named
    for page, text in zip(pages, texts, strict=True):
        assert suite.sync_tables(text, REPO) == text, (
            f"{page.name}: run python -m bench --report-only"
        )


def test_every_docs_table_block_is_its_study_file() -> None:
    """A table block on README or any page of docs/ is synced as on results.md's, so none
    drifts."""
    paths = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    pages = {str(p.relative_to(REPO)): p.read_text() for p in paths}
    blocked = {name for name, text in pages.items() if suite.TABLE_BLOCK.search(text)}
    assert {"README.md", "docs/results.md", "docs/drift.md", "docs/real-model.md"} <= blocked
    for name in blocked:
        assert suite.sync_tables(pages[name], REPO) == pages[name], (
            f"{name}: run python -m bench --report-only"
        )


def test_sync_tables_replaces_a_stale_block(tmp_path: Path) -> None:
    (tmp_path / "study.md").write_text("Title\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    stale = "x\n<!-- table: study.md -->\n| a |\n|---|\n| 0 |\n<!-- end table -->\ny\n"
    fresh = suite.sync_tables(stale, tmp_path)
    assert (
        fresh
        == "x\n<!-- table: study.md -->\n| a | b |\n|---|---|\n| 1 | 2 |\n<!-- end table -->\ny\n"
    )


def test_sync_tables_renders_a_json_record_with_its_study(tmp_path: Path) -> None:
    """A block naming <study>.json is the table bench.<study>.record_table renders from it."""
    summary = {"test_size": 100, "baseline_accuracy": 0.5, "final_accuracy": 0.75,
               "scale_baseline": {"heldout_accuracy": 0.625}}  # fmt: skip
    record = {"runs": [{"summary": summary, "command_wall_seconds": 60.0}]}
    (tmp_path / "demo.json").write_text(json.dumps(record))
    stale = "<!-- table: demo.json -->\n| old |\n<!-- end table -->\n"
    fresh = suite.sync_tables(stale, tmp_path)
    assert "| SFT adapter (the starting point) | 0.500 |" in fresh
    assert "| ESSA (CMA-ES over singular values, distribution mean) | 0.750 |" in fresh
    assert "| old |" not in fresh and "Gain of ESSA" not in fresh  # table lines only


def modules_of(folder: Path) -> set[str]:
    return {p.stem for p in folder.glob("*.py")} - {"__init__", "__main__"}


def test_every_bench_module_is_listed_in_one_place() -> None:
    """bench/ separates benchmarks (bench/benchmarks/: SUITE or ON_DEMAND) from studies
    (bench/studies/: STUDIES); every other module is a named helper. A driver listed nowhere is
    a one-off that would rot, and a benchmark among the studies (or the reverse) is misfiled."""
    benchmarks = {n for n, _ in suite.SUITE} | {n for n, _ in suite.ON_DEMAND}
    studies = {n for n, _ in suite.STUDIES}
    helpers = set(suite.HELPERS)
    assert modules_of(REPO / "bench" / "benchmarks") - helpers == benchmarks
    assert modules_of(REPO / "bench" / "studies") - helpers == studies
    assert modules_of(REPO / "bench") <= helpers  # the suite and the records it reads
    found = modules_of(REPO / "bench") | modules_of(REPO / "bench" / "benchmarks")
    assert helpers <= found | modules_of(REPO / "bench" / "studies")


def test_every_driver_runs_by_its_module_path() -> None:
    """`python -m bench --list` names each driver's module in its own package."""
    for name, _ in [*suite.SUITE, *suite.ON_DEMAND]:
        assert suite.module(name) == f"bench.benchmarks.{name}"
    for name, _ in suite.STUDIES:
        assert suite.module(name) == f"bench.studies.{name}"
    assert {n for n, _, _ in suite.known() if suite.kind_of(n) == "study"} == {
        "demo",
        "peers",
        "trl_grpo",
        "lisa",
    }  # the studies with report rows


def test_benchmarks_never_import_a_study() -> None:
    """A benchmark stands alone: what it shares with studies lives in bench/common.py."""
    for path in sorted((REPO / "bench" / "benchmarks").glob("*.py")):
        imports = re.findall(r"^\s*(?:from|import) (bench\.\w+)", path.read_text(), re.M)
        assert "bench.studies" not in imports, path.name


def test_unknown_benchmark_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert suite.main(["no_such_bench"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown benchmark") and err.count("\n") == 1


@pytest.mark.slow
def test_suite_runs_a_module_in_a_fresh_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the fresh process finds `bench` from tmp_path
    args = [
        "--dims",
        "10",
        "--populations",
        "4",
        "--methods",
        "openai_es",
        "--iterations",
        "2",
        "--repeats",
        "1",
        *suite.thread_args("optimizer_timing", 1),
    ]
    run = suite.run_one("optimizer_timing", args)
    assert run["exit_code"] == 0, (tmp_path / "runs/bench-suite/optimizer_timing.log").read_text()
    result = read_result("optimizer_timing")
    assert result is not None
    assert result["command"].startswith("python -m bench.benchmarks.optimizer_timing --dims 10")
    assert result["machine"]["torch_threads"] == 1
    failed = suite.run_one("optimizer_timing", ["--dims", "-5"])
    assert failed["exit_code"] != 0


def test_bench_results_in_git_stay_under_one_megabyte() -> None:
    """The records kept in git (summary JSONs, plots, one compressed run archive per study) stay
    under 1 MB, so a clone does not carry every run's files: the sizes are git's own blobs."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: nothing is tracked")
    listed = subprocess.run(
        ["git", "ls-files", "-s", "bench/results"], cwd=REPO, capture_output=True, text=True,
        check=True,
    ).stdout.splitlines()  # fmt: skip
    blobs = "".join(line.split()[1] + "\n" for line in listed)
    sizes = subprocess.run(
        ["git", "cat-file", "--batch-check=%(objectsize)"], cwd=REPO, input=blobs,
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert len(sizes) == len(listed) > 10  # the summaries are there and every blob was sized
    total = sum(map(int, sizes))
    assert total < 1_000_000, f"bench/results holds {total:,} bytes in git (budget 1,000,000)"


def test_record_json_round_trips_and_keeps_curves_on_one_line() -> None:
    record = {"runs": [{"seed": 0, "curve": [0.5, 0.25, None], "tags": []}], "empty": {}, "n": 3}
    text = record_json(record)
    assert json.loads(text) == record
    assert '"curve": [0.5, 0.25, null]' in text  # a list of scalars stays on one line
    assert text.count("\n") == 11  # one key a line elsewhere, ending in a newline
