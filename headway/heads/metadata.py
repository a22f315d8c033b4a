"""What a heads checkpoint records besides its architecture (``config.json["metadata"]``), read
without loading weights: the one reader for the decoder, the CLI and training.

``metadata["adapter"]`` names the PEFT adapter a Medusa-2 checkpoint needs merged into its target.
Training writes it as a dict, ``{"subfolder": "adapter", "kind": "lora", "r": ..., ...}`` (the
folder relative to the checkpoint); a plain string path (relative or absolute) is read too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ADAPTER_SUBFOLDER = "adapter"


def read_metadata(heads_dir: str | Path) -> dict[str, Any]:
    """The checkpoint's ``metadata`` dict ({} when it has none); a folder without a headway
    ``config.json`` is a ``HeadsError``."""
    from .base import HeadsError, read_config

    path = Path(heads_dir).expanduser()
    meta = read_config(path).get("metadata") or {}
    if not isinstance(meta, dict):
        raise HeadsError(f"{path / 'config.json'}: 'metadata' must be an object, got {meta!r}")
    return dict(meta)


def update_metadata(heads_dir: str | Path, entries: dict[str, Any]) -> dict[str, Any]:
    """Set ``entries`` in the checkpoint's ``metadata`` (other keys kept) and publish the new
    ``config.json`` atomically; returns the metadata now on disk."""
    import json

    from ..publish import write_text
    from .base import read_config

    path = Path(heads_dir).expanduser()
    cfg = read_config(path)
    meta = dict(read_metadata(path))
    meta.update(entries)
    cfg["metadata"] = meta
    write_text(path / "config.json", json.dumps(cfg, indent=2) + "\n")
    return meta


def write_card(heads_dir: str | Path) -> Path:
    """Write the checkpoint's ``README.md`` model card again from its ``config.json`` (after
    ``update_metadata`` changed what the card shows: ``headway adapt``'s lineage); published atomically."""
    from ..publish import write_text
    from .base import read_config
    from .card import model_card

    path = Path(heads_dir).expanduser()
    return write_text(path / "README.md", model_card(read_config(path)))


def adapter_dir(heads_dir: str | Path, metadata: dict[str, Any] | None = None) -> Path | None:
    """The adapter folder the checkpoint at ``heads_dir`` needs on its target (Medusa-2), or None.
    ``metadata``: the checkpoint's, when already read (saves reading config.json again)."""
    from .base import HeadsError

    heads_dir = Path(heads_dir).expanduser()
    meta = read_metadata(heads_dir) if metadata is None else metadata
    entry = meta.get("adapter")
    if not entry:
        return None
    if isinstance(entry, dict):
        entry = entry.get("subfolder")
    if not isinstance(entry, str) or not entry:
        raise HeadsError(f"{heads_dir / 'config.json'}: metadata.adapter should be {{'subfolder': 'adapter', ...}} "
                         f"or a path, got {meta.get('adapter')!r}")
    path = Path(entry).expanduser()
    return path if path.is_absolute() else heads_dir / path


def calibration_temperatures(metadata: dict[str, Any] | None) -> list[float] | None:
    """``metadata["calibration"]["temperature_by_depth"]``: the temperature per draft depth (depth 1
    first) the decoder divides the drafter's logits by when it ranks tree nodes; None without one.
    Written by training (fitted on its held-out data) or ``headway tune calibration_data=...``."""
    from .base import HeadsError

    entry = (metadata or {}).get("calibration")
    if not entry:
        return None
    temps = entry.get("temperature_by_depth") if isinstance(entry, dict) else None
    ok = isinstance(temps, list) and all(
        isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < float("inf") for t in temps)
    if not ok:
        raise HeadsError(f"metadata.calibration.temperature_by_depth should be a list of positive numbers, got "
                         f"{temps if isinstance(entry, dict) else entry!r}")
    return [float(t) for t in temps] or None
