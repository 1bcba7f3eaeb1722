"""A gradient run's drift report (essa/drift/): the models it compares, the parts written
before training (what training cannot change), the seconds kept for it inside the budget, and
the report of the final policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from essa.drift.models import PeftModels
from essa.drift.report import (
    DriftSettings,
    measure,
    pass_figures,
    summary_line,
    tuned_seconds,
    warm,
)
from essa.drift.update import peft_updates

if TYPE_CHECKING:
    from essa.gradient.policy import Policy
    from essa.harness import Harness
    from essa.types import Example


@dataclass(frozen=True)
class PolicyDrift:
    """The drift report of a policy trained by gradient. ``lisa``: LISA trains the base weights
    (the SFT adapter merged in), so there is neither a base nor an adapter to compare: the
    tuned model only, and no update sizes."""

    settings: DriftSettings
    lisa: bool = False

    def models(self, policy: Policy, tokenizer: Any) -> tuple[PeftModels, Any]:
        """(models, update sizes) the report compares."""
        sft = None if self.lisa else policy.frozen_reference
        mb = self.settings.micro_batch_size
        models = PeftModels(policy.model, tokenizer, mb, sft=sft, has_base=not self.lisa)
        return models, None if self.lisa else peft_updates(policy.model, sft)

    def warm(
        self, h: Harness, policy: Policy, tokenizer: Any, test: list[Example]
    ) -> dict[str, float]:
        """Write the parts training cannot change (essa.drift.report.warm), rank 0, which
        writes the report; the seconds each took (pass@K's priced on the start's samples of
        the first ``test`` items)."""
        if not h.is_root:
            return {}
        models, _ = self.models(policy, tokenizer)
        with h.phase("drift baseline"):
            return warm(self.settings, models, tokenizer, policy.offtask, test, h.metric)

    def reserve(self, h: Harness, warmed: dict[str, float], items: int) -> float:
        """Keep the passes after training inside the budget (``h.end_reserve``): the final
        held-out pass, as long as the held-out baseline, and the report's forecast."""
        seconds = h.reporter.actual.get("held-out baseline", 0.0)
        report = tuned_seconds(self.settings, warmed, seconds / max(1, items), items)
        h.end_reserve = round(seconds + report, 1)
        return h.end_reserve

    def pass_figures(self, policy: Policy, tokenizer: Any) -> dict[str, float]:
        """A held-out pass's drift figures (essa.drift.report.pass_figures)."""
        models, updates = self.models(policy, tokenizer)
        return pass_figures(self.settings, models, updates, policy.offtask)

    def report(
        self, h: Harness, policy: Policy, tokenizer: Any, test: list[Example]
    ) -> dict[str, Any]:
        """The final policy's report, and its console line."""
        models, updates = self.models(policy, tokenizer)
        # Not under policy.inference(): its cached factors would outlive frozen_reference's swap.
        with h.phase("drift"):
            report = measure(
                self.settings, models, tokenizer, test, h.metric, updates, policy.offtask
            )
        if (line := summary_line(report)) is not None:
            h.say(line)
        return report
