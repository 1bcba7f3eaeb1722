"""A run that reads its own signal: the per-generation signal, the validation split, the
exported point chosen on validation, the early stop and the pre-flight (essa.es.signal,
essa.es.watch), down to `essa train` on a task at the floor."""

from __future__ import annotations

import doctest
import json
from pathlib import Path

import numpy as np
import pytest

import essa.es.signal as signal_module
import essa.es.watch as watch_module
from essa.config import DataConfig
from essa.data.task import load_task, val_items
from essa.es.signal import disagree_share, signal_record, split_half
from essa.es.watch import CEILING, FLOOR, Watch, WatchSettings, paired_gain
from tests.cli_runner import essa


def test_doctests() -> None:
    import essa.es.checks as checks_module

    for module in (signal_module, watch_module, checks_module):
        assert doctest.testmod(module).failed == 0


def test_a_kl_budget_keeps_the_held_points_check_in_the_reserve() -> None:
    """With a KL budget the export may validate the held point after the last mean's check:
    the reserve keeps two checks, before the search and after each check of the mean."""
    from types import SimpleNamespace

    from essa.dist import LocalComm
    from essa.es.checks import Checks, passes_after

    task = SimpleNamespace(test=[None] * 10)
    for promise, checks in ((None, 1), (object(), 2)):
        h = SimpleNamespace(comm=LocalComm(), end_reserve=0.0)
        c = Checks(h, None, task, [], [], None, None, None, promise)  # type: ignore[arg-type]
        c.reserve_end(50.0, check_seconds=10.0)
        assert h.end_reserve == passes_after(50.0, 0.0, 10.0, checks=checks) == 50 + 10 * checks


# ---------------------------------------------------------------------- the signal
def test_identical_candidates_give_no_signal() -> None:
    rng = np.random.default_rng(0)
    row = (rng.random(32) < 0.4).astype(float)
    values = np.tile(row, (16, 1))  # (P, N): every candidate answers every prompt alike
    fitness = values.mean(1)
    record = signal_record(fitness, values, seed=3, g=5)
    assert record == {
        "signal": 0.0,
        "reward_signal": 0.0,
        "disagree_share": 0.0,
        "zero_margin": 1.0,
    }


def test_a_planted_ranking_gives_a_high_signal() -> None:
    """Candidate c is right on a share of prompts that grows with c: any half of the batch
    ranks them as the other half does."""
    rng = np.random.default_rng(1)
    skill = np.linspace(0.05, 0.95, 16)[:, None]  # (P, 1)
    values = (rng.random((16, 64)) < skill).astype(float)  # (P, N)
    assert split_half(values, 0, 0) > 0.9
    record = signal_record(values.mean(1), values, 0, 0)
    assert record["zero_margin"] == 0.0 and record["disagree_share"] > 0.9


def test_noise_gives_a_signal_near_zero() -> None:
    """Candidates alike in skill, each prompt's outcome a coin: the median over many
    generations is 0 and most generations read below a planted ranking's."""
    rng = np.random.default_rng(2)
    null = [split_half((rng.random((16, 32)) < 0.3).astype(float), 0, g) for g in range(100)]
    assert np.median(null) < 0.05 and np.percentile(null, 75) < 0.3
    assert all(0.0 <= v <= 1.0 for v in null)


def test_the_signal_is_the_same_on_every_call_and_differs_by_generation() -> None:
    rng = np.random.default_rng(4)
    values = (rng.random((8, 32)) < np.linspace(0.3, 0.6, 8)[:, None]).astype(float)
    assert split_half(values, 7, 3) == split_half(values, 7, 3)  # every rank, a resume
    assert len({split_half(values, 7, g) for g in range(6)}) > 1  # other random halves


def test_disagree_share_counts_prompts_where_candidates_differ() -> None:
    values = np.array([[1.0, 0.0, 1.0, np.nan], [1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0]])
    assert disagree_share(values) == pytest.approx(2 / 4)  # prompts 1 and 2


def test_failed_candidates_rank_last_without_breaking_the_signal() -> None:
    values = np.tile(np.arange(6.0)[:, None], (1, 10))
    values[0] = np.nan  # a candidate with non-finite logits
    assert split_half(values, 0, 0) == pytest.approx(1.0)


def test_with_the_tie_breaker_the_signal_reads_the_ranking_the_search_uses() -> None:
    """Every candidate's reward ties on every prompt, but the tie-breaker's term orders them
    on every prompt: the ranking the search uses is reliable, the reward's alone is not."""
    from essa.es.generation import ranked_values

    rng = np.random.default_rng(5)
    values = np.tile((rng.random(32) < 0.4).astype(float), (16, 1))  # (P, N): ties
    terms = -2.0 + 0.05 * np.arange(16.0)[:, None] + 0.01 * rng.standard_normal((16, 32))
    ranked = ranked_values(values, terms, 0.5, 1)  # (P, N)
    assert split_half(values, 0, 0) == 0.0 and split_half(ranked, 0, 0) > 0.9
    # two samples per prompt: the term is the prompt's mean over its samples
    twice = np.repeat(terms, 2, axis=1)  # (P, 2N)
    np.testing.assert_allclose(ranked_values(values, twice, 0.5, 2), ranked)


@pytest.mark.slow
def test_a_run_with_the_tie_breaker_logs_both_signals(tmp_path: Path) -> None:
    """Each generation records the reward's signal and the ranking's; the tie-breaker's term
    moves the second."""
    run_dir = tmp_path / "run"
    res = essa("train", "--run-dir", str(run_dir), *_sets(
        "sft.steps=6", "data.sft_size=16", "data.test_size=16", "data.val_size=0",
        "data.batch_size=16", "optimizer.population_size=8", "evaluation.every=0",
        "run.generations=3", "run.show_progress=false", "evaluation.drift.items=0",
        "reward.reference_weight=1", "reward.reference_check=false",
    ))  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if r.get("generation", -1) >= 0 and "signal" in r]
    assert len(records) == 3
    assert all(0 <= r["signal"] <= 1 and 0 <= r["reward_signal"] <= 1 for r in records)
    assert any(r["signal"] != r["reward_signal"] for r in records)


def _sets(*pairs: str) -> list[str]:
    return [x for pair in pairs for x in ("--set", pair)]


# ---------------------------------------------------------------------- validation split
def test_validation_split_is_disjoint_and_sized() -> None:
    task = load_task(DataConfig(sft_size=100, test_size=200), seed=0)
    prompts = {name: {e.prompt for e in getattr(task, name)} for name in ("sft", "val", "test")}
    prompts["train"] = {e.prompt for e in task.train}
    names = list(prompts)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not prompts[a] & prompts[b], (a, b)
    assert len(task.val) == 256
    assert len(load_task(DataConfig(sft_size=100, val_size=40), seed=0).val) == 40
    assert load_task(DataConfig(sft_size=100, val_size=0), seed=0).val == []
    assert val_items(None, 100) == 25  # a small pool keeps most for training


# ---------------------------------------------------------------------- the watch
def _watch(**settings: object) -> Watch:
    return Watch(WatchSettings(**settings))  # type: ignore[arg-type]


def test_paired_gain_matches_its_formula() -> None:
    a, b = [1.0, 0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0]
    d = np.subtract(a, b)
    assert paired_gain(a, b) == pytest.approx((d.mean(), d.std(ddof=1) / np.sqrt(5)))


def test_a_lucky_point_within_its_se_is_not_exported() -> None:
    """Two items better and one worse of 100 is within its paired SE: the SFT adapter is
    exported."""
    sft = [0.0, 0.0, 1.0] + [0.0] * 97
    lucky = [1.0, 1.0, 0.0] + [0.0] * 97
    w = _watch()
    w.observe("SFT adapter", -1, np.zeros(3), sft)
    w.start_search()
    w.observe("mean after generation 10", 9, np.ones(3), lucky)
    vector, exported = w.choice(np.full(3, 2.0))
    assert exported["point"] == "SFT adapter" and np.array_equal(vector, np.zeros(3))
    assert "paired SE" in exported["why"]


@pytest.mark.parametrize("export", ["latest", "best"])
def test_an_earlier_point_better_beyond_its_se_is_exported_not_the_last(export: str) -> None:
    sft = [0.0] * 50 + [1.0] * 50
    w = _watch(patience=0, export=export)
    w.observe("SFT adapter", -1, np.zeros(2), sft)
    w.start_search()
    w.observe("g10", 9, np.array([1.0, 0.0]), [1.0] * 80 + [0.0] * 20)  # +0.3
    w.observe("g20", 19, np.array([2.0, 0.0]), [1.0] * 90 + [0.0] * 10)  # +0.4, the best
    w.observe("g30", 29, np.array([3.0, 0.0]), [1.0] * 60 + [0.0] * 40)  # +0.1, the last
    vector, exported = w.choice(np.array([3.0, 0.0]))
    assert exported["point"] == "g20" and vector.tolist() == [2.0, 0.0]
    assert exported["val_gain"] == pytest.approx(0.4)


def _climb(export: str) -> tuple[np.ndarray, dict]:
    """A slow climb read through noisy checks: g20 reads highest, g30 a little lower on other
    items (within their paired SE), both well above the SFT adapter."""
    w = _watch(patience=0, export=export)
    w.observe("SFT adapter", -1, np.zeros(1), [0.0] * 60 + [1.0] * 40)
    w.start_search()
    w.observe("g10", 9, np.array([1.0]), [1.0] * 50 + [0.0] * 50)  # +0.10
    w.observe("g20", 19, np.array([2.0]), [1.0] * 66 + [0.0] * 34)  # +0.26, the best
    w.observe("g30", 29, np.array([3.0]), [0.0] * 10 + [1.0] * 63 + [0.0] * 27)  # +0.23
    return w.choice(np.array([3.0]))


def test_latest_exports_the_last_validated_point_when_no_earlier_one_is_clearly_better() -> None:
    vector, exported = _climb("latest")
    assert exported["point"] == "g30" and vector.tolist() == [3.0]
    assert exported["why"].startswith("the latest point that beats the SFT adapter")
    vector, exported = _climb("best")
    assert exported["point"] == "g20" and vector.tolist() == [2.0]
    assert exported["why"].startswith("the best validation score (0.660)")


def test_a_later_point_within_its_se_of_the_sft_adapter_is_not_the_latest() -> None:
    """The latest point is the last one that beats the SFT adapter beyond its SE: a last check
    that falls back to the SFT adapter's level hands the export to the one before it."""
    w = _watch(patience=0)
    w.observe("SFT adapter", -1, np.zeros(1), [0.0] * 60 + [1.0] * 40)
    w.start_search()
    w.observe("g10", 9, np.array([1.0]), [1.0] * 60 + [0.0] * 40)  # +0.20
    w.observe("g20", 19, np.array([2.0]), [1.0] * 2 + [0.0] * 58 + [1.0] * 40)  # +0.02
    vector, exported = w.choice(np.array([2.0]))
    assert exported["point"] == "g10" and vector.tolist() == [1.0]


def test_patience_stops_after_checks_without_a_new_best() -> None:
    w = _watch(patience=2, min_signal=0.0)
    w.observe("SFT adapter", -1, np.zeros(1), [0.0, 1.0, 0.0, 1.0])
    w.start_search()
    w.observe("g10", 9, np.zeros(1), [1.0, 1.0, 0.0, 1.0])  # a new best
    assert w.stop_after_check(9) is None
    w.observe("g20", 19, np.zeros(1), [1.0, 1.0, 0.0, 0.0])
    assert w.stop_after_check(19) is None
    w.observe("g30", 29, np.zeros(1), [1.0, 1.0, 0.0, 1.0])  # equal is not better
    reason = w.stop_after_check(29)
    assert reason is not None and "not improved for 2 checks" in reason and w.stopped


def test_patience_counts_from_the_point_the_search_starts_from() -> None:
    """A scaled start that read higher on validation but did not beat the SFT adapter beyond
    its SE is not where the search starts: checks that improve on the SFT adapter are new
    bests, though not above the scaled start's reading."""
    w = _watch(patience=2, min_signal=0.0)
    w.observe("SFT adapter", -1, np.zeros(1), [0.0] * 60 + [1.0] * 40)  # 0.40
    scaled = [1.0] * 5 + [0.0] * 58 + [1.0] * 37  # 0.42: 5 items up, 3 down, within its SE
    w.observe("SFT adapter x1.5", -1, np.ones(1), scaled)
    assert not w.validated()
    w.start_search(0.40)
    w.observe("g10", 9, np.zeros(1), [0.0] * 59 + [1.0] * 41)  # 0.41
    assert w.stop_after_check(9) is None
    w.observe("g20", 19, np.zeros(1), [0.0] * 58 + [1.0] * 42)  # 0.42
    assert w.stop_after_check(19) is None and w.state["best"] == pytest.approx(0.42)
    without = _watch(patience=2, min_signal=0.0)  # the bar left at the best reading so far
    for name, scores in (("SFT adapter", [0.0] * 60 + [1.0] * 40),
                         ("SFT adapter x1.5", scaled)):  # fmt: skip
        without.observe(name, -1, np.zeros(1), scores)
    without.start_search()
    without.observe("g10", 9, np.zeros(1), [0.0] * 59 + [1.0] * 41)
    without.observe("g20", 19, np.zeros(1), [0.0] * 58 + [1.0] * 42)
    assert without.stop_after_check(19) is not None


def _check_after(patience: int, signals: tuple[float, ...]) -> str | None:
    """A check that brings no new best after four generations with ``signals``: the stop."""
    w = _watch(patience=patience, min_signal=0.1, signal_window=4)
    w.observe("SFT adapter", -1, np.zeros(1), [0.0, 1.0])
    w.start_search()
    for value in signals:
        w.signal(value)
    w.observe("g4", 3, np.zeros(1), [0.0, 1.0])
    return w.stop_after_check(3)


def test_no_signal_stops_at_the_first_check_without_a_new_best() -> None:
    reason = _check_after(5, (0.0, 0.05, 0.0, 0.02))
    assert reason is not None and "no signal" in reason and "0.01" in reason


def test_a_signal_keeps_the_run_going_within_its_patience() -> None:
    assert _check_after(3, (0.5, 0.6, 0.4, 0.7)) is None


def test_no_signal_stop_waits_for_a_full_window() -> None:
    """Three zero-signal generations of a four-generation window: too few to call it."""
    assert _check_after(5, (0.0, 0.0, 0.0)) is None
    assert _check_after(5, (0.0, 0.0, 0.0, 0.0)) is not None


@pytest.mark.parametrize(
    ("score", "dense", "stops"),
    [(0.0, False, True), (0.0, True, False), (1.0, False, True), (1.0, True, True),
     (0.5, False, False), (FLOOR, False, False), (CEILING, False, False)],
)  # fmt: skip
def test_preflight_keeps_the_start_at_the_floor_and_the_ceiling(
    score: float, dense: bool, stops: bool
) -> None:
    w = _watch()
    w.observe("SFT adapter", -1, np.zeros(1), [score] * 64)
    line = w.preflight([score] * 64, dense)
    assert (line is not None) == stops and w.stopped == stops
    if stops and score < FLOOR:
        assert f"{score:.3f} on 64 validation items" in line and "what would help" in line
    if stops and score > CEILING:
        assert line.startswith("start at the ceiling: 64 of 64 validation prompts right (1.00")
        assert "keeping the start" in line and "a harder task" in line


@pytest.mark.parametrize(
    ("right", "of", "ceiling"), [(31, 32, True), (30, 32, False), (9, 10, False), (97, 100, True)]
)
def test_the_start_at_the_ceiling_counts_the_items_it_gets_right(
    right: int, of: int, ceiling: bool
) -> None:
    """(Nearly) every item right: the share right reads 0.97 or more to two places."""
    w = _watch(on_no_signal="search")
    scores = [1.0] * right + [0.0] * (of - right)
    w.observe("SFT adapter", -1, np.zeros(1), scores)
    line = w.preflight(scores, False)
    assert (line is not None) == ceiling and not w.stopped  # search: the line only
    if ceiling:
        assert line == (
            f"start at the ceiling: {right} of {of} validation prompts right ({right / of:.2f}; "
            f"mean score {right / of:.3f}); the search can only drift; searching anyway "
            "(run.on_no_signal: search)"
        )
        assert w.summary()["start_ceiling"] == {"right": right, "items": of, "score": right / of}
    else:
        assert w.summary()["start_ceiling"] is None


def test_preflight_searches_anyway_when_asked() -> None:
    w = _watch(on_no_signal="search")
    w.observe("SFT adapter", -1, np.zeros(1), [0.0] * 8)
    line = w.preflight([0.0] * 8, False)
    assert line is not None and "searching anyway" in line and not w.stopped


def test_the_watch_state_round_trips_through_json() -> None:
    """The state rides in checkpoint.json: a resumed run decides as the uninterrupted one."""
    w = _watch()
    w.observe("SFT adapter", -1, np.zeros(2), [0.0, 1.0, 0.0])
    w.signal(0.3)
    w.observe("g10", 9, np.ones(2), [1.0, 1.0, 1.0])
    again = Watch(WatchSettings(), json.loads(json.dumps(w.state)))
    assert again.state == w.state
    assert again.choice(np.zeros(2))[1] == w.choice(np.zeros(2))[1]


# ---------------------------------------------------------------------- end to end
def _floor_task(path: Path) -> Path:
    """Sums whose 'answers' are unrelated 7-digit numbers: the demo model gets none right."""
    rng = np.random.default_rng(0)
    with path.open("w") as f:
        for _ in range(400):
            a, b = (int(x) for x in rng.integers(10, 99, 2))
            answer = int(rng.integers(1_000_000, 9_999_999))
            f.write(json.dumps({"question": f"{a}+{b}=", "answer": str(answer)}) + "\n")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("start", ["sft", "scale_baseline"])
def test_train_at_the_floor_keeps_the_start_and_says_why(tmp_path: Path, start: str) -> None:
    """At the floor the run keeps the start, says why in one line and scores the test split
    once: the final pass is the start's own scores. With the scaled start configured (and the
    tie-breaker on), the scaled start is not tried from the floor, and the line says so."""
    data = _floor_task(tmp_path / "floor.jsonl")
    run_dir = tmp_path / "run"
    sets = [
        "sft.steps=2", "data.sft_size=32", "data.test_size=40", "data.val_size=40",
        "data.batch_size=8", "optimizer.population_size=4", "run.generations=20",
        "run.show_progress=false", f"data.source={data}", "reward.name=math_accuracy",
        f"optimizer.start={start}", "evaluation.use_scale_baseline=false",
        *(["reward.reference_weight=1.0"] if start == "scale_baseline" else []),
    ]  # fmt: skip
    res = essa("train", "--run-dir", str(run_dir), *[a for s in sets for a in ("--set", s)])
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [line for line in res.stdout.splitlines() if line.startswith("no signal:")]
    assert len(lines) == 1, res.stdout[-3000:]
    assert "0.000 on 40 validation items, at the floor" in lines[0]
    assert "keeping the start" in lines[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["generations"] == 0
    assert summary["exported"]["point"] == "SFT adapter"
    assert summary["final_accuracy"] == summary["baseline_accuracy"]
    assert summary["stop_reason"].startswith("no signal:")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["generation"] for r in records] == [-1]  # no generation ran
    passes = [json.loads(line) for line in (run_dir / "heldout_scores.jsonl").open()]
    assert [(p["pass"], p["final"]) for p in passes] == [
        ("held-out baseline", False),
        ("final held-out", True),
    ]
    assert passes[1]["scores"] == passes[0]["scores"]
    assert "final held-out: the SFT adapter's scores from the start" in res.stdout
    assert "ESSA: no search (the pre-flight kept the start)" in res.stdout
    # The SFT adapter exported unchanged: its KL to the base, no retention or pass@K of its own.
    assert "kl_base" in summary["drift"] and not {"retention", "samples"} & set(summary["drift"])
    assert "drift: the SFT adapter exported unchanged; retention and pass@K not measured" in (
        res.stdout
    )
    assert "exported: SFT adapter (the pre-flight kept the start: no signal)" in res.stdout
    phases = [json.loads(line)["phase"] for line in (run_dir / "phases.jsonl").open()]
    assert phases.count("final held-out") == 0 and phases.count("held-out baseline") >= 1
    assert "scale baseline" not in phases
    assert "drift baseline" not in phases  # the report's fixed parts serve a search only
    if start == "scale_baseline":
        assert "scaled start not tried: the SFT adapter is at the floor on validation" in res.stdout
        assert "the scaled start and the tie-breaker's check are not tried" in lines[0]
        assert summary["scale_baseline"] is None
    else:
        assert "no tie-breaker carries the ranking" in lines[0]


@pytest.mark.slow
def test_train_at_the_ceiling_says_so_before_the_search(tmp_path: Path) -> None:
    """Sums of 11-13, which the demo model gets all right: the run says so in one line before
    the search, with the count, and the summary keeps it; run.on_no_signal search searches."""
    rng = np.random.default_rng(0)
    data = tmp_path / "easy.jsonl"
    with data.open("w") as f:
        for _ in range(400):
            a, b = (int(x) for x in rng.integers(11, 14, 2))
            f.write(json.dumps({"question": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    run_dir = tmp_path / "run"
    sets = [
        "sft.steps=2", "data.sft_size=32", "data.test_size=40", "data.val_size=40",
        "data.batch_size=8", "optimizer.population_size=4", "run.generations=1",
        "run.show_progress=false", f"data.source={data}", "reward.name=math_accuracy",
        "run.on_no_signal=search",
    ]  # fmt: skip
    res = essa("train", "--run-dir", str(run_dir), *[a for s in sets for a in ("--set", s)])
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [line for line in res.stdout.splitlines() if line.startswith("start at the ceiling")]
    assert lines == [
        "start at the ceiling: 40 of 40 validation prompts right (1.00; mean score 1.000); the "
        "search can only drift; searching anyway (run.on_no_signal: search)"
    ], res.stdout[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["start_ceiling"] == {"right": 40, "items": 40, "score": 1.0}
    assert summary["generations"] == 1 and summary["stop_reason"] is None
    # What it computed in: the demo's float32 on this CPU's own instruction set.
    import torch

    assert summary["compute"] == {
        "device": "cpu",
        "dtype": "float32",
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
    }
    phases = [json.loads(line)["phase"] for line in (run_dir / "phases.jsonl").open()]
    assert "drift baseline" in phases  # a run that searches writes the report's fixed parts
