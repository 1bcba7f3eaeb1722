"""Task data: ``Example`` loaders, the built-in arithmetic tasks and prompt templates.

Imports only numpy and the standard library; ``pyarrow``, ``datasets`` and ``reasoning_gym``
are imported inside the loaders that need them. Grading stays in ``essa.rewards``.
"""

from essa.data.loaders import (
    BUILTIN_SOURCES,
    DataError,
    builtin_examples,
    load_examples,
    record_to_example,
    shuffle,
    split_examples,
)
from essa.data.templates import TEMPLATES, known_templates, render_prompt

__all__ = [
    "BUILTIN_SOURCES",
    "TEMPLATES",
    "DataError",
    "builtin_examples",
    "known_templates",
    "load_examples",
    "record_to_example",
    "render_prompt",
    "shuffle",
    "split_examples",
]
