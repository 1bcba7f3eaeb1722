"""Gradient LISA: the layer schedule, which parameters get gradients, bounded optimizer state."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from essa.gradient.lisa import (
    LisaOptimizer,
    decoder_layers,
    grad_bytes,
    optimizer_state_bytes,
    persistent_params,
)
from essa.optimizers.layerwise import active_layers

NUM_LAYERS = 6


def tiny_qwen2(tied: bool = True) -> torch.nn.Module:
    """A random 6-layer Qwen2 (hidden 32): enough blocks for gamma=2 to mean something."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
    )
    return Qwen2ForCausalLM(config)


def train_step(model: torch.nn.Module, lisa: LisaOptimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 40, (2, 10), generator=generator)  # (B, T)
    lisa.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()


# schedule ----------------------------------------------------------------------------------


def test_schedule_is_a_pure_function_of_seed_and_interval() -> None:
    first = [active_layers(7, t, 24, 4) for t in range(50)]
    assert first == [active_layers(7, t, 24, 4) for t in range(50)]
    assert all(len(set(c)) == 4 and list(c) == sorted(c) for c in first)
    assert all(0 <= i < 24 for c in first for i in c)
    assert len(set(first)) > 40, "the choice must change between intervals"
    assert first != [active_layers(8, t, 24, 4) for t in range(50)], "the seed must matter"


def test_schedule_uniform_by_default_and_weights_respected() -> None:
    counts = [0] * 6
    for t in range(3000):
        for i in active_layers(0, t, 6, 2):
            counts[i] += 1
    assert all(abs(c / 3000 - 2 / 6) < 0.04 for c in counts), counts
    weights = [0.0, 1.0, 1.0, 0.0, 5.0, 0.0]
    chosen = {i for t in range(200) for i in active_layers(0, t, 6, 2, weights)}
    assert chosen == {1, 2, 4}
    with pytest.raises(ValueError, match="gamma"):
        active_layers(0, 0, 6, 7)
    with pytest.raises(ValueError, match="positive weight"):
        active_layers(0, 0, 6, 2, [1, 0, 0, 0, 0, 0])


def test_schedule_imports_without_torch() -> None:
    code = "import sys, essa.optimizers.layerwise; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# parameter groups --------------------------------------------------------------------------


def test_tied_embedding_counted_once_and_head_flags() -> None:
    model = tiny_qwen2(tied=True)
    layers = decoder_layers(model)
    assert len(layers) == NUM_LAYERS
    both = persistent_params(model, layers, train_embeddings=True, train_head=True)
    embed = model.get_input_embeddings().weight
    assert sum(p is embed for p in both) == 1
    assert len({id(p) for p in both}) == len(both)
    untied = tiny_qwen2(tied=False)
    no_head = persistent_params(
        untied, decoder_layers(untied), train_embeddings=True, train_head=False
    )
    assert not any(p is untied.lm_head.weight for p in no_head)
    assert any(p is untied.get_input_embeddings().weight for p in no_head)


def test_exactly_the_sampled_layers_receive_gradients_and_change() -> None:
    model = tiny_qwen2()
    lisa = LisaOptimizer(model, active_layers=2, interval=3, seed=5, lr=1e-2)
    persistent = {id(p) for p in lisa.persistent}
    seen = set()
    for step in range(12):
        interval = step // 3
        assert lisa.active == active_layers(5, interval, NUM_LAYERS, 2)
        seen.add(lisa.active)
        train_step(model, lisa, step)
        before = {id(p): p.detach().clone() for p in model.parameters()}
        for i, layer in enumerate(lisa.layers):
            for p in layer.parameters():
                has_grad = p.grad is not None
                assert has_grad == (i in lisa.active), (step, i)
        assert all(p.grad is not None for p in lisa.persistent)
        active_ids = persistent | {id(p) for i in lisa.active for p in lisa.layers[i].parameters()}
        lisa.step()
        for p in model.parameters():
            changed = not torch.equal(before[id(p)], p.detach())
            if id(p) not in active_ids:
                assert not changed, "a frozen parameter moved"
        moved = [not torch.equal(before[id(p)], p.detach()) for p in lisa.layers[0].parameters()]
        assert any(moved) == (0 in active_layers(5, interval, NUM_LAYERS, 2))
    assert len(seen) > 1


# memory ------------------------------------------------------------------------------------


def adamw_bytes(params: list[torch.nn.Parameter]) -> int:
    """AdamW state of ``params``: exp_avg + exp_avg_sq (param-sized) + a float32 step each."""
    return sum(2 * p.numel() * p.element_size() + 4 for p in params)


def test_optimizer_state_bounded_and_flat_across_ten_switches() -> None:
    model = tiny_qwen2()
    lisa = LisaOptimizer(model, active_layers=2, interval=2, seed=1, lr=1e-3)
    layer_params = [list(layer.parameters()) for layer in lisa.layers]
    bound = adamw_bytes(lisa.persistent) + 2 * max(adamw_bytes(ps) for ps in layer_params)
    peaks, grad_sizes, switches = [], [], 0
    for step in range(20):  # interval 2: a switch after every second step, 10 in all
        active = lisa.active
        train_step(model, lisa, step)
        grad_sizes.append(grad_bytes(model))
        lisa.step()
        switches += lisa.active != active or step % 2 == 1
        state = optimizer_state_bytes(lisa.optimizer)
        assert state <= bound
        assert {id(p) for p in lisa.optimizer.state} <= {id(p) for p in lisa.trainable()}
        if step % 2 == 0:  # mid-interval: E+H and both active layers hold state
            peaks.append(state)
    assert switches == 10
    assert peaks == [bound] * 10, "optimizer state must stay at E+H + gamma layers"
    assert len(set(grad_sizes)) == 1, f"gradient memory must stay flat: {grad_sizes}"
    assert bound < adamw_bytes(list(model.parameters()))


def test_toggling_requires_grad_alone_creeps() -> None:
    """The reference's bug, reproduced: without state dropping AdamW state grows to full size.

    Shows that the bound above is a real constraint, not one any implementation meets.
    """
    model = tiny_qwen2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    layers = decoder_layers(model)
    sizes = []
    for step in range(11):
        for i, layer in enumerate(layers):
            layer.requires_grad_(i in active_layers(1, step, NUM_LAYERS, 2))
        optimizer.zero_grad(set_to_none=True)
        ids = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(step))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        sizes.append(optimizer_state_bytes(optimizer))
    assert sizes[-1] > sizes[0]


# end to end --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("trainable", ["lisa", "full"])
def test_essa_sft_trains_base_weights(tmp_path: Path, tiny_model_dir: Path, trainable: str) -> None:
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from essa.cli import app

    run_dir = tmp_path / "run"
    sets = [
        f"model.name_or_path={tiny_model_dir}",
        f"sft.trainable={trainable}",
        "sft.steps=3",
        "sft.batch_size=4",
        "sft.lisa.active_layers=1",
        "sft.lisa.interval=2",
        "data.sft_size=8",
        "data.test_size=4",
    ]
    args = [arg for item in sets for arg in ("--set", item)]
    res = CliRunner().invoke(app, ["sft", "--run-dir", str(run_dir), *args])
    assert res.exit_code == 0, res.output
    assert "SFT model:" in res.stdout
    before = load_file(str(tiny_model_dir / "model.safetensors"))
    after = load_file(str(run_dir / "sft_model" / "model.safetensors"))
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    layers_changed = {int(k.split(".")[2]) for k in changed if k.startswith("model.layers.")}
    assert "model.embed_tokens.weight" in changed
    if trainable == "full":
        assert layers_changed == {0, 1}
    else:  # 3 steps, interval 2: intervals 0 and 1, one layer each
        assert layers_changed == set(active_layers(0, 0, 2, 1) + active_layers(0, 1, 2, 1))


def test_train_refuses_non_lora_sft_in_one_line(tmp_path: Path, tiny_model_dir: Path) -> None:
    from typer.testing import CliRunner

    from essa.cli import app

    args = ["train", "--run-dir", str(tmp_path / "r"), "--set", "sft.trainable=lisa"]
    args += ["--set", f"model.name_or_path={tiny_model_dir}", "--set", "data.test_size=4"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2
    assert res.stderr.startswith("error: sft.trainable: lisa") and res.stderr.count("\n") == 1


@pytest.mark.slow
def test_grpo_lisa_trains_base_weights_and_resumes_exactly(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    from safetensors.torch import load_file

    from essa.config import load_config
    from essa.recipes import grpo

    def config(generations: int):  # noqa: ANN202
        return load_config(
            None,
            [
                "algorithm=grpo",
                f"model.name_or_path={tiny_model_dir}",
                "grpo.trainable=lisa",
                "grpo.lisa.active_layers=1",
                "grpo.lisa.interval=1",
                "grpo.prompts_per_step=2",
                "grpo.group_size=2",
                "grpo.lr=0.01",
                "grpo.lr_schedule=constant",  # the schedule depends on run.generations
                "reward.name=length",  # graded by length too: a random model's groups differ
                "reward.params={max_length: 8, unit: chars}",
                "sft.steps=2",
                "sft.batch_size=4",
                "data.sft_size=8",
                "data.test_size=4",
                "evaluation.every=0",
                "run.show_progress=false",
                f"run.generations={generations}",
                "generation.max_new_tokens=8",  # the tiny model is not builtin:demo
            ],
        )

    ref, split = tmp_path / "ref", tmp_path / "split"
    for run_dir in (ref, split):
        run_dir.mkdir()
    summary = grpo.run(config(3), ref)
    assert summary["generations"] == 3
    grpo.run(config(2), split)
    (split / "summary.json").unlink()
    grpo.run(config(3), split, resume=True)
    a = load_file(str(ref / "adapter" / "model.safetensors"))
    b = load_file(str(split / "adapter" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    assert not torch.equal(a["model.embed_tokens.weight"], base["model.embed_tokens.weight"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("sft.lisa.active_layers=0", "sft.lisa.active_layers: must be >= 1, got 0"),
        ("grpo.lisa.interval=0", "grpo.lisa.interval: must be >= 1, got 0"),
        ("optimizer.layerwise.active_layers=0", "optimizer.layerwise.active_layers: must be >= 1"),
        ("sft.trainable=half", "sft.trainable: expected one of 'lora' | 'full' | 'lisa'"),
        ("optimizer.layerwise.gamma=2", "optimizer.layerwise.gamma: unknown key"),
    ],
)
def test_lisa_config_errors_name_the_key(override: str, message: str) -> None:
    from essa.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_lisa_config_defaults_keep_plain_behaviour() -> None:
    from essa.config import load_config

    cfg = load_config(None)
    assert cfg.sft.trainable == "lora" and cfg.grpo.trainable == "lora"
    assert cfg.optimizer.layerwise.active_layers is None  # plain ESSA over every layer
    assert (cfg.sft.lisa.active_layers, cfg.sft.lisa.interval) == (2, 20)  # LMFlow's defaults
