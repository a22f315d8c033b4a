"""The draft vocabulary of a training run: the most frequent answer tokens of its data, shared by
every head kind's task (Medusa and EAGLE-3 with ``draft_vocab_size``) and by calibration."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..heads import HeadsBase
from .config import TrainConfig
from .errors import TrainError
from .losses import IGNORE_INDEX


def draft_vocab_counts(data: str, vocab_size: int) -> torch.Tensor:
    """Answer-token frequencies of the training data: the dataset's token_counts, else counted now."""
    from ..data.errors import DataError
    from ..data.vocab import load_token_counts, token_frequencies

    try:
        counts = load_token_counts(data)
    except DataError:
        from datasets import load_from_disk

        counts = token_frequencies(load_from_disk(str(Path(data).expanduser())), vocab_size)
    if counts.numel() != vocab_size:
        raise ValueError(f"token counts of {data} cover {counts.numel()} ids, but the target vocabulary has "
                         f"{vocab_size}; was the data distilled with another tokenizer?")
    return counts


def answer_draft_vocab(cfg: TrainConfig, vocab_size: int, n: int | None) -> tuple[Tensor | None, dict[str, Any]]:
    """The ``n`` most frequent answer tokens of the training data (target ids, ascending) and the
    ``draft_vocab`` metadata; (None, full-vocabulary metadata) when ``n`` is None or covers everything.
    Counted as EAGLE-3 counts them (``draft_vocab_counts``: the dataset's token_counts, else counted now)."""
    info: dict[str, Any] = {"size": n or vocab_size, "target_vocab_size": vocab_size}
    if n is not None and n > vocab_size:
        raise TrainError(f"draft_vocab_size={n} is larger than the target's vocabulary of {vocab_size} tokens")
    if n is None or n == vocab_size:
        return None, info
    from ..data.vocab import draft_vocab

    if not cfg.data or not Path(cfg.data).expanduser().exists():
        raise TrainError(f"the draft vocabulary is counted on the training data, and data={cfg.data!r} is not "
                         "there; set data=PATH (with features=, a copy of the features' dataset)")
    counts = draft_vocab_counts(cfg.data, vocab_size)  # (V,)
    ids, _, _ = draft_vocab(counts, n)  # (n,)
    info["answer_token_coverage"] = round(float(counts[ids].sum()) / max(1, int(counts.sum())), 4)
    return ids, info


def in_draft_vocab(heads: HeadsBase, labels: Tensor, missing: int) -> Tensor:
    """(K, B, T) target-id labels (IGNORE_INDEX where none) -> draft-id labels, ``missing`` where the
    token is outside the heads' draft vocabulary; unchanged without one."""
    if not heads.has_draft_vocab:
        return labels
    return torch.where(labels == IGNORE_INDEX, labels, heads.to_draft_ids(labels, missing=missing))


__all__ = ["answer_draft_vocab", "draft_vocab_counts", "in_draft_vocab"]
