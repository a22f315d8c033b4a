"""Batches: padding variable-length rows, and the one target forward every head kind trains on.

``target_batch`` is shared by online training, evaluation and (through ``headway features``)
offline feature extraction, so what a drafter sees never depends on the route. Offline
(``headway train features=DIR``) the DataLoader pads stored rows (``collate_features``) and
``stored_batch`` builds the same ``TargetBatch`` from them: the target's decoder never runs,
only its lm_head on the stored ``final`` state when logits are needed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence


@dataclass
class TargetBatch:
    """What the target gives each step (all tensors on the target's device)."""

    input_ids: Tensor  # (B, T) long, right-padded
    attention_mask: Tensor  # (B, T) long, 1 on real tokens
    loss_mask: Tensor  # (B, T) long, 1 on target-written tokens, 0 on prompt and padding
    hidden: dict[int, Tensor]  # HF hidden_states index -> (B, T, H); -1 = final post-norm
    logits: Tensor | None = None  # (B, T, V), when the task needs them
    ref_logits: Tensor | None = None  # (B, T, V) of the unadapted target (adapter disabled), Medusa-2 only


def collate(rows: Sequence[dict[str, Any]], pad_id: int = 0, max_length: int | None = None) -> dict[str, Tensor]:
    """Rows with ``input_ids`` / ``loss_mask`` lists -> right-padded (B, T) long tensors."""
    ids = [list(r["input_ids"])[:max_length] for r in rows]
    masks = [list(r["loss_mask"])[:max_length] for r in rows]
    T = max(len(x) for x in ids)
    out = {"input_ids": torch.full((len(rows), T), pad_id, dtype=torch.long),
           "attention_mask": torch.zeros(len(rows), T, dtype=torch.long),
           "loss_mask": torch.zeros(len(rows), T, dtype=torch.long)}
    for i, (x, m) in enumerate(zip(ids, masks)):
        if len(m) != len(x):
            raise ValueError(f"row {i}: input_ids has {len(x)} tokens but loss_mask has {len(m)}")
        out["input_ids"][i, : len(x)] = torch.tensor(x, dtype=torch.long)
        out["attention_mask"][i, : len(x)] = 1
        out["loss_mask"][i, : len(x)] = torch.tensor(m, dtype=torch.long)
    return out


def _forward(target: nn.Module, input_ids: Tensor, attention_mask: Tensor, need_logits: bool) -> Any:
    kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask,
                              "output_hidden_states": True, "use_cache": False}
    if not need_logits:
        kwargs["logits_to_keep"] = 1  # skip the (B, T, V) projection nobody reads
    return target(**kwargs)


def target_batch(target: nn.Module, batch: dict[str, Tensor], layers: Sequence[int], need_logits: bool,
                 need_ref: bool = False, grad: bool = False) -> TargetBatch:
    """Run the target once on a collated batch.

    ``layers`` are HF ``hidden_states`` indices (-1 = final post-norm state). ``grad`` keeps the
    graph (Medusa-2, where the target's LoRA trains); ``need_ref`` adds the logits of the same
    model with its PEFT adapter disabled, without grad. Without grad or logits the hidden states
    come from ``headway.data.features.target_features``, the forward ``headway features`` stores,
    so online and offline training see the same features (tests/test_train_batch.py checks the
    two routes agree).
    """
    device = next(target.parameters()).device
    ids = batch["input_ids"].to(device)  # (B, T)
    attn = batch["attention_mask"].to(device)
    logits = None
    if grad or need_logits:
        with contextlib.nullcontext() if grad else torch.no_grad():
            out = _forward(target, ids, attn, need_logits)
        hs = out.hidden_states  # L + 1 tensors of (B, T, H)
        hidden = {i: hs[i] for i in layers}
        logits = out.logits if need_logits else None
    else:  # the same forward `headway features` stores (no lm_head); clone out of inference mode
        from ..data.features import layer_key, target_features

        specs = {i: "final" if i == -1 else i for i in layers}
        feats = target_features(target, ids, attn, list(specs.values()))
        hidden = {i: feats[layer_key(spec)].clone() for i, spec in specs.items()}
    ref = None
    if need_ref:
        with torch.no_grad(), target.disable_adapter():
            ref = _forward(target, ids, attn, True).logits
    return TargetBatch(input_ids=ids, attention_mask=attn, loss_mask=batch["loss_mask"].to(device),
                       hidden=hidden, logits=logits, ref_logits=ref)


# -- offline: stored features ----------------------------------------------------------------
def feature_key(layer: int) -> str:
    """HF hidden-state index -> the key ``headway features`` stores it under (-1 = ``final``)."""
    return "final" if layer == -1 else f"hidden_states.{int(layer)}"


def stored_keys(layers: Sequence[int], need_logits: bool) -> list[str]:
    """The stored keys a task reads: its layers, plus ``final`` for the lm_head when it needs logits."""
    keys = [feature_key(i) for i in layers]
    return keys + ["final"] if need_logits and "final" not in keys else keys


def collate_features(rows: Sequence[dict[str, Any]], pad_id: int = 0, max_length: int | None = None) -> dict[str, Any]:
    """``FeatureStore.row`` dicts -> right-padded tensors as ``collate`` gives, plus
    ``features``: {key: (B, T, H)} zero-padded (runs in the DataLoader)."""
    ids = [r["input_ids"][:max_length] for r in rows]  # each (T_i,)
    lengths = torch.tensor([len(x) for x in ids])  # (B,)
    T = int(lengths.max())
    return {"input_ids": pad_sequence(ids, batch_first=True, padding_value=pad_id).long(),  # (B, T)
            "attention_mask": (torch.arange(T)[None] < lengths[:, None]).long(),  # (B, T)
            "loss_mask": pad_sequence([r["loss_mask"][:max_length] for r in rows], batch_first=True).long(),
            "features": {k: pad_sequence([r["features"][k][:max_length] for r in rows], batch_first=True)
                         for k in rows[0]["features"]}}  # each (B, T, H)


def lm_head_logits(lm_head: nn.Module) -> Callable[[Tensor], Tensor]:
    """The target's output projection as a float32 function (..., H) -> (..., V), outside any
    autocast: the logits the online forward computes, from the stored post-norm ``final`` state.
    The float32 weight is made once (no copy for a float32 target)."""
    weight = lm_head.weight.detach().float()  # (V, H)
    bias = lm_head.bias.detach().float() if getattr(lm_head, "bias", None) is not None else None

    def logits(final: Tensor) -> Tensor:
        with torch.autocast(final.device.type, enabled=False), torch.no_grad():
            return nn.functional.linear(final.to(weight.device, torch.float32), weight, bias)  # (B, T, V)

    return logits


def shift_mask(loss_mask: Tensor) -> Tensor:
    """(B, T) -> bool (B, T): position s is followed by an answer token (loss_mask[s+1] == 1)."""
    used = torch.zeros(loss_mask.shape, dtype=torch.bool, device=loss_mask.device)
    used[:, :-1] = loss_mask[:, 1:].bool()
    return used


def stored_batch(batch: dict[str, Any], layers: Sequence[int], logits_fn: Callable[[Tensor], Tensor] | None,
                 device: torch.device, dtype: torch.dtype) -> TargetBatch:
    """A ``collate_features`` batch -> the ``TargetBatch`` ``target_batch`` gives online: hidden
    states in the target's dtype on ``device``, logits from ``logits_fn`` on ``final`` where they are
    read (zeros elsewhere: see the comment below)."""
    feats = batch["features"]  # key -> (B, T, H), stored dtype
    hidden = {i: feats[feature_key(i)].to(device=device, dtype=dtype) for i in layers}  # each (B, T, H)
    logits = None
    if logits_fn is not None:
        # Every loss and metric reads the target's logits at s only where token s+1 is an answer
        # token (loss_mask 1): it predicts that token. Project just those positions (about half
        # of a padded chat batch) and leave zeros, which nothing reads, elsewhere.
        used = shift_mask(batch["loss_mask"]).to(device)  # (B, T) bool
        final = feats["final"].to(device)
        rows = logits_fn(final[used])  # (N, V) float32
        logits = rows.new_zeros(*used.shape, rows.shape[-1])  # (B, T, V)
        logits[used] = rows
    return TargetBatch(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                       loss_mask=batch["loss_mask"].to(device), hidden=hidden, logits=logits)
