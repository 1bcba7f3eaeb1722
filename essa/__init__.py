"""essa-align: gradient-free alignment of LLMs by evolution strategies over LoRA singular values.

The Python API (essa/api.py), what the ``essa`` command runs::

    import essa

    cfg = essa.load_config("configs/demo.yaml", overrides=["run.generations=20"])
    summary = essa.train(cfg, run_dir="runs/demo")  # summary.json's content
    result = essa.evaluate(cfg, adapter=summary["adapter_dir"])  # pass@1, mean_score, drift

Importing ``essa`` is cheap: no torch, transformers or MPI at import time. User errors raise
:class:`essa.errors.UserError` or :class:`essa.config.ConfigError` with a one-line message.
"""

from essa.api import evaluate, load_config, train

__version__ = "0.1.0"
__all__ = ["__version__", "evaluate", "load_config", "train"]
