"""Which token ids end a completion: the tokenizer's EOS and the model's own stop list.

Chat models stop on an end-of-turn token that is often not the tokenizer's ``eos_token``
(Llama-3's ``<|eot_id|>``, Qwen's ``<|im_end|>`` next to ``<|endoftext|>``); the model's
``generation_config.eos_token_id`` (an int or a list) names them. Passing only the tokenizer's
EOS to ``generate`` replaces that list, and every row then runs to ``max_new_tokens``. Both
backends stop on the union. Imports nothing heavy.
"""

from __future__ import annotations

from typing import Any


def stop_token_ids(tokenizer: Any, generation_config: Any | None) -> list[int]:
    """The tokenizer's EOS first, then the generation config's EOS ids not already listed.

    >>> from types import SimpleNamespace as NS
    >>> stop_token_ids(NS(eos_token_id=2), NS(eos_token_id=[7, 2]))
    [2, 7]
    >>> stop_token_ids(NS(eos_token_id=None), None)
    []
    """
    ids: list[int] = []
    for source in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(generation_config, "eos_token_id", None),
    ):
        if source is None:
            continue
        for token in [source] if isinstance(source, int) else source:
            if int(token) not in ids:
                ids.append(int(token))
    return ids
