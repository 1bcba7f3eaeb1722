"""Task data: ``Example`` loaders, the built-in arithmetic task and prompt templates.

Imports only numpy and the standard library; ``pyarrow`` and ``datasets`` are imported inside
the loaders that need them. Grading stays in ``essa.rewards``.
"""

from essa.data.loaders import (
    DataError,
    load_examples,
    record_to_example,
    shuffle,
    split_examples,
)
from essa.data.templates import TEMPLATES, known_templates, render_prompt

__all__ = [
    "TEMPLATES",
    "DataError",
    "known_templates",
    "load_examples",
    "record_to_example",
    "render_prompt",
    "shuffle",
    "split_examples",
]
