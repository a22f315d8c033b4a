"""The files of a heads checkpoint, below the head modules: where a checkpoint is (a folder or a
Hub repo), its ``config.json`` and its tensors, read with one-line errors. ``base`` (save / load),
``hub``, ``export`` and the importers read through here, so none of them imports another for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..config import read_json_object
from ..errors import HeadwayError


class HeadsError(HeadwayError):
    """A head checkpoint cannot be saved or loaded as asked."""


def resolve_checkpoint(name_or_path: str | Path, revision: str | None = None) -> Path:
    """A local folder, or a Hub repo id resolved through huggingface_hub (the cache works offline)."""
    from ..target import resolve_folder

    return resolve_folder(name_or_path, revision, allow_patterns=["*.json", "*.safetensors", "*.md"],
                          what="heads checkpoint", error=HeadsError)


def is_heads_checkpoint(path: str | Path) -> bool:
    """Whether the local folder ``path`` holds a saved heads checkpoint (its config and weights):
    what a resumed run or a pipeline stage checks before it reuses one."""
    folder = Path(path)
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def read_config(path: Path) -> dict[str, Any]:
    f = path / "config.json"
    if not f.is_file():
        raise HeadsError(f"{path} has no config.json; is it a headway heads checkpoint?")
    cfg = read_json_object(f, HeadsError)
    if "kind" not in cfg:
        raise HeadsError(f"{f} has no 'kind'; not a headway checkpoint (use `headway import` for reference formats)")
    if not isinstance(cfg["kind"], str):
        raise HeadsError(f"{f}: 'kind' must be a string, got {cfg['kind']!r}")
    return cfg


def read_tensors(f: Path, error: type[HeadwayError] = HeadsError) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; a missing, empty, truncated or foreign file is one ``error``
    line naming the file (safetensors' own error names neither the file nor the likely cause)."""
    if not f.is_file():
        raise error(f"{f.parent} has no {f.name}")
    if f.stat().st_size == 0:
        raise error(f"{f}: the file is empty (an interrupted save or download?)")
    try:
        return load_file(str(f))
    except OSError as e:
        raise error(f"{f}: cannot read ({e.strerror or type(e).__name__})") from None
    except SafetensorError as e:
        why = " ".join(str(e).split()).removeprefix("Error while deserializing header: ")
        raise error(f"{f}: not a readable safetensors file ({why}); it is probably truncated or corrupt") from None


def check_finite(tensors: dict[str, torch.Tensor], where: str, error: type[HeadwayError] = HeadsError) -> None:
    """Refuse weights holding NaN or Inf, naming the tensor: they would draft garbage silently."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            raise error(f"{where}: tensor '{name}' has {nan} NaN and {inf} infinite values of {t.numel()}")


def read_reference_tensors(f: Path) -> dict[str, torch.Tensor]:
    """A flat dict of tensors from .safetensors, or from .pt/.bin read weights-only; a missing,
    truncated or foreign file is one ``HeadsError`` line naming it."""
    if f.suffix == ".safetensors":
        return read_tensors(f)
    if not f.is_file():
        raise HeadsError(f"{f.parent} has no {f.name}")
    try:
        sd = torch.load(str(f), map_location="cpu", weights_only=True)
    except Exception as e:  # pickled code, not plain tensors
        raise HeadsError(f"{f}: cannot read as plain tensors (weights_only=True): {str(e).splitlines()[0]}") from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise HeadsError(f"{f} is not a flat dict of tensors")
    return sd
