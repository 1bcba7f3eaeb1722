"""A clean first run: no library warning on stderr, and the last lines say what to do next."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Runs the CLI with matplotlib made unimportable, as on a fresh install without the [plot] extra
# (this venv has matplotlib, which would hide pycma's import-time warning).
NO_MATPLOTLIB = (
    "import sys; sys.modules['matplotlib'] = None; sys.modules['matplotlib.pyplot'] = None; "
    "from essa.cli import main; sys.argv = ['essa', *sys.argv[1:]]; main()"
)

TINY_RUN = [
    "sft.steps=1",
    "data.sft_size=16",
    "data.batch_size=4",
    "data.test_size=8",
    "optimizer.population_size=4",
    "run.generations=1",
    "evaluation.every=0",
    "evaluation.use_scale_baseline=false",
]


def essa_no_matplotlib(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", NO_MATPLOTLIB, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


def test_pycma_import_warning_is_silenced_precisely() -> None:
    code = (
        "import sys, warnings; sys.modules['matplotlib'] = None; "
        "sys.modules['matplotlib.pyplot'] = None; warnings.simplefilter('error'); "
        "from essa.optimizers import make_optimizer; "
        "opt = make_optimizer('cma_es', 3, population_size=4, sigma0=0.5, seed=0); opt.ask(); "
        "warnings.warn('other warnings still show')"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1  # only our own warning, turned into an error, escapes
    assert "other warnings still show" in res.stderr
    assert "matplotlib" not in res.stderr


@pytest.mark.slow
def test_demo_train_prints_no_warning(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    sets = [arg for item in TINY_RUN for arg in ("--set", item)]
    res = essa_no_matplotlib("train", "--run-dir", str(run_dir), *sets)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Warning" not in res.stderr and "warn" not in res.stderr.lower(), res.stderr
    last = res.stdout.strip().splitlines()[-4:]  # where the adapter is, the next commands
    assert last[0].startswith(f"adapter:  {(run_dir / 'adapter').resolve()}")
    assert last[1].startswith(f"evaluate: essa eval {run_dir}/config.yaml --adapter ")
    assert last[2].startswith(f"compare:  essa compare {run_dir} ")
    assert last[3] == f"export:   essa export {run_dir} --merged {run_dir}/merged"
