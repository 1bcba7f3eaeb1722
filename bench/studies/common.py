"""What every study repeats: its runs in fresh processes, the run archive, paired statistics.

A study (bench/studies/<name>.py) runs ``essa`` commands one after another, each in a fresh
process, and reads back what the run wrote. This module holds what they share (docs/studies.md):

* the real-model task configs (``configs/smollm2.yaml`` with a reasoning-gym task swapped in)
  and the ESSA and GRPO arms run from them, each from the seed's own SFT adapter;
* SFT adapters built once for several arms (:func:`sft_adapter`);
* the run archive, ``bench/results/runs/<task>.jsonl.xz``: every finished command's records,
  restored with ``--reuse`` when the same command is asked for again (:func:`timed`);
* paired statistics on the same held-out items: :func:`paired` per run, :func:`over_seeds` over
  seeds, :func:`kl_ratio` for drift, and rows-to-threshold on a held-out curve.
"""

from __future__ import annotations

import functools
import json
import lzma
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from bench.common import RESULTS, launch, median_spread

# ------------------------------------------------------------------ real-model tasks and arms

CONFIG = Path("configs/smollm2.yaml")

# ESSA runs the shipped config as it is: the scaled start is chosen on training prompts and
# validated, and the test split is scored at the start and for the exported point only (the
# scaled start's own test score, evaluation.use_scale_baseline, would be a third pass of
# the test split inside the timed run; the tables show "-" for it).
ESSA_SETS: list[str] = []

# GRPO on the same LoRA: group 8 x 8 prompts per step (TRL's default G), sampling at T = 1.
# lr 1e-4: a third of the SFT rate (the demo's 1e-3 is for its 4-layer toy); not tuned here.
GRPO_SETS = [
    "grpo.lr=1e-4",
    "grpo.group_size=8",
    "grpo.prompts_per_step=8",
    "reward.reference_weight=0",  # an ESSA fitness term; GRPO takes the reward as it is
]

# Difficulties at which the base model is neither near 0 nor near its ceiling (probed with
# `essa eval` on the base model); task parameters go to both the generator and the scorer.
TASKS: dict[str, dict[str, Any]] = {
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
    "letter_counting": {"min_words": 3, "max_words": 5},
    "spell_backward": {"min_word_len": 3, "max_word_len": 5},
}

# Tasks nobody tuned the shipped config on, at reasoning-gym's default parameters, chosen by the
# shape of their prompts and answers on SmolLM2's tokenizer (question tokens / answer tokens,
# mean of 50, before the chat template): long/long, long/long, mid/short, short/mid,
# short/one token.
UNTUNED: dict[str, dict[str, Any]] = {
    "number_format": {},  # 105 / 13.3
    "word_sorting": {},  # 91 / 13.6
    "base_conversion": {},  # 57 / 3.7
    "fraction_simplification": {},  # 33 / 9.1
    "gcd": {},  # 35 / 1.1
}

# Tasks at SmolLM2's edges, where a run should stop before its search (docs/signal.md): the
# SFT adapter of the shipped config (seed 0, 200 held-out items; `essa sft` then `essa eval
# --adapter`) scores 0.000 full credit on leg_counting at reasoning-gym's defaults (the floor),
# and 0.975 on needle_haystack with one statement (a name to copy out of one sentence: the
# ceiling; 0.835 with one or two statements, 0.475 with two to five).
EDGES: dict[str, dict[str, Any]] = {
    "leg_counting": {},
    "needle_haystack": {"min_num_statements": 1, "max_num_statements": 1},
}

ALL_TASKS = {**TASKS, **UNTUNED, **EDGES}


def task_config(task: str, params: dict[str, Any], out: Path) -> Path:
    """configs/smollm2.yaml with ``task`` swapped in (data source, generator and scorer)."""
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["data"]["source"] = f"reasoning_gym:{task}"
    cfg["data"]["params"] = dict(params)
    cfg["reward"] = {**cfg["reward"], "params": {"task": task, "params": dict(params)}}
    cfg["run"]["show_progress"] = False
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


# ------------------------------------------------------------------ commands in fresh processes


def essa(args: list[str], log: Path, threads: int) -> float:
    """One ``essa ...`` command in a fresh process; its wall seconds."""
    return launch([sys.executable, "-m", "essa.cli", *args], log, threads)


def sets(overrides: list[str]) -> list[str]:
    return [x for o in overrides for x in ("--set", o)]


def train_demo(seed: int, overrides: list[str], root: Path) -> dict[str, Any]:
    """``essa train`` of the embedded demo for ``seed`` in a fresh process (into
    ``root/seed<seed>``): its summary, wall seconds, median seconds per generation and held-out
    curve."""
    run_dir = root / f"seed{seed}"
    cmd = [
        sys.executable,
        "-m",
        "essa.cli",
        "train",
        "--overwrite",
        "--run-dir",
        str(run_dir),
        "--set",
        f"run.seed={seed}",
        "--set",
        "run.show_progress=false",
    ]
    for item in overrides:
        cmd += ["--set", item]
    start = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
    wall = time.perf_counter() - start
    if res.returncode != 0:
        raise SystemExit(f"seed {seed} failed:\n{res.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = [
        (r["generation"] + 1, r["heldout_accuracy"]) for r in records if "heldout_accuracy" in r
    ]
    # Generation 0 includes auto's one-off strategy probe: left out of the median.
    seconds = [r["seconds"] for r in records if r.get("generation", -1) >= 1 and "seconds" in r]
    return {
        "seed": seed,
        "summary": summary,
        "command_wall_seconds": wall,
        "generation_seconds": median_spread(seconds) if seconds else None,
        "curve": curve,
    }


# ------------------------------------------------------------------ the run archive

# Finished commands' records, kept in the repository: the run directories under --root live on
# one machine, and a paired comparison with an earlier arm needs that arm's per-item scores.
# With --reuse, a command missing from --root is restored from here when its arguments and task
# config are the same; every command run or reused is archived (one .jsonl.xz per task).
ARCHIVE = RESULTS / "runs"
# --no-restore: --reuse keeps what is finished under --root and runs the rest, so that a table
# re-made under new code is made of new runs (the archive matches a command on its config
# alone).
RESTORE = True

RUN_FILES = ("config.yaml", "summary.json", "metrics.jsonl", "heldout_scores.jsonl", "phases.jsonl")


def reusable(done: Path, log: Path, reuse: bool) -> float | None:
    """With ``--reuse``, the wall seconds recorded for a finished command (its output ``done``
    exists), so it is not run again; None: run it."""
    if not (reuse and done.exists() and log.with_suffix(".seconds").exists()):
        return None
    return float(log.with_suffix(".seconds").read_text())


def archive_file(log: Path) -> Path:
    """The task's archive, one compressed file per task: ARCHIVE/<task>.jsonl.xz, one JSON line
    per command (its log's stem) holding its ``command.json`` and its files' text."""
    return ARCHIVE / f"{log.parent.name}.jsonl.xz"


def read_archive(path: Path) -> dict[str, dict[str, Any]]:
    """The records of one archive file by command name (empty when there is none)."""
    if not path.exists():
        return {}
    with lzma.open(path, "rt", encoding="utf-8") as f:
        return {r["name"]: r for r in map(json.loads, f)}


def write_archive(path: Path, records: dict[str, dict[str, Any]]) -> None:
    """Rewrite one archive file, records sorted by name (xz keeps no timestamp: same records,
    same bytes), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with lzma.open(tmp, "wt", encoding="utf-8", preset=9) as f:
        for name in sorted(records):
            record = {**records[name], "files": slim(records[name]["files"])}
            f.write(json.dumps(record, sort_keys=True) + "\n")
    tmp.replace(path)


# Of an archived file, the fields the bench reads back: the base model's per-item completions
# were nine tenths of a task's archive, and only their scores are read.
ARCHIVED_FIELDS = {"base_eval.items.jsonl": ("reward",)}


def slim(files: dict[str, str]) -> dict[str, str]:
    """``files`` with each JSON-lines file of :data:`ARCHIVED_FIELDS` cut to those fields."""
    out = dict(files)
    for name, fields in ARCHIVED_FIELDS.items():
        if name in out:
            rows = (json.loads(line) for line in out[name].splitlines())
            out[name] = "".join(
                json.dumps({k: row[k] for k in fields if k in row}) + "\n" for row in rows
            )
    return out


def archived(log: Path) -> dict[str, Any] | None:
    """The archived record of the command whose log is ``log``: ``name``, ``command`` (its
    arguments, task config, seconds, file names) and ``files`` (name -> text); None if none."""
    return read_archive(archive_file(log)).get(log.stem)


def identity(args: list[str]) -> dict[str, Any]:
    """What a command is recorded as: its arguments and its task config's text
    (``essa train|eval CONFIG ...``)."""
    return {"args": args, "config": Path(args[1]).read_text()}


def effective(args: list[str], config_text: str) -> dict[str, Any]:
    """What makes two commands the same one: the config they run (the task config with its
    ``--set`` overrides applied and defaults filled in, so comments, key order and a value set
    twice do not count) and their other arguments, the run directory aside (it names the run,
    it does not change it)."""
    from essa.config import load_config, to_dict

    overrides, rest, i = [], [], 2
    while i < len(args):
        if args[i] in ("--set", "--run-dir") and i + 1 < len(args):
            if args[i] == "--set":
                overrides.append(args[i + 1])
            i += 2
        else:
            rest.append(args[i])
            i += 1
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(config_text)
        cfg = to_dict(load_config(path, overrides))
    return {"command": args[0], "args": rest, "config": cfg}


def archive(args: list[str], log: Path, seconds: float, keep: list[Path]) -> None:
    """Add a finished command's records (``keep``, a few hundred KB of text) to its task's
    archive in the repository."""
    path = archive_file(log)
    records = read_archive(path)
    command = {**identity(args), "seconds": seconds, "files": [p.name for p in keep]}
    files = {p.name: p.read_text() for p in keep}
    records[log.stem] = {"name": log.stem, "command": command, "files": files}
    write_archive(path, records)


def ran_as(record: dict[str, Any]) -> dict[str, Any]:
    """What an archived command ran: ``effective`` of its arguments, with the config it wrote
    into its run directory where it kept one. That file holds every value as the code of its day
    resolved it, so a default added or changed since (a new key, a new value) tells it apart
    from today's command; the task config alone would be filled with today's defaults."""
    command = record["command"]
    ran = effective(command["args"], command["config"])
    written = record["files"].get("config.yaml")
    if written is not None:
        ran["config"] = yaml.safe_load(written)
    return ran


def same_command(args: list[str], log: Path) -> dict[str, Any] | None:
    """The archived record of this command: its own (same name) or, under another name, one of
    a command that ran the same config (an ablation arm that became the default); None when
    there is none."""
    records = read_archive(archive_file(log))
    names = [log.stem, *sorted(n for n in records if n != log.stem)]
    mine = effective(args, Path(args[1]).read_text())
    for name in names:
        record = records.get(name)
        if record is None:
            continue
        if ran_as(record) == mine:
            return record
    if log.stem in records:
        print(f"[bench] {log.stem} in {archive_file(log)} is another command's record: running it",
              flush=True)  # fmt: skip
    return None


def restore(args: list[str], log: Path, keep: list[Path]) -> float | None:
    """The archived records of this very command put back where the command writes them; its
    wall seconds, or None when none is archived with the same config and arguments."""
    record = same_command(args, log)
    if record is None:
        return None
    for path in keep:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(record["files"][path.name])
    source = f"{archive_file(log)}:{record['name']}"
    log.write_text(f"restored from {source}\n")
    log.with_suffix(".seconds").write_text(f"{record['command']['seconds']}\n")
    print(f"[bench] restored {log.stem} from {source}", flush=True)
    return float(record["command"]["seconds"])


def timed(
    args: list[str], done: Path, log: Path, threads: int, reuse: bool, keep: Sequence[Path] = ()
) -> float:
    """``essa ARGS`` unless ``--reuse`` finds it finished, in ``log``'s directory or in the
    archive; its wall seconds, kept beside the log. A command run or reused with ``keep``
    (its output files) is archived."""
    seconds = reusable(done, log, reuse)
    if seconds is None and reuse and keep and RESTORE:
        seconds = restore(args, log, list(keep))
    if seconds is None:
        seconds = essa(args, log, threads)
        log.with_suffix(".seconds").write_text(f"{seconds}\n")
    if keep:
        archive(args, log, seconds, list(keep))
    return seconds


def must_run(args: list[str], log: Path, keep: list[Path], reuse: bool) -> bool:
    """True when a run command has to run: ``--reuse`` finds it neither finished on disk nor
    in the archive."""
    finished = reusable(keep[0].parent / "summary.json", log, reuse) is not None
    return not (finished or (reuse and RESTORE and same_command(args, log) is not None))


# ------------------------------------------------------------------ arms: SFT, ESSA, GRPO


def sft_path(root: Path, name: str, seed: int) -> Path:
    """Where :func:`sft_adapter` writes ``name``'s adapter (the arms' ``adapter.path``)."""
    return (root / f"sft-{name}-seed{seed}" / "sft_adapter").resolve()


def sft_adapter(
    config: Path, seed: int, root: Path, name: str, sets_: list[str], threads: int, reuse: bool
) -> None:
    """``essa sft`` for the config's steps into :func:`sft_path`: the adapter every arm of
    ``name`` starts from."""
    adapter = sft_path(root, name, seed)
    cli = ["sft", str(config), "--overwrite", "--run-dir", str(adapter.parent),
           "--set", f"run.seed={seed}", *sets(sets_)]  # fmt: skip
    timed(cli, adapter / "adapter_model.safetensors", root / f"sft-{name}-seed{seed}.log",
          threads, reuse)  # fmt: skip


def essa_command(
    config: Path, seed: int, root: Path, overrides: list[str], name: str = "essa"
) -> tuple[list[str], Path, list[Path]]:
    """ESSA's ``essa`` arguments, log and kept records (``name``: the run's directory prefix)."""
    run_dir = root / f"{name}-seed{seed}"
    args = ["train", str(config), "--overwrite", "--run-dir", str(run_dir),
            "--set", f"run.seed={seed}", *sets(ESSA_SETS), *sets(overrides)]  # fmt: skip
    return args, root / f"{name}-seed{seed}.log", [run_dir / f for f in RUN_FILES]


def essa_seed(
    config: Path,
    seed: int,
    root: Path,
    overrides: list[str],
    threads: int,
    reuse: bool = False,
    name: str = "essa",
) -> dict:
    """One ``essa train`` of the task config (``name``: the run's directory prefix)."""
    args, log, keep = essa_command(config, seed, root, overrides, name)
    run_dir = keep[0].parent
    wall = timed(args, run_dir / "summary.json", log, threads, reuse, keep)
    summary = json.loads((run_dir / "summary.json").read_text())
    scores = passes(run_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    margins = [r["margin_prompts"] for r in records if "margin_prompts" in r]
    signals = [r["signal"] for r in records if "signal" in r]
    return {
        "seed": seed,
        "run_dir": str(run_dir),
        "command_wall_seconds": wall,
        "summary": summary,
        "accuracy": {k: statistics.mean(v) for k, v in scores.items()},
        # the task scorers give partial credit; full credit alone is the strict accuracy
        "full_credit": {k: statistics.mean(full(v)) for k, v in scores.items()},
        "essa_vs_sft": paired(scores["final"], scores["sft"]),
        "essa_vs_sft_full_credit": paired(full(scores["final"]), full(scores["sft"])),
        "essa_vs_scale": paired(scores["final"], scores["scale"]) if "scale" in scores else None,
        "margin_prompts_median": statistics.median(margins) if margins else None,
        "signal_median": statistics.median(signals) if signals else None,
        "ceiling": ceiling(run_dir),
        "scores": scores,
    }


def ceiling(run_dir: Path) -> int | None:
    """The run's generation ceiling (run.generations of the config it wrote); None without one."""
    path = run_dir / "config.yaml"
    if not path.exists():
        return None
    return (yaml.safe_load(path.read_text()).get("run") or {}).get("generations")


def grpo_command(
    config: Path, essa_run: dict, root: Path, overrides: list[str]
) -> tuple[list[str], Path, list[Path]]:
    """GRPO's ``essa`` arguments, log and kept records: from the ESSA run's own SFT adapter,
    with the ESSA run's wall-clock as budget."""
    run_dir = root / f"grpo-seed{essa_run['seed']}"
    budget = int(essa_run["summary"]["wall_seconds"])
    args = ["train", str(config), "--overwrite", "--run-dir", str(run_dir),
            "--set", "algorithm=grpo", "--set", f"run.seed={essa_run['seed']}",
            "--set", f"adapter.path={essa_run['summary']['sft_adapter_dir']}",
            "--set", f"run.max_wall_seconds={budget}", "--set", "run.generations=1000",
            *sets(GRPO_SETS), *sets(overrides)]  # fmt: skip
    return args, root / f"grpo-seed{essa_run['seed']}.log", [run_dir / f for f in RUN_FILES]


def grpo_needs_sft_adapter(
    config: Path, essa_run: dict, root: Path, overrides: list[str], reuse: bool
) -> bool:
    """True when GRPO must run (nothing to reuse or restore) but the SFT adapter it starts
    from is not on disk: the ESSA run was restored from the archive, which keeps no weights."""
    if Path(essa_run["summary"]["sft_adapter_dir"]).exists():
        return False
    return must_run(*grpo_command(config, essa_run, root, overrides), reuse)


def grpo_seed(
    config: Path,
    essa_run: dict,
    root: Path,
    overrides: list[str],
    threads: int,
    reuse: bool = False,
) -> dict:
    """GRPO from the ESSA run's own SFT adapter, with the ESSA run's wall-clock as budget."""
    args, log, keep = grpo_command(config, essa_run, root, overrides)
    run_dir = keep[0].parent
    wall = timed(args, run_dir / "summary.json", log, threads, reuse, keep)
    summary = json.loads((run_dir / "summary.json").read_text())
    scores = passes(run_dir)
    return {
        "seed": essa_run["seed"],
        "run_dir": str(run_dir),
        "command_wall_seconds": wall,
        "summary": summary,
        "accuracy": {k: statistics.mean(v) for k, v in scores.items()},
        "grpo_vs_sft": paired(scores["final"], scores["sft"]),
        "essa_vs_grpo": paired(essa_run["scores"]["final"], scores["final"]),
    }


# ------------------------------------------------------------------ paired statistics


def passes(run_dir: Path) -> dict[str, list[float]]:
    """The run's held-out passes by name: sft (its start), scale (the no-search baseline),
    final (the exported adapter)."""
    out: dict[str, list[float]] = {}
    for line in (run_dir / "heldout_scores.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["final"]:
            out["final"] = record["scores"]
        elif record.get("pass", "").startswith("scale"):
            out["scale"] = record["scores"]
        elif record["generation"] == -1:
            out["sft"] = record["scores"]
    return out


def full(scores: list[float]) -> list[float]:
    """1.0 where an item got full credit, else 0.0 (the strict accuracy of a graded scorer)."""
    return [1.0 if x >= 1.0 else 0.0 for x in scores]


def paired(a: list[float], b: list[float]) -> dict[str, float]:
    """Mean of a - b over the same items and its standard error."""
    diff = [x - y for x, y in zip(a, b, strict=True)]
    n = len(diff)
    se = statistics.stdev(diff) / math.sqrt(n) if n > 1 else float("nan")
    return {"gain": statistics.mean(diff), "se": se, "n": n}


def over_seeds(diffs: Sequence[dict[str, float]]) -> dict[str, Any]:
    """Mean of per-seed paired gains (:func:`paired`) and its standard error, independent
    seeds: sqrt(sum SE_s^2) / S; z = gain / SE and each seed's own z.

    >>> over_seeds([{"gain": 0.5, "se": 0.75}, {"gain": 1.5, "se": 1.0}])
    {'gain': 1.0, 'se': 0.625, 'z': 1.6, 'per_seed_z': [0.6666666666666666, 1.5]}
    """
    gains = [d["gain"] for d in diffs]
    se = math.sqrt(sum(d["se"] ** 2 for d in diffs)) / len(diffs)
    mean = statistics.mean(gains)
    return {
        "gain": mean,
        "se": se,
        "z": mean / se if se else float("nan"),
        "per_seed_z": [d["gain"] / d["se"] if d["se"] else float("nan") for d in diffs],
    }


def pooled(runs: list[dict], key: str) -> dict[str, float]:
    """:func:`over_seeds` of the runs' ``key`` gains."""
    return over_seeds([r[key] for r in runs])


def kl_ratio(pairs: list[tuple[float, float]]) -> dict[str, float]:
    """mean(a) / mean(b) over paired per-prompt values and its delta-method standard error,
    sqrt(var(a - R b) / n) / mean(b).

    >>> kl_ratio([(1.0, 2.0), (2.0, 4.0)])
    {'ratio': 0.5, 'se': 0.0, 'n': 2}
    """
    a, b = [x for x, _ in pairs], [y for _, y in pairs]
    ratio = statistics.mean(a) / statistics.mean(b)
    resid = [x - ratio * y for x, y in pairs]
    se = statistics.stdev(resid) / math.sqrt(len(pairs)) / statistics.mean(b)
    return {"ratio": ratio, "se": se, "n": len(pairs)}


def pooled_kl_ratio(
    mine: Sequence[dict[str, Any]], theirs: Sequence[dict[str, Any]]
) -> dict[str, float]:
    """:func:`kl_ratio` of two lists of drift reports paired by seed, over their per-prompt
    KL(base || tuned) pairs pooled across the seeds."""
    pairs = [
        pair
        for a, b in zip(mine, theirs, strict=True)
        for pair in zip(a["kl_per_prompt"]["kl_base"], b["kl_per_prompt"]["kl_base"], strict=True)
    ]
    return kl_ratio(pairs)


def retention_change(runs: Sequence[dict[str, Any]]) -> str:
    """Retention's change of the tuned model from the base model and from the SFT adapter
    (tuned - base / tuned - SFT, docs/drift.md), each the mean over the runs whose summaries
    report both, with those runs' count and items; "-" when none does (GRPO with LISA has no
    base or SFT model, a run before drift reports none).

    On a task of few answers, the forced choice's changes follow (``choice``, the same means).

    >>> kept = {"change_from_base": 0.0625, "change_from_sft": -0.125, "items": 64}
    >>> retention_change([{"summary": {"drift": {"retention": kept}}}, {"summary": {}}])
    '+0.062 / -0.125 (1 x 64)'
    >>> choice = {"change_from_base": -0.25, "change_from_sft": 0.0, "auc_change_from_base": -0.1,
    ...           "auc_change_from_sft": 0.02}
    >>> retention_change([{"summary": {"drift": {"retention": {**kept, "choice": choice}}}}])
    '+0.062 / -0.125 (1 x 64); forced choice -0.250 / +0.000, AUC -0.100 / +0.020'
    """
    reports = [(r["summary"].get("drift") or {}).get("retention") or {} for r in runs]
    kept = [k for k in reports if "change_from_base" in k and "change_from_sft" in k]
    if not kept:
        return "-"
    items = "/".join(str(n) for n in sorted({k["items"] for k in kept}))
    shown = f"{_changes(kept)} ({len(kept)} x {items})"
    choices = [k.get("choice") or {} for k in kept]
    if all("auc_change_from_base" in c and "auc_change_from_sft" in c for c in choices):
        shown += f"; forced choice {_changes(choices)}, AUC {_changes(choices, 'auc_')}"
    return shown


def _changes(reports: Sequence[dict[str, Any]], prefix: str = "") -> str:
    """'tuned - base / tuned - SFT', each the mean over ``reports``."""
    base = statistics.mean(k[f"{prefix}change_from_base"] for k in reports)
    sft = statistics.mean(k[f"{prefix}change_from_sft"] for k in reports)
    return f"{base:+.3f} / {sft:+.3f}"


@functools.cache
def run_config(run_dir: Path) -> Any:
    """The resolved config a finished run wrote (read once per run directory)."""
    from essa.config import load_config

    return load_config(run_dir / "config.yaml")


def rows_per_step(run_dir: Path, record: dict[str, Any]) -> int:
    """Training rows generated in one metrics record's step."""
    cfg = run_config(run_dir)
    if cfg.algorithm == "grpo":
        rounds = int(record.get("sampling_rounds", 1))
        return cfg.grpo.prompts_per_step * cfg.grpo.group_size * rounds
    return cfg.optimizer.population_size * cfg.generation.samples_per_prompt * cfg.data.batch_size


def curve(run_dir: Path) -> list[tuple[int, float]]:
    """(training rows generated so far, held-out accuracy): the SFT start, then every pass."""
    points: list[tuple[int, float]] = []
    rows = 0
    for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        if record["generation"] < 0:
            points.append((0, record["heldout_accuracy"]))
            continue
        rows += rows_per_step(run_dir, record)
        if "heldout_accuracy" in record:
            points.append((rows, record["heldout_accuracy"]))
    return points


def rows_to(points: list[tuple[int, float]], threshold: float) -> int | None:
    """Rows generated until the curve first reaches ``threshold`` (None: never)."""
    return next((rows for rows, acc in points if acc >= threshold - 1e-12), None)


def rows_ratio(
    on: list[tuple[int, float]], off: list[tuple[int, float]], sft: float, off_final: float
) -> float | None:
    """Rows-to-threshold off / on: the threshold is SFT + 90% of the off run's final gain (None
    when either curve never reaches it)."""
    threshold = sft + 0.9 * (off_final - sft)
    mine, theirs = rows_to(on, threshold), rows_to(off, threshold)
    return theirs / mine if mine and theirs else None


def geomean(ratios: list[float | None]) -> float | None:
    """Geometric mean of the finite ratios (None when there are none)."""
    finite = [x for x in ratios if x is not None]
    return math.exp(statistics.mean(map(math.log, finite))) if finite else None
