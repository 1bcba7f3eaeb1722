"""Data: local loaders, GSM8K/MATH normalisation, error messages, splits and prompt templates."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from essa.data import (
    DataError,
    known_templates,
    load_examples,
    render_prompt,
    shuffle,
    split_examples,
)
from essa.data.arithmetic import NUM_TEST
from essa.types import Example

GSM8K_ROWS = [
    {
        "question": "Natalia sold clips to 48 friends in April, and half as many in May. How many in total?",
        "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\nAltogether 48+24 = <<48+24=72>>72.\n#### 72",
    },
    {
        "question": "A shop sells 1,000 pens a day for 2 days. How many pens?",
        "answer": "1000 * 2 = 2000\n#### 2,000",
    },
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_gsm8k_jsonl_normalisation(tmp_path: Path) -> None:
    examples = load_examples(str(write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)))
    assert [e.answer for e in examples] == ["72", "2000"]
    assert examples[0].prompt == GSM8K_ROWS[0]["question"]
    assert examples[0].solution == GSM8K_ROWS[0]["answer"]
    assert examples[0].solution.endswith("#### 72")
    assert examples[1].target == GSM8K_ROWS[1]["answer"]


def test_math_style_boxed_solution(tmp_path: Path) -> None:
    rows = [
        {
            "problem": "Half of one?",
            "solution": r"It is $\boxed{\frac{1}{2}}$.",
            "answer": r"\frac{1}{2}",
        },
        {"problem": "Set?", "solution": r"So $\boxed{\{1, \{2\}\}}$.", "answer": None},
    ]
    path = write_jsonl(tmp_path / "math.jsonl", rows)
    labelled = load_examples(str(path), question_field="problem", solution_field="solution")
    assert labelled[0] == Example("Half of one?", r"\frac{1}{2}", rows[0]["solution"])
    # a null answer falls back to the solution's boxed content
    assert labelled[1].answer == r"\{1, \{2\}\}"
    from_solution = load_examples(
        str(path), question_field="problem", answer_field=None, solution_field="solution"
    )
    assert [e.answer for e in from_solution] == [r"\frac{1}{2}", r"\{1, \{2\}\}"]
    boxed_answer_field = load_examples(str(path), question_field="problem", answer_field="solution")
    assert boxed_answer_field[1].answer == r"\{1, \{2\}\}"


def test_unlabeled_and_numbers(tmp_path: Path) -> None:
    rows = [{"q": "2+2?", "a": 4}, {"q": "AMC", "a": 27.0}]
    path = write_jsonl(tmp_path / "n.jsonl", rows)
    assert [e.answer for e in load_examples(str(path), question_field="q", answer_field="a")] == [
        "4",
        "27.0",
    ]
    unlabeled = load_examples(str(path), question_field="q", answer_field=None)
    assert [e.answer for e in unlabeled] == [None, None]
    assert unlabeled[0].solution is None


def test_csv_json_and_limit(tmp_path: Path) -> None:
    with (tmp_path / "d.csv").open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=["question", "answer"])
        writer.writeheader()
        writer.writerows(GSM8K_ROWS)
    from_csv = load_examples(str(tmp_path / "d.csv"))
    (tmp_path / "d.json").write_text(json.dumps(GSM8K_ROWS), encoding="utf-8")
    from_json = load_examples(str(tmp_path / "d.json"))
    assert (
        from_csv == from_json == load_examples(str(write_jsonl(tmp_path / "d.jsonl", GSM8K_ROWS)))
    )
    assert load_examples(str(tmp_path / "d.json"), limit=1) == from_json[:1]
    (tmp_path / "splits.json").write_text(
        json.dumps({"train": GSM8K_ROWS, "test": GSM8K_ROWS[:1]}), encoding="utf-8"
    )
    assert load_examples(str(tmp_path / "splits.json"), split="test") == from_json[:1]
    with pytest.raises(DataError, match="split= one of: train, test"):
        load_examples(str(tmp_path / "splits.json"))


def test_parquet(tmp_path: Path) -> None:
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as parquet

    parquet.write_table(pyarrow.Table.from_pylist(GSM8K_ROWS), tmp_path / "d.parquet")
    assert [e.answer for e in load_examples(str(tmp_path / "d.parquet"))] == ["72", "2000"]


def test_builtin_arithmetic() -> None:
    train = load_examples("builtin:arithmetic")
    test = load_examples("builtin:arithmetic", split="test")
    assert len(test) == NUM_TEST and len(train) == 100 * 100 - NUM_TEST
    assert not {e.prompt for e in train} & {e.prompt for e in test}
    a, b = map(int, test[0].prompt.rstrip("=").split("+"))
    assert test[0].answer == str(a + b)
    assert load_examples("builtin:arithmetic", limit=5) == train[:5]
    with pytest.raises(DataError, match="known: builtin:arithmetic"):
        load_examples("builtin:nope")


# ---------------------------------------------------------------------------------------------
# Bad input


def test_malformed_jsonl_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"question": "a", "answer": "1"}\n\n{"question": "b", "answer": \n', encoding="utf-8"
    )
    with pytest.raises(DataError, match=rf"^{path}:3: invalid JSON: "):
        load_examples(str(path))
    path.write_text('{"question": "a", "answer": "1"}\n[1, 2]\n', encoding="utf-8")
    with pytest.raises(DataError, match=rf"^{path}:2: expected a JSON object"):
        load_examples(str(path))


def test_missing_field_names_field_and_fields_present(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "m.jsonl", [{"question": "a", "answer": "1"}, {"problem": "b", "solution": "2"}]
    )
    with pytest.raises(DataError) as info:
        load_examples(str(path))
    assert (
        str(info.value) == f"{path}:2: missing field 'question'; fields present: problem, solution"
    )
    with pytest.raises(
        DataError, match=r"m.jsonl:1: missing field 'sol'; fields present: question, answer"
    ):
        load_examples(str(path), solution_field="sol")
    with (tmp_path / "m.csv").open("w", encoding="utf-8") as handle:
        handle.write("q,answer\nx,1\n")
    with pytest.raises(
        DataError, match=r"m.csv:2: missing field 'question'; fields present: q, answer"
    ):
        load_examples(str(tmp_path / "m.csv"))


def test_empty_dataset_and_bad_sources(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n\n", encoding="utf-8")
    with pytest.raises(DataError, match="no examples"):
        load_examples(str(tmp_path / "empty.jsonl"))
    with pytest.raises(DataError, match="no such file"):
        load_examples(str(tmp_path / "missing.jsonl"))
    (tmp_path / "d.txt").write_text("x", encoding="utf-8")
    with pytest.raises(DataError, match="unsupported file type"):
        load_examples(str(tmp_path / "d.txt"))
    path = write_jsonl(tmp_path / "d.jsonl", GSM8K_ROWS)
    with pytest.raises(DataError, match="has no splits"):
        load_examples(str(path), split="train")
    with pytest.raises(DataError, match="limit"):
        load_examples(str(path), limit=0)
    with pytest.raises(DataError, match="is empty"):
        load_examples(str(write_jsonl(tmp_path / "e.jsonl", [{"question": " ", "answer": "1"}])))
    assert issubclass(DataError, ValueError)


# ---------------------------------------------------------------------------------------------
# Splits and shuffling


def make_examples(n: int) -> list[Example]:
    return [Example(prompt=f"q{i}", answer=str(i)) for i in range(n)]


def test_shuffle_is_deterministic_permutation() -> None:
    items = make_examples(50)
    assert shuffle(items, seed=3) == shuffle(items, seed=3)
    assert shuffle(items, seed=3) != shuffle(items, seed=4)
    assert sorted(shuffle(items, seed=3), key=lambda e: int(e.answer)) == items
    assert items == make_examples(50)  # input untouched


def test_split_examples() -> None:
    items = make_examples(100)
    train, test = split_examples(items, test_size=0.2, seed=0)
    assert (len(train), len(test)) == (80, 20)
    assert (train, test) == split_examples(items, test_size=20, seed=0)
    assert not {e.prompt for e in train} & {e.prompt for e in test}
    assert split_examples(items, 20, seed=1) != (train, test)
    assert len(split_examples(items, test_size=0.001, seed=0)[1]) == 1
    for bad in (0, 100, 1.0, 0.0, -3):
        with pytest.raises(DataError):
            split_examples(items, test_size=bad, seed=0)


def test_train_size_keeps_the_first_training_examples_and_the_other_splits() -> None:
    from essa.config import DataConfig
    from essa.data.task import load_task

    full = load_task(DataConfig(), seed=3)
    small = load_task(DataConfig(train_size=7), seed=3)
    assert small.train == full.train[:7]
    assert (small.sft, small.test) == (full.sft, full.test)  # the SFT cut and held-out unchanged
    assert load_task(DataConfig(train_size=10**9), seed=3).train == full.train


# ---------------------------------------------------------------------------------------------
# Prompt templates


class FakeChatTokenizer:
    """Records the call and renders a ChatML-like string, as transformers' tokenizers do."""

    chat_template = "<{role}>{content}</{role}>"  # a tokenizer with a template says so

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        body = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return body + "<assistant>"


def test_templates_exact_strings() -> None:
    q = "What is 1+1?"
    assert render_prompt("raw", q) == q
    assert render_prompt("qwen_math_cot", q) == (
        "<|im_start|>system\nPlease reason step by step, and put your final answer within "
        "\\boxed{}.<|im_end|>\n<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_prompt("qwen_boxed", q) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "What is 1+1?\nPlease reason step by step, and put your final answer within \\boxed{}."
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    r1 = render_prompt("r1", q)
    assert r1.startswith("A conversation between User and Assistant.")
    assert "<think> reasoning process here </think> <answer> answer here </answer>." in r1
    assert r1.endswith("\nUser: What is 1+1?\nAssistant: <think>")
    assert "<|im_start|>" not in r1
    assert render_prompt("essa_math", q).startswith(
        "<|im_start|>system\nPlease reason step by step and place your final answer in \\boxed{}<|im_end|>"
    )


def test_chat_template_uses_tokenizer() -> None:
    assert (
        render_prompt("chat", "hi", tokenizer=FakeChatTokenizer()) == "<user>hi</user><assistant>"
    )
    with pytest.raises(ValueError, match="needs a tokenizer"):
        render_prompt("chat", "hi")


def test_unknown_template_lists_known() -> None:
    assert {"raw", "chat", "qwen_math_cot", "qwen_boxed", "r1"} <= set(known_templates())
    with pytest.raises(ValueError, match="known: .*qwen_math_cot.*r1"):
        render_prompt("qwen25-math-cot", "x")
