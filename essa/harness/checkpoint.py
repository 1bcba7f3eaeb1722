"""checkpoint.json: the JSON checkpoint (ESSA's) written atomically and read back, a damaged
one being one UserError line."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from essa.errors import UserError
from essa.rundir import atomic_write_json, recover

JSONDict = dict[str, Any]


def write_json_checkpoint(run_dir: Path, data: JSONDict, step: int) -> None:
    """RUN_DIR/checkpoint.json, replaced atomically (plain JSON: nothing read back is executed)."""
    from essa.rundir import before_checkpoint

    atomic_write_json(run_dir / "checkpoint.json", data, before_rename=before_checkpoint(step))


def read_json_checkpoint(run_dir: Path, restore: Callable[[JSONDict], None]) -> JSONDict | None:
    """The checkpoint's data after ``restore(data)`` took its part; None when there is none.

    A checkpoint that cannot be restored is one UserError line, never a traceback.
    """
    path = run_dir / "checkpoint.json"
    recover(path)
    if not path.exists():
        return None
    try:
        data: JSONDict = json.loads(path.read_text())
        restore(data)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as err:
        # Atomic writes never leave a torn checkpoint; this one was edited, damaged, or was
        # written under another optimizer setting (--set on resume).
        first = str(err).splitlines()[0] if str(err) else "invalid"
        raise UserError(
            f"{path}: cannot resume from this checkpoint ({type(err).__name__}: {first}); "
            "start a new run or restore the file"
        ) from None
    return data
