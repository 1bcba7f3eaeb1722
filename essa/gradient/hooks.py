"""The GRPO step's three hooks (essa/recipes/grpo.py), where its optional features plug in:

* what is sampled: a :class:`SamplingHook` is an option that
  :func:`~essa.gradient.sampling.sample_groups` consults and that keeps state across steps;
* how advantages are made: the variant's group-normalised outcome advantages
  (essa/gradient/outcome.py), then each :class:`AdvantageHook` in turn;
* what the loss masks: the completion tokens of the rows the variant keeps, less the rows each
  :class:`MaskHook` drops.

A hook returns its metrics, which join the step's record. :class:`Hooks` holds a run's hooks and
runs each stage; with none, the step is plain GRPO. Which feature sits on which hook:
essa/gradient/features.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
from torch import Tensor

from essa.gradient.policy import Rollout

if TYPE_CHECKING:
    from essa.data.selection import Informative
    from essa.gradient.informative import InformativePrompts
    from essa.gradient.replay import Experience, Replay, ReplayBuffer

State = dict[str, Any]  # the run's checkpointed state (plain JSON): a hook's own keys
Record = dict[str, Any]  # one step's metrics


@dataclass(frozen=True)
class StepBatch:
    """The step's training rows, as the advantage and mask hooks see them."""

    rollout: Rollout  # B rows: the fresh completions, group-major, then the replayed ones
    rewards: Tensor  # (N, G + k) the kept groups' rewards; NaN: ungradable or no replay
    prompt_ids: list[int]  # (N,) each kept group's training prompt
    group_index: Tensor  # (B,) each row's group
    slot: Tensor  # (B,) each row's column in ``rewards``
    credit: list[Tensor]  # (n_i*G, T_i) per sampling round: PRM step credit (else empty)


class RowAdvantages(NamedTuple):
    values: Tensor  # (B,), or (B, T) once a hook gives each token its own
    keep: Tensor  # (B,) bool: the row takes part in the loss (PSR / NSR drop some)


class SamplingHook(Protocol):
    """What is sampled: an option sample_groups consults, with state carried across steps."""

    def end(
        self,
        replays: Sequence[Sequence[Experience]],
        found: Sequence[Experience],
        state: State,
    ) -> Record:
        """After the step's sampling: its metrics; the option's state written into ``state``.

        ``replays``: each kept group's replayed successes; ``found``: the fresh rows' verified
        successes."""
        ...


class AdvantageHook(Protocol):
    """How advantages are made: the step's advantages so far in, the new ones out."""

    def __call__(self, adv: RowAdvantages, rows: StepBatch) -> tuple[RowAdvantages, Record]: ...


class MaskHook(Protocol):
    """What the loss masks: (B,) bool, the rows that take no gradient this step."""

    def __call__(self, batch: Rollout) -> tuple[Tensor, Record]: ...


@dataclass(frozen=True)
class Hooks:
    """The run's hooks, each stage in the order the step meets its features."""

    informative: InformativePrompts | None = None  # data.selection / data.hints
    replay: Replay | None = None  # grpo.replay (RLEP)
    advantages: tuple[AdvantageHook, ...] = ()  # after the group's outcome advantages
    masks: tuple[MaskHook, ...] = ()

    def sources(self) -> tuple[Informative | None, ReplayBuffer | None]:
        """What sample_groups consults: the informative prompts and the replay buffer."""
        informative = None if self.informative is None else self.informative.prompts
        return informative, None if self.replay is None else self.replay.buffer

    def sampled(
        self,
        replays: Sequence[Sequence[Experience]],
        found: Sequence[Experience],
        state: State,
    ) -> Record:
        """Every sampling hook's :meth:`SamplingHook.end`, merged."""
        hooks: list[SamplingHook] = [h for h in (self.informative, self.replay) if h is not None]
        return {k: v for hook in hooks for k, v in hook.end(replays, found, state).items()}

    def made(self, adv: RowAdvantages, rows: StepBatch) -> tuple[RowAdvantages, Record]:
        """The outcome advantages ``adv`` through each advantage hook in turn."""
        record: Record = {}
        for hook in self.advantages:
            adv, metrics = hook(adv, rows)
            record.update(metrics)
        return adv, record

    def loss_mask(self, batch: Rollout, keep: Tensor) -> tuple[Tensor, Record]:
        """(B, T): the completion tokens of the kept rows (``keep`` (B,)), less the dropped."""
        mask = batch.mask * keep[:, None]  # (B, T)
        record: Record = {}
        for hook in self.masks:
            dropped, metrics = hook(batch)  # (B,)
            mask = mask * ~dropped[:, None]
            record.update(metrics)
        return mask, record


def no_rows(batch: Rollout) -> Tensor:
    """(B,) bool, all False: a mask hook that drops nothing this step."""
    return torch.zeros(batch.mask.shape[0], dtype=torch.bool)
