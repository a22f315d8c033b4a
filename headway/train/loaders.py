"""Which rows a run trains and evaluates on, in which order, in which batches.

The training order is a pure function of (seed, step): ``EpochView`` lays seeded passes over the
rows end to end, so a resumed run skips whole batches and 1 or N processes see the same global
batches. Held-out rows are an ``eval_data`` / ``eval_features`` folder or a seeded split of the
training rows, the same rows for Arrow data and for the features made from it.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from .batch import collate, collate_features
from .config import TrainConfig
from .errors import TrainError
from .rows import FeatureRows, load_rows, row_lengths


class EpochView(Dataset):
    """Rows of ``epochs`` passes over ``rows``, each pass in its own seeded order.

    A flat, sequential index makes the data order a pure function of (seed, step): resuming
    skips batches, and 1 or N processes see the same global batches. With ``lengths`` and a
    ``window`` (rows), each pass is cut into windows of its seeded order and every window is
    sorted longest first, so consecutive batches hold rows of similar length and pad less."""

    def __init__(self, rows: Any, seed: int, epochs: int, lengths: Sequence[int] | None = None,
                 window: int = 0) -> None:
        self.rows, self.seed, self.epochs, self.n = rows, seed, epochs, len(rows)
        self.lengths, self.window = lengths, window
        self._perms: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return self.n * self.epochs

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = length_windows(torch.randperm(self.n, generator=g).tolist(), self.lengths,
                                                self.window)
        return self._perms[epoch]

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[self._perm(i // self.n)[i % self.n]]


def length_windows(order: list[int], lengths: Sequence[int] | None, window: int) -> list[int]:
    """``order`` cut into windows of ``window`` rows, each sorted by length, longest first (stable:
    ties keep the seeded order). Unchanged without lengths or with a window of 0 or 1."""
    if lengths is None or window <= 1:
        return order
    out: list[int] = []
    for a in range(0, len(order), window):
        out += sorted(order[a:a + window], key=lambda i: -lengths[i])
    return out


def split_indices(n: int, fraction: float, seed: int) -> tuple[list[int], list[int] | None]:
    """(train, held-out) row indices: ``round(fraction * n)`` rows (at least 1) held out by the
    seeded rule of datasets' ``train_test_split``, so Arrow rows and feature rows of the same
    data hold out the same rows. (0..n-1, None) when nothing is held out."""
    if fraction <= 0 or n < 2:
        return list(range(n)), None
    n_test = max(1, round(fraction * n))
    perm = np.random.default_rng(seed).permutation(n)  # (n,)
    return perm[n_test:].tolist(), perm[:n_test].tolist()


def split_data(cfg: TrainConfig, keys: Sequence[str] | None = None,
               eval_keys: Sequence[str] | None = None) -> tuple[Any, Any | None]:
    """Training and held-out rows: Arrow rows of ``data``, or (offline) ``FeatureRows`` of
    ``features`` reading ``keys`` (the held-out ones ``eval_keys``, default the same); held out:
    eval_features, eval_data, or an eval_fraction split."""
    from ..data.features import FeatureStore

    def feature_rows(path: str, which: Sequence[str] | None) -> FeatureRows:
        store = FeatureStore(path)
        return FeatureRows(store, store.keys if which is None else which, cfg.max_length)

    held = keys if eval_keys is None else eval_keys
    rows = feature_rows(cfg.features, keys) if cfg.features else load_rows(cfg.data)
    if cfg.eval_features:
        return rows, feature_rows(cfg.eval_features, held)
    if cfg.eval_data:
        return rows, load_rows(cfg.eval_data)
    train_idx, eval_idx = split_indices(len(rows), cfg.eval_fraction, cfg.seed)
    if eval_idx is None:
        return rows, None
    if isinstance(rows, FeatureRows) and held is not None:
        return rows.select(train_idx), FeatureRows(rows.store, held, cfg.max_length).select(eval_idx)
    return rows.select(train_idx), rows.select(eval_idx)


def collate_fn(rows: Any, pad_id: int, max_length: int | None) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
    """The DataLoader's collate for these rows: stored features are padded there too."""
    fn = collate_features if isinstance(rows, FeatureRows) else collate
    return functools.partial(fn, pad_id=pad_id, max_length=max_length)


def train_loader(rows: Any, cfg: TrainConfig, steps: int, global_batch: int, pad_id: int, accelerator: Any
                 ) -> DataLoader:
    """Enough seeded epochs for every step (plus one batch per process), in a fixed order."""
    world = accelerator.num_processes
    epochs = max(1, math.ceil((steps * global_batch + cfg.batch_size * world) / len(rows)))
    lengths = row_lengths(rows, cfg.max_length) if cfg.group_by_length else None
    view = EpochView(rows, cfg.seed, epochs, lengths, cfg.group_by_length * global_batch)
    return DataLoader(view, batch_size=cfg.batch_size, shuffle=False,
                      collate_fn=collate_fn(rows, pad_id, cfg.max_length), num_workers=cfg.num_workers,
                      pin_memory=bool(cfg.features) and accelerator.device.type == "cuda")  # stored states: copy fast


def eval_loader(rows: Any, cfg: TrainConfig, accelerator: Any, pad_id: int) -> DataLoader:
    """This process's share of the held-out rows (row i goes to process i % world): exact sums, no padding."""
    if len(rows) < accelerator.num_processes:
        raise TrainError(f"the held-out set has {len(rows)} rows, fewer than the {accelerator.num_processes} "
                         "processes; raise eval_fraction or give eval_data")
    idx = list(range(accelerator.process_index, len(rows), accelerator.num_processes))
    return DataLoader(rows.select(idx), batch_size=cfg.batch_size, shuffle=False,
                      collate_fn=collate_fn(rows, pad_id, cfg.max_length))

