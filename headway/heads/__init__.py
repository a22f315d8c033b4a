"""Draft modules: Medusa heads and EAGLE-1 / EAGLE-3 drafters, with save / load / push."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import HeadsBase, HeadsError, load_heads
    from .eagle import Eagle1Config, Eagle1Drafter, Eagle3Config, Eagle3Drafter, default_aux_layers
    from .medusa import MedusaConfig, MedusaHeads

_EXPORTS = {"HeadsBase": "base", "HeadsError": "base", "load_heads": "base", "MedusaConfig": "medusa",
            "MedusaHeads": "medusa", "Eagle1Config": "eagle", "Eagle1Drafter": "eagle", "Eagle3Config": "eagle",
            "Eagle3Drafter": "eagle", "default_aux_layers": "eagle"}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    # PEP 562: these load on first use, so that `headway <command> --help`, which imports this
    # package for a config dataclass (headway.heads.configs), never pays for torch / transformers.
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
