"""The Python tool's sandbox (essa.tools.sandbox) against hostile snippets, with real processes.

Every hostile snippet must come back as a tool error (``ToolResult.error`` set) while this
process, its files and its other children are untouched, and the next snippet must run. The
bwrap tests are the ``sandbox`` component: required in CI, where .ci/run installs bubblewrap.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from essa.config import ConfigError, PythonToolConfig, load_config
from essa.tools.sandbox import (
    SandboxUnavailable,
    ToolResult,
    check_sandbox,
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
