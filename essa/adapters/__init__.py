"""LoRA adapters in singular-value form (ESSA): SVD layout, population-batched forward,
merged strategy and PEFT export. Imports torch; vLLM and bitsandbytes are never imported."""

from essa.adapters.export import export_peft
from essa.adapters.merged import merged_candidate
from essa.adapters.population import PopulationLinear, PopulationLoRA, candidate_rows
from essa.adapters.svd import LAYOUT_ORDER, FactorSVD, SVDAdapter

__all__ = [
    "LAYOUT_ORDER",
    "FactorSVD",
    "PopulationLinear",
    "PopulationLoRA",
    "SVDAdapter",
    "candidate_rows",
    "export_peft",
    "merged_candidate",
]
