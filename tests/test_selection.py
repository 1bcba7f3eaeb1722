"""The informative-prompt rules (essa/data/selection.py) on hand-made histories.

GRESO's skip probability, its adaptation and the refilled draw; Scaf-GRPO's hint tiers and
hint text; every expected number below is worked out by hand in the comments.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from essa.config import DataConfig, HintConfig, SelectionConfig, load_config
from essa.data.selection import (
    Informative,
    PromptRecord,
    adapt_rate,
    choose,
    hint_text,
    hint_tier,
    skip_probability,
    update,
    visit_kind,
)
from essa.es.generation import prompt_values
from essa.types import Example

GRESO = SelectionConfig(name="greso")
NAN = float("nan")


def tracker(data: DataConfig, seed: int = 7, rows: int = 4) -> Informative:
    return Informative(data, seed, rows, lambda examples: [f"<{e.prompt}>" for e in examples])


def visits(informative: Informative, index: int, *rows: list[float]) -> None:
    for row in rows:
        informative.observe([index], np.array([row]))


def test_streaks_follow_a_hand_made_spread_history() -> None:
    record = PromptRecord()
    history = [
        ([1.0, 1.0, 1.0], PromptRecord(1, easy=1)),  # zero spread, reward > 0: easy
        ([1.0, 1.0, 1.0], PromptRecord(2, easy=2)),
        ([0.0, 1.0, 0.0], PromptRecord(3)),  # spread: every streak ends
        ([0.0, 0.0, 0.0], PromptRecord(4, hard=1, zero=1)),
        ([0.0, NAN, 0.0], PromptRecord(5, hard=2, zero=2)),  # an ungradable reward is left out
        ([NAN, NAN, NAN], PromptRecord(5, hard=2, zero=2)),  # a failed visit is not recorded
        ([-1.0, 0.0, 0.0], PromptRecord(6, zero=3)),  # spread, but nothing scored above 0
        ([-1.0, -1.0, -1.0], PromptRecord(7, hard=1, zero=4)),  # a +-1 reward, all wrong
    ]
    for values, expected in history:
        record = update(record, np.array(values))
        assert record == expected, values
    assert visit_kind(np.array([NAN])) is None


def test_skip_probability_decays_as_greso() -> None:
    # 1 - max(p**z, 0.01): p = 0.5, z = 1 -> 0.5; z = 3 -> 1 - 0.125; z = 7 -> 1 - 0.01 (floor)
    assert skip_probability(PromptRecord(1, easy=1), 0.5, 0.5, 0.01) == 0.5
    assert skip_probability(PromptRecord(3, easy=3), 0.5, 0.5, 0.01) == 0.875
    assert skip_probability(PromptRecord(7, hard=7), 0.5, 0.5, 0.01) == pytest.approx(0.99)
    # each streak takes its own rate: 1 - 0.6**2 = 0.64, 1 - 0.3**2 = 0.91
    assert skip_probability(PromptRecord(2, easy=2), 0.6, 0.3, 0.01) == pytest.approx(0.64)
    assert skip_probability(PromptRecord(2, hard=2), 0.6, 0.3, 0.01) == pytest.approx(0.91)
    assert skip_probability(PromptRecord(5, zero=5), 0.5, 0.5, 0.01) == 0.0  # no zero spread
    assert skip_probability(PromptRecord(), 0.5, 0.5, 0.01) == 0.0  # never seen: never skipped


def test_exploration_rate_moves_toward_the_target() -> None:
    target = 0.25 / 3  # the easy share of GRESO's 0.25
    assert adapt_rate(0.5, 0.1, target, GRESO) == 0.49  # above target: skip more
    assert adapt_rate(0.5, 0.25 / 3, target, GRESO) == 0.49  # at the target: down too
    assert adapt_rate(0.5, 0.0, target, GRESO) == 0.51  # below: explore more
    assert adapt_rate(0.05, 1.0, target, GRESO) == 0.05  # bounded below
    assert adapt_rate(0.95, 0.0, target, GRESO) == 0.95  # and above
    p = 0.5
    for _ in range(4):
        p = adapt_rate(p, 1.0, target, GRESO)
    assert p == 0.46  # four steps of 0.01, no float residue


def test_choose_skips_then_refills_from_the_next_prompts() -> None:
    # j=0: 0.4 < 0.5 skip 5; j=1: keep 2; j=2: 0.98 < 0.99 skip 7; j=3: 0.6 >= 0.5 keep 1; keep 9
    kept, skipped = choose(
        [5, 2, 7, 1, 9], 3, [0.5, 0.0, 0.99, 0.5, 0.0], np.array([0.4, 0.9, 0.98, 0.6, 0.1])
    )
    assert (kept, skipped) == ([2, 1, 9], [5, 7])
    # a walk that ends short takes the first skipped prompts back: the batch keeps its size
    assert choose([3, 4], 2, [1.0, 0.0], np.array([0.2, 0.3])) == ([4, 3], [])


def test_draw_gives_exact_skip_decisions_under_a_fixed_seed() -> None:
    informative = tracker(DataConfig(selection=GRESO))
    visits(informative, 0, [1, 1], [1, 1], [1, 1])  # easy streak 3: skip 1 - 0.5**3 = 0.875
    visits(informative, 1, [0, 0])  # hard streak 1: 0.5
    visits(informative, 2, [0, 1])  # informative: 0
    visits(informative, 6, [0, 0])  # 0.5
    visits(informative, 3, [1, 1])  # 0.5
    informative.end_step()
    informative.p_easy = informative.p_hard = 0.5
    # SeedSequence([7, 31, 4]): the rest of the pool in the order [6, 3, 5, 4, 7], uniforms
    # 0.0233, 0.2678, 0.3556, 0.8576, 0.8484, ... Walk: 0 (0.0233 < 0.875) skipped,
    # 1 (0.2678 < 0.5) skipped, 2 kept, 6 (0.8576 >= 0.5) kept, 3 (0.8484 >= 0.5) kept.
    assert informative.draw([0, 1, 2], 8, (4,)) == [2, 6, 3]
    metrics = informative.end_step()
    assert metrics["prompts_skipped"] == 2 and metrics["rows_saved"] == 2 * 4
    # selection off: the recipe's own draw, untouched, whatever the history
    off = tracker(DataConfig(hints=HintConfig(after=1)))
    visits(off, 0, [1, 1], [1, 1], [1, 1])
    assert off.draw([0, 1, 2], 8, (4,)) == [0, 1, 2]


def test_end_step_metrics_and_adaptation() -> None:
    informative = tracker(DataConfig(selection=GRESO, hints=HintConfig(after=2)))
    # 4 visits: 1 easy, 2 hard, 1 informative -> zero-spread 3/4; easy 1/4 >= 0.25/3 (down),
    # hard 2/4 >= 0.5/3 (down)
    informative.observe([0, 1, 2, 3], np.array([[1, 1], [0, 0], [0, 0], [0, 1]], dtype=float))
    metrics = informative.end_step()
    assert metrics == {
        "zero_spread_fraction": 0.75,
        "prompts_skipped": 0,
        "rows_saved": 0,
        "explore_easy": 0.5,  # the rates in force during the step
        "explore_hard": 0.5,
        "prompts_hinted": 0,
    }
    assert (informative.p_easy, informative.p_hard) == (0.49, 0.49)
    # 2 informative visits: both ratios 0 < target: up again
    informative.observe([0, 1], np.array([[0, 1], [1, 0]], dtype=float))
    assert informative.end_step()["zero_spread_fraction"] == 0.0
    assert (informative.p_easy, informative.p_hard) == (0.5, 0.5)


def test_hint_tiers_escalate_then_stop() -> None:
    cfg = HintConfig(after=2, tiers=3)
    # zero-reward streak 0, 1: no hint; 2 -> tier 1; 3 -> 2; 4 -> 3; 9 -> 3 (the last tier)
    assert [hint_tier(z, cfg) for z in (0, 1, 2, 3, 4, 9)] == [0, 0, 1, 2, 3, 3]
    assert hint_tier(50, HintConfig()) == 0  # hints off


def test_hint_text_is_a_growing_prefix_never_the_whole_solution() -> None:
    lines = "a = 12 + 35\ntens 1 + 3 = 4\nunits 2 + 5 = 7\nso 47"  # 4 lines
    # floor(4 * t / 4) = t lines for t = 1, 2, 3
    assert hint_text(lines, 1, 3) == "a = 12 + 35"
    assert hint_text(lines, 2, 3) == "a = 12 + 35\ntens 1 + 3 = 4"
    assert hint_text(lines, 3, 3) == "a = 12 + 35\ntens 1 + 3 = 4\nunits 2 + 5 = 7"
    words = "4 7"  # 2 words: floor(2 * t / 4) -> 0, 1, 1, raised to 1, capped at n - 1 = 1
    assert [hint_text(words, t, 3) for t in (1, 2, 3)] == ["4", "4", "4"]
    assert hint_text("1234567", 1, 2) == "12"  # characters: floor(7 / 3) = 2
    assert hint_text("1234567", 2, 2) == "1234"  # floor(14 / 3) = 4
    assert hint_text("7", 3, 3) == ""  # one unit: nothing to show without the answer


def test_prompts_carry_the_tier_of_their_history() -> None:
    data = DataConfig(hints=HintConfig(after=1, tiers=2, format="({hint}){question}"))
    informative = tracker(data)
    examples = [
        Example("12+35=", "47", "4 7"),
        Example("1+2=", "3"),  # one character, no solution: nothing to hint
        Example("10+15=", "25"),  # no solution: the answer's prefix
        Example("20+20=", "40", "4 0"),
    ]
    rendered = [f"<{e.prompt}>" for e in examples]
    for i in (0, 1, 2):
        visits(informative, i, [0.0, 0.0])  # zero reward once: tier 1 next visit
    visits(informative, 3, [0.0, 1.0])  # one success: no hint
    prompts = informative.prompts([0, 1, 2, 3], examples, rendered)
    assert prompts == ["<(4)12+35=>", "<1+2=>", "<(2)10+15=>", "<20+20=>"]
    assert informative.end_step()["prompts_hinted"] == 2
    visits(informative, 0, [1.0, 1.0])  # solved with the hint: the streak ends, no more hints
    assert informative.prompts([0], examples, rendered) == ["<12+35=>"]


def test_state_round_trips_through_json() -> None:
    informative = tracker(DataConfig(selection=GRESO, hints=HintConfig(after=1)))
    visits(informative, 3, [1, 1], [1, 1])
    visits(informative, 5, [0, 0])
    informative.end_step()
    state = json.loads(json.dumps(informative.state_dict()))
    assert state == {
        "p_easy": 0.49,
        "p_hard": 0.49,
        "prompts": {"3": [2, 2, 0, 0], "5": [1, 0, 1, 1]},
    }
    again = Informative(DataConfig(selection=GRESO), 7, 4, informative.render, state)
    assert again.draw([3, 5], 10, (2,)) == informative.draw([3, 5], 10, (2,))


def test_per_candidate_prompt_values() -> None:
    # 2 candidates, 2 prompts, k = 2 samples: means over each candidate's samples of a prompt
    graded = [[1.0, 0.0, None, None], [1.0, 1.0, 0.0, None]]
    values = prompt_values(graded, 2, 2, np.array([False, False]))
    np.testing.assert_array_equal(values, [[0.5, NAN], [1.0, 0.0]])
    values = prompt_values(graded, 2, 2, np.array([True, False]))  # non-finite logits: NaN
    np.testing.assert_array_equal(values, [[NAN, NAN], [1.0, 0.0]])


def test_switches_are_off_by_default_and_checked() -> None:
    cfg = load_config(None)
    assert cfg.data.selection.name == "none" and cfg.data.hints.after is None
    assert Informative.build(cfg.data, 0, 4, lambda e: []) is None
    on = load_config(None, ["data.selection.name=greso", "data.hints.after=2"])
    assert Informative.build(on.data, 0, 4, lambda e: []) is not None


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.selection.name=gresso", "data.selection.name: expected one of 'none' | 'greso'"),
        (
            "data.selection.explore_init=0.99",
            "data.selection: need 0 < explore_min <= explore_init",
        ),
        ("data.selection.target_zero_spread=2", "data.selection.target_zero_spread: must be in"),
        ("data.hints.after=0", "data.hints.after: must be >= 1"),
        ("data.hints.tiers=0", "data.hints.tiers: must be >= 1"),
        ("data.hints.format=({hint})", "data.hints.format: '({hint})' must contain {question}"),
        ("data.hints.steps=2", "data.hints.steps: unknown key"),
    ],
)
def test_bad_settings_are_one_line_errors(override: str, message: str) -> None:
    from essa.config import ConfigError

    with pytest.raises(ConfigError, match=None) as err:
        load_config(None, [override])
    assert message in str(err.value) and "\n" not in str(err.value)
