"""evaluation.metric: the held-out score follows it, never a shaping or label-free reward."""

from __future__ import annotations

import pytest

from essa.config import ConfigError, load_config
from essa.errors import UserError
from essa.evaluation import check_heldout_answers, heldout_metric, score_heldout
from essa.types import Example

EXAMPLES = [
    Example(prompt="2+2=", answer="4", solution=None),
    Example(prompt="3+3=", answer="6", solution=None),
]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], "math_accuracy"),
        (["reward.name=exact_match"], "exact_match"),  # a correctness reward: itself
        (["reward.name=format"], "math_accuracy"),  # shaping: says nothing about answers
        (["reward.name=majority_vote"], "math_accuracy"),  # label-free
        (["reward.name=format", "evaluation.metric=exact_match"], "exact_match"),
        (
            ["evaluation.metric=tests.test_evaluation:first_char"],
            "tests.test_evaluation:first_char",
        ),
    ],
)
def test_metric_follows_config(overrides: list[str], expected: str) -> None:
    name, reward = heldout_metric(load_config(None, overrides))
    assert name == expected and reward.name == expected


def first_char(
    completions: list[str], answers: list[str | None], prompts: list[str]
) -> list[float]:
    return [float(c[:1] == (a or "")[:1]) for c, a in zip(completions, answers, strict=True)]


def test_scores_differ_by_metric() -> None:
    # "4 apples" is right under math_accuracy (last number) and wrong under exact_match.
    completions, prompts = ["4 apples", "7"], ["2+2=", "3+3="]
    for metric, mean in (("math_accuracy", 0.5), ("exact_match", 0.0)):
        _, reward = heldout_metric(load_config(None, [f"evaluation.metric={metric}"]))
        assert score_heldout(reward, completions, EXAMPLES, prompts) == (mean, [mean * 2, 0.0])


def test_training_reward_params_go_with_it() -> None:
    cfg = load_config(None, ["reward.name=math_accuracy", "reward.params={use_last_number: false}"])
    _, reward = heldout_metric(cfg)
    assert score_heldout(reward, ["4 apples", "the answer is 6"], EXAMPLES, ["", ""])[1] == [
        0.0,
        1.0,
    ]


@pytest.mark.parametrize("metric", ["majority_vote", "format", "self_confidence", "random"])
def test_label_free_or_shaping_metric_is_refused(metric: str) -> None:
    with pytest.raises(
        ConfigError,
        match=rf"^--set evaluation.metric: evaluation.metric: '{metric}' does not compare",
    ):
        load_config(None, [f"evaluation.metric={metric}"])


def test_heldout_without_answers_is_refused() -> None:
    unlabeled = [Example(prompt="q", answer=None, solution=None)] * 3
    with pytest.raises(UserError, match="none of the 3 held-out examples has one"):
        check_heldout_answers("math_accuracy", unlabeled)
    check_heldout_answers("gym_score", unlabeled)  # grades by the task's own entries
    check_heldout_answers("math_accuracy", [*unlabeled, EXAMPLES[0]])
