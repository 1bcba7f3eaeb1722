"""Layer blocks of the SVD adapter's search vector, for layerwise ES.

Reads the layout manifest (``SVDAdapter.manifest()``): each module's ``slice_a`` and ``slice_b``
belong to the decoder layer named by the first integer component of its module path
(``model.layers.3.self_attn.q_proj`` -> layer 3). Layers are numbered 0..L-1 in the order of
their index in the model, so a block schedule over L layers addresses them directly.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_LAYER = re.compile(r"\.(\d+)\.")


def layer_of(module_name: str) -> int | None:
    """The decoder-layer index in a module path, or None when it names no layer."""
    match = _LAYER.search(f".{module_name}.")
    return int(match.group(1)) if match else None


def layer_blocks(manifest: Mapping[str, Any]) -> list[list[int]]:
    """Per layer (ascending model index), the search-vector coordinates of its singular values.

    Raises ValueError when a module has no layer index (layerwise search needs one per module).
    """
    by_layer: dict[int, list[int]] = {}
    for module in manifest["modules"]:
        layer = layer_of(module["name"])
        if layer is None:
            raise ValueError(f"adapter module {module['name']} belongs to no numbered layer")
        indices = by_layer.setdefault(layer, [])
        for start, stop in (module["slice_a"], module["slice_b"]):
            indices.extend(range(start, stop))
    return [sorted(by_layer[layer]) for layer in sorted(by_layer)]
