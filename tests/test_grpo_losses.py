"""GRPO-family math against hand-computed values, plus TRL.

Each variant's advantages, token loss and normaliser are checked on numbers worked out by hand
(section numbers refer to the spec); the grpo, dr_grpo and dapo losses and gradients are also
checked against TRL's own ``GRPOTrainer._compute_loss`` on identical random inputs.

TRL has no public function for the loss alone, so that check calls the private
``GRPOTrainer._compute_loss`` with a stand-in ``self``. It is pinned: the test first compares the
method's source with the fingerprint of the version it was written against (TRL_CHECKED) and
fails, saying so, when TRL changed it; a TRL update can thus never make it pass on a stand-in that
no longer matches what the method reads. The advantages are checked on hand-computed values only.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import statistics
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from essa.config import ConfigError, load_config
from essa.gradient import losses as L

NAN = math.nan


def binary_group(correct: int, size: int = 8) -> torch.Tensor:
    return torch.tensor([[1.0] * correct + [0.0] * (size - correct)])  # (1, G)


# --------------------------------------------------------------------------------- advantages


@pytest.mark.parametrize(
    ("correct", "right", "wrong"),
    [(1, 2.475, -0.354), (4, 0.935, -0.935), (7, 0.354, -2.475)],
)
def test_grpo_advantages_sample_std(correct: int, right: float, wrong: float) -> None:
    # Spec §2.1: sample std; one correct of 8 gives +2.475 / -0.354 (TRL adds 1e-4 to the std).
    adv = L.std_normalized_advantages(binary_group(correct)).values[0]
    assert adv[0].item() == pytest.approx(right, abs=2e-3)
    assert adv[-1].item() == pytest.approx(wrong, abs=2e-3)
    assert adv.sum().item() == pytest.approx(0.0, abs=1e-5)


def test_grpo_zero_std_group_and_ungradable_rewards() -> None:
    rewards = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, NAN, 0.0]])
    adv = L.std_normalized_advantages(rewards)
    assert torch.equal(adv.values[0], torch.zeros(4))  # zero-std group: no signal
    # NaN is left out of the baseline: mean 1/3, sample std over {1, 0, 0} = 0.57735.
    expected = (1 - 1 / 3) / (statistics.stdev([1, 0, 0]) + 1e-4)
    assert adv.values[1, 0].item() == pytest.approx(expected, rel=1e-5)
    assert adv.values[1, 2].item() == 0.0  # the ungradable completion gets advantage 0
    assert adv.keep.all()  # ... but stays in the batch, as in TRL


def test_dr_grpo_advantages_are_centered_only() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [3.0, 1.0, 2.0, 2.0]])
    adv = L.centered_advantages(rewards).values
    assert torch.allclose(adv, torch.tensor([[0.75, -0.25, -0.25, -0.25], [1.0, -1.0, 0.0, 0.0]]))


@pytest.mark.parametrize(
    ("correct", "right", "wrong"),
    [(0, None, -0.333), (1, 1.764, -0.504), (4, 0.843, -1.054), (7, 0.333, -2.667)],
)
def test_ngrpo_worked_examples(correct: int, right: float | None, wrong: float) -> None:
    # Spec §7 table: a virtual max-reward sample joins the statistics (G + K = 9 values).
    adv = L.ngrpo_advantages(binary_group(correct)).values[0]
    if right is not None:
        assert adv[0].item() == pytest.approx(right, abs=1e-3)
    assert adv[-1].item() == pytest.approx(wrong, abs=1e-3)


def test_ngrpo_all_wrong_group_of_8_gets_minus_one_third_each() -> None:
    adv = L.ngrpo_advantages(torch.zeros(1, 8)).values
    assert torch.allclose(adv, torch.full((1, 8), -1 / 3), atol=1e-5)


def test_ngrpo_all_correct_group_is_zero_and_filtered() -> None:
    rewards = torch.cat([binary_group(8), binary_group(0), binary_group(3)])
    assert torch.equal(L.ngrpo_advantages(rewards).values[0], torch.zeros(8))
    assert L.groups_to_keep(rewards, "not_all_max").tolist() == [False, True, True]


def test_w_reinforce_psr_nsr() -> None:
    rewards = torch.tensor([[1.0, 0.0, 1.0, NAN]])
    w = L.w_reinforce_advantages(rewards)
    assert w.values.tolist() == [[pytest.approx(0.1), -1.0, pytest.approx(0.1), 0.0]]
    assert w.keep.tolist() == [[True, True, True, False]]
    psr = L.psr_advantages(rewards)
    assert psr.values.tolist() == [[1.0, 0.0, 1.0, 0.0]]
    assert psr.keep.tolist() == [[True, False, True, False]]  # correct samples only
    nsr = L.nsr_advantages(rewards)
    assert nsr.values.tolist() == [[0.0, -1.0, 0.0, 0.0]]
    assert nsr.keep.tolist() == [[False, True, False, False]]  # incorrect samples only


def test_dapo_dynamic_sampling_keeps_mixed_groups() -> None:
    rewards = torch.cat([binary_group(0), binary_group(8), binary_group(1), binary_group(7)])
    assert L.groups_to_keep(rewards, "mixed").tolist() == [False, False, True, True]
    assert L.groups_to_keep(rewards, "none").all()


def test_soft_overlong_punishment_worked_example() -> None:
    # Spec §5.4b: L_max 20480, L_cache 4096: 18432 tokens -> -0.5, 16000 -> 0.
    lengths = torch.tensor([16000, 16384, 18432, 20480, 20481])
    got = L.soft_overlong_punishment(lengths, 20480, 4096)
    assert got.tolist() == [0.0, 0.0, -0.5, -1.0, -1.0]


# ---------------------------------------------------------------------------------- DCPO


@pytest.mark.parametrize(
    ("q", "bounds_016_02", "bounds_02_028"),
    [
        (0.9, (0.769, 1.187), (0.667, 1.249)),
        (0.5, (0.5, 1.306), (0.5, 1.4)),
        (0.1, (0.5, 2.0), (0.5, 2.246)),
        (0.01, (0.5, 5.0), (0.5, 5.815)),
    ],
)
def test_dcpo_bounds_table(q: float, bounds_016_02: tuple, bounds_02_028: tuple) -> None:
    # Spec §8.1 table (matches the DCPO README).
    for (eps_low, eps_high), (low, high) in (
        ((0.16, 0.2), bounds_016_02),
        ((0.2, 0.28), bounds_02_028),
    ):
        got_low, got_high = L.dcpo_clip_bounds(torch.tensor([q]), eps_low, eps_high, 10.0)
        assert got_low.item() == pytest.approx(low, abs=1e-3)
        assert got_high.item() == pytest.approx(high, abs=1e-3)


def test_dcpo_high_bound_is_capped_at_max_c_10() -> None:
    _, high = L.dcpo_clip_bounds(torch.tensor([1e-4]), 0.2, 0.28, 10.0)
    assert high.item() == 10.0


def _sas_reference(visits: list[list[float]]) -> list[list[float]]:
    """Spec §8.2 written out with plain floats, one visit at a time."""
    out = []
    mean, var = 0.0, 0.0
    for n, rewards in enumerate(visits):  # n: earlier visits
        mean_new, std_new = statistics.mean(rewards), statistics.stdev(rewards)
        if n == 0:
            mean, var = mean_new, std_new**2
        else:
            mean, var = (
                (n * mean + mean_new) / (n + 1),
                (n * var + std_new**2 + n / (n + 1) * (mean_new - mean) ** 2) / (n + 1),
            )
        i = n + 1  # this visit, counting it
        row = []
        for r in rewards:
            a_new = 0.0 if std_new == 0 else (r - mean_new) / (std_new + 1e-6)
            a_total = 0.0 if var == 0 else (r - mean) / (math.sqrt(var) + 1e-6)
            sa_new = (i - 1) / i * a_new + a_total / i
            sa_total = a_new / i + (i - 1) / i * a_total
            row.append(sa_new if abs(sa_new) <= abs(sa_total) else sa_total)
        out.append(row)
    return out


def test_dcpo_smooth_standardization_over_visits() -> None:
    visits = [
        [1.0, 0.0, 0.0, 0.0],
        [1.0, 1.0, 0.0, 0.0],
        [1.0, 1.0, 1.0, 1.0],
        [0.0, 1.0, 1.0, 1.0],
    ]
    expected = _sas_reference(visits)
    history: dict[int, L.PromptStats] = {}
    for rewards, want in zip(visits, expected, strict=True):
        adv, new_history = L.smooth_standardized_advantages(torch.tensor([rewards]), [7], history)
        assert adv.values[0].tolist() == pytest.approx(want, abs=1e-5)
        assert history is not new_history  # the state is passed in and out, never mutated
        history = new_history
    assert history[7].visits == 4


def test_dcpo_first_visit_is_plain_standardization_and_equal_group_later_is_nonzero() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    adv, history = L.smooth_standardized_advantages(rewards, [0], {})
    # Visit 1: both terms use the same statistics: (r - 0.25) / 0.5.
    assert adv.values[0].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    adv, history = L.smooth_standardized_advantages(torch.ones(1, 4), [0], history)
    # Visit 2, all correct: Â_new = 0, μ_total = 0.625, σ²_total = (0.25 + 0.5 * 0.75²) / 2.
    a_total = (1 - 0.625) / (math.sqrt((0.25 + 0.5 * 0.75**2) / 2) + 1e-6)
    assert adv.values[0].tolist() == pytest.approx([a_total / 2] * 4, abs=1e-6)


# ------------------------------------------------------------------------ token losses


def test_k3_kl_values() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.25]]))
    ref = torch.log(torch.tensor([[0.5, 0.5]]))
    kl = L.k3_kl(logp, ref)
    # Δ = ln 2 for the second token: e^Δ − Δ − 1 = 1 − ln 2.
    assert kl.tolist() == [[0.0, pytest.approx(1 - math.log(2))]]


def test_on_policy_gradient_is_advantage_times_grad_logp() -> None:
    # Spec §1: with old = sg(logp), ρ = 1, the loss value is 0 and d loss/d logp = −Â·weight.
    logp = torch.log(torch.tensor([[0.3, 0.6, 0.9], [0.2, 0.5, 0.7]])).requires_grad_(True)
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    counts = L.step_counts(mask, torch.tensor([0, 0]), 3)
    loss, _ = L.policy_loss(L.get_variant("dapo"), logp, logp.detach(), adv, mask, counts)
    loss.backward()
    assert loss.item() == pytest.approx(-(2.0 * 2 - 1.0 * 3) / 5)  # Σ −ρÂ m / Σ m with ρ = 1
    expected = -adv[:, None] * mask / 5  # token mean: 5 completion tokens
    assert torch.allclose(logp.grad, expected)


def test_dapo_clip_higher_bounds_and_zero_gradient_when_clipped() -> None:
    variant = L.get_variant("dapo")
    old = torch.zeros(1, 4)
    ratios = torch.tensor([[1.5, 1.1, 0.5, 0.9]])
    logp = torch.log(ratios).requires_grad_(True)
    adv = torch.tensor([1.0])
    mask = torch.ones(1, 4)
    loss, token = L.policy_loss(
        variant, logp, old, adv, mask, L.step_counts(mask, torch.tensor([0]), 4)
    )
    loss.backward()
    # Â > 0: ρ = 1.5 is clipped at 1 + 0.28 (no gradient); ρ below 1 is never clipped for Â > 0.
    assert token.loss[0].tolist() == pytest.approx([-1.28, -1.1, -0.5, -0.9])
    assert logp.grad[0, 0].item() == 0.0
    assert logp.grad[0, 1].item() == pytest.approx(-1.1 / 4)
    low, high = L.clip_fractions(token, adv, mask)
    assert (low, high) == (0.0, 0.25)
    # Â < 0: ρ = 0.5 is clipped at 1 − 0.2 (no gradient).
    logp2 = torch.log(ratios).requires_grad_(True)
    loss2, token2 = L.policy_loss(
        variant, logp2, old, -adv, mask, L.step_counts(mask, torch.tensor([0]), 4)
    )
    loss2.backward()
    assert token2.loss[0].tolist() == pytest.approx([1.5, 1.1, 0.8, 0.9])
    assert logp2.grad[0, 2].item() == 0.0


def test_dual_clip_caps_negative_advantage_loss() -> None:
    logp = torch.log(torch.tensor([[5.0, 2.0]])).requires_grad_(True)
    token = L.clipped_token_loss(
        logp, torch.zeros(1, 2), torch.tensor([-1.0]), low=0.8, high=1.2, dual_clip=3.0
    )
    assert token.loss[0].tolist() == pytest.approx([3.0, 2.0])  # min(ρ·|Â|, c·|Â|)
    token.loss.sum().backward()
    assert logp.grad[0, 0].item() == 0.0


def test_grpo_preset_adds_beta_k3() -> None:
    variant = L.get_variant("grpo")
    logp = torch.log(torch.tensor([[0.25]]))
    ref = torch.log(torch.tensor([[0.5]]))
    mask = torch.ones(1, 1)
    counts = L.step_counts(mask, torch.tensor([0]), 1)
    loss, token = L.policy_loss(
        variant, logp, logp, torch.tensor([0.0]), mask, counts, ref_logp=ref
    )
    assert loss.item() == pytest.approx(0.04 * (1 - math.log(2)))
    assert token.kl is not None


# --------------------------------------------------------------------------- normalisers


def test_normaliser_weights_worked_example() -> None:
    # Spec §6: sequences of 10 and 100 tokens, L_max = 3000: the weight of each token.
    mask = torch.zeros(2, 100)
    mask[0, :10] = 1
    mask[1, :] = 1
    expected = {
        "sequence_mean": (1 / 20, 1 / 200),
        "token_mean": (1 / 110, 1 / 110),
        "constant_length": (1 / 6000, 1 / 6000),
        "group_token_mean": (1 / 110, 1 / 110),  # one group: its token mean
    }
    counts = L.step_counts(mask, torch.tensor([0, 0]), 3000)
    for name, (short, long) in expected.items():
        per_token = torch.ones(2, 100, requires_grad=True)
        L.aggregate(per_token, mask, name, counts).backward()
        assert per_token.grad[0, 0].item() == pytest.approx(short), name
        assert per_token.grad[1, 0].item() == pytest.approx(long), name
        assert per_token.grad[0, 50].item() == 0.0  # masked


def test_dcpo_group_token_mean_sums_over_groups() -> None:
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    per_token = torch.ones(4, 2)
    counts = L.step_counts(mask, torch.tensor([0, 0, 1, 1]), 2)
    assert counts.group_tokens.tolist() == [3, 3, 4, 4]
    # Token mean within each group (1.0 each), summed over the two groups.
    assert L.group_token_mean(per_token, mask, counts.group_tokens).item() == pytest.approx(2.0)


@pytest.mark.parametrize("name", list(L.VARIANTS))
def test_micro_batches_add_up_to_the_full_batch_loss(name: str) -> None:
    gen = torch.Generator().manual_seed(0)
    b, t = 8, 6
    logp = -torch.rand(b, t, generator=gen) * 3
    old = logp + 0.3 * torch.randn(b, t, generator=gen)
    ref = logp + 0.3 * torch.randn(b, t, generator=gen)
    adv = torch.randn(b, generator=gen)
    mask = (torch.arange(t)[None, :] < torch.randint(1, t + 1, (b, 1), generator=gen)).float()
    counts = L.step_counts(mask, torch.arange(b) // 4, t)
    variant = L.get_variant(name)
    full, _ = L.policy_loss(variant, logp, old, adv, mask, counts, ref_logp=ref, beta=0.1)
    parts = 0.0
    for rows in torch.arange(b).chunk(3):
        part, _ = L.policy_loss(
            variant,
            logp[rows],
            old[rows],
            adv[rows],
            mask[rows],
            counts._replace(group_tokens=counts.group_tokens[rows]),
            ref_logp=ref[rows],
            beta=0.1,
        )
        parts += part.item()
    assert parts == pytest.approx(full.item(), rel=1e-5, abs=1e-7)


def test_registry_is_the_configs_list_of_names() -> None:
    for name in L.VARIANTS:  # every preset is a grpo.loss value, and nothing else is
        assert load_config(None, [f"grpo.loss={name}"]).grpo.loss == name
    with pytest.raises(ConfigError, match="grpo.loss: expected one of 'grpo' .* 'dcpo', got 'ppo'"):
        load_config(None, ["grpo.loss=ppo"])
    with pytest.raises(ValueError, match="unknown GRPO variant"):
        L.get_variant("ppo")


def test_advantages_dispatch_and_dcpo_state() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    for name in L.VARIANTS:
        adv, history = L.advantages(L.get_variant(name), rewards, [3], {})
        assert adv.values.shape == (1, 4)
        assert (history != {}) == (name == "dcpo")


# ------------------------------------------------------------------------ TRL equivalence

# The TRL release whose GRPOTrainer._compute_loss the stand-in below was checked against, and the
# sha256 of that method's source (inspect.getsource). To move to a new TRL: read the new method,
# update the stand-in's attributes and inputs, then these two constants.
TRL_CHECKED = "1.16.0"
TRL_COMPUTE_LOSS_SHA256 = "80295546bbdbf6f711acce7f6e69b0100ab40aa8f23ed8052cc564ff024e3e40"


def _pinned_compute_loss():  # type: ignore[no-untyped-def]
    """TRL's GRPOTrainer._compute_loss, or a loud failure if it is not the checked source."""
    import trl
    from trl.trainer.grpo_trainer import GRPOTrainer

    method = GRPOTrainer._compute_loss
    digest = hashlib.sha256(inspect.getsource(method).encode()).hexdigest()
    if digest != TRL_COMPUTE_LOSS_SHA256:
        pytest.fail(
            f"TRL {trl.__version__}: GRPOTrainer._compute_loss differs from the TRL "
            f"{TRL_CHECKED} source this test's stand-in was checked against (sha256 {digest}); "
            "re-check _trl_loss against the new method and update TRL_CHECKED and "
            "TRL_COMPUTE_LOSS_SHA256",
            pytrace=False,
        )
    return method


def _trl_loss(loss_type: str, logp, old, ref, adv, mask, beta, eps_low, eps_high, max_len):
    """TRL's GRPOTrainer._compute_loss on our tensors, with the model call stubbed out."""
    compute_loss = _pinned_compute_loss()
    b, t = logp.shape
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros(b, t), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        loss_type=loss_type,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        use_vllm=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=max_len,
        accelerator=SimpleNamespace(
            num_processes=1,
            gather=lambda x: x,
            reduce=lambda x, reduction: x,
            gather_for_metrics=lambda x: x,
        ),
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list)},
    )
    inputs = {
        "prompt_ids": torch.zeros(b, 2, dtype=torch.long),
        "prompt_mask": torch.ones(b, 2, dtype=torch.long),
        "completion_ids": torch.zeros(b, t, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    return compute_loss(fake, None, inputs)


@pytest.mark.component("trl")
@pytest.mark.parametrize(
    ("name", "beta"), [("grpo", 0.04), ("dr_grpo", 0.0), ("dapo", 0.0), ("dapo", 0.1)]
)
def test_losses_and_gradients_equal_trl(name: str, beta: float) -> None:
    pytest.importorskip(
        "trl.trainer.grpo_trainer", reason="TRL (test-only dependency) not installed"
    )
    gen = torch.Generator().manual_seed(1)
    b, t, max_len = 6, 7, 9
    base = -torch.rand(b, t, generator=gen) * 2
    old = base + 0.4 * torch.randn(b, t, generator=gen)  # ratios far enough from 1 to clip
    ref = base + 0.4 * torch.randn(b, t, generator=gen)
    adv = torch.randn(b, generator=gen)
    mask = (torch.arange(t)[None, :] < torch.randint(1, t + 1, (b, 1), generator=gen)).long()
    variant = L.get_variant(name)

    ours_logp = base.clone().requires_grad_(True)
    counts = L.step_counts(mask.float(), torch.arange(b) // 3, max_len)
    ours, token = L.policy_loss(
        variant, ours_logp, old, adv, mask.float(), counts, ref_logp=ref, beta=beta
    )
    ours.backward()
    assert token.ratio.max() > 1 + variant.epsilon_high  # the clip is active somewhere

    trl_logp = base.clone().requires_grad_(True)
    theirs = _trl_loss(
        name,
        trl_logp,
        old,
        ref,
        adv,
        mask,
        beta,
        variant.epsilon_low,
        variant.epsilon_high,
        max_len,
    )
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-8)
    assert torch.allclose(ours_logp.grad, trl_logp.grad, rtol=1e-5, atol=1e-8)
