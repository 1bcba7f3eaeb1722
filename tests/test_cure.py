"""CURE's first stage (essa/gradient/cure.py): the critical-token rule on hand-made logits, the
branched rollout on the tiny in-process Qwen2, and `essa train` on the demo with exact resume."""

from __future__ import annotations

import copy
import json
import math
import signal
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from essa.config import Config, CureConfig, GRPOConfig
from essa.gradient import cure
from essa.gradient.policy import Policy, Rollout, token_logprobs
from tests.conftest import grpo_cfg, sampling
from tests.test_grpo_e2e import SMALL, lora_changed, records
from tests.test_train_e2e import essa, sets

PAD, EOS, A, B = 0, 1, 2, 3
NEG = -1e4  # a finite "minus infinity": exp gives 0 and 0 * log 0 stays 0 in the entropy


PROMPTS = (10, 11, 12)  # one prompt token per row: the fake model tells the rows apart by it


class FixedLogits(torch.nn.Module):
    """A 'model' with given logits: row r of ``table`` (T + 1, V) for the prompt PROMPTS[r]."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = table  # (R, T + 1, V); the last position predicts past the completion
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # token_logprobs reads the device

    def forward(self, input_ids: torch.Tensor, **_: object) -> SimpleNamespace:
        rows = input_ids[:, 0] - PROMPTS[0]  # (b,)
        return SimpleNamespace(logits=self.table[rows])  # (b, T + 1, V)


def hand_rollout() -> Rollout:
    """Three rows, each a one-token prompt, completions of 4 tokens:
    0: a b a EOS  (candidates: positions 1, 2; position 0 and the EOS are excluded)
    1: b EOS      (no candidate: falls back to position 0)
    2: a a a a    (no EOS, truncated; candidates 1, 2, 3 tie)
    """
    completion = torch.tensor([[A, B, A, EOS], [B, EOS, PAD, PAD], [A, A, A, A]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])
    prompt = torch.tensor(PROMPTS)[:, None]  # (3, 1)
    return Rollout(
        input_ids=torch.cat([prompt, completion], 1),
        attention_mask=torch.cat([torch.ones_like(prompt), mask], 1),
        completion_ids=completion,
        mask=mask.float(),
        truncated=torch.tensor([False, False, True]),
        texts=["aba", "b", "aaaa"],
    )


def hand_logits() -> torch.Tensor:
    """(3, 5, 4) logits; at temperature 0.5 the entropies are (by hand):
    row 0: ln 4, H(3/4, 1/4) = 0.5623, ln 2, ln 3; row 1: ln 4 everywhere;
    row 2: ln 4, then ln 2 at positions 1, 2 and 3 (a tie)."""
    uniform = [0.0, 0.0, 0.0, 0.0]
    three_to_one = [NEG, NEG, 0.5 * math.log(3), 0.0]  # / 0.5 -> ln 3 vs 0: p = (3/4, 1/4)
    two = [NEG, NEG, 0.0, 0.0]
    three = [NEG, 0.0, 0.0, 0.0]
    return torch.tensor(
        [
            [uniform, three_to_one, two, three, uniform],
            [uniform, uniform, uniform, uniform, uniform],
            [uniform, two, two, two, uniform],
        ]
    )


def test_critical_tokens_from_hand_made_logits() -> None:
    out = hand_rollout()
    policy = Policy(model=FixedLogits(hand_logits()), params=[], reference=[])
    cfg = Config(grpo=GRPOConfig(temperature=0.5, grad_accumulation=2))  # two micro-batches
    g = cfg.grpo
    entropy = cure.rollout_entropy(policy, out, g.temperature, g.grad_accumulation)  # (3, 4)
    h = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    ln2, ln3, ln4 = math.log(2), math.log(3), math.log(4)
    expected = torch.tensor([[ln4, h, ln2, ln3], [ln4] * 4, [ln4, ln2, ln2, ln2]])
    assert torch.allclose(entropy, expected, atol=1e-5)

    candidates = cure.candidate_positions(out, [PAD, EOS])
    assert candidates.tolist() == [
        [False, True, True, False],  # position 0 and the EOS (the two highest) are excluded
        [False, False, False, False],  # only position 0 and the EOS: no candidate
        [False, True, True, True],
    ]
    # K = 1: the most uncertain candidate; ties go to the earlier position.
    positions, found = cure.choose_critical(entropy, candidates, 1, np.random.default_rng(0))
    assert positions.tolist() == [2, 0, 1] and found.tolist() == [True, False, True]
    # K = 2: uniform among the two most uncertain; one draw per row that has a candidate.
    positions, _ = cure.choose_critical(entropy, candidates, 2, np.random.default_rng(7))
    draws = np.random.default_rng(7)
    assert positions.tolist() == [[2, 1][draws.integers(2)], 0, [1, 2][draws.integers(2)]]
    # K above the candidates: every candidate is possible, no other position ever is.
    seen = {
        int(cure.choose_critical(entropy, candidates, 20, np.random.default_rng(s))[0][2])
        for s in range(40)
    }
    assert seen == {1, 2, 3}


def test_branch_contexts_are_the_prompt_and_the_prefix_before_the_critical_token() -> None:
    out = hand_rollout()
    ids, attention = cure.branch_contexts(out, torch.tensor([2, 0, 1]), PAD)
    assert ids.tolist() == [[10, A, B], [PAD, PAD, 11], [PAD, 12, A]]  # q + o[:j], left-padded
    assert attention.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]


def cure_cfg(**cure_fields: object) -> Config:
    return grpo_cfg(
        temperature=1.0,
        group_size=4,
        cure=CureConfig(use_branching=True, **cure_fields),  # type: ignore[arg-type]
    )


def test_branched_rollout_fills_each_group_with_originals_then_their_branches(tiny_lora) -> None:  # type: ignore[no-untyped-def]
    peft_model, tokenizer = tiny_lora
    policy = Policy.build(copy.deepcopy(peft_model), "lora", 1.0)
    cfg = cure_cfg(branches=1, top_k_tokens=3)  # G = 4: n1 = 2 originals, 1 branch each
    prompts = ["12+7="] * 4 + ["5+93="] * 4
    tally = cure.Tally()
    out = cure.branched_rollout(
        policy, tokenizer, prompts, sampling(cfg), 11, g=cfg.grpo, tally=tally
    )
    again = cure.branched_rollout(
        policy, tokenizer, prompts, sampling(cfg), 11, g=cfg.grpo, tally=cure.Tally()
    )
    assert torch.equal(out.input_ids, again.input_ids) and out.texts == again.texts  # seeded
    assert len(out.texts) == 8 and tally.branches == 4 and tally.critical + tally.fallbacks == 4
    t = out.completion_ids.shape[1]
    for group, prompt in enumerate(("12+7=", "5+93=")):
        for k in range(2):
            original, branch = 4 * group + k, 4 * group + 2 + k
            context = out.input_ids[branch, :-t][out.attention_mask[branch, :-t].bool()]
            prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            assert context[: len(prompt_ids)].tolist() == prompt_ids
            prefix = context[len(prompt_ids) :]  # o[:j]: the original's tokens before j
            j = len(prefix)
            assert out.completion_ids[original, :j].tolist() == prefix.tolist()
            assert j < out.mask[original].sum()  # cut before the original's end
            continuation = int(out.mask[branch].sum())
            assert j + continuation <= cfg.generation.max_new_tokens  # the trajectory's budget
            whole = out.texts[branch]  # scored as one trajectory: o[:j] + continuation
            assert whole.startswith(tokenizer.decode(prefix, skip_special_tokens=True))
    assert tally.critical >= 1  # this seed branches at least one original at a critical token
    assert tally.metrics()["cure_critical_entropy"] > 0  # type: ignore[operator]
    # The branches are trainable rows: their tokens get log-probs like any completion.
    logp, _ = token_logprobs(policy.model, out.input_ids, out.attention_mask, t, 1.0)
    assert torch.isfinite(logp[out.mask.bool()]).all()


def test_stage_switch() -> None:
    assert not cure.is_active(CureConfig(), 0)  # off by default
    on = CureConfig(use_branching=True, stage1_steps=3)
    assert [cure.is_active(on, s) for s in range(5)] == [True, True, True, False, False]
    assert cure.is_active(CureConfig(use_branching=True), 10_000)  # None: branch throughout


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("grpo.cure.branches=0", "grpo.cure.branches: must be >= 1"),
        ("grpo.cure.top_k_tokens=0", "grpo.cure.top_k_tokens: must be >= 1"),
        ("grpo.cure.stage1_steps=0", "grpo.cure.stage1_steps: must be >= 1"),
        ("grpo.cure.enabled=true", "grpo.cure.enabled: unknown key"),
    ],
)
def test_cure_config_errors(override: str, fragment: str) -> None:
    from essa.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="^--set grpo") as err:
        load_config(None, ["algorithm=grpo", override])
    assert fragment in str(err.value)


def test_group_size_must_hold_whole_branch_families() -> None:
    from essa.config import ConfigError, load_config

    load_config(None, ["grpo.group_size=8", "grpo.cure.branches=3"])  # off: no constraint
    with pytest.raises(ConfigError, match="multiple of 4, got 6"):
        load_config(None, ["grpo.group_size=6", "grpo.cure.use_branching=true"])


CURE = [*SMALL, "grpo.cure.use_branching=true", "grpo.cure.branches=1"]  # G = 4: 2 + 2


# Stage 1 (branching) for 3 steps of 4; a constant LR, so the resume below is step for step.
STAGED = [*CURE, "grpo.lr_schedule=constant", "grpo.cure.stage1_steps=3", "run.generations=4"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-step CURE run: checked for what it logged, and the run the killed one must resume
    onto (run once; the tests only read it)."""
    run_dir = tmp_path_factory.mktemp("cure") / "ref"
    res = essa("train", "--run-dir", str(run_dir), *sets(*STAGED))
    assert res.returncode == 0, res.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_cure_train_on_the_demo_logs_branches_then_switches_stage(uninterrupted: Path) -> None:
    run_dir = uninterrupted
    steps = [r for r in records(run_dir) if r["generation"] >= 0]
    assert [r["cure_branches"] for r in steps] == [8, 8, 8, 0]  # 4 prompts x 2 originals x 1
    for r in steps[:3]:
        assert r["cure_critical_entropy"] > 0 and r["cure_fallbacks"] >= 0
        assert 0.0 <= r["mean_reward"] <= 1.0 and math.isfinite(r["loss"])
    assert "cure_critical_entropy" not in steps[3]  # stage 2: plain sampling
    assert lora_changed(run_dir), "GRPO with CURE changed nothing"


@pytest.mark.slow
def test_cure_resume_after_a_kill_matches_uninterrupted(
    tmp_path: Path, uninterrupted: Path
) -> None:
    """SIGKILL while checkpointing step 3 of 4 (stage 1 ends after step 3): the resumed run
    repeats step 3's critical tokens and branches, switches stage on time, and is bit-exact."""
    small, ref = STAGED, uninterrupted
    run_dir = tmp_path / "run"
    res = essa("train", "--run-dir", str(run_dir), *sets(*small), env={"ESSA_FAULT": "kill@3"})
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    assert json.loads((run_dir / "checkpoint" / "state.json").read_text())["step"] == 2
    res = essa("train", "--resume", str(run_dir))
    assert res.returncode == 0, res.stderr[-3000:]
    a = load_file(str(ref / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    for key in a:
        assert torch.equal(a[key], b[key]), key
    timing = ("seconds", "tokens_per_second")
    ours = [{k: v for k, v in r.items() if k not in timing} for r in records(run_dir)]
    theirs = [{k: v for k, v in r.items() if k not in timing} for r in records(ref)]
    assert ours == theirs  # the same critical tokens, branches, rewards and losses
    assert [r.get("cure_branches") for r in ours] == [None, 8, 8, 8, 0]
