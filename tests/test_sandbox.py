"""The Python tool's sandbox (essa.tools.sandbox) against hostile snippets, with real processes.

Every hostile snippet must come back as a tool error (``ToolResult.error`` set) while this
process, its files and its other children are untouched, and the next snippet must run. The
bwrap tests are the ``sandbox`` component: required in CI, where .ci/run installs bubblewrap.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from essa.config import ConfigError, PythonToolConfig, load_config
from essa.tools.sandbox import (
    BASE_PATH,
    Interpreter,
    SandboxUnavailable,
    ToolResult,
    check_sandbox,
    python_layout,
    run_python,
    run_python_batch,
    select_isolation,
)
from tests.conftest import requires

# Small limits keep each hostile test to a couple of seconds.
LIMITS = PythonToolConfig(
    timeout_seconds=2.0, memory_mb=256, max_processes=8, max_file_mb=4, max_output_chars=1000
)
UNISOLATED = PythonToolConfig(
    timeout_seconds=2.0, memory_mb=256, max_output_chars=1000, allow_unisolated=True
)
needs_bwrap = requires("sandbox", None if shutil.which("bwrap") else "bwrap is not installed")


def run(code: str, limits: PythonToolConfig = LIMITS) -> ToolResult:
    return run_python(textwrap.dedent(code), limits, "bwrap")


def assert_still_works(limits: PythonToolConfig = LIMITS) -> None:
    result = run_python("print(2 + 3)", limits)
    assert (result.stdout, result.error) == ("5\n", None)


def sandbox_uid_processes() -> list[str]:
    """Processes (pid: name) whose uid is in the sandbox's own range."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines())
        except (OSError, ValueError):
            continue  # exited while we read it
        if 200_000 <= int(fields["Uid"].split()[0]) < 1_000_000:
            found.append(f"{status.parent.name}: {fields['Name'].strip()}")
    return found


def assert_no_sandbox_process_survives() -> None:
    """As root each snippet runs under its own uid: none may outlive the run. The PID namespace
    is torn down asynchronously after bwrap dies, so wait (bounded) for it to finish."""
    if os.geteuid() != 0:
        return
    deadline = time.monotonic() + 30
    while (left := sandbox_uid_processes()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, left


# ------------------------------------------------------------------------------ normal code


@needs_bwrap
def test_prints_the_result() -> None:
    result = run("print(2 + 3)")
    assert result == ToolResult("5\n", "", 0, False, False, None)
    assert check_sandbox(LIMITS) == "bwrap"


@needs_bwrap
def test_an_exception_is_a_tool_error_with_its_last_line() -> None:
    result = run("1 / 0")
    assert result.exit_status == 1
    assert result.error == "exit status 1: ZeroDivisionError: division by zero"
    assert 'File "/tmp/main.py", line 1' in result.stderr  # only the snippet's own frame
    assert "launcher" not in result.stderr and "<string>" not in result.stderr


@needs_bwrap
def test_code_larger_than_a_pipe_buffer_goes_in_whole() -> None:
    padding = "#" * 100 + "\n"
    result = run(padding * 5000 + "print('end')")  # about 500 kB
    assert (result.stdout, result.error) == ("end\n", None)


@needs_bwrap
def test_the_private_tmp_is_writable_and_the_standard_library_loads() -> None:
    result = run("""
        import fractions, os
        with open("/tmp/notes.txt", "w") as f:
            f.write("x" * 1000)
        print(os.getcwd(), sorted(os.listdir("/tmp")), fractions.Fraction(6, 4))
    """)
    assert result.stdout == "/tmp ['main.py', 'notes.txt'] 3/2\n", result.stderr


# ---------------------------------------------------------------------------- hostile code


@needs_bwrap
def test_infinite_loop_is_killed_at_the_wall_clock() -> None:
    result = run("while True:\n    pass")
    assert result.timed_out and result.error == "timed out after 2 s"
    assert_still_works()


@needs_bwrap
def test_fork_bomb_is_capped_by_the_process_limit() -> None:
    # Children that stay alive, so each fork holds a slot: at most max_processes at once.
    result = run("""
        import os, time
        forked = 0
        for _ in range(100):
            try:
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
                forked += 1
            except OSError:
                pass
        print(forked)
    """)
    assert result.error is None, result.stderr
    assert 1 <= int(result.stdout) < LIMITS.max_processes
    assert_no_sandbox_process_survives()  # the sleeping children die with the sandbox


@needs_bwrap
def test_endless_fork_bomb_is_contained_and_cleaned_up() -> None:
    result = run("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """)
    assert result.timed_out and result.error is not None
    assert_no_sandbox_process_survives()
    assert_still_works()


@needs_bwrap
def test_ten_gigabyte_allocation_fails_inside() -> None:
    result = run("block = bytearray(10 * 1024**3)\nprint('allocated')")
    assert result.stdout == ""
    assert result.error == "exit status 1: MemoryError"
    assert_still_works()


@needs_bwrap
def test_no_network_even_to_this_machine() -> None:
    # A listener on the host's loopback: reachable from any process that shares its network.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        result = run(f"""
            import socket
            socket.create_connection(("127.0.0.1", {port}), timeout=1)
            print("connected")
        """)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever connected
    assert result.stdout == ""
    assert result.error is not None and "ConnectionRefusedError" in result.error


@needs_bwrap
def test_files_outside_the_sandbox_cannot_be_read(tmp_path: Path) -> None:
    secret = f"secret-{secrets.token_hex(8)}"
    (tmp_path / "secret.txt").write_text(secret)
    result = run(f"""
        import json
        seen = {{}}
        for path in [{str(tmp_path / "secret.txt")!r}, {__file__!r}, "/etc/passwd",
                     "/proc/1/environ"]:
            try:
                with open(path) as f:
                    seen[path] = f.read()
            except OSError as err:
                seen[path] = type(err).__name__
        print(json.dumps(seen))
    """)
    seen = json.loads(result.stdout)
    assert secret not in result.stdout + result.stderr
    assert seen[str(tmp_path / "secret.txt")] == "FileNotFoundError"
    assert seen[__file__] == "FileNotFoundError"  # the repository is not in the sandbox
    assert seen["/etc/passwd"] == "FileNotFoundError"
    assert seen["/proc/1/environ"] == "PermissionError"  # the sandbox's own init, not the host's


@needs_bwrap
def test_nothing_outside_the_private_tmp_is_writable(tmp_path: Path) -> None:
    targets = [str(tmp_path / "escaped.txt"), os.path.join(sys.prefix, "escaped.txt"), "/x"]
    targets += ["/dev/x", "/dev/shm/x", "/usr/x"]
    result = run(f"""
        written = []
        for path in {targets!r}:
            try:
                with open(path, "w") as f:
                    f.write("x")
                written.append(path)
            except OSError:
                pass
        print(written)
    """)
    assert result.stdout == "[]\n", result.stderr
    assert not any(os.path.exists(path) for path in targets[:2])


@needs_bwrap
def test_a_file_past_the_size_limit_fails() -> None:
    result = run("open('/tmp/big', 'wb').write(b'x' * (5 << 20))")  # max_file_mb is 4
    assert result.error is not None and result.exit_status != 0


@needs_bwrap
def test_huge_output_is_truncated_and_stopped() -> None:
    result = run("import sys\nwhile True:\n    sys.stdout.write('x' * 4096)")
    assert result.truncated and not result.timed_out
    assert result.stdout == "x" * LIMITS.max_output_chars
    assert result.error == "output cut at 1000 characters"
    assert_still_works()


@needs_bwrap
def test_killing_the_parent_or_everything_leaves_the_caller_alone() -> None:
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for code in (
            "import os; os.kill(os.getppid(), 9)",
            "import os; os.kill(-1, 9); print('survived')",
            f"import os; os.kill({os.getpid()}, 9); os.kill({bystander.pid}, 9)",
        ):
            result = run(code)
            assert result.error is not None, code  # each one failed inside the sandbox
        assert bystander.poll() is None  # this test process is evidently alive too
    finally:
        bystander.kill()
        bystander.wait()
    assert_still_works()


@needs_bwrap
def test_batch_runs_rows_in_separate_sandboxes() -> None:
    rows = [
        "import os\nopen('/tmp/row', 'w').write('0')\nprint(sorted(os.listdir('/tmp')))",
        "while True:\n    pass",
        "import os\nopen('/tmp/row', 'w').write('2')\nprint(sorted(os.listdir('/tmp')))",
        "bytearray(10 * 1024**3)",
        "print(sum(range(10)))",
    ]
    results = run_python_batch(rows, LIMITS)
    assert [r.stdout for r in results] == [
        "['main.py', 'row']\n",  # each row sees only its own files
        "",
        "['main.py', 'row']\n",
        "",
        "45\n",
    ]
    assert results[1].timed_out and results[3].error == "exit status 1: MemoryError"
    assert [r.error is None for r in results] == [True, False, True, False, True]


# ------------------------------------------------------- without bwrap (opt-in, no isolation)


def test_missing_bwrap_is_one_line_unless_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailable) as err:
        run_python("print(1)", LIMITS)
    assert "\n" not in str(err.value)
    assert "apt-get install bubblewrap" in str(err.value) and "allow_unisolated" in str(err.value)
    assert select_isolation(UNISOLATED) == "rlimits"
    with pytest.raises(SandboxUnavailable, match="needs allow_unisolated"):
        run_python("print(1)", LIMITS, "rlimits")  # asked for by name: still not allowed
    assert run_python("print(2 + 3)", UNISOLATED).stdout == "5\n"


def test_unisolated_fallback_still_limits_time_memory_and_output() -> None:
    hostile = [
        "while True:\n    pass",
        "bytearray(10 * 1024**3)",
        "print('x' * 10**7)",
        "import os; os.kill(os.getppid(), 9)",  # the launcher, not this process
        "print(2 + 3)",
    ]
    results = run_python_batch(hostile, UNISOLATED, "rlimits")
    assert results[0].timed_out
    assert results[1].error == "exit status 1: MemoryError"
    assert results[2].truncated and len(results[2].stdout) == 1000
    assert results[3].error == "killed by SIGKILL"
    assert (results[4].stdout, results[4].error) == ("5\n", None)


# ---------------------------------------------------------------------------------- config


def test_config_section_is_strict_and_range_checked() -> None:
    cfg = load_config(None, ["tools.python.timeout_seconds=3", "tools.python.memory_mb=128"])
    assert (cfg.tools.python.timeout_seconds, cfg.tools.python.memory_mb) == (3.0, 128)
    assert cfg.tools.python.allow_unisolated is False
    with pytest.raises(ConfigError, match=r"tools.python.network: unknown key"):
        load_config(None, ["tools.python.network=true"])
    with pytest.raises(ConfigError, match=r"tools.python.max_output_chars: must be > 0, got 0"):
        load_config(None, ["tools.python.max_output_chars=0"])


# ------------------------------------------------------- the interpreter, however it is called

REPO = Path(__file__).resolve().parents[1]
# Runs one snippet in a fresh caller (the interpreter under test), with ``threads`` idle threads
# started first (a trainer's are), under ``umask``; prints the ToolResult as JSON.
DRIVER = """
import dataclasses, json, os, sys, threading
sys.path.insert(0, sys.argv[1])
sys.path += sys.argv[2:]  # this test's site-packages: essa's own dependencies (PyYAML)
from essa.config import PythonToolConfig
from essa.tools.sandbox import run_python
job = json.load(sys.stdin)
os.umask(job["umask"])
idle = threading.Event()
for _ in range(job["threads"]):
    threading.Thread(target=idle.wait, daemon=True).start()
result = run_python(job["code"], PythonToolConfig(**job["limits"]), job["isolation"])
print(json.dumps(dataclasses.asdict(result)))
"""
# What the driver needs on sys.path: the repository, then this test's site-packages (the
# interpreter under test may be the bare installation, without the venv's packages).
IMPORTS = [str(REPO), *dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))]
NOBODY_UID = 61_234  # the non-root user: outside the sandbox's uid range


@dataclass
class Caller:
    """Who runs the sandbox: a command prefix (setpriv for the non-root user), an interpreter
    that user can run, and a folder of that user's for its files."""

    prefix: list[str]
    python: str
    home: Path
    env: dict[str, str]

    def run(
        self,
        code: str,
        limits: PythonToolConfig = LIMITS,
        isolation: str = "bwrap",
        python: str | None = None,
        threads: int = 0,
        umask: int = 0o022,
        cwd: Path | None = None,
    ) -> ToolResult:
        job = {"code": textwrap.dedent(code), "limits": dataclasses.asdict(limits)}
        job |= {"isolation": isolation, "threads": threads, "umask": umask}
        done = subprocess.run(
            [*self.prefix, python or self.python, "-c", DRIVER, *IMPORTS],
            input=json.dumps(job),
            capture_output=True,
            text=True,
            cwd=cwd or self.home,
            env=self.env,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return ToolResult(**json.loads(done.stdout))


def _runs_essa(prefix: list[str], python: str) -> bool:
    # Its sandbox layout must resolve: a Python that cannot read its own installation (a
    # pyenv under a /root it may not enter) falls back to another one's standard library.
    probe = f"import sys; sys.path[:0] = {IMPORTS[:1]!r}; sys.path += {IMPORTS[1:]!r}; "
    probe += "from essa.tools.sandbox import *; "
    probe += "python_layout(Interpreter.current())"
    done = subprocess.run([*prefix, python, "-c", probe], capture_output=True, cwd="/")
    return done.returncode == 0


@pytest.fixture(params=["this user", "non-root"])
def caller(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Caller]:
    """The sandbox run by this test's user, and by a non-root user (through setpriv when the
    tests run as root; a root-only bug such as the uid drop shows in the first)."""
    base_python = os.path.realpath(sys.executable)  # the installation, without the venv
    if request.param == "this user":
        yield Caller([], base_python, tmp_path, {**os.environ, "HOME": str(tmp_path)})
        return
    if os.geteuid() != 0:
        pytest.skip("the tests already run as a non-root user: 'this user' is that case")
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is not installed")
    prefix = [setpriv, f"--reuid={NOBODY_UID}", f"--regid={NOBODY_UID}", "--clear-groups", "--"]
    # This user may not reach this interpreter (a pyenv under /root): then the system's.
    usable = [p for p in (base_python, "/usr/bin/python3") if _runs_essa(prefix, p)]
    if not usable:
        pytest.skip(f"no interpreter that uid {NOBODY_UID} can run imports essa")
    home = Path(tempfile.mkdtemp(prefix="essa-nobody-"))
    os.chown(home, NOBODY_UID, NOBODY_UID)
    try:
        yield Caller(prefix, usable[0], home, {"PATH": "/usr/bin:/bin", "HOME": str(home)})
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _write_as(caller: Caller, path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if caller.prefix:  # the non-root user's own files, as in its home
        relative = path.relative_to(caller.home)
        for part in [relative, *relative.parents]:
            os.chown(caller.home / part, NOBODY_UID, NOBODY_UID)


@needs_bwrap
def test_a_symlinked_interpreter_in_a_home_shows_nothing_of_that_home(caller: Caller) -> None:
    secret = f"key-{secrets.token_hex(8)}"
    key = caller.home / ".ssh" / "id_ed25519"
    _write_as(caller, key, secret)
    python = caller.home / "bin" / "python"  # ~/bin/python -> the real interpreter
    python.parent.mkdir()
    python.symlink_to(caller.python)
    result = caller.run(f"print(open({str(key)!r}).read())", python=str(python))
    assert secret not in result.stdout + result.stderr
    assert result.error is not None and "FileNotFoundError" in result.error, result


@needs_bwrap
@pytest.mark.skipif(
    not (os.path.islink("/bin") and os.access("/bin/python3", os.X_OK)),
    reason="needs a merged /usr (/bin a link to usr/bin) with /usr/bin/python3",
)
def test_python_called_as_bin_python3_shows_no_root(caller: Caller) -> None:
    secret = f"secret-{secrets.token_hex(8)}"
    _write_as(caller, caller.home / "secret.txt", secret)
    result = caller.run(
        """
        import os, sys
        print(sys.executable, sorted(os.listdir("/")), os.path.exists("/etc"))
        """,
        python="/bin/python3",
    )
    assert result.error is None, result.stderr
    assert result.stdout.endswith(" False\n")  # no /etc: the host's root is not bound
    assert secret not in result.stdout


@needs_bwrap
def test_a_venv_in_a_checkout_under_tmp_brings_only_the_venv(caller: Caller) -> None:
    checkout = caller.home / "clone"
    secret = f"secret-{secrets.token_hex(8)}"
    _write_as(caller, checkout / "secret.txt", secret)
    venv = checkout / ".venv"
    made = subprocess.run(
        [*caller.prefix, caller.python, "-m", "venv", "--without-pip", "--system-site-packages"]
        + [str(venv)],
        capture_output=True,
        text=True,
    )
    assert made.returncode == 0, made.stderr
    site = next(venv.glob("lib/python3*/site-packages"))
    _write_as(caller, site / "venv_only.py", "WHERE = 'the venv'\n")
    result = caller.run(
        f"""
        import json, os, sys, venv_only
        try:
            secret = open({str(checkout / "secret.txt")!r}).read()
        except OSError as err:
            secret = type(err).__name__
        tmp, here = sorted(os.listdir("/tmp")), os.path.exists({str(checkout)!r})
        print(json.dumps([venv_only.WHERE, tmp, here, secret, sys.prefix == sys.base_prefix]))
        """,
        python=str(venv / "bin" / "python"),
        cwd=checkout,
    )
    assert result.error is None, result.stderr
    # Its own site-packages load; the snippet's /tmp holds only its file; no checkout path.
    assert json.loads(result.stdout) == ["the venv", ["main.py"], False, "FileNotFoundError", False]


@needs_bwrap
def test_a_umask_of_077_does_not_break_snippets(caller: Caller) -> None:
    result = caller.run("print(2 + 3)", umask=0o077)
    assert (result.stdout, result.error) == ("5\n", None), result.stderr


def test_an_installation_outside_usr_is_bound_alone(tmp_path: Path) -> None:
    """A conda-style prefix: the interpreter is a file of its own installation's tree."""
    conda = tmp_path / "conda"
    (conda / "bin").mkdir(parents=True)
    (conda / "bin" / "python3.11").touch()
    (conda / "bin" / "python").symlink_to("python3.11")
    layout = python_layout(Interpreter(str(conda / "bin" / "python"), str(conda), str(conda)))
    # Under /tmp, which the sandbox replaces: moved, its libpython found by LD_LIBRARY_PATH.
    assert layout.mounts[-3:] == ["--ro-bind", str(conda), BASE_PATH]
    assert layout.executable == f"{BASE_PATH}/bin/python3.11"
    assert layout.env == {"LD_LIBRARY_PATH": f"{BASE_PATH}/lib"}
    outside = python_layout(Interpreter("/opt/c/bin/python", "/opt/c", "/opt/c"), [], "/srv")
    assert outside.mounts == ["--perms", "0755", "--dir", "/opt", "--ro-bind", "/opt/c", "/opt/c"]
    assert outside.executable == "/opt/c/bin/python"


@pytest.mark.parametrize(
    ("prefix", "home", "cwd", "held"),
    [
        ("/", ["/home/u"], "/srv", "the whole filesystem"),  # a Python whose prefix is the root
        ("/home/u", ["/home/u"], "/srv", "/home/u"),  # ~/bin/python as an installation
        ("/srv/py", ["/home/u"], "/srv/py/work", "/srv/py/work"),  # a parent of the cwd
    ],
)
def test_a_tree_that_holds_the_root_a_home_or_the_cwd_is_refused(
    prefix: str, home: list[str], cwd: str, held: str
) -> None:
    interpreter = Interpreter(f"{prefix.rstrip('/')}/bin/python", prefix, prefix)
    with pytest.raises(SandboxUnavailable, match=f"would show {held} to") as err:
        python_layout(interpreter, home, cwd)
    assert "\n" not in str(err.value)


def test_a_venv_over_a_python_under_tmp_is_refused(tmp_path: Path) -> None:
    interpreter = Interpreter(str(tmp_path / "v/bin/python"), str(tmp_path / "v"), str(tmp_path))
    with pytest.raises(SandboxUnavailable, match="lies under /tmp"):
        python_layout(interpreter, [], "/srv")


# ------------------------------------------------ without bwrap: the whole tree, counted, killed


def test_the_fallback_counts_only_the_snippets_processes(caller: Caller) -> None:
    # The caller has 20 idle threads (a trainer's torch threads): the snippet's 8 are its own.
    limits = replace(UNISOLATED, max_processes=8)
    result = caller.run(
        """
        import os, threading, time
        threads = [threading.Thread(target=time.sleep, args=(0.1,)) for _ in range(3)]
        for t in threads:
            t.start()
        forked = 0
        for _ in range(50):
            try:
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
                forked += 1
            except OSError:
                pass
        print(forked)
        """,
        limits,
        "rlimits",
        threads=20,
    )
    assert result.error is None, result.stderr
    if caller.prefix or os.geteuid() != 0:  # the kernel exempts root from the process limit
        assert 1 <= int(result.stdout) < limits.max_processes


def test_the_fallback_kills_a_child_that_left_the_group(caller: Caller) -> None:
    token = f"{secrets.randbelow(10**8) + 10**9}"  # sleep's argument: unique in /proc
    result = caller.run(
        f"""
        import os
        ready, done = os.pipe()
        if os.fork() == 0:
            os.setsid()  # out of the process group that is killed at the deadline
            os.write(done, b"x")
            os.execv("/bin/sleep", ["sleep", "{token}"])
        os.read(ready, 1)
        print("detached", flush=True)
        while True:
            pass
        """,
        UNISOLATED,
        "rlimits",
    )
    assert result.timed_out and result.stdout == "detached\n", result
    try:
        deadline = time.monotonic() + 10  # a PID namespace is torn down asynchronously
        while (left := _with_argument(token)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left
    finally:
        for pid in _with_argument(token):
            os.kill(pid, signal.SIGKILL)


def _with_argument(token: str) -> list[int]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if token.encode() in cmdline.read_bytes().split(b"\0"):
                found.append(int(cmdline.parent.name))
    return found
