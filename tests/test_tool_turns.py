"""Tool-integrated rollouts: the turn format, the turn loop (real tokenizer, real sandbox), the
HF decode path turn by turn (the bundled demo model), the GRPO rollout's masks, SFT targets
from reasoning-gym items, and the config checks.

The demo's character vocabulary has no backticks or letters, so its code block is a
parenthesised expression (configs/tools_demo.yaml): "(12+30)" runs and "=42 " comes back.
"""

from __future__ import annotations

import contextlib
import io
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from essa.config import EvaluationConfig, GenerationConfig, PythonToolConfig
from essa.tools.sandbox import ToolResult
from essa.tools.turns import (
    ToolTally,
    Transcript,
    block_code,
    block_end,
    output_block,
    run_turns,
    with_echo,
)
from tests.conftest import requires

needs_bwrap = requires("sandbox", None if shutil.which("bwrap") else "bwrap is not installed")

TORL = PythonToolConfig(max_tool_calls=2, timeout_seconds=3.0)
DEMO = PythonToolConfig(
    max_tool_calls=1,
    code_start="(",
    code_end=")",
    output_start="=",
    output_end=" ",
    answer_format="{answer}",
    timeout_seconds=3.0,
    allow_unisolated=shutil.which("bwrap") is None,
)


def ok(stdout: str) -> ToolResult:
    return ToolResult(stdout, "", 0, False, False, None)


# ------------------------------------------------------------------------------ the format


def test_a_block_closes_only_after_it_opens() -> None:
    text = "I will compute.\n```python\nx = 6 * 7\nx\n```\nmore"
    assert block_code(text, TORL) == "x = 6 * 7\nx"
    assert text[: block_end(text, TORL)].endswith("x\n```")
    assert block_end("```python\nprint(1)", TORL) is None  # still open
    assert block_end("plain ``` fence, no python block", TORL) is None


def test_echo_shows_the_last_expression_and_leaves_statements() -> None:
    assert with_echo("x = 2\nx * 21").splitlines()[-1] == "    print(repr(__value))"
    assert with_echo("print(3)") == "print(3)"  # prints itself: shown once
    assert with_echo("x = 1") == "x = 1"
    assert with_echo("def (") == "def ("  # a syntax error stays for the sandbox to report


@pytest.mark.parametrize(
    ("code", "shown"),
    [
        ('t = "ü"; len(t)', "1"),  # columns count UTF-8 bytes: "ü" is two
        ('s = "€ and ü"\ns', "'€ and ü'"),
        ('x = "\x0c"; y = "é"\r\nlen(x + y)', "2"),  # a form feed is no line break to ast
    ],
)
def test_echo_runs_code_with_non_ascii_text_as_written(code: str, shown: str) -> None:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(with_echo(code), {})
    assert printed.getvalue() == shown + "\n"


CORPUS = ["```python\nprint(6 * 7)\n``` The answer is 42.\n```output\n42\n```\n"] * 8


def byte_level_tokenizer() -> Any:
    """A GPT-2-style byte-level BPE (a newline is "Ċ", a space "Ġ"), trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=alphabet
    )
    backend.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


def sentencepiece_tokenizer() -> Any:
    """A SentencePiece-style BPE (a space is "▁", joined to the next word), trained here."""
    from tokenizers import SentencePieceBPETokenizer
    from transformers import PreTrainedTokenizerFast

    backend = SentencePieceBPETokenizer()
    backend.train_from_iterator(CORPUS, vocab_size=200, special_tokens=["<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=backend._tokenizer, eos_token="<eos>")


@pytest.mark.parametrize(
    ("make", "code_end"),
    [
        (byte_level_tokenizer, "\n```\n"),
        (byte_level_tokenizer, "\n``` "),
        (byte_level_tokenizer, "\n```"),
        (sentencepiece_tokenizer, "\n``` "),  # the space is in the next word's piece
    ],
)
def test_a_block_end_in_whitespace_stops_the_row_and_cuts_the_turn(
    make: Any, code_end: str
) -> None:
    from essa.backends.stops import ToolCallStop

    tokenizer = make()
    cfg = replace(TORL, code_end=code_end)
    text = f"```python\nprint(6 * 7){code_end}The answer"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    closes = [block_end(tokenizer.decode(ids[: k + 1]), cfg) is not None for k in range(len(ids))]
    k = closes.index(True)  # the token that closes the block
    ended = ToolCallStop(tokenizer, cfg).ended(torch.tensor([ids[: k + 1]]), torch.tensor([True]))
    assert ended.tolist() == [True]  # the decode stops the row there
    generate, _ = scripted(tokenizer, {0: [text, "42"]})
    prompt = tokenizer("6 * 7", add_special_tokens=False)["input_ids"]
    out = run_turns([prompt], generate, tokenizer, cfg, lambda codes: [ok("42\n")] * len(codes))
    assert out[0].ends == ["code", "length"]  # and the turn loop runs the block
    assert out[0].segments[0][0] == ids[: k + 1]


def test_output_block_shows_stdout_or_the_error_line() -> None:
    assert output_block(ok("42\n"), TORL) == "\n```output\n42\n```\n"
    failed = ToolResult("", "Traceback...", 1, False, False, "exit status 1: NameError: y")
    assert output_block(failed, TORL) == "\n```output\nexit status 1: NameError: y\n```\n"


# --------------------------------------------------------------------------- the turn loop


@pytest.fixture(scope="module")
def demo_tokenizer():  # type: ignore[no-untyped-def]
    from essa.backends.models import load_model
    from essa.config import ModelConfig

    return load_model(ModelConfig())[1]


def scripted(tokenizer, turns: dict[int, list[str]]):  # type: ignore[no-untyped-def]
    """A generate_turn that writes row r's next scripted turn (its ids), recording its calls."""
    calls: list[tuple[list[int], list[list[int]], bool]] = []

    def generate(rows, contexts, may_call):  # type: ignore[no-untyped-def]
        calls.append((list(rows), [list(c) for c in contexts], may_call))
        out = []
        for r in rows:
            text = turns[r].pop(0)
            out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        return out

    return generate, calls


@needs_bwrap
def test_turns_run_the_code_and_continue_the_calling_rows(demo_tokenizer) -> None:  # type: ignore[no-untyped-def]
    tok = demo_tokenizer
    eos = tok.eos_token_id
    prompts = [tok("12+30=", add_special_tokens=False)["input_ids"], tok("1+1=")["input_ids"]]
    # row 0 calls and its first turn runs on past the block (a decode step late): cut there;
    # row 1 answers at once.
    generate, calls = scripted(tok, {0: ["(12+30)99", "42"], 1: ["2"]})
    transcripts = run_turns(
        prompts, generate, tok, replace(DEMO, allow_unisolated=False), None, [eos]
    )
    first, second = transcripts
    assert [tok.decode(ids) for ids, _ in first.segments] == ["(12+30)", "=42 ", "42"]
    assert [own for _, own in first.segments] == [True, False, True]
    assert first.ends == ["code", "length"] and first.calls == 1 and first.errors == 0
    assert second.ends == ["length"] and second.calls == 0  # no stop token: the cap
    assert calls[0][2] is True and calls[1][2] is False  # the last allowed turn runs to its end
    assert calls[1][0] == [0]  # only the calling row comes back
    assert tok.decode(calls[1][1][0]) == "12+30=(12+30)=42 "  # its prompt, turn and output


def test_a_stop_token_ends_the_row_and_the_call_budget_holds(demo_tokenizer) -> None:  # type: ignore[no-untyped-def]
    tok = demo_tokenizer
    eos = tok.eos_token_id
    ids = tok("(1+1)", add_special_tokens=False)["input_ids"]
    seen: list[int] = []

    def generate(rows, contexts, may_call):  # type: ignore[no-untyped-def]
        seen.append(len(rows))
        return [ids + [eos] for _ in rows]  # always writes a block

    def execute(codes):  # type: ignore[no-untyped-def]
        return [ok(str(eval(c.split("\n")[0].split("=", 1)[-1]))) for c in codes]

    cfg = replace(DEMO, max_tool_calls=3, show_last_expression=False)
    (t,) = run_turns([tok("5=")["input_ids"]], generate, tok, cfg, execute, [eos])
    assert t.calls == 3 and t.ends == ["code", "code", "code", "stop"]
    assert seen == [1, 1, 1, 1]
    assert t.segments[-1][0][-1] == eos  # the final turn keeps its stop token


def test_tally_counts_calls_errors_and_answers_the_tool_printed() -> None:
    called = Transcript(results=[ok("42\n")])
    failed = Transcript(results=[ToolResult("", "", 1, False, False, "exit status 1: E")])
    tally = ToolTally()
    tally.add([called, failed, Transcript()], ["42", "7", None])
    metrics = tally.metrics()
    assert metrics["tool_calls_per_row"] == 2 / 3
    assert metrics["tool_error_rate"] == 0.5
    assert metrics["tool_rows"] == 2 / 3
    assert metrics["tool_output_used"] == 1 / 3


def test_tally_shares_of_answers_by_calls_and_void_turns() -> None:
    """Eight rows built with known calls and endings: 2 rows with no call, 3 with one, 3 with
    two or more (one of them three); 2 of the 9 runs failed; 3 rows have a void turn (cut by
    the length cap, twice, or stopped with no answer)."""
    failed = ToolResult("", "", 1, False, False, "exit status 1: NameError")

    def row(ends: list[str], results: list[ToolResult]) -> Transcript:
        return Transcript(ends=ends, turns=["x"] * len(ends), results=results)  # type: ignore[arg-type]

    rows = [
        (row(["stop"], []), "5"),  # answered without the tool
        (row(["length"], []), None),  # void: cut by the cap
        (row(["code", "stop"], [ok("3\n")]), "3"),
        (row(["code", "stop"], [failed]), None),  # void: stopped with no answer
        (row(["code", "stop"], [ok("4\n")]), "4"),
        (row(["code", "code", "stop"], [ok("1\n"), ok("2\n")]), "2"),
        (row(["code", "code", "length"], [ok("1\n"), failed]), None),  # void
        (row(["code", "code", "code", "stop"], [ok("1\n"), ok("2\n"), ok("6\n")]), "6"),
    ]
    tally = ToolTally()
    tally.add([t for t, _ in rows], [a for _, a in rows])
    metrics = tally.metrics()
    assert (metrics["tool_rows_0_calls"], metrics["tool_rows_1_call"]) == (2 / 8, 3 / 8)
    assert metrics["tool_rows_2plus_calls"] == 3 / 8
    assert metrics["tool_rows"] == 6 / 8
    assert metrics["tool_calls_per_row"] == 10 / 8 and metrics["tool_error_rate"] == 2 / 10
    assert metrics["tool_void_rows"] == 3 / 8
    assert metrics["tool_output_used"] == 4 / 8  # 3, 4, 2 and 6 were printed; 5 was not
    # GRPO's void-turn filter reads the same turns
    from essa.gradient.tool_rollout import void_turns

    texts = {"5": "The answer is 5.", None: "no answer here"}
    for t, answer in rows:
        t.turns[-1] = texts.get(answer, f"The answer is {answer}.")
    assert void_turns([t for t, _ in rows]).tolist() == [
        False, True, False, True, False, False, True, False,
    ]  # fmt: skip


# ----------------------------------------------------------------- the HF decode, turn by turn


@pytest.fixture(scope="module")
def demo():  # type: ignore[no-untyped-def]
    from essa.adapters import SVDAdapter
    from essa.backends.models import load_model
    from essa.config import AdapterConfig, ModelConfig
    from essa.gradient.sft import make_lora_model

    model, tokenizer = load_model(ModelConfig())
    peft_model = make_lora_model(model, AdapterConfig(rank=4, lora_alpha=8))
    gen = torch.Generator().manual_seed(1)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=gen) * 0.05
    adapter = SVDAdapter.from_peft_model(peft_model, alpha=1.0)
    return peft_model.unload(), tokenizer, adapter


QUESTIONS = ["12+3=", "7+45=", "1+1=", "99+99=", "5+60=", "3+3=", "48+51=", "0+7="]


def forced_block_model(model, tokenizer, again: bool = False):  # type: ignore[no-untyped-def]
    """The demo model steered into writing blocks (it never writes "(" or ")" itself): a
    forward hook makes "(" the choice after "=" and ")" after a digit that follows "(";
    ``again``: "(" after a space too (the output block's end), so a row calls a second time."""
    open_id, close_id = tokenizer.convert_tokens_to_ids("("), tokenizer.convert_tokens_to_ids(")")
    opens = torch.tensor(tokenizer("= " if again else "=", add_special_tokens=False)["input_ids"])
    digits = torch.tensor(tokenizer.convert_tokens_to_ids(list("0123456789")))

    def hook(module, args, kwargs, output):  # type: ignore[no-untyped-def]
        ids = kwargs.get("input_ids", args[0] if args else None)  # (B, T) this forward's
        output.logits[torch.isin(ids[:, -1], opens), -1, open_id] += 30.0
        output.logits[torch.isin(ids[:, -1], digits), -1, close_id] += 30.0
        return output

    return model.register_forward_hook(hook, with_kwargs=True)


@needs_bwrap
@pytest.mark.parametrize("drop", [True, False])
def test_each_turn_is_what_generate_writes_from_its_context(demo, monkeypatch, drop) -> None:  # type: ignore[no-untyped-def]
    """Turn 1 is the plain decode cut where the block closes; turn 2 is the plain decode of
    prompt + turn 1 + output block: the turn loop changes nothing but the context."""
    from essa.backends import generate as hf
    from essa.backends.generate import generate_texts
    from essa.backends.tool_turns import generate_turns

    model, tok, _ = demo
    if not drop:
        monkeypatch.setattr(hf, "supports_row_dropping", lambda model: False)
    gen = GenerationConfig(max_new_tokens=8)
    handle = forced_block_model(model, tok)
    try:
        ids = [tok(q, add_special_tokens=False)["input_ids"] for q in QUESTIONS]
        texts, _, transcripts = generate_turns(
            model, tok, ids, gen, replace(DEMO, allow_unisolated=False), micro_batch_size=3
        )
        plain_ids: list[list[int]] = []
        generate_texts(model, tok, QUESTIONS, gen, micro_batch_size=3, out_ids=plain_ids)
        calling = [i for i, t in enumerate(transcripts) if t.calls]
        assert calling, "the forced '(' should open blocks"
        for i, t in enumerate(transcripts):
            first = t.segments[0][0]
            assert plain_ids[i][: len(first)] == first
        contexts = [
            ids[i] + transcripts[i].segments[0][0] + transcripts[i].segments[1][0] for i in calling
        ]
        again: list[list[int]] = []
        generate_texts(
            model,
            tok,
            [""] * len(contexts),
            gen,
            micro_batch_size=3,
            token_ids=contexts,
            out_ids=again,
        )
        for i, want in zip(calling, again, strict=True):
            assert transcripts[i].segments[2][0] == want[: len(transcripts[i].segments[2][0])]
            assert len(transcripts[i].segments) == 3
        for i, t in enumerate(transcripts):
            assert texts[i] == tok.decode(t.ids, skip_special_tokens=True)
    finally:
        handle.remove()


@needs_bwrap
def test_the_population_evaluator_runs_tools_for_every_candidate(demo) -> None:  # type: ignore[no-untyped-def]
    from essa.backends.evaluator import PopulationEvaluator

    model, tok, adapter = demo
    x = np.random.default_rng(0).normal(size=(3, adapter.dim)) * adapter.stds()
    handle = forced_block_model(model, tok)
    try:
        gen = GenerationConfig(max_new_tokens=8)
        with_tools = PopulationEvaluator(
            model, tok, adapter, gen, EvaluationConfig(strategy="batched"),
            replace(DEMO, allow_unisolated=False),
        )  # fmt: skip
        out = with_tools.completions(x, QUESTIONS)
        metrics = with_tools.take_tool_metrics()
        merged = PopulationEvaluator(
            model, tok, adapter, gen, EvaluationConfig(strategy="merged"),
            replace(DEMO, allow_unisolated=False),
        )  # fmt: skip
        assert merged.completions(x, QUESTIONS) == out  # both strategies: the same transcripts
    finally:
        handle.remove()
    shown = [text for row in out for text in row if "=" in text]
    assert shown and metrics["tool_calls_per_row"] > 0
    assert metrics["tool_calls_per_row"] == metrics["tool_rows"]  # one call at most here
    assert with_tools.take_tool_metrics()["tool_calls_per_row"] == 0.0  # a take resets


@needs_bwrap
def test_rows_call_twice_in_both_recipes_rollouts(demo) -> None:  # type: ignore[no-untyped-def]
    """With max_tool_calls 2 a row calls again after its first output block, in ESSA's
    population evaluator and in GRPO's rollout, and never a third time; the tally's shares are
    the transcripts' counts."""
    from essa.gradient.policy import Policy, Sampling
    from essa.gradient.tool_rollout import tool_rollout
    from essa.rewards.extract import extract_answer

    model, tok, adapter = demo
    two = replace(DEMO, max_tool_calls=2, allow_unisolated=False)
    gen = GenerationConfig(max_new_tokens=8)
    x = np.random.default_rng(0).normal(size=(2, adapter.dim)) * adapter.stds()
    handle = forced_block_model(model, tok, again=True)
    try:
        from essa.backends.evaluator import PopulationEvaluator

        evaluator = PopulationEvaluator(
            model, tok, adapter, gen, EvaluationConfig(strategy="batched"), two
        )
        texts = [t for row in evaluator.completions(x, QUESTIONS) for t in row]
        essa_metrics = evaluator.take_tool_metrics()
        policy = Policy(model=model, params=[], reference=[])
        out = tool_rollout(policy, tok, QUESTIONS, Sampling(gen, 4, 1.0, tools=two), seed=0)
    finally:
        handle.remove()
    assert max(text.count("=") for text in texts) == 2  # two output blocks
    assert essa_metrics["tool_rows_2plus_calls"] > 0
    assert out.transcripts is not None
    calls = [t.calls for t in out.transcripts]
    assert max(calls) == 2
    tally = ToolTally()
    tally.add(out.transcripts, [extract_answer(t.turns[-1]) for t in out.transcripts])
    grpo = tally.metrics()
    assert grpo["tool_rows_2plus_calls"] == calls.count(2) / len(calls)
    assert grpo["tool_rows_1_call"] == calls.count(1) / len(calls)
    total = grpo["tool_rows_0_calls"] + grpo["tool_rows_1_call"] + grpo["tool_rows_2plus_calls"]
    assert total == pytest.approx(1.0)
    i = calls.index(2)  # both output blocks are masked out of the loss, the turns are not
    own = [own for ids, own in out.transcripts[i].segments for _ in ids]
    assert out.mask[i, : len(own)].tolist() == [float(o) for o in own]
    assert [own for _, own in out.transcripts[i].segments][:4] == [True, False, True, False]


# ---------------------------------------------------------------------------------- GRPO


def test_grpo_rollout_masks_the_tool_output_out_of_the_loss(demo_tokenizer) -> None:  # type: ignore[no-untyped-def]
    from essa.gradient.tool_rollout import assemble, void_turns

    tok = demo_tokenizer
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    called = Transcript(
        segments=[(enc("(1+2)"), True), (enc("=3 "), False), (enc("3") + [tok.eos_token_id], True)],
        ends=["code", "stop"], turns=["(1+2)", "3"], results=[ok("3\n")],
    )  # fmt: skip
    plain = Transcript(segments=[(enc("12"), True)], ends=["length"], turns=["12"])
    out = assemble([enc("1+2="), enc("5+7=")], [called, plain], tok)
    assert out.mask[0].tolist() == [1, 1, 1, 1, 1, 0, 0, 0, 1, 1]
    assert out.attention_mask[0, -10:].tolist() == [1] * 10  # the output is attended to
    assert out.mask[1].tolist() == [1, 1] + [0] * 8
    assert out.truncated.tolist() == [False, True]
    assert out.texts == ["(1+2)=3 3", "12"]
    # the truncated turn is void (neither a block nor an answer); a stated answer is not
    assert void_turns([called, plain]).tolist() == [False, True]


# ----------------------------------------------------------------------------- SFT targets


@pytest.mark.parametrize(
    "task", ["chain_sum", "products", "gcd", "lcm", "count_bits", "letter_counting"]
)
def test_sft_code_targets_compute_the_reference_answer(task: str) -> None:
    """On real reasoning-gym items the solver's value is the task's own answer wherever it
    applies (integer tasks: on nearly every item)."""
    pytest.importorskip("reasoning_gym")
    from essa.data.gym import gym_examples
    from essa.data.tool_sft import solve, with_tool_targets

    examples = gym_examples(task)[:200]
    made = [solve(ex.prompt) for ex in examples]
    solved = [(m, ex) for m, ex in zip(made, examples, strict=True) if m is not None]
    agree = sum(m[1] == ex.answer for m, ex in solved)
    assert len(solved) >= 0.9 * len(examples) and agree >= 0.9 * len(solved), (len(solved), agree)
    with_code, count = with_tool_targets(examples, TORL, "The answer is {answer}.")
    assert count == agree
    target = next(ex.target for ex in with_code if ex.solution is not None)
    assert target.startswith("```python\n") and "\n```\n```output\n" in target
    assert target.endswith(f"The answer is {next(ex for ex in with_code if ex.solution).answer}.")


def test_the_solvers_doctests() -> None:
    import doctest

    import essa.data.tool_sft as tool_sft

    assert doctest.testmod(tool_sft).failed == 0


@pytest.mark.parametrize(
    "task", ["leg_counting", "calendar_arithmetic", "word_sorting", "base_conversion"]
)
def test_word_problem_solvers_score_full_marks_by_the_tasks_own_scorer(task: str) -> None:
    """The solvers that read what to compute out of words (animals and their legs, dates
    written out, the words to sort, a number and two bases) answer every one of 200 items, and
    the task's own scorer gives each answer 1.0."""
    pytest.importorskip("reasoning_gym")
    from essa.data.gym import gym_dataset
    from essa.data.tool_sft import solve

    dataset = gym_dataset(task)
    entries = [dataset[i] for i in range(200)]
    found = [solve(entry["question"]) for entry in entries]
    assert all(f is not None for f in found)
    assert [dataset.score_answer(f[1], e) for f, e in zip(found, entries, strict=True)] == [
        1.0
    ] * 200


@needs_bwrap
def test_sft_code_prints_its_value_in_the_sandbox() -> None:
    pytest.importorskip("reasoning_gym")
    from essa.data.gym import gym_dataset, gym_examples
    from essa.data.tool_sft import solve
    from essa.tools.sandbox import run_python_batch

    tasks = ("chain_sum", "gcd", "count_bits", "letter_counting", "leg_counting", "word_sorting",
             "base_conversion")  # fmt: skip
    found = [solve(gym_examples(task)[0].prompt) for task in tasks]
    kinds: dict[str, str] = {}  # one question of each calendar kind (7)
    for entry in gym_dataset("calendar_arithmetic"):
        kinds.setdefault(entry["metadata"]["task"], entry["question"])
        if len(kinds) == 7:
            break
    found += [solve(question) for question in kinds.values()]
    codes = [with_echo(code) for code, _ in found if code]
    results = run_python_batch(codes, TORL, "bwrap")
    assert [r.stdout.strip() for r in results] == [value for _, value in found]


# --------------------------------------------------------------------------- config checks


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["backend=vllm"], "backend vllm cannot stop a row for a tool call"),
        (["algorithm=dpo"], "algorithm dpo generates no rollouts with tools"),
        (["tools.python.drop_void_turns=true"], "SimpleTIR's filter drops trajectories"),
        (["tools.python.code_end=''"], "tools.python.code_end: must not be empty"),
        (["tools.python.answer_format=done"], "needs one {answer} field"),
    ],
)
def test_tool_settings_that_cannot_run_are_refused(sets: list[str], message: str) -> None:
    from essa.config import load_config
    from essa.config.errors import ConfigError

    with pytest.raises(ConfigError, match=message.replace("{", r"\{").replace("}", r"\}")):
        load_config(None, ["tools.python.max_tool_calls=1", *sets])
    with pytest.raises(ConfigError, match="needs tool calls"):
        load_config(None, ["tools.python.drop_void_turns=true"])


# ------------------------------------------------------------------------------- end to end


@needs_bwrap
@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["essa", "grpo"])
def test_train_with_tools_end_to_end(tmp_path: Path, algorithm: str) -> None:
    import json

    from essa.cli import tool_line
    from tests.cli_runner import essa

    sets = ["run.generations=2", "evaluation.every=1", "data.test_size=32", "sft.steps=4",
            "tools.python.max_tool_calls=2"]  # fmt: skip
    if algorithm == "grpo":
        sets += ["algorithm=grpo", "grpo.prompts_per_step=4", "grpo.group_size=4",
                 "tools.python.drop_void_turns=true", "reward.reference_weight=0"]  # fmt: skip
    args = [arg for s in sets for arg in ("--set", s)]
    res = essa("train", "configs/tools_demo.yaml", *args, "--run-dir", str(tmp_path / "run"))
    assert res.returncode == 0, res.stderr[-3000:]
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("generation", -1) >= 0 and "tool_calls_per_row" in r]
    assert len(steps) == 2
    check = "val_tool_calls_per_row" if algorithm == "essa" else "heldout_tool_calls_per_row"
    assert all(check in r for r in steps)  # ESSA checks on validation, GRPO on the test split
    if algorithm == "grpo":
        assert all("void_trajectories" in r for r in steps if not r.get("skipped"))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    tools = summary["tools"]
    assert set(tools) == {
        "tool_calls_per_row",
        "tool_error_rate",
        "tool_rows",
        "tool_rows_0_calls",
        "tool_rows_1_call",
        "tool_rows_2plus_calls",
        "tool_void_rows",
        "tool_output_used",
    }
    shares = [tools["tool_rows_0_calls"], tools["tool_rows_1_call"], tools["tool_rows_2plus_calls"]]
    assert sum(shares) == pytest.approx(1.0)
    assert [line for line in res.stdout.splitlines() if line.startswith("tools:")] == [
        "tools:    answers with 0 / 1 / 2+ calls " + " / ".join(f"{x:.2f}" for x in shares)
        + f", {tools['tool_calls_per_row']:.2f} calls each, {tools['tool_error_rate']:.2f} of "
        f"runs failed, {tools['tool_void_rows']:.2f} with a void turn"
    ]  # fmt: skip
    if algorithm == "essa":  # `essa eval` of the exported adapter reports its tool use too
        out = tmp_path / "eval.json"
        res = essa("eval", str(tmp_path / "run" / "config.yaml"), "--adapter",
                   summary["adapter_dir"], "--output", str(out))  # fmt: skip
        assert res.returncode == 0, res.stderr[-3000:]
        result = json.loads(out.read_text())
        assert set(tools) <= set(result)
        shares = [
            result[k] for k in ("tool_rows_0_calls", "tool_rows_1_call", "tool_rows_2plus_calls")
        ]
        assert sum(shares) == pytest.approx(1.0)
        assert [line for line in res.stdout.splitlines() if line.startswith("tools:")] == [
            tool_line(result)
        ]


def test_rows_that_wrote_the_same_code_share_one_run(demo_tokenizer) -> None:  # type: ignore[no-untyped-def]
    tok = demo_tokenizer
    eos = tok.eos_token_id
    texts = {0: ["(1+1)", "2"], 1: ["(1+1)", "2"], 2: ["(2+2)", "4"]}
    generate, _ = scripted(tok, texts)
    ran: list[list[str]] = []

    def execute(codes):  # type: ignore[no-untyped-def]
        ran.append(list(codes))
        return [ok(str(eval(c.split("\n")[0].split("=", 1)[-1]))) for c in codes]

    prompts = [tok("1+1=")["input_ids"]] * 2 + [tok("2+2=")["input_ids"]]
    cfg = replace(DEMO, show_last_expression=False)
    out = run_turns(prompts, generate, tok, cfg, execute, [eos])
    assert ran == [["1+1", "2+2"]]
    assert [tok.decode(t.segments[1][0]) for t in out] == ["=2 ", "=2 ", "=4 "]


def test_tool_references_are_the_code_call_targets() -> None:
    from essa.data.tool_sft import tool_references
    from essa.types import Example

    examples = [Example("12+30=", "42"), Example("spell cat backwards", "tac")]
    refs = tool_references(examples, TORL)
    assert refs[0] == "```python\n12+30\n```\n```output\n42\n```\nThe answer is 42."
    assert refs[1] == "tac"  # no solver reads it: the answer, as without tools


@needs_bwrap
def test_drift_report_samples_with_the_runs_tool_calls(demo) -> None:  # type: ignore[no-untyped-def]
    """Retention and pass@K of a run with tools generate as its rollouts do: the tuned
    candidate's completions of the drift report equal the evaluator's, tool outputs included;
    without tools the same models write no output block."""
    from essa.backends.evaluator import PopulationEvaluator
    from essa.drift.models import PopulationModels

    model, tok, adapter = demo
    x = np.random.default_rng(1).normal(size=adapter.dim) * adapter.stds()
    tools = replace(DEMO, allow_unisolated=False)
    gen = GenerationConfig(max_new_tokens=8)
    handle = forced_block_model(model, tok)
    try:
        models = PopulationModels(model, tok, adapter, x, 4, tools=tools)
        with_tools = models.generate(QUESTIONS, gen, ["tuned"], tools=True)["tuned"]
        text_only = models.generate(QUESTIONS, gen, ["tuned"])["tuned"]
        evaluator = PopulationEvaluator(
            model, tok, adapter, gen, EvaluationConfig(strategy="batched"), tools
        )
        (rollouts,) = evaluator.completions(x[None, :], QUESTIONS)
    finally:
        handle.remove()
    assert with_tools == rollouts
    assert any(tools.output_start in t for t in with_tools)
    assert not any(tools.output_start in t for t in text_only)
