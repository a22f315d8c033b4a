"""``load_heads``: any headway checkpoint, whatever its kind (the one place that knows every kind)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from .base import HeadsBase
from .dflash import DFlashDrafter
from .eagle import Eagle1Drafter, Eagle3Drafter
from .files import HeadsError, read_config, resolve_checkpoint
from .medusa import MedusaHeads
from .peagle import PEagleDrafter

HEAD_CLASSES: dict[str, type[HeadsBase]] = {c.kind: c for c in (MedusaHeads, Eagle1Drafter, Eagle3Drafter, DFlashDrafter,
                                                                 PEagleDrafter)}


def heads_class(kind: str) -> type[HeadsBase]:
    if kind not in HEAD_CLASSES:
        raise HeadsError(f"unknown heads kind '{kind}'; known: {', '.join(HEAD_CLASSES)}")
    return HEAD_CLASSES[kind]


def load_heads(name_or_path: str | Path, target: nn.Module | None = None, revision: str | None = None,
               expected: type[HeadsBase] | None = None, tokenizer: Any = None) -> HeadsBase:
    """Load any headway checkpoint; with ``target`` given, check it (and ``tokenizer``) and attach."""
    path = resolve_checkpoint(name_or_path, revision)
    cfg = read_config(path)
    cls = heads_class(cfg["kind"])
    if expected is not None and expected is not HeadsBase and cls is not expected:
        raise HeadsError(f"{path} holds '{cfg['kind']}' heads, not '{expected.kind}'")
    return cls.from_folder(path, cfg, target, tokenizer)
