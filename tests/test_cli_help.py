"""`essa --help` and every subcommand's help read as plain text: one full sentence first, then
the options, with no reST markup, no summary cut off mid-sentence and no `--help <bool>`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer

from essa.cli import app

REPO = Path(__file__).resolve().parent.parent


def command_paths(command: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path of the CLI, the top level first: (), ("train",), ("config", "show"), ...
    (typer's click-like command objects: a group has ``commands``)."""
    paths = [prefix]
    for name, sub in getattr(command, "commands", {}).items():
        paths += command_paths(sub, (*prefix, name))
    return paths


PATHS = command_paths(typer.main.get_command(app))


def help_text(path: tuple[str, ...]) -> str:
    """The help as a user sees it: `python -m essa.cli ... --help` in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "80"}
    out = subprocess.run(
        [sys.executable, "-m", "essa.cli", *path, "--help"], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_every_command_is_listed() -> None:
    names = {" ".join(p) for p in PATHS}
    assert {"", "train", "sft", "eval", "export", "compare", "config show"} <= names


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "essa")
def test_help_is_one_plain_sentence_then_options(path: tuple[str, ...]) -> None:
    text = help_text(path)
    lines = text.splitlines()
    assert lines[0].startswith("Usage: ") and lines[1] == ""
    summary = lines[2].strip()
    end = lines.index("", 2)  # the first paragraph: one sentence, possibly wrapped
    sentence = " ".join(line.strip() for line in lines[2:end])
    assert summary[0].isupper(), summary
    assert sentence.endswith(".") and sentence.count(". ") == 0, sentence
    assert "``" not in text and "<bool>" not in text
    assert "Options:" in text and "--help  " in text
    if "Commands:" in text:  # a group: every command's one-line summary is whole, not cut off
        listed = lines[lines.index("Commands:") + 1 :]
        assert listed and all(line.rstrip().endswith(".") for line in listed if line.strip())
        assert not any(line.rstrip().endswith("...") for line in listed)
