"""Pieces of the GRPO recipe on the tiny in-process Qwen2: rollouts, log-probs, SVD-GRPO."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from essa.config import Config, GRPOConfig
from essa.gradient.policy import Policy, rollout, token_logprobs
from essa.gradient.schedule import lr_factor
from tests.conftest import grpo_cfg, sampling


def test_token_logprobs_match_generate_with_left_padding(tiny_lora) -> None:  # type: ignore[no-untyped-def]
    peft_model, tokenizer = tiny_lora
    policy = Policy.build(copy.deepcopy(peft_model), "lora", 1.0)
    cfg = grpo_cfg()
    prompts = ["12+7=", "5+93=", "1+1="]  # different lengths: left padding differs per row
    out = rollout(policy, tokenizer, prompts, sampling(cfg), seed=3)
    t = out.completion_ids.shape[1]
    logp, entropy = token_logprobs(
        policy.model, out.input_ids, out.attention_mask, t, cfg.grpo.temperature
    )
    # Reference: generate again with the same seed, keeping its raw logits.
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(3)
    ref = policy.model.generate(
        **batch,
        do_sample=True,
        temperature=0.7,
        top_p=1.0,
        top_k=0,
        max_new_tokens=6,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    assert torch.equal(ref.sequences[:, batch["input_ids"].shape[1] :], out.completion_ids)
    raw = torch.stack(ref.logits, dim=1)  # (B, T, V) before temperature
    expected = torch.log_softmax(raw / 0.7, -1).gather(-1, out.completion_ids[..., None])[..., 0]
    mask = out.mask.bool()
    assert torch.allclose(logp[mask], expected[mask], atol=1e-4)
    assert (entropy[mask] >= 0).all()


def test_rollout_mask_stops_after_first_eos(tiny_lora) -> None:  # type: ignore[no-untyped-def]
    peft_model, tokenizer = tiny_lora
    policy = Policy.build(copy.deepcopy(peft_model), "lora", 1.0)
    out = rollout(policy, tokenizer, ["3+4="] * 16, sampling(grpo_cfg()), seed=0)
    eos = out.completion_ids == tokenizer.eos_token_id
    for row in range(16):
        hits = torch.nonzero(eos[row]).flatten()
        n = int(out.mask[row].sum())
        if hits.numel():
            assert n == int(hits[0]) + 1 and not out.truncated[row]  # EOS itself is trained on
        else:
            assert n == out.completion_ids.shape[1] and out.truncated[row]
    assert len(out.texts) == 16


def test_singular_values_policy_starts_at_the_sft_adapter(tiny_lora) -> None:  # type: ignore[no-untyped-def]
    peft_model, tokenizer = tiny_lora
    ids = tokenizer(["12+34="], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits
    policy = Policy.build(copy.deepcopy(peft_model), "singular_values", 1.0)
    assert [p.shape for p in policy.params] == [torch.Size([policy.svd.dim])]
    logits = policy.model(input_ids=ids).logits
    assert torch.allclose(logits, expected, atol=1e-5)
    logits.sum().backward()
    trainable = [n for n, p in policy.model.named_parameters() if p.grad is not None]
    assert len(trainable) == 1 and policy.params[0].grad.abs().sum() > 0
    with torch.no_grad():
        policy.params[0].add_(0.5)
        moved = policy.model(input_ids=ids).logits
        with policy.frozen_reference():
            assert torch.allclose(policy.model(input_ids=ids).logits, expected, atol=1e-5)
        assert torch.equal(policy.model(input_ids=ids).logits, moved)  # restored bit-exactly


def test_singular_values_export_reproduces_the_policy(tiny_lora, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    peft_model, tokenizer = tiny_lora
    policy = Policy.build(copy.deepcopy(peft_model), "singular_values", 1.0)
    with torch.no_grad():
        policy.params[0].copy_(0.3 * torch.randn(policy.params[0].shape))
    ids = tokenizer(["7+8="], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = policy.model(input_ids=ids).logits
    policy.export(tmp_path / "adapter", "unused")
    base_dir = peft_model.base_model.model.config._name_or_path
    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, expected, atol=1e-4)


def test_lr_schedule() -> None:
    cfg = Config(grpo=GRPOConfig(lr_schedule="cosine", lr_warmup_steps=2))
    cfg = Config(grpo=cfg.grpo, run=type(cfg.run)(generations=12))
    g = cfg.grpo

    def factor(step: int) -> float:
        return lr_factor(step, cfg.run.generations, g.lr_warmup_steps, g.lr_schedule)

    assert [factor(s) for s in (0, 1)] == [0.5, 1.0]
    assert factor(2) == pytest.approx(1.0)
    assert factor(7) == pytest.approx(0.5)
    assert factor(12) == pytest.approx(0.0)


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("grpo.group_size=1", "grpo.group_size: must be >= 2"),
        ("grpo.loss=ppo", "grpo.loss: expected one of 'grpo' | 'dr_grpo'"),
        ("grpo.overlong_buffer=20", "exceeds generation.max_new_tokens"),
        ("grpo.epsilon_low=1.5", "grpo.epsilon_low: must be in [0, 1)"),
        ("grpo.beta=-0.1", "grpo.beta: must be >= 0"),
        ("grpo.trainable=full", "grpo.trainable: expected one of 'lora' | 'singular_values'"),
    ],
)
def test_grpo_config_errors(override: str, fragment: str) -> None:
    from essa.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="^--set grpo") as err:
        load_config(None, ["algorithm=grpo", override])
    assert fragment in str(err.value)


def test_grpo_refuses_multi_rank_runs(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from essa.errors import UserError
    from essa.recipes import grpo

    comm = SimpleNamespace(rank=0, world_size=2)
    with pytest.raises(UserError, match="one process"):
        grpo.run(Config(algorithm="grpo"), tmp_path, comm=comm)  # type: ignore[arg-type]


def test_rollout_stops_at_the_model_end_of_turn_token(tiny_lora) -> None:  # type: ignore[no-untyped-def]
    """As ESSA's backends do (tests/test_stops.py): a stop id in the model's generation_config
    that is not the tokenizer's EOS ends a rollout row, and the mask keeps it."""
    peft_model, tokenizer = tiny_lora
    model = copy.deepcopy(peft_model)
    policy = Policy.build(model, "lora", 1.0)
    cfg = grpo_cfg()
    full = rollout(policy, tokenizer, ["3+4="] * 8, sampling(cfg), seed=0)
    end_of_turn = int(full.completion_ids[0, 0])  # row 0's first sampled token
    assert end_of_turn != tokenizer.eos_token_id
    model.generation_config.eos_token_id = [end_of_turn]
    out = rollout(policy, tokenizer, ["3+4="] * 8, sampling(cfg), seed=0)
    assert int(out.mask[0].sum()) == 1 and not out.truncated[0]
    for row in range(8):  # every row ends at its first stop (EOS or the end-of-turn id)
        ids = out.completion_ids[row].tolist()
        n = int(out.mask[row].sum())
        stops = [t for t, x in enumerate(ids) if x in (end_of_turn, tokenizer.eos_token_id)]
        assert n == (stops[0] + 1 if stops else len(ids))


def test_micro_batches_bound_the_logits_and_keep_the_asked_number(tiny_lora, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from essa.gradient import policy as policy_module

    peft_model, _ = tiny_lora
    v = policy_module.vocab_size(peft_model)
    assert v == peft_model.get_output_embeddings().weight.shape[0]
    monkeypatch.setattr(policy_module, "LOGITS_PER_MICRO_BATCH", 3 * 5 * v)  # 3 rows of T=4
    chunks = policy_module.micro_batches(peft_model, 10, 4)
    assert [len(c) for c in chunks] == [3, 3, 3, 1]  # ceil(10 / 3) = 4 micro-batches
    assert torch.equal(torch.cat(chunks), torch.arange(10))
    assert len(policy_module.micro_batches(peft_model, 10, 4, at_least=5)) == 5  # the asked number
    assert len(policy_module.micro_batches(peft_model, 10, 1)) == 2  # short rows: 7 per batch
    assert [len(c) for c in policy_module.micro_batches(peft_model, 2, 100)] == [1, 1]


def test_long_rows_split_into_more_micro_batches_give_the_same_update(
    tiny_lora, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """A logit budget that splits the step into one row per micro-batch moves the LoRA as one
    micro-batch does: the losses divide by the step's counts, not a micro-batch's."""
    from essa.gradient import losses
    from essa.gradient import policy as policy_module
    from essa.gradient.update import policy_update

    peft_model, tokenizer = tiny_lora
    cfg = grpo_cfg(beta=0.04)
    variant = losses.VARIANTS["grpo"]
    prompts = ["12+7=", "5+93=", "1+1=", "40+2="]
    base = Policy.build(copy.deepcopy(peft_model), "lora", 1.0)
    batch = rollout(base, tokenizer, prompts, sampling(cfg), seed=5)
    advantages = torch.tensor([1.0, -0.5, 0.25, -0.75])
    mask = batch.mask.float()
    counts = losses.step_counts(mask, torch.tensor([0, 0, 1, 1]), cfg.generation.max_new_tokens)

    def updated(logits_budget: int) -> tuple[list[torch.Tensor], int]:
        monkeypatch.setattr(policy_module, "LOGITS_PER_MICRO_BATCH", logits_budget)
        policy = Policy.build(copy.deepcopy(peft_model), "lora", 1.0)
        optimizer = torch.optim.AdamW(policy.params, lr=1e-2)
        record = policy_update(
            cfg.grpo, variant, policy, optimizer, batch, advantages, mask, counts, 0
        )
        return [p.detach().clone() for p in policy.params], record["micro_batches"]

    whole, one = updated(2**40)
    split, four = updated(1)  # under one row's logits: a row per micro-batch
    assert (one, four) == (1, 4)
    moved = [not torch.equal(a, b.detach()) for a, b in zip(whole, base.params, strict=True)]
    assert any(moved)  # the step did something to compare
    for a, b in zip(whole, split, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
