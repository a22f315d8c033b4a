"""The features folder's format, shared by ``headway features`` (a pass over finished rows) and
``headway distill --features`` (kept while the rows are written): layer specs, how a shard's
tensors are packed, and the manifest a finished folder carries. ``features`` documents the folder.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import torch

from ..feature_layers import dflash_layers, eagle3_layers
from .configs import FeaturesConfig
from .errors import DataError
from .shards import complete_shards, write_json

MANIFEST = "features.json"
FORMAT = "headway-features"
SUFFIX = ".safetensors"
STORE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# ``--topk_logits K``: the target's K largest logits per token (float32, sorted descending) and their token
# ids (int32), stored beside the layers under these keys; zeros where the next token is not an answer token
TOPK_VALUES, TOPK_INDICES = "topk_values", "topk_indices"
TOPK_KEYS = (TOPK_VALUES, TOPK_INDICES)


# ---------------------------------------------------------------- layer specs

def parse_layers(layers: Sequence[str | int], num_hidden_layers: int) -> list[str | int]:
    """Validate and expand a layer spec: 'final', hidden-state indices 0..L, 'eagle3' or 'dflash'."""
    out: list[str | int] = []
    for spec in layers:
        s = str(spec).strip().lower()
        if s == "final":
            out.append("final")
        elif s in ("eagle3", "dflash"):  # a preset adds its layers not listed yet ('eagle3 dflash final')
            try:
                preset = eagle3_layers(num_hidden_layers) if s == "eagle3" else dflash_layers(num_hidden_layers)
            except ValueError as e:
                raise DataError(str(e)) from None
            out += [i for i in preset if i not in out]
        elif s.lstrip("-").isdigit():
            i = int(s)
            if not 0 <= i <= num_hidden_layers:
                raise DataError(f"layer {i} is not a hidden_states index of a {num_hidden_layers}-layer target "
                                f"(0..{num_hidden_layers}; use 'final' for the post-norm final state)")
            out.append(i)
        else:
            raise DataError(f"unknown layer '{spec}'; use 'final', an integer hidden_states index, 'eagle3' or "
                            "'dflash'")
    if len(set(map(str, out))) != len(out):
        raise DataError(f"layers {out} repeat a layer")
    if not out:
        raise DataError("no layers given")
    return out


def layer_key(layer: str | int) -> str:
    return "final" if layer == "final" else f"hidden_states.{int(layer)}"


def pack_shard(rows: list[dict[str, Any]], parts: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One shard's tensors: ``parts`` holds per key the rows' (T_i, H) features in row order, stored
    concatenated with the rows' tokens, loss masks, offsets and dataset indices (``distill``
    writes the same shards from the forwards that generated the rows)."""
    lengths = torch.tensor([len(r["input_ids"]) for r in rows], dtype=torch.int64)
    tensors = {k: torch.cat(v).contiguous() for k, v in parts.items()}
    tensors["input_ids"] = torch.tensor([t for r in rows for t in r["input_ids"]], dtype=torch.int32)
    tensors["loss_mask"] = torch.tensor([t for r in rows for t in r["loss_mask"]], dtype=torch.int8)
    tensors["offsets"] = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    tensors["index"] = torch.tensor([r["index"] for r in rows], dtype=torch.int64)
    return tensors


def layer_indices(layers: Sequence[str | int], num_hidden_layers: int) -> dict[str, int]:
    """{feature key: HF ``hidden_states`` index} of parsed ``layers`` (``final`` is the last one)."""
    return {layer_key(l): (num_hidden_layers if l == "final" else int(l)) for l in layers}


def feature_keys(layers: Sequence[str | int], topk: int = 0) -> list[str]:
    """The keys a folder of these layers (and ``--topk_logits topk``) stores per token."""
    return [layer_key(l) for l in layers] + (list(TOPK_KEYS) if topk else [])


def finish_features(out: Path, n_shards: int, manifest: dict[str, Any], layers: list[str | int], info: Any,
                    store_dtype: torch.dtype, tokens_per_s: float, topk: int = 0) -> dict[str, Any]:
    from safetensors import safe_open

    files = complete_shards(out, SUFFIX)
    missing = [j for j in range(n_shards) if j not in files]
    if missing:
        raise DataError(f"{out}: feature shards {missing[:5]} are missing after all processes finished; rerun")
    shards, disk = [], 0
    for j in range(n_shards):
        with safe_open(str(files[j]), "pt") as f:
            meta = f.metadata()
        shards.append({"file": files[j].name, "rows": int(meta["rows"]), "tokens": int(meta["tokens"])})
        disk += files[j].stat().st_size
    tokens = sum(s["tokens"] for s in shards)
    keys = feature_keys(layers, topk)
    final = {**manifest, "layers": [str(l) for l in layers], "keys": keys, "dtype": str(store_dtype).split(".")[-1],
             "hidden_size": info.hidden_size, "num_hidden_layers": info.num_hidden_layers, "target": asdict(info),
             "rows_per_shard": manifest["settings"]["shard_size"], "shards": shards,
             "num_rows": sum(s["rows"] for s in shards), "num_tokens": tokens,
             "feature_bytes_per_token": len(layers) * info.hidden_size * store_dtype.itemsize + topk * 8,
             "bytes_per_token": round(disk / max(tokens, 1), 1), "tokens_per_s": round(tokens_per_s, 1),
             "complete": True}
    write_json(out / MANIFEST, final)
    return final


def features_command(settings: dict[str, Any], output: str | Path, layers: Sequence[str] | None = None) -> str:
    """The ``headway features`` command line that makes (or, same settings, completes) a features folder."""
    defaults = {f.name: f.default for f in FeaturesConfig.__dataclass_fields__.values()}
    words = ["headway features", str(settings["dataset"]), "--layers", *map(str, layers or settings["layers"]),
             "--output", str(output), "--target", str(settings["target"])]
    for key in ("revision", "adapter", "dtype", "store_dtype", "shard_size", "topk_logits"):
        if settings.get(key) is not None and settings[key] != defaults[key]:
            words += [f"--{key}", str(settings[key])]
    rows = dataset_rows(settings["dataset"])
    if rows is None or settings.get("rows", rows) < rows:
        words += ["--limit", str(settings["rows"])]
    return " ".join(words)


def dataset_rows(path: str | Path) -> int | None:
    """Rows of a distilled dataset folder, or None when it cannot be read."""
    try:
        from datasets import load_from_disk

        return len(load_from_disk(str(Path(path).expanduser())))
    except Exception:  # noqa: BLE001 - only a hint for a message
        return None
