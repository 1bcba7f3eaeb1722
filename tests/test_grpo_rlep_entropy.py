"""RLEP replay, entropy control and the temperature schedule (docs/grpo-rlep-entropy.md).

The formulas on hand-computed numbers, then the pieces on the tiny in-process Qwen2: replayed
rows score exactly as they were sampled, the ERA-style floor samples what the loss trains, and
the entropy bonus carries a gradient only when asked.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from essa.config import Config, EntropyConfig, GenerationConfig, GRPOConfig
from essa.gradient import losses as L
from essa.gradient import replay as R
from essa.gradient.policy import Policy, rollout, token_logprobs
from essa.gradient.sampling import Groups, temperature_at, training_batch
from tests.conftest import grpo_cfg, sampling

NAN = math.nan
H_075 = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))  # entropy of (0.75, 0.25): 0.5623


def experience(prompt_id: int, *ids: int, reward: float = 1.0) -> R.Experience:
    return R.Experience(prompt_id, ids, reward, "".join(map(str, ids)))


# ------------------------------------------------------------------------------- RLEP replay


def test_replayed_success_joins_the_group_statistics() -> None:
    # G = 4 all wrong, k = 2 slots, one stored success: the group is {0, 0, 0, 0, 1}.
    # mean 0.2; sample std sqrt((4 * 0.04 + 0.64) / 4) = sqrt(0.2) = 0.44721.
    mixed = R.mixed_group_rewards(torch.zeros(1, 4), [[experience(0, 5, 1)]], 2)
    assert mixed.shape == (1, 6) and math.isnan(mixed[0, 5])
    adv = L.advantages(L.get_variant("grpo"), mixed)[0].values[0]
    std = 0.447214 + L.TRL_EPS_STD
    assert adv[:4].tolist() == pytest.approx([-0.2 / std] * 4, abs=1e-5)  # -0.44711
    assert float(adv[4]) == pytest.approx(0.8 / std, abs=1e-5)  # +1.78845
    assert float(adv[0]) == pytest.approx(-0.44711, abs=1e-5)
    centered = L.advantages(L.get_variant("dr_grpo"), mixed)[0].values[0]
    assert centered[:5].tolist() == pytest.approx([-0.2, -0.2, -0.2, -0.2, 0.8])
    # Without a replay the all-wrong group carries no signal (and DAPO would filter it).
    assert L.groups_to_keep(mixed, "mixed").tolist() == [True]
    assert L.groups_to_keep(mixed[:, :4], "mixed").tolist() == [False]


def test_buffer_keeps_distinct_successes_fifo_and_draws_per_prompt() -> None:
    buffer = R.ReplayBuffer(3, [])
    added = buffer.add(
        [experience(0, 5, 1), experience(0, 5, 1), experience(1, 6, 1), experience(0, 7, 1)]
    )
    assert added == 3  # the duplicate is stored once
    assert buffer.add([experience(2, 8, 1), experience(1, 6, 1)]) == 1
    assert [(e.prompt_id, e.completion_ids) for e in buffer.entries] == [
        (1, (6, 1)),
        (0, (7, 1)),
        (2, (8, 1)),
    ]  # the oldest, (0, 5 1), was dropped at capacity 3
    drawn = buffer.draw([0, 1, 3], k=2, rng=np.random.default_rng(0))
    assert [[e.completion_ids for e in group] for group in drawn] == [[(7, 1)], [(6, 1)], []]
    again = R.ReplayBuffer.from_json(3, buffer.to_json())
    assert again == buffer  # what the checkpoint stores round-trips exactly


def test_successes_are_the_rows_at_or_above_min_reward() -> None:
    ids = torch.tensor([[5, 1, 0], [6, 6, 1], [7, 1, 0], [8, 8, 8]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]]).float()
    out = R.Rollout(ids, ids, ids, mask, torch.tensor([0, 0, 0, 1]).bool(), ["a", "b", "c", "d"])
    found = R.successes(out, torch.tensor([1.0, 0.0, NAN, 1.5]), [3, 3, 4, 4], 1.0)
    assert found == [R.Experience(3, (5, 1), 1.0, "a"), R.Experience(4, (8, 8, 8), 1.5, "d")]


def test_replayed_rows_score_exactly_as_sampled(tiny_lora) -> None:  # type: ignore[no-untyped-def]
    peft_model, tokenizer = tiny_lora
    policy = Policy.build(copy.deepcopy(peft_model), "lora", 1.0)
    cfg = grpo_cfg()
    prompts = ["12+7=", "5+93=", "1+1=", "12+7="]
    out = rollout(policy, tokenizer, prompts, sampling(cfg), seed=3)
    stored = R.successes(out, torch.ones(4), [0, 1, 2, 0], -math.inf)
    again = R.replay_rollout(tokenizer, prompts, stored)
    assert torch.equal(again.truncated, out.truncated)
    w = again.completion_ids.shape[1]
    assert torch.equal(again.mask, out.mask[:, :w]) and not out.mask[:, w:].any()
    t_out, t_again = out.completion_ids.shape[1], w
    a, _ = token_logprobs(policy.model, out.input_ids, out.attention_mask, t_out, 0.7)
    b, _ = token_logprobs(policy.model, again.input_ids, again.attention_mask, t_again, 0.7)
    m = again.mask.bool()
    assert torch.allclose(a[:, :w][m], b[m], atol=1e-5)


def test_training_batch_puts_replays_after_the_fresh_rows(tiny_lora) -> None:  # type: ignore[no-untyped-def]
    peft_model, tokenizer = tiny_lora
    policy = Policy.build(copy.deepcopy(peft_model), "lora", 1.0)
    cfg = Config(generation=GenerationConfig(max_new_tokens=4))
    out = rollout(policy, tokenizer, ["3+4="] * 2 + ["10+20="] * 2, sampling(cfg), seed=1)
    data = type("D", (), {"train_prompts": ["3+4=", "10+20="]})()
    groups = Groups([out], [torch.zeros(2, 4)], [0, 1], [[experience(0, 7, 1)], []])
    batch, group_index, slot = training_batch(groups, data, tokenizer, 2)  # type: ignore[arg-type]
    assert group_index.tolist() == [0, 0, 1, 1, 0]
    assert slot.tolist() == [0, 1, 0, 1, 2]  # the replay is slot G + 0 of group 0
    assert batch.texts[-1] == "71" and batch.input_ids.shape[0] == 5


# ---------------------------------------------------------------------------- entropy control


def test_token_entropy_and_bonus_by_hand() -> None:
    uniform = torch.log_softmax(torch.zeros(1, 1, 4), -1)
    assert float(L.token_entropy(uniform)) == pytest.approx(math.log(4))
    entropy = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # -coef * token mean over the 3 completion tokens: -0.1 * (1 + 2 + 4) / 3 = -0.23333
    assert float(L.entropy_bonus(entropy, mask, 3, 0.1)) == pytest.approx(-0.1 * 7 / 3)
    halves = L.entropy_bonus(entropy[:1], mask[:1], 3, 0.1) + L.entropy_bonus(
        entropy[1:], mask[1:], 3, 0.1
    )
    assert float(halves) == pytest.approx(-0.1 * 7 / 3)  # micro-batches add up


def test_era_floor_by_hand() -> None:
    # softmax([2 ln 3, 0]) = (0.9, 0.1), entropy 0.325 < H(0.75, 0.25) = 0.5623: the scale s
    # with sigmoid(s * 2 ln 3) = 0.75 is s = 1/2, so the logits become [ln 3, 0].
    z = torch.tensor([[2 * math.log(3), 0.0], [0.0, 0.0]], requires_grad=True)
    out = L.era_activation(z, H_075)
    assert out[0].tolist() == pytest.approx([math.log(3), 0.0], abs=1e-6)
    assert out[1].tolist() == [0.0, 0.0]  # entropy ln 2 = 0.693 is above the floor: unchanged
    assert torch.softmax(out[0], -1).tolist() == pytest.approx([0.75, 0.25], abs=1e-6)
    out.sum().backward()  # the scale is a constant in the backward pass
    assert z.grad is not None
    assert z.grad.flatten().tolist() == pytest.approx([0.5, 0.5, 1.0, 1.0], abs=1e-6)
    # A floor at or above log V gives the uniform distribution; floor 0 is the identity.
    assert L.era_activation(torch.tensor([5.0, 0.0]), 1.0).tolist() == [0.0, 0.0]
    assert L.era_activation(z, 0.0) is z
    # The argmax never moves: greedy decoding is unaffected.
    logits = torch.randn(16, 7, generator=torch.Generator().manual_seed(0)) * 5
    assert torch.equal(L.era_activation(logits, 1.5).argmax(-1), logits.argmax(-1))


def test_era_floor_samples_what_the_loss_scores(tiny_lora) -> None:  # type: ignore[no-untyped-def]
    peft_model, tokenizer = tiny_lora
    policy = Policy.build(copy.deepcopy(peft_model), "lora", 1.0)
    cfg = grpo_cfg(temperature=0.5, entropy=EntropyConfig(floor=2.5))
    prompts = ["12+7=", "5+93=", "1+1="]
    out = rollout(policy, tokenizer, prompts, sampling(cfg), seed=3)
    t = out.completion_ids.shape[1]
    logp, entropy = token_logprobs(policy.model, out.input_ids, out.attention_mask, t, 0.5, 2.5)
    # Reference: the same seed through HF with the processor, keeping the processed scores.
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    from essa.gradient.policy import sampling_processors

    processors, temperature = sampling_processors(2.5, 0.5)
    assert temperature == 1.0
    torch.manual_seed(3)
    ref = policy.model.generate(
        **batch,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=6,
        logits_processor=processors,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        output_scores=True,
        return_dict_in_generate=True,
    )
    assert torch.equal(ref.sequences[:, batch["input_ids"].shape[1] :], out.completion_ids)
    scores = torch.stack(ref.scores, dim=1)  # (B, T, V) after the activation
    expected = torch.log_softmax(scores, -1).gather(-1, out.completion_ids[..., None])[..., 0]
    mask = out.mask.bool()
    assert torch.allclose(logp[mask], expected[mask], atol=1e-4)
    assert (entropy[mask] >= 2.5 - 1e-4).all()  # the floor holds at every sampled position


def test_entropy_carries_a_gradient_only_for_the_bonus(tiny_lora) -> None:  # type: ignore[no-untyped-def]
    peft_model, tokenizer = tiny_lora
    policy = Policy.build(copy.deepcopy(peft_model), "lora", 1.0)
    ids = tokenizer(["1+2=3"], return_tensors="pt", add_special_tokens=False)
    plain = token_logprobs(policy.model, ids["input_ids"], ids["attention_mask"], 2, 1.0)
    bonus = token_logprobs(policy.model, ids["input_ids"], ids["attention_mask"], 2, 1.0, 0.0, True)
    assert plain[1].grad_fn is None and bonus[1].grad_fn is not None
    assert torch.equal(plain[1], bonus[1].detach())
    bonus[1].sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.params)


# ----------------------------------------------------------------------- temperature schedule


def test_temperature_schedule_is_staged_by_step() -> None:
    cfg = Config(grpo=GRPOConfig(temperature=0.6, temperature_schedule=((2, 0.8), (5, 1.0))))
    assert [temperature_at(s, cfg.grpo) for s in range(7)] == [0.6, 0.6, 0.8, 0.8, 0.8, 1.0, 1.0]
    cfg = Config(grpo=GRPOConfig(temperature=0.6, temperature_schedule=((0, 0.9),)))
    assert temperature_at(0, cfg.grpo) == 0.9  # a stage at step 0 replaces the base


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("grpo.temperature_schedule=[[3,0.6],[3,1.0]]", "stage 1: steps must increase"),
        ("grpo.temperature_schedule=[[1.5,0.6]]", "stage 0: expected [step, temperature]"),
        ("grpo.temperature_schedule=[[1,0]]", "stage 0: expected [step, temperature]"),
        ("grpo.replay.ratio=0.25", "grpo.replay.ratio: needs a buffer, grpo.replay.capacity > 0"),
        ("grpo.replay.capacity=-1", "grpo.replay.capacity: must be >= 0"),
        ("grpo.entropy.coef=-0.1", "grpo.entropy.coef: must be >= 0"),
        ("grpo.train_examples=0", "grpo.train_examples: must be >= 1"),
    ],
)
def test_config_errors(override: str, fragment: str) -> None:
    from essa.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(None, ["algorithm=grpo", override])
    assert fragment in str(err.value) and "grpo." in str(err.value).split(":")[0]


def test_seed_file_keeps_what_the_reward_verifies(tiny_lora, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from essa.errors import UserError
    from essa.rewards import get_reward

    _, tokenizer = tiny_lora
    path = tmp_path / "seed.jsonl"
    path.write_text(
        '{"prompt": "3+4=", "completion": "7"}\n'
        '{"prompt": "3+4=", "completion": "8"}\n'
        '{"prompt": "9+9=", "completion": "18"}\n'
        "\n"
        '{"prompt": "1+1=", "completion": "2"}\n'
    )
    found, report = R.seed_experiences(
        str(path), tokenizer, ["1+1=", "3+4="], ["2", "7"], get_reward("math_accuracy"), 1.0
    )
    assert [(e.prompt_id, e.text) for e in found] == [(1, "7"), (0, "2")]
    assert found[0].completion_ids[-1] == tokenizer.eos_token_id
    assert report == R.SeedReport(lines=4, stored=2, unmatched=1, failed=1)
    path.write_text('{"prompt": "3+4="}\n')
    with pytest.raises(UserError, match=r"seed.jsonl:1: grpo.replay.seed_file"):
        R.seed_experiences(str(path), tokenizer, ["3+4="], ["7"], get_reward("exact_match"), 1.0)
