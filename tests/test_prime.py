"""PRIME implicit process rewards (grpo.prime): the token reward, the PRM loss and the token
advantages on hand-made log-probs, computed by hand; `essa train` on builtin:demo with PRIME on;
exact resume after a kill -9 inside a checkpoint write (the PRM's LoRA and AdamW moments are in
the checkpoint). The kill is placed by ESSA_FAULT (the run kills itself), never by a sleep.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from essa.config import ConfigError, load_config
from essa.gradient import losses
from essa.gradient.prime import (
    implicit_token_rewards,
    leave_one_out,
    masked_whiten,
    prime_advantages,
    prm_loss,
)
from tests.test_grpo_e2e import SMALL, records
from tests.test_train_e2e import essa, sets

PRIME = ["grpo.prime.enabled=true", "grpo.lr_schedule=constant"]


def test_token_reward_and_prm_loss_by_hand() -> None:
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.0, -1.0]])  # (B, T) under phi
    ref = torch.tensor([[-1.5, -2.0, -2.0], [-1.0, -0.5, -4.0]])  # (B, T) under the reference
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    r = implicit_token_rewards(logp, ref, mask, beta=0.5)
    # 0.5 * (logp - ref) on masked tokens: [0.25, 0, 0] and [0.25, -0.25, 1.5]
    assert torch.allclose(r, torch.tensor([[0.25, 0.0, 0.0], [0.25, -0.25, 1.5]]))
    # s = sum_t r_t = 0.25 and 1.5; labels 1 and 0:
    # L = (-log sigmoid(0.25) - log(1 - sigmoid(1.5))) / 2 = (log(1 + e^-0.25) + log(1 + e^1.5)) / 2
    labels = torch.tensor([1.0, 0.0])
    expected = (math.log1p(math.exp(-0.25)) + math.log1p(math.exp(1.5))) / 2
    assert prm_loss(logp, ref, mask, labels, 0.5).item() == pytest.approx(expected, rel=1e-6)
    # an ungradable label (NaN) is left out; a reward above 1 is the label 1
    nan_labels = torch.tensor([2.0, math.nan])
    one = math.log1p(math.exp(-0.25))
    assert prm_loss(logp, ref, mask, nan_labels, 0.5).item() == pytest.approx(one, rel=1e-6)
    # micro-batches with the step's labelled count sum to the full-step loss
    parts = sum(prm_loss(logp[i : i + 1], ref[i : i + 1], mask[i : i + 1], labels[i : i + 1], 0.5, 2)
                for i in range(2))  # fmt: skip
    assert float(parts) == pytest.approx(expected, rel=1e-6)


def test_prm_loss_gradient_pushes_the_sequence_reward_toward_the_label() -> None:
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0]])
    prm_loss(logp, ref, torch.ones(1, 2), torch.tensor([1.0]), 0.05).backward()
    # d/dlogp_t of -log sigmoid(beta * sum) at sum 0 = -beta * (1 - 0.5) = -0.025 per token
    assert torch.allclose(logp.grad, torch.full((1, 2), -0.025))


def test_leave_one_out_by_hand() -> None:
    got = leave_one_out(torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, math.nan, 0.0, 0.0]]))
    third = 1 / 3
    expected = torch.tensor(
        [[1 - third, -2 * third, -2 * third, 1 - third], [1.0, 0.0, -0.5, -0.5]]
    )
    assert torch.allclose(got, expected)
    assert torch.equal(leave_one_out(torch.tensor([[1.0, math.nan]])), torch.zeros(1, 2))


def test_prime_advantages_by_hand() -> None:
    # one prompt, G = 2; row 1 has one token (the second is padding)
    rewards = torch.tensor([[0.2, 0.4], [-0.2, 0.0]])  # (B, T) token process rewards
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    outcome = torch.tensor([[1.0, 0.0]])  # (N, G)
    # per-token means 0.3 and -0.2, so baselines (the other's mean) -0.2 and 0.3;
    # r - b: [0.4, 0.6] and [-0.5]; returns (sum over s >= t): [1.0, 0.6] and [-0.5];
    # RLOO outcome: 1 - 0 = 1 and 0 - 1 = -1
    plain = prime_advantages(
        outcome, rewards, mask, process_weight=1.0, outcome_weight=1.0, use_whitening=False
    )
    assert torch.allclose(plain, torch.tensor([[2.0, 1.6], [-1.5, 0.0]]))
    weighted = prime_advantages(
        outcome, rewards, mask, process_weight=0.5, outcome_weight=2.0, use_whitening=False
    )
    assert torch.allclose(weighted, torch.tensor([[2.5, 2.3], [-2.25, 0.0]]))
    # whitening over the three real tokens: mean 0.7, Bessel var (1.69 + 0.81 + 4.84) / 2
    white = prime_advantages(
        outcome, rewards, mask, process_weight=1.0, outcome_weight=1.0, use_whitening=True
    )
    sd = math.sqrt(3.67 + 1e-8)
    assert torch.allclose(white, torch.tensor([[1.3 / sd, 0.9 / sd], [-2.2 / sd, 0.0]]))
    assert torch.allclose(masked_whiten(plain, mask) * mask, white)


def test_token_advantages_enter_the_clipped_surrogate_per_token() -> None:
    """With rho = 1 the token loss is -A_t: (B, T) advantages are used token by token."""
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]])
    adv = torch.tensor([[2.0, -1.0], [0.5, 0.0]])
    token = losses.clipped_token_loss(logp, logp.detach(), adv, low=0.8, high=1.2)
    assert torch.allclose(token.loss, -adv)
    per_sequence = losses.clipped_token_loss(logp, logp.detach(), adv[:, 0], low=0.8, high=1.2)
    assert torch.allclose(per_sequence.loss, -adv[:, :1].expand(2, 2))


def test_prime_config_switches() -> None:
    cfg = load_config(None, ["algorithm=grpo", "grpo.prime.enabled=true"])
    assert cfg.grpo.prime.beta == 0.05 and cfg.grpo.prime.prm_lr is None
    assert load_config(None).grpo.prime.enabled is False
    for override, words in [
        ("grpo.trainable=singular_values", "needs grpo.trainable: lora"),
        ("grpo.prime.beta=0", "must be > 0"),
        ("grpo.prime.outcome_weight=-1", "must be >= 0"),
        ("grpo.prime.gamma=1", "unknown key"),
    ]:
        with pytest.raises(ConfigError, match=words):
            load_config(None, ["algorithm=grpo", "grpo.prime.enabled=true", override])


# ---------------------------------------------------------------------------------------------
# essa train


def prime_tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    tensors = load_file(str(run_dir / "checkpoint" / "tensors.safetensors"))
    return {k: v for k, v in tensors.items() if k.startswith("prime.")}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-step GRPO run with PRIME on: checked for what it logged and kept, and the run the
    killed one must resume onto (run once; the tests only read it)."""
    run_dir = tmp_path_factory.mktemp("prime") / "ref"
    res = essa("train", "--run-dir", str(run_dir), *sets(*SMALL, *PRIME, "run.generations=4"))
    assert res.returncode == 0, res.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_grpo_train_with_prime_on_demo(uninterrupted: Path) -> None:
    run_dir = uninterrupted
    steps = [r for r in records(run_dir) if r["generation"] >= 0]
    assert len(steps) == 4
    # step 0: phi is the SFT adapter, the reference: every process reward is 0, L_CE = log 2
    assert steps[0]["process_reward"] == 0.0
    assert steps[0]["prm_loss"] == pytest.approx(math.log(2), rel=1e-5)
    assert any(r["process_reward"] != 0.0 for r in steps[1:])  # phi has moved
    assert all(math.isfinite(r["loss"]) and 0 <= r["prm_accuracy"] <= 1 for r in steps)
    phi = prime_tensors(run_dir)
    n = len([k for k in phi if k.startswith("prime.param.")])
    assert n > 0 and len(phi) == 3 * n  # phi and both AdamW moments
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["grpo"]["prime"]["enabled"] is True


@pytest.mark.slow
def test_prime_resume_after_kill_matches_uninterrupted(tmp_path: Path, uninterrupted: Path) -> None:
    small, ref = [*SMALL, *PRIME, "run.generations=4"], uninterrupted
    run_dir = tmp_path / "killed"
    res = essa("train", "--run-dir", str(run_dir), *sets(*small), env={"ESSA_FAULT": "kill@3"})
    assert res.returncode == -9, res.stderr[-3000:]  # killed inside step 3's checkpoint write
    assert json.loads((run_dir / "checkpoint" / "state.json").read_text())["step"] == 2
    res = essa("train", "--resume", str(run_dir))
    assert res.returncode == 0, res.stderr[-3000:]
    a = load_file(str(ref / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    for key in a:
        assert torch.equal(a[key], b[key]), key
    pa, pb = prime_tensors(ref), prime_tensors(run_dir)
    assert set(pa) == set(pb)
    for key in pa:
        assert torch.equal(pa[key], pb[key]), key
    keys = ("prm_loss", "process_reward", "mean_reward", "loss")
    ra = [{k: r[k] for k in keys} for r in records(ref) if r["generation"] >= 0]
    rb = [{k: r[k] for k in keys} for r in records(run_dir) if r["generation"] >= 0]
    assert ra == rb


@pytest.mark.slow
def test_resuming_a_run_without_prime_with_prime_on_is_one_error_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    res = essa("train", "--run-dir", str(run_dir), *sets(*SMALL, "run.generations=1"))
    assert res.returncode == 0, res.stderr[-3000:]
    res = essa("train", "--resume", str(run_dir), *sets(*PRIME, "run.generations=2"))
    assert res.returncode == 2, res.stderr[-3000:]
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and "no implicit PRM" in lines[-1], res.stderr[-3000:]
