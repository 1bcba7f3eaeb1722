"""The Hugging Face :class:`~essa.rewards.prm.StepScorer` of ``prm``: any local process-reward model.

torch and transformers are imported inside :func:`load_step_scorer` only (as ``reward_model``
does), and the model loads when the reward is built, so a bad path fails at setup.

Two heads (``head: auto`` reads ``config.architectures``):

* **token** (``*ForTokenClassification``, e.g. Qwen2.5-Math-PRM style): one forward over
  ``prompt + completion``; step k's score is read at the last token of step k (found with the
  fast tokenizer's character offsets), so all steps cost one pass.
* **sequence** (``*ForSequenceClassification``): step k's score is the classifier's score of
  the prefix ``prompt + completion[:end_k]``, one row per step.

Score of a logit vector z: ``output: probability`` gives ``sigmoid(z_0)`` for a one-label head
and ``softmax(z)[label]`` otherwise (label 1, the "correct" class of a two-label head, unless
``label_index`` says); ``output: logit`` gives ``z[label]``.
"""

from __future__ import annotations

from typing import Any


def load_step_scorer(
    path: str,
    *,
    head: str = "auto",
    label_index: int | None = None,
    output: str = "probability",
    batch_size: int = 8,
    device: str | None = None,
) -> HFStepScorer:
    """Load the model and tokenizer in ``path``; ValueError naming what is wrong."""
    import torch
    import transformers

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    config = transformers.AutoConfig.from_pretrained(path)
    if head == "auto":
        kinds = [a for a in (config.architectures or []) if a.endswith("Classification")]
        if not kinds:
            raise ValueError(
                f"prm {path!r}: no classification head in config.architectures "
                f"({config.architectures}); set reward.params.head: token or sequence"
            )
        head = "token" if kinds[0].endswith("TokenClassification") else "sequence"
    auto = (
        transformers.AutoModelForTokenClassification
        if head == "token"
        else transformers.AutoModelForSequenceClassification
    )
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    net = auto.from_pretrained(path).to(device).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    if not tok.is_fast:
        raise ValueError(f"prm {path!r}: needs a fast tokenizer (character offsets of steps)")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    # Right padding keeps every real token at its unpadded position, whatever the model's
    # position scheme (absolute positions shift under left padding).
    tok.padding_side = "right"
    if net.config.pad_token_id is None:  # decoder classifiers find the last non-pad token
        net.config.pad_token_id = tok.pad_token_id
    labels = int(net.config.num_labels)
    label = label_index if label_index is not None else (0 if labels == 1 else 1)
    if not 0 <= label < labels:
        raise ValueError(f"prm {path!r}: label_index {label} out of range for {labels} labels")
    return HFStepScorer(net, tok, head, label, output == "probability", batch_size, device)


class HFStepScorer:
    """Step scores from a token- or sequence-classification model (module docstring)."""

    def __init__(
        self,
        net: Any,
        tokenizer: Any,
        head: str,
        label: int,
        use_probability: bool,
        batch_size: int,
        device: str,
    ) -> None:
        self.net, self.tokenizer, self.head = net, tokenizer, head
        self.label, self.use_probability = label, use_probability
        self.batch_size, self.device = batch_size, device

    def _scores(self, logits: Any) -> Any:
        """(..., L) logits -> (...) step scores."""
        logits = logits.float()
        if self.use_probability:
            if logits.shape[-1] == 1:
                return logits[..., 0].sigmoid()
            return logits.softmax(-1)[..., self.label]
        return logits[..., self.label]

    def step_scores(
        self, prompts: list[str], completions: list[str], step_ends: list[list[int]]
    ) -> list[list[float]]:
        if self.head == "token":
            return self._token_scores(prompts, completions, step_ends)
        texts = [p + c[:end] for p, c, ends in zip(prompts, completions, step_ends, strict=True)
                 for end in ends]  # fmt: skip
        flat = self._sequence_scores(texts)
        out, start = [], 0
        for ends in step_ends:
            out.append(flat[start : start + len(ends)])
            start += len(ends)
        return out

    def _sequence_scores(self, texts: list[str]) -> list[float]:
        import torch

        scores = [0.0] * len(texts)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # less padding
        with torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                rows = order[start : start + self.batch_size]
                batch = self.tokenizer([texts[i] for i in rows], padding=True, return_tensors="pt")
                logits = self.net(
                    input_ids=batch["input_ids"].to(self.device),
                    attention_mask=batch["attention_mask"].to(self.device),
                ).logits  # (b, L)
                for i, value in zip(rows, self._scores(logits).tolist(), strict=True):
                    scores[i] = float(value)
        return scores

    def _token_scores(
        self, prompts: list[str], completions: list[str], step_ends: list[list[int]]
    ) -> list[list[float]]:
        import torch

        out: list[list[float]] = [[] for _ in completions]
        with torch.inference_mode():
            for start in range(0, len(completions), self.batch_size):
                rows = [i for i in range(start, min(start + self.batch_size, len(completions)))]
                rows = [i for i in rows if step_ends[i]]
                if not rows:
                    continue
                texts = [prompts[i] + completions[i] for i in rows]
                batch = self.tokenizer(
                    texts, padding=True, return_tensors="pt", return_offsets_mapping=True
                )
                logits = self.net(
                    input_ids=batch["input_ids"].to(self.device),
                    attention_mask=batch["attention_mask"].to(self.device),
                ).logits  # (b, T, L)
                scores = self._scores(logits).cpu()  # (b, T)
                for j, i in enumerate(rows):
                    positions = _end_tokens(
                        batch["offset_mapping"][j].tolist(),
                        batch["attention_mask"][j].tolist(),
                        [len(prompts[i]) + end for end in step_ends[i]],
                    )
                    out[i] = [float(scores[j, t]) for t in positions]
        return out


def _end_tokens(offsets: list[list[int]], attention: list[int], ends: list[int]) -> list[int]:
    """Per character end (exclusive), the last real token that starts before it.

    >>> _end_tokens([[0, 0], [0, 1], [1, 2], [2, 3]], [0, 1, 1, 1], [2, 3])
    [2, 3]
    """
    real = [t for t, (a, b) in enumerate(offsets) if attention[t] and b > a]
    found = []
    for end in ends:
        before = [t for t in real if offsets[t][0] < end]
        found.append(before[-1] if before else real[0])
    return found
