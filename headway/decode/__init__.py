"""The bundled tree decoder: tree arithmetic, shapes, proposers, verification, the generation loop."""

from .shapes import DynamicShape, StaticShape, chain, from_accuracies, mc_sim_7b_63, parse_shape
from .speculator import GenerationOutput, GenerationStats, Speculator

__all__ = ["Speculator", "GenerationOutput", "GenerationStats", "StaticShape", "DynamicShape", "chain",
           "mc_sim_7b_63", "from_accuracies", "parse_shape"]
