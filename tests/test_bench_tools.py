"""bench.tools' table from a result record (the runs themselves are the bench's)."""

from __future__ import annotations

from bench.tools import table


def arm(name: str, final: float, tools: dict | None) -> dict:
    return {"arm": name, "seed": 0, "sft": 0.5, "final": final, "steps": 21,
            "vs_sft": {"gain": final - 0.5, "se": 0.02}, "wall_seconds": 1200.0, "tools": tools}  # fmt: skip


def test_table_has_a_row_per_task_and_arm_with_tool_use() -> None:
    used = {"tool_calls_per_row": 1.0, "tool_error_rate": 0.02, "tool_output_used": 0.9}
    result = {"tasks": {"products": {
        "arms": {"text ESSA": [arm("text ESSA", 0.6, None)],
                 "tool ESSA": [arm("tool ESSA", 0.9, used)]},
        "pooled": {"text ESSA": {"gain": 0.1, "se": 0.02}, "tool ESSA": {"gain": 0.4, "se": 0.02}},
    }}}  # fmt: skip
    lines = table(result).splitlines()
    assert len(lines) == 4
    assert (
        lines[2] == "| products | text ESSA | 1 | 0.500 | 0.600 | +0.100 (0.020) | 21 | - | - | - |"
    )
    assert lines[3].endswith("| 21 | 1.00 | 0.02 | 0.90 |")
