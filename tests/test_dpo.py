"""DPO: the loss by hand and against TRL's DPOTrainer, pair picking, and `essa train` end to end
(online pairs with LoRA, file pairs with LISA, exact resume after kill -9) on the demo model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from essa.config import DPOConfig
from essa.gradient.preference import dpo_loss, encode_pairs, pick_pairs, sequence_logprobs
from tests.test_train_e2e import essa, sets

SMALL = [
    "algorithm=dpo",
    "sft.steps=4",
    "data.sft_size=32",
    "data.test_size=40",
    "evaluation.every=2",
    "dpo.pairs_per_step=4",
    "run.show_progress=false",
]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------ the loss by hand


def test_sigmoid_loss_by_hand() -> None:
    # delta = (-1 - -2) - (-3 - -2.5) = 1 - (-0.5) = 1.5; beta 0.2: logit 0.3
    # -log sigmoid(0.3) = log(1 + e^-0.3) = 0.554355...
    d = DPOConfig(beta=0.2)
    out = dpo_loss(
        torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.5]), d
    )
    assert out.loss.item() == pytest.approx(math.log(1 + math.exp(-0.3)), rel=1e-6)
    assert out.chosen_rewards.item() == pytest.approx(0.2)  # beta * (-1 - -2)
    assert out.rejected_rewards.item() == pytest.approx(-0.1)  # beta * (-3 - -2.5)


def test_label_smoothed_loss_by_hand() -> None:
    # cDPO, eps 0.25: 0.75 * log(1 + e^-0.3) + 0.25 * log(1 + e^0.3)
    d = DPOConfig(beta=0.2, label_smoothing=0.25)
    out = dpo_loss(
        torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.5]), d
    )
    expected = 0.75 * math.log(1 + math.exp(-0.3)) + 0.25 * math.log(1 + math.exp(0.3))
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)


def test_ipo_loss_by_hand_is_per_token_and_averaged_over_pairs() -> None:
    # pair 1: chosen ratio 1 over 2 tokens, rejected -0.5 over 1: 0.5 + 0.5 = 1; tau 0.5: 1/(2 tau) = 1
    #   -> (1 - 1)^2 = 0
    # pair 2: chosen ratio 0 over 4 tokens, rejected 2 over 4: -0.5 -> (-0.5 - 1)^2 = 2.25
    d = DPOConfig(loss="ipo", beta=0.5)
    out = dpo_loss(
        torch.tensor([-1.0, -4.0]),
        torch.tensor([-3.0, -1.0]),
        torch.tensor([-2.0, -4.0]),
        torch.tensor([-2.5, -3.0]),
        d,
        torch.tensor([2.0, 4.0]),
        torch.tensor([1.0, 4.0]),
    )
    assert out.loss.item() == pytest.approx((0.0 + 2.25) / 2, rel=1e-6)


def test_loss_gradient_pushes_chosen_up_and_rejected_down() -> None:
    logp = torch.tensor([-2.0, -2.0], requires_grad=True)
    out = dpo_loss(logp[:1], logp[1:], torch.tensor([-2.0]), torch.tensor([-2.0]), DPOConfig())
    out.loss.backward()
    # d/dx -log sig(beta x) at 0 = -beta / 2
    assert logp.grad is not None
    assert logp.grad.tolist() == pytest.approx([-0.05, 0.05])


def test_pick_pairs_best_against_worst_first_of_ties_and_nan_never_picked() -> None:
    rewards = np.array(
        [
            [0.0, 1.0, 1.0, 0.0],  # chosen the first 1 (1), rejected the first 0 (0)
            [1.0, 1.0, 1.0, 1.0],  # all equal: no pair
            [np.nan, 0.2, 0.7, np.nan],  # NaN skipped: 2 over 1
            [np.nan, np.nan, 1.0, np.nan],  # one graded sample: no pair
            [0.5, np.nan, 0.0, 0.9],  # 3 over 2
        ]
    )
    assert pick_pairs(rewards) == [(0, 1, 0), (2, 2, 1), (4, 3, 2)]


def test_encode_pairs_layout() -> None:
    from tests.conftest import build_char_tokenizer

    tok = build_char_tokenizer()
    batch = encode_pairs(tok, ["1+2=", "10+5="], ["3", "15"], ["4 ", "1"])
    pad, eos = tok.pad_token_id, tok.eos_token_id
    assert batch.input_ids.shape == (4, 5 + 3)  # prompts left-padded to 5, completions to 3
    assert batch.input_ids[0].tolist()[:1] == [pad] and batch.attention_mask[0, 0] == 0
    assert batch.completion_ids[0].tolist() == [*tok("3")["input_ids"], eos, pad]
    assert batch.mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 0]]


# ------------------------------------------------------------------------ TRL's DPOTrainer


def _trl_trainer(policy, ref, tokenizer, loss_type: str, beta: float, out: Path):  # type: ignore[no-untyped-def]
    from datasets import Dataset
    from trl import DPOConfig as TRLConfig
    from trl import DPOTrainer

    args = TRLConfig(
        output_dir=str(out),
        beta=beta,
        loss_type=[loss_type],
        report_to=[],
        use_cpu=True,
        max_length=None,
    )
    dataset = Dataset.from_list([{"prompt": "1+2=", "chosen": "3", "rejected": "4"}])
    return DPOTrainer(
        model=policy, ref_model=ref, args=args, train_dataset=dataset, processing_class=tokenizer
    )


@pytest.mark.component("trl")
@pytest.mark.parametrize(("loss_type", "beta"), [("sigmoid", 0.3), ("ipo", 0.5)])
def test_loss_and_gradients_equal_trl_dpo_trainer(
    tiny_model_dir: Path, tmp_path: Path, loss_type: str, beta: float
) -> None:
    """TRL's public DPOTrainer.compute_loss on its own collated batch (right padding, its
    model forward) against our loss on our batch (left padding, our log-probs): same models,
    same token ids, so loss and gradients must agree."""
    pytest.importorskip("trl", reason="TRL (test-only dependency) not installed")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a reference that differs from the policy
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    prompts, chosen, rejected = ["12+3=", "7+7=", "9="], ["15", "14", "9"], ["16 ", "1", "90"]
    trainer = _trl_trainer(policy, ref, tok, loss_type, beta, tmp_path / "trl")
    eos = tok.eos_token_id
    examples = [
        {
            "prompt_ids": tok(p)["input_ids"],
            "chosen_ids": tok(c)["input_ids"] + [eos],
            "rejected_ids": tok(r)["input_ids"] + [eos],
        }
        for p, c, r in zip(prompts, chosen, rejected, strict=True)
    ]
    theirs = trainer.compute_loss(
        trainer.model, DataCollatorForPreference(tok.pad_token_id)(examples)
    )
    theirs.backward()
    their_grads = [p.grad.clone() for p in policy.parameters()]
    policy.zero_grad(set_to_none=True)

    batch = encode_pairs(tok, prompts, chosen, rejected)
    with torch.no_grad():
        ref_logp = sequence_logprobs(ref, batch)  # (6,)
    logp = sequence_logprobs(policy, batch)
    tokens = batch.mask.sum(-1)
    d = DPOConfig(loss="ipo" if loss_type == "ipo" else "sigmoid", beta=beta)
    ours = dpo_loss(logp[:3], logp[3:], ref_logp[:3], ref_logp[3:], d, tokens[:3], tokens[3:]).loss
    ours.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)
    assert ours.item() > 0.01  # not a trivially zero loss
    for mine, trl_grad in zip((p.grad for p in policy.parameters()), their_grads, strict=True):
        assert mine is not None
        assert torch.allclose(mine, trl_grad, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def online(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 3-step run on online pairs with LoRA: checked for what it wrote and the
    run the killed one must resume onto (run once; the tests only read it)."""
    run_dir = tmp_path_factory.mktemp("dpo-online") / "run"
    res = essa("train", "--run-dir", str(run_dir), *sets(*SMALL, "run.generations=3"))
    assert res.returncode == 0, res.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_dpo_online_pairs_train_and_export(online: Path) -> None:
    run_dir = online
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["algorithm"] == "dpo" and summary["generations"] == 3
    assert 0.0 <= summary["final_accuracy"] <= 1.0
    recs = records(run_dir)
    assert recs[0]["event"] == "baseline"
    steps = [r for r in recs if r["generation"] >= 0]
    assert [r["generation"] for r in steps] == [0, 1, 2]
    trained = [r for r in steps if not r.get("skipped")]
    assert trained, "no step found a pair"
    for r in trained:
        assert 1 <= r["pairs"] <= 4 and math.isfinite(r["loss"]) and r["new_tokens"] > 0
    assert "heldout_accuracy" in steps[1]
    sft = load_file(str(run_dir / "sft_adapter" / "adapter_model.safetensors"))
    final = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    assert any(not torch.equal(final[k], sft[k]) for k in final), "DPO changed nothing"


def _write_pairs(path: Path) -> Path:
    """Pairs on training-pool questions: the right sum chosen, the sum + 1 rejected."""
    from essa.data.loaders import builtin_examples

    train, _ = builtin_examples("builtin:arithmetic")
    lines = [
        json.dumps({"prompt": e.prompt, "chosen": e.answer, "rejected": str(int(e.answer) + 1)})
        for e in train[:40]
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow
def test_dpo_file_pairs_with_lisa_resume_after_kill_is_exact(tmp_path: Path) -> None:
    """File pairs, LISA on the merged SFT weights (interval 2: a re-sampling inside the run);
    kill -9 inside the step-2 checkpoint write, resume: the same model as uninterrupted."""
    pairs = _write_pairs(tmp_path / "pairs.jsonl")
    small = [
        *SMALL,
        f"dpo.pairs={pairs}",
        "dpo.trainable=lisa",
        "dpo.lisa.active_layers=1",
        "dpo.lisa.interval=2",
        "dpo.lr=1e-4",
        "run.generations=4",
    ]
    ref = tmp_path / "ref"
    res = essa("train", "--run-dir", str(ref), *sets(*small))
    assert res.returncode == 0, res.stderr[-3000:]
    recs = [r for r in records(ref) if r["generation"] >= 0]
    assert all(r["pairs"] == 4 and "reward_accuracy" in r for r in recs)
    assert recs[-1]["reward_margin"] > recs[0]["reward_margin"]  # the pairs are being learned

    run_dir = tmp_path / "killed"
    res = essa("train", "--run-dir", str(run_dir), *sets(*small), env={"ESSA_FAULT": "kill@2"})
    assert res.returncode == -9, res.stderr[-3000:]
    assert json.loads((run_dir / "checkpoint" / "state.json").read_text())["step"] == 1
    res = essa("train", "--resume", str(run_dir))
    assert res.returncode == 0, res.stderr[-3000:]
    a = load_file(str(ref / "adapter" / "model.safetensors"))
    b = load_file(str(run_dir / "adapter" / "model.safetensors"))
    assert set(a) == set(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert [r["generation"] for r in records(run_dir)] == [-1, 0, 1, 2, 3]
    assert _same_but_seconds(records(run_dir), records(ref))


def _same_but_seconds(a: list[dict], b: list[dict]) -> bool:
    def strip(r: dict) -> dict:
        return {k: v for k, v in r.items() if k not in ("seconds", "tokens_per_second")}

    return [strip(r) for r in a] == [strip(r) for r in b]


def test_bad_pairs_file_is_one_line(tmp_path: Path) -> None:
    from essa.data import DataError
    from essa.data.loaders import load_preference_pairs

    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n{"prompt": "x", "chosen": "2"}\n'
    )
    with pytest.raises(DataError, match=r"p.jsonl:2: missing field 'rejected'"):
        load_preference_pairs(str(path))
    path.write_text('{"prompt": "1+1=", "chosen": "", "rejected": "3"}\n')
    with pytest.raises(DataError, match=r"p.jsonl:1: field 'chosen' must be a non-empty string"):
        load_preference_pairs(str(path))


def test_missing_pairs_file_is_one_error_line_through_the_cli(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    res = essa("train", "--run-dir", str(tmp_path / "run"), *sets(*SMALL, f"dpo.pairs={missing}"))
    assert res.returncode == 2
    assert res.stderr.strip() == f"error: dpo.pairs: {missing}: no such file (preference pairs)"


@pytest.mark.slow
def test_dpo_online_lora_resume_after_kill_is_exact(tmp_path: Path, online: Path) -> None:
    """Online pairs (sampling, reward, pairing) and LoRA: kill -9 inside the step-2 checkpoint
    write, resume; adapter and records equal the uninterrupted run's."""
    small, ref = [*SMALL, "run.generations=3"], online
    run_dir = tmp_path / "killed"
    res = essa("train", "--run-dir", str(run_dir), *sets(*small), env={"ESSA_FAULT": "kill@2"})
    assert res.returncode == -9, res.stderr[-3000:]
    res = essa("train", "--resume", str(run_dir))
    assert res.returncode == 0, res.stderr[-3000:]
    a = load_file(str(ref / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert _same_but_seconds(records(run_dir), records(ref))
    assert (run_dir / "samples.jsonl").read_text() == (ref / "samples.jsonl").read_text()


def test_dpo_takes_its_own_sampling_settings_not_grpos() -> None:
    from essa.config import Config, ConfigError, DPOConfig, GRPOConfig, check_values
    from essa.config.gradient import EntropyConfig

    check_values(Config(algorithm="dpo", dpo=DPOConfig(train_examples=1, entropy_floor=0.5)))
    with pytest.raises(
        ConfigError,
        match="grpo.train_examples: a GRPO setting; with algorithm dpo set dpo.train_examples",
    ):
        check_values(Config(algorithm="dpo", grpo=GRPOConfig(train_examples=1)))
    with pytest.raises(ConfigError, match="grpo.entropy.floor: .* set dpo.entropy_floor"):
        check_values(Config(algorithm="dpo", grpo=GRPOConfig(entropy=EntropyConfig(floor=0.5))))
    check_values(Config(algorithm="grpo", grpo=GRPOConfig(train_examples=1)))  # GRPO's own
    with pytest.raises(ConfigError, match="dpo.train_examples: must be >= 1"):
        check_values(Config(algorithm="dpo", dpo=DPOConfig(train_examples=0)))
