"""The drift report of a run's final solution, the figures of every held-out pass, and the
console line (docs/drift.md).

The report reads its config sections through :class:`DriftSettings`, never the whole config;
``essa.setup.drift_settings`` takes them from a run's config.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from essa.config import DataConfig, DriftConfig, GenerationConfig, PythonToolConfig
from essa.drift.models import Models, PopulationModels
from essa.drift.offtask import ContinuationCache, offtask_kl, rendered_offtask_prompts
from essa.drift.retention import (
    fixed_answers,
    fixed_choices,
    retention,
    retention_length,
    retention_source,
    retention_task,
    sampled,
)
from essa.drift.update import adapter_updates, base_weights, update_size
from essa.types import AdapterVector, Example

if TYPE_CHECKING:
    from essa.adapters.svd import SVDAdapter
    from essa.harness import Harness


@dataclass(frozen=True)
class DriftSettings:
    """The config sections the drift report reads."""

    drift: DriftConfig  # evaluation.drift
    data: DataConfig  # the run's task and template: the off-task set and retention's prompts
    generation: GenerationConfig  # retention's and pass@K's decoding (resolved lengths)
    micro_batch_size: int  # evaluation.micro_batch_size: KL rows per forward
    seed: int  # run.seed: pass@K's sample streams derive from it
    tools: PythonToolConfig | None = None  # tools.calls: retention and pass@K as the run rolls out


def measure(
    s: DriftSettings,
    models: Models | None,
    tokenizer: Any,
    test: Sequence[Example],
    reward: Any,
    updates: Mapping[str, dict[str, Any]] | None = None,
    cache: ContinuationCache | None = None,
) -> dict[str, Any]:
    """The drift report of ``s.drift`` (``updates``: the update sizes, by adapter; ``cache``:
    the run's base continuations, shared with its held-out passes).

    ``models`` None (no HF model, e.g. the vLLM backend): update sizes only.
    """
    report: dict[str, Any] = {}
    if updates:
        report["update"] = dict(updates)
    if models is None:
        return report
    models = replace(models, tools=s.tools)  # retention and pass@K as the run rolls out
    with _eval_mode(models.model):
        report.update(_model_parts(s, models, tokenizer, test, reward, cache))
    return report


def _model_parts(
    s: DriftSettings,
    models: Models,
    tokenizer: Any,
    test: Sequence[Example],
    reward: Any,
    cache: ContinuationCache | None,
) -> dict[str, Any]:
    from essa.data.task import render_prompts

    def render(examples: Sequence[Example]) -> list[str]:
        return render_prompts(examples, s.data.template, tokenizer, s.data.system_prompt)

    d = s.drift
    report: dict[str, Any] = _kl_part(s, models, tokenizer, cache)
    source = retention_source(d, s.data)
    if source is not None:
        examples, grader = retention_task(source, d.items)
        gen = replace(s.generation, max_new_tokens=retention_length(d, s.generation))
        prompts = render(examples)
        report["retention"] = retention(
            models, examples, prompts, gen, source, grader, cache, s.micro_batch_size
        )
    items = list(test[: d.items])
    if d.samples >= 2 and items:
        gen = replace(s.generation, temperature=d.temperature)
        report["samples"] = sampled(models, items, render(items), gen, d.samples, reward, s.seed)
    return report


SAMPLE_PROBE_ITEMS = 8  # items whose pass@K the start samples, to price the final one


def warm(
    s: DriftSettings,
    models: Models,
    tokenizer: Any,
    cache: ContinuationCache,
    test: Sequence[Example] = (),
    reward: Any = None,
) -> dict[str, float]:
    """Write into ``cache`` the parts of the final report the search cannot change, before it
    starts: the base model's off-task continuations and the base's and the SFT adapter's
    retention answers. The final report then generates the tuned model's part alone, so the
    time after the search is short and known (:func:`tuned_seconds`). Returns the seconds each
    part took ({} when the report has no model part), and ``samples_per_item``: pass@K's
    seconds per test item, timed on the start's samples of the first
    :data:`SAMPLE_PROBE_ITEMS` (sampled answers run longer than the held-out pass's greedy
    ones: on chain_sum, 3x its seconds per row)."""
    from essa.data.task import render_prompts

    d, seconds = s.drift, {}
    if d.prompts and "base" in models.names:
        start = time.perf_counter()
        prompts = rendered_offtask_prompts(s.data, d.prompts, tokenizer)
        with _eval_mode(models.model):
            cache.continuations(models, prompts, d.tokens)
        seconds["continuations"] = time.perf_counter() - start
    source = retention_source(d, s.data)
    if source is not None:
        start = time.perf_counter()
        examples, _ = retention_task(source, d.items)
        prompts = render_prompts(examples, s.data.template, tokenizer, s.data.system_prompt)
        gen = replace(s.generation, max_new_tokens=retention_length(d, s.generation))
        with _eval_mode(models.model):
            held = fixed_answers(replace(models, tools=s.tools), prompts, gen, cache)
        seconds["retention"] = time.perf_counter() - start
        seconds["retention_models"] = len(held)
        start = time.perf_counter()
        with _eval_mode(models.model):
            scored = fixed_choices(models, examples, prompts, s.micro_batch_size, cache)
        if scored:
            seconds["choice"] = time.perf_counter() - start
            seconds["choice_models"] = len(scored)
    probe = list(test[: min(d.items, SAMPLE_PROBE_ITEMS)])
    if d.samples >= 2 and probe and reward is not None:
        start = time.perf_counter()
        gen = replace(s.generation, temperature=d.temperature)
        prompts = render_prompts(probe, s.data.template, tokenizer, s.data.system_prompt)
        with _eval_mode(models.model):
            sampled(replace(models, tools=s.tools), probe, prompts, gen, d.samples, reward, s.seed)
        seconds["samples_per_item"] = (time.perf_counter() - start) / len(probe)
    return seconds


def tuned_seconds(
    s: DriftSettings, warmed: dict[str, float], row_seconds: float, test_items: int
) -> float:
    """The final report's seconds, forecast before the search: the tuned model's retention
    (and forced choice) at the warmed models' rate per model, pass@K at the start's rate per item
    (``samples_per_item``; without it, the held-out pass's rate per row, ``row_seconds``: the
    same prompts, greedy), and its off-task KL forward at the continuations' cost (a
    teacher-forced pass of each model, priced as the generation).

    >>> warmed = {"retention": 20.0, "retention_models": 2, "continuations": 3.0}
    >>> tuned_seconds(_settings(), warmed, 0.05, 500)
    25.8
    >>> tuned_seconds(_settings(), {**warmed, "samples_per_item": 0.4}, 0.05, 500)
    38.6
    """
    d = s.drift
    per_model = warmed.get("retention", 0.0) / max(1, int(warmed.get("retention_models", 0)))
    items = min(d.items, test_items)
    if d.samples < 2:
        samples = 0.0
    elif "samples_per_item" in warmed:
        samples = items * warmed["samples_per_item"]
    else:
        samples = items * d.samples * row_seconds
    choice = warmed.get("choice", 0.0) / max(1, int(warmed.get("choice_models", 0)))
    kl = warmed.get("continuations", 0.0)
    return round(per_model + choice + samples + kl, 1)


def _settings() -> DriftSettings:
    """A run's drift settings at the defaults (the doctests')."""
    return DriftSettings(DriftConfig(), DataConfig(), GenerationConfig(), 64, 0)


def _kl_part(
    s: DriftSettings, models: Models, tokenizer: Any, cache: ContinuationCache | None
) -> dict[str, Any]:
    """Off-task KL (:func:`offtask_kl`) on ``s.drift.prompts`` prompts in the run's template;
    {} when there is no base model to compare with or no prompt."""
    d = s.drift
    if not d.prompts or "base" not in models.names:
        return {}
    prompts = rendered_offtask_prompts(s.data, d.prompts, tokenizer)
    return offtask_kl(models, prompts, d.tokens, s.micro_batch_size, cache)


def pass_figures(
    s: DriftSettings,
    models: Models | None,
    updates: Mapping[str, dict[str, Any]] | None = None,
    cache: ContinuationCache | None = None,
) -> dict[str, float]:
    """The drift figures of an intermediate held-out pass, as flat metrics fields: off-task KL
    (``drift_kl_base``, ``drift_kl_sft``) and the mean relative update of the adapter
    (``drift_update``); {} with ``drift.every_pass`` off. Retention and pass@K, which generate
    far more, are the final report's (:func:`measure`). ``cache``: the run's base
    continuations, generated at its first pass."""
    if not s.drift.every_pass:
        return {}
    out: dict[str, float] = {}
    if models is not None:
        with _eval_mode(models.model):
            kl = _kl_part(s, models, models.tokenizer, cache)
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
    """One console line of the report's headline figures (None when it has none).

    >>> kept = {"source": "builtin:arithmetic", "items": 64, "tuned": 0.5,
    ...         "change_from_base": 0.25, "change_from_sft": -0.125}
    >>> summary_line({"retention": kept})
    'drift: retention (builtin:arithmetic, 64 items) 0.500, vs base +0.250, vs SFT -0.125'
    """
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
        changes = "".join(
            f", vs {name} {kept[f'change_from_{key}']:+.3f}"
            for key, name in (("base", "base"), ("sft", "SFT"))
            if f"change_from_{key}" in kept
        )
        shown = f"retention ({kept['source']}, {kept['items']} items) {kept['tuned']:.3f}"
        parts.append(shown + changes + _choice_part(kept.get("choice")))
    samples = report.get("samples")
    if samples:
        k = samples["k"]
        parts.append(f"pass@{k} {samples[f'pass@{k}']:.3f} maj@{k} {samples[f'maj@{k}']:.3f}")
    return "drift: " + "; ".join(parts) if parts else None


def _choice_part(choice: Mapping[str, Any] | None) -> str:
    """Forced choice's share of the retention line ('' without one).

    >>> _choice_part({"tuned": 0.625, "change_from_sft": 0.0625, "auc_tuned": 0.75,
    ...               "auc_change_from_sft": -0.02})
    ', forced choice 0.625 (vs SFT +0.062), AUC 0.750 (vs SFT -0.020)'
    """
    if not choice or "tuned" not in choice:
        return ""

    def versus(key: str) -> str:
        return "" if key not in choice else f" (vs SFT {choice[key]:+.3f})"

    shown = f", forced choice {choice['tuned']:.3f}{versus('change_from_sft')}"
    return shown + f", AUC {choice['auc_tuned']:.3f}{versus('auc_change_from_sft')}"


def adapter_report(
    s: DriftSettings,
    cache: ContinuationCache,
    h: Harness,
    model: Any,
    tokenizer: Any,
    adapter: SVDAdapter,
    test: list[Example],
    vector: AdapterVector,
) -> dict[str, Any]:
    """ESSA's drift report of ``vector`` (rank 0, after the search): ``model`` is the bare base
    model (None under vLLM: update sizes need W0 too, so nothing is measured). The SFT adapter
    exported unchanged gets its KL and update sizes only: its retention and pass@K would be
    those of the adapter the run started from, not anything the run changed."""
    if model is None:
        return {}
    updates = adapter_updates(model, adapter, vector)
    models = PopulationModels(model, tokenizer, adapter, np.asarray(vector), s.micro_batch_size)
    unchanged = not np.any(vector)
    if unchanged:
        s = replace(s, drift=replace(s.drift, items=0))  # items 0: no retention, no pass@K
    with h.phase("drift"):
        report = measure(s, models, tokenizer, test, h.metric, updates, cache)
    line = summary_line(report)
    if line is not None:
        h.say(line)
    if unchanged:
        h.say("drift: the SFT adapter exported unchanged; retention and pass@K not measured")
    return report


def adapter_warm(
    s: DriftSettings,
    cache: ContinuationCache,
    h: Harness,
    model: Any,
    tokenizer: Any,
    adapter: SVDAdapter,
    test: Sequence[Example] = (),
) -> Callable[[float, int], float]:
    """ESSA's :func:`warm` (rank 0, which writes the report, before the search; ``model``
    None under vLLM: nothing); the report's forecast, (seconds of a held-out row, items) ->
    seconds (:func:`tuned_seconds`). The run calls it once it knows it will search."""
    warmed: dict[str, float] = {}
    if model is not None and h.is_root:
        zeros = np.zeros(adapter.dim)  # the tuned row is not generated here
        models = PopulationModels(model, tokenizer, adapter, zeros, s.micro_batch_size)
        with h.phase("drift baseline"):
            warmed = warm(s, models, tokenizer, cache, test, h.metric)
    return functools.partial(tuned_seconds, s, warmed)


def adapter_pass_figures(
    s: DriftSettings,
    cache: ContinuationCache,
    model: Any,
    tokenizer: Any,
    adapter: SVDAdapter,
    vector: AdapterVector,
) -> dict[str, float]:
    """ESSA's :func:`pass_figures` for ``vector`` (rank 0; ``model`` None under vLLM: none)."""
    if model is None or not s.drift.every_pass:
        return {}
    models = PopulationModels(model, tokenizer, adapter, np.asarray(vector), s.micro_batch_size)
    w0 = base_weights(model, adapter.module_names)  # a pass reads the final update size only
    updates = None if w0 is None else {"final": update_size(adapter.delta_weights(vector), w0)}
    return pass_figures(s, models, updates, cache)
