"""bench/benchmarks/gpu_check.py runs end to end on CPU at tiny shapes (the GPU figures need a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_smoke_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "bench.benchmarks.gpu_check", "--device", "cpu", "--tiny", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [c["dtype"] for c in result["cells"]] == ["bfloat16", "float32"]
    bf16, fp32 = result["cells"]
    assert set(bf16["runs"]) == {"plain", "batched"} and bf16["merged"] == "refused in bfloat16"
    assert set(fp32["runs"]) == {"plain", "batched", "merged"}
    for cell in result["cells"]:
        assert all(run["new_tokens"] > 0 for run in cell["runs"].values())
        assert all(run["tokens_per_second"] > 0 for run in cell["runs"].values())
    assert result["separation"]["max_abs_difference_bf16"] > 0  # candidates stay apart
