"""essa-align: gradient-free alignment of LLMs by evolution strategies over LoRA singular values.

Importing ``essa`` is cheap: no torch, transformers or MPI at import time.
"""

__version__ = "0.1.0"
