"""bench.studies.tools' table from a result record and when it trains an SFT adapter (the runs
themselves are the bench's)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench.studies.tools import cost, step_seconds, summary_table, table


def arm(name: str, final: float, tools: dict | None, **cost: float) -> dict:
    return {"arm": name, "seed": 0, "sft": 0.5, "final": final, "steps": 21,
            "vs_sft": {"gain": final - 0.5, "se": 0.02}, "wall_seconds": 1200.0, "tools": tools,
            **cost}  # fmt: skip


def test_table_has_a_row_per_task_and_arm_with_tool_use() -> None:
    used = {"tool_calls_per_row": 1.2, "tool_error_rate": 0.02, "tool_output_used": 0.9,
            "tool_rows_0_calls": 0.1, "tool_rows_1_call": 0.6, "tool_rows_2plus_calls": 0.3,
            "tool_void_rows": 0.05}  # fmt: skip
    older = {"tool_calls_per_row": 1.0, "tool_error_rate": 0.0, "tool_output_used": 1.0}
    result = {"tasks": {"products": {
        "arms": {"text ESSA": [arm("text ESSA", 0.6, None)],
                 "tool ESSA": [arm("tool ESSA", 0.9, used)],
                 "tool GRPO": [arm("tool GRPO", 0.8, older)]},
        "pooled": {"text ESSA": {"gain": 0.1, "se": 0.02}, "tool ESSA": {"gain": 0.4, "se": 0.02},
                   "tool GRPO": {"gain": 0.3, "se": 0.02}},
    }}}  # fmt: skip
    lines = table(result).splitlines()
    assert len(lines) == 5
    assert lines[2] == (
        "| products | text ESSA | 1 | 0.500 | 0.600 | +0.100 (0.020) | 21 | - | - / - / - | - | - "
        "| - | - | - |"
    )
    assert lines[3].endswith("| 21 | 1.20 | 0.10 / 0.60 / 0.30 | 0.02 | 0.05 | 0.90 | - | - |")
    # a record written before the 0 / 1 / 2+ shares and void turns were kept
    assert lines[4].endswith("| 21 | 1.00 | - / - / - | 0.00 | - | 1.00 | - | - |")


def test_summary_table_has_a_cell_per_task_and_arm() -> None:
    result = {"tasks": {"products": {
        "arms": {"text ESSA": [arm("text ESSA", 0.6, None), arm("text ESSA", 0.7, None)],
                 "tool ESSA": [arm("tool ESSA", 0.9, None)]},
        "pooled": {"text ESSA": {"gain": 0.15, "se": 0.014}, "tool ESSA": {"gain": 0.4, "se": 0.02}},
    }}}  # fmt: skip
    assert summary_table(result).splitlines() == [
        "| task | text ESSA | tool ESSA | tool GRPO |",
        "|---|---|---|---|",
        "| products | 0.500 -> 0.650 (+0.150, SE 0.014) | 0.500 -> 0.900 (+0.400, SE 0.020) | - |",
    ]


def test_cost_cells_average_the_seconds_and_keep_the_largest_peak_rss() -> None:
    """Seconds a generation: the mean over seeds of each run's median; memory: the worst seed."""
    runs = [arm("tool ESSA", 0.9, None, step_seconds=44.5, peak_rss_mb=4021.6),
            arm("tool ESSA", 0.9, None, step_seconds=47.5, peak_rss_mb=4518.2)]  # fmt: skip
    assert cost(runs) == "46 | 4.5 GB |"
    assert cost([arm("tool ESSA", 0.9, None)]) == "- | - |"  # records from before the columns


def test_step_seconds_is_the_median_generation_without_the_baseline(tmp_path: Path) -> None:
    rows = [{"event": "baseline", "generation": -1, "seconds": 300.0}, {"generation": 0, "seconds": 40.0},
            {"generation": 1, "seconds": 50.0}, {"generation": 2, "seconds": 44.0}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert step_seconds(tmp_path) == 44.0


def test_an_sft_adapter_trains_once_and_only_for_an_arm_that_must_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An arm the archive restores needs no weights: its SFT adapter is not trained again."""
    import bench.studies.common as common
    import bench.studies.tools as tools

    monkeypatch.setattr(common, "ARCHIVE", tmp_path / "archive")
    trained: list[str] = []
    monkeypatch.setattr(tools, "sft_adapter", lambda *a: trained.append(a[3]))
    root = tmp_path / "runs" / "products"
    root.mkdir(parents=True)
    config = root / "config.yaml"
    config.write_text("sft: {steps: 48}\n")
    args = argparse.Namespace(reuse=True, threads=1)
    sets_ = [f"adapter.path={tools.sft_path(root, 'tool', 0)}"]
    command = common.essa_command(config, 0, root, sets_, "tool")

    done: set[str] = set()
    tools.arm_adapter(config, 0, root, "tool", [], [command], done, args)
    tools.arm_adapter(config, 0, root, "tool", [], [command], done, args)  # the GRPO arm
    assert trained == ["tool"]

    cmd_args, log, keep = command
    keep[0].parent.mkdir(parents=True)
    (keep[0].parent / "config.yaml").write_text(
        json.dumps(common.effective(cmd_args, config.read_text())["config"])
    )
    for path in keep[1:]:
        path.write_text("{}\n")
    common.archive(cmd_args, log, 1140.0, keep)  # the arm ran and was archived ...
    for path in keep:
        path.unlink()  # ... on another machine: restorable, no SFT
    tools.arm_adapter(config, 0, root, "tool", [], [command], set(), args)
    assert trained == ["tool"]
    tools.arm_adapter(
        config, 0, root, "tool", [], [command], set(), argparse.Namespace(reuse=False, threads=1)
    )
    assert trained == ["tool", "tool"]


def test_the_tool_task_probe_tables_each_task_and_says_whether_it_is_in_range() -> None:
    """bench.studies.tool_tasks: per task the code-call SFT adapter's mean held-out score over
    seeds (and each seed's), its tool use, and whether the start lies in [0.2, 0.7]."""
    from bench.studies.tool_tasks import in_range
    from bench.studies.tool_tasks import table as probe_table

    def probe(seed: int, score: float, **tools: float) -> dict:
        return {"seed": seed, "mean_score": score, "n": 500, **tools}

    used = {"tool_calls_per_row": 1.1, "tool_rows_0_calls": 0.0, "tool_rows_1_call": 0.9,
            "tool_rows_2plus_calls": 0.1, "tool_error_rate": 0.05, "tool_void_rows": 0.02}  # fmt: skip
    result = {"tasks": {"word_sorting": [probe(0, 0.2, **used), probe(1, 0.3, **used)],
                        "products": [probe(0, 0.99)]}}  # fmt: skip
    lines = probe_table(result).splitlines()
    assert lines[2] == (
        "| word_sorting | 2 | 0.250 (0.200, 0.300) | 500 | 1.10 | 0.00 / 0.90 / 0.10 | 0.05 "
        "| 0.02 | yes |"
    )
    assert lines[3].endswith("| - | - / - / - | - | - | no (ceiling) |")
    assert [in_range(x) for x in (0.199, 0.2, 0.7, 0.701)] == ["no (floor)", "yes", "yes",
                                                                "no (ceiling)"]  # fmt: skip
