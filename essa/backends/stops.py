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


class ToolCallStop:
    """Ends a row when its text since the turn began closes a code block (essa.tools.turns).

    Checked after every decode step on the running rows; only rows whose newest token can hold
    the block's last character (``closing``, from the vocabulary once) are decoded and tested,
    so a step costs a tensor lookup for the rest. Also usable as a ``generate`` stopping
    criterion (:meth:`__call__`). Needs the rows' tokens on the host (a sync per step on GPUs).
    """

    def __init__(self, tokenizer: Any, cfg: Any, width: int = 0) -> None:
        import torch

        from essa.tools.turns import closing_tokens

        closing = closing_tokens(tokenizer, cfg.code_end[-1])
        self.closing = torch.tensor(closing, dtype=torch.bool)  # (V,)
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.width = width  # prompt columns before the turn's first token (``generate``)

    def ended(self, generated: Any, running: Any) -> Any:
        """(b,) bool: the rows of ``generated`` (b, t) new tokens, among ``running`` (b,), whose
        text closes a code block at the last token."""
        import torch

        from essa.tools.turns import block_end

        out = torch.zeros(generated.shape[0], dtype=torch.bool)
        if generated.shape[1] == 0:
            return out.to(generated.device)
        last = generated[:, -1].cpu()
        inside = last < len(self.closing)
        candidates = running.cpu() & inside & self.closing[last.clamp(max=len(self.closing) - 1)]
        for i in candidates.nonzero().flatten().tolist():
            text = self.tokenizer.decode(generated[i].tolist(), skip_special_tokens=True)
            out[i] = block_end(text, self.cfg) is not None
        return out.to(generated.device)

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        running = torch.ones(input_ids.shape[0], dtype=torch.bool)
        return self.ended(input_ids[:, self.width :], running)
