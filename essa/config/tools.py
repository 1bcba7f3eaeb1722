"""Tools a policy may call during a rollout: section ``tools`` (the sandboxed Python executor:
its limits, the turn format of tool-integrated rollouts), with its range checks."""

from __future__ import annotations

from dataclasses import dataclass, field

from essa.config.errors import ConfigError


@dataclass(frozen=True)
class PythonToolConfig:
    """The sandboxed Python executor (essa.tools.sandbox, docs/tools.md): limits per snippet."""

    timeout_seconds: float = 5.0  # wall clock; the CPU-time limit is this, rounded up
    memory_mb: int = 512  # address space of each process in the sandbox (RLIMIT_AS)
    max_processes: int = 16  # processes and threads the snippet may have at once (RLIMIT_NPROC)
    max_file_mb: int = 16  # size of the private /tmp, and of any one file (RLIMIT_FSIZE)
    max_output_chars: int = 4096  # per stream; past it the output is cut and the snippet stopped
    max_concurrent: int = 4  # snippets of a batch run at once (one process tree each)
    # Without bubblewrap, run snippets as plain subprocesses with the same resource limits but
    # no isolation (they can read the filesystem and reach the network); off: a missing bwrap
    # is an error.
    allow_unisolated: bool = False
    # Tool-integrated rollouts (docs/tools.md): code blocks a completion may run, per row; 0:
    # rollouts are plain text. Generation stops when a block closes, the code runs and its
    # output is appended in an output block, and the model goes on.
    max_tool_calls: int = 0
    code_start: str = "```python\n"  # ToRL's format by default
    code_end: str = "\n```"
    output_start: str = "\n```output\n"
    output_end: str = "\n```\n"
    show_last_expression: bool = True  # a block ending in an expression prints its repr
    # SFT targets of tasks with a code solution become code, output, answer (essa.data.tool_sft)
    sft_with_code: bool = True
    answer_format: str = "The answer is {answer}."  # the SFT target's last line after the output
    # GRPO: trajectories with a void turn (neither a closed code block nor an answer) get no
    # gradient (SimpleTIR's filter).
    drop_void_turns: bool = False


@dataclass(frozen=True)
class ToolsConfig:
    python: PythonToolConfig = field(default_factory=PythonToolConfig)

    @property
    def calls(self) -> PythonToolConfig | None:
        """The Python tool's settings when rollouts call it (``max_tool_calls`` > 0), else None."""
        return self.python if self.python.max_tool_calls else None


def check_tools(t: ToolsConfig) -> None:
    _check_python_tool(t.python)


def _check_python_tool(p: PythonToolConfig) -> None:
    """Checked whether or not a recipe runs tools: a value out of range is a typo even where unused."""
    positive = {
        "tools.python.timeout_seconds": p.timeout_seconds,
        "tools.python.memory_mb": p.memory_mb,
        "tools.python.max_processes": p.max_processes,
        "tools.python.max_file_mb": p.max_file_mb,
        "tools.python.max_output_chars": p.max_output_chars,
        "tools.python.max_concurrent": p.max_concurrent,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key}: must be > 0, got {value}")
    if p.max_tool_calls < 0:
        raise ConfigError(f"tools.python.max_tool_calls: must be >= 0, got {p.max_tool_calls}")
    for key in ("code_start", "code_end", "output_start"):
        if not getattr(p, key):
            raise ConfigError(f"tools.python.{key}: must not be empty")
    if p.answer_format.count("{answer}") != 1 or "{}" in p.answer_format:
        raise ConfigError(
            f"tools.python.answer_format: needs one {{answer}} field, got {p.answer_format!r}"
        )
