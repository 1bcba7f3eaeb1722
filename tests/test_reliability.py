"""Faults, injected on purpose: storage, evaluation, unsafe files. Table: docs/reliability.md.

The kill -9 / resume chain lives in tests/test_train_e2e.py (test_kill_and_resume_matches_
uninterrupted); fuzzed configs and data rows in tests/test_fuzz_config.py.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import subprocess
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from essa.config import EvaluationConfig, GenerationConfig, ModelConfig
from essa.errors import UserError
from tests.cli_runner import essa
from tests.conftest import svd_setup

# Fast settings for CLI runs: the faults act during the ES loop, not on accuracy.
FAST = [
    "sft.steps=2",
    "data.sft_size=16",
    "data.batch_size=4",
    "data.test_size=8",
    "optimizer.population_size=4",
    "evaluation.every=0",
    "evaluation.use_scale_baseline=false",
    "run.show_progress=false",
]


def sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def one_error_line(res: subprocess.CompletedProcess[str]) -> str:
    """The single stderr line of a user error (exit 2, no traceback)."""
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


# --------------------------------------------------------------------------- evaluation faults


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    return svd_setup(tiny_model_dir)


PROMPTS = ["12+3=", "7+45=", "1+1=", "99+99="]


def _population(adapter) -> np.ndarray:  # type: ignore[no-untyped-def]
    x = np.random.default_rng(0).normal(size=(3, adapter.dim)) * adapter.stds()  # (3, D)
    x[1] = 1e30  # singular values this large overflow float32: the logits become NaN/inf
    return x


@pytest.mark.parametrize("strategy", ["batched", "merged"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nonfinite_logits_flag_the_candidate(setup, strategy: str, temperature: float) -> None:  # type: ignore[no-untyped-def]
    """A candidate whose logits turn NaN/inf is flagged (NaN fitness in the recipe); the others
    get exactly the completions they get on their own, and sampling does not crash."""
    from essa.backends.evaluator import PopulationEvaluator

    model, tokenizer, adapter = setup
    gen = GenerationConfig(max_new_tokens=5, temperature=temperature)
    evaluator = PopulationEvaluator(
        model, tokenizer, adapter, gen, EvaluationConfig(strategy=strategy)
    )
    x = _population(adapter)
    out = evaluator.completions(x, PROMPTS, seed=3)
    assert evaluator.nonfinite.tolist() == [False, True, False]
    assert out[1] == [""] * len(PROMPTS)  # ended at once with EOS, nothing graded
    if temperature == 0.0:  # greedy: the healthy candidates are unaffected by the sick one
        alone = evaluator.completions(x[[0, 2]], PROMPTS)
        assert evaluator.nonfinite.tolist() == [False, False]
        assert [out[0], out[2]] == alone


def _oom_after(limit: int, calls: list[int]):  # type: ignore[no-untyped-def]
    """generate_texts that raises an out-of-memory error above ``limit`` rows per forward.

    A mock, because a real out-of-memory cannot be provoked safely on a shared CPU host (the
    kernel would kill a process) and there is no GPU here.
    """
    from essa.backends import generate as hf

    def fake(*args, micro_batch_size: int, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(micro_batch_size)
        if micro_batch_size > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return hf.generate_texts(*args, micro_batch_size=micro_batch_size, **kwargs)

    return fake


@pytest.mark.parametrize("strategy", ["batched", "merged"])
def test_out_of_memory_halves_micro_batch_and_retries(
    setup, monkeypatch, caplog, strategy: str
) -> None:  # type: ignore[no-untyped-def]
    from essa.backends import evaluator as evaluator_module
    from essa.backends.evaluator import PopulationEvaluator

    model, tokenizer, adapter = setup
    gen = GenerationConfig(max_new_tokens=4)
    x = _population(adapter)[[0, 2]]
    cfg = EvaluationConfig(strategy=strategy, micro_batch_size=16)
    reference = PopulationEvaluator(model, tokenizer, adapter, gen, cfg).completions(x, PROMPTS)
    calls: list[int] = []
    monkeypatch.setattr(evaluator_module, "generate_texts", _oom_after(3, calls))
    evaluator = PopulationEvaluator(model, tokenizer, adapter, gen, cfg)
    with caplog.at_level(logging.WARNING, logger="essa.backends.evaluator"):
        out = evaluator.completions(x, PROMPTS)
    assert out == reference
    assert evaluator.micro_batch_size == 2  # 16 -> 8 -> 4 -> 2, and it stays there
    assert calls[:4] == [16, 8, 4, 2]
    assert sum("out of memory with micro_batch_size" in r.message for r in caplog.records) == 3


def test_out_of_memory_retry_returns_one_set_of_logprobs(setup, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``merged`` generates per candidate: an out-of-memory error after the first one retries
    the whole call, and the log-probs are the call's, one list per candidate (not P + 1)."""
    from essa.backends import evaluator as evaluator_module
    from essa.backends import generate as hf
    from essa.backends.evaluator import PopulationEvaluator

    model, tokenizer, adapter = setup
    x = _population(adapter)[[0, 2]]
    references = ["15", "52", "2", "198"]

    def evaluate() -> tuple[list[list[str]], list, list]:
        cfg = EvaluationConfig(strategy="merged", micro_batch_size=8)
        evaluator = PopulationEvaluator(
            model, tokenizer, adapter, GenerationConfig(max_new_tokens=8), cfg
        )
        evaluator.record_logprobs = True
        out = evaluator.completions(x, PROMPTS, references=references)
        return out, evaluator.last_logprobs, evaluator.last_reference_logprobs

    reference = evaluate()
    calls: list[int] = []

    def second_call_fails(*args, micro_batch_size: int, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(micro_batch_size)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return hf.generate_texts(*args, micro_batch_size=micro_batch_size, **kwargs)

    monkeypatch.setattr(evaluator_module, "generate_texts", second_call_fails)
    out, logprobs, ref_logprobs = evaluate()
    assert calls == [8, 8, 4, 4]  # candidate 0, candidate 1 fails; both again at 4
    assert len(logprobs) == len(ref_logprobs) == len(x)
    assert (out, logprobs, ref_logprobs) == reference


def test_out_of_memory_at_one_sequence_is_a_clear_error(setup, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from essa.backends import evaluator as evaluator_module
    from essa.backends.evaluator import PopulationEvaluator

    model, tokenizer, adapter = setup
    monkeypatch.setattr(evaluator_module, "generate_texts", _oom_after(0, []))
    cfg = EvaluationConfig(strategy="batched", micro_batch_size=4)
    evaluator = PopulationEvaluator(
        model, tokenizer, adapter, GenerationConfig(max_new_tokens=8), cfg
    )
    with pytest.raises(UserError, match="out of memory during evaluation even at one sequence"):
        evaluator.completions(_population(adapter)[:1], PROMPTS)


def test_host_memory_error_counts_as_out_of_memory() -> None:
    from essa.backends.evaluator import is_out_of_memory

    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(RuntimeError("[enforce fail] DefaultCPUAllocator: out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


def test_deadline_bounds_a_hanging_reward() -> None:
    import threading
    import time

    from essa.rewards import Reward
    from essa.rewards.deadline import with_deadline

    release = threading.Event()  # lets the abandoned call end with the test

    def hangs_on_x(completions: list[str], answers: list, prompts: list[str]) -> list[float]:
        if "x" in completions:
            release.wait(30)
        return [1.0] * len(completions)

    reward = with_deadline(Reward("custom", hangs_on_x), 0.2)
    start = time.perf_counter()
    assert reward(["a", "x"], ["1", "1"], ["p", "q"]) == [None, None]
    assert time.perf_counter() - start < 5
    assert reward(["a", "b"], ["1", "1"], ["p", "q"]) == [1.0, 1.0]
    assert reward.stats.as_dict() == {"n_items": 4, "n_none": 2, "n_error": 0, "n_timeout": 2}
    release.set()


HANGING_REWARD = """
import threading

CALLS = []


def flaky(completions, answers, prompts):
    \"\"\"One call per candidate: generation 0 hangs on every second call, then on all.\"\"\"
    CALLS.append(1)
    if len(CALLS) % 2 == 0 or len(CALLS) > 4:
        threading.Event().wait()
    return [1.0] * len(completions)
"""


@pytest.mark.slow
def test_hanging_custom_reward_is_bounded(tmp_path: Path) -> None:
    """Half the candidates hang: NaN fitness, counted; a generation of hangs stops the run."""
    module = f"hang_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(HANGING_REWARD)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    run_dir = tmp_path / "run"
    res = essa(
        "train",
        "--run-dir",
        str(run_dir),
        *sets(
            *FAST,
            "run.generations=3",
            "evaluation.strategy=batched",
            f"reward.name={module}:flaky",
            "reward.timeout_seconds=0.4",
        ),
        env=env,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 2 and "did not return within 0.4 s" in lines[0]  # warned once
    assert lines[1].startswith("error: generation 1: all 4 candidates failed (NaN fitness)")
    assert "timed out on 16 " in lines[1]  # 4 candidates x 4 prompts
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (gen0,) = [r for r in records if r["generation"] >= 0]
    assert gen0["n_failed"] == 2 and gen0["reward_timeouts"] == 8  # candidates 1 and 3 hung
    assert gen0["best_fitness"] == 1.0
    checkpoint = json.loads((run_dir / "checkpoint.json").read_text())
    assert checkpoint["optimizer"]["generation"] == 1  # generation 1 was never told


# ------------------------------------------------------------------------------- storage faults


def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@pytest.fixture
def small_tmpfs(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A real 1 MiB filesystem (tmpfs); skipped where this process may not mount."""
    where = tmp_path / "tmpfs"
    where.mkdir()
    if not _mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)):
        pytest.skip("cannot mount a tmpfs here (needs root and mount permission)")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.component("tmpfs")
def test_small_filesystem_is_refused_before_training(small_tmpfs: Path) -> None:
    res = essa("train", "--run-dir", str(small_tmpfs / "run"), *sets(*FAST))
    line = one_error_line(res)
    assert f"run.dir {small_tmpfs / 'run'}: only" in line and "MiB free" in line


@pytest.mark.component("tmpfs")
def test_full_filesystem_is_refused_before_training(small_tmpfs: Path) -> None:
    from essa.rundir import prepare_run_dir

    (small_tmpfs / "run").mkdir()
    with open(small_tmpfs / "filler", "wb") as f:  # fill it up
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    with pytest.raises(UserError, match="not writable \\(no space left on device\\)"):
        prepare_run_dir(small_tmpfs / "run", resume=False, overwrite=False)
    assert not (small_tmpfs / "run" / ".write-probe").exists()


@pytest.mark.component("readonly")
def test_read_only_run_dir_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "ro"
    target.mkdir()
    if not _mount("--bind", "-o", "ro", str(target), str(target)):
        pytest.skip("cannot bind-mount read-only here (root ignores chmod, so no fallback)")
    try:
        res = essa("train", "--run-dir", str(target / "run"), *sets(*FAST))
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)
    line = one_error_line(res)
    assert line.startswith(f"error: run.dir {target / 'run'}: not writable (Read-only file system)")


def test_failed_write_keeps_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import essa.rundir
    from essa.rundir import StorageError, atomic_write_json, before_checkpoint
    from tests.faults.sitecustomize import checkpoint_fault

    path = tmp_path / "checkpoint.json"
    atomic_write_json(path, {"generation": 1})
    assert before_checkpoint(2) is None  # no hook installed: nothing injected
    monkeypatch.setenv("ESSA_FAULT", "enospc@2")
    monkeypatch.setattr(essa.rundir, "checkpoint_hook", checkpoint_fault)
    assert before_checkpoint(1) is None
    hook = before_checkpoint(2)
    with pytest.raises(StorageError, match="checkpoint.json: no space left on device"):
        atomic_write_json(path, {"generation": 2}, before_rename=hook)
    assert json.loads(path.read_text()) == {"generation": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.json"]  # no temp left


# ------------------------------------------------------------------- corrupt or unsafe inputs


def _optimizer(population_size: int = 4):  # type: ignore[no-untyped-def]
    from essa.optimizers import make_optimizer

    return make_optimizer("cma_es", 6, population_size=population_size, sigma0=0.5, seed=0)


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: text[: len(text) // 2],  # truncated (an edited or damaged file)
        lambda text: "[]",
        lambda text: json.dumps({"optimizer": {"generation": "three"}}),
        lambda text: json.dumps(
            {**json.loads(text), "optimizer": {**json.loads(text)["optimizer"], "history": [[1]]}}
        ),
    ],
)
def test_corrupt_checkpoint_is_a_clear_error(tmp_path: Path, damage) -> None:  # type: ignore[no-untyped-def]
    from essa.es.checkpoint import load, save

    opt = _optimizer()
    x = opt.ask()
    opt.tell(x, np.arange(4.0))
    save(tmp_path, opt, {"elapsed": 1.0})
    path = tmp_path / "checkpoint.json"
    path.write_text(damage(path.read_text()))
    with pytest.raises(UserError, match="cannot resume from this checkpoint") as info:
        load(tmp_path, lambda scale: _optimizer())
    assert "\n" not in str(info.value)
    assert "not callable" not in str(info.value)  # refused for the damage, not a wrong call


def test_checkpoint_of_another_population_size_is_refused(tmp_path: Path) -> None:
    from essa.es.checkpoint import load, save

    opt = _optimizer()
    opt.tell(opt.ask(), np.arange(4.0))
    save(tmp_path, opt, {"elapsed": 1.0})
    with pytest.raises(UserError, match="different constructor arguments: population_size"):
        load(tmp_path, lambda scale: _optimizer(population_size=6))
    restored, data = load(tmp_path, lambda scale: _optimizer())  # the right size
    assert restored is not None and restored.generation == 1 and data == {"elapsed": 1.0}


class _RunsCode:
    """Unpickling this calls os.mkdir(marker): the classic malicious pickle."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.mkdir, (str(self.marker),))


def test_pickled_model_weights_never_run_code(tiny_model_dir: Path, tmp_path: Path) -> None:
    from essa.backends.models import load_model

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / "model.safetensors").unlink()
    marker = tmp_path / "pwned"
    with open(model_dir / "pytorch_model.bin", "wb") as f:
        pickle.dump({"model.embed_tokens.weight": _RunsCode(marker)}, f)
    with pytest.raises(UserError, match="model.name_or_path: cannot load model"):
        load_model(ModelConfig(name_or_path=str(model_dir)))
    assert not marker.exists()

    # A plain tensor pickle is fine: torch.load(weights_only=True) reads tensors only.
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.save(reference.state_dict(), model_dir / "pytorch_model.bin")
    model, _ = load_model(ModelConfig(name_or_path=str(model_dir)))
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_pickled_adapter_never_runs_code(tiny_model_dir: Path, tmp_path: Path) -> None:
    from essa.backends.models import load_model
    from essa.setup import load_peft_adapter

    adapter_dir = tmp_path / "adapter"
    adapter_dir.mkdir()
    (adapter_dir / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": 4,
                "lora_alpha": 8,
                "target_modules": ["q_proj"],
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": str(tiny_model_dir),
            }
        )
    )
    marker = tmp_path / "pwned"
    with open(adapter_dir / "adapter_model.bin", "wb") as f:
        pickle.dump({"x": _RunsCode(marker)}, f)
    model, _ = load_model(ModelConfig(name_or_path=str(tiny_model_dir)))
    with pytest.raises(UserError, match=f"adapter.path: cannot load the adapter in {adapter_dir}"):
        load_peft_adapter(model, str(adapter_dir), "adapter.path")
    assert not marker.exists()


REMOTE_CODE = """
import os
os.mkdir({marker!r})
from transformers import Qwen2ForCausalLM


class CustomForCausalLM(Qwen2ForCausalLM):
    pass
"""


def test_remote_code_runs_only_when_trusted(tiny_model_dir: Path, tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    from essa.backends.models import load_model

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    marker = tmp_path / "remote-code-ran"
    (model_dir / "modeling_custom.py").write_text(REMOTE_CODE.format(marker=str(marker)))
    config = json.loads((model_dir / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (model_dir / "config.json").write_text(json.dumps(config))
    try:
        load_model(ModelConfig(name_or_path=str(model_dir)))  # built-in Qwen2 code, or refused
    except UserError as err:
        assert "trust_remote_code" in str(err)
    assert not marker.exists()

    with caplog.at_level(logging.WARNING, logger="essa.backends.models"):
        model, _ = load_model(ModelConfig(name_or_path=str(model_dir), trust_remote_code=True))
    assert marker.exists() and type(model).__name__ == "CustomForCausalLM"
    assert any("trust_remote_code is TRUE" in r.message for r in caplog.records)


def test_custom_reward_is_never_loaded_from_a_file_path(tmp_path: Path) -> None:
    from essa.rewards import get_reward

    marker = tmp_path / "reward-ran"
    evil = tmp_path / "evil_reward.py"
    evil.write_text(f"import os\nos.mkdir({str(marker)!r})\ndef fn(c, a, p):\n    return [1.0]\n")
    for name in (f"{evil}:fn", f"{tmp_path}/evil_reward:fn", "./evil_reward.py:fn"):
        with pytest.raises(ValueError, match="cannot import module"):
            get_reward(name)
    with pytest.raises(ValueError, match="must be written 'module:function'"):
        get_reward(":fn")
    assert not marker.exists()


def test_guarded_errors_stay_on_one_line(capsys) -> None:  # type: ignore[no-untyped-def]
    import typer

    from essa.cli import guarded

    @guarded
    def fails() -> None:  # a message quoting user text (a field name) with a line break
        raise UserError("data.jsonl:3: missing field 'q'; fields present: a\nb")

    with pytest.raises(typer.Exit) as info:
        fails()
    assert info.value.exit_code == 2
    err = capsys.readouterr().err
    assert err == "error: data.jsonl:3: missing field 'q'; fields present: a\\nb\n"


def test_metrics_torn_by_a_kill_are_dropped_on_resume(tmp_path: Path) -> None:
    from essa.rundir import MetricsLog

    log = MetricsLog(tmp_path / "metrics.jsonl")
    for g in range(-1, 3):
        log.write({"generation": g})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"generation": 3, "mean_fi')  # a kill -9 in the middle of a line
    log.truncate_after(1)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["generation"] for line in lines] == [-1, 0, 1]


class _StubEvaluator:
    """A fake evaluator (fixed completions, candidate 2 flagged non-finite) for the recipe's
    fitness bookkeeping alone; the real flagging is tested above on a real model."""

    def __init__(self) -> None:
        self.nonfinite = np.array([False, False, True, False])
        self.chosen: dict[int, str] = {}

    def completions(self, population, prompts, seed=None, progress=None, samples=1):  # type: ignore[no-untyped-def]
        return [["4"] * len(prompts), ["inf"] * len(prompts), ["4"] * len(prompts), ["x"] * 2]


def test_failed_candidates_get_nan_fitness_and_are_counted() -> None:
    from essa.config import Config
    from essa.dist import get_comm
    from essa.es.generation import FitnessSettings
    from essa.es.generation import fault_counts as _fault_counts
    from essa.es.generation import generation_record as _generation_record
    from essa.es.generation import shard_fitness as _fitness
    from essa.rewards import Reward
    from essa.types import Example

    def scores(completions: list[str], answers: list, prompts: list[str]) -> list[object]:
        # "inf" is not a usable reward; "x" cannot be graded (None)
        return [{"4": 1.0, "inf": float("inf"), "x": None}[c] for c in completions]

    reward = Reward("custom", scores)
    evaluator = _StubEvaluator()
    train = [Example(prompt="2+2=", answer="4", solution=None)] * 2
    cfg = Config()
    settings = FitnessSettings.of(cfg.run, cfg.data, cfg.generation, cfg.reward)
    fitness, _ = _fitness(
        settings, 0, np.zeros((4, 3)), evaluator, train, ["2+2="] * 2, reward, get_comm()
    )
    assert fitness[0] == 1.0 and np.isnan(fitness[1:]).all()  # inf, non-finite logits, None
    record = _generation_record(0, fitness, {}, 1.0, 10, evaluator)
    assert record["n_failed"] == 3 and record["best_fitness"] == 1.0
    faults = _fault_counts(reward, evaluator)
    assert faults["nonfinite_candidates"] == 1 and faults["reward_errors"] == 2
