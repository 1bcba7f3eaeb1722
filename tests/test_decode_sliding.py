"""The fast decode path on sliding-window caches: the same tokens as HF generate.

Tiny random models of current families, built in-process with a window of 4 columns, so that
the window slides well inside every prompt and completion: Gemma 3 (sliding and full layers
mixed by ``layer_types``), Gemma 2 (alternating), Mistral (every layer sliding) and Qwen2 with
``use_sliding_window``. Random weights rarely say EOS, so each model also stops on the
character whose first appearance varies most between rows: rows end at different steps and
are dropped on the way. The Gemma models carry ``cache_implementation="hybrid"`` in their
generation config, as the hub's checkpoints do (``generate`` now reads it as the dynamic cache).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from essa.config import EvaluationConfig, GenerationConfig
from tests.conftest import build_char_tokenizer, svd_setup

WINDOW = 4
MAX_NEW = 10
QUESTIONS = ["12+3=", "7+45=", "1+1=", "99+99=", "5+60=", "3+3=", "48+51=", "0+7="]
FEW_SHOT = "1+2+3+4+5+6+"  # 12 shared tokens: more than MIN_PREFIX_TOKENS and than the window

# family: (model class, config class, config options, the cache's windows per layer)
FAMILIES: dict[str, tuple[str, str, dict[str, Any], list[int | None]]] = {
    "gemma3": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
        [WINDOW, None, WINDOW],
    ),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", {}, [WINDOW, None, WINDOW]),
    "mistral": ("MistralForCausalLM", "MistralConfig", {}, [WINDOW] * 3),
    "qwen2": (
        "Qwen2ForCausalLM",
        "Qwen2Config",
        {"use_sliding_window": True, "max_window_layers": 1},
        [None, WINDOW, WINDOW],
    ),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family's tiny model saved with its tokenizer (loads through load_model)."""
    return {name: _build(name, tmp_path_factory.mktemp(name)) for name in FAMILIES}


@pytest.fixture(scope="module")
def populations(model_dirs: dict[str, Path]) -> Callable[[str], tuple[Any, Any, Any]]:
    """family -> (base model, tokenizer, SVDAdapter of a random rank-4 LoRA), built once."""
    built: dict[str, tuple[Any, Any, Any]] = {}

    def get(family: str) -> tuple[Any, Any, Any]:
        if family not in built:
            built[family] = svd_setup(model_dirs[family])
        return built[family]

    return get


def _build(family: str, directory: Path) -> Path:
    import transformers

    from essa.backends.generate import _generate_kwargs, pad_rows

    model_class, config_class, options, _ = FAMILIES[family]
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=WINDOW,
        max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=1, **options,
    )  # fmt: skip
    model = getattr(transformers, model_class)(config).eval()
    kwargs = _generate_kwargs(GenerationConfig(max_new_tokens=MAX_NEW), tokenizer, [1])
    greedy = []  # (B, MAX_NEW) on the questions alone and after the shared prefix
    for prompts in (QUESTIONS, [FEW_SHOT + q for q in QUESTIONS]):
        encoded = tokenizer(prompts, add_special_tokens=False)["input_ids"]
        ids, mask = pad_rows(encoded, 0, 0, torch.device("cpu"))
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        greedy.append(out[:, ids.shape[1] :])
    model.generation_config.eos_token_id = [1, _varied_stop(greedy, tokenizer)]
    if family.startswith("gemma"):  # as the hub's Gemma 2/3 checkpoints ship it
        model.generation_config.cache_implementation = "hybrid"
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _varied_stop(completions: list[torch.Tensor], tokenizer: Any) -> int:
    """The character token whose first appearance varies most between the rows of each (B, T)."""

    def spread(token: int, rows: torch.Tensor) -> int:
        firsts = {
            int(hits[0]) if len(hits) else rows.shape[1]
            for hits in ((row == token).nonzero().squeeze(1) for row in rows)
        }
        return len(firsts)

    chars = [tokenizer.convert_tokens_to_ids(c) for c in "0123456789+-*="]
    return max(chars, key=lambda token: min(spread(token, rows) for rows in completions))


def _load(model_dirs: dict[str, Path], family: str) -> tuple[Any, Any]:
    from essa.backends.models import load_model
    from essa.config import ModelConfig

    return load_model(ModelConfig(name_or_path=str(model_dirs[family])))


def _spy_drops(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many rows each compaction of the decode loop drops."""
    from essa.backends import decode

    drops: list[int] = []
    keep = decode._Running.keep

    def spy(self, kept, cache):  # type: ignore[no-untyped-def]
        drops.append(len(self.origin) - len(kept))
        keep(self, kept, cache)

    monkeypatch.setattr(decode._Running, "keep", spy)
    return drops


@pytest.mark.parametrize("family", FAMILIES)
def test_sliding_window_caches_take_the_fast_path(model_dirs: dict[str, Path], family: str) -> None:
    from essa.backends.cache import cache_windows, has_plain_dynamic_cache
    from essa.backends.decode import supports_row_dropping

    model, _ = _load(model_dirs, family)
    assert cache_windows(model) == FAMILIES[family][3]
    assert supports_row_dropping(model)
    assert not has_plain_dynamic_cache(model)


@pytest.mark.parametrize(
    ("config_class", "why"),
    [("Llama4TextConfig", "chunked attention"), ("Qwen3NextConfig", "linear attention")],
)
def test_other_layouts_fall_back(config_class: str, why: str) -> None:
    import transformers

    from essa.backends.cache import cache_windows, fast_cache_layout

    config = getattr(transformers, config_class)(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    model = SimpleNamespace(config=config)
    assert cache_windows(model) is None, why
    assert not fast_cache_layout(model)


@pytest.mark.parametrize("shared_prefix", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_decode_rows_matches_generate(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, family: str, shared_prefix: bool
) -> None:
    """Token ids equal generate's on whole left-padded rows, with rows dropped on the way; with
    a shared prefix, its cache is run once and placed after each row's left padding."""
    from essa.backends.decode import decode_rows
    from essa.backends.generate import (
        MIN_PREFIX_TOKENS,
        _generate_kwargs,
        pad_rows,
        prefix_states,
        shared_prefix_length,
    )
    from essa.backends.stops import stop_token_ids

    model, tokenizer = _load(model_dirs, family)
    prompts = [FEW_SHOT + q for q in QUESTIONS] if shared_prefix else QUESTIONS
    encoded = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    ids, mask = pad_rows(encoded, 0, tokenizer.pad_token_id, torch.device("cpu"))  # (B, T)
    stops = stop_token_ids(tokenizer, model.generation_config)
    kwargs = _generate_kwargs(GenerationConfig(max_new_tokens=MAX_NEW), tokenizer, stops)
    with torch.no_grad():
        expected = model.generate(input_ids=ids, attention_mask=mask, **kwargs)[:, ids.shape[1] :]
    cache = None
    if shared_prefix:
        length = shared_prefix_length(encoded)
        assert length >= MIN_PREFIX_TOKENS and length > WINDOW
        rows = torch.zeros(len(prompts), dtype=torch.long)
        cache = prefix_states(model, encoded[0][:length], rows, 3, None).expand(model, rows, mask)
    drops = _spy_drops(monkeypatch)
    got = decode_rows(model, ids, mask, kwargs, cache=cache)
    assert torch.equal(got, expected)
    assert drops, "rows should end at different steps"
    assert len({int((row != tokenizer.pad_token_id).sum()) for row in expected}) >= 3


def _completions(setup, monkeypatch, strategy, *, fast: bool, prefix: bool):  # type: ignore[no-untyped-def]
    """completions[candidate][prompt], rows dropped, prefix passes; ``fast=False`` is generate."""
    from essa.backends import generate as hf
    from essa.backends.evaluator import PopulationEvaluator

    base, tokenizer, adapter = setup
    population = np.random.default_rng(0).normal(size=(4, adapter.dim)) * adapter.stds() * 2.0
    with monkeypatch.context() as patch:
        drops = _spy_drops(patch)
        passes: list[int] = []
        original = hf.prefix_states

        def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
            passes.append(len(args[1]))
            return original(*args, **kwargs)

        patch.setattr(hf, "prefix_states", spy)
        if not fast:
            patch.setattr(hf, "supports_row_dropping", lambda model: False)
        cfg = EvaluationConfig(strategy=strategy, micro_batch_size=5, use_prefix_cache=prefix)
        gen = GenerationConfig(max_new_tokens=MAX_NEW)
        evaluator = PopulationEvaluator(base, tokenizer, adapter, gen, cfg)
        out = evaluator.completions(population, [FEW_SHOT + q for q in QUESTIONS])
    return out, drops, passes


@pytest.mark.parametrize("strategy", ["batched", "merged"])
@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_population_completions_match_generate(
    populations: Callable[[str], Any], monkeypatch: pytest.MonkeyPatch, family: str, strategy: str
) -> None:
    """Candidates (an adapter per row, or merged one at a time) through the evaluator: the
    row-dropping loop with the shared-prefix cache, and generate with that cache, give the
    completions of generate on whole rows."""
    setup = populations(family)
    fast, drops, passes = _completions(setup, monkeypatch, strategy, fast=True, prefix=True)
    cached, _, _ = _completions(setup, monkeypatch, strategy, fast=False, prefix=True)
    whole, none, no_passes = _completions(setup, monkeypatch, strategy, fast=False, prefix=False)
    assert fast == whole and cached == whole
    assert drops and not none
    assert passes and set(passes) == {len(FEW_SHOT)} and not no_passes
    assert len({tuple(c) for c in whole}) > 1, "candidates should differ"


def test_references_in_the_prefill_with_sliding_windows(
    populations: Callable[[str], Any],
) -> None:
    """References forced in the prefill run past the window, then leave the cache: the
    completions are those of a call without them, the log-probs those of a separate pass."""
    from essa.backends.decode import supports_row_dropping
    from essa.backends.evaluator import PopulationEvaluator

    base, tokenizer, adapter = populations("gemma3")
    assert supports_row_dropping(base)
    population = np.random.default_rng(3).normal(size=(3, adapter.dim)) * adapter.stds()
    prompts = [FEW_SHOT + q for q in ("12+3=", "7+7=", "1+1=", "40+2=")]
    refs = ["15", "14+0+0+0", None, "42"]  # longer than the window; a missing one scores nothing
    cfg = EvaluationConfig(strategy="batched", micro_batch_size=5, use_prefix_cache=True)
    gen = GenerationConfig(max_new_tokens=MAX_NEW)
    evaluator = PopulationEvaluator(base, tokenizer, adapter, gen, cfg)
    plain = evaluator.completions(population, prompts)
    forced = evaluator.completions(population, prompts, references=refs)
    assert forced == plain
    got = evaluator.last_reference_logprobs
    want = evaluator.reference_logprobs(population, prompts, [r or "" for r in refs])
    assert [len(x) for x in got[0]] == [2, 8, 0, 2]
    for g_c, w_c in zip(got, want, strict=True):
        for g, w in zip(g_c, w_c, strict=True):
            assert g == pytest.approx(w, abs=2e-5)
