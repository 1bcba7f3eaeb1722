"""Loading: YAML with file:line:key errors, ``--set`` overrides, a builtin model's own defaults.

Loading is strict: an unknown key or a value of the wrong type raises :class:`ConfigError`
whose message names the file, the line and the dotted key path, e.g.
``configs/demo.yaml:7: optimizer.sigma: unknown key (known: name, population_size, ...)``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml

from essa.config.backend import ModelConfig
from essa.config.errors import ConfigError
from essa.config.schema import Config, check_values

logger = logging.getLogger(__name__)

_YAML11_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _line_map(node: yaml.Node, prefix: str, lines: dict[str, int]) -> None:
    """Record the 1-based line of every mapping key, keyed by dotted path."""
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
            lines[path] = key_node.start_mark.line + 1
            _line_map(value_node, path, lines)


def _where(source: str, lines: dict[str, int], path: str) -> str:
    line = lines.get(path)
    return f"{source}:{line}" if line is not None else source


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(v) for v in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp)).replace("NoneType", "null")


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widen to float)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(tp):
            try:
                return _coerce(value, arm, path)
            except ConfigError:
                continue
        names = " or ".join(_type_name(a) for a in typing.get_args(tp))
        raise ConfigError(f"{path}: expected {names}, got {value!r}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{path}: expected one of {_type_name(tp)}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        (arm, _) = typing.get_args(tp)
        return tuple(_coerce(v, arm, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"{path}: expected null, got {value!r}")
        return None
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _YAML11_FLOAT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads "3e-4" (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        try:
            number = float(value)
        except OverflowError:  # an integer too large for a float
            number = math.inf
        if not math.isfinite(number):  # .nan would slip through every range check
            raise ConfigError(f"{path}: expected a finite number, got {value!r}")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported annotation {tp!r} at {path}")  # a bug in this module


def _build(cls: type, data: Any, prefix: str, where: typing.Callable[[str], str]) -> Any:
    """Build dataclass ``cls`` from a mapping, strictly."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{where(prefix)}: {prefix or 'config'}: expected a mapping, got {data!r}"
        )
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    flat, flat_cls, ignored = _flat_part(cls, data, where)
    flat_keys = [f.name for f in dataclasses.fields(flat_cls)] if flat_cls else []
    flat_data: dict[str, Any] = {}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key in ignored:
            continue
        if key in flat_keys and key not in fields:
            flat_data[key] = value
            continue
        if key not in fields or key == flat:
            known = ", ".join(k for name in fields for k in (flat_keys if name == flat else [name]))
            raise ConfigError(f"{where(path)}: {path}: unknown key (known: {known})")
        tp = hints[key]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, path, where)
            continue
        try:
            kwargs[key] = _coerce(value, tp, path)
        except ConfigError as err:
            raise ConfigError(f"{where(path)}: {err}") from None
    if flat is not None and flat_cls is not None:
        kwargs[flat] = _build(flat_cls, flat_data, prefix, where)
    return cls(**kwargs)


def _flat_part(
    cls: type, data: dict[str, Any], where: typing.Callable[[str], str]
) -> tuple[str | None, type | None, set[str]]:
    """A field whose metadata ``flat`` is a function of the section's data (an ES optimizer's
    options: essa.config.es.flat_options) holds keys written flat in the section: (its name, the
    dataclass those keys build, keys to accept and ignore); (None, None, set()) without one."""
    for f in dataclasses.fields(cls):
        if "flat" in f.metadata:
            try:
                flat_cls, ignored = f.metadata["flat"](data)
            except ConfigError as err:  # "section.key: why"
                raise ConfigError(f"{where(str(err).split(':', 1)[0])}: {err}") from None
            return f.name, flat_cls, ignored
    return None, None, set()


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``a.b=value`` (value is YAML: ``0.2``, ``true``, ``[q_proj, v_proj]``, ``null``)."""
    if "=" not in text:
        raise ConfigError(f"--set {text}: expected KEY=VALUE, e.g. optimizer.sigma0=0.2")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except (yaml.YAMLError, RecursionError):
        value = raw
    return key.strip().split("."), value


def _apply_override(data: dict[str, Any], keys: list[str], value: Any) -> None:
    node = data
    for k in keys[:-1]:
        child = node.get(k)
        if child is None:
            child = node[k] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {'.'.join(keys)}: {k} is not a section")
        node = child
    node[keys[-1]] = value


# The bundled demo model's values (model.name_or_path: builtin:demo, built by
# essa/data/build_demo.py) where they differ from the schema's defaults, which suit a real chat
# model. The loader takes them for keys the config leaves unset and logs which; configs/demo.yaml
# spells them out, and docs/configuration.md says why each default differs.
DEMO_DEFAULTS: Mapping[str, object] = types.MappingProxyType(
    {
        "sft.steps": 4,  # with batch_size 100: a deliberately weak SFT, leaving the search room
        "sft.batch_size": 100,  # one step per pass over the 100 SFT examples
        "optimizer.sigma0": 1.0,  # the tiny latent skill needs big relative steps
        "data.template": "raw",  # the character tokenizer has no chat template
        "data.sft_size": 100,  # enough correct examples for the weak SFT
        "generation.max_new_tokens": 8,  # "a+b=" answers take at most 4 characters
        "evaluation.use_scale_baseline": True,  # cheap here, and it tells most of the story
    }
)


def model_defaults(name_or_path: str) -> Mapping[str, object]:
    """The training values a builtin model states for itself (dotted key -> value), which a
    config for that model takes where it leaves the key unset; empty for any other model."""
    if name_or_path != "builtin:demo":
        return {}
    return DEMO_DEFAULTS


def _fill_model_defaults(data: dict[str, Any]) -> list[str]:
    """Fill in the model's own defaults (:func:`model_defaults`) for unset keys; the keys filled."""
    model = data.get("model")
    default = ModelConfig().name_or_path
    name = model.get("name_or_path", default) if isinstance(model, dict) else default
    filled = []
    for dotted, value in model_defaults(name).items():
        section, key = dotted.split(".")
        node = data.get(section)
        if node is None:
            node = data[section] = {}
        if isinstance(node, dict) and key not in node:  # a non-mapping fails in _build
            node[key] = value
            filled.append(dotted)
    if filled:
        shown = ", ".join(f"{key}={model_defaults(name)[key]}" for key in filled)
        logger.info("%s: keys left unset take the model's own defaults: %s", name, shown)
    return filled


def demo_config() -> Config:
    """The embedded default (``essa train`` with no arguments): the schema, for builtin:demo
    with the demo's own defaults (:func:`model_defaults`)."""
    return load_config(None)


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Load and validate a config file (or the embedded default when ``path`` is None)."""
    source = str(path) if path is not None else "<default>"
    lines: dict[str, int] = {}
    data: Any = {}
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as err:
            raise ConfigError(f"{source}: cannot read config: {err.strerror}") from None
        except UnicodeDecodeError as err:
            raise ConfigError(
                f"{source}: not a UTF-8 text file (byte {err.start}: {err.reason})"
            ) from None
        try:
            node = yaml.compose(text)
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            line = f":{mark.line + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or "invalid YAML"
            raise ConfigError(f"{source}{line}: invalid YAML: {problem}") from None
        except RecursionError:  # PyYAML composes nested collections recursively
            raise ConfigError(f"{source}: invalid YAML: nested too deeply") from None
        if node is not None:
            _line_map(node, "", lines)
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: the top level must be a mapping of sections")
    overridden: set[str] = set()
    for text in overrides:
        keys, value = parse_override(text)
        _apply_override(data, keys, value)
        overridden.add(".".join(keys))

    _fill_model_defaults(data)

    def where(key_path: str) -> str:
        if key_path in overridden:
            return f"--set {key_path}"
        return _where(source, lines, key_path)

    cfg = _build(Config, data, "", where)
    try:
        check_values(cfg)
    except ConfigError as err:
        key = str(err).split(":", 1)[0]
        raise ConfigError(f"{where(key)}: {err}") from None
    return cfg


def key_location(path: str | Path | None, overrides: typing.Sequence[str], key: str) -> str:
    """Where ``key`` of the config :func:`load_config` built from ``path`` and ``overrides`` was
    set, as its errors say it: ``--set KEY``, ``FILE:LINE``, or ``FILE`` (``<default>``)."""
    if any(parse_override(text)[0] == key.split(".") for text in overrides):
        return f"--set {key}"
    if path is None:
        return "<default>"
    lines: dict[str, int] = {}
    try:
        node = yaml.compose(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError):
        node = None  # it loaded a moment ago; without it, the file alone
    if node is not None:
        _line_map(node, "", lines)
    return _where(str(path), lines, key)


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain-data view (tuples as lists) suitable for YAML/JSON; a ``flat`` field's keys are
    written into its section, as the loader reads them."""

    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            out: dict[str, Any] = {}
            for f in dataclasses.fields(v):
                value = plain(getattr(v, f.name))
                if "flat" in f.metadata:
                    out.update(value)
                else:
                    out[f.name] = value
            return out
        if isinstance(v, tuple | list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    result: dict[str, Any] = plain(cfg)
    return result


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
