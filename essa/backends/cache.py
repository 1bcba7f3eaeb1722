"""KV cache layouts that the fast decode path handles, and the operations it needs on them.

The row-dropping decode loop (``essa.backends.decode``) and the shared-prefix cache
(``essa.backends.generate``) work on a transformers ``DynamicCache`` whose layers are all
full-attention ``DynamicLayer`` or sliding-window ``DynamicSlidingWindowLayer``, in any mix:
Llama, Qwen2/3 and SmolLM2 (all full), Gemma 2/3 (sliding and full layers), Mistral with
``sliding_window`` set (all sliding), Qwen2/3 with ``use_sliding_window``. Row selection
(``batch_select_indices``) is per layer and keeps each layer's own bookkeeping.

A sliding-window layer keeps only the last ``window - 1`` columns, and transformers counts the
window in columns (padding included), not in token positions. Two consequences:

- a shared prefix copied into the cache must sit in the columns where a row encoded whole would
  have it, right after that row's left padding (:func:`place_prefix`); a gap of padding
  between the prefix and a row's own tokens would shift the window;
- cropping tokens off the end (teacher-forced references in the prefill) needs the columns the
  window already dropped: :func:`record_past` keeps them until :func:`rewind` crops.

Chunked attention (Llama 4), linear-attention or recurrent layers (hybrid models), KV sharing
(Gemma 3n) and encoder-decoder caches are not handled: :func:`fast_cache_layout` says so and
those models decode with HF ``generate``, every row encoded whole.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

# The attention kinds whose cache layers the fast path handles (transformers' `layer_types`).
HANDLED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def cache_argument(model: Any) -> str:
    """The forward/generate argument that takes the cache (transformers 5: ``cache``)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_windows(model: Any) -> list[int | None] | None:
    """Per layer of the model's ``DynamicCache``: None (full attention) or its sliding window.

    None when the layout is not one the fast path handles (see the module docstring), or when
    the installed transformers has no layered cache that can rewind a sliding window.
    """
    try:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
    except ImportError:
        return None
    if getattr(model.config, "is_encoder_decoder", False):
        return None
    supports_dynamic = getattr(model, "_supports_default_dynamic_cache", None)
    if supports_dynamic is not None and not supports_dynamic():  # generate builds its own cache
        return None
    text = model.config.get_text_config(decoder=True)
    if getattr(text, "attention_chunk_size", None) is not None:  # chunked: another mask
        return None
    if not set(getattr(text, "layer_types", None) or ()) <= HANDLED_LAYER_TYPES:
        return None
    windows: list[int | None] = []
    for layer in DynamicCache(config=model.config).layers:
        if type(layer) is DynamicLayer:
            windows.append(None)
        elif type(layer) is DynamicSlidingWindowLayer and hasattr(layer, "record_past"):
            windows.append(int(layer.sliding_window))
        else:
            return None
    return windows or None


def fast_cache_layout(model: Any) -> bool:
    """True when the model's cache is one :mod:`essa.backends.cache` handles."""
    return cache_windows(model) is not None


def has_plain_dynamic_cache(model: Any) -> bool:
    """True when the model generates with a DynamicCache of full-attention layers only."""
    windows = cache_windows(model)
    return windows is not None and all(w is None for w in windows)


def has_sliding_window(model: Any) -> bool:
    """True when a handled cache has at least one sliding-window layer."""
    windows = cache_windows(model)
    return windows is not None and any(w is not None for w in windows)


def model_cache(model: Any) -> Any:
    """An empty cache with the layers ``generate`` builds for ``model``."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def unwindowed_cache() -> Any:
    """An empty cache of full-attention layers only: nothing a window would drop is dropped.

    For a forward without past, the model computes the same outputs as with its own cache (a
    sliding layer returns every column of the current forward too); only what is kept differs.
    """
    from transformers import DynamicCache

    return DynamicCache()


def place_prefix(states: torch.Tensor, index: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """Per-row prefix states (B, H, L, D) laid out in the columns given by ``seen``.

    ``states`` (G, H, L, D) are the prefix's keys or values per candidate, ``index`` (B,) each
    row's candidate in ``states``, ``seen`` (B, L) the rows' attention mask over the prefix's
    columns. Row b's attended columns hold the prefix tokens 0, 1, ... in order; its unattended
    (left padding) columns hold zeros. All ones: the prefix as it is in every row.
    """
    rows = states.index_select(0, index.to(states.device))  # (B, H, L, D)
    seen = seen.to(states.device)
    source = (seen.cumsum(-1) - 1).clamp(min=0)  # (B, L): the prefix token in each column
    at = source[:, None, :, None].expand(-1, rows.shape[1], -1, rows.shape[3])
    placed = rows.gather(2, at)
    return placed.masked_fill(~seen.bool()[:, None, :, None], 0.0)


def record_past(cache: Any) -> None:
    """Make sliding-window layers keep what they would drop, until :func:`rewind` crops."""
    cache.activate_past_recording()


def rewind(cache: Any, tokens: int) -> None:
    """Drop the last ``tokens`` columns of every layer, after :func:`record_past`.

    Sliding-window layers go back to their last ``window - 1`` columns and stop recording, so
    they are as they would be had the dropped tokens never been run.
    """
    cache.crop(-tokens)  # crop(0) still trims a recording window layer to its window
    for layer in cache.layers:
        if hasattr(layer, "record_past"):
            layer.record_past = False  # as transformers' own generate resets it
