"""run.report_to: each tracker writes locally with the real library, read back by its own format.

The logging runs in a fresh process, as in `essa train` (trackio fixes its store directory at
import, and wandb starts its service per process); the network is never needed.
"""

from __future__ import annotations

import glob
import json
import os
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from essa.errors import UserError
from essa.tracking import check_trackers, samples_markdown, scalars


def _missing_trackers() -> str | None:
    import importlib.util

    absent = [n for n in ("tensorboard", "wandb", "trackio") if importlib.util.find_spec(n) is None]
    return f"{', '.join(absent)} not installed (the [track] extra)" if absent else None


# The whole module needs the three libraries: a component, so ESSA_REQUIRE=track makes a skip fail.
pytestmark = [
    pytest.mark.skipif(_missing_trackers() is not None, reason=_missing_trackers() or ""),
    pytest.mark.component("track"),
]

WORKER = """
import json, sys
from pathlib import Path
from essa.tracking import make_trackers
run_dir = Path(sys.argv[1])
names = sys.argv[2].split(",") if sys.argv[2] else []
trackers = make_trackers(names, run_dir, {"optimizer": {"sigma0": 0.1}, "run": {"seed": 7}})
assert ("wandb" in sys.modules) == ("wandb" in names)  # imported only when named
trackers.log({"generation": -1, "event": "baseline", "heldout_accuracy": 0.25}, step=0)
trackers.log({"generation": 0, "mean_fitness": 0.5, "best_fitness": 0.75}, step=1)
trackers.log({"generation": 1, "mean_fitness": 0.625, "best_fitness": 0.875}, step=2)
rows = [{"generation": 2, "prompt": "1+2=", "completion": "3", "extracted": "3",
         "reference": "3", "reward": 1.0}]
trackers.log_samples(rows, step=2)
trackers.log_summary({"final_accuracy": 0.5, "heldout_metric": "math_accuracy"})
trackers.close()
"""


def log_with(run_dir: Path, *names: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "TRACKIO_"))}
    env["OMP_NUM_THREADS"] = "1"
    res = subprocess.run(
        [sys.executable, "-c", WORKER, str(run_dir), ",".join(names)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout == "", res.stdout  # no tracker banner on our console


def test_scalars_and_markdown() -> None:
    assert scalars({"a": 1, "b": None, "c": {"d": 0.5, "e": "x"}, "f": False}) == {
        "a": 1.0,
        "c/d": 0.5,
    }
    table = samples_markdown([{"prompt": "a|b", "completion": "x\ny", "reward": 0.0}])
    assert "a\\|b" in table and "x\\ny" in table and table.count("\n") == 2


def test_tensorboard_event_files(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_with(tmp_path, "tensorboard")
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    fitness = [(e.step, e.value) for e in events.Scalars("mean_fitness")]
    assert fitness == [(1, 0.5), (2, 0.625)]
    assert [(e.step, e.value) for e in events.Scalars("heldout_accuracy")] == [(0, 0.25)]
    assert events.Scalars("summary/final_accuracy")[0].value == 0.5
    texts = {tag: events.Tensors(f"{tag}/text_summary") for tag in ("config", "samples", "summary")}
    assert b"sigma0" in texts["config"][0].tensor_proto.string_val[0]
    assert b"1+2=" in texts["samples"][0].tensor_proto.string_val[0]
    assert b"math_accuracy" in texts["summary"][0].tensor_proto.string_val[0]


def wandb_records(path: str) -> list[object]:
    """Records of a wandb transaction log: LevelDB-style 32 KiB blocks of (crc, length, type)."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, pending, out = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # block padding
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def items(update: object) -> dict[str, object]:
    """key -> value of wandb history/summary items (keys in ``key`` or ``nested_key``)."""
    return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in update}


def test_wandb_offline_run(tmp_path: Path) -> None:
    log_with(tmp_path, "wandb")
    (path,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = wandb_records(path)
    kinds = [r.WhichOneof("record_type") for r in records]
    history = [items(r.history.item) for r, k in zip(records, kinds, strict=True) if k == "history"]
    assert [h["_step"] for h in history] == [0, 1, 2]
    assert history[1]["mean_fitness"] == 0.5 and "event" not in history[0]
    assert history[2]["samples/_type"] == "table-file" and history[2]["samples/nrows"] == 1
    (run,) = [r.run for r, k in zip(records, kinds, strict=True) if k == "run"]
    assert items(run.config.update)["optimizer"] == {"sigma0": 0.1}
    summary: dict[str, object] = {}
    for r, k in zip(records, kinds, strict=True):
        if k == "summary":
            summary.update(items(r.summary.update))
    assert summary["final_accuracy"] == 0.5 and summary["heldout_metric"] == "math_accuracy"
    media = tmp_path / "wandb" / "offline-run-*" / "files" / "media" / "table" / "*.json"
    assert "1+2=" in Path(glob.glob(str(media))[0]).read_text()


def test_trackio_local_store(tmp_path: Path) -> None:
    log_with(tmp_path, "trackio")
    with sqlite3.connect(tmp_path / "trackio" / "essa-align.db") as db:
        rows = [
            (step, json.loads(metrics))
            for step, metrics in db.execute("SELECT step, metrics FROM metrics ORDER BY id")
        ]
        (config,) = [json.loads(c) for (c,) in db.execute("SELECT config FROM configs")]
    assert rows[1] == (1, {"generation": 0.0, "mean_fitness": 0.5, "best_fitness": 0.75})
    samples = [m["samples"] for _, m in rows if "samples" in m]
    assert samples[0]["_value"][0]["prompt"] == "1+2="
    assert rows[-1] == (2, {"summary/final_accuracy": 0.5})
    assert config["run"] == {"seed": 7}


def test_all_three_together_and_none(tmp_path: Path) -> None:
    log_with(tmp_path / "all", "tensorboard", "wandb", "trackio")
    assert {p.name for p in (tmp_path / "all").iterdir()} == {"tensorboard", "wandb", "trackio"}
    log_with(tmp_path / "none")
    assert not (tmp_path / "none").exists()


def test_missing_or_unknown_tracker_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    with pytest.raises(UserError, match="unknown tracker 'mlflow'"):
        check_trackers(["mlflow"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n: None if n == "wandb" else real(n))
    with pytest.raises(UserError, match=r"^run.report_to: wandb is not installed: pip install"):
        check_trackers(["tensorboard", "wandb"])
