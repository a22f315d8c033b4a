"""Fit the draft calibration of heads already trained (``headway tune calibration_data=...``).

The same per-depth sums training's evaluation computes (``calibration.py``), on a distilled
dataset or a features folder of the same target, each head kind's through its task's
``calibration_sums``: no branch on the kind here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from .calibration import calibration_metadata, summarize_calibration
from .registry import TASKS


def calibration_rows(data: str | Path, layers: Sequence[int], max_rows: int | None) -> Any:
    """Rows of a distilled dataset (Arrow) or of a features folder, at most ``max_rows``."""
    from ..data.features import MANIFEST, FeatureStore
    from .batch import stored_keys
    from .rows import FeatureRows, load_rows

    path = Path(data).expanduser()
    if (path / MANIFEST).is_file():
        rows: Any = FeatureRows(FeatureStore(str(path)), stored_keys(layers, False))
    else:
        rows = load_rows(str(path))
    n = len(rows) if max_rows is None else min(max_rows, len(rows))
    return rows.select(list(range(n)))


@torch.no_grad()
def fit_calibration(heads: nn.Module, target: nn.Module, data: str | Path, depth: int = 5,
                    max_rows: int | None = 64, batch_size: int = 4, max_length: int | None = 1024) -> dict[str, Any]:
    """Fit per-depth temperatures for existing heads, without training: the eval path's sums on
    ``data`` (a distilled dataset, or a features folder of the same target), summarised. Returns
    ``calibration_metadata`` with ``summary`` (the per-depth numbers) added. ``depth``: EAGLE chain
    steps measured (Medusa: one per head)."""
    from .batch import collate, collate_features, stored_batch, target_batch
    from .rows import FeatureRows

    sums = TASKS[heads.kind].calibration_sums
    layers = list(heads.feature_layers)
    rows = calibration_rows(data, layers, max_rows)
    was_training = heads.training
    heads.eval()  # the decoder's distribution: the draft vocabulary
    head = target.get_output_embeddings().weight
    totals: dict[str, Tensor] = {}
    try:
        for i in range(0, len(rows), batch_size):
            chunk = [rows[j] for j in range(i, min(i + batch_size, len(rows)))]
            if isinstance(rows, FeatureRows):
                tb = stored_batch(collate_features(chunk, max_length=max_length), layers, None, head.device, head.dtype)
            else:
                tb = target_batch(target, collate(chunk, max_length=max_length), layers, need_logits=False)
            for k, v in sums(heads, tb, depth).items():
                totals[k] = totals[k] + v if k in totals else v
    finally:
        heads.train(was_training)
    if not totals:
        raise ValueError(f"{data}: no rows to fit the calibration on")
    summary = summarize_calibration({k: v.cpu() for k, v in totals.items()})
    return calibration_metadata(summary, fitted_on=str(data)) | {"summary": summary}
