"""bench/studies/real_model.py's bookkeeping on hand-made run files: passes, paired tests, the table."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.studies.common import paired, passes, pooled, sets, task_config
from bench.studies.real_model import table


def test_passes_reads_every_held_out_pass(tmp_path: Path) -> None:
    lines = [
        {"generation": -1, "final": False, "pass": "held-out baseline", "scores": [0, 1, 0]},
        {"generation": -1, "final": False, "pass": "scale baseline held-out", "scores": [1, 1, 0]},
        {"generation": 9, "final": False, "pass": "held-out", "scores": [1, 0, 0]},
        {"generation": 20, "final": True, "pass": "final held-out", "scores": [1, 1, 1]},
    ]
    (tmp_path / "heldout_scores.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    got = passes(tmp_path)
    assert got == {"sft": [0, 1, 0], "scale": [1, 1, 0], "final": [1, 1, 1]}


def test_paired_gain_and_standard_error_by_hand() -> None:
    # differences 1, 0, 1, 0: mean 0.5, sample sd sqrt(1/3), SE sqrt(1/3)/2
    p = paired([1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0])
    assert p["gain"] == 0.5 and p["n"] == 4
    assert p["se"] == pytest.approx(math.sqrt(1 / 3) / 2)
    # two seeds: SE of the mean of independent gains = sqrt(se1^2 + se2^2) / 2
    runs = [{"g": {"gain": 0.1, "se": 0.03}}, {"g": {"gain": 0.2, "se": 0.04}}]
    pool = pooled(runs, "g")
    assert pool["gain"] == pytest.approx(0.15) and pool["se"] == pytest.approx(0.025)
    assert pool["z"] == pytest.approx(6.0)
    assert pool["per_seed_z"] == pytest.approx([0.1 / 0.03, 5.0])


def test_task_config_swaps_only_the_task(tmp_path: Path) -> None:
    import yaml

    from essa.config import load_config

    path = task_config("spell_backward", {"min_word_len": 3, "max_word_len": 5}, tmp_path)
    cfg = load_config(path)  # a valid config, every key known
    assert cfg.data.source == "reasoning_gym:spell_backward"
    assert cfg.reward.params == {
        "task": "spell_backward",
        "params": {"min_word_len": 3, "max_word_len": 5},
    }
    shipped = yaml.safe_load(Path("configs/smollm2.yaml").read_text())
    assert cfg.optimizer.population_size == shipped["optimizer"]["population_size"]
    assert cfg.reward.reference_weight == shipped["reward"]["reference_weight"]


def test_table_row_from_a_result() -> None:
    run = {
        "accuracy": {"sft": 0.2, "scale": 0.21, "final": 0.26},
        "summary": {"wall_seconds": 1150.0, "peak_rss_mb": 3000.0},
    }
    result = {
        "tasks": {
            "chain_sum": {
                "base_accuracy": 0.04,
                "essa": [run],
                "essa_vs_sft": {"gain": 0.06, "se": 0.015, "z": 4.0, "per_seed_z": [4.0]},
                "grpo": {
                    "accuracy": {"final": 0.22},
                    "essa_vs_grpo": {"gain": 0.04, "se": 0.02},
                    "summary": {"peak_rss_mb": 6000.0},
                },
            }
        }
    }
    row = table(result).splitlines()[-1]
    assert row.startswith(
        "| chain_sum | - | 0.040 | 0.200 | 0.210 | 0.260 | +0.060 (0.015) | 4.0 |"
    )
    header, rule = table(result).splitlines()[:2]
    assert header.count("|") == rule.count("|") == row.count("|")
    lengths = {"prompt_mean": 116.4, "reference_mean": 13.96}
    run["summary"] |= {"plan": {"generations": 20, "lengths": lengths}, "generations": 21,
                       "phases": {"generations": {"actual": 700.0, "planned": 690.0}}}  # fmt: skip
    assert table(result).splitlines()[-1].startswith("| chain_sum | 116 / 14.0 | 0.040 |")
    assert "0.220 (ESSA +0.040 ± 0.020)" in row and "3000 / 6000 MB (0.50x)" in row
    # A start kept on every seed scores as its SFT adapter item for item: SE 0, no z.
    nan = float("nan")
    result["tasks"]["chain_sum"]["essa_vs_sft"] = {"gain": 0.0, "se": 0.0, "z": nan,
                                                   "per_seed_z": [nan, nan]}  # fmt: skip
    assert "| +0.000 (0.000) | - | -, - |" in table(result).splitlines()[-1]


def test_table_shows_each_runs_plan_against_what_it_made() -> None:
    """Generations made (planned) per seed, the search's seconds actual / planned and its share
    of the phases the budget sizes and of the whole run; a run from before the plan shows "-"."""
    from bench.studies.real_model import plan_cells

    def run(made: int, planned: int, actual: float, before: float, wall: float) -> dict:
        phases = {"SFT": {"actual": before, "planned": 100.0},
                  "generations": {"actual": actual, "planned": 800.0}}  # fmt: skip
        summary = {"generations": made, "wall_seconds": wall, "plan": {"generations": planned},
                   "phases": phases}  # fmt: skip
        return {"summary": summary}

    made, search = plan_cells(
        [run(22, 25, 700.0, 300.0, 1400.0), run(26, 25, 900.0, 100.0, 1000.0)]
    )
    assert made == "22 (25), 26 (25)"
    # of the budgeted phases 70% and 90%, of the run 50% and 90%
    assert search == "800 / 800 (80% / 70%)"
    assert plan_cells([{"summary": {"wall_seconds": 900.0}}]) == ("-", "-")


def test_table_pools_grpo_over_its_seeds_and_pairs_memory_by_seed() -> None:
    """GRPO on two seeds: its mean final, ESSA - GRPO pooled over those seeds, and the peak RSS
    of each GRPO run beside the ESSA run of its own seed (seed 2's ESSA has no GRPO)."""
    import argparse

    from bench.studies.real_model import grpo_seeds

    def essa(seed: int, rss: float) -> dict:
        acc = {"sft": 0.2, "scale": 0.2, "final": 0.3}
        return {
            "seed": seed,
            "accuracy": acc,
            "summary": {"wall_seconds": 900.0, "peak_rss_mb": rss},
        }

    def grpo(seed: int, final: float, gain: float, se: float, rss: float) -> dict:
        return {"seed": seed, "accuracy": {"final": final}, "summary": {"peak_rss_mb": rss},
                "essa_vs_grpo": {"gain": gain, "se": se}}  # fmt: skip

    grpo_runs = [grpo(0, 0.26, 0.04, 0.03, 8000.0), grpo(1, 0.30, 0.00, 0.04, 6000.0)]
    t = {
        "base_accuracy": 0.04,
        "essa": [essa(0, 2000.0), essa(1, 1000.0), essa(2, 9000.0)],
        "essa_vs_sft": {"gain": 0.1, "se": 0.01, "z": 10.0, "per_seed_z": [10.0] * 3},
        "grpo_runs": grpo_runs,
        "essa_vs_grpo": pooled(grpo_runs, "essa_vs_grpo"),
    }
    row = table({"tasks": {"chain_sum": t}}).splitlines()[-1]
    # mean final (0.26 + 0.30) / 2; gain (0.04 + 0) / 2, SE sqrt(0.03² + 0.04²) / 2 = 0.025
    assert "| 0.280 (ESSA +0.020 ± 0.025, 2 seeds) |" in row
    assert "| 1500 / 7000 MB (0.21x) |" in row  # seeds 0 and 1 only: 9000 MB is not GRPO's pair
    # The README's short table carries the same cells: the headline columns only.
    from bench.studies.real_model import short_table

    short = short_table({"tasks": {"chain_sum": t}}).splitlines()
    assert short[-1] == (
        "| chain_sum | - | 0.200 | 0.300 | +0.100 (0.010) | 10.0, 10.0, 10.0 | - | - | "
        "0.280 (ESSA +0.020 ± 0.025, 2 seeds) | 1500 / 7000 MB (0.21x) |"
    )
    assert short[0].count("|") == short[1].count("|") == short[-1].count("|")
    assert grpo_seeds(argparse.Namespace(grpo_seeds=None, seeds=[3, 4])) == [3]
    assert grpo_seeds(argparse.Namespace(grpo_seeds=[0, 1], seeds=[0, 1, 2])) == [0, 1]


def test_grpo_seed_outside_seeds_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """GRPO starts from an ESSA seed's run: a --grpo-seeds seed not in --seeds would not run."""
    from bench.studies.real_model import parse_args

    assert parse_args(["--seeds", "0", "1", "--grpo-seeds", "1"]).grpo_seeds == [1]
    with pytest.raises(SystemExit) as stop:
        parse_args(["--seeds", "0", "1", "--grpo-seeds", "1", "2"])
    assert stop.value.code == 2
    assert "error: --grpo-seeds 2: not in --seeds 0 1" in capsys.readouterr().err


def test_grpo_options_summary_pairs_each_option_with_plain_grpo_of_its_seed() -> None:
    from bench.studies.grpo_options import OPTIONS, summarise
    from bench.studies.grpo_options import table as options_table

    plain = [{"final": 0.5, "steps": 10, "scores": [1.0, 0.0, 0.0, 1.0]},
             {"final": 0.25, "steps": 11, "scores": [0.0, 0.0, 0.0, 1.0]}]  # fmt: skip
    option = [{"final": 0.75, "steps": 7, "scores": [1.0, 1.0, 0.0, 1.0]},
              {"final": 0.25, "steps": 8, "scores": [0.0, 0.0, 1.0, 0.0]}]  # fmt: skip
    s = summarise(option, plain)
    # seed 0: diffs 0, 1, 0, 0 (gain 0.25, SE 0.25); seed 1: 0, 0, 1, -1 (gain 0, SE sqrt(2/3)/2)
    assert s["vs_grpo"] == pytest.approx(0.125)
    assert s["vs_grpo_se"] == pytest.approx(math.sqrt(0.25**2 + (2 / 3) / 4) / 2)
    assert s["steps"] == [7, 8] and s["final"] == 0.5
    result = {"summary": {"grpo": summarise(plain, plain), "cure": s}}
    rows = options_table(result).splitlines()
    assert rows[2].startswith("| `grpo` | 0.375 |") and rows[2].endswith("| - |")
    assert (
        rows[3] == "| `cure` | 0.500 | 0.750, 0.250 | 7, 8 | +0.125 (0.239) |"
    )  # sqrt(0.0625 + 1/6) / 2
    assert "grpo" in OPTIONS and all(isinstance(v, list) for v in OPTIONS.values())


def test_reuse_skips_finished_commands_and_keeps_their_seconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import bench.studies.common as common

    calls: list[list[str]] = []

    def fake_essa(args: list[str], log: Path, threads: int) -> float:
        calls.append(args)
        (tmp_path / "done.json").write_text("{}")
        return 12.5

    monkeypatch.setattr(common, "essa", fake_essa)
    done, log = tmp_path / "done.json", tmp_path / "run.log"
    assert common.timed(["train"], done, log, 2, reuse=True) == 12.5  # nothing to reuse yet: runs
    assert log.with_suffix(".seconds").read_text() == "12.5\n"
    assert common.timed(["train"], done, log, 2, reuse=True) == 12.5  # reused: not run again
    assert len(calls) == 1
    assert common.timed(["train"], done, log, 2, reuse=False) == 12.5  # without --reuse: runs
    assert len(calls) == 2


def test_ablation_arms_are_paired_with_the_default_of_their_seed() -> None:
    from bench.studies.real_model_ablation import ARMS, summarise
    from bench.studies.real_model_ablation import table as ablation_table

    def run(sft: list[float], final: list[float], wall: float) -> dict:
        return {
            "scores": {"sft": sft, "final": final},
            "accuracy": {"sft": sum(sft) / len(sft), "final": sum(final) / len(final)},
            "essa_vs_sft": paired(final, sft),
            "summary": {"wall_seconds": wall, "generations": 30, "peak_rss_mb": wall * 5},
        }

    default = [run([0, 0, 1, 0], [1, 0, 1, 0], 600)]
    arm = [run([0, 0, 1, 0], [1, 1, 1, 0], 1200)]
    s = summarise(arm, default)
    assert s["vs_default"] == 0.25 and s["gain_over_sft"] == 0.5
    assert s["gain_per_minute"] == pytest.approx(0.5 / 20)
    text = ablation_table({"summary": {"default": summarise(default, default),
                                       "no_tie_breaker": s}})  # fmt: skip
    assert "| no_tie_breaker | `reward.reference_weight=0` | 0.250 | 0.750 | +0.500 |" in text
    assert "| +0.250 (0.250) | 30.0 | 6000 |" in text  # generations, peak RSS (MB)
    assert ARMS["default"] == []


def test_drift_arms_report_off_task_kl_against_the_baseline_and_grpo() -> None:
    """With drift reports on every run, an ablation row gains KL(base||tuned), KL(SFT||tuned) and
    the KL ratios (per-prompt pairs pooled over seeds) to the baseline arm and to GRPO."""
    from bench.studies.real_model_ablation import ABLATION, ARMS, summarise
    from bench.studies.real_model_ablation import table as ablation_table

    def run(kl: list[float], kl_sft: float) -> dict:
        drift = {"kl_base": sum(kl) / len(kl), "kl_sft": kl_sft, "kl_per_prompt": {"kl_base": kl}}
        return {
            "scores": {"sft": [0, 1], "final": [1, 1]},
            "accuracy": {"sft": 0.5, "final": 1.0},
            "essa_vs_sft": paired([1, 1], [0, 1]),
            "summary": {"wall_seconds": 600, "generations": 30, "drift": drift},
        }

    default = [run([0.4, 0.8], 0.2), run([0.6, 1.0], 0.2)]
    anchor = [run([0.2, 0.4], 0.05), run([0.3, 0.5], 0.05)]
    grpo = [r["summary"]["drift"] for r in [run([0.4, 0.4], 0.1), run([0.4, 0.4], 0.1)]]
    s = summarise(anchor, default, grpo)["drift"]
    assert s["kl_base"] == pytest.approx(0.35) and s["kl_sft"] == pytest.approx(0.05)
    assert s["kl_vs_baseline"]["ratio"] == pytest.approx(1.4 / 2.8)
    assert s["kl_vs_grpo"]["ratio"] == pytest.approx(1.4 / 1.6)
    assert s["kl_vs_grpo"]["n"] == 4 and s["kl_vs_grpo"]["se"] > 0
    assert "drift_anchor" in ARMS and "drift_anchor" not in ABLATION
    text = ablation_table({"summary": {"default": summarise(default, default, grpo),
                                       "drift_anchor": summarise(anchor, default, grpo)}})  # fmt: skip
    assert "| KL(base‖tuned) | KL(SFT‖tuned) | KL vs default | KL vs GRPO |" in text
    assert "| 0.350 | 0.050 | 0.50x ± " in text  # the anchor arm's row
    assert "| 0.700 | 0.200 | - | 1.75x ± " in text  # the baseline's: no ratio to itself
    # without drift reports the table keeps its columns
    plain = [{**r, "summary": {"wall_seconds": 600, "generations": 30}} for r in default]
    assert "KL vs" not in ablation_table({"summary": {"default": summarise(plain, plain)}})


def test_real_model_signal_arms_count_rows_and_compare_with_their_baseline(tmp_path: Path) -> None:
    """The per-prompt switches' real-model arms: rows, the curve with the final
    appended, skip/hint counts, rows per point of gain and rows-to-threshold against `pool`."""
    from bench.studies.real_model_ablation import ARMS, prompt_signal, summarise
    from bench.studies.real_model_ablation import table as ablation_table
    from essa.config import dump_config, load_config

    def run_dir(name: str, records: list[dict]) -> Path:
        d = tmp_path / name
        d.mkdir()
        cfg = load_config(None, ["data.batch_size=8", "optimizer.population_size=4"])
        (d / "config.yaml").write_text(dump_config(cfg))
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return d

    base_records = [
        {"generation": -1, "heldout_accuracy": 0.25},
        {"generation": 0, "heldout_accuracy": 0.25},
        {"generation": 1},
    ]
    on_records = [
        {"generation": -1, "heldout_accuracy": 0.25},
        {"generation": 0, "heldout_accuracy": 0.75, "prompts_skipped": 3, "rows_saved": 12,
         "zero_spread_fraction": 0.5},
        {"generation": 1, "prompts_skipped": 1, "rows_saved": 4, "prompts_hinted": 2,
         "zero_spread_fraction": 0.25},
    ]  # fmt: skip
    # 4 candidates x 8 prompts = 32 rows per generation
    base_signal = prompt_signal(run_dir("base", base_records), 0.5)
    assert base_signal["rows"] == 64
    assert base_signal["curve"] == [(0, 0.25), (32, 0.25), (64, 0.5)]
    assert base_signal["zero_spread_fraction"] is None
    on_signal = prompt_signal(run_dir("on", on_records), 0.75)
    assert on_signal["prompts_skipped"] == 4 and on_signal["rows_saved"] == 16
    assert on_signal["prompts_hinted"] == 2 and on_signal["zero_spread_fraction"] == 0.375

    def run(final: list[float], signal: dict) -> dict:
        sft = [0, 0, 1, 0]
        return {
            "scores": {"sft": sft, "final": final},
            "accuracy": {"sft": 0.25, "final": sum(final) / len(final)},
            "essa_vs_sft": paired(final, sft),
            "summary": {"wall_seconds": 600},
            "signal": signal,
        }

    base, on = [run([1, 0, 1, 0], base_signal)], [run([1, 1, 1, 0], on_signal)]
    s = summarise(on, base)
    # threshold 0.25 + 0.9 x 0.25 = 0.475: the base reaches it at 64 rows, the switch at 32
    assert s["rows_to_threshold_ratio"] == [2.0] and s["rows_to_threshold_geomean"] == 2.0
    assert s["rows_per_gain"] == pytest.approx(64 / 0.5)  # 64 rows for +0.5 over SFT
    assert s["vs_default"] == 0.25 and s["prompts_skipped"] == 4
    flat = summarise([run([0, 0, 1, 0], base_signal)], base)
    assert flat["rows_per_gain"] is None  # no gain: no rows-per-gain figure
    text = ablation_table({"baseline": "pool", "summary": {"pool": summarise(base, base),
                                                           "pool_greso": s}})  # fmt: skip
    assert "vs pool (paired SE)" in text
    assert "| pool_greso | `data.train_size=128`, `data.selection.name=greso` |" in text
    assert "| +0.250 (0.250) | - | - | 1 | 2.00x (2.00) | 4 | 2 |" in text  # no summary counts
    assert ARMS["pool_greso"] == [*ARMS["pool"], "data.selection.name=greso"]


def test_reuse_restores_an_archived_command_only_when_it_is_the_same_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wiped --root: --reuse puts the archived records back instead of running again, unless
    the arguments or the task config changed."""
    import bench.studies.common as common

    monkeypatch.setattr(common, "ARCHIVE", tmp_path / "archive")
    calls: list[list[str]] = []
    config = tmp_path / "config.yaml"
    config.write_text("data: {batch_size: 32}\n")
    root = tmp_path / "runs" / "chain_sum"
    run_dir, log = root / "essa-seed0", root / "essa-seed0.log"
    keep = [run_dir / "summary.json", run_dir / "heldout_scores.jsonl"]

    def fake_essa(args: list[str], log: Path, threads: int) -> float:
        calls.append(args)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "summary.json").write_text(json.dumps({"run": len(calls)}))
        (run_dir / "heldout_scores.jsonl").write_text('{"scores": [1.0, 0.0]}\n')
        return 30.0 + len(calls)

    monkeypatch.setattr(common, "essa", fake_essa)
    args = ["train", str(config), "--set", "run.seed=0"]
    root.mkdir(parents=True)
    assert common.timed(args, keep[0], log, 2, reuse=True, keep=keep) == 31.0
    archived = common.archived(log)
    assert common.archive_file(log) == tmp_path / "archive" / "chain_sum.jsonl.xz"
    assert archived is not None and archived["command"]["seconds"] == 31.0
    assert archived["files"]["heldout_scores.jsonl"] == '{"scores": [1.0, 0.0]}\n'

    for path in [*keep, log.with_suffix(".seconds")]:  # the machine is wiped
        path.unlink()
    assert common.timed(args, keep[0], log, 2, reuse=True, keep=keep) == 31.0  # restored, not run
    assert len(calls) == 1
    assert json.loads(keep[0].read_text()) == {"run": 1}
    assert keep[1].read_text() == '{"scores": [1.0, 0.0]}\n'

    for path in [*keep, log.with_suffix(".seconds")]:
        path.unlink()
    config.write_text("data: {batch_size: 64}\n")  # another task config: the record is not it
    assert common.timed(args, keep[0], log, 2, reuse=True, keep=keep) == 32.0
    assert len(calls) == 2
    record = common.archived(log)  # the record now is the new config's run
    assert record is not None and record["command"]["config"] == config.read_text()
    other = [*args, "--set", "data.batch_size=16"]  # other arguments: run as well
    for path in [*keep, log.with_suffix(".seconds")]:
        path.unlink()
    assert common.timed(other, keep[0], log, 2, reuse=True, keep=keep) == 33.0
    assert len(calls) == 3


def test_reuse_runs_again_a_record_whose_run_resolved_its_config_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record whose run directory's config.yaml (the config as its day's code resolved it)
    lacks a default added since, or holds another default value, is not today's command, although
    its task config and arguments are the same: --reuse runs it again."""
    import bench.studies.common as common
    from essa.config import dump_config, load_config

    monkeypatch.setattr(common, "ARCHIVE", tmp_path / "archive")
    calls: list[list[str]] = []
    config = tmp_path / "config.yaml"
    config.write_text("data: {batch_size: 32}\n")
    root = tmp_path / "runs" / "chain_sum"
    run_dir, log = root / "essa-seed0", root / "essa-seed0.log"
    keep = [run_dir / "config.yaml", run_dir / "summary.json"]

    def fake_essa(args: list[str], log: Path, threads: int) -> float:
        calls.append(args)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(load_config(config, ["run.seed=0"])))
        (run_dir / "summary.json").write_text(json.dumps({"run": len(calls)}))
        return 30.0 + len(calls)

    def wipe() -> None:
        for path in [*keep, log.with_suffix(".seconds")]:
            path.unlink()

    monkeypatch.setattr(common, "essa", fake_essa)
    args = ["train", str(config), "--set", "run.seed=0"]
    root.mkdir(parents=True)
    assert common.timed(args, keep[0], log, 2, reuse=True, keep=keep) == 31.0
    wipe()
    assert common.timed(args, keep[0], log, 2, reuse=True, keep=keep) == 31.0  # restored
    assert len(calls) == 1

    def rewrite(old: str, new: str) -> None:  # the record as an older day's code left it
        path = common.archive_file(log)
        records = common.read_archive(path)
        text = records["essa-seed0"]["files"]["config.yaml"]
        records["essa-seed0"]["files"]["config.yaml"] = text.replace(old, new)
        common.write_archive(path, records)

    no_key = ("  reference_check: true\n", "")  # a key added since
    other_default = ("  reference_weight: 0.0\n", "  reference_weight: 1.0\n")
    for old, new in (no_key, other_default):
        assert old in keep[0].read_text()
        wipe()
        rewrite(old, new)
        ran = len(calls)
        assert common.timed(args, keep[0], log, 2, reuse=True, keep=keep) == 31.0 + ran  # run again
    assert len(calls) == 3


def test_the_archive_keeps_only_the_base_models_scores_of_its_completions(
    tmp_path: Path,
) -> None:
    """An archived base_eval.items.jsonl keeps each item's reward (all the bench reads back),
    not the prompt and completion; every other file is kept whole."""
    import bench.studies.common as common

    items = "".join(
        json.dumps({"prompt": "p" * 200, "completion": "c" * 100, "reward": r}) + "\n"
        for r in (1.0, 0.0, None)
    )
    files = {"base_eval.items.jsonl": items, "base_eval.json": '{"accuracy": 0.33}'}
    path = tmp_path / "task.jsonl.xz"
    common.write_archive(path, {"base_eval": {"name": "base_eval", "command": {}, "files": files}})
    (record,) = common.read_archive(path).values()
    kept = record["files"]["base_eval.items.jsonl"].splitlines()
    assert [json.loads(x) for x in kept] == [{"reward": 1.0}, {"reward": 0.0}, {"reward": None}]
    assert record["files"]["base_eval.json"] == files["base_eval.json"]


def test_reuse_restores_the_record_of_an_arm_that_ran_the_same_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ablation arm that became the default: a command whose task config now holds what the
    arm set with --set (comments and run directory aside) is restored from the arm's record;
    one that differs in any resolved value is run."""
    import bench.studies.common as common

    monkeypatch.setattr(common, "ARCHIVE", tmp_path / "archive")
    calls: list[list[str]] = []
    root = tmp_path / "runs" / "chain_sum"

    def fake_essa(args: list[str], log: Path, threads: int) -> float:
        calls.append(args)
        run_dir = Path(args[args.index("--run-dir") + 1])
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "summary.json").write_text(
            json.dumps({"run": args[args.index("--run-dir") + 1]})
        )
        return 40.0 + len(calls)

    def command(name: str, *overrides: str) -> tuple[list[str], Path, list[Path]]:
        args = [
            "train",
            str(config),
            "--overwrite",
            "--run-dir",
            str(root / name),
            *sets(overrides),
        ]
        return args, root / f"{name}.log", [root / name / "summary.json"]

    monkeypatch.setattr(common, "essa", fake_essa)
    root.mkdir(parents=True)
    config = tmp_path / "config.yaml"
    config.write_text("# 24 steps\nsft: {steps: 24}\n")
    args, log, keep = command("ablation-longer_sft-seed0", "sft.steps=48")
    assert common.timed(args, keep[0], log, 2, reuse=True, keep=keep) == 41.0

    config.write_text("# 48 steps now\nsft: {steps: 48}\n")  # the arm became the default
    args, log, keep = command("essa-seed0")
    assert common.timed(args, keep[0], log, 2, reuse=True, keep=keep) == 41.0  # restored, not run
    assert len(calls) == 1
    assert json.loads(keep[0].read_text()) == {"run": str(root / "ablation-longer_sft-seed0")}
    assert common.archived(log) is not None  # archived under its own name too

    args, log, keep = command("essa-seed1", "run.seed=1")  # another seed: run
    assert common.timed(args, keep[0], log, 2, reuse=True, keep=keep) == 42.0
    assert len(calls) == 2


def test_grpo_reruns_essa_only_when_it_must_run_and_its_sft_adapter_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restored ESSA run keeps no weights: GRPO, which starts from its SFT adapter, needs the
    ESSA run again, unless GRPO itself is finished or archived (then nothing runs)."""
    import bench.studies.common as common

    monkeypatch.setattr(common, "ARCHIVE", tmp_path / "archive")
    root = tmp_path / "runs" / "chain_sum"
    root.mkdir(parents=True)
    config = tmp_path / "config.yaml"
    config.write_text("sft: {steps: 48}\n")
    sft = root / "essa-seed0" / "sft_adapter"
    essa_run = {"seed": 0, "summary": {"wall_seconds": 900.0, "sft_adapter_dir": str(sft)}}

    assert common.grpo_needs_sft_adapter(config, essa_run, root, [], reuse=True)
    assert common.grpo_needs_sft_adapter(config, essa_run, root, [], reuse=False)
    sft.mkdir(parents=True)
    assert not common.grpo_needs_sft_adapter(config, essa_run, root, [], reuse=True)
    sft.rmdir()

    args, log, keep = common.grpo_command(config, essa_run, root, [])
    assert f"adapter.path={sft}" in args
    keep[0].parent.mkdir(parents=True)
    for path in keep:
        path.write_text("{}\n")
    resolved = common.effective(args, config.read_text())["config"]  # what the run writes
    (keep[0].parent / "config.yaml").write_text(json.dumps(resolved))
    assert keep[0].parent / "config.yaml" in keep
    common.archive(args, log, 300.0, keep)  # GRPO ran once and was archived ...
    for path in keep:
        path.unlink()  # ... then the machine was wiped: restorable, so no ESSA run is needed
    assert not common.grpo_needs_sft_adapter(config, essa_run, root, [], reuse=True)
    assert common.grpo_needs_sft_adapter(config, essa_run, root, [], reuse=False)
    config.write_text("sft: {steps: 24}\n")  # another config: the record is not this GRPO
    assert common.grpo_needs_sft_adapter(config, essa_run, root, [], reuse=True)


def test_replay_pins_what_depended_on_the_clock(tmp_path: Path) -> None:
    """--verify reruns the recorded command with its config text, into a new run directory,
    with the plan off, no wall-clock budget and the recorded generation count."""
    from bench.studies.real_model import pass_scores, replay_args

    args = ["train", "runs/x/task.yaml", "--overwrite", "--run-dir", "runs/x/essa-seed0",
            "--set", "run.seed=0"]  # fmt: skip
    summary = {"generations": 23}
    record = {"command": {"args": args}, "files": {"summary.json": json.dumps(summary)}}
    got = replay_args(record, tmp_path / "c.yaml", tmp_path / "run")
    assert got[:5] == ["train", str(tmp_path / "c.yaml"), "--overwrite", "--run-dir",
                       str(tmp_path / "run")]  # fmt: skip
    assert got[5:] == sets(
        ["run.seed=0", "run.plan=false", "run.max_wall_seconds=null", "run.generations=23"]
    )
    assert args[1] == "runs/x/task.yaml"  # the record is not changed
    text = "".join(
        json.dumps({"pass": p, "generation": g, "scores": s}) + "\n"
        for p, g, s in [("held-out baseline", -1, [0.0, 1.0]), ("held-out", 9, [1.0, 1.0])]
    )
    assert pass_scores(text) == {("held-out baseline", -1): [0.0, 1.0], ("held-out", 9): [1.0, 1.0]}


def test_drift_columns_pair_essa_and_grpo_per_seed() -> None:
    """The table's KL cell pools per-prompt KL pairs over the GRPO seeds into a ratio and its
    retention cell averages each recipe's changes from base and SFT over its runs; the drift
    table lists each seed's two reports; records without drift reports give "-" / no row."""
    from bench.studies.real_model import drift_cells, drift_table, retention_cell

    def report(kl: list[float], kept: float, update: float, pass_k: float) -> dict:
        return {
            "kl_base": sum(kl) / len(kl), "kl_base_sft": 0.4, "kl_sft": 0.1,
            "kl_per_prompt": {"kl_base": kl},
            "retention": {"items": 128, "change_from_base": kept - 0.125, "change_from_sft": kept},
            "update": {"final": {"mean": update}},
            "samples": {"k": 4, "pass@4": pass_k},
        }  # fmt: skip

    essa = [{"seed": s, "summary": {"drift": report([0.2, 0.4], 0.0, 0.01, 0.5)},
             "essa_vs_sft": {"gain": 0.05}} for s in (0, 1)]  # fmt: skip
    grpo = [{"seed": s, "summary": {"drift": report([1.0, 2.0], -0.25, 0.02, 0.75)},
             "grpo_vs_sft": {"gain": 0.06}} for s in (0, 1)]  # fmt: skip
    t = {"essa": essa, "grpo_runs": grpo}
    assert drift_cells(t) == "0.3000 / 1.5000 (0.20x ± 0.00)"  # every ESSA prompt a fifth
    assert retention_cell(t) == "-0.125 / +0.000 (2 x 128); -0.375 / -0.250 (2 x 128)"
    rows = drift_table({"tasks": {"chain_sum": t}}).splitlines()[2:]
    assert rows == [
        f"| chain_sum | {s} | +0.050 / +0.060 | 0.400 | 0.300 / 1.500 | 0.100 / 0.100 | "
        "0.0100 / 0.0200 | 0.500 / 0.750 | -0.125 / +0.000 (1 x 128); -0.375 / -0.250 (1 x 128) |"
        for s in (0, 1)
    ]
    # ESSA alone (no GRPO run): its retention change is still in the table
    assert retention_cell({"essa": essa}) == "-0.125 / +0.000 (2 x 128); -"
    assert drift_cells({"essa": essa}) == "-"
    old = {"essa": [{"seed": 0, "summary": {}}], "grpo": {"seed": 0, "summary": {}}}
    assert drift_cells(old) == "-" and retention_cell(old) == "-; -"
    assert drift_table({"tasks": {"chain_sum": {**old, "grpo_runs": [old["grpo"]]}}}) == ""


def test_tie_breaker_table_shows_each_factor_and_the_checks_verdict() -> None:
    from bench.studies.tie_breaker import table

    line = {
        "factors": [0.5, 1.0],
        "reward": [0.39, 0.19],
        "likelihood": [-0.66, -0.48],
        "margin": [-0.35, -0.29],
        "reference_written": [0.08, 0.14],
        "reward_choice": 0.5,
        "check": {"agrees": False, "factor": 1.0, "reward_with": 0.19, "reward_without": 0.39},
    }
    same = {"agrees": True, "factor": 0.5, "reward_with": 0.39, "reward_without": 0.39}
    kept = {**line, "check": same}
    rows = table({"tasks": {"number_format": line, "chain_sum": kept}}).splitlines()
    assert rows[2] == (
        "| number_format | x0.5: 0.390 / -0.66 / -0.35 / 0.08<br>x1: 0.190 / -0.48 / -0.29 / 0.14"
        " | x0.5 | x1 | 0.190 / 0.390 | off |"
    )
    assert rows[3].endswith("| x0.5 | x0.5 | 0.390 / 0.390 | kept |")


def test_the_signal_table_reads_each_runs_stop_budget_and_exported_point() -> None:
    from bench.studies.real_model import signal_table

    def run(gain: float, reason: str | None, generations: int, wall: float, point: str) -> dict:
        return {
            "accuracy": {"sft": 0.2, "final": 0.2 + gain},
            "signal_median": 0.1 + gain,
            "summary": {"stop_reason": reason, "generations": generations, "wall_seconds": wall,
                        "plan": {"budget": 1000.0, "generations": 40},
                        "exported": {"point": point}},
        }  # fmt: skip

    patience = "stopping after generation 20: validation has not improved for 2 checks"
    floor = "no signal: the start scores 0.000 on 64 validation items, at the floor"
    result = {"tasks": {
        "climbs": {"essa": [run(0.05, patience, 20, 600.0, "mean after generation 10"),
                            run(0.03, None, 40, 900.0, "mean after generation 40")],
                   "essa_vs_sft": {"gain": 0.04, "se": 0.01},
                   "grpo_runs": [{"seed": 0, "grpo_vs_sft": {"gain": 0.03, "se": 0.01}}]},
        "floor": {"essa": [run(0.0, floor, 0, 150.0, "SFT adapter")],
                  "essa_vs_sft": {"gain": 0.0, "se": 0.0}},
    }}  # fmt: skip
    rows = signal_table(result, {"climbs": "+0.045 (0.009)"}).splitlines()
    assert rows[2] == (
        "| climbs | 0.200 | 0.240 | +0.040 (0.010) | +0.045 (0.009) | +0.030 (0.010, seed 0) "
        "| patience (20); cap (40) "
        "| 20, 40 | 75% | 0.14 | mean after generation 10; mean after generation 40 |"
    )
    assert rows[3] == (
        "| floor | 0.200 | 0.200 | +0.000 (0.000) | - | - | floor (pre-flight) | 0 | 15% | 0.10 "
        "| SFT adapter |"
    )


def test_drift_proof_pools_each_recipe_against_grpo_and_the_shipped_gain() -> None:
    """bench.studies.drift_proof: per recipe the pooled gain over SFT, its share of the shipped
    ESSA run's gain, the per-prompt KL ratio to GRPO over the seeds, retention's change, and the
    target's verdict on the drift arms only."""
    from bench.studies.drift_proof import parse_arm, run_dir_name, summarise
    from bench.studies.drift_proof import table as proof_table

    def run(seed: int, gain: float, kl: list[float], key: str = "essa_vs_sft") -> dict:
        kept = {"items": 64, "change_from_base": -0.25, "change_from_sft": 0.0}
        drift = {"kl_base": sum(kl) / len(kl), "kl_per_prompt": {"kl_base": kl}, "retention": kept}
        return {"seed": seed, "run_dir": f"r{seed}", key: {"gain": gain, "se": 0.01},
                "summary": {"wall_seconds": 500, "drift": drift}}  # fmt: skip

    runs = {
        "essa": [run(0, 0.04, [0.6, 1.0]), run(1, 0.06, [0.8, 1.2])],
        "decay 0.05": [run(0, 0.045, [0.2, 0.4]), run(1, 0.046, [0.3, 0.5])],
        "grpo": [run(s, 0.05, [0.4, 0.4], "grpo_vs_sft") for s in (0, 1)],
    }
    s = summarise(runs)
    assert s["essa"]["share_of_shipped_gain"] == pytest.approx(1.0)
    assert s["decay 0.05"]["share_of_shipped_gain"] == pytest.approx(0.91)
    assert s["decay 0.05"]["gain_se"] == pytest.approx(math.sqrt(2) * 0.01 / 2)
    assert s["essa"]["kl_vs_grpo"]["ratio"] == pytest.approx(3.6 / 1.6)
    assert s["decay 0.05"]["kl_vs_grpo"]["ratio"] == pytest.approx(1.4 / 1.6)
    assert s["grpo"]["kl_vs_grpo"] == {"ratio": 1.0, "se": 0.0, "n": 4}
    rows = proof_table({"tasks": {"chain_sum": s}}).splitlines()[2:]
    assert rows[0].startswith("| chain_sum | essa | +0.050 (0.007) | 100% | 0.900 | 2.25x ± ")
    assert rows[1].endswith("| -0.250 / +0.000 (2 x 64) | yes |")  # 91% of the gain at 0.88x
    assert rows[2].endswith(" | - |") and "| grpo | +0.050 (0.007) |" in rows[2]
    # a drift arm that keeps the KL but not the gain misses the target
    runs["decay 0.05"][1]["essa_vs_sft"]["gain"] = 0.03
    assert proof_table({"tasks": {"t": summarise(runs)}}).splitlines()[3].endswith("| no |")
    assert parse_arm(
        "kl=optimizer.drift_budget.kl_budget=0.5,optimizer.drift_budget.decay=0.1"
    ) == ("kl", ["optimizer.drift_budget.kl_budget=0.5", "optimizer.drift_budget.decay=0.1"])
    assert run_dir_name("decay 0.05") == "drift-decay_0.05"
    with pytest.raises(Exception, match="expected NAME=KEY=VALUE"):
        parse_arm("decay")
