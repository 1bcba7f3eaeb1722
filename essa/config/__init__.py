"""One YAML schema of small frozen dataclasses, one module per concern.

Every field has its default in its section's dataclass and only there (no
``cfg.get(key, default)`` anywhere else); a builtin model may state its own training defaults
(:func:`model_defaults`), which the loader takes for keys its config leaves unset and logs.

* :mod:`essa.config.loader`: YAML, ``--set`` overrides, file:line:key errors;
* :mod:`essa.config.schema`: :class:`Config`, the sections composed, and the checks across them;
* one module per concern, its sections with their checks: :mod:`~essa.config.backend` (model,
  adapter, generation, vLLM), :mod:`~essa.config.es` (optimizer), :mod:`~essa.config.gradient`
  (SFT, GRPO, DPO, ScaleBiO, LISA), :mod:`~essa.config.data` (data, reward),
  :mod:`~essa.config.evaluation`, :mod:`~essa.config.run`, :mod:`~essa.config.tools`.

Components take their own sections; only the recipes and the set-up take the whole
:class:`Config`.
"""

from essa.config.backend import (
    VLLM_DROPPED_QUANTIZATION,
    AdapterConfig,
    GenerationConfig,
    ModelConfig,
    VLLMConfig,
)
from essa.config.data import DataConfig, HintConfig, RewardConfig, SelectionConfig
from essa.config.errors import ConfigError
from essa.config.es import DriftBudgetConfig, LayerwiseConfig, OptimizerConfig
from essa.config.evaluation import HELDOUT_METRICS, DriftConfig, EvaluationConfig
from essa.config.gradient import (
    CureConfig,
    DPOConfig,
    EntropyConfig,
    GRPOConfig,
    LisaConfig,
    PrimeConfig,
    ReplayConfig,
    ScaleBiOConfig,
    SFTConfig,
)
from essa.config.loader import (
    demo_config,
    dump_config,
    key_location,
    load_config,
    model_defaults,
    parse_override,
    to_dict,
)
from essa.config.run import MAX_SEED, RunConfig
from essa.config.schema import TINY_SFT_STEPS, Config, check_values, tiny_sft_warning
from essa.config.tools import PythonToolConfig, ToolsConfig

__all__ = [
    "HELDOUT_METRICS",
    "MAX_SEED",
    "TINY_SFT_STEPS",
    "VLLM_DROPPED_QUANTIZATION",
    "AdapterConfig",
    "Config",
    "ConfigError",
    "CureConfig",
    "DPOConfig",
    "DataConfig",
    "DriftConfig",
    "EntropyConfig",
    "EvaluationConfig",
    "GRPOConfig",
    "GenerationConfig",
    "HintConfig",
    "LayerwiseConfig",
    "DriftBudgetConfig",
    "LisaConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PrimeConfig",
    "PythonToolConfig",
    "ReplayConfig",
    "RewardConfig",
    "RunConfig",
    "SFTConfig",
    "ScaleBiOConfig",
    "SelectionConfig",
    "ToolsConfig",
    "VLLMConfig",
    "check_values",
    "demo_config",
    "dump_config",
    "key_location",
    "load_config",
    "model_defaults",
    "parse_override",
    "tiny_sft_warning",
    "to_dict",
]
