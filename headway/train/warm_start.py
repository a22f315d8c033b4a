"""``init_from``: a run that starts from earlier heads instead of fresh ones.

The recipe still builds its heads (so their settings are the recipe's); the stored heads must have
the same kind, settings and target, and then lend every weight and buffer (the draft vocabulary
included). Only a fresh run reads them: a resumed run continues from its own checkpoint."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from torch import nn

from ..heads.base import HeadsBase, load_state_strict
from ..heads.load import load_heads
from .errors import TrainError


def warm_start(heads: HeadsBase, name_or_path: str, target: nn.Module, tokenizer: Any = None) -> HeadsBase:
    """Copy the heads at ``name_or_path`` into ``heads`` (built by the recipe for ``target``); a
    mismatch of kind, target or settings is refused with both values named."""
    src = load_heads(name_or_path, target=target, tokenizer=tokenizer, expected=type(heads))  # refuses another kind
    ours, theirs = asdict(heads.config), asdict(src.config)
    differ = [f"{k}: {theirs.get(k)!r} there, {v!r} in this recipe" for k, v in ours.items() if theirs.get(k) != v]
    if differ:
        raise TrainError(f"init_from {name_or_path} has other settings than this recipe ({'; '.join(differ)})")
    load_state_strict(heads, src.state_dict(), f"init_from {name_or_path}")
    if "draft_vocab" in src.metadata:  # which tokens the copied d2t holds (calibration is refitted at evaluation)
        vocab = dict(src.metadata["draft_vocab"])
        lm_head = getattr(heads, "lm_head", None)
        if "lm_head_init" in vocab and isinstance(lm_head, nn.Linear):  # frozen or not is this run's choice
            frozen = "" if lm_head.weight.requires_grad else " (frozen)"
            vocab["lm_head_init"] = vocab["lm_head_init"].removesuffix(" (frozen)") + frozen
        heads.metadata["draft_vocab"] = vocab
    heads.metadata["init_from"] = str(name_or_path)
    return heads


__all__ = ["warm_start"]
