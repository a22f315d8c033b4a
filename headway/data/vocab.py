"""Draft-vocabulary statistics for EAGLE-3: token frequencies over the answers, and the reduced vocab.

The counts live with the dataset as ``token_counts.safetensors`` (one int64 tensor ``counts``
over the target vocabulary). ``draft_vocab`` picks the N most frequent target tokens and gives
the two mapping tensors EAGLE-3 checkpoints carry: ``d2t`` (draft id i -> target id i + d2t[i])
and ``t2d`` (a bool mask over the target vocab).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..publish import publishing
from .errors import DataError

COUNTS_FILE = "token_counts.safetensors"


def token_frequencies(dataset: Any, vocab_size: int, batch_size: int = 4096) -> torch.LongTensor:
    """How often each target token id occurs at a loss-masked position of ``dataset``. (vocab_size,) int64."""
    import pyarrow.compute as pc

    counts = np.zeros(vocab_size, dtype=np.int64)
    for table in dataset.with_format("arrow").iter(batch_size=batch_size):
        ids = pc.list_flatten(table.column("input_ids")).to_numpy(zero_copy_only=False)  # (N,)
        mask = pc.list_flatten(table.column("loss_mask")).to_numpy(zero_copy_only=False)  # (N,)
        kept = ids[mask.astype(bool)]
        if kept.size and (kept.min() < 0 or kept.max() >= vocab_size):
            raise DataError(f"token id {int(kept.max())} is outside the target vocabulary of {vocab_size}")
        counts += np.bincount(kept, minlength=vocab_size)
    return torch.from_numpy(counts)


def draft_vocab(counts: torch.Tensor, n: int) -> tuple[torch.LongTensor, torch.LongTensor, torch.BoolTensor]:
    """(draft_to_target_ids (n,), d2t (n,) int64, t2d (V,) bool) for the ``n`` most frequent tokens.

    Ties go to the lower target id; draft ids are sorted by target id, so
    ``draft_to_target_ids == torch.nonzero(t2d)[:, 0]`` and ``d2t[i] = draft_to_target_ids[i] - i``.
    """
    vocab = counts.shape[0]
    if not 0 < n <= vocab:
        raise DataError(f"draft vocabulary size must be in 1..{vocab} (the target vocabulary), got {n}")
    order = torch.sort(-counts.to(torch.int64), stable=True).indices  # most frequent first, ties by id
    draft_to_target = torch.sort(order[:n]).values  # (n,)
    d2t = draft_to_target - torch.arange(n, dtype=torch.int64)  # (n,)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_to_target] = True
    return draft_to_target, d2t, t2d


def save_token_counts(folder: str | Path, counts: torch.Tensor) -> Path:
    from safetensors.torch import save_file

    path = Path(folder) / COUNTS_FILE
    with publishing(path) as tmp:
        save_file({"counts": counts.to(torch.int64).contiguous()}, str(tmp),
                  metadata={"what": "token frequencies over loss-masked tokens"})
    return path


def load_token_counts(folder: str | Path) -> torch.LongTensor:
    from safetensors.torch import load_file

    path = Path(folder) / COUNTS_FILE
    if not path.is_file():
        raise DataError(f"no {COUNTS_FILE} in {folder}; distilled and tokenized datasets write it when they finish")
    return load_file(str(path))["counts"]
