"""GRPO rollouts that call the Python tool (ToRL; SimpleTIR's void-turn filter).

Each turn samples the running rows with :func:`~essa.gradient.policy.rollout_from_ids`
(``generate``, one batched forward per step, a row stopping at EOS or when its code block
closes); between turns the sandbox runs the blocks (essa.tools.turns.run_turns) and a calling
row's next context is its prompt, its turns and the output block. The rollout's completion is
the whole transcript: the policy's tokens carry ``mask`` 1 and the tool's output tokens 0, so
the loss never trains the model to write what the interpreter wrote (ToRL), while every later
token is scored with the output in its context (``attention_mask`` 1 on them).

SimpleTIR's filter (``tools.python.drop_void_turns``): a trajectory with a void turn, one that
ends with neither a closed code block nor an answer, gets mask 0 everywhere (no gradient);
its reward still counts in its group's mean and std. "An answer" here: the turn ended on a stop
token and its text has one by :func:`essa.rewards.extract.extract_answer`. In the GRPO step the
filter is a mask hook (essa/gradient/hooks.py), :func:`void_rows`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from essa import seeding
from essa.backends.stops import ToolCallStop, stop_token_ids
from essa.gradient.hooks import Record, no_rows
from essa.gradient.policy import Policy, Rollout, Sampling, rollout_from_ids
from essa.tools.turns import Transcript, is_void, run_turns


def tool_rollout(
    policy: Policy,
    tokenizer: Any,
    prompts: Sequence[str],
    sampling: Sampling,
    seed: int,
    progress: Callable[[int], None] | None = None,
    temperature: float | None = None,
) -> Rollout:
    """One tool-integrated completion per prompt row (see the module docstring)."""
    tools = sampling.tools
    assert tools is not None
    prompt_ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    stopping = ToolCallStop(tokenizer, tools)
    pad = tokenizer.pad_token_id
    turn = [0]

    def one_turn(rows: list[int], contexts: list[list[int]], may_call: bool) -> list[list[int]]:
        ids, attention = left_pad(contexts, pad)
        out = rollout_from_ids(
            policy, tokenizer, ids, attention, sampling,
            seed if turn[0] == 0 else seeding.seed_int(seed, "tools.turn", turn[0]),
            progress if turn[0] == 0 else None,
            temperature=temperature, stopping=stopping if may_call else None,
        )  # fmt: skip
        turn[0] += 1
        lengths = out.mask.sum(-1).long().tolist()
        return [row[:n].tolist() for row, n in zip(out.completion_ids, lengths, strict=True)]

    stops = stop_token_ids(tokenizer, getattr(policy.model, "generation_config", None))
    transcripts = run_turns(prompt_ids, one_turn, tokenizer, tools, None, stops)
    return assemble(prompt_ids, transcripts, tokenizer)


def left_pad(rows: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), each (B, T), left-padded as ``generate`` wants them."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)  # (B, T)
    attention = torch.zeros((len(rows), width), dtype=torch.long)  # (B, T)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row) :] = torch.as_tensor(list(row), dtype=torch.long)
            attention[i, width - len(row) :] = 1
    return ids, attention


def assemble(
    prompt_ids: Sequence[Sequence[int]], transcripts: list[Transcript], tokenizer: Any
) -> Rollout:
    """The rollout of the transcripts: prompts left-padded, transcripts right-padded; the loss
    mask is 1 on the policy's tokens only, the attention mask on every real token."""
    pad = tokenizer.pad_token_id
    prompt, prompt_attention = left_pad(prompt_ids, pad)  # (B, P)
    width = max((len(t.ids) for t in transcripts), default=0)
    completion = torch.full((len(transcripts), width), pad, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(transcripts), width))  # (B, T) the policy's tokens
    attention = torch.zeros((len(transcripts), width), dtype=torch.long)  # (B, T) real tokens
    for i, t in enumerate(transcripts):
        at = 0
        for ids, own in t.segments:
            completion[i, at : at + len(ids)] = torch.as_tensor(ids, dtype=torch.long)
            mask[i, at : at + len(ids)] = float(own)
            attention[i, at : at + len(ids)] = 1
            at += len(ids)
    return Rollout(
        input_ids=torch.cat([prompt, completion], dim=1),
        attention_mask=torch.cat([prompt_attention, attention], dim=1),
        completion_ids=completion,
        mask=mask,
        truncated=torch.tensor([bool(t.ends) and t.ends[-1] == "length" for t in transcripts]),
        texts=[tokenizer.decode(t.ids, skip_special_tokens=True) for t in transcripts],
        transcripts=transcripts,
    )


def void_turns(transcripts: Sequence[Transcript]) -> torch.Tensor:
    """(B,) bool: trajectories with a turn that ends with neither a closed code block nor an
    answer (SimpleTIR's void turn, :func:`essa.tools.turns.is_void`)."""
    from essa.rewards.extract import extract_answer

    return torch.tensor(
        [is_void(t, extract_answer(t.turns[-1]) if t.turns else None) for t in transcripts],
        dtype=torch.bool,
    )


def void_rows(batch: Rollout) -> tuple[torch.Tensor, Record]:
    """``tools.python.drop_void_turns`` as a mask hook: the (B,) void trajectories, and their
    count as void_trajectories (nothing for a batch without transcripts)."""
    if batch.transcripts is None:
        return no_rows(batch), {}
    void = void_turns(batch.transcripts)  # (B,)
    return void, {"void_trajectories": int(void.sum())}
