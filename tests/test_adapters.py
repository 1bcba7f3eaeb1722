"""essa.adapters on a tiny in-process Qwen2 with a random (non-zero B) PEFT LoRA on q/k/v/o."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from essa.adapters import (
    PopulationLoRA,
    SVDAdapter,
    candidate_rows,
    export_peft,
    merged_candidate,
)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
RANK = 4
LORA_ALPHA = 8
PAD = 0
TOL = 1e-5


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """(base, peft_model): the base stays bare; the PEFT model wraps a deep copy of it."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=PAD,
        eos_token_id=1,
        bos_token_id=2,
    )
    base = Qwen2ForCausalLM(config).eval()
    lora = LoraConfig(r=RANK, lora_alpha=LORA_ALPHA, target_modules=TARGETS, lora_dropout=0.0)
    peft_model = get_peft_model(copy.deepcopy(base), lora).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            # PEFT initialises B = 0; a trained adapter has non-zero B.
            if "lora_B" in name:
                parameter.copy_(0.2 * torch.randn(parameter.shape, generator=generator))
    return base, peft_model


@pytest.fixture(scope="module")
def adapter(models: tuple[torch.nn.Module, torch.nn.Module]) -> SVDAdapter:
    return SVDAdapter.from_peft_model(models[1], alpha=1.0)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two left-padded prompts: (input_ids (2, 7), attention_mask (2, 7))."""
    ids = torch.tensor([[PAD, PAD, 5, 17, 33, 9, 41], [11, 23, 7, 64, 3, 99, 12]])
    return ids, (ids != PAD).long()


def _population(adapter: SVDAdapter, size: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(size, adapter.dim)) * 0.3 * adapter.stds()  # (P, D)


@torch.no_grad()
def _logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=mask).logits  # (B, T, V)


@torch.no_grad()
def _greedy(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD
    )
    return out[:, ids.shape[1] :]  # (B, 8)


def test_zero_vector_reproduces_peft(models, adapter) -> None:
    base, peft_model = models
    ids, mask = _batch()
    expected = _logits(peft_model, ids, mask)
    with PopulationLoRA(base, adapter) as pop:
        pop.set_population(np.zeros((1, adapter.dim)))
        pop.set_rows([0, 0])
        batched = _logits(base, ids, mask)
    with merged_candidate(base, adapter, np.zeros(adapter.dim)):
        merged = _logits(base, ids, mask)
    assert (batched - expected).abs().max() <= TOL
    assert (merged - expected).abs().max() <= TOL
    # Bare base differs: the LoRA is not a no-op, so the comparison above means something.
    assert (_logits(base, ids, mask) - expected).abs().max() > 1e-3


def test_factors_of_zero_vector_are_sft_weights(models, adapter) -> None:
    peft_model = models[1]
    factors = adapter.factors(np.zeros(adapter.dim))
    for name, (a, b) in factors.items():
        layer = peft_model.base_model.model.get_submodule(name)
        torch.testing.assert_close(a, layer.lora_A["default"].weight, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(b, layer.lora_B["default"].weight, atol=1e-6, rtol=1e-5)
        assert adapter.module(name).gamma == LORA_ALPHA / RANK


def _documented_layout(peft_model: torch.nn.Module, k: int) -> list[tuple[str, int, int]]:
    """(module, factor 0 = A / 1 = B, singular index) of each search coordinate, as the docs
    state the layout: layer -> q, k, v, o -> A then B -> the top k values, largest first."""
    names = [
        name.removeprefix("base_model.model.")
        for name, module in peft_model.named_modules()
        if hasattr(module, "lora_A") and name.rsplit(".", 1)[-1] in TARGETS
    ]
    names.sort(key=lambda n: (int(n.split(".")[2]), TARGETS.index(n.rsplit(".", 1)[-1])))
    return [(name, factor, j) for name in names for factor in (0, 1) for j in range(k)]


def _moved(weight: torch.Tensor, j: int, delta: float) -> torch.Tensor:
    """``weight`` with its j-th singular value moved by ``delta``, from the test's own SVD."""
    u, s, vh = torch.linalg.svd(weight.double(), full_matrices=False)
    s = s.clone()
    s[j] += delta
    return (u * s) @ vh


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_offset_i_moves_only_the_ith_singular_value_of_its_factor(models, alpha: float) -> None:
    """Checked against the SFT LoRA's own weights and the documented layout, for every
    coordinate i of the search vector: the factors rebuilt from delta * e_i (svd.py's A', B')
    have exactly one singular value moved (torch.linalg.svdvals), the intended one, by delta;
    and the update population.py's forward adds for that candidate is gamma B' A' with that
    one value moved (a permuted or misrouted scaling changes it, though not its svdvals)."""
    base, peft_model = models
    adapter = SVDAdapter.from_peft_model(peft_model, alpha=alpha)
    layers = dict(peft_model.base_model.model.named_modules())
    sft = {  # name -> (A, B) of the trained LoRA
        name: tuple(getattr(layers[name], f"lora_{f}")["default"].weight.detach() for f in "AB")
        for name in adapter.module_names
    }
    values = {name: tuple(torch.linalg.svdvals(w.double()) for w in sft[name]) for name in sft}
    layout = _documented_layout(peft_model, int(RANK * alpha))
    assert len(layout) == adapter.dim
    offsets = np.zeros((adapter.dim, adapter.dim))  # candidate i = delta_i * e_i
    for i, (name, factor, j) in enumerate(layout):
        s = values[name][factor]
        offsets[i, i] = 0.4 * float(s[j - 1] - s[j] if j else s[0])  # keeps the order
    eye = torch.eye(base.config.hidden_size)[:, None, :]  # (n, 1, n): one basis input per row
    with PopulationLoRA(base, adapter) as pop, torch.no_grad():
        pop.set_population(offsets)
        wrapped = {name: base.get_submodule(name) for name in adapter.module_names}
        for i, (name, factor, j) in enumerate(layout):
            delta = float(offsets[i, i])
            rebuilt = adapter.factors(offsets[i])
            pop.set_rows(torch.full((len(eye),), i))
            for other in adapter.module_names:
                moved = [
                    _moved(w, j, delta) if (other, f) == (name, factor) else w.double()
                    for f, w in enumerate(sft[other])
                ]
                for f in (0, 1):
                    want = torch.linalg.svdvals(moved[f])
                    got = torch.linalg.svdvals(rebuilt[other][f].double())
                    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
                layer = wrapped[other]
                update = (layer(eye) - layer.base(eye))[:, 0].T.double()  # (m, n) = gamma B'A'
                want = adapter.module(other).gamma * moved[1] @ moved[0]
                torch.testing.assert_close(update, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("alpha", "k"), [(1.0, 4), (0.5, 2), (0.25, 1), (0.3, 1)])
def test_layout_dim_and_k(models, alpha: float, k: int) -> None:
    adapter = SVDAdapter.from_peft_model(models[1], alpha=alpha)
    assert adapter.dim == 2 * len(TARGETS) * 2 * k  # layers * modules * factors * k
    assert all(module.k == k for module in adapter.modules)
    stds = adapter.stds()
    assert stds.shape == (adapter.dim,) and stds.dtype == np.float64
    first = adapter.modules[0]
    np.testing.assert_array_equal(stds[:k], first.s_a[:k].numpy())
    np.testing.assert_array_equal(stds[k : 2 * k], first.s_b[:k].numpy())
    assert np.all(np.diff(first.s_a.numpy()) <= 0)  # descending


def test_alpha_selecting_nothing_raises(models) -> None:
    with pytest.raises(ValueError, match="selects zero singular values"):
        SVDAdapter.from_peft_model(models[1], alpha=0.2)


def test_manifest_slices_are_contiguous_in_layout_order(models) -> None:
    adapter = SVDAdapter.from_peft_model(models[1], alpha=0.5)
    manifest = json.loads(json.dumps(adapter.manifest()))
    names = [entry["name"] for entry in manifest["modules"]]
    assert names == [f"model.layers.{i}.self_attn.{t}" for i in range(2) for t in TARGETS]
    cursor = 0
    for entry in manifest["modules"]:
        for key in ("slice_a", "slice_b"):  # A before B
            start, stop = entry[key]
            assert start == cursor and stop - start == entry["k"]
            cursor = stop
    assert cursor == manifest["dim"] == adapter.dim


def test_from_lora_state_orders_like_the_model(models, adapter) -> None:
    """A name-sorted state dict (as loaded from safetensors) gives the same layout."""
    peft_model = models[1]
    names = sorted(adapter.module_names)  # alphabetical: k, o, q, v
    layers = {n: peft_model.base_model.model.get_submodule(n) for n in names}
    rebuilt = SVDAdapter.from_lora_state(
        {n: layers[n].lora_A["default"].weight for n in names},
        {n: layers[n].lora_B["default"].weight for n in names},
        LORA_ALPHA / RANK,
        alpha=1.0,
    )
    assert rebuilt.module_names == adapter.module_names
    np.testing.assert_array_equal(rebuilt.stds(), adapter.stds())


def test_population_forward_matches_merged(models, adapter) -> None:
    base = models[0]
    ids, mask = _batch()
    population = _population(adapter, 3, seed=2)  # (3, D)
    merged_logits, merged_tokens = [], []
    for vector in population:
        with merged_candidate(base, adapter, vector):
            merged_logits.append(_logits(base, ids, mask))
            merged_tokens.append(_greedy(base, ids, mask))
    rows = candidate_rows(3, ids.shape[0])  # (6,) candidate-major
    ids_rep, mask_rep = ids.repeat(3, 1), mask.repeat(3, 1)  # (6, T)
    with PopulationLoRA(base, adapter) as pop:
        pop.set_population(population)
        pop.set_rows(rows)
        batched_logits = _logits(base, ids_rep, mask_rep)
        batched_tokens = _greedy(base, ids_rep, mask_rep)
    assert (batched_logits - torch.cat(merged_logits)).abs().max() <= TOL
    assert torch.equal(batched_tokens, torch.cat(merged_tokens))
    # Candidates really differ, so the row mapping is exercised.
    assert (merged_logits[0] - merged_logits[1]).abs().max() > 1e-3


def test_rows_map_in_any_order(models, adapter) -> None:
    base = models[0]
    ids, mask = _batch()
    population = _population(adapter, 3, seed=3)
    with PopulationLoRA(base, adapter) as pop:
        pop.set_population(population)
        pop.set_rows([2, 0])
        mixed = _logits(base, ids, mask)
        pop.set_rows([2, 2])
        first = _logits(base, ids, mask)
        pop.set_rows([0, 0])
        second = _logits(base, ids, mask)
        with pytest.raises(RuntimeError, match="set_rows"):
            _logits(base, ids[:1], mask[:1])
    assert (mixed[0] - first[0]).abs().max() <= TOL
    assert (mixed[1] - second[1]).abs().max() <= TOL


def test_population_unwrap_restores_modules(models, adapter) -> None:
    base = models[0]
    before = {name: type(module) for name, module in base.named_modules()}
    pop = PopulationLoRA(base, adapter)
    assert type(base.get_submodule(adapter.module_names[0])).__name__ == "PopulationLinear"
    pop.close()
    pop.close()
    assert {name: type(module) for name, module in base.named_modules()} == before


def test_merged_restore_is_bit_exact(models, adapter) -> None:
    base = models[0]
    before = {k: v.clone() for k, v in base.state_dict().items()}
    vector = _population(adapter, 1, seed=4)[0]
    with merged_candidate(base, adapter, vector):
        changed = base.get_submodule(adapter.module_names[0]).weight
        assert not torch.equal(changed, before[adapter.module_names[0] + ".weight"])
    after = base.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_merged_restores_on_error(models, adapter) -> None:
    base = models[0]
    before = {k: v.clone() for k, v in base.state_dict().items()}
    with pytest.raises(KeyError), merged_candidate(base, adapter, np.ones(adapter.dim)):
        raise KeyError("boom")
    assert all(torch.equal(base.state_dict()[k], v) for k, v in before.items())


def test_export_roundtrips_through_peft(models, adapter, tmp_path: Path) -> None:
    from peft import PeftModel

    base = models[0]
    ids, mask = _batch()
    population = _population(adapter, 2, seed=5)
    out_dir = tmp_path / "adapter"
    out_dir.mkdir()
    (out_dir / "stale.txt").write_text("replaced atomically")
    assert export_peft(adapter, population[1], out_dir, base_model_name_or_path=None) == out_dir
    assert sorted(p.name for p in out_dir.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "essa_manifest.json",
    ]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    manifest = json.loads((out_dir / "essa_manifest.json").read_text())
    np.testing.assert_array_equal(np.asarray(manifest["vector"]), population[1])

    with PopulationLoRA(base, adapter) as pop:
        pop.set_population(population)
        pop.set_rows([1, 1])
        ours = _logits(base, ids, mask)
    loaded = PeftModel.from_pretrained(copy.deepcopy(base), str(out_dir)).eval()
    assert (_logits(loaded, ids, mask) - ours).abs().max() <= TOL


def test_export_keeps_per_module_gamma(models, adapter, tmp_path: Path) -> None:
    """A module whose gamma differs is exported through PEFT's alpha_pattern."""
    from peft import PeftModel

    base, peft_model = models
    names = adapter.module_names
    layers = {n: peft_model.base_model.model.get_submodule(n) for n in names}
    scaling = {n: 3.0 if n == names[1] else LORA_ALPHA / RANK for n in names}
    odd = SVDAdapter.from_lora_state(
        {n: layers[n].lora_A["default"].weight for n in names},
        {n: layers[n].lora_B["default"].weight for n in names},
        scaling,
        alpha=0.5,
    )
    ids, mask = _batch()
    vector = _population(odd, 1, seed=6)[0]
    odd.export_peft(vector, tmp_path / "odd")
    with PopulationLoRA(base, odd) as pop:
        pop.set_population(vector[None])
        pop.set_rows([0, 0])
        ours = _logits(base, ids, mask)
    loaded = PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "odd")).eval()
    assert (_logits(loaded, ids, mask) - ours).abs().max() <= TOL


def test_row_map_is_dropped_when_the_population_shrinks(models, adapter) -> None:
    base, _ = models
    with PopulationLoRA(base, adapter) as pop:
        pop.set_population(_population(adapter, 4, 0))
        pop.set_rows([3, 0])
        pop.set_population(_population(adapter, 2, 1))  # candidate 3 is gone: the map resets
        assert pop.num_candidates == 2
        pop.set_rows([1, 0])
        pop.set_population(_population(adapter, 3, 2))  # the map [1, 0] still fits: kept
        layer = next(iter(pop._layers.values()))
        assert layer.weight is layer.base.weight  # HF code reading proj.weight sees the base


def test_modules_without_a_layer_index_come_first() -> None:
    gen = torch.Generator().manual_seed(0)
    names = ["model.layers.0.self_attn.q_proj", "lm_head", "model.layers.1.self_attn.q_proj"]
    lora_a = {n: torch.randn(2, 8, generator=gen) for n in names}
    lora_b = {n: torch.randn(8, 2, generator=gen) for n in names}
    adapter = SVDAdapter.from_lora_state(lora_a, lora_b, 1.0, alpha=1.0)
    assert adapter.module_names == ["lm_head", names[0], names[2]]  # no layer sorts as -1
