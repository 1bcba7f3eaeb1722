"""Fuzzed bad input: config files, --set overrides and data rows (hypothesis).

Property: whatever the input, loading either succeeds or ends in one line ``error: ...`` and
exit code 2 (through the CLI's ``guarded``), never a traceback. Examples are derandomised so CI
sees the same inputs on every run; a few pathological files also go through the real CLI.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import tempfile
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pytest
import typer
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from essa.cli import guarded
from essa.config import Config, ConfigError, DataConfig, load_config, to_dict
from essa.optimizers import OPTIMIZERS
from tests.cli_runner import essa

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,  # nothing written to .hypothesis/: the examples are derandomised anyway
    suppress_health_check=[HealthCheck.too_slow],
)

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["float32", "cma_es", "builtin:demo", "1e-3", "3e400", ".nan", "yes", "~"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)


def run_guarded(fn: Callable[[], Any]) -> tuple[int, str]:
    """Call ``fn`` under the CLI's error handling; return (exit code, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            guarded(fn)()
            code = 0
        except typer.Exit as stop:
            code = stop.exit_code
    return code, err.getvalue()


def assert_clean(code: int, stderr: str) -> None:
    assert code in (0, 2), stderr
    if code == 2:
        assert stderr.startswith("error: ") and stderr.endswith("\n"), stderr
        assert stderr.count("\n") == 1, stderr  # one line
        assert "Traceback" not in stderr


def config_file(text: str | bytes) -> Path:
    with tempfile.NamedTemporaryFile("wb", suffix=".yaml", delete=False) as handle:
        handle.write(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
    return Path(handle.name)


def load_file(text: str | bytes, overrides: tuple[str, ...] = ()) -> tuple[int, str]:
    path = config_file(text)
    try:
        return run_guarded(lambda: load_config(path, overrides))
    finally:
        path.unlink()


@st.composite
def mutated_configs(draw: st.DrawFn) -> str:
    """The default config as YAML with one to three keys replaced, added or deleted."""
    data = to_dict(Config())
    for _ in range(draw(st.integers(1, 3))):
        node = data
        # Down into a section and on into its sub-sections (tools.python, optimizer.layerwise).
        while (keys := sorted(node)) and draw(st.booleans()):
            child = node[draw(st.sampled_from(keys))]
            if not isinstance(child, dict):
                break
            node = child
        names = st.text(max_size=6)  # an empty section (all deleted) gets new keys only
        key = draw(st.one_of(st.sampled_from(keys), names) if keys else names)
        action = draw(st.sampled_from(["replace", "replace", "delete"]))
        if action == "delete":
            node.pop(key, None)
        else:
            node[key] = draw(VALUES)
    return yaml.safe_dump(data, allow_unicode=draw(st.booleans()))


@FUZZ
@given(mutated_configs())
def test_fuzzed_config_values(text: str) -> None:
    assert_clean(*load_file(text))


YAML_PIECES = st.sampled_from(
    ["model:", "  dtype:", " ", "\n", "\t", "- ", "[", "]", "{", "}", ":", "&a", "*a", "!!python/object:os.system",
     "'", '"', "#", "---", "...", "? ", "|", ">", ".nan", "optimizer:\n  sigma0: ", "run:\n  dir: ",
     "!!binary", "%YAML 1.1", "<<: *a", "\x00", "\ud800"]
)  # fmt: skip


@FUZZ
@given(st.lists(st.one_of(YAML_PIECES, st.text(max_size=5)), max_size=25).map("".join))
def test_fuzzed_yaml_text(text: str) -> None:
    assert_clean(*load_file(text))


@FUZZ
@given(st.binary(max_size=200))
def test_fuzzed_config_bytes(data: bytes) -> None:
    assert_clean(*load_file(data))


@FUZZ
@given(
    st.lists(
        st.tuples(
            st.lists(
                st.one_of(st.sampled_from(["model", "optimizer", "run", "dir", "sigma0", "params"]),
                          st.text(max_size=5)),
                min_size=1,
                max_size=3,
            ).map(".".join),
            st.one_of(st.text(max_size=10), st.sampled_from(["[1, 2", "{a: 1}", ".inf", "null"])),
        ).map(lambda kv: f"{kv[0]}={kv[1]}") | st.text(max_size=10),
        max_size=3,
    )
)  # fmt: skip
def test_fuzzed_overrides(overrides: list[str]) -> None:
    code, err = load_file("", tuple(overrides))
    assert_clean(code, err)


def test_known_bad_configs_found_by_fuzzing(tmp_path: Path) -> None:
    """Inputs that used to escape as tracebacks or pass unchecked (kept as regressions)."""
    cases = {
        "optimizer:\n  sigma0: .nan\n": "optimizer.sigma0: expected a finite number",
        "run:\n  max_wall_seconds: .inf\n": "run.max_wall_seconds: expected",
        "optimizer:\n  sigma0: " + "9" * 400 + "\n": "optimizer.sigma0: expected a finite number",
        "a: " + "[" * 5000: "invalid YAML",
        "optimizer:\n  name: \udcff\n": "not a UTF-8 text file",
        "reward:\n  timeout_seconds: 0\n": "reward.timeout_seconds: must be > 0",
    }
    for text, fragment in cases.items():
        code, err = load_file(text)
        assert code == 2 and fragment in err, (text[:40], err)
        assert_clean(code, err)


# ------------------------------------------------------------------------- numeric ranges

# The natural range of every numeric field: (low, high, low included, high included); None: no
# bound on that side. A value outside it must be a ConfigError naming the key, never accepted.
POSITIVE = (0, None, False, False)
NONNEG = (0, None, True, False)
AT_LEAST_1 = (1, None, True, False)
FRACTION = (0, 1, False, True)  # (0, 1]
UNIT = (0, 1, True, True)  # [0, 1]
RANGES: dict[str, tuple[float | None, float | None, bool, bool]] = {
    "model.num_threads": AT_LEAST_1,
    "adapter.rank": AT_LEAST_1,
    "adapter.lora_alpha": POSITIVE,
    "adapter.alpha": FRACTION,
    **{f"{s}.lisa.{k}": AT_LEAST_1 for s in ("sft", "grpo", "dpo", "scalebio")
       for k in ("active_layers", "interval")},
    "sft.steps": NONNEG,
    "sft.batch_size": AT_LEAST_1,
    "sft.lr": POSITIVE,
    "sft.weight_decay": NONNEG,
    "sft.max_length": AT_LEAST_1,
    "sft.lr_warmup_steps": NONNEG,
    "optimizer.population_size": (2, None, True, False),
    "optimizer.sigma0": POSITIVE,
    "optimizer.sep_above_dim": NONNEG,
    "optimizer.lr": POSITIVE,
    "optimizer.eta_mu": POSITIVE,
    "optimizer.eta_sigma": POSITIVE,
    "optimizer.layerwise.active_layers": AT_LEAST_1,
    "optimizer.layerwise.interval": AT_LEAST_1,
    "data.selection.explore_init": FRACTION,
    "data.selection.explore_min": FRACTION,
    "data.selection.explore_max": FRACTION,
    "data.selection.explore_step": UNIT,
    "data.selection.explore_floor": UNIT,
    "data.selection.target_zero_spread": UNIT,
    "data.hints.after": AT_LEAST_1,
    "data.hints.tiers": AT_LEAST_1,
    "data.sft_size": NONNEG,
    "data.test_size": NONNEG,
    "data.train_size": AT_LEAST_1,
    "data.val_size": NONNEG,
    "data.batch_size": AT_LEAST_1,
    "reward.timeout_seconds": POSITIVE,
    "reward.reference_weight": NONNEG,
    "generation.max_new_tokens": AT_LEAST_1,
    "generation.temperature": NONNEG,
    "generation.top_p": FRACTION,
    "generation.samples_per_prompt": AT_LEAST_1,
    "evaluation.micro_batch_size": AT_LEAST_1,
    "evaluation.every": NONNEG,
    "evaluation.drift.prompts": NONNEG,
    "evaluation.drift.tokens": AT_LEAST_1,
    "evaluation.drift.retention_tokens": AT_LEAST_1,
    "evaluation.drift.items": NONNEG,
    "evaluation.drift.samples": NONNEG,
    "evaluation.drift.temperature": POSITIVE,
    "run.generations": NONNEG,
    "run.seed": (0, 2**32 - 1, True, True),
    "run.max_wall_seconds": POSITIVE,
    "run.patience": NONNEG,
    "run.min_signal": UNIT,
    "run.signal_window": AT_LEAST_1,
    "grpo.group_size": (2, None, True, False),
    "grpo.prompts_per_step": AT_LEAST_1,
    "grpo.temperature": POSITIVE,
    "grpo.num_iterations": AT_LEAST_1,
    "grpo.beta": NONNEG,
    "grpo.epsilon_low": (0, 1, True, False),
    "grpo.epsilon_high": NONNEG,
    "grpo.lr": POSITIVE,
    "grpo.weight_decay": NONNEG,
    "grpo.lr_warmup_steps": NONNEG,
    "grpo.max_grad_norm": NONNEG,
    "grpo.grad_accumulation": AT_LEAST_1,
    "grpo.overlong_buffer": NONNEG,
    "grpo.train_examples": AT_LEAST_1,
    "grpo.cure.top_k_tokens": AT_LEAST_1,
    "grpo.cure.branches": AT_LEAST_1,
    "grpo.cure.stage1_steps": AT_LEAST_1,
    "grpo.replay.capacity": NONNEG,
    "grpo.replay.ratio": NONNEG,
    "grpo.entropy.coef": NONNEG,
    "grpo.entropy.floor": NONNEG,
    "grpo.prime.beta": POSITIVE,
    "grpo.prime.prm_lr": POSITIVE,
    "grpo.prime.process_weight": NONNEG,
    "grpo.prime.outcome_weight": NONNEG,
    "dpo.beta": POSITIVE,
    "dpo.label_smoothing": (0, 0.5, True, False),
    "dpo.pairs_per_step": AT_LEAST_1,
    "dpo.samples_per_prompt": (2, None, True, False),
    "dpo.temperature": POSITIVE,
    "dpo.entropy_floor": NONNEG,
    "dpo.train_examples": AT_LEAST_1,
    "dpo.lr": POSITIVE,
    "dpo.weight_decay": NONNEG,
    "dpo.max_grad_norm": NONNEG,
    "scalebio.batch_size": AT_LEAST_1,
    "scalebio.lr": POSITIVE,
    "scalebio.weight_decay": NONNEG,
    "scalebio.weight_lr": POSITIVE,
    "scalebio.penalty": POSITIVE,
    "scalebio.max_grad_norm": NONNEG,
    "scalebio.max_length": AT_LEAST_1,
    "vllm.tensor_parallel_size": AT_LEAST_1,
    "vllm.gpu_memory_utilization": FRACTION,
    "vllm.max_loras": AT_LEAST_1,
    "vllm.max_lora_rank": AT_LEAST_1,
    "vllm.max_model_len": AT_LEAST_1,
    "vllm.kv_cache_space_gb": AT_LEAST_1,
    "vllm.max_num_seqs": AT_LEAST_1,
    "tools.python.timeout_seconds": POSITIVE,
    "tools.python.memory_mb": AT_LEAST_1,
    "tools.python.max_processes": AT_LEAST_1,
    "tools.python.max_file_mb": AT_LEAST_1,
    "tools.python.max_output_chars": AT_LEAST_1,
    "tools.python.max_concurrent": AT_LEAST_1,
    "tools.python.max_tool_calls": NONNEG,
    "optimizer.drift_budget.kl_penalty": NONNEG,
    "optimizer.drift_budget.kl_budget": POSITIVE,
    "optimizer.drift_budget.kl_budget_sft": POSITIVE,
    "optimizer.drift_budget.prompts": AT_LEAST_1,
    "optimizer.drift_budget.tokens": AT_LEAST_1,
    "optimizer.drift_budget.anchor": NONNEG,
    "optimizer.drift_budget.decay": (0, 1, True, False),  # [0, 1): 1 would pin the mean to x0
}  # fmt: skip
# The ES optimizers' own keys, written flat in the optimizer section: optimizer name -> its options.
OPTION_OWNERS = {name: spec.options for name, spec in OPTIMIZERS.items()}
UNBOUNDED = {"grpo.replay.min_reward"}  # a reward threshold: any real number is meaningful


def numeric_fields(cls: type = Config, prefix: str = "") -> dict[str, type]:
    """Every int or float leaf of the schema (optional ones included): dotted key -> int/float.
    A ``flat`` field (the ES optimizers' own keys) contributes every registered optimizer's."""
    out: dict[str, type] = {}
    flat = {f.name for f in dataclasses.fields(cls) if "flat" in f.metadata}
    for name, tp in typing.get_type_hints(cls).items():
        key = f"{prefix}{name}"
        if name in flat:
            for options in OPTION_OWNERS.values():
                out.update(numeric_fields(options, prefix))
            continue
        if dataclasses.is_dataclass(tp):
            out.update(numeric_fields(tp, f"{key}."))
            continue
        args = typing.get_args(tp)
        # Optional fields and keyword arms ("auto") aside, the field is numeric.
        arms = {a for a in args if a is not type(None) and typing.get_origin(a) is not Literal}
        arms = arms if args else {tp}
        if arms in ({int}, {float}):
            out[key] = arms.pop()
    return out


def test_every_numeric_field_has_a_declared_range() -> None:
    assert set(numeric_fields()) == set(RANGES) | UNBOUNDED


@st.composite
def out_of_range(draw: st.DrawFn) -> tuple[str, int | float]:
    """A numeric field and a value just or far outside its natural range."""
    key = draw(st.sampled_from(sorted(RANGES)))
    low, high, low_in, high_in = RANGES[key]
    sides = [s for s, bound in (("below", low), ("above", high)) if bound is not None]
    side = draw(st.sampled_from(sides))
    if numeric_fields()[key] is int:
        if side == "below":
            return key, draw(st.integers(max_value=int(low) - 1 if low_in else int(low)))
        return key, draw(st.integers(min_value=int(high) + 1 if high_in else int(high)))
    finite = {"allow_nan": False, "allow_infinity": False, "width": 32}
    if side == "below":
        return key, draw(st.floats(max_value=low, exclude_max=low_in, **finite))
    return key, draw(st.floats(min_value=high, exclude_min=high_in, **finite))


@FUZZ
@given(out_of_range())
def test_out_of_range_numbers_are_refused_naming_key_and_file(case: tuple[str, float]) -> None:
    key, value = case
    data: dict[str, Any] = {}
    node = data
    *sections, name = key.split(".")
    for section in sections:
        node = node.setdefault(section, {})
    node[name] = value
    owners = [n for n, options in OPTION_OWNERS.items() if name in numeric_fields(options)]
    if sections == ["optimizer"] and owners:  # an optimizer's own key: that optimizer chosen
        node["name"] = owners[0]
    path = config_file(yaml.safe_dump(data))
    try:
        with pytest.raises(ConfigError) as err:
            load_config(path)
    finally:
        path.unlink()
    message = str(err.value)
    assert message.startswith(f"{path}:") and f" {key}: " in message, message
    assert "\n" not in message


# ------------------------------------------------------------------------------------ data rows

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)  # fmt: skip
RECORDS = st.fixed_dictionaries(
    {},
    optional={"question": JSON_VALUES, "answer": JSON_VALUES, "solution": JSON_VALUES},
).flatmap(
    lambda d: st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=2).map(
        lambda e: {**e, **d}
    )
)
LINES = st.one_of(
    RECORDS.map(json.dumps),
    JSON_VALUES.map(json.dumps),
    st.binary(max_size=20).map(lambda b: b.decode("latin-1")),
    st.just("{\"question\": \"1+1=\", \"answer\": \"2\"}"),
    st.just("[" * 3000),
)  # fmt: skip


def load_rows(name: str, content: bytes) -> tuple[int, str]:
    from essa.data.task import load_task

    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / name
        path.write_bytes(content)
        cfg = DataConfig(source=str(path), test_size=1, sft_size=0, solution_field=None)
        return run_guarded(lambda: load_task(cfg, 0))


@FUZZ
@given(st.lists(LINES, max_size=6), st.sampled_from(["utf-8", "latin-1"]))
def test_fuzzed_jsonl_rows(lines: list[str], encoding: str) -> None:
    content = "\n".join(lines).encode(encoding, "replace")
    assert_clean(*load_rows("rows.jsonl", content))


@FUZZ
@given(st.binary(max_size=300), st.sampled_from(["d.jsonl", "d.json", "d.csv", "d.parquet"]))
def test_fuzzed_data_file_bytes(content: bytes, name: str) -> None:
    assert_clean(*load_rows(name, content))


@FUZZ
@given(st.lists(st.lists(st.text(max_size=8), max_size=4), max_size=5))
def test_fuzzed_csv_rows(rows: list[list[str]]) -> None:
    import csv

    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["question", "answer"])
    writer.writerows(rows)
    assert_clean(*load_rows("rows.csv", buffer.getvalue().encode("utf-8", "surrogatepass")))


def test_known_bad_data_files() -> None:
    """Data files that used to escape as tracebacks (kept as regressions)."""
    cases = [
        ("d.csv", b'question,answer\n"' + b"x" * 200_000 + b'",1\n', "invalid CSV: field larger"),
        ("d.csv", b"question,answer\n\xff\xfe,1\n", "not UTF-8 text"),
        ("d.parquet", b"PAR1 this is not parquet PAR1", "cannot read Parquet"),
        ("d.json", b"[" * 5000, "nested too deeply"),
        ("d.jsonl", b'{"question": "1+1=", "answer": "2"}\n' + b"[" * 5000, ":2: invalid JSON"),
        ("d.jsonl", b'{"question": "1+1=", "answer": "2"}\n\xff\n', ":2: not UTF-8 text"),
    ]
    for name, content, fragment in cases:
        code, err = load_rows(name, content)
        assert code == 2 and fragment in err, (name, err)
        assert_clean(code, err)


# ------------------------------------------------------------------------- the real CLI, too

CLI_CASES = {
    "config.yaml": b"optimizer:\n  sigma0: .nan\n",
    "deep.yaml": b"a: " + b"[" * 5000,
    "binary.yaml": bytes(range(256)),
    "rows.jsonl": b'{"question": "1+1=", "answer": "2"}\n\xff\xfe{"question"\n',
}


@pytest.mark.parametrize("name", sorted(CLI_CASES))
def test_cli_rejects_bad_file_in_one_line(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_bytes(CLI_CASES[name])
    if name.endswith(".yaml"):
        args = ["config", "show", str(path)]
    else:
        args = ["eval", "--set", f"data.source={path}", "--set", "data.test_size=1"]
    res = essa(*args, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert str(path) in lines[0]
