"""Multi-rank runs under a real ``mpiexec`` (MPICH from ``pip install 'essa-align[mpi]'``).

Skipped, with the reason, when no mpiexec or mpi4py is installed (a failure under
ESSA_REQUIRE=mpi). Every run is tiny (a random 2-layer model, population 4, 4 prompts, 8 new
tokens) so the file takes well under two minutes on 2 cores. The fault tests bound each run by
FAULT_TIMEOUT, generous for a loaded machine (a hang raises TimeoutExpired), and check the exit
code and message, never the wall time.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from essa.config import ModelConfig
from essa.dist import LocalComm, any_rank, check_replicas, get_comm, place_rank, shard
from essa.dist.mpi import detect_mpi_launch
from essa.errors import UserError
from tests.conftest import requires
from tests.test_train_e2e import SMALL as E2E_SMALL

TESTS = Path(__file__).parent
SMALL = [
    "sft.steps=10",
    "sft.lr=0.01",
    "data.sft_size=32",
    "data.batch_size=4",
    "data.test_size=20",
    "optimizer.population_size=4",
    "optimizer.sigma0=3",
    "evaluation.every=2",
    "evaluation.strategy=batched",  # the same strategy on every rank: bit-identical fitness
    "run.show_progress=false",
    "reward.name=mpi_helpers:char_variety",
    # The tiny model is not builtin:demo: pin the demo's values the schema no longer defaults to.
    "generation.max_new_tokens=8",
    "sft.batch_size=100",
    "evaluation.use_scale_baseline=true",
    # The tiny model scores 0 on the held-out metric (validation too): search all the same.
    "run.on_no_signal=search",
]
FAULT_TIMEOUT = 300  # s; a healthy fault run ends in seconds, a hung one would never end
MPI_ABORT_EXIT = 1  # essa.cli's guard calls MPI_Abort(COMM_WORLD, 1); mpiexec passes it on
# Differ by rank count by design: timings, rank 0's own token count, the exchange itself.
PER_RANK_KEYS = {
    "seconds",
    "tokens_per_second",
    "new_tokens",
    "world_size",
    "comm_bytes",
    "peak_rss_mb",
}


def find_mpiexec() -> str | None:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def mpi_ready() -> str:
    """Empty when multi-rank tests can run, else the reason they cannot."""
    if find_mpiexec() is None:
        return "no mpiexec (pip install 'essa-align[mpi]')"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install 'essa-align[mpi]')"
    return ""


needs_mpi = requires("mpi", mpi_ready() or None)


def rank_env() -> dict[str, str]:
    """The environment of every launched process: one thread each, tests/ importable."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("ESSA_DIST", None)
    return env


def launch(
    ranks: int, *args: str, timeout: float = 300
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``python ARGS`` on ``ranks`` MPI ranks (0: plain, no mpiexec); return (result, s)."""
    prefix = [find_mpiexec() or "mpiexec", "-n", str(ranks)] if ranks else []
    start = time.perf_counter()
    result = subprocess.run(
        [*prefix, sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=rank_env(),
    )
    return result, time.perf_counter() - start


def train(ranks: int, *args: str, sets: list[str]) -> subprocess.CompletedProcess[str]:
    overrides = [a for item in sets for a in ("--set", item)]
    res, _ = launch(ranks, "-m", "essa.cli", "train", *args, *overrides)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res


def small(model_dir: Path, *extra: str) -> list[str]:
    return [f"model.name_or_path={model_dir}", *SMALL, *extra]


def generations(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def trajectory(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in PER_RANK_KEYS} for r in generations(run_dir)]


def adapter(run_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def assert_same_adapter(a: Path, b: Path) -> None:
    x, y = adapter(a), adapter(b)
    assert set(x) == set(y)
    for key in x:
        assert np.array_equal(x[key], y[key]), key


# ------------------------------------------------------------------ single process, no mpiexec


def test_detect_mpi_launch() -> None:
    assert detect_mpi_launch({}) is None
    assert detect_mpi_launch({"PMI_RANK": "0", "PMI_SIZE": "1"}) is None  # mpiexec -n 1
    assert detect_mpi_launch({"OMPI_COMM_WORLD_SIZE": "4"}) == "OMPI_COMM_WORLD_SIZE=4"
    # sbatch's own script sees SLURM_NTASKS of the allocation, but only srun sets the step size.
    assert detect_mpi_launch({"SLURM_NTASKS": "8", "SLURM_PROCID": "0"}) is None
    assert detect_mpi_launch({"SLURM_STEP_NUM_TASKS": "8"}) == "SLURM_STEP_NUM_TASKS=8"


def test_get_comm_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("ESSA_DIST", raising=False)
    assert isinstance(get_comm(), LocalComm)
    monkeypatch.setenv("PMI_SIZE", "2")
    assert isinstance(get_comm("local"), LocalComm)
    monkeypatch.setenv("ESSA_DIST", "everywhere")
    with pytest.raises(UserError, match="ESSA_DIST=everywhere"):
        get_comm()


def test_local_comm_helpers() -> None:
    comm = LocalComm()
    assert comm.allgather_fitness(np.array([1.0, np.nan])).tolist()[0] == 1.0
    assert any_rank(comm, True) and not any_rank(comm, False)
    check_replicas(comm, object(), 0)  # one rank: nothing to compare, no checksum computed
    for size in range(1, 9):
        for world in range(1, 6):
            slices = [shard(size, r, world) for r in range(world)]
            assert [i for s in slices for i in range(size)[s]] == list(range(size))
            assert (
                max(s.stop - s.start for s in slices) - min(s.stop - s.start for s in slices) <= 1
            )


class FakeComm(LocalComm):
    def __init__(self, world_size: int, local_rank: int, local_size: int) -> None:
        self.world_size, self.local_rank, self.local_size = world_size, local_rank, local_size


def test_place_rank_one_rank_per_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    auto = ModelConfig()
    assert place_rank(auto, FakeComm(4, 3, 4)).device == "cuda:1"  # local rank 3 of 4, 2 GPUs
    assert place_rank(replace(auto, device="cuda"), FakeComm(2, 0, 2)).device == "cuda:0"
    assert place_rank(replace(auto, device="cuda:1"), FakeComm(2, 0, 2)).device == "cuda:1"
    assert place_rank(auto, FakeComm(1, 0, 1)) == auto  # one process: untouched


def test_place_rank_splits_cpu_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert place_rank(ModelConfig(), FakeComm(4, 1, 4)).num_threads == 2
    assert place_rank(ModelConfig(num_threads=3), FakeComm(4, 1, 4)).num_threads == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert place_rank(ModelConfig(), FakeComm(4, 1, 4)).num_threads == 3  # bound by launcher
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert place_rank(ModelConfig(), FakeComm(4, 1, 4)).num_threads is None


class ReplayComm(LocalComm):
    """Rank ``rank`` of ``world_size``: every gather returns, in call order, what the one-rank
    run gathered (all ranks' values) plus this rank's own; with ``record`` it is that run."""

    def __init__(self, rank: int = 0, world_size: int = 1, gathered: list | None = None) -> None:
        self.rank, self.world_size = rank, world_size
        self.record = gathered is None
        self.gathered: list[np.ndarray] = [] if gathered is None else list(gathered)

    def _gather(self, local: np.ndarray) -> np.ndarray:
        if self.record:
            self.gathered.append(local)
            return local
        return np.concatenate([self.gathered.pop(0), local])

    def allgather_fitness(self, local: np.ndarray) -> np.ndarray:
        return self._gather(np.asarray(local, dtype=np.float64))

    def allgather_keys(self, local: np.ndarray) -> np.ndarray:
        return self._gather(np.asarray(local, dtype=np.int64))


@pytest.mark.parametrize("reward", ["population_vote", "self_confidence"])
def test_scale_baseline_on_a_rank_without_factors(tiny_model_dir: Path, reward: str) -> None:
    """The scale baseline's 8 factors on 9 ranks: rank 8 has none; after a held-out call left
    one candidate's log-probs behind, its choice is still the one-rank run's."""
    from essa.backends.evaluator import PopulationEvaluator
    from essa.config import EvaluationConfig, GenerationConfig
    from essa.es.start import scale_baseline
    from essa.rewards import get_reward
    from essa.types import Example
    from tests.conftest import svd_setup

    model, tokenizer, adapter = svd_setup(tiny_model_dir)
    gen = GenerationConfig(max_new_tokens=4)
    evaluator = PopulationEvaluator(model, tokenizer, adapter, gen, EvaluationConfig())
    params = {"pool": "population"} if reward == "population_vote" else {}
    score = get_reward("majority_vote" if params else "self_confidence", **params)
    evaluator.record_logprobs = not params
    train = [Example(f"{a}+{b}=", str(a + b)) for a, b in ((1, 2), (3, 4), (12, 9))]
    prompts = [ex.prompt for ex in train]

    def run(comm: ReplayComm) -> dict[str, float] | None:
        evaluator.completions(np.zeros((1, adapter.dim)), prompts[:1], greedy=True)  # held-out
        return scale_baseline(
            evaluator, adapter, train, prompts, score, 0, lambda x: 0.5, comm=comm
        )

    one = ReplayComm()
    want = run(one)
    assert want is not None
    assert run(ReplayComm(8, 9, one.gathered)) == want


# ------------------------------------------------------------------------- real mpiexec runs


@pytest.mark.mpi
@needs_mpi
def test_allgather_uneven_shards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ESSA_TEST_OUT", str(tmp_path))
    res, _ = launch(2, str(TESTS / "mpi_helpers.py"), "allgather", timeout=FAULT_TIMEOUT)
    assert res.returncode == 0, res.stderr[-3000:]
    outs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [o["rank"] for o in outs] == [0, 1]
    assert [o["shard"] for o in outs] == [[0, 3], [3, 5]]
    for out in outs:
        assert out["world_size"] == 2 and out["local_size"] == 2
        assert out["fitness"] == [0.5, 1.5, 2.5, 3.5, None]
        assert out["names"] == ["rank-0", "rank-1"]
        assert "ranks [0] have aaa; ranks [1] have bbb" in out["mismatch"]
    assert sorted(o["local_rank"] for o in outs) == [0, 1]
    # Payload received from the other rank: its count (8 bytes) and its float64 fitness.
    assert [o["bytes_fitness"] for o in outs] == [8 + 2 * 8, 8 + 3 * 8]


@pytest.mark.mpi
@needs_mpi
def test_fault_on_one_rank_ends_every_rank() -> None:
    res, _ = launch(2, str(TESTS / "mpi_helpers.py"), "fault", timeout=FAULT_TIMEOUT)
    assert res.returncode == MPI_ABORT_EXIT, res.stderr[-3000:]
    output = res.stdout + res.stderr
    assert output.count("RuntimeError: injected fault on rank 1") == 1
    # Rank 0, blocked in a collective, ended too: the launch returned (no TimeoutExpired) with
    # the abort's code. MPICH's own "MPI_Abort(...)" line is not checked: hydra forwards rank
    # output asynchronously and may tear the job down before that line passes through.


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A single-process run (no mpiexec) of 3 generations."""
    run_dir = tmp_path_factory.mktemp("mpi") / "one-rank"
    train(0, "--run-dir", str(run_dir), sets=small(tiny_model_dir, "run.generations=3"))
    return run_dir


@pytest.mark.mpi
@needs_mpi
def test_two_ranks_match_one_rank(reference: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "two-ranks"
    res = train(2, "--run-dir", str(run_dir), sets=small(tiny_model_dir, "run.generations=3"))
    # Rank 0 alone prints the summary and messages; the others print nothing.
    assert res.stdout.count("summary:  ") == 1
    assert res.stdout.count("ESSA: D=") == 1
    assert trajectory(run_dir) == trajectory(reference)  # same fitness, sigma, held-out, ...
    records = generations(run_dir)[1:]
    # Rank 0 receives 2 fitness values (16 B), their rewards on the 4 prompts (64 B: the
    # signal's), a sha256 hex checksum (64 B) and 3 counts (24 B).
    assert all(r["world_size"] == 2 and r["comm_bytes"] == 168 for r in records), [
        r["comm_bytes"] for r in records
    ]
    assert_same_adapter(run_dir, reference)
    summary = json.loads((run_dir / "summary.json").read_text())
    ref_summary = json.loads((reference / "summary.json").read_text())
    assert summary["final_accuracy"] == ref_summary["final_accuracy"]
    leftovers = {p.name for p in run_dir.iterdir()} - {
        "config.yaml",
        "metrics.jsonl",
        "phases.jsonl",
        "samples.jsonl",
        "heldout_scores.jsonl",
        "checkpoint.json",
        "sft_adapter",
        "adapter",
        "summary.json",
    }
    assert not leftovers
    # rank 0 alone writes the samples, the same as one process's
    assert (run_dir / "samples.jsonl").read_text() == (reference / "samples.jsonl").read_text()


@pytest.mark.mpi
@needs_mpi
def test_resume_with_another_rank_count(
    reference: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Three ranks (shards of 2, 1, 1) for two generations, then one process for the third."""
    run_dir = tmp_path / "three-then-one"
    train(3, "--run-dir", str(run_dir), sets=small(tiny_model_dir, "run.generations=2"))
    train(0, "--resume", str(run_dir), sets=["run.generations=3"])
    assert trajectory(run_dir) == trajectory(reference)
    assert_same_adapter(run_dir, reference)


# Rewards that read more than the rank's own texts: the vote gathers every rank's answer keys,
# self_confidence reads the evaluator's log-probs of the call.
EMPTY_RANK_REWARDS = {
    "population_vote": ["reward.name=majority_vote", "reward.params={pool: population}"],
    "self_confidence": ["reward.name=self_confidence"],
}
# Relative tolerance of the fitness: the vote is exact; a log-prob differs in its last float32
# bits when a rank's batch holds another number of rows (its GEMMs sum in another order).
EMPTY_RANK_TOLERANCE = {"population_vote": 0.0, "self_confidence": 1e-6}


def assert_same_values(got: dict, want: dict, rel: float) -> None:
    """Equal keys; floats equal within ``rel``, everything else exactly."""
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, float):
            assert got[key] == pytest.approx(value, rel=rel, abs=0.0), key
        else:
            assert got[key] == value, key


@pytest.mark.mpi
@needs_mpi
@pytest.mark.parametrize("reward", sorted(EMPTY_RANK_REWARDS))
def test_more_ranks_than_candidates(tiny_model_dir: Path, tmp_path: Path, reward: str) -> None:
    """Population 2 on 3 ranks: rank 2 evaluates nothing but joins every exchange, and every
    fitness (the generation's, the scale baseline's) is the one-process run's."""
    sets = small(tiny_model_dir, "optimizer.population_size=2", "run.generations=1")
    sets += ["sft.steps=1", "data.test_size=5", *EMPTY_RANK_REWARDS[reward]]
    runs = {ranks: tmp_path / f"ranks-{ranks}" for ranks in (0, 3)}
    for ranks, run_dir in runs.items():
        train(ranks, "--run-dir", str(run_dir), sets=sets)
    (record,) = [r for r in generations(runs[3]) if r["generation"] == 0]
    assert record["world_size"] == 3 and record["mean_fitness"] is not None
    rel = EMPTY_RANK_TOLERANCE[reward]
    many, one = trajectory(runs[3]), trajectory(runs[0])
    assert len(many) == len(one)
    for got, want in zip(many, one, strict=True):
        assert_same_values(got, want, rel)
    scale = [json.loads((d / "summary.json").read_text())["scale_baseline"] for d in runs.values()]
    assert scale[0] is not None
    assert_same_values(scale[1], scale[0], rel)


@pytest.mark.mpi
@needs_mpi
def test_fault_in_training_command_ends_every_rank(tiny_model_dir: Path, tmp_path: Path) -> None:
    sets = small(tiny_model_dir, "reward.name=mpi_helpers:fail_on_rank", "reward.params={rank: 1}")
    args = ["-m", "essa.cli", "train", "--run-dir", str(tmp_path / "run")]
    overrides = [a for s in sets for a in ("--set", s)]
    res, _ = launch(2, *args, *overrides, timeout=FAULT_TIMEOUT)
    assert res.returncode == MPI_ABORT_EXIT, res.stderr[-3000:]
    output = res.stdout + res.stderr
    assert output.count("RuntimeError: injected fault on rank 1") == 1
    # (the launch returned with the abort's code: rank 0 was ended too; see test above)
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.mpi
@needs_mpi
def test_user_error_on_every_rank_printed_once(tmp_path: Path) -> None:
    args = ["-m", "essa.cli", "train", "--run-dir", str(tmp_path / "run")]
    overrides = ["--set", "model.name_or_path=/nonexistent/model"]
    res, _ = launch(2, *args, *overrides, timeout=FAULT_TIMEOUT)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.count("model.name_or_path: no such directory") == 1
    assert "Traceback" not in res.stderr


# ------------------------------------------------------------------- a signal to one rank

# The demo model, small: each generation takes a second or two on 2 busy cores.
DEMO = [
    *E2E_SMALL,
    "evaluation.strategy=batched",
    "evaluation.use_scale_baseline=false",
    "run.generations=6",
]
# Each rank's exit status, written by the shell that runs it: mpiexec ORs them into its own.
RANK_STATUS = '"$PYTHON" -m essa.cli "$@"; rc=$?; echo $rc > "$RC_DIR/rank$PMI_RANK"; exit $rc'


def rank_pid(launcher: int, rank: int) -> int | None:
    """The PID of MPI rank ``rank``'s ``python -m essa.cli`` among the launcher's descendants."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the process ended meanwhile
        children.setdefault(ppid, []).append(int(stat.parent.name))
    todo = [launcher]
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv[1:3] == [b"-m", b"essa.cli"] and f"PMI_RANK={rank}".encode() in env:
                return pid
    return None


def wait_until(proc: subprocess.Popen, ready: Callable[[], bool], what: str) -> None:
    """Poll until ``ready()``; fail if the launch ends first. The timeout bounds a hang only."""
    deadline = time.monotonic() + FAULT_TIMEOUT
    while not ready():
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} after {FAULT_TIMEOUT} s"
        time.sleep(0.02)  # a poll interval: nothing waits on time passing


@pytest.mark.mpi
@needs_mpi
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds ranks through /proc")
def test_sigint_to_one_rank_stops_every_rank_and_resumes_exactly(tmp_path: Path) -> None:
    """SIGINT to rank 1 alone: both ranks finish the same generation, rank 0 checkpoints it,
    both exit 130; the resumed run ends with the adapter of an uninterrupted one."""
    overrides = [a for item in DEMO for a in ("--set", item)]
    ref = tmp_path / "ref"
    res, _ = launch(2, "-m", "essa.cli", "train", "--run-dir", str(ref), *overrides)
    assert res.returncode == 0, res.stderr[-3000:]

    run_dir, status = tmp_path / "run", tmp_path / "status"
    status.mkdir()
    out = (tmp_path / "stdout").open("w+")
    cmd = [find_mpiexec() or "mpiexec", "-n", "2", "sh", "-c", RANK_STATUS, "sh"]
    proc = subprocess.Popen(
        [*cmd, "train", "--run-dir", str(run_dir), *overrides],
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**rank_env(), "RC_DIR": str(status), "PYTHON": sys.executable},
        start_new_session=True,  # the whole job can be ended if it hangs
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        wait_until(
            proc,
            lambda: metrics.exists() and '"generation": 0,' in metrics.read_text(),
            "generation 0 in metrics.jsonl",
        )
        pid = rank_pid(proc.pid, 1)
        assert pid is not None, "rank 1's process not found"
        os.kill(pid, signal.SIGINT)
        proc.wait(timeout=FAULT_TIMEOUT)  # before the fix rank 0 blocked in the next exchange
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out.seek(0)
    output = out.read()
    assert proc.returncode == 130, output[-3000:]
    assert {p.name: p.read_text().strip() for p in status.iterdir()} == {
        "rank0": "130",
        "rank1": "130",
    }
    assert output.count(f"continue with: essa train --resume {run_dir}") == 1  # rank 0's line
    done = json.loads((run_dir / "checkpoint.json").read_text())["optimizer"]["generation"]
    assert 1 <= done < 6 and not (run_dir / "summary.json").exists()
    assert [r["generation"] for r in generations(run_dir)] == list(range(-1, done))

    res, _ = launch(2, "-m", "essa.cli", "train", "--resume", str(run_dir))
    assert res.returncode == 0, res.stderr[-3000:]
    assert [r["generation"] for r in generations(run_dir)] == list(range(-1, 6))
    assert_same_adapter(run_dir, ref)
    assert trajectory(run_dir) == trajectory(ref)


@pytest.mark.mpi
@needs_mpi
def test_two_ranks_price_drift_as_one_rank(tiny_model_dir: Path, tmp_path: Path) -> None:
    """optimizer.drift_budget under MPI: each rank computes its own candidates' anchor-set KL
    and gathers the rest, so the shaped fitness is the single process's."""
    priced = ["run.generations=2", "optimizer.drift_budget.kl_penalty=2",
              "optimizer.drift_budget.anchor=0.5"]  # fmt: skip
    runs = {}
    for ranks in (0, 2):
        runs[ranks] = tmp_path / f"ranks{ranks}"
        train(ranks, "--run-dir", str(runs[ranks]), sets=small(tiny_model_dir, *priced))
    one, two = trajectory(runs[0])[1:], trajectory(runs[2])[1:]
    assert [r["anchor_kl_mean"] for r in one] == pytest.approx(
        [r["anchor_kl_mean"] for r in two], rel=1e-6
    )
    assert all(r["anchor_kl_mean"] > 0 for r in one)
    assert [r["sigma"] for r in one] == [r["sigma"] for r in two]
    a, b = adapter(runs[0]), adapter(runs[2])  # the same ranking told: the same mean
    assert all(np.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a)


@pytest.mark.mpi
@needs_mpi
def test_two_ranks_decay_the_mean_as_one_rank(tiny_model_dir: Path, tmp_path: Path) -> None:
    """optimizer.drift_budget.decay under MPI: every rank tells the same fitness and moves the
    mean by the same offset, so two ranks hold (checked every generation) and export what one
    process does."""
    decayed = ["run.generations=3", "optimizer.drift_budget.decay=0.2"]
    runs = {}
    for ranks in (0, 2):
        runs[ranks] = tmp_path / f"ranks{ranks}"
        train(ranks, "--run-dir", str(runs[ranks]), sets=small(tiny_model_dir, *decayed))
    assert trajectory(runs[2]) == trajectory(runs[0])
    assert all(r["decay_step_norm"] > 0 for r in trajectory(runs[0])[1:])
    assert_same_adapter(runs[2], runs[0])
    states = [json.loads((runs[r] / "checkpoint.json").read_text())["optimizer"] for r in runs]
    assert states[0]["optimizer"] == "mean_decay" and states[0] == states[1]
