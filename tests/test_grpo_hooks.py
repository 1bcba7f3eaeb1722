"""The GRPO step's hooks (essa/gradient/hooks.py): what is sampled, how advantages are made, what
the loss masks, each stage on hand-built batches, and which hooks the config plugs in."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from essa.config import load_config
from essa.gradient import losses as L
from essa.gradient.features import grpo_hooks
from essa.gradient.hooks import Hooks, RowAdvantages, StepBatch
from essa.gradient.informative import InformativePrompts
from essa.gradient.outcome import outcome_advantages
from essa.gradient.policy import Policy, Rollout
from essa.gradient.prime import ImplicitPRM, ProcessAdvantages
from essa.gradient.prm_credit import step_credit_advantages
from essa.gradient.replay import Experience, Replay
from essa.gradient.tool_rollout import void_rows
from essa.gradient.truncation import truncated_rows
from essa.tools.turns import Transcript

NAN = math.nan


def batch(mask: list[list[float]], truncated: list[bool], transcripts=None) -> Rollout:  # type: ignore[no-untyped-def]
    """A rollout of B rows with the given completion mask (B, T); the ids do not matter here."""
    m = torch.tensor(mask)  # (B, T)
    ids = torch.ones(m.shape, dtype=torch.long)
    return Rollout(
        input_ids=ids,
        attention_mask=m.long(),
        completion_ids=ids,
        mask=m,
        truncated=torch.tensor(truncated),
        texts=[""] * m.shape[0],
        transcripts=transcripts,
    )


def rows_of(rollout: Rollout, rewards: list[list[float]], **fields) -> StepBatch:  # type: ignore[no-untyped-def]
    """The step batch of N groups of G fresh rows (group-major), no replays."""
    r = torch.tensor(rewards)  # (N, G)
    n, g = r.shape
    return StepBatch(
        rollout=rollout,
        rewards=r,
        prompt_ids=fields.get("prompt_ids", list(range(n))),
        group_index=torch.arange(n).repeat_interleave(g),
        slot=torch.arange(g).repeat(n),
        credit=fields.get("credit", []),
    )


# ------------------------------------------------------------------------ what the loss masks


def test_loss_mask_is_the_kept_rows_less_the_truncated_and_void_ones() -> None:
    transcripts = [
        Transcript(ends=["stop"], turns=["3"]),  # an answer: not void
        Transcript(ends=["length"], turns=["12"]),  # cut off: void (and truncated)
        Transcript(ends=["stop"], turns=["no answer"]),  # neither a block nor an answer: void
        Transcript(ends=["stop"], turns=["7"]),
    ]
    out = batch(
        [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], [False, True, False, False], transcripts
    )
    keep = torch.tensor([True, True, True, False])  # the variant drops row 3
    mask, record = Hooks(masks=(truncated_rows, void_rows)).loss_mask(out, keep)
    assert mask.tolist() == [[1, 1, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert mask.dtype == out.mask.dtype
    assert record == {"void_trajectories": 2}
    # each hook alone drops only its own rows; no hooks: the completion tokens of the kept rows
    assert Hooks(masks=(truncated_rows,)).loss_mask(out, keep)[0][:, 0].tolist() == [1, 0, 1, 0]
    plain, nothing = Hooks().loss_mask(out, keep)
    assert torch.equal(plain, out.mask * keep[:, None]) and nothing == {}


def test_void_turns_drop_nothing_from_a_batch_without_transcripts() -> None:
    out = batch([[1, 0], [1, 1]], [True, False])
    dropped, record = void_rows(out)
    assert dropped.tolist() == [False, False] and record == {}


# --------------------------------------------------------------- how advantages are made


def test_outcome_advantages_are_read_at_each_rows_group_and_slot() -> None:
    rows = rows_of(batch([[1, 1]] * 4, [False] * 4), [[1.0, 0.0], [NAN, 1.0]])
    state = {"history": {}}
    adv = outcome_advantages(L.get_variant("dr_grpo"), rows, state)
    assert adv.values.tolist() == [0.5, -0.5, 0.0, 0.0]  # NaN: no advantage, one left: 0
    assert adv.keep.tolist() == [True] * 4  # ungradable rows stay in the normalisers (TRL)
    psr = outcome_advantages(L.get_variant("psr"), rows, state)
    assert psr.values.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert psr.keep.tolist() == [True, False, False, True]  # PSR trains on the correct rows only
    assert state == {"history": {}}  # only DCPO keeps a history


def test_dcpo_history_lives_in_the_run_state() -> None:
    rows = rows_of(batch([[1]] * 4, [False] * 4), [[1.0, 0.0], [1.0, 1.0]], prompt_ids=[7, 3])
    state: dict = {"history": {}}
    outcome_advantages(L.get_variant("dcpo"), rows, state)
    assert sorted(state["history"]) == ["3", "7"]
    visits = state["history"]["7"][0]
    outcome_advantages(L.get_variant("dcpo"), rows, state)
    assert state["history"]["7"][0] == visits + 1  # read back and updated on the next step


def test_advantage_hooks_run_in_turn_and_keep_the_variants_rows() -> None:
    out = batch([[1, 1, 1], [1, 1, 0]], [False, False])
    credit = torch.tensor([[0.0, -0.5, -0.5], [0.0, 0.25, 0.0]])  # (n*G, T) one round
    rows = rows_of(out, [[1.0, 0.0]], credit=[credit])
    start = RowAdvantages(torch.tensor([1.0, -1.0]), torch.tensor([True, False]))

    def doubled(adv: RowAdvantages, rows: StepBatch) -> tuple[RowAdvantages, dict]:
        return RowAdvantages(2 * adv.values, adv.keep), {"doubled": True}

    adv, record = Hooks(advantages=(step_credit_advantages, doubled)).made(start, rows)
    assert adv.values.tolist() == [[2.0, 1.0, 1.0], [-2.0, -1.5, -2.0]]  # 2 (A_i + credit)
    assert adv.keep.tolist() == [True, False]
    assert record["doubled"] is True
    assert record["prm_step_credit"] == pytest.approx((0.5 + 0.5 + 0.25) / 5)
    same, nothing = Hooks().made(start, rows)
    assert same is start and nothing == {}


# --------------------------------------------------------------------- what is sampled


def experience(prompt_id: int, *ids: int) -> Experience:
    return Experience(prompt_id, ids, 1.0, "".join(map(str, ids)))


def test_replay_hook_stores_the_fresh_successes_and_checkpoints_the_buffer() -> None:
    from essa.config import ReplayConfig

    assert Replay.build(ReplayConfig(capacity=0), {"replay": []}) is None
    state: dict = {"replay": [[0, [5, 1], 1.0, "51"]]}
    hook = Replay.build(ReplayConfig(capacity=2, ratio=0.5), state)
    assert hook is not None and Hooks(replay=hook).sources() == (None, hook.buffer)
    found = [experience(0, 5, 1), experience(1, 6, 1), experience(2, 7, 1)]  # one known
    record = Hooks(replay=hook).sampled([[experience(0, 5, 1)], []], found, state)
    assert record == {"replayed": 1, "replay_added": 2, "replay_buffer_size": 2}
    assert state["replay"] == [[1, [6, 1], 1.0, "61"], [2, [7, 1], 1.0, "71"]]  # FIFO at 2


def test_informative_hook_logs_the_step_and_checkpoints_the_history() -> None:
    off = load_config(None, ["algorithm=grpo"])
    assert InformativePrompts.build(off.data, 0, 4, None, {}) is None
    on = load_config(None, ["algorithm=grpo", "data.selection.name=greso", "data.hints.after=1"])
    hook = InformativePrompts.build(on.data, 0, 4, None, {})
    assert hook is not None
    assert Hooks(informative=hook).sources() == (hook.prompts, None)
    hook.prompts.observe([3], torch.tensor([[0.0, 0.0, 0.0, 0.0]]).numpy())  # all wrong: hard
    state: dict = {}
    record = Hooks(informative=hook).sampled([], [], state)
    assert {"prompts_skipped", "rows_saved", "prompts_hinted", "zero_spread_fraction"} <= set(
        record
    )
    assert state["informative"]["prompts"]["3"][0] == 1  # one visit of prompt 3
    resumed = InformativePrompts.build(on.data, 0, 4, None, state)
    assert resumed is not None and resumed.prompts.state_dict() == state["informative"]


# ----------------------------------------------------------------- the config's hooks


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        ([], ((), ())),
        (["grpo.loss=dapo"], ((), (truncated_rows,))),
        (
            ["tools.python.max_tool_calls=2", "tools.python.drop_void_turns=true"],
            ((), (void_rows,)),
        ),
        (["grpo.prm_credit=step", "reward.name=prm"], ((step_credit_advantages,), ())),
    ],
)
def test_the_config_plugs_in_its_hooks(tiny_lora, sets: list[str], expected) -> None:  # type: ignore[no-untyped-def]
    cfg = load_config(None, ["algorithm=grpo", *sets])
    g = cfg.grpo
    policy = Policy.build(copy.deepcopy(tiny_lora[0]), "lora", 1.0)
    state = {"replay": [], "history": {}}
    hooks = grpo_hooks(
        g, cfg.data, cfg.tools.python, 0, L.get_variant(g.loss), policy, None, state, None
    )
    assert (hooks.advantages, hooks.masks) == expected
    assert hooks.informative is None and hooks.replay is None


def test_the_config_plugs_in_prime_replay_and_informative_prompts(tiny_lora) -> None:  # type: ignore[no-untyped-def]
    sets = ["grpo.prime.enabled=true", "data.selection.name=greso"]
    cfg = load_config(None, ["algorithm=grpo", *sets])
    g = cfg.grpo
    policy = Policy.build(copy.deepcopy(tiny_lora[0]), "lora", 1.0)
    prime = ImplicitPRM.build(g, policy)
    state = {"replay": [], "history": {}}
    variant = L.get_variant(g.loss)
    hooks = grpo_hooks(g, cfg.data, cfg.tools.python, 0, variant, policy, None, state, prime)
    assert hooks.advantages == (ProcessAdvantages(prime, policy, g),)  # type: ignore[arg-type]
    assert hooks.informative is not None and hooks.replay is None
    replayed = load_config(None, ["algorithm=grpo", "grpo.replay.capacity=4"])
    hooks = grpo_hooks(
        replayed.grpo, cfg.data, cfg.tools.python, 0, variant, policy, None, state, None
    )
    assert hooks.replay is not None and hooks.replay.buffer.capacity == 4
