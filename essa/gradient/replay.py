"""RLEP experience replay for the GRPO recipe (Zhang et al., arXiv 2507.07451).

A buffer of verified successes (completions whose reward reached ``grpo.replay.min_reward``),
collected online from every step's fresh rollouts and optionally seeded from a JSONL file of
``{"prompt", "completion"}`` lines (a first phase: e.g. an earlier run's ``replay.jsonl``).
Each step, every drawn prompt's group of G fresh completions is extended by up to
k = round(ratio · G) of that prompt's stored successes, and the group advantage is formed over
all G + k rewards, as RLEP's verl recipe does (``experience_replay_num`` responses join each
prompt's ``rollout.n`` in one group; 2 + 16 in its script). docs/grpo-rlep-entropy.md has the
formulas and our choices.

Deviations from RLEP:
* the buffer also fills online from the run's own rollouts (RLEP's pool is built once, offline,
  from a phase-1 checkpoint; seeding from a file gives that two-phase form);
* the buffer holds distinct completions per prompt (a duplicate is not stored twice) and is
  FIFO at ``capacity`` completions;
* a replayed completion keeps the reward it was verified with (RLEP re-scores it; a
  deterministic verifier gives the same number); group rewards are refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from essa.config import ReplayConfig
from essa.errors import UserError
from essa.gradient.policy import Rollout
from essa.rewards.base import Reward


@dataclass(frozen=True)
class Experience:
    """One verified success: a completion of training prompt ``prompt_id``."""

    prompt_id: int  # stable index into the training prompts
    completion_ids: tuple[int, ...]  # the completion's tokens up to and including EOS
    reward: float  # as scored when it was verified (>= min_reward)
    text: str


@dataclass
class ReplayBuffer:
    capacity: int
    entries: list[Experience]  # oldest first

    def add(self, items: Sequence[Experience]) -> int:
        """Store the new distinct successes, dropping the oldest beyond capacity; count added."""
        seen = {(e.prompt_id, e.completion_ids) for e in self.entries}
        added = 0
        for item in items:
            key = (item.prompt_id, item.completion_ids)
            if key not in seen:
                seen.add(key)
                self.entries.append(item)
                added += 1
        del self.entries[: max(0, len(self.entries) - self.capacity)]
        return added

    def draw(
        self, prompt_ids: Sequence[int], k: int, rng: np.random.Generator
    ) -> list[list[Experience]]:
        """Up to k stored successes of each prompt, without replacement within a group."""
        by_prompt: dict[int, list[Experience]] = {}
        for entry in self.entries:
            by_prompt.setdefault(entry.prompt_id, []).append(entry)
        drawn = []
        for prompt_id in prompt_ids:
            pool = by_prompt.get(prompt_id, [])
            m = min(k, len(pool))
            picks = rng.choice(len(pool), size=m, replace=False).tolist() if m else []
            drawn.append([pool[i] for i in picks])
        return drawn

    def to_json(self) -> list[list[Any]]:
        return [[e.prompt_id, list(e.completion_ids), e.reward, e.text] for e in self.entries]

    @classmethod
    def from_json(cls, capacity: int, data: list[list[Any]]) -> ReplayBuffer:
        entries = [
            Experience(int(p), tuple(int(i) for i in ids), float(r), str(t))
            for p, ids, r, t in data
        ]
        return cls(capacity, entries)


@dataclass(frozen=True)
class Replay:
    """RLEP in the GRPO step: the buffer sample_groups draws replays from; :meth:`end` is the
    sampling hook (essa/gradient/hooks.py) that stores the step's fresh successes."""

    buffer: ReplayBuffer

    @classmethod
    def build(cls, r: ReplayConfig, state: dict[str, Any]) -> Replay | None:
        """The hook when ``grpo.replay.capacity`` is set, on the buffer in the run state."""
        return cls(ReplayBuffer.from_json(r.capacity, state["replay"])) if r.capacity else None

    def end(
        self,
        replays: Sequence[Sequence[Experience]],
        found: Sequence[Experience],
        state: dict[str, Any],
    ) -> dict[str, Any]:
        """replayed, replay_added, replay_buffer_size; the buffer into ``state`` (JSON)."""
        record = {
            "replayed": sum(len(r) for r in replays),
            "replay_added": self.buffer.add(found),  # after drawing: replays are from past steps
            "replay_buffer_size": len(self.buffer.entries),
        }
        state["replay"] = self.buffer.to_json()
        return record


def mixed_group_rewards(
    rewards: torch.Tensor, replays: Sequence[Sequence[Experience]], k: int
) -> torch.Tensor:
    """Fresh rewards (N, G) and each group's replays -> (N, G + k); NaN pads missing replays.

    The advantage functions leave NaN out of every group statistic, so a group with m < k
    replays has exactly G + m members; the padded slots are dropped from the batch.
    """
    extra = torch.full((rewards.shape[0], k), float("nan"), dtype=rewards.dtype)  # (N, k)
    for i, group in enumerate(replays):
        for j, entry in enumerate(group):
            extra[i, j] = entry.reward
    return torch.cat([rewards, extra], dim=1)


def successes(
    out: Rollout, rewards: torch.Tensor, prompt_ids: Sequence[int], min_reward: float
) -> list[Experience]:
    """The rollout rows whose reward (B,) is >= min_reward, as experiences (row order)."""
    found = []
    for row in torch.nonzero(rewards >= min_reward).flatten().tolist():  # NaN compares False
        ids = out.completion_ids[row][out.mask[row].bool()]
        found.append(
            Experience(prompt_ids[row], tuple(ids.tolist()), float(rewards[row]), out.texts[row])
        )
    return found


def replay_rollout(
    tokenizer: Any, prompts: Sequence[str], experiences: Sequence[Experience]
) -> Rollout:
    """Stored completions as a rollout batch in the layout of :func:`grpo_policy.rollout`."""
    batch = tokenizer(list(prompts), return_tensors="pt", padding=True, add_special_tokens=False)
    width = max(len(e.completion_ids) for e in experiences)
    completion = torch.full((len(experiences), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(experiences), width)  # (R, T)
    for row, entry in enumerate(experiences):
        completion[row, : len(entry.completion_ids)] = torch.tensor(entry.completion_ids)
        mask[row, : len(entry.completion_ids)] = 1.0
    # A stored success ended on a stop: EOS, or a model's end-of-turn id (a special token).
    ends = {tokenizer.eos_token_id, *getattr(tokenizer, "all_special_ids", ())}
    truncated = torch.tensor([e.completion_ids[-1] not in ends for e in experiences])
    return Rollout(
        input_ids=torch.cat([batch["input_ids"], completion], dim=1),
        attention_mask=torch.cat([batch["attention_mask"], mask.long()], dim=1),
        completion_ids=completion,
        mask=mask,
        truncated=truncated,
        texts=[e.text for e in experiences],
    )


@dataclass(frozen=True)
class SeedReport:
    lines: int
    stored: int
    unmatched: int  # prompts that are not training prompts of this run
    failed: int  # completions that did not reach min_reward under this run's reward


def seed_experiences(
    path: str,
    tokenizer: Any,
    train_prompts: Sequence[str],
    answers: Sequence[str | None],
    reward: Reward,
    min_reward: float,
) -> tuple[list[Experience], SeedReport]:
    """Read ``{"prompt", "completion"}`` lines, keep the ones this run's reward verifies.

    ``prompt`` must be a rendered training prompt (as samples.jsonl and replay.jsonl write it);
    the completion is tokenized without special tokens and gets EOS appended.
    """
    index: dict[str, int] = {}
    for i, prompt in enumerate(train_prompts):
        index.setdefault(prompt, i)
    rows = _read_seed_file(path)
    matched = [(index[p], c) for p, c in rows if p in index]
    ids = [
        tuple(tokenizer(c, add_special_tokens=False)["input_ids"]) + (tokenizer.eos_token_id,)
        for _, c in matched
    ]
    texts = [tokenizer.decode(list(i[:-1]), skip_special_tokens=True) for i in ids]
    prompts = [train_prompts[p] for p, _ in matched]
    scores = reward(texts, [answers[p] for p, _ in matched], prompts) if matched else []
    kept = [
        Experience(p, i, float(s), t)
        for (p, _), i, t, s in zip(matched, ids, texts, scores, strict=True)
        if s is not None and s >= min_reward
    ]
    report = SeedReport(len(rows), len(kept), len(rows) - len(matched), len(matched) - len(kept))
    return kept, report


def _read_seed_file(path: str) -> list[tuple[str, str]]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"grpo.replay.seed_file: cannot read {path}: {err}") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            item = None
        if (
            not isinstance(item, dict)
            or not isinstance(item.get("prompt"), str)
            or not isinstance(item.get("completion"), str)
        ):
            raise UserError(
                f'{path}:{n}: grpo.replay.seed_file: expected a JSON object with string "prompt" and "completion"'
            )
        rows.append((item["prompt"], item["completion"]))
    return rows


def write_buffer(path: Path, buffer: ReplayBuffer, train_prompts: Sequence[str]) -> None:
    """RUN_DIR/replay.jsonl: the buffer as seed lines (prompt, completion, reward)."""
    with path.open("w", encoding="utf-8") as f:
        for e in buffer.entries:
            line = {"prompt": train_prompts[e.prompt_id], "completion": e.text, "reward": e.reward}
            f.write(json.dumps(line) + "\n")


def seeded_buffer(
    r: ReplayConfig,
    tokenizer: Any,
    train: Sequence[Any],
    train_prompts: Sequence[str],
    reward: Reward,
) -> tuple[list[Any], str]:
    """The buffer seeded from ``grpo.replay.seed_file`` (RLEP's first phase), as JSON, and the
    line that says what was kept. ``train``: the training examples (their answers)."""
    assert r.seed_file is not None
    answers = [e.answer for e in train]
    found, report = seed_experiences(
        r.seed_file, tokenizer, train_prompts, answers, reward, r.min_reward
    )
    buffer = ReplayBuffer(r.capacity, [])
    buffer.add(found)
    line = (
        f"replay: seeded {len(buffer.entries)} verified completions from {r.seed_file} "
        f"({report.lines} lines: {report.unmatched} not training prompts of this run, "
        f"{report.failed} below min_reward {r.min_reward})"
    )
    return buffer.to_json(), line


def first_buffer(
    r: ReplayConfig,
    tokenizer: Any,
    train: Sequence[Any],
    train_prompts: Sequence[str],
    reward: Reward,
    say: Callable[[str], None],
) -> list[Any]:
    """A fresh run's buffer, as JSON: seeded from ``grpo.replay.seed_file`` (saying what was
    kept), else empty."""
    if r.seed_file is None:
        return []
    buffer, line = seeded_buffer(r, tokenizer, train, train_prompts, reward)
    say(line)
    return buffer
