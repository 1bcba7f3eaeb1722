"""What the gradient recipes train and how they sample: the policy (trainable tensors and their
SFT reference), rollouts (sampled completions with their masks) and token log-probs.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from essa.backends.stops import stop_token_ids
from essa.config import GenerationConfig, GRPOConfig, PythonToolConfig
from essa.drift.offtask import ContinuationCache
from essa.gradient.losses import era_activation, token_entropy

if TYPE_CHECKING:
    from essa.adapters.svd import SVDAdapter
    from essa.tools.turns import Transcript


@dataclass
class Policy:
    """The PEFT model plus the tensors GRPO trains and their frozen SFT values (the reference)."""

    model: Any  # PeftModel; its LoRA weights are either trained or parametrized by ``params``
    params: list[torch.Tensor]  # the trainable tensors
    reference: list[torch.Tensor]  # their SFT values: the KL reference and the baseline
    svd: SVDAdapter | None = None  # when trainable == singular_values
    # The base model's off-task continuations for the drift figures: generated at the first
    # held-out pass, read by the later ones and the final report (the base weights do not train
    # under lora or singular_values; under lisa there is no base model to compare).
    offtask: ContinuationCache = field(default_factory=ContinuationCache)

    @classmethod
    def build(
        cls, peft_model: Any, trainable: str, alpha: float, use_reference: bool = True
    ) -> Policy:
        for param in peft_model.parameters():
            param.requires_grad_(False)
        svd = None
        if trainable == "lisa":
            # Every base weight may train; LisaOptimizer sets requires_grad per interval. The
            # KL reference (a full copy of the weights) is kept only when beta != 0.
            peft_model = peft_model.merge_and_unload()
            params = list(peft_model.parameters())  # tied weights appear once
            reference = [p.detach().clone() for p in params] if use_reference else []
            return cls(peft_model.eval(), params, reference, None)
        if trainable == "lora":
            params = [p for n, p in peft_model.named_parameters() if "lora_" in n]
        else:
            svd, offsets = _parametrize_singular_values(peft_model, alpha)
            params = [offsets]
        for param in params:
            param.requires_grad_(True)
        reference = [p.detach().clone() for p in params]
        return cls(peft_model.eval(), params, reference, svd)

    @property
    def dim(self) -> int:
        return sum(p.numel() for p in self.params)

    @contextlib.contextmanager
    def frozen_reference(self) -> Iterator[None]:
        """Temporarily load the SFT values (for reference log-probs); restore bit-exactly."""
        saved = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for param, ref in zip(self.params, self.reference, strict=True):
                param.copy_(ref)
            try:
                yield
            finally:
                for param, value in zip(self.params, saved, strict=True):
                    param.copy_(value)

    def inference(self) -> contextlib.AbstractContextManager[None]:
        """Generation context: reconstruct parametrized factors once, not at every token."""
        from torch.nn.utils import parametrize

        return parametrize.cached() if self.svd is not None else contextlib.nullcontext()

    def export(self, out_dir: Path, base_model_name_or_path: str) -> None:
        if self.svd is None:
            from essa.gradient.sft import save_adapter

            save_adapter(self.model, out_dir)
            return
        vector = self.params[0].detach().to("cpu", torch.float64).numpy()
        self.svd.export_peft(vector, out_dir, base_model_name_or_path=base_model_name_or_path)


class _FactorFromSingularValues(torch.nn.Module):
    """A LoRA factor rebuilt as U diag(s_SFT + offsets[slice], padded) Vᵀ (SVD-GRPO)."""

    u: torch.Tensor
    v: torch.Tensor
    s: torch.Tensor

    def __init__(
        self,
        u: torch.Tensor,
        v: torch.Tensor,
        s: torch.Tensor,
        offsets: torch.Tensor,
        part: slice,
    ) -> None:
        super().__init__()
        self.register_buffer("u", u)  # (rows, r)
        self.register_buffer("v", v)  # (cols, r)
        self.register_buffer("s", s.float())  # (r,) SFT singular values
        self.offsets = offsets  # the shared trainable (D,) vector
        self.part = part

    def forward(self, _weight: torch.Tensor) -> torch.Tensor:
        delta = self.offsets[self.part]  # (k,)
        s = self.s + torch.nn.functional.pad(delta, (0, self.s.shape[0] - delta.shape[0]))
        return (self.u * s) @ self.v.T  # (rows, cols)


def _parametrize_singular_values(peft_model: Any, alpha: float) -> tuple[SVDAdapter, torch.Tensor]:
    from torch.nn.utils import parametrize

    from essa.adapters.svd import svd_adapter

    svd = svd_adapter(peft_model, alpha)
    device = next(peft_model.parameters()).device
    offsets = torch.nn.Parameter(torch.zeros(svd.dim, device=device))  # (D,) zero = SFT
    layers = dict(peft_model.named_modules())
    for module in svd.modules:
        layer = layers[f"base_model.model.{module.name}"]
        (name,) = layer.active_adapters
        factors = (
            (layer.lora_A[name], module.u_a, module.v_a, module.s_a, module.slice_a),
            (layer.lora_B[name], module.u_b, module.v_b, module.s_b, module.slice_b),
        )
        for linear, u, v, s, part in factors:
            rebuild = _FactorFromSingularValues(
                u.to(device), v.to(device), s.to(device), offsets, part
            )
            parametrize.register_parametrization(linear, "weight", rebuild, unsafe=True)
    return svd, offsets


@dataclass(frozen=True)
class Rollout:
    input_ids: torch.Tensor  # (B, P + T) left-padded prompt, then completion
    attention_mask: torch.Tensor  # (B, P + T) prompt padding 0, completion up to EOS 1
    completion_ids: torch.Tensor  # (B, T)
    mask: torch.Tensor  # (B, T) float: completion tokens up to and including the first EOS
    truncated: torch.Tensor  # (B,) bool: no EOS within max_new_tokens
    texts: list[str]
    # Tool-integrated rollouts: each row's turns and tool calls; ``mask`` is 0 on tool outputs.
    transcripts: list[Transcript] | None = None


@dataclass(frozen=True)
class Sampling:
    """How rollouts sample: ``generation``'s length and top-p, ``micro_batch_size`` rows per
    generate call, the temperature and the ERA-style entropy floor (0: none)."""

    generation: GenerationConfig
    micro_batch_size: int
    temperature: float
    entropy_floor: float = 0.0
    tools: PythonToolConfig | None = None  # tool-integrated rollouts (essa.gradient.tool_rollout)

    @classmethod
    def for_grpo(
        cls,
        g: GRPOConfig,
        generation: GenerationConfig,
        micro_batch_size: int,
        tools: PythonToolConfig | None = None,
    ) -> Sampling:
        """GRPO's: ``grpo.temperature`` and ``grpo.entropy.floor``; ``tools`` when it calls."""
        calls = tools if tools is not None and tools.max_tool_calls else None
        return cls(generation, micro_batch_size, g.temperature, g.entropy.floor, calls)


@torch.no_grad()
def rollout(
    policy: Policy,
    tokenizer: Any,
    prompts: Sequence[str],
    sampling: Sampling,
    seed: int,
    progress: Callable[[int], None] | None = None,
    temperature: float | None = None,
) -> Rollout:
    """Sample one completion per prompt row at ``temperature`` (default sampling.temperature).

    ``progress(rows)`` is called after each micro-batch. With an entropy floor the tokens are
    drawn from the ERA-activated distribution the loss trains (see :func:`sampling_processors`).
    Tool-integrated rollouts are :func:`essa.gradient.tool_rollout.tool_rollout`.
    """
    batch = tokenizer(list(prompts), return_tensors="pt", padding=True, add_special_tokens=False)
    return rollout_from_ids(
        policy, tokenizer, batch["input_ids"], batch["attention_mask"], sampling, seed, progress,
        temperature=temperature,
    )  # fmt: skip


@torch.no_grad()
def rollout_from_ids(
    policy: Policy,
    tokenizer: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    sampling: Sampling,
    seed: int,
    progress: Callable[[int], None] | None = None,
    budgets: torch.Tensor | None = None,
    temperature: float | None = None,
    stopping: Any = None,
) -> Rollout:
    """:func:`rollout` from left-padded token ids (B, P); ``budgets`` (B,) caps each row's
    completion length (default ``generation.max_new_tokens``): tokens past a row's budget are
    dropped as if never sampled, and a row without EOS within it is truncated. ``stopping``
    (a ``generate`` stopping criterion, essa.backends.stops.ToolCallStop) ends rows early too.
    """
    temperature = sampling.temperature if temperature is None else temperature
    processors, temperature = sampling_processors(sampling.entropy_floor, temperature)
    model = policy.model
    device = next(model.parameters()).device
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    max_new_tokens = sampling.generation.new_tokens if budgets is None else int(budgets.max())
    # The tokenizer's EOS and the model's own end-of-turn ids (essa/backends/stops.py), as ESSA
    # stops: with EOS alone a chat model's rows would all run to max_new_tokens.
    stops = stop_token_ids(tokenizer, getattr(model, "generation_config", None))
    torch.manual_seed(seed)  # HF sampling draws from the global torch RNG
    chunks = []
    size = sampling.micro_batch_size
    with policy.inference():
        for start in range(0, len(input_ids), size):
            part = {k: v[start : start + size].to(device) for k, v in batch.items()}
            if stopping is not None:
                from transformers import StoppingCriteriaList

                stopping.width = part["input_ids"].shape[1]
                extra = {"stopping_criteria": StoppingCriteriaList([stopping])}
            else:
                extra = {}
            out = model.generate(
                **part,
                do_sample=True,
                temperature=temperature,
                logits_processor=processors,
                top_p=sampling.generation.top_p,
                top_k=0,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=stops or tokenizer.eos_token_id,
                **extra,
            )
            chunks.append(out[:, part["input_ids"].shape[1] :].cpu())  # (b, T_chunk)
            if progress is not None:
                progress(len(part["input_ids"]))
    width = max(c.shape[1] for c in chunks)
    completion = torch.cat(
        [
            torch.nn.functional.pad(c, (0, width - c.shape[1]), value=tokenizer.pad_token_id)
            for c in chunks
        ]
    )
    room = torch.ones_like(completion, dtype=torch.bool)  # (B, T)
    if budgets is not None:
        room = torch.arange(width)[None, :] < budgets[:, None]
        completion = completion.masked_fill(~room, tokenizer.pad_token_id)
    is_eos = torch.isin(completion, torch.tensor(stops, dtype=completion.dtype)) & room  # (B, T)
    # Keep tokens up to and including the first stop (pad may equal EOS, so do not test pad).
    mask = ((torch.cumsum(is_eos, dim=1) - is_eos.long()) == 0) & room  # (B, T)
    return Rollout(
        input_ids=torch.cat([input_ids, completion], dim=1),
        attention_mask=torch.cat([attention_mask, mask.long()], dim=1),
        completion_ids=completion,
        mask=mask.float(),
        truncated=~is_eos.any(dim=1),
        texts=tokenizer.batch_decode(
            completion * mask + tokenizer.pad_token_id * ~mask, skip_special_tokens=True
        ),
    )


def token_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    num_completion_tokens: int,
    temperature: float,
    entropy_floor: float = 0.0,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the completion tokens and the policy's entropy there: 2 x (B, T).

    Both come from one forward, on the temperature-scaled logits (after the ERA-style
    activation when ``entropy_floor`` > 0). The entropy carries a gradient only when
    ``entropy_grad`` (the entropy bonus needs it; the (B, T, V) graph costs memory).
    """
    device = next(model.parameters()).device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # as generate does, left padding
    t = num_completion_tokens
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=t + 1,
    ).logits[:, :-1]  # (B, T, V): position j predicts completion token j
    scaled = era_activation(logits.float() / temperature, entropy_floor)  # (B, T, V)
    logp_all = torch.log_softmax(scaled, dim=-1)  # (B, T, V)
    logp = logp_all.gather(-1, input_ids[:, -t:, None]).squeeze(-1)  # (B, T)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = token_entropy(logp_all)  # (B, T)
    return logp.cpu(), entropy.cpu()


# Logit elements (rows x positions x vocabulary) one micro-batch may hold. token_logprobs keeps a
# few fp32 (b, T, V) tensors alive through the backward: 2^27 elements is 512 MiB each, which
# bounds a step to a few GiB whatever the completion length. A tool transcript runs to hundreds
# of tokens where a bare answer is a dozen, and 64 such rows over a 49k vocabulary held ~19 GB.
LOGITS_PER_MICRO_BATCH = 2**27


def vocab_size(model: Any) -> int | None:
    """Rows of the model's LM head (the V of its logits); None when the model does not say."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and hasattr(head, "weight"):
        return int(head.weight.shape[0])
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return int(size) if size else None


def micro_batches(
    model: Any, rows: int, completion_tokens: int, at_least: int = 1
) -> list[torch.Tensor]:
    """Row indices of a step's micro-batches: ``at_least`` of them (``grpo.grad_accumulation``),
    more where one would hold over LOGITS_PER_MICRO_BATCH logits.

    The losses divide by the whole step's counts (``losses.Counts``), so the update is the same
    however the rows are split; only the order of the gradient's sums changes.
    """
    v = vocab_size(model)
    n = at_least
    if v is not None:  # a model that does not say gets the asked number
        most = max(1, LOGITS_PER_MICRO_BATCH // ((completion_tokens + 1) * v))
        n = max(at_least, math.ceil(rows / most))
    return [c for c in torch.arange(rows).chunk(n) if c.numel()]


def sampling_processors(entropy_floor: float, temperature: float) -> tuple[Any, float]:
    """(logits processors, temperature to pass to generate) for rollouts.

    Without a floor: none, and the temperature as is. With one, the processor applies the
    temperature and then the ERA-style activation itself, and generate gets temperature 1.0:
    HF runs custom processors before its temperature and top-p warpers, so top-p then acts on
    exactly the distribution :func:`token_logprobs` scores.
    """
    if entropy_floor <= 0.0:
        return None, temperature
    from transformers import LogitsProcessor, LogitsProcessorList

    class _EntropyFloor(LogitsProcessor):  # type: ignore[misc]
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            return era_activation(scores.float() / temperature, entropy_floor)  # (b, V)

    return LogitsProcessorList([_EntropyFloor()]), 1.0


def select(out: Rollout, rows: torch.Tensor) -> Rollout:
    return Rollout(
        out.input_ids[rows],
        out.attention_mask[rows],
        out.completion_ids[rows],
        out.mask[rows],
        out.truncated[rows],
        [out.texts[i] for i in rows.tolist()],
        None if out.transcripts is None else [out.transcripts[i] for i in rows.tolist()],
    )


def merge(rollouts: list[Rollout], pad_token_id: int) -> Rollout:
    """Concatenate the rounds' rollouts (prompt and completion widths may differ)."""
    if len(rollouts) == 1:
        return rollouts[0]
    p = max(r.input_ids.shape[1] - r.completion_ids.shape[1] for r in rollouts)
    t = max(r.completion_ids.shape[1] for r in rollouts)

    def widen(x: torch.Tensor, prompt: int, completion: int, value: int) -> torch.Tensor:
        left = p - prompt
        right = t - completion
        return torch.nn.functional.pad(x, (left, right), value=value)

    parts = []
    for r in rollouts:
        prompt = r.input_ids.shape[1] - r.completion_ids.shape[1]
        completion = r.completion_ids.shape[1]
        parts.append(
            (
                widen(r.input_ids, prompt, completion, pad_token_id),
                widen(r.attention_mask, prompt, completion, 0),
                torch.nn.functional.pad(r.completion_ids, (0, t - completion), value=pad_token_id),
                torch.nn.functional.pad(r.mask, (0, t - completion)),
            )
        )
    return Rollout(
        torch.cat([x[0] for x in parts]),
        torch.cat([x[1] for x in parts]),
        torch.cat([x[2] for x in parts]),
        torch.cat([x[3] for x in parts]),
        torch.cat([r.truncated for r in rollouts]),
        [text for r in rollouts for text in r.texts],
        None
        if any(r.transcripts is None for r in rollouts)
        else [t for r in rollouts for t in r.transcripts or []],
    )
