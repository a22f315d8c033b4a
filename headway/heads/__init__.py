"""Draft modules: Medusa heads, EAGLE-1 / EAGLE-3 / P-EAGLE drafters and DFlash block drafters, with save / load / push."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

if TYPE_CHECKING:
    from .base import HeadsBase, HeadsError
    from .dflash import DFlashConfig, DFlashDrafter, default_context_layers
    from .load import load_heads
    from .eagle import Eagle1Config, Eagle1Drafter, Eagle3Config, Eagle3Drafter, default_aux_layers
    from .medusa import MedusaConfig, MedusaHeads
    from .peagle import PEagleConfig, PEagleDrafter

_EXPORTS = {"HeadsBase": "base", "HeadsError": "base", "load_heads": "load", "MedusaConfig": "medusa",
            "MedusaHeads": "medusa", "Eagle1Config": "eagle", "Eagle1Drafter": "eagle", "Eagle3Config": "eagle",
            "Eagle3Drafter": "eagle", "default_aux_layers": "eagle",
            "DFlashConfig": "dflash", "DFlashDrafter": "dflash", "default_context_layers": "dflash",
            "PEagleConfig": "peagle", "PEagleDrafter": "peagle"}
__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
