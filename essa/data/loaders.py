"""Load task items as :class:`~essa.types.Example` from local files, hub datasets or built-ins.

Sources (``load_examples(source, ...)``):

- ``builtin:arithmetic``: the built-in ``a+b=`` task (``split="test"`` gives its fixed
  held-out set, anything else its training pool); ``builtin:arithmetic3`` (three-digit
  addition) and ``builtin:arithmetic_mixed`` (``+``, ``-``, ``*`` on 0..99) are harder levels
  with their own fixed splits (:mod:`essa.data.generators`); :func:`builtin_examples` returns
  a built-in's ``(train, test)``;
- ``reasoning_gym:TASK``: a reasoning-gym task (optional ``[gym]`` extra, :mod:`essa.data.gym`;
  ``split="test"`` gives its fixed held-out part), graded by the ``gym_score`` reward;
- a local ``.jsonl``/``.ndjson``, ``.json``, ``.csv`` or ``.parquet`` file (Parquet needs
  ``pyarrow``);
- otherwise a Hugging Face ``datasets`` id, optionally ``"id:config"`` (e.g.
  ``"openai/gsm8k:main"``); ``datasets`` is imported only then.

Answer normalisation (the gold that rewards grade against):

- GSM8K: an answer containing ``#### 42`` gives answer ``"42"``; the full text, ``####`` line
  included, becomes the SFT solution unless ``solution_field`` names another field.
- MATH: an answer (or, with ``answer_field=None``, a solution) containing ``\\boxed{...}``
  gives the last boxed content as the answer.
- Thousands separators are dropped ("1,234" -> "1234").

The prompt is the raw question; templates are applied later by :func:`render_prompt`.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from essa.data.arithmetic import arithmetic_examples
from essa.data.generators import level_examples
from essa.rewards.extract import last_boxed, normalize_gold
from essa.sources import BUILTIN_SOURCES
from essa.types import Example, PreferencePair

FILE_SUFFIXES = (".jsonl", ".ndjson", ".json", ".csv", ".parquet")

# (where, record): "where" is "FILE:LINE" or "SOURCE: row N", used in error messages.
Record = tuple[str, Mapping[str, Any]]


class DataError(ValueError):
    """Bad input data: unreadable file, malformed line, missing field or empty dataset."""


def _read_jsonl(path: Path) -> Iterator[Record]:
    with path.open("rb") as handle:  # decoded per line, so a bad byte names its line
        for line_number, raw in enumerate(handle, start=1):
            where = f"{path}:{line_number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DataError(f"{where}: not UTF-8 text ({error.reason})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(
                    f"{where}: invalid JSON: {error.msg} (column {error.colno})"
                ) from error
            except RecursionError:
                raise DataError(f"{where}: invalid JSON: nested too deeply") from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
            yield where, record


def _read_json(path: Path, split: str | None) -> Iterator[Record]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise DataError(f"{path}:{error.lineno}: invalid JSON: {error.msg}") from error
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not UTF-8 text (byte {error.start}: {error.reason})") from None
    except RecursionError:
        raise DataError(f"{path}: invalid JSON: nested too deeply") from None
    if isinstance(data, dict):
        if split is None or split not in data:
            raise DataError(
                f"{path}: a JSON object of splits needs split= one of: {', '.join(map(str, data))}"
            )
        data = data[split]
    elif split is not None:
        raise DataError(f"{path}: split={split!r} given but the file is a plain list of records")
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a list of records, got {type(data).__name__}")
    for index, record in enumerate(data):
        if not isinstance(record, dict):
            raise DataError(
                f"{path}: record {index}: expected an object, got {type(record).__name__}"
            )
        yield f"{path}: record {index}", record


def _read_csv(path: Path) -> Iterator[Record]:
    with path.open(encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle)
        try:
            for record in reader:
                yield f"{path}:{reader.line_num}", record
        except UnicodeDecodeError as error:
            raise DataError(
                f"{path}: not UTF-8 text (byte {error.start}: {error.reason})"
            ) from None
        except csv.Error as error:
            raise DataError(f"{path}:{reader.line_num}: invalid CSV: {error}") from None


def _read_parquet(path: Path) -> Iterator[Record]:
    try:
        import pyarrow.parquet as parquet
    except ImportError as error:
        raise DataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from error
    try:
        rows = parquet.read_table(path).to_pylist()
    except Exception as error:  # pyarrow's ArrowInvalid / OSError for a damaged file
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DataError(f"{path}: cannot read Parquet: {first}") from None
    for index, record in enumerate(rows):
        yield f"{path}: row {index}", record


def _read_hub(source: str, split: str | None) -> Iterator[Record]:
    try:
        import datasets
    except ImportError as error:
        raise DataError(
            f"{source!r} is not a local file, and loading hub datasets needs `datasets` "
            "(pip install datasets)"
        ) from error
    dataset_id, _, config = source.partition(":")
    split = split or "train"
    dataset = datasets.load_dataset(dataset_id, config or None, split=split)
    for index, record in enumerate(dataset):
        yield f"{source}[{split}]: row {index}", record


def _local_records(path: Path, split: str | None) -> Iterator[Record]:
    suffix = path.suffix.lower()
    if suffix == ".json":
        return _read_json(path, split)
    if split is not None:
        raise DataError(f"{path}: split={split!r} given, but a {suffix} file has no splits")
    if suffix in (".jsonl", ".ndjson"):
        return _read_jsonl(path)
    if suffix == ".csv":
        return _read_csv(path)
    return _read_parquet(path)


def _field(where: str, record: Mapping[str, Any], name: str) -> Any:
    if name not in record:
        raise DataError(
            f"{where}: missing field {name!r}; fields present: {', '.join(map(str, record)) or 'none'}"
        )
    return record[name]


def _text(value: Any) -> str | None:
    return None if value is None else str(value).strip()


def record_to_example(
    where: str,
    record: Mapping[str, Any],
    *,
    question_field: str = "question",
    answer_field: str | None = "answer",
    solution_field: str | None = None,
) -> Example:
    """One record -> Example, with the GSM8K / MATH answer normalisation of the module docstring."""
    question = _text(_field(where, record, question_field))
    if not question:
        raise DataError(f"{where}: field {question_field!r} is empty")
    raw_answer = _text(_field(where, record, answer_field)) if answer_field else None
    solution = _text(_field(where, record, solution_field)) if solution_field else None
    if raw_answer is None and solution is not None and last_boxed(solution) is not None:
        raw_answer = solution
    answer = normalize_gold(raw_answer) if raw_answer else None
    if solution is None and raw_answer is not None and "####" in raw_answer:
        solution = raw_answer
    return Example(prompt=question, answer=answer or None, solution=solution)


def builtin_examples(source: str) -> tuple[list[Example], list[Example]]:
    """``(train, test)`` of a built-in source (one of :data:`BUILTIN_SOURCES`); the test part
    is the fixed held-out set, independent of any run seed."""
    if source == "builtin:arithmetic":
        return arithmetic_examples()
    name = source.removeprefix("builtin:")
    if source not in BUILTIN_SOURCES:
        raise DataError(f"unknown built-in source {source!r}; known: {', '.join(BUILTIN_SOURCES)}")
    return level_examples(name)


def _builtin(source: str, split: str | None) -> list[Example]:
    train, test = builtin_examples(source)
    return test if split == "test" else train


def _gym(source: str, split: str | None, params: Mapping[str, Any] | None) -> list[Example]:
    from essa.data.gym import GYM_PREFIX, gym_examples

    try:
        return gym_examples(source.removeprefix(GYM_PREFIX), split, params)
    except ValueError as error:
        raise DataError(f"{source}: {error}") from error


def _records(source: str, split: str | None) -> Iterator[Record]:
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix.lower() not in FILE_SUFFIXES:
            raise DataError(f"{path}: unsupported file type; known: {', '.join(FILE_SUFFIXES)}")
        return _local_records(path, split)
    if path.suffix.lower() in FILE_SUFFIXES or source.startswith((".", "/", "~")):
        raise DataError(f"{source}: no such file")
    return _read_hub(source, split)


def load_examples(
    source: str,
    *,
    question_field: str = "question",
    answer_field: str | None = "answer",
    solution_field: str | None = None,
    split: str | None = None,
    limit: int | None = None,
    params: Mapping[str, Any] | None = None,
) -> list[Example]:
    """Examples from ``source`` (see the module docstring), in file order, at most ``limit``;
    ``params`` configure a ``reasoning_gym:TASK`` source (the task's own config fields).

    ``answer_field=None`` reads unlabeled data, or MATH-style data whose answer is the boxed
    content of ``solution_field``. Raises :class:`DataError` naming FILE:LINE (or the row) for
    malformed lines and missing fields, and when no example is left.
    """
    if limit is not None and limit < 1:
        raise DataError(f"{source}: limit must be >= 1, got {limit}")
    if source.startswith("builtin:"):
        examples = _builtin(source, split)[:limit]
    elif source.startswith("reasoning_gym:"):
        examples = _gym(source, split, params)[:limit]
    else:
        examples = []
        for where, record in _records(source, split):
            if limit is not None and len(examples) >= limit:
                break
            examples.append(
                record_to_example(
                    where,
                    record,
                    question_field=question_field,
                    answer_field=answer_field,
                    solution_field=solution_field,
                )
            )
    if not examples:
        raise DataError(f"{source}: no examples")
    return examples


PAIR_FIELDS = ("prompt", "chosen", "rejected")


def load_preference_pairs(source: str) -> list[PreferencePair]:
    """DPO pairs from a local file (one ``{"prompt", "chosen", "rejected"}`` object per JSONL
    line; also .json/.csv/.parquet), in file order. Each field must be a non-empty string;
    :class:`DataError` names FILE:LINE otherwise, and when the file holds no pair."""
    path = Path(source).expanduser()
    if not path.is_file():
        raise DataError(f"{source}: no such file (preference pairs)")
    pairs = []
    for where, record in _records(source, None):
        values = []
        for name in PAIR_FIELDS:
            value = _field(where, record, name)
            if not isinstance(value, str) or not value.strip():
                raise DataError(f"{where}: field {name!r} must be a non-empty string")
            values.append(value)
        pairs.append(PreferencePair(*values))
    if not pairs:
        raise DataError(f"{source}: no preference pairs")
    return pairs


def shuffle(examples: Sequence[Example], seed: int) -> list[Example]:
    """A copy of ``examples`` permuted by ``np.random.default_rng(seed)`` (deterministic)."""
    order = np.random.default_rng(seed).permutation(len(examples))
    return [examples[i] for i in order]


def split_examples(
    examples: Sequence[Example], test_size: int | float, seed: int
) -> tuple[list[Example], list[Example]]:
    """Deterministic ``(train, test)`` split: shuffle with ``seed``, the first ``n_test`` items
    are the test set. ``test_size`` is a count (int) or a fraction in (0, 1) (rounded, at
    least 1); both parts must be non-empty.
    """
    n = len(examples)
    if isinstance(test_size, float):
        if not 0.0 < test_size < 1.0:
            raise DataError(f"test_size fraction must be in (0, 1), got {test_size}")
        n_test = max(1, round(test_size * n))
    else:
        n_test = int(test_size)
    if not 0 < n_test < n:
        raise DataError(
            f"cannot split {n} examples into a test set of {n_test} and a non-empty train set"
        )
    shuffled = shuffle(examples, seed)
    return shuffled[n_test:], shuffled[:n_test]
