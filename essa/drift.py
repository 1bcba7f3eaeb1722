"""What else a tuned adapter changed: off-task KL, update size, retention and pass@K.

Forward passes and generation only, offline (docs/drift.md has the formulas):

* off-task KL: mean per-token KL(base || tuned), KL(SFT || tuned) and KL(base || SFT),
  teacher-forced on the base model's own greedy continuations of fixed off-task prompts
  (:func:`offtask_prompts`), over the |y| + 1 next-token distributions from the end of the
  prompt to the token after the continuation;
* update size: ||dW||_F / ||W0||_F per adapted matrix, mean and max, for the SFT adapter and
  the tuned one (:func:`update_size`);
* retention: greedy accuracy on a task the run does not train on (built-in or reasoning-gym),
  for the base, the SFT adapter and the tuned one;
* diversity: pass@K, maj@K and mean@K of K sampled completions per held-out item, and the
  answer entropy per item.

The models are reached through :class:`PopulationModels` (ESSA: the bare base model, and the SFT
and tuned vectors as two candidate rows of one PopulationLoRA forward) or :class:`PeftModels`
(GRPO and ``essa eval``: a PEFT model with its adapter switched off for the base). Sampling draws
from counter-based per-row streams (``drift.samples``), never from a stream training uses.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from essa import seeding
from essa.config import Config, DataConfig, DriftConfig, GenerationConfig, PythonToolConfig
from essa.types import AdapterVector, Example

if TYPE_CHECKING:
    from essa.adapters.svd import SVDAdapter
    from essa.harness import Harness

Pair = tuple[list[int], list[int]]  # (prompt ids, continuation ids)

# General-text prompts for the off-task set, interleaved with built-in arithmetic problems.
# Short, so that prompt + continuation fit a small model's context.
OFFTASK_TEXTS = (
    "The capital of France is",
    "Water boils at a temperature of",
    "Once upon a time, there was a",
    "The opposite of hot is",
    "A list of three primary colours:",
    "def add(a, b):",
    "The largest planet in the solar system is",
    "Translate to French: good morning.",
    "The first month of the year is",
    "Photosynthesis is the process by which",
    "My favourite book is",
    "The chemical symbol for gold is",
    "In 1492, Columbus",
    "A haiku about the sea:",
    "import numpy as np",
    "The square root of 81 is",
)
NAMES = ("base", "sft", "tuned")


def retention_source(cfg: Config) -> str | None:
    """The task retention is measured on (None: off): ``builtin:NAME`` or ``reasoning_gym:TASK``.

    >>> from essa.config import load_config
    >>> retention_source(load_config(None, []))
    'builtin:arithmetic_mixed'
    """
    choice = cfg.evaluation.drift.retention
    if choice == "none" or cfg.evaluation.drift.items == 0:
        return None
    if choice == "auto":
        mixed = "builtin:arithmetic_mixed"
        return "builtin:arithmetic" if cfg.data.source == mixed else mixed
    return choice


def retention_length(cfg: Config) -> int:
    """New tokens retention generates: the run's length, or ``drift.retention_tokens`` when
    longer. The retention task is not the run's: the base model, in a chat template, writes a
    sentence before its number, and at a short task's length (6 tokens on chain_sum) every such
    answer was cut and scored 0.

    >>> from essa.config import load_config
    >>> retention_length(load_config(None, ["generation.max_new_tokens=6"]))
    32
    """
    return max(cfg.generation.new_tokens, cfg.evaluation.drift.retention_tokens)


def offtask_prompts(train_source: str, n: int, tokenizer: Any) -> list[str]:
    """``n`` off-task prompts, the same for every run on the same task and tokenizer.

    Round robin over :data:`OFFTASK_TEXTS` (those the tokenizer round-trips: a digits-only
    vocabulary drops letters) and the fixed test splits of the built-in arithmetic tasks other
    than ``train_source``, each in its own order, until ``n`` are taken or all are used.
    """
    from essa.data.loaders import BUILTIN_SOURCES, builtin_examples

    def encodable(text: str) -> bool:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return tokenizer.decode(ids, skip_special_tokens=True) == text

    streams = [[t for t in OFFTASK_TEXTS if encodable(t)]]
    for source in BUILTIN_SOURCES:
        if source != train_source:
            streams.append([e.prompt for e in builtin_examples(source)[1][:n]])
    out: list[str] = []
    for i in range(max((len(s) for s in streams), default=0)):
        out.extend(s[i] for s in streams if i < len(s))
    return out[:n]


def rendered_offtask_prompts(data: DataConfig, n: int, tokenizer: Any) -> list[str]:
    """:func:`offtask_prompts` in ``data``'s template, as the run renders its own prompts."""
    from essa.data.task import render_prompts

    questions = [Example(prompt=t, answer=None) for t in offtask_prompts(data.source, n, tokenizer)]
    return render_prompts(questions, data.template, tokenizer, data.system_prompt)


def token_kl(logp_p: torch.Tensor, logp_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) = sum_v p_v (log p_v - log q_v) per position, from log-probs (..., V).

    >>> logp = torch.log_softmax(torch.tensor([[1.0, 2.0, 3.0]]), -1)
    >>> float(token_kl(logp, logp))
    0.0
    """
    return (logp_p.exp() * (logp_p - logp_q)).sum(-1)


def tail_mask(chunk: Sequence[Pair], tail: int) -> torch.Tensor:
    """(B, tail) bool: row i's last ``|c_i| + 1`` columns, the distributions that predict its
    continuation and the token after it (:func:`essa.backends.teacher.tail_log_softmax`)."""
    mask = torch.zeros((len(chunk), tail), dtype=torch.bool)
    for i, (prompt, cont) in enumerate(chunk):
        mask[i, tail - min(len(cont) + 1, len(prompt) + len(cont), tail) :] = True
    return mask


def texts_of(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    gen: GenerationConfig,
    tools: PythonToolConfig | None,
    **kwargs: Any,
) -> list[str]:
    """Completions of ``prompts``: ``generate_texts``, or with ``tools`` the turn-by-turn
    rollouts the run itself makes (essa.backends.tool_turns), tool outputs in the text."""
    from essa.backends.generate import generate_texts

    if tools is None:
        return generate_texts(model, tokenizer, prompts, gen, **kwargs)[0]
    from essa.backends.tool_turns import generate_turns

    ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    return generate_turns(model, tokenizer, ids, gen, tools, **kwargs)[0]


@dataclass
class PopulationModels:
    """ESSA's models: the bare base model, and the SFT (zero offsets) and tuned vectors as the
    two candidate rows of one PopulationLoRA forward."""

    model: Any  # the bare base model
    tokenizer: Any
    adapter: SVDAdapter
    vector: AdapterVector
    micro_batch_size: int
    names: tuple[str, ...] = NAMES
    tools: PythonToolConfig | None = None  # the run's tool calls, for retention and pass@K

    def _population(self) -> np.ndarray:
        return np.stack([np.zeros_like(self.vector), np.asarray(self.vector)])  # (2, D)

    def log_softmax(self, chunk: Sequence[Pair]) -> dict[str, torch.Tensor]:
        from essa.adapters import PopulationLoRA, candidate_rows

        base = tail_logp(self.model, chunk, self.tokenizer.pad_token_id)
        with PopulationLoRA(self.model, self.adapter) as pop:
            pop.set_population(self._population())
            pop.set_rows(candidate_rows(2, len(chunk)))
            both = tail_logp(self.model, list(chunk) * 2, self.tokenizer.pad_token_id)
        n = len(chunk)
        return {"base": base, "sft": both[:n], "tuned": both[n:]}

    def generate(
        self,
        prompts: Sequence[str],
        gen: GenerationConfig,
        names: Sequence[str],
        row_seeds: Sequence[int] | None = None,
        tools: bool = False,
    ) -> dict[str, list[str]]:
        """Completions of ``prompts`` by each of ``names``; with ``tools``, with the run's
        tool calls (``self.tools``)."""
        from essa.adapters import PopulationLoRA, candidate_rows

        calls = self.tools if tools else None
        out: dict[str, list[str]] = {}
        if "base" in names:
            out["base"] = texts_of(
                self.model,
                self.tokenizer,
                prompts,
                gen,
                calls,
                micro_batch_size=self.micro_batch_size,
                row_seeds=row_seeds,
            )
        rows = [i for i, name in enumerate(("sft", "tuned")) if name in names]
        if rows:
            n = len(prompts)
            with PopulationLoRA(self.model, self.adapter) as pop:
                pop.set_population(self._population()[rows])
                texts = texts_of(
                    self.model,
                    self.tokenizer,
                    list(prompts) * len(rows),  # candidate-major
                    gen,
                    calls,
                    micro_batch_size=self.micro_batch_size,
                    row_candidates=candidate_rows(len(rows), n),
                    set_rows=pop.set_rows,
                    row_seeds=None if row_seeds is None else list(row_seeds) * len(rows),
                )
            for c, i in enumerate(rows):
                out[("sft", "tuned")[i]] = texts[c * n : (c + 1) * n]
        return out


@dataclass
class PeftModels:
    """A PEFT model holding the tuned adapter: the base with the adapter switched off, the SFT
    values under ``sft`` (a context that loads them; None: not known), the tuned as is."""

    model: Any  # PeftModel
    tokenizer: Any
    micro_batch_size: int
    sft: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
    has_base: bool = True  # False: the base weights themselves were trained (GRPO with LISA)
    tools: PythonToolConfig | None = None  # the run's tool calls, for retention and pass@K

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n in NAMES if self._context(n) is not None)

    @property
    def inner(self) -> Any:
        """The HF model with the LoRA layers injected: it generates as the PEFT model does, and
        the decode loop (row dropping, per-row sampling streams) applies to it."""
        get = getattr(self.model, "get_base_model", None)
        return self.model if get is None else get()

    def _context(self, name: str) -> Callable[[], contextlib.AbstractContextManager[Any]] | None:
        if name == "base":
            return self.model.disable_adapter if self.has_base else None
        if name == "sft":
            return self.sft
        return contextlib.nullcontext

    def log_softmax(self, chunk: Sequence[Pair]) -> dict[str, torch.Tensor]:
        out = {}
        for name in self.names:
            with self._context(name)():  # type: ignore[misc]
                out[name] = tail_logp(self.inner, chunk, self.tokenizer.pad_token_id)
        return out

    def generate(
        self,
        prompts: Sequence[str],
        gen: GenerationConfig,
        names: Sequence[str],
        row_seeds: Sequence[int] | None = None,
        tools: bool = False,
    ) -> dict[str, list[str]]:
        """As :meth:`PopulationModels.generate`."""
        out = {}
        for name in (n for n in self.names if n in names):
            with self._context(name)():  # type: ignore[misc]
                out[name] = texts_of(
                    self.inner,
                    self.tokenizer,
                    prompts,
                    gen,
                    self.tools if tools else None,
                    micro_batch_size=self.micro_batch_size,
                    row_seeds=row_seeds,
                )
        return out


Models = PopulationModels | PeftModels


@torch.no_grad()
def tail_logp(model: Any, chunk: Sequence[Pair], pad_id: int) -> torch.Tensor:
    """(B, tail, V) next-token log-probs of ``model`` at the last ``max |c| + 1`` columns of
    the left-padded pairs (:func:`essa.backends.teacher.tail_log_softmax`), on the CPU."""
    import inspect

    from essa.backends.models import model_device
    from essa.backends.teacher import tail_log_softmax

    keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    logp, _ = tail_log_softmax(model, chunk, pad_id, model_device(model), keep)
    return logp.cpu()  # (B, tail, V)


@torch.no_grad()
def offtask_kl(
    models: Models, prompts: Sequence[str], tokens: int, micro_batch_size: int
) -> dict[str, Any]:
    """Mean per-token KL between the models on the base model's greedy continuations of
    ``prompts`` (``tokens`` new tokens at most): ``kl_base`` = KL(base || tuned), ``kl_sft`` =
    KL(SFT || tuned), ``kl_base_sft`` = KL(base || SFT), where the models are known."""
    from essa.backends.teacher import encode_pairs

    gen = GenerationConfig(max_new_tokens=tokens, temperature=0.0)
    continuations = models.generate(prompts, gen, ["base"])["base"]
    pairs = encode_pairs(models.tokenizer, prompts, continuations)
    wanted = {
        "kl_base": ("base", "tuned"),
        "kl_sft": ("sft", "tuned"),
        "kl_base_sft": ("base", "sft"),
    }
    wanted = {k: v for k, v in wanted.items() if set(v) <= set(models.names)}
    rows: dict[str, list[float]] = {k: [] for k in wanted}  # per prompt: the KL summed
    counts: list[int] = []  # per prompt: its positions
    for start in range(0, len(pairs), micro_batch_size):
        chunk = pairs[start : start + micro_batch_size]
        logps = models.log_softmax(chunk)  # name -> (B, tail, V)
        mask = tail_mask(chunk, next(iter(logps.values())).shape[1])  # (B, tail)
        counts.extend(mask.sum(1).tolist())
        for key, (p, q) in wanted.items():
            kl = token_kl(logps[p], logps[q]).double() * mask  # (B, tail)
            rows[key].extend(kl.sum(1).tolist())
    positions = sum(counts)
    report: dict[str, Any] = {
        k: sum(v) / positions if positions else math.nan for k, v in rows.items()
    }
    report.update(kl_prompts=len(pairs), kl_positions=positions)
    # Per prompt, its mean per-token KL: two runs on the same base and prompts compare pairwise.
    report["kl_per_prompt"] = {k: [float(f"{s / n:.6g}") for s, n in zip(v, counts, strict=True)]
                               for k, v in rows.items()}  # fmt: skip
    return report


def update_size(deltas: Mapping[str, torch.Tensor], bases: Mapping[str, torch.Tensor]) -> dict:
    """``||dW||_F / ||W0||_F`` per adapted matrix: mean, max and count.

    >>> update_size({"w": torch.ones(2, 2)}, {"w": 2 * torch.ones(2, 2)})
    {'mean': 0.5, 'max': 0.5, 'matrices': 1}
    """
    ratios = [
        float(torch.linalg.norm(delta.double()) / torch.linalg.norm(bases[name].double()))
        for name, delta in deltas.items()
    ]
    return {"mean": float(np.mean(ratios)), "max": float(np.max(ratios)), "matrices": len(ratios)}


def base_weights(model: Any, names: Sequence[str]) -> dict[str, torch.Tensor] | None:
    """W0 of the named linears of ``model`` (float32 CPU); None when quantised (no W0 to read)."""
    weights = {name: model.get_submodule(name).weight for name in names}
    if any(not w.is_floating_point() for w in weights.values()):
        return None
    return {name: w.detach().float().cpu() for name, w in weights.items()}


def peft_deltas(peft_model: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(gamma * B A, W0)`` per LoRA module of a PEFT model, keyed by its base-model name."""
    deltas, bases = {}, {}
    for name, module in peft_model.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if not isinstance(lora_a, torch.nn.ModuleDict) or not lora_a:
            continue
        (adapter,) = module.active_adapters
        a = module.lora_A[adapter].weight.detach().float().cpu()  # (r, n)
        b = module.lora_B[adapter].weight.detach().float().cpu()  # (m, r)
        key = name.removeprefix("base_model.model.")
        deltas[key] = float(module.scaling[adapter]) * (b @ a)
        weight = module.base_layer.weight.detach()
        bases[key] = weight.float().cpu() if weight.is_floating_point() else weight
    return deltas, bases


def peft_updates(
    peft_model: Any, sft: Callable[[], contextlib.AbstractContextManager[Any]] | None
) -> dict[str, Any] | None:
    """Update sizes of a PEFT model's adapter (``final``) and, with ``sft`` (a context that
    loads the SFT values), of the SFT adapter and the change from it (``search``); None when
    the base weights are quantised."""
    final, w0 = peft_deltas(peft_model)
    if any(not w.is_floating_point() for w in w0.values()):
        return None
    report = {"final": update_size(final, w0)}
    if sft is not None:
        with sft():
            start, _ = peft_deltas(peft_model)
        report["sft"] = update_size(start, w0)
        report["search"] = update_size({n: final[n] - start[n] for n in final}, w0)
    return report


def retention_task(source: str, items: int) -> tuple[list[Example], Any]:
    """The first ``items`` held-out examples of ``source`` and the reward that grades them: the
    task's own scorer for ``reasoning_gym:TASK`` (at its default parameters), math accuracy for
    a built-in task."""
    from essa.data.gym import GYM_PREFIX
    from essa.data.loaders import load_examples
    from essa.rewards import get_reward

    examples = load_examples(source, split="test", limit=items)
    if source.startswith(GYM_PREFIX):
        return examples, get_reward("gym_score", task=source.removeprefix(GYM_PREFIX))
    return examples, get_reward("math_accuracy")


def retention(
    models: Models,
    examples: Sequence[Example],
    prompts: Sequence[str],
    gen: GenerationConfig,
    source: str,
    reward: Any,
) -> dict[str, Any]:
    """Greedy accuracy of each model on ``examples`` (the share ``reward`` gives full credit)
    and the tuned one's changes."""
    answers = [e.answer for e in examples]
    texts = models.generate(prompts, replace(gen, temperature=0.0), models.names, tools=True)
    report: dict[str, Any] = {"source": source, "items": len(examples)}
    for name, completions in texts.items():
        scores = reward(completions, answers, list(prompts))
        report[name] = sum(float(s or 0.0) >= 1.0 for s in scores) / len(scores)
    for name in ("base", "sft"):
        if name in report:
            report[f"change_from_{name}"] = report["tuned"] - report[name]
    return report


def sampled(
    models: Models,
    examples: Sequence[Example],
    prompts: Sequence[str],
    gen: GenerationConfig,
    k: int,
    reward: Any,
    seed: int,
) -> dict[str, Any]:
    """pass@K, maj@K, mean@K and the mean answer entropy (nats) of the tuned model from K
    samples per item, on per-row streams of ``drift.samples`` (no training stream moves)."""
    from essa.backends.sampling import row_seed

    base_seed = seeding.seed_int(seed, "drift.samples")
    rows = [p for p in prompts for _ in range(k)]  # problem-major
    seeds = [row_seed(base_seed, i, j) for i in range(len(prompts)) for j in range(k)]
    texts = models.generate(rows, gen, ["tuned"], row_seeds=seeds, tools=True)["tuned"]
    answers = [e.answer for e in examples for _ in range(k)]
    return grade_samples(texts, answers, rows, k, reward)


def grade_samples(
    texts: Sequence[str], answers: Sequence[str | None], rows: Sequence[str], k: int, reward: Any
) -> dict[str, Any]:
    """The sampled metrics of ``texts`` (problem-major, ``k`` per problem); full credit only."""
    from essa.metrics import sample_metrics
    from essa.rewards import extract_answer

    values = [float(s or 0.0) for s in reward(list(texts), list(answers), list(rows))]
    n = len(values) // k
    correct = [[v >= 1.0 for v in values[i * k : (i + 1) * k]] for i in range(n)]
    keys = [[extract_answer(t) for t in texts[i * k : (i + 1) * k]] for i in range(n)]
    metrics: dict[str, Any] = {"k": k, "items": n}
    metrics.update(sample_metrics(correct, ks=sorted({1, k}), keys=keys))
    metrics[f"mean@{k}"] = metrics.pop(f"avg@{k}")
    metrics["answer_entropy"] = float(np.mean([answer_entropy(row) for row in keys]))
    return metrics


def answer_entropy(answers: Sequence[str | None]) -> float:
    """Entropy (nats) of the extracted answers of one problem's samples (None is an answer).

    >>> answer_entropy(["1", "1"]), round(answer_entropy(["1", "2"]), 4)
    (0.0, 0.6931)
    """
    counts = np.array(list(Counter(answers).values()), dtype=np.float64)
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum())


def measure(
    cfg: Config,
    models: Models | None,
    tokenizer: Any,
    test: Sequence[Example],
    reward: Any,
    updates: Mapping[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The drift report of ``evaluation.drift`` (``updates``: the update sizes, by adapter).

    ``models`` None (no HF model, e.g. the vLLM backend): update sizes only.
    """
    d: DriftConfig = cfg.evaluation.drift
    report: dict[str, Any] = {}
    if updates:
        report["update"] = dict(updates)
    if models is None:
        return report
    models = replace(models, tools=cfg.tools.calls)  # retention and pass@K as the run rolls out
    with _eval_mode(models.model):
        report.update(_model_parts(cfg, d, models, tokenizer, test, reward))
    return report


def _model_parts(
    cfg: Config,
    d: DriftConfig,
    models: Models,
    tokenizer: Any,
    test: Sequence[Example],
    reward: Any,
) -> dict[str, Any]:
    from essa.data.task import render_prompts

    def render(examples: Sequence[Example]) -> list[str]:
        return render_prompts(examples, cfg.data.template, tokenizer, cfg.data.system_prompt)

    report: dict[str, Any] = _kl_part(cfg, d, models, tokenizer)
    source = retention_source(cfg)
    if source is not None:
        examples, grader = retention_task(source, d.items)
        gen = replace(cfg.generation, max_new_tokens=retention_length(cfg))
        report["retention"] = retention(models, examples, render(examples), gen, source, grader)
    items = list(test[: d.items])
    if d.samples >= 2 and items:
        gen = replace(cfg.generation, temperature=d.temperature)
        report["samples"] = sampled(
            models, items, render(items), gen, d.samples, reward, cfg.run.seed
        )
    return report


def _kl_part(cfg: Config, d: DriftConfig, models: Models, tokenizer: Any) -> dict[str, Any]:
    """Off-task KL (:func:`offtask_kl`) on ``d.prompts`` prompts in the run's template; {} when
    there is no base model to compare with or no prompt."""
    if not d.prompts or "base" not in models.names:
        return {}
    prompts = rendered_offtask_prompts(cfg.data, d.prompts, tokenizer)
    return offtask_kl(models, prompts, d.tokens, cfg.evaluation.micro_batch_size)


def pass_figures(
    cfg: Config, models: Models | None, updates: Mapping[str, dict[str, Any]] | None = None
) -> dict[str, float]:
    """The drift figures of an intermediate held-out pass, as flat metrics fields: off-task KL
    (``drift_kl_base``, ``drift_kl_sft``) and the mean relative update of the adapter
    (``drift_update``); {} with ``evaluation.drift.every_pass`` off. Retention and pass@K,
    which generate far more, are the final report's (:func:`measure`)."""
    d: DriftConfig = cfg.evaluation.drift
    if not d.every_pass:
        return {}
    out: dict[str, float] = {}
    if models is not None:
        with _eval_mode(models.model):
            kl = _kl_part(cfg, d, models, models.tokenizer)
        out.update({f"drift_{k}": kl[k] for k in ("kl_base", "kl_sft") if k in kl})
    final = (updates or {}).get("final")
    if final:
        out["drift_update"] = final["mean"]
    return out


@contextlib.contextmanager
def _eval_mode(model: Any) -> Iterator[None]:
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


def summary_line(report: Mapping[str, Any]) -> str | None:
    """One console line of the report's headline figures (None when it has none)."""
    parts = []
    if "kl_base" in report:
        parts.append(f"off-task KL(base||tuned) {report['kl_base']:.4f}")
    if "kl_sft" in report:
        parts.append(f"KL(SFT||tuned) {report['kl_sft']:.4f}")
    final = report.get("update", {}).get("final")
    if final:
        parts.append(f"||dW||/||W0|| mean {final['mean']:.4f} max {final['max']:.4f}")
    kept = report.get("retention")
    if kept:
        parts.append(f"retention ({kept['source']}) {kept['tuned']:.3f}")
    samples = report.get("samples")
    if samples:
        k = samples["k"]
        parts.append(f"pass@{k} {samples[f'pass@{k}']:.3f} maj@{k} {samples[f'maj@{k}']:.3f}")
    return "drift: " + "; ".join(parts) if parts else None


def adapter_report(
    cfg: Config,
    h: Harness,
    model: Any,
    tokenizer: Any,
    adapter: SVDAdapter,
    test: list[Example],
    vector: AdapterVector,
) -> dict[str, Any]:
    """ESSA's drift report of ``vector`` (rank 0, after the search): ``model`` is the bare base
    model (None under vLLM: update sizes need W0 too, so nothing is measured)."""
    if model is None:
        return {}
    updates = adapter_updates(model, adapter, vector)
    mb = cfg.evaluation.micro_batch_size
    models = PopulationModels(model, tokenizer, adapter, np.asarray(vector), mb)
    with h.phase("drift"):
        report = measure(cfg, models, tokenizer, test, h.metric, updates)
    line = summary_line(report)
    if line is not None:
        h.say(line)
    return report


def adapter_updates(
    model: Any, adapter: SVDAdapter, vector: AdapterVector
) -> dict[str, dict[str, Any]] | None:
    """Update sizes of the SFT adapter, of ``vector``'s and of the search (their difference),
    relative to the base weights of ``model``; None when they cannot be read (quantised)."""
    w0 = base_weights(model, adapter.module_names)
    if w0 is None:
        return None
    sft, final = adapter.delta_weights(np.zeros(adapter.dim)), adapter.delta_weights(vector)
    search = {name: final[name] - sft[name] for name in final}
    return {
        "sft": update_size(sft, w0),
        "final": update_size(final, w0),
        "search": update_size(search, w0),  # the final adapter's change from SFT
    }


def adapter_pass_figures(
    cfg: Config, model: Any, tokenizer: Any, adapter: SVDAdapter, vector: AdapterVector
) -> dict[str, float]:
    """ESSA's :func:`pass_figures` for ``vector`` (rank 0; ``model`` None under vLLM: none)."""
    if model is None or not cfg.evaluation.drift.every_pass:
        return {}
    mb = cfg.evaluation.micro_batch_size
    models = PopulationModels(model, tokenizer, adapter, np.asarray(vector), mb)
    w0 = base_weights(model, adapter.module_names)  # a pass reads the final update size only
    updates = None if w0 is None else {"final": update_size(adapter.delta_weights(vector), w0)}
    return pass_figures(cfg, models, updates)
