"""The bundled tree decoder: tree arithmetic, shapes, proposers, verification, the generation loop."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

if TYPE_CHECKING:
    from .shapes import DynamicShape, StaticShape, chain, from_accuracies, mc_sim_7b_63, parse_shape
    from .stats import BatchOutput
    from .speculator import GenerationOutput, GenerationStats, Speculator

_EXPORTS = {"Speculator": "speculator", "GenerationOutput": "speculator", "GenerationStats": "speculator", "BatchOutput": "stats",
            "StaticShape": "shapes", "DynamicShape": "shapes", "chain": "shapes", "mc_sim_7b_63": "shapes",
            "from_accuracies": "shapes", "parse_shape": "shapes"}
__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
