"""The tests' ``essa`` command: a fork of a process that has already imported the heavy modules.

A fresh ``python -m essa.cli`` spends about 7 s importing torch, transformers and peft before a
demo run that takes 2-4 s, and the suite starts over a hundred of them. Here one server process
per test process (multiprocessing's forkserver) imports them once; each command is a forked
child of it that runs ``essa.cli.main`` as ``python -m essa.cli`` would:

* its own process: its own pid, exit code (``-N`` when signal N killed it), signal handlers
  (Python's defaults, as in a fresh interpreter), environment (the ``env`` given, exactly),
  working directory, and stdout/stderr (files, read back when it ends);
* ``sys.path`` as ``python -m`` builds it: the working directory first, then ``$PYTHONPATH``;
* ``ESSA_FAULT`` installs the checkpoint fault as tests/faults/sitecustomize.py would at start-up;
* torch's intra-op threads from ``$OMP_NUM_THREADS``, as a fresh torch would read it;
* atexit handlers run at the end.

What it does not reproduce: a fresh interpreter's hash seed and import-time side effects run
per process. Tests that need a real interpreter (MPI ranks, the pinned demo bytes, the vLLM
worker, ``--help`` output of the installed script) still start one.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
from multiprocessing.context import ForkServerContext
from pathlib import Path

# Imported once in the server, so that no command pays for them.
PRELOAD = [
    "torch",
    "transformers",
    "peft",
    "safetensors.torch",
    "math_verify",
    "essa.cli",
    "essa.setup",
    "essa.recipes.essa_es",
    "essa.recipes.grpo",
    "essa.recipes.dpo",
    "essa.recipes.scalebio",
    "essa.backends.models",
    "essa.backends.generate",
    "essa.drift.report",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.llama.modeling_llama",
]
FAULTS = Path(__file__).resolve().parent / "faults"
_CONTEXT: ForkServerContext | None = None


def _context() -> ForkServerContext:
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(PRELOAD)
    return _CONTEXT


def _run_cli(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """The child: become ``python -m essa.cli ARGV`` with ``env`` in ``cwd``, output to files."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    for sig in (signal.SIGINT, signal.SIGTERM):  # a fresh interpreter's handlers
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    path_env = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [cwd, *path_env]
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
    if env.get("ESSA_FAULT"):
        from importlib.util import module_from_spec, spec_from_file_location

        spec = spec_from_file_location("essa_test_faults", FAULTS / "sitecustomize.py")
        assert spec is not None and spec.loader is not None
        spec.loader.exec_module(module_from_spec(spec))  # installs the checkpoint fault
    sys.argv = ["essa", *argv]
    try:
        from essa.cli import main

        main()
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()


class CliProcess:
    """A running ``essa`` command, with the parts of ``subprocess.Popen`` the tests use."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str | None = None) -> None:
        self.args = ["essa", *argv]
        self._dir = tempfile.TemporaryDirectory(prefix="essa-cli-")
        self._out = os.path.join(self._dir.name, "stdout")
        self._err = os.path.join(self._dir.name, "stderr")
        self._process = _context().Process(
            target=_run_cli, args=(argv, env, cwd or os.getcwd(), self._out, self._err)
        )
        self._process.start()
        self.pid: int = self._process.pid  # type: ignore[assignment]

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def output(self) -> tuple[str, str]:
        """(stdout, stderr) as written so far."""
        return (
            Path(self._out).read_text(errors="replace"),
            Path(self._err).read_text(errors="replace"),
        )

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for the end (TimeoutExpired after ``timeout`` s) and return (stdout, stderr)."""
        self.wait(timeout)
        return self.output()

    def finish(self, timeout: float | None = None) -> subprocess.CompletedProcess[str]:
        """Wait (killing it after ``timeout`` s, as subprocess.run does) and collect its output."""
        try:
            code = self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self._process.join()
            raise
        out, err = self.output()
        self._dir.cleanup()
        return subprocess.CompletedProcess(self.args, code, out, err)


def run(
    argv: list[str], env: dict[str, str], timeout: float = 600, cwd: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([python, -m, essa.cli, *argv], capture_output=True, text=True, ...)``."""
    return CliProcess(argv, env, cwd).finish(timeout)


def essa(
    *args: str, env: dict[str, str] | None = None, timeout: float = 600, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m essa.cli ARGS`` with one thread and ``env`` on top of this environment."""
    full = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return run(list(args), full, timeout, None if cwd is None else str(cwd))


def start(*args: str, env: dict[str, str] | None = None) -> CliProcess:
    """``essa ARGS`` started in the background (as ``subprocess.Popen``), environment as essa()."""
    return CliProcess(list(args), {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
