"""The reference as a greedy draft: the prefill that scores each row's reference also writes the
part of it that greedy decoding would write, and the completions stay greedy's.

Runs the bundled demo model with perturbed candidates (some answer right, some wrong, some
never stop), references that are right, wrong, partly right, missing or longer than the
completion budget.
"""

from __future__ import annotations

import functools

import pytest

from essa.config import EvaluationConfig, GenerationConfig
from tests import test_decode
from tests.test_decode import FEW_SHOT, QUESTIONS

demo = test_decode.demo  # the fixture: the demo model, its adapter and four candidates

MAX_NEW = 6


def references(plain: list[str]) -> list[str | None]:
    """Per prompt: the candidate's own answer, a wrong one, a partly right one, none, and one
    longer than the completion budget."""
    refs: list[str | None] = []
    for i, text in enumerate(plain):
        kind = i % 5
        if kind == 0:
            refs.append(text)
        elif kind == 1:
            refs.append("77")
        elif kind == 2:
            refs.append((text[:1] or "1") + "9")
        elif kind == 3:
            refs.append(None)
        else:
            refs.append(text + "1234567890")
    return refs


def evaluate(demo, monkeypatch, prompts, refs, *, draft: bool, **options):  # type: ignore[no-untyped-def]
    """(completions, reference log-probs, decode steps: forwards of one new token per row)."""
    from essa.backends.evaluator import PopulationEvaluator

    model, tokenizer, adapter, x = demo
    steps: list[int] = []
    forward = model.forward

    @functools.wraps(forward)  # keeps the signature that the fast path inspects
    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] == 1:
            steps.append(ids.shape[0])
        return forward(*args, **kwargs)

    cfg = EvaluationConfig(reference_draft=draft, **options)
    gen = GenerationConfig(max_new_tokens=MAX_NEW)
    evaluator = PopulationEvaluator(model, tokenizer, adapter, gen, cfg)
    with monkeypatch.context() as patch:
        patch.setattr(model, "forward", counting)
        out = evaluator.completions(x, prompts, references=refs)
    return out, evaluator.last_reference_logprobs, sum(steps), evaluator


@pytest.mark.parametrize("strategy", ["batched", "merged"])
@pytest.mark.parametrize("use_prefix_cache", [False, True])
def test_draft_keeps_greedy_completions_and_reference_logprobs(
    demo, monkeypatch, strategy: str, use_prefix_cache: bool
) -> None:  # type: ignore[no-untyped-def]
    prompts = [FEW_SHOT + q for q in QUESTIONS] if use_prefix_cache else QUESTIONS
    options = dict(strategy=strategy, use_prefix_cache=use_prefix_cache, micro_batch_size=5)
    plain, _, _, _ = evaluate(demo, monkeypatch, prompts, None, draft=False, **options)
    refs = references(plain[0])
    off, off_logprobs, off_steps, _ = evaluate(
        demo, monkeypatch, prompts, refs, draft=False, **options
    )
    on, on_logprobs, on_steps, _ = evaluate(demo, monkeypatch, prompts, refs, draft=True, **options)
    assert on == off == plain
    assert on_logprobs == off_logprobs  # the same prefill: the same numbers
    assert on_steps < off_steps, (on_steps, off_steps)
    lengths = {len(t) for c in plain for t in c}
    assert len(lengths) >= 3, f"answers should vary in length, got {lengths}"


def test_a_row_that_writes_its_reference_takes_no_decode_step(demo, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Candidate 0 with its own answers as references: every row is decided in the prefill,
    except for the stop token after the reference, which the prefill's last column gives too."""
    model, tokenizer, adapter, x = demo
    plain, _, _, _ = evaluate(demo, monkeypatch, QUESTIONS, None, draft=False, strategy="batched")
    assert all(plain[0]), "the SFT candidate should answer every question"
    demo_one = (model, tokenizer, adapter, x[:1])
    out, _, steps, _ = evaluate(
        demo_one, monkeypatch, QUESTIONS, plain[0], draft=True, strategy="batched"
    )
    assert out[0] == plain[0]
    assert steps == 0


def test_nonfinite_candidates_are_flagged_with_a_draft(demo, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer, adapter, x = demo
    sick = x.copy()
    sick[2] = 1e30  # overflows: NaN/inf logits
    refs = ["15", "52", "2", "198", "65", "6", "99", "7"]
    out, _, _, evaluator = evaluate(
        (model, tokenizer, adapter, sick), monkeypatch, QUESTIONS, refs, draft=True,
        strategy="batched",
    )  # fmt: skip
    assert evaluator.nonfinite.tolist() == [False, False, True, False]
    assert out[2] == [""] * len(QUESTIONS)


def test_draft_applies_only_where_it_is_greedy_exactly(demo) -> None:  # type: ignore[no-untyped-def]
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    from essa.backends.decode import draft_applies

    model = demo[0]
    none = LogitsProcessorList()
    assert draft_applies(model, none, greedy=True, columns=64)
    assert not draft_applies(model, none, greedy=False, columns=64)
    penalty = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.2)])
    assert not draft_applies(model, penalty, greedy=True, columns=64)


@pytest.mark.parametrize("draft", [False, True])
def test_margins_are_zero_where_greedy_writes_the_reference(demo, monkeypatch, draft: bool) -> None:  # type: ignore[no-untyped-def]
    """reward.reference_signal: margin reads log p(y*_t) - max_v log p(v) from the same prefill:
    the completions do not change, every margin is <= 0 and >= the token's log-prob, and a
    reference that is the candidate's own greedy answer has margin 0 at every token."""
    options = dict(strategy="batched", micro_batch_size=5)
    plain, _, _, _ = evaluate(demo, monkeypatch, QUESTIONS, None, draft=False, **options)
    refs = references(plain[0])
    texts, logprobs, _, _ = evaluate(demo, monkeypatch, QUESTIONS, refs, draft=draft, **options)
    from essa.backends.evaluator import PopulationEvaluator

    model, tokenizer, adapter, x = demo
    cfg = EvaluationConfig(reference_draft=draft, **options)
    evaluator = PopulationEvaluator(
        model, tokenizer, adapter, GenerationConfig(max_new_tokens=MAX_NEW), cfg
    )
    evaluator.reference_margin = True
    assert evaluator.completions(x, QUESTIONS, references=refs) == texts == plain
    margins = evaluator.last_reference_logprobs  # [candidate][item][token]
    for cand_lp, cand_m in zip(logprobs, margins, strict=True):
        for lp, m in zip(cand_lp, cand_m, strict=True):
            assert len(lp) == len(m)
            assert all(b - a >= -1e-6 and b <= 1e-6 for a, b in zip(lp, m, strict=True))
    own = [m for i, m in enumerate(margins[0]) if i % 5 == 0 and refs[i]]  # candidate 0's own
    assert own and all(abs(v) <= 1e-5 for m in own for v in m)
    wrong = [m for i, m in enumerate(margins[0]) if i % 5 == 1 and plain[0][i] != "77"]
    assert wrong and all(min(m) < -1e-3 for m in wrong)  # greedy does not write "77" there
