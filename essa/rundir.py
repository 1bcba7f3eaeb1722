"""Run directory: resolved config, metrics.jsonl, atomic checkpoints, summary.json.

Every file that a later step reads is written atomically (temporary file, fsync, rename), so a
run killed at any moment leaves either the previous checkpoint or the new one, never half of one.
Nothing read back from a run directory is executed: checkpoints are JSON and safetensors.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from essa.errors import UserError

# Checked before training: a filesystem with less free space than this fails at once, with one
# message, rather than at the first checkpoint or adapter export.
MIN_FREE_BYTES = 32 * 2**20

# Set by the reliability tests only (tests/faults/sitecustomize.py, docs/reliability.md): called
# with the step count of the checkpoint being written; the function it returns, if any, runs
# after the temporary checkpoint is written and before it replaces the previous one.
checkpoint_hook: Callable[[int], Callable[[], None] | None] | None = None


class StorageError(UserError):
    """The run directory cannot be written (read-only, full, gone); the last checkpoint is intact."""


def storage_error(path: Path, err: OSError) -> StorageError:
    reason = err.strerror or str(err)
    if err.errno == errno.ENOSPC:
        reason = "no space left on device"
    return StorageError(f"cannot write {path}: {reason}")


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_text(
    path: Path, text: str, *, before_rename: Callable[[], None] | None = None
) -> None:
    """Write ``text`` to ``path`` through a synced temporary file and a rename.

    On failure (full disk, read-only filesystem) the temporary file is removed, ``path`` keeps
    its previous content and :class:`StorageError` names the file. ``before_rename`` runs after
    the temporary file is synced, before the rename (:func:`before_checkpoint`).
    """
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise storage_error(path, err) from None
    _fsync_dir(path.parent)


def before_checkpoint(step: int) -> Callable[[], None] | None:
    """What :data:`checkpoint_hook` injects into the checkpoint of ``step`` (None: nothing)."""
    return None if checkpoint_hook is None else checkpoint_hook(step)


@contextlib.contextmanager
def stop_on_storage_error(run_dir: Path, done: int, unit: str) -> Iterator[None]:
    """Re-raise a :class:`StorageError` of a step's writes with what was kept and how to go on.

    ``done`` is the number of ``unit`` (generations, steps) the last complete checkpoint holds.
    """
    try:
        yield
    except StorageError as err:
        kept = f"the last checkpoint ({done} {unit} done)" if done else "no checkpoint yet"
        raise StorageError(
            f"{err}; stopped, {kept} intact; free space and continue with: "
            f"essa train --resume {run_dir}"
        ) from None


def atomic_write_json(
    path: Path, data: Any, *, before_rename: Callable[[], None] | None = None
) -> None:
    atomic_write_text(
        path, json.dumps(data, indent=2, sort_keys=True) + "\n", before_rename=before_rename
    )


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
        with open(probe, "w") as f:
            f.write("ok")
            f.flush()
            os.fsync(f.fileno())  # a full disk may only refuse the write when it is synced
        probe.unlink()
    except OSError as err:
        with contextlib.suppress(OSError):
            (run_dir / ".write-probe").unlink()
        reason = "no space left on device" if err.errno == errno.ENOSPC else err.strerror
        raise UserError(f"run.dir {run_dir}: not writable ({reason})") from None
    free = shutil.disk_usage(run_dir).free
    if free < MIN_FREE_BYTES:
        raise UserError(
            f"run.dir {run_dir}: only {free / 2**20:.1f} MiB free on its filesystem; "
            f"checkpoints and the adapter need at least {MIN_FREE_BYTES // 2**20} MiB"
        )


def check_output(path: Path, option: str, *, directory: bool = False) -> None:
    """Before any work: create ``path``'s parent directories and write (then remove) a probe
    file there, so that a result computed for minutes is never lost to a path it cannot be
    written to. A file output may not be a directory, a directory output not a file. One
    UserError line naming ``option`` otherwise."""
    parent = path.parent
    probe = parent / f".{path.name}.write-probe"
    try:
        parent.mkdir(parents=True, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
    except OSError as err:
        reason = "no space left on device" if err.errno == errno.ENOSPC else err.strerror
        raise UserError(f"{option} {path}: cannot write in {parent} ({reason})") from None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    if directory and path.exists() and not path.is_dir():
        raise UserError(f"{option} {path}: exists and is not a directory")
    if not directory and path.is_dir():
        raise UserError(f"{option} {path}: is a directory; name a file")
    if not directory and path.exists() and not os.access(path, os.W_OK):
        raise UserError(f"{option} {path}: exists and is not writable")


class MetricsLog:
    """Append-only metrics.jsonl; each line is flushed so a crash loses at most one line."""

    def __init__(self, path: Path, *, enabled: bool = True) -> None:
        self.path = path
        self.enabled = enabled  # False on MPI ranks other than 0: they write nothing

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")
                f.flush()
        except OSError as err:  # a torn last line is dropped on resume (truncate_after)
            raise storage_error(self.path, err) from None

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
