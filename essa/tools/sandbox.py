"""Run Python from a completion in a sandbox: its own process tree, limited and isolated.

Each snippet runs in a fresh interpreter (this process's own, so the same standard library and
site-packages, read-only) under these limits (``tools.python`` in the config, docs/tools.md):

* wall clock (``timeout_seconds``, enforced here: the whole process tree is killed) and CPU
  time (RLIMIT_CPU, the same number rounded up);
* address space per process (RLIMIT_AS), processes and threads (RLIMIT_NPROC), file size
  (RLIMIT_FSIZE), no core dumps;
* stdout and stderr each cut at ``max_output_chars``; a snippet that keeps writing is stopped.

Isolation is bubblewrap (``bwrap``): new PID, network, IPC and UTS namespaces (no network
beyond an empty loopback; the snippet sees only its own processes), a root filesystem that holds
only /usr, the Python installation's own tree and a venv's folder (read-only,
:func:`python_layout`), a minimal /dev, /proc and a private, size-limited /tmp: the only writable
place. Run as root, bwrap needs no user namespace and the snippet drops to a uid of its own, so
RLIMIT_NPROC counts only its processes (root is exempt from it) and it cannot signal anything
outside; run as a user, bwrap makes a user namespace.

Without bwrap, ``allow_unisolated: true`` runs the snippet without isolation but in a PID
namespace of its own (``unshare``; for a user, in a user namespace too, so that the process
limit counts the snippet's processes only): the same limits, and the kill at the deadline
reaches every process it started. It keeps the caller's uid (root is exempt from the process
limit), reads what that uid can read and reaches the network. Otherwise a missing bwrap raises
:class:`SandboxUnavailable`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import pwd
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

from essa.config import PythonToolConfig
from essa.errors import UserError

Isolation = Literal["bwrap", "rlimits"]

# Each snippet's own uid when this process is root: far above any real account's.
_SANDBOX_UIDS = (200_000, 1_000_000)
_CHUNK = 65536

# Runs first inside the sandbox (trusted): reads the snippet from stdin into main.py, sets the
# limits, drops root (uid 0: keeps its uid), then runs a fresh interpreter on main.py, so that
# the snippet's tracebacks show only its own frames, and waits for it: the snippet's parent is
# this launcher, never the caller. argv: cpu_seconds memory_bytes processes file_bytes uid.
_LAUNCHER = """\
import os, resource, sys
if os.getpid() == 1:  # init of the fallback's PID namespace: init ignores signals from inside,
    child = os.fork()  # so the launcher runs as its child; init reaps orphans, relays the status
    while child:
        pid, status = os.wait()
        if pid == child:
            status = os.waitstatus_to_exitcode(status)
            os._exit(128 - status if status < 0 else status)
cpu, memory, processes, file_bytes, uid = map(int, sys.argv[1:6])
with open("main.py", "wb") as f:
    f.write(sys.stdin.buffer.read())
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
for limit, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, memory),
                     (resource.RLIMIT_NPROC, processes), (resource.RLIMIT_FSIZE, file_bytes),
                     (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value + 1 if limit == resource.RLIMIT_CPU else value))
if uid:
    os.chown(".", uid, uid)
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
pid = os.fork()
if pid == 0:
    os.execv(sys.executable, [sys.executable, "-I", "main.py"])
status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
os._exit(128 - status if status < 0 else status)
"""

# One thread for numeric libraries: threads count against RLIMIT_NPROC and each maps a stack.
_THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class SandboxUnavailable(UserError):
    """No isolation tool, and running without one was not allowed (one line)."""


@dataclass(frozen=True)
class ToolResult:
    """What a snippet did. ``error`` is None exactly when it exited 0 within every limit."""

    stdout: str
    stderr: str
    exit_status: int  # the exit code; 128 + n when signal n ended it (the shell's convention)
    timed_out: bool  # the wall clock ran out and the process tree was killed
    # stdout or stderr was cut at max_output_chars; a snippet that goes on writing is stopped
    truncated: bool
    error: str | None  # one line for the caller (and the model): why this is a tool error


def select_isolation(limits: PythonToolConfig) -> Isolation:
    """bwrap when installed; the plain-subprocess fallback only when the config allows it."""
    if shutil.which("bwrap"):
        return "bwrap"
    if limits.allow_unisolated:
        return "rlimits"
    raise SandboxUnavailable(
        "tools.python: bubblewrap (bwrap) is not installed: install it (apt-get install "
        "bubblewrap) or set tools.python.allow_unisolated: true to run code without isolation"
    )


def check_sandbox(limits: PythonToolConfig, isolation: Isolation | None = None) -> Isolation:
    """Run ``print(2 + 3)`` once; raise :class:`SandboxUnavailable` unless it prints 5.

    For start-up: an installed bwrap that cannot make its namespaces here (a kernel or AppArmor
    that forbids them) fails every snippet; this says so once, with bwrap's own reason.
    """
    isolation = isolation or select_isolation(limits)
    result = run_python("print(2 + 3)", limits, isolation)
    if result.stdout != "5\n":
        reason = _last_line(result.stderr) or result.error or "no output"
        raise SandboxUnavailable(f"tools.python: the {isolation} sandbox does not work: {reason}")
    return isolation


def run_python(
    code: str, limits: PythonToolConfig, isolation: Isolation | None = None
) -> ToolResult:
    """Run ``code`` in a sandbox (``isolation``: None picks one with :func:`select_isolation`).

    >>> from essa.config import PythonToolConfig
    >>> run_python("print(2 + 3)", PythonToolConfig(allow_unisolated=True)).stdout
    '5\\n'
    """
    isolation = isolation or select_isolation(limits)
    if isolation == "rlimits" and not limits.allow_unisolated:
        raise SandboxUnavailable("tools.python: running without isolation needs allow_unisolated")
    uid = 0  # keep this process's uid
    if isolation == "bwrap" and os.geteuid() == 0:
        uid = _SANDBOX_UIDS[0] + secrets.randbelow(_SANDBOX_UIDS[1] - _SANDBOX_UIDS[0])
    launcher = [
        "-I",
        "-c",
        _LAUNCHER,
        str(math.ceil(limits.timeout_seconds)),
        str(limits.memory_mb << 20),
        str(limits.max_processes),
        str(limits.max_file_mb << 20),
        str(uid),
    ]
    if isolation == "bwrap":
        layout = python_layout(Interpreter.current())
        command = [*_bwrap_prefix(limits, layout), layout.executable, *launcher]
        return _run(command, None, {}, code, limits)
    with tempfile.TemporaryDirectory(prefix="essa-tool-", ignore_cleanup_errors=True) as tmp:
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, **_THREAD_ENV}
        return _run([*_unshare_prefix(), sys.executable, *launcher], tmp, env, code, limits)


def run_python_batch(
    codes: Sequence[str], limits: PythonToolConfig, isolation: Isolation | None = None
) -> list[ToolResult]:
    """Run many snippets (e.g. one per row of a generation), ``limits.max_concurrent`` at a
    time, each in its own sandbox; results in input order."""
    isolation = isolation or select_isolation(limits)
    with ThreadPoolExecutor(max_workers=limits.max_concurrent) as pool:
        return list(pool.map(lambda code: run_python(code, limits, isolation), codes))


# ---------------------------------------------------------------------------------------------
# bubblewrap


def _bwrap_prefix(limits: PythonToolConfig, layout: PythonLayout) -> list[str]:
    """The bwrap command line up to the program: namespaces, environment, filesystem."""
    bwrap = shutil.which("bwrap") or "bwrap"
    command = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"]
    if os.geteuid() != 0:  # root needs no user namespace (and dropping to a uid needs none)
        command.append("--unshare-user")
    command += ["--unshare-cgroup-try", "--die-with-parent", "--new-session", "--clearenv"]
    inner_env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
    for name, value in {**inner_env, **_THREAD_ENV, **layout.env}.items():
        command += ["--setenv", name, value]
    command += _system_mounts()
    command += ["--dev", "/dev", "--proc", "/proc", "--perms", "1777"]
    if _bwrap_has_size(bwrap):
        command += ["--size", str(limits.max_file_mb << 20)]
    command += ["--tmpfs", "/tmp"]
    command += layout.mounts
    # The root and /dev are bwrap's own tmpfs: read-only, so /tmp stays the one writable place.
    command += ["--chdir", "/tmp", "--remount-ro", "/dev", "--remount-ro", "/"]
    return command


def _system_mounts() -> list[str]:
    """/usr read-only, and the top-level library and binary directories (links on merged-usr)."""
    mounts = ["--ro-bind", "/usr", "/usr"]
    for path in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(path):
            mounts += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            mounts += ["--ro-bind", path, path]
    return mounts


@dataclass(frozen=True)
class Interpreter:
    """A Python as it reports itself: ``sys.executable`` (the path it was called by, links
    unresolved), ``sys.prefix`` (a venv's own folder) and ``sys.base_prefix`` (its
    installation)."""

    executable: str
    prefix: str
    base_prefix: str

    @classmethod
    def current(cls) -> Interpreter:
        return cls(sys.executable, sys.prefix, sys.base_prefix)

    @property
    def is_venv(self) -> bool:
        return os.path.realpath(self.prefix) != os.path.realpath(self.base_prefix)


@dataclass(frozen=True)
class PythonLayout:
    """How an interpreter appears in the sandbox: its bwrap mounts, its path there, and the
    environment it needs there."""

    mounts: list[str]
    executable: str
    env: dict[str, str]


# A venv is bound here (it holds only links and its site-packages, so it runs from any path):
# a venv inside a checkout shows nothing of the checkout's path, one under /tmp stays out of
# the snippet's /tmp. An installation under /tmp moves too; its libpython is found through
# LD_LIBRARY_PATH (builds such as pyenv's name their lib folder by its absolute path).
VENV_PATH = "/run/python/venv"
BASE_PATH = "/run/python/base"


def python_layout(
    interpreter: Interpreter, home: Sequence[str] | None = None, cwd: str | None = None
) -> PythonLayout:
    """The mounts that give the sandbox ``interpreter`` and nothing else: its installation's
    tree read-only (nothing when under /usr, which the sandbox has anyway) and a venv's own
    folder. Raises :class:`SandboxUnavailable` where that tree would bring the root, a home
    directory (``home``: $HOME and the user's passwd entry) or the working directory with it.
    """
    home = _home_dirs() if home is None else home
    cwd = os.getcwd() if cwd is None else cwd
    real_base, inside, mounts = _installation(interpreter, home, cwd)
    env = {"LD_LIBRARY_PATH": f"{BASE_PATH}/lib"} if inside == BASE_PATH else {}
    if interpreter.is_venv:
        venv = os.path.realpath(interpreter.prefix)
        _refuse_exposing(venv, home, cwd)
        name = os.path.basename(interpreter.executable)
        if not os.path.exists(os.path.join(venv, "bin", name)):
            name = "python"
        return PythonLayout([*mounts, *_bind(venv, VENV_PATH)], f"{VENV_PATH}/bin/{name}", env)
    executable = os.path.realpath(interpreter.executable)  # ~/bin/python: where it links to
    if _within(executable, real_base):
        return PythonLayout(mounts, inside + executable[len(real_base) :], env)
    if _within(executable, "/usr"):
        return PythonLayout(mounts, executable, env)
    raise SandboxUnavailable(
        f"tools.python: the interpreter {executable} lies outside its installation "
        f"{real_base}: run the sandbox from an installed Python"
    )


def _installation(
    interpreter: Interpreter, home: Sequence[str], cwd: str
) -> tuple[str, str, list[str]]:
    """(the installation's real path, its path in the sandbox, the mounts that put it there)."""
    base = os.path.abspath(interpreter.base_prefix)
    real_base = os.path.realpath(base)
    if _within(base, "/usr"):  # in the sandbox anyway
        return real_base, base, []
    for tree in {base, real_base}:
        _refuse_exposing(tree, home, cwd)
    if not (_within(base, "/tmp") or _within(real_base, "/tmp")):
        return real_base, base, _bind(real_base, base)
    if interpreter.is_venv:  # its links and pyvenv.cfg name the installation's own path
        raise SandboxUnavailable(
            f"tools.python: the venv's base Python {real_base} lies under /tmp, which the "
            "sandbox replaces with its own: make the venv from a Python installed elsewhere"
        )
    return real_base, BASE_PATH, _bind(real_base, BASE_PATH)


def _refuse_exposing(tree: str, home: Sequence[str], cwd: str) -> None:
    """A Python tree may not be the root, nor hold a home directory or the working directory."""
    held = [path for path in (*home, cwd) if _within(os.path.realpath(path), tree)]
    if tree == "/" or held:
        shown = "the whole filesystem" if tree == "/" else held[0]
        raise SandboxUnavailable(
            f"tools.python: binding the Python installation {tree} would show {shown} to the "
            "snippet: run a Python installed in a folder of its own"
        )


def _home_dirs() -> list[str]:
    homes = [os.path.expanduser("~")]
    with contextlib.suppress(KeyError):
        homes.append(pwd.getpwuid(os.getuid()).pw_dir)
    return [h for h in homes if h and h != "/"]


def _bind(source: str, target: str) -> list[str]:
    """``source`` read-only at ``target``, whose missing parents are made 0755 (bwrap makes
    them 0700, which the snippet's uid could not cross)."""
    mounts: list[str] = []
    for parent in _parents(target):
        mounts += ["--perms", "0755", "--dir", parent]
    return [*mounts, "--ro-bind", source, target]


def _parents(path: str) -> list[str]:
    """``/a/b/c`` -> ``["/a", "/a/b"]``."""
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


@functools.cache
def _bwrap_has_size(bwrap: str) -> bool:
    """bwrap 0.7 added ``--size`` (a tmpfs size); older ones bound /tmp by RLIMIT_FSIZE only."""
    help_text = subprocess.run([bwrap, "--help"], capture_output=True, text=True).stdout
    return "--size" in help_text


# ---------------------------------------------------------------------------------------------
# Without bubblewrap


def _unshare_prefix() -> list[str]:
    """The fallback's namespaces, or :class:`SandboxUnavailable` where the kernel lacks them.

    A PID namespace: when its init (the launcher's parent) dies, the kernel kills everything in
    it, including processes that left the process group (setsid). For a user, also a user
    namespace (which a PID namespace needs without root): RLIMIT_NPROC then counts only the
    snippet's processes (per user namespace since Linux 5.14), not the caller's threads. Root
    keeps its uid, which the kernel exempts from the limit in any namespace.
    """
    unshare = shutil.which(
        "unshare", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/bin"])
    )
    if unshare is None:
        raise SandboxUnavailable(
            "tools.python: running without bwrap needs unshare (util-linux) to count and kill "
            "a snippet's processes: install util-linux or bubblewrap"
        )
    if os.geteuid() == 0:
        return [unshare, "--pid", "--fork", "--kill-child"]
    release = tuple(int(n) for n in re.findall(r"\d+", os.uname().release)[:2])
    if release < (5, 14):
        raise SandboxUnavailable(
            f"tools.python: running without bwrap as a user needs Linux 5.14 or newer (this "
            f"is {os.uname().release}) to count a snippet's processes: install bubblewrap"
        )
    return [unshare, "--user", "--pid", "--fork", "--kill-child"]


# ---------------------------------------------------------------------------------------------
# Running and reporting


def _run(
    command: list[str], cwd: str | None, env: dict[str, str], code: str, limits: PythonToolConfig
) -> ToolResult:
    process = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cwd,
        env=env,
        start_new_session=True,  # one process group to kill
        umask=0o022,  # the launcher writes main.py before it drops to the snippet's uid
    )
    return _finish(process, code.encode(), limits)


def _finish(process: subprocess.Popen, code: bytes, limits: PythonToolConfig) -> ToolResult:
    deadline = time.monotonic() + limits.timeout_seconds
    byte_cap = 4 * limits.max_output_chars + 4  # UTF-8: at most 4 bytes a character
    out, err, stopped = _exchange(process, code, deadline, byte_cap)
    timed_out = stopped == "timeout"
    if stopped is None:
        timed_out = not _exited_by(process, deadline)
    # Kill the group before reaping the leader, so that its id cannot have been reused.
    _kill_group(process)
    status = process.wait()
    for pipe in (process.stdout, process.stderr):
        assert pipe is not None
        pipe.close()
    stdout, cut_out = _decode(out, limits.max_output_chars)
    stderr, cut_err = _decode(err, limits.max_output_chars)
    exit_status = 128 - status if status < 0 else status
    truncated = stopped == "output" or cut_out or cut_err
    error = _describe(exit_status, timed_out, truncated, stderr, limits)
    return ToolResult(stdout, stderr, exit_status, timed_out, truncated, error)


def _exchange(
    process: subprocess.Popen, code: bytes, deadline: float, byte_cap: int
) -> tuple[bytearray, bytearray, Literal["timeout", "output"] | None]:
    """Write the code, read both streams until they close, the deadline, or too much output."""
    assert process.stdin is not None and process.stdout is not None
    assert process.stderr is not None
    buffers = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray()}
    stdin = process.stdin.fileno()
    os.set_blocking(stdin, False)
    pending = memoryview(code)
    with selectors.DefaultSelector() as selector:
        selector.register(stdin, selectors.EVENT_WRITE)
        for fd in buffers:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                process.stdin.close()
                return buffers[process.stdout.fileno()], buffers[process.stderr.fileno()], "timeout"
            for key, _ in selector.select(remaining):
                fd = int(key.fd)
                if fd == stdin:
                    pending = _write_some(stdin, pending)
                    if not pending:
                        selector.unregister(stdin)
                        process.stdin.close()
                    continue
                chunk = os.read(fd, _CHUNK)
                if not chunk:
                    selector.unregister(fd)
                buffers[fd] += chunk
                if len(buffers[fd]) > byte_cap:
                    process.stdin.close()
                    out, err = buffers[process.stdout.fileno()], buffers[process.stderr.fileno()]
                    return out, err, "output"
    return buffers[process.stdout.fileno()], buffers[process.stderr.fileno()], None


def _write_some(fd: int, pending: memoryview) -> memoryview:
    try:
        return pending[os.write(fd, pending[:_CHUNK]) :]
    except BlockingIOError:
        return pending
    except BrokenPipeError:  # the launcher died before reading it all: its stderr says why
        return pending[:0]


def _exited_by(process: subprocess.Popen, deadline: float) -> bool:
    """Wait, without reaping, until the process exits or the deadline passes.

    Both streams closed usually means it exited; a snippet may also close them and go on.
    """
    while True:
        if os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)  # polls like Popen.wait(timeout) does; only a snippet that closed its
        # own output streams and kept running gets here more than once


def _kill_group(process: subprocess.Popen) -> None:
    # ProcessLookupError: nothing left in the group but the zombie leader.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def _decode(raw: bytes | bytearray, max_chars: int) -> tuple[str, bool]:
    text = bytes(raw).decode("utf-8", errors="replace")
    return (text[:max_chars], True) if len(text) > max_chars else (text, False)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def _describe(
    exit_status: int, timed_out: bool, truncated: bool, stderr: str, limits: PythonToolConfig
) -> str | None:
    """The one-line reason a snippet is a tool error, or None."""
    if timed_out:
        return f"timed out after {limits.timeout_seconds:g} s"
    if truncated:
        return f"output cut at {limits.max_output_chars} characters"
    if exit_status == 128 + signal.SIGXCPU:
        return f"CPU time limit ({math.ceil(limits.timeout_seconds)} s) reached"
    if exit_status > 128 and exit_status - 128 in signal.valid_signals():
        return f"killed by {signal.Signals(exit_status - 128).name}"
    if exit_status != 0:
        return f"exit status {exit_status}: {_last_line(stderr) or 'no message'}"
    return None
