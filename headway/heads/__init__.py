"""Draft modules: Medusa heads and EAGLE-1 / EAGLE-3 drafters, with save / load / push."""

from .base import HeadsBase, HeadsError, load_heads
from .eagle import Eagle1Config, Eagle1Drafter, Eagle3Config, Eagle3Drafter, default_aux_layers
from .medusa import MedusaConfig, MedusaHeads

__all__ = ["HeadsBase", "HeadsError", "load_heads", "MedusaConfig", "MedusaHeads", "Eagle1Config", "Eagle1Drafter",
           "Eagle3Config", "Eagle3Drafter", "default_aux_layers"]
