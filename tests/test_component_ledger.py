"""The optional-component ledger of tests/conftest.py, in a pytest run of its own.

Run as CI runs it (xdist workers) and on one process: a skip of a component that
``ESSA_REQUIRE`` names fails the run, and the summary counts every tagged test once, whichever
process ran it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CASES = """
import pytest

from tests.conftest import requires


@requires("gym", None)
def test_present() -> None:
    assert True


@requires("gym", "reasoning-gym is not installed")
def test_missing() -> None:
    assert False


@requires("trl", "TRL is not installed")
def test_optional() -> None:
    assert False
"""


@pytest.mark.slow
@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one-process", "xdist"])
def test_required_skip_fails_and_every_test_is_counted_once(
    tmp_path: Path, workers: list[str]
) -> None:
    (tmp_path / "conftest.py").write_text("from tests.conftest import *  # noqa: F403\n")
    (tmp_path / "test_cases.py").write_text(CASES)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ESSA_REQUIRE": "gym"}
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers, "."],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = res.stdout + res.stderr
    assert res.returncode == 1, out[-3000:]
    assert "ESSA_REQUIRE names gym, but this test skipped: reasoning-gym is not installed" in out
    assert "1 passed, 1 skipped, 1 error" in out, out[-3000:]  # skipif skips at set-up
    assert (
        "component gym: ran 1, skipped 1 (reasoning-gym is not installed) "
        "[required by ESSA_REQUIRE]"
    ) in out
    assert "component trl: ran 0, skipped 1 (TRL is not installed)" in out
