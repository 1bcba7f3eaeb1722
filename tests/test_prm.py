"""``prm`` process rewards: the step rules on hand-made scores, the HF scorer on tiny in-process
PRMs (a token-classification Qwen2 trained for a few steps on arithmetic step correctness, and a
sequence-classification Qwen2), and `essa train` with ``prm`` on builtin:demo for both recipes.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from essa.config import RewardConfig
from essa.errors import UserError
from essa.rewards import get_reward
from essa.rewards.loading import load_reward
from essa.rewards.prm import (
    aggregate_steps,
    clip_rewards,
    delta_rewards,
    process_reward,
    step_ends,
)
from tests.conftest import GRPO_SETS, build_char_tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


class FixedScorer:
    """Step scores given by hand, per completion text; records what it was asked."""

    def __init__(self, table: dict[str, list[float]]) -> None:
        self.table = table
        self.calls: list[list[list[int]]] = []

    def step_scores(
        self, prompts: list[str], completions: list[str], step_ends: list[list[int]]
    ) -> list[list[float]]:
        self.calls.append(step_ends)
        for text, ends in zip(completions, step_ends, strict=True):
            assert len(self.table[text]) == len(ends), (text, ends)
        return [self.table[text] for text in completions]


# ---------------------------------------------------------------------------------------------
# The rules, by hand


@pytest.mark.parametrize(
    ("text", "delimiter", "expected"),
    [
        ("a=1\n\nb=2", "\n\n", [3, 8]),
        ("a=1\n\n\n\nb=2\n\n", "\n\n", [3, 10]),  # blank step skipped, trailing one too
        ("a=1  \nb=2", "\n", [3, 9]),  # trailing spaces are not part of the step
        ("", "\n", []),
        ("1+2=3 3+4=7", " ", [5, 11]),
    ],
)
def test_step_ends(text: str, delimiter: str, expected: list[int]) -> None:
    assert step_ends(text, delimiter) == expected


def test_clip_delta_and_each_aggregate_by_hand() -> None:
    r = [0.75, 0.25, 0.5, 1.0]
    # Clip, eta = 0.5: min(r - 0.5, 0) = [0, -0.25, 0, 0]
    assert clip_rewards(r, 0.5) == [0.0, -0.25, 0.0, 0.0]
    # Delta: r_k - r_{k+1}, last 0: [0.5, -0.25, -0.5, 0]; sum telescopes to r_1 - r_K
    assert delta_rewards(r) == [0.5, -0.25, -0.5, 0.0]
    assert math.fsum(delta_rewards(r)) == r[0] - r[-1]
    assert aggregate_steps(r, "sum") == 2.5
    assert aggregate_steps(r, "last") == 1.0
    assert aggregate_steps(r, "min") == 0.25  # PURE min-form
    assert aggregate_steps(r, "mean") == 0.625
    assert aggregate_steps([], "min") == 0.0
    table = {
        ("sum", "clip"): -0.25,
        ("min", "clip"): -0.25,
        ("last", "clip"): 0.0,
        ("sum", "delta"): -0.25,
        ("min", "delta"): -0.5,
        ("last", "delta"): 0.0,
        ("mean", "delta"): -0.0625,
    }
    for (rule, refine), expected in table.items():
        got = process_reward(r, aggregate=rule, refine=refine, clip_threshold=0.5)
        assert got == expected, (rule, refine)


def test_repeating_good_steps_cannot_grow_a_clipped_or_delta_sum() -> None:
    """The hack Clip and Delta exist for: padding a solution with many high-scoring steps."""
    short, padded = [0.9, 0.4], [0.9] * 20 + [0.4]
    plain = [process_reward(s, aggregate="sum", refine="none", clip_threshold=0.5)
             for s in (short, padded)]  # fmt: skip
    assert plain[1] > plain[0] + 10  # summing raw scores rewards padding
    for refine in ("clip", "delta"):
        a, b = (process_reward(s, aggregate="sum", refine=refine, clip_threshold=0.5)
                for s in (short, padded))  # fmt: skip
        assert b <= a + 1e-12, refine


def test_prm_reward_combines_outcome_and_process_by_weight() -> None:
    texts = ["1+1=2\n\n2+2=4\n\nso 4", "1+1=3\n\nso 5", ""]
    scorer = FixedScorer({texts[0]: [0.75, 0.25, 0.5], texts[1]: [0.5, 0.25], texts[2]: []})
    reward = get_reward("prm", scorer=scorer, aggregate="min", outcome_weight=1.0, prm_weight=0.5)
    # outcome (math_accuracy vs "4"): 1, 0, 0; min over steps: 0.25, 0.25, none -> 0
    assert reward(texts, ["4", "4", "4"], ["q"] * 3) == [1.125, 0.125, 0.0]
    assert scorer.calls[-1] == [[5, 12, 18], [5, 11], []]
    only_process = get_reward("prm", scorer=scorer, aggregate="sum", outcome=None, refine="delta")
    assert only_process(texts[:2], [None, None], ["q", "q"]) == [0.25, 0.25]
    # an ungradable outcome (no reference) makes the item ungradable
    assert reward(texts[:1], [None], ["q"]) == [None]


def test_prm_parameter_errors_are_one_line() -> None:
    scorer = FixedScorer({})
    for params, words in [
        ({"scorer": scorer, "aggregate": "max"}, "unknown aggregate"),
        ({"scorer": scorer, "refine": "cap"}, "unknown refine"),
        ({}, "reward.params.prm"),
        ({"scorer": scorer, "outcome": "majority_vote"}, "plain text reward"),
        ({"scorer": scorer, "steps": 3}, "unknown parameter"),
    ]:
        with pytest.raises(ValueError, match=words):
            get_reward("prm", **params)
    with pytest.raises(UserError, match="reward.name: .*reward.params.prm"):
        load_reward(RewardConfig(name="prm"), recipe="ESSA")


# ---------------------------------------------------------------------------------------------
# Tiny process-reward models built in-process


def step_chain(rng: random.Random, steps: int) -> tuple[str, list[int]]:
    """'a+b=c d+e=f ...' with each sum right or one too high (the demo's error); labels 1/0."""
    parts, labels = [], []
    for _ in range(steps):
        a, b = rng.randrange(10), rng.randrange(10)
        right = rng.random() < 0.5
        parts.append(f"{a}+{b}={a + b + (0 if right else 1)}")
        labels.append(int(right))
    return " ".join(parts), labels


def tiny_qwen2(num_labels: int) -> object:
    torch.manual_seed(0)
    return transformers.Qwen2Config(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        num_labels=num_labels,
        pad_token_id=0,
        eos_token_id=1,
    )


def train_token_prm(out: Path, steps: int = 30) -> list[float]:
    """A two-label Qwen2ForTokenClassification trained on step correctness at step ends.

    The tokenizer is the one ``AutoTokenizer`` loads back from ``out`` (with a Qwen2 config
    beside it, transformers swaps in Qwen2's pre-tokenizer, which drops the spaces), so the
    labels sit where the scorer will read: at the token that ends each step's characters.
    """
    model = transformers.Qwen2ForTokenClassification(tiny_qwen2(2))
    model.save_pretrained(out)
    build_char_tokenizer().save_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(0)
    losses = []
    for _ in range(steps):
        chains = [step_chain(rng, 3) for _ in range(16)]
        batch = tokenizer(
            [text for text, _ in chains], padding=True, return_tensors="pt",
            return_offsets_mapping=True,
        )  # fmt: skip
        offsets = batch.pop("offset_mapping")  # (B, T, 2)
        labels = torch.full(batch["input_ids"].shape, -100)  # (B, T): only step ends count
        for row, (text, steps_ok) in enumerate(chains):
            for end, ok in zip(step_ends(text, " "), steps_ok, strict=True):
                at = (offsets[row, :, 1] == end) & (batch["attention_mask"][row] == 1)
                labels[row, at] = ok
        loss = model(**batch, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    model.save_pretrained(out)
    return losses


@pytest.fixture(scope="module")
def token_prm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-token-prm")
    losses = train_token_prm(out)
    assert sum(losses[-5:]) < sum(losses[:5]), losses  # it learned something
    return out


@pytest.fixture(scope="module")
def sequence_prm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-seq-prm")
    transformers.Qwen2ForSequenceClassification(tiny_qwen2(1)).save_pretrained(out)
    build_char_tokenizer().save_pretrained(out)
    return out


def test_token_head_reads_each_step_at_its_last_token(token_prm: Path) -> None:
    prompts, texts = ["3+4=", "9+9="], ["7 7+2=9 9+1=11", "19"]
    reward = get_reward("prm", prm=str(token_prm), step_delimiter=" ", outcome=None,
                        aggregate="sum")  # fmt: skip
    tokenizer = transformers.AutoTokenizer.from_pretrained(token_prm)
    model = transformers.AutoModelForTokenClassification.from_pretrained(token_prm).eval()
    expected = []
    for prompt, text in zip(prompts, texts, strict=True):
        ids = tokenizer(prompt + text, return_tensors="pt")
        with torch.no_grad():
            probs = model(**ids).logits.softmax(-1)[0, :, 1]  # (T,) unpadded
        # each step's last token, counted by tokenising the prefix up to the step's end
        ends = [len(tokenizer(prompt + text[:end])["input_ids"]) - 1
                for end in step_ends(text, " ")]  # fmt: skip
        expected.append(math.fsum(float(probs[t]) for t in ends))
    got = reward(texts, [None, None], prompts)
    assert got == pytest.approx(expected, abs=1e-5)
    assert all(0.0 < g < len(step_ends(t, " ")) for g, t in zip(got, texts, strict=True))


def test_sequence_head_scores_each_prefix(sequence_prm: Path) -> None:
    prompt, text = "3+4=", "7 7+2=9 9+1=11"
    reward = get_reward("prm", prm=str(sequence_prm), step_delimiter=" ", outcome=None,
                        aggregate="last", output="logit")  # fmt: skip
    tokenizer = transformers.AutoTokenizer.from_pretrained(sequence_prm)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(sequence_prm).eval()
    with torch.no_grad():
        whole = model(**tokenizer(prompt + text, return_tensors="pt")).logits[0, 0]
    assert reward([text], [None], [prompt]) == [pytest.approx(float(whole), abs=1e-5)]
    first = get_reward("prm", prm=str(sequence_prm), step_delimiter=" ", outcome=None,
                       aggregate="min", output="logit")  # fmt: skip
    with torch.no_grad():
        prefixes = [
            float(model(**tokenizer(prompt + text[:end], return_tensors="pt")).logits[0, 0])
            for end in step_ends(text, " ")
        ]
    assert first([text], [None], [prompt]) == [pytest.approx(min(prefixes), abs=1e-5)]


# ---------------------------------------------------------------------------------------------
# essa train with prm on the demo, both recipes


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["essa", "grpo"])
def test_train_with_prm_reward_on_demo(tmp_path: Path, token_prm: Path, recipe: str) -> None:
    from tests.test_train_e2e import SMALL, essa, sets

    own = GRPO_SETS if recipe == "grpo" else []
    params = [f"reward.params.prm={token_prm}", "reward.params.prm_weight=0.5",
              "reward.params.aggregate=min", "reward.params.step_delimiter=' '"]  # fmt: skip
    run_dir = tmp_path / recipe
    res = essa(
        "train", "--run-dir", str(run_dir),
        *sets(*SMALL, *own, "reward.name=prm", *params, "run.generations=2",
              "evaluation.use_scale_baseline=false"),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    key = "mean_reward" if recipe == "grpo" else "mean_fitness"
    values = [r[key] for r in lines if r["generation"] >= 0]
    assert len(values) == 2 and all(math.isfinite(v) for v in values)
    # min over the (one-step) demo answers of a probability, at weight 0.5, plus 0/1 accuracy:
    # never a whole number unless the PRM's score were exactly 0 or 1
    assert all(0.0 < v < 1.5 and v != round(v) for v in values), values
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["heldout_metric"] == "math_accuracy"  # the PRM never grades held-out items


# ---------------------------------------------------------------------------------------------
# grpo.prm_credit: step (essa/gradient/prm_credit.py), by hand


def test_step_returns_by_hand_and_their_first_is_the_reward_value() -> None:
    from essa.rewards.prm import step_returns

    r = [0.75, 0.25, 0.5, 1.0]
    expected = {
        ("min", "none"): [0.25, 0.25, 0.5, 1.0],  # PURE: min over the steps from k on
        ("sum", "none"): [2.5, 1.75, 1.5, 1.0],
        ("mean", "none"): [0.625, 0.5833333333333334, 0.75, 1.0],
        ("last", "none"): [1.0, 1.0, 1.0, 1.0],
        ("sum", "clip"): [-0.25, -0.25, 0.0, 0.0],  # clipped [0, -0.25, 0, 0]
        ("min", "delta"): [-0.5, -0.5, -0.5, 0.0],  # delta [0.5, -0.25, -0.5, 0]
    }
    for (rule, refine), values in expected.items():
        got = step_returns(r, aggregate=rule, refine=refine, clip_threshold=0.5)
        assert got == pytest.approx(values), (rule, refine)
        assert got[0] == process_reward(r, aggregate=rule, refine=refine, clip_threshold=0.5)
    assert step_returns([], aggregate="min", refine="none", clip_threshold=0.5) == []


def test_token_steps_and_char_ends_on_a_real_tokenizer() -> None:
    from essa.gradient.prm_credit import char_ends, token_steps

    tokenizer = build_char_tokenizer()
    text = "1+1=2 2+2=5"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ends = char_ends(tokenizer, ids)
    assert ends == [*range(1, 12), 11]  # one character a token; EOS adds no text
    # steps end at 5 ("1+1=2") and 11; the space starts after step 1 ends, so it is step 2's;
    # EOS (after the last step) belongs to the last step
    assert token_steps(ends, step_ends(text, " ")) == [0] * 5 + [1] * 6 + [1]
    assert token_steps([1, 2], [5]) == [0, 0]


def test_step_credit_on_a_rollout_by_hand() -> None:
    from essa.gradient.policy import Rollout
    from essa.gradient.prm_credit import step_credit

    tokenizer = build_char_tokenizer()
    texts = ["1+1=2 2+2=5", "3+3=6"]
    scorer = FixedScorer({texts[0]: [0.75, 0.25], texts[1]: [0.5]})
    reward = load_reward(RewardConfig(name="prm", params={"scorer": scorer, "prm_weight": 0.5,
                                                          "step_delimiter": " ",
                                                          "aggregate": "min"}),
                         recipe="GRPO")  # fmt: skip
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] + [1] for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])  # (2, 12)
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows])
    out = Rollout(ids, mask.long(), ids, mask, torch.zeros(2, dtype=torch.bool), texts)
    prompts = ["q", "q"]
    rewards = reward(texts, ["4", "6"], prompts)  # outcome + 0.5 * min: 0 + 0.125, 1 + 0.25
    assert rewards == [0.125, 1.25]
    calls = len(scorer.calls)
    credit = step_credit(tokenizer, out, prompts, reward)
    assert len(scorer.calls) == calls  # the reward's own PRM pass is reused
    # row 0: G = [min(.75,.25), .25] = [.25, .25]: no credit anywhere; row 1: one step
    assert torch.equal(credit, torch.zeros(2, width))
    scorer.table[texts[0]] = [0.25, 0.75]  # a bad first step, a good second one
    reward(texts, ["4", "6"], prompts)
    credit = step_credit(tokenizer, out, prompts, reward)
    # G = [0.25, 0.75]: the second step's 7 tokens (space, "2+2=5", EOS) get 0.5 * 0.5
    assert credit[0].tolist() == [0.0] * 5 + [0.25] * 7
    assert torch.equal(credit[1], torch.zeros(width))


@pytest.mark.parametrize(
    ("sets", "words"),
    [
        (["grpo.prm_credit=step"], "algorithm: grpo"),
        (["algorithm=grpo", "grpo.prm_credit=step"], "reward.name: prm"),
        (
            ["algorithm=grpo", "grpo.prm_credit=step", "reward.name=prm", "grpo.replay.capacity=8"],
            "grpo.replay.capacity",
        ),  # fmt: skip
        (
            [
                "algorithm=grpo",
                "grpo.prm_credit=step",
                "reward.name=prm",
                "grpo.prime.enabled=true",
            ],
            "grpo.prime.enabled",
        ),  # fmt: skip
    ],
)
def test_prm_credit_refusals_are_one_line(sets: list[str], words: str) -> None:
    from essa.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=words):
        load_config(None, sets)


@pytest.mark.slow
def test_grpo_trains_with_step_credit_on_demo(tmp_path: Path, token_prm: Path) -> None:
    """The demo's answers are one step each under ' '; split at '2', sums 120-129 have two
    steps ("125" -> "1", "5"), and with aggregate: sum G_2 - G_1 = -r_1 != 0, so some tokens of
    the step's 16 completions get non-zero credit."""
    from tests.test_train_e2e import SMALL, essa, sets

    params = [f"reward.params.prm={token_prm}", "reward.params.prm_weight=0.5",
              "reward.params.aggregate=sum", "reward.params.step_delimiter='2'"]  # fmt: skip
    run_dir = tmp_path / "run"
    res = essa(
        "train", "--run-dir", str(run_dir),
        # data.val_size=0: GRPO reads no validation split, and the draw this test is built on
        # (sums 120-129 among the first steps' prompts) is that of the whole training pool.
        *sets(*SMALL, *GRPO_SETS, "grpo.prm_credit=step", "reward.name=prm", *params, "run.generations=3",
              "data.val_size=0",
              "evaluation.use_scale_baseline=false"),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    credit = [r["prm_step_credit"] for r in lines if r["generation"] >= 0]
    assert len(credit) == 3 and all(math.isfinite(c) and c >= 0 for c in credit)
    assert max(credit) > 0, "no two-step completion: the test would prove nothing"
