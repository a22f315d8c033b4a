"""A headway features folder -> each peer trainer's offline input, row for row (pure functions + writers).

The rows, tokens and loss masks are headway's (``FeatureStore``, in dataset order); only the
layout and the numbering of the three EAGLE-3 auxiliary layers change. Three numberings of the
same layers exist, and mixing them up silently trains on the wrong layers:

- **HF index** (headway): ``output_hidden_states[k]`` = the output of decoder layer k-1 = the input
  of decoder layer k (0 = the embeddings).
- **input of layer k** (speculators' ``target_layer_ids``, and vLLM's
  ``eagle_aux_hidden_state_layer_ids``): the same number as the HF index.
- **output of layer k** (ModelOpt's ``eagle_aux_hidden_state_layer_ids``, whose forward hooks sit on
  ``layers[k]``; SpecForge, whose capture and SGLang serving add one): HF index - 1.

The final state: headway stores ``final`` after the target's last norm; ModelOpt and SpecForge
take exactly that (their lm_head is applied to it as is). speculators wants the last layer's
output *before* the norm and applies the verifier's RMSNorm itself; RMSNorm is scale-invariant,
so the pre-norm state is recovered from ``final``, the norm's weight and eps
(``prenorm_equivalent``), without running the target again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
from safetensors.torch import save_file

PEERS = ("speculators", "modelopt", "specforge")


@dataclass
class Row:
    """One training row: tokens, loss mask and the target's states, all (T, ...) float32."""

    input_ids: torch.Tensor  # (T,) long
    loss_mask: torch.Tensor  # (T,) long, 1 on the tokens the target wrote
    aux: list[torch.Tensor]  # 3 x (T, H), in the order of the HF indices asked for
    final: torch.Tensor  # (T, H), after the target's final norm


def peer_layer_ids(hf_indices: Sequence[int], peer: str) -> list[int]:
    """HF hidden-state indices -> the numbers ``peer`` writes in its config / CLI."""
    if peer not in PEERS:
        raise ValueError(f"unknown peer '{peer}'; one of {PEERS}")
    if any(k < 1 for k in hf_indices):
        raise ValueError(f"aux layers {list(hf_indices)}: index 0 (the embeddings) is no layer's output")
    shift = 0 if peer == "speculators" else 1  # input of layer k | output of layer k
    return [int(k) - shift for k in hf_indices]


def hf_indices_from_peer(ids: Sequence[int], peer: str) -> list[int]:
    """The inverse of ``peer_layer_ids``."""
    shift = 0 if peer == "speculators" else 1
    return [int(k) + shift for k in ids]


def read_rows(features: str | Path, aux_layers: Sequence[int], limit: int | None = None,
              max_length: int | None = None) -> Iterator[Row]:
    """Rows of a headway features folder holding ``hidden_states.k`` for ``aux_layers`` and ``final``."""
    from headway.data.features import FeatureStore

    store = FeatureStore(features)
    keys = [f"hidden_states.{int(k)}" for k in aux_layers] + ["final"]
    missing = [k for k in keys if k not in store.keys]
    if missing:
        raise ValueError(f"{features} lacks {missing}; make it with headway features DATASET --layers "
                         f"{' '.join(map(str, aux_layers))} final")
    for i in range(len(store) if limit is None else min(limit, len(store))):
        r = store.row(i, keys, max_length)
        f = {k: v.float().clone() for k, v in r["features"].items()}  # own storage: torch.save writes a view's whole
        yield Row(r["input_ids"].clone(), r["loss_mask"].clone(), [f[k] for k in keys[:3]], f["final"])


def prenorm_equivalent(final: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(T, H) post-norm state -> a (T, H) state x with RMSNorm_{w,eps}(x) == final.

    final = w * x / sqrt(ms(x) + eps), so u = final / w has ms(u) = ms(x) / (ms(x) + eps) and
    x = u * sqrt(eps / (1 - ms(u))) exactly. Where eps is negligible (real models) 1 - ms(u) is
    lost in rounding, the clamp then gives a large multiple of u, which the norm maps to final
    just as well (the error is of the order of eps / ms(x))."""
    if bool((norm_weight == 0).any()):
        raise ValueError("the target's final norm has zero weights: its pre-norm state cannot be recovered")
    u = final.double() / norm_weight.double()  # (T, H)
    gap = (1 - u.pow(2).mean(-1, keepdim=True)).clamp(min=1e-12)  # (T, 1) = eps / (ms(x) + eps)
    return (u * (eps / gap).sqrt()).float()


def speculators_sample(row: Row, norm_weight: torch.Tensor, eps: float) -> dict[str, torch.Tensor]:
    """speculators' ``hs_{i}.safetensors``: token_ids (T,), hidden_states (T, 4, H) = 3 aux + pre-norm last."""
    last = prenorm_equivalent(row.final, norm_weight, eps)
    return {"token_ids": row.input_ids.long(), "hidden_states": torch.stack([*row.aux, last], dim=1).contiguous()}


def modelopt_sample(row: Row) -> dict[str, torch.Tensor]:
    """ModelOpt's offline ``.pt``: input_ids, hidden_states (post-norm last), aux_hidden_states (T, 3H), loss_mask."""
    return {"input_ids": row.input_ids.long(), "hidden_states": row.final.contiguous(),
            "aux_hidden_states": torch.cat(row.aux, dim=-1).contiguous(), "loss_mask": row.loss_mask.long()}


def specforge_sample(row: Row) -> dict[str, torch.Tensor]:
    """SpecForge's offline ``.ckpt``: input_ids / loss_mask (T,) (its reader slices ``[:max_len][None]``),
    hidden_state (1, T, H), aux_hidden_state (1, T, 3H) (squeezed by its reader)."""
    return {"input_ids": row.input_ids.long(), "loss_mask": row.loss_mask.long(),
            "hidden_state": row.final[None].contiguous(),
            "aux_hidden_state": torch.cat(row.aux, dim=-1)[None].contiguous()}


# ---------------------------------------------------------------- writers (one folder per peer)

def write_speculators(rows: Sequence[Row], out: str | Path, norm_weight: torch.Tensor, eps: float,
                      dtype: torch.dtype = torch.float32) -> Path:
    """What ``speculators train --data-path out`` reads: a datasets folder (``input_ids``, ``loss_mask``,
    ``seq_len``; torch format, as its ``prepare-data`` saves it) and ``out/hidden_states/hs_{i}.safetensors``."""
    from datasets import Dataset

    out = Path(out)
    (out / "hidden_states").mkdir(parents=True, exist_ok=True)
    cols: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for i, row in enumerate(rows):
        cols["input_ids"].append(row.input_ids.tolist())
        cols["loss_mask"].append(row.loss_mask.tolist())
        cols["seq_len"].append(len(row.input_ids))
        s = speculators_sample(row, norm_weight, eps)
        save_file({"token_ids": s["token_ids"], "hidden_states": s["hidden_states"].to(dtype)},
                  str(out / "hidden_states" / f"hs_{i}.safetensors"))
    ds = Dataset.from_dict(cols)
    ds.set_format(type="torch")
    ds.save_to_disk(str(out))
    return out


def write_vocab_npy(d2t: torch.Tensor, t2d: torch.Tensor, out: str | Path) -> tuple[Path, Path]:
    """``d2t-{Vd}.npy`` / ``t2d-{Vd}.npy`` (speculators' ``--d2t-path`` / ``--t2d-path``)."""
    import numpy as np

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / f"d2t-{d2t.numel()}.npy", out / f"t2d-{d2t.numel()}.npy"
    np.save(paths[0], d2t.long().numpy())
    np.save(paths[1], t2d.bool().numpy())
    return paths


def write_modelopt(rows: Sequence[Row], out: str | Path) -> Path:
    """``out/sample_{i:06d}.pt`` per row (ModelOpt's offline reader loads ``.pt`` files with torch.load)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for i, row in enumerate(rows):
        torch.save(modelopt_sample(row), out / f"sample_{i:06d}.pt")
    return out


def write_specforge(rows: Sequence[Row], out: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """``out/data_{i}.ckpt`` per row, what SpecForge's offline capture writes."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for i, row in enumerate(rows):
        s = specforge_sample(row)
        s["hidden_state"], s["aux_hidden_state"] = s["hidden_state"].to(dtype), s["aux_hidden_state"].to(dtype)
        torch.save(s, out / f"data_{i}.ckpt")
    return out


def draft_vocab_mapping(dataset: str | Path, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft vocabulary headway trains with (its ``draft_vocab`` over the dataset's token counts),
    given to every peer so all drafters predict over the same ids: d2t (Vd,) int64 offsets (draft id i
    is target id i + d2t[i]) and t2d (V,) bool."""
    from headway.data.vocab import draft_vocab, load_token_counts

    _, d2t, t2d = draft_vocab(load_token_counts(dataset), draft_vocab_size)
    return d2t, t2d
