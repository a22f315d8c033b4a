"""The bundled tree decoder: tree arithmetic, shapes, proposers, verification, the generation loop."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .shapes import DynamicShape, StaticShape, chain, from_accuracies, mc_sim_7b_63, parse_shape
    from .speculator import GenerationOutput, GenerationStats, Speculator

_EXPORTS = {"Speculator": "speculator", "GenerationOutput": "speculator", "GenerationStats": "speculator",
            "StaticShape": "shapes", "DynamicShape": "shapes", "chain": "shapes", "mc_sim_7b_63": "shapes",
            "from_accuracies": "shapes", "parse_shape": "shapes"}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    # PEP 562: these load on first use, so that `headway <command> --help`, which imports this
    # package for a config dataclass (headway.decode.configs), never pays for torch / transformers.
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
