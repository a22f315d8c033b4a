"""The row readers training and calibration share: a distilled dataset's rows (Arrow, the target
runs each step) or a ``headway features`` folder's (offline, memory-mapped)."""

from __future__ import annotations

from typing import Any, Sequence

from torch.utils.data import Dataset


def load_rows(path: str) -> Any:
    from ..data.distill import load_distilled

    return load_distilled(path).select_columns(["input_ids", "loss_mask"])


class FeatureRows(Dataset):
    """Offline rows: those of a ``FeatureStore`` (memory-mapped shards), or a subset in a given
    order, reading only ``keys`` and at most ``max_length`` tokens of each row."""

    def __init__(self, store: Any, keys: Sequence[str], max_length: int | None = None,
                 indices: list[int] | None = None) -> None:
        self.store, self.keys, self.max_length = store, list(keys), max_length
        self.indices = list(range(len(store))) if indices is None else indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.store.row(self.indices[i], self.keys, self.max_length)

    def lengths(self) -> list[int]:
        """Token count of each row (after ``max_length``), without reading a feature."""
        every = self.store.lengths()
        cap = self.max_length or max(every, default=0)
        return [min(every[i], cap) for i in self.indices]

    def select(self, indices: Sequence[int]) -> "FeatureRows":
        return FeatureRows(self.store, self.keys, self.max_length, [self.indices[i] for i in indices])


def row_lengths(rows: Any, max_length: int | None = None) -> list[int]:
    """Token count of each training row (FeatureRows or distilled Arrow rows), capped at ``max_length``."""
    if isinstance(rows, FeatureRows):
        return rows.lengths()
    cap = max_length or 1 << 62
    if hasattr(rows, "with_format"):  # datasets.Dataset: list lengths from Arrow, no row decoded
        import pyarrow.compute as pc

        column = rows.with_format("arrow")[:]["input_ids"]  # the rows in order (a select() respected)
        return [min(n, cap) for n in pc.list_value_length(column).to_pylist()]
    return [min(len(ids), cap) for ids in rows["input_ids"]]


__all__ = ["FeatureRows", "load_rows", "row_lengths"]
