"""The benchmark suite: run the benchmarks, then render docs/performance.md from their JSON.

    python -m bench                  # SUITE: the quick-but-honest set, <= 15 min on 2 cores
    python -m bench --all            # SUITE and ON_DEMAND
    python -m bench NAME [NAME ...]  # those benchmarks or studies only (with their listed arguments)
    python -m bench --report-only    # re-render docs/performance.md and the plots, run nothing
    python -m bench --list           # every benchmark and study, with its command

bench/ holds two kinds of driver. A benchmark (bench/benchmarks/) times or sizes one thing in
minutes and reports ratios measured side by side; a study (bench/studies/) trains whole runs
for hours and compares held-out accuracy, written up in docs/results*.md. Each runs in a fresh
process (``python -m bench.benchmarks.<name> ARGS``, ``python -m bench.studies.<name> ARGS``),
so its memory, threads and imports do not leak into the next; a failing one is logged and the
others still run. Every driver writes bench/results/<name>.json; the report lists every
benchmark, and every study that defines ``report_rows``, with the date of its record, whether
run now, recorded earlier or never ("not run yet"). bench/results/suite.json keeps the wall
time of the last suite run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, Row, compact_png, read_result, row

BENCH_DIR = Path(__file__).resolve().parent
KINDS = ("benchmarks", "studies")  # bench/<kind>/<name>.py
DOC = Path("docs/performance.md")
# docs/results.md (any page of docs/, and README) is prose around the studies' own tables: each
# block between "<!-- table: bench/results/NAME.md -->" and "<!-- end table -->" is that file's
# table, copied in by `python -m bench --report-only` (and by any run), never edited by hand.
DOCS = Path("docs")
README = Path("README.md")  # its headline tables are blocks too
TABLE_BLOCK = re.compile(r"(<!-- table: (\S+) -->\n)(.*?)(<!-- end table -->)", re.S)
LOGS = Path("runs/bench-suite")
BUDGET_SECONDS = 15 * 60
# Benchmarks that need another interpreter (vLLM lives in its own venv: launch/setup_vllm_cpu.sh).
INTERPRETERS = {"vllm_throughput": Path(".venv-vllm/bin/python")}

# (module, CLI arguments of its suite run). Sized for <= 15 minutes on 2 quiet cores in all.
SUITE: list[tuple[str, list[str]]] = [
    ("generation_overhead", ["--models", "demo", "smollm2", "--repeats", "3"]),
    ("strategies", ["--repeats", "3"]),
    ("optimizer_timing", ["--iterations", "10", "--max-seconds", "15"]),
    ("mpi_scaling", ["--generations", "20", "--repeats", "2"]),
]
# Longer benchmarks: their recorded JSON is rendered; `--all` or their name runs them.
ON_DEMAND: list[tuple[str, list[str]]] = [
    ("prefix_cache", []),
    ("quant", ["--seeds", "0", "1", "2"]),
    ("peers_memory", ["--threads", "1", "--repeats", "2"]),
    ("vllm_throughput", ["--repeats", "3"]),
    ("long_completions", ["--repeats", "3", "--baseline", "main"]),  # this tree vs main (~15 min)
    ("generation_speed", []),  # one generation on a long-prompt task, 3 variants (~12 min)
    ("gpu_check", []),  # needs a GPU (< 8 min); on CPU: --device cpu --tiny
]
# Studies: algorithm comparisons on held-out accuracy, written up in docs/results*.md (their own
# .md tables and plots); `python -m bench NAME` runs one. Minutes (demo, peers, trl_grpo, lisa)
# to hours each. Those that define report_rows are rendered in docs/performance.md too.
STUDIES: list[tuple[str, list[str]]] = [
    ("demo", ["--seeds", "0", "1", "2"]),  # the demo table and plot of docs/results.md (~5 min)
    (
        "peers",
        [
            "--threads",
            "1",
            "--seeds",
            "0",
            "1",
            "2",
            "--set",
            "run.generations=30",
            "--set",
            "data.test_size=200",
        ],
    ),  # ESSA, our GRPO and TRL on the demo (~9 min)
    ("trl_grpo", ["--threads", "1"]),  # TRL's GRPOTrainer on the demo (~5 min)
    ("lisa", ["--seeds", "0", "1", "2", "--steps", "12"]),  # LISA memory, layerwise ES on the demo
    ("real_model", ["--seeds", "0", "1", "2"]),  # SmolLM2 on reasoning-gym tasks, vs GRPO
    ("real_model_ablation", ["--seeds", "0", "1", "2"]),  # one change at a time, real model
    ("signal", ["--seeds", "0", "1", "2"]),  # informative prompts and process rewards
    ("grpo_options", ["--seeds", "0", "1", "2"]),  # the gradient backend's options vs plain GRPO
    ("label_free", ["--seeds", "0", "1", "2"]),  # TTRL's vote and RLSC vs labels
    ("tools", ["--seeds", "0", "1", "2"]),  # text-only vs tool-integrated ESSA, and GRPO
    ("tool_tasks", []),  # the code-call SFT adapter's held-out score: which tasks suit tools
    ("drift_budget", ["--seeds", "0", "1", "2"]),  # the search's drift budget on and off
    ("drift_proof", ["--seeds", "0", "1", "2"]),  # ESSA with and without a drift control vs GRPO
    ("tie_breaker", []),  # the reference tie-breaker along the scaled line, per task
    ("retention_tasks", []),  # the base model's score on candidate retention tasks (~10 min)
    ("mutation", ["--per-module", "5", "--seed", "0"]),  # do the tests catch injected bugs
]
# Modules that serve the drivers rather than measure: run by them, or by hand before them.
HELPERS = ("common", "suite", "gguf_to_safetensors", "tiny_prm")


def kind_of(name: str) -> str:
    """How a listed driver runs: "suite", "on demand" (benchmarks) or "study"."""
    if name in dict(SUITE):
        return "suite"
    return "on demand" if name in dict(ON_DEMAND) else "study"


def module_file(name: str) -> Path | None:
    """bench/benchmarks/<name>.py or bench/studies/<name>.py, whichever exists."""
    found = [BENCH_DIR / kind / f"{name}.py" for kind in KINDS]
    return next((path for path in found if path.exists()), None)


def module(name: str) -> str:
    """The dotted module of a driver: ``bench.benchmarks.<name>`` or ``bench.studies.<name>``."""
    path = module_file(name)
    if path is None:
        raise KeyError(f"no driver {name} in bench/benchmarks or bench/studies")
    return f"bench.{path.parent.name}.{name}"


def thread_args(name: str, threads: int | None) -> list[str]:
    """How ``python -m bench --threads N`` reaches a module: its --threads, or a config override."""
    if threads is None:
        return []
    if name in ("demo", "quant"):  # they run `essa train` with --set overrides
        return ["--set", f"model.num_threads={threads}"]
    path = module_file(name)
    text = path.read_text() if path else ""
    return ["--threads", str(threads)] if '"--threads"' in text else []


def reported(name: str) -> bool:
    """True when a study's module defines report_rows (its rows go to docs/performance.md)."""
    path = module_file(name)
    return path is not None and "\ndef report_rows(" in path.read_text()


def known() -> list[tuple[str, list[str], bool]]:
    """(name, args, in SUITE) for every listed benchmark whose module file exists, and every
    study that reports rows."""
    listed = [(n, a, True) for n, a in SUITE] + [(n, a, False) for n, a in ON_DEMAND]
    listed += [(n, a, False) for n, a in STUDIES if reported(n)]
    return [(n, a, s) for n, a, s in listed if module_file(n) is not None]


def run_one(name: str, args: list[str]) -> dict[str, Any]:
    """Run one benchmark in a fresh process, logging to runs/bench-suite/<name>.log."""
    LOGS.mkdir(parents=True, exist_ok=True)
    log = LOGS / f"{name}.log"
    python = INTERPRETERS.get(name)
    cmd = [str(python) if python and python.exists() else sys.executable, "-m", module(name),
           *args]  # fmt: skip
    print(f"[bench] {' '.join(cmd[1:])}  (log: {log})", flush=True)
    start = time.perf_counter()
    with log.open("w") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - start
    status = "ok" if code == 0 else f"failed (exit {code}; see {log})"
    print(f"[bench] {name}: {status}, {seconds:.0f} s", flush=True)
    return {"name": name, "args": args, "exit_code": code, "wall_seconds": round(seconds, 1)}


def rows_for(name: str, result: dict[str, Any] | None) -> list[Row]:
    """The module's report rows, or one row saying why there are none."""
    if result is None:
        return [row(name, "not run yet", None, None, f"run: python -m bench {name}")]
    report = getattr(importlib.import_module(module(name)), "report_rows", None)
    if report is None:
        return [row(name, "recorded", None, None, "module has no report_rows yet")]
    try:
        return list(report(result))
    except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError) as err:
        return [row(name, "unreadable result", None, None,
                    f"{type(err).__name__}: {err}; re-run: python -m bench {name}")]  # fmt: skip


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _met(flag: bool | None) -> str:
    return {True: "yes", False: "**no**", None: ""}[flag]


def section(name: str, in_suite: bool, result: dict[str, Any] | None, ran_now: set[str]) -> str:
    """One benchmark's heading, provenance line and table."""
    lines = [f"### {name}", ""]
    if result is not None:
        machine = result.get("machine")
        if isinstance(machine, dict):
            machine = (
                f"{machine.get('processor')}, {machine.get('cpu_count')} CPUs, torch threads "
                f"{machine.get('torch_threads', 'n/a')}, load {machine.get('load_average_1min')}"
            )
        when = result.get("date", "date not recorded")
        origin = "this run" if name in ran_now else ("suite" if in_suite else kind_of(name))
        versions = result.get("versions")
        lines += [
            f"Command: `{result.get('command', f'not recorded: re-run python -m bench {name}')}`  ",
            f"Recorded: {when} ({origin}); machine: {machine or 'not recorded'}"
            + (
                "; versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v)
                if isinstance(versions, dict)
                else ""
            ),
            "",
        ]
    lines += ["| row | value | target | met | note |", "|---|---|---|---|---|"]
    for r in rows_for(name, result):
        lines.append(
            f"| {_cell(r['row'])} | {_cell(r['value'])} | {_cell(r['target'] or '')} "
            f"| {_met(r['met'])} | {_cell(r['note'])} |"
        )
    return "\n".join(lines + [""])


def render(ran_now: set[str]) -> str:
    """docs/performance.md's text from bench/results/*.json."""
    suite = read_result("suite")
    head = [
        "# Performance",
        "",
        "Generated by `python -m bench` (or `python -m bench --report-only`) from "
        "bench/results/*.json; do not edit by hand. Each benchmark measures its ratios side by "
        "side in one run (timings on a shared CPU drift; ratios measured together do not), "
        "reports medians with [min–max, n] over repeats, and names the command that "
        "reproduces it. `met` is empty where no target is set.",
        "",
        "```bash",
        "python -m bench                # the suite below (SUITE), <= 15 min on 2 cores",
        "python -m bench --threads 1    # the same with 1 torch thread: for a busy machine",
        "python -m bench --all          # plus the on-demand benchmarks (much longer)",
        "python -m bench strategies     # one benchmark (python -m bench.benchmarks.strategies --help)",
        "python -m bench --report-only  # re-render this page from bench/results/*.json",
        "```",
        "",
        "Suite: "
        + ", ".join(f"`{n}`" for n, _, s in known() if s)
        + ". On demand: "
        + ", ".join(f"`{n}`" for n, _, _ in known() if kind_of(n) == "on demand")
        + ". Studies with rows here (their tables are in docs/results*.md): "
        + ", ".join(f"`{n}`" for n, _, _ in known() if kind_of(n) == "study")
        + ".",
        "",
    ]
    if suite is not None:
        head += [
            f"Last suite run: {suite['date']}, {suite['wall_seconds']:.0f} s in all "
            f"(budget {BUDGET_SECONDS} s on 2 cores), machine load at start "
            f"{suite['machine'].get('load_average_1min')}: "
            + ", ".join(f"{r['name']} {r['wall_seconds']:.0f} s" for r in suite["runs"])
            + "."
            + (
                " The machine was busy (load above its CPU count): timings are inflated and "
                "noisier than on a quiet machine; ratios were measured side by side."
                if suite["machine"].get("load_average_1min", 0) > suite["machine"]["cpu_count"]
                else ""
            ),
            "",
        ]
    if (RESULTS / "throughput.png").exists():
        head += ["![throughput](../bench/results/throughput.png)", ""]
    results = {n: read_result(n) for n, _, _ in known()}
    targets = [
        f"| {name} | {_cell(r['row'])} | {_cell(r['value'])} | {_cell(r['target'] or '')} "
        f"| {_met(r['met'])} |"
        for name, result in results.items()
        if result is not None
        for r in rows_for(name, result)
        if r["target"]
    ]
    head += [
        "## Targets at a glance",
        "",
        "| benchmark | row | value | target | met |",
        "|---|---|---|---|---|",
        *targets,
        "",
        "## All rows, per benchmark",
        "",
    ]
    body = [section(n, s, results[n], ran_now) for n, _, s in known()]
    return "\n".join(head) + "\n" + "\n".join(body)


def plot_throughput(path: Path) -> bool:
    """Bars of generated tokens/s (generation_overhead) and sequences/s (strategies)."""
    overhead, strategies = read_result("generation_overhead"), read_result("strategies")
    panels = []
    for cell in (overhead or {}).get("cells", []):
        bars = {k: cell["new_tokens"][k] / cell["seconds"][k]["median"] for k in cell["seconds"]}
        panels.append((f"{cell['model'].split(' ')[0]}: new tokens/s", bars))
    if strategies and strategies.get("cells"):
        bars = {}
        for c in strategies["cells"]:
            for s in ("batched", "merged"):
                label = f"{s[0]} P{c['population']} N{c['prompts']}"
                bars[label] = c["population"] * c["prompts"] / c["seconds"][s]["median"]
        panels.append(("demo strategies: sequences/s (b=batched, m=merged)", bars))
    if not panels:
        return False
    try:
        import matplotlib
    except ImportError:
        print("[bench] no plot: matplotlib is not installed (pip install 'essa-align[plot]')")
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), dpi=110)
    for ax, (title, bars) in zip(list(getattr(axes, "flat", [axes])), panels, strict=True):
        colors = ["tab:orange" if k.startswith(("m ", "plain")) else "tab:blue" for k in bars]
        ax.bar(range(len(bars)), list(bars.values()), color=colors)
        ax.set_xticks(range(len(bars)), list(bars), rotation=30, ha="right", fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    compact_png(path)
    plt.close(fig)
    return True


def study_table(path: Path) -> str:
    """The markdown table of a study: ``bench/results/<name>.md`` as written, or for
    ``<name>.json`` the table that the driver's ``record_table`` renders from the record (its
    table lines only)."""
    if path.suffix == ".json":
        driver = importlib.import_module(module(path.stem))
        text = driver.record_table(json.loads(path.read_text()))
    else:
        text = path.read_text()
    lines = [line for line in text.splitlines() if line.startswith("|")]
    if not lines:
        raise ValueError(f"{path} holds no table")
    return "\n".join(lines) + "\n"


def sync_tables(text: str, root: Path = Path(".")) -> str:
    """``text`` with every table block refreshed from the file it names."""
    return TABLE_BLOCK.sub(lambda m: m.group(1) + study_table(root / m.group(2)) + m.group(4), text)


def write_report(ran_now: set[str]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot_throughput(RESULTS / "throughput.png")
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(render(ran_now))
    print(f"[bench] wrote {DOC}", flush=True)
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        text = page.read_text() if page.exists() else ""
        if TABLE_BLOCK.search(text):
            page.write_text(sync_tables(text))
            print(f"[bench] refreshed the study tables of {page}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="benchmarks to run (default: the SUITE)")
    parser.add_argument("--all", action="store_true", help="SUITE and ON_DEMAND")
    parser.add_argument("--report-only", action="store_true", help="render, run nothing")
    parser.add_argument("--list", action="store_true", help="list the benchmarks")
    parser.add_argument(
        "--threads", type=int, default=None,
        help="torch threads for every benchmark that takes them (default: each module's own, "
        "2 for most; use 1 on a machine where other work keeps the cores busy)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    table = {n: (a, kind_of(n)) for n, a, _ in known()}
    table |= {n: (a, "study") for n, a in STUDIES}  # run by name only
    if args.list:
        for n, (a, kind) in table.items():
            print(f"{n:22s} {kind:9s} python -m {module(n)} {' '.join(a)}")
        return 0
    unknown = [n for n in args.names if n not in table]
    if unknown:
        print(f"error: unknown benchmark(s) {', '.join(unknown)}; see --list", file=sys.stderr)
        return 2
    if args.report_only:
        write_report(set())
        return 0
    chosen = ("suite", "on demand") if args.all else ("suite",)
    names = args.names or [n for n, (_, kind) in table.items() if kind in chosen]
    start = time.perf_counter()
    runs = [run_one(n, table[n][0] + thread_args(n, args.threads)) for n in names]
    wall = time.perf_counter() - start
    if not args.names and not args.all:
        from bench.common import write_result

        command = "python -m bench" + (f" --threads {args.threads}" if args.threads else "")
        write_result("suite", {"runs": runs, "wall_seconds": round(wall, 1)}, command)
        if wall > BUDGET_SECONDS:
            print(f"[bench] warning: the suite took {wall:.0f} s > {BUDGET_SECONDS} s budget")
    write_report({r["name"] for r in runs if r["exit_code"] == 0})
    failed = [r["name"] for r in runs if r["exit_code"] != 0]
    if failed:
        print(f"error: benchmark(s) failed: {', '.join(failed)} (logs in {LOGS})", file=sys.stderr)
    return 1 if failed else 0
