"""Run directory: resolved config, metrics.jsonl, atomic checkpoints, summary.json.

Every file that a later step reads is written atomically (temporary file, fsync, rename), so a
run killed at any moment leaves either the previous checkpoint or the new one, never half of one.
Nothing read back from a run directory is executed: checkpoints are JSON and safetensors.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from essa.errors import UserError


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def atomic_write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def atomic_dir(path: Path) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``path`` only once the block succeeds.

    The previous ``path`` is kept until the new one is complete.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    old = path.with_name(f".{path.name}.old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for child in tmp.iterdir():
        if child.is_file():
            with open(child, "rb") as f:
                os.fsync(f.fileno())
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def recover(path: Path) -> None:
    """If a kill struck between the two renames of :func:`atomic_dir`, restore the old copy."""
    old = path.with_name(f".{path.name}.old")
    if not path.exists() and old.exists():
        os.replace(old, path)


def prepare_run_dir(run_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """Create or check the run directory before any work is done."""
    if resume and overwrite:
        raise UserError("--resume and --overwrite exclude each other")
    if resume:
        if not (run_dir / "config.yaml").exists():
            raise UserError(f"--resume {run_dir}: not a run directory (no config.yaml)")
    elif run_dir.exists() and any(run_dir.iterdir()):
        if not overwrite:
            raise UserError(
                f"run.dir {run_dir} exists and is not empty: pass --resume to continue "
                "it or --overwrite to replace it"
            )
        shutil.rmtree(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise UserError(f"run.dir {run_dir}: not writable ({err.strerror})") from None


class MetricsLog:
    """Append-only metrics.jsonl; each line is flushed so a crash loses at most one line."""

    def __init__(self, path: Path, *, enabled: bool = True) -> None:
        self.path = path
        self.enabled = enabled  # False on MPI ranks other than 0: they write nothing

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()

    def truncate_after(self, generation: int) -> None:
        """On resume, drop records of generations past the checkpoint (they will be redone)."""
        if not self.enabled or not self.path.exists():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line from a kill
            if rec.get("generation", -1) <= generation:
                keep.append(line)
        atomic_write_text(self.path, "".join(f"{line}\n" for line in keep))
