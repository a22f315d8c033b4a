"""Batches: padding variable-length rows, and the one target forward every head kind trains on.

``target_batch`` is shared by online training, evaluation and (through ``headway features``)
offline feature extraction, so what a drafter sees never depends on the route. Offline
(``headway train features=DIR``) the DataLoader pads stored rows (``collate_features``) and
``stored_batch`` builds the same ``TargetBatch`` from them: the target's decoder never runs,
only its lm_head on the stored ``final`` state when logits are needed.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from ..data.feature_format import TOPK_INDICES, TOPK_KEYS, TOPK_VALUES


@dataclass
class TargetBatch:
    """What the target gives each step (all tensors on the target's device)."""

    input_ids: Tensor  # (B, T) long, right-padded
    attention_mask: Tensor  # (B, T) long, 1 on real tokens
    loss_mask: Tensor  # (B, T) long, 1 on target-written tokens, 0 on prompt and padding
    hidden: dict[int, Tensor]  # HF hidden_states index -> (B, T, H); -1 = final post-norm
    logits: Tensor | None = None  # (B, T, V), when the task needs them; (B, T, R) when only logit_rows were projected
    ref_logits: Tensor | None = None  # (B, T, V) of the unadapted target (adapter disabled), Medusa-2 only
    logit_rows: Tensor | None = None  # (R,) target ids of logits' last dim; None = the whole vocabulary
    top: Tensor | None = None  # (B, T) the target's argmax (target ids) where logits are read, when projected apart


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


def stored_keys(layers: Sequence[int], need_logits: bool, topk: bool = False) -> list[str]:
    """The stored keys a task reads: its layers, plus ``final`` for the lm_head when it needs logits
    (with ``topk``, the stored top-k logits instead: ``eagle.soft_labels=stored_topk``)."""
    keys = [feature_key(i) for i in layers]
    if need_logits and topk:
        return keys + list(TOPK_KEYS)
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


class StoredLogits:
    """The target's lm_head on stored post-norm ``final`` states, in float32 outside any autocast
    (the logits the online forward computes), reduced to what a loss reads.

    ``rows`` (R,) target ids: project onto only these vocabulary rows (EAGLE-3's draft vocabulary,
    in draft order); None = all V. ``top``: also return the target's argmax -- ``"logits"`` from
    the full projection (exact; with ``rows``, computed in chunks so no (N, V) tensor is kept),
    ``"data"`` the data's next token (the data is the target's own greedy output, where the two
    agree: the full-vocabulary projection, most of the cost with a small draft vocabulary, is
    skipped), or None. The float32 weight is made once (no copy for a float32 target).

    ``soft="stored_topk"``: where a batch stores the target's top-k logits (``headway features
    --topk_logits``), ``from_topk`` spreads them over ``rows`` instead of projecting ``final``: the
    distribution renormalised over those k tokens, the argmax their first; ``exact()`` prefers
    ``final`` again wherever a batch has it (evaluation)."""

    def __init__(self, lm_head: nn.Module, rows: Tensor | None = None, top: str | None = None,
                 chunk: int = 512, soft: str = "lm_head") -> None:
        if top not in (None, "logits", "data"):
            raise ValueError(f"top must be None, 'logits' or 'data', not {top!r}")
        self.soft = soft
        self.dtype = lm_head.weight.dtype  # the target's: stored states are cast to it, as online
        self.weight = lm_head.weight.detach().float()  # (V, H)
        bias = getattr(lm_head, "bias", None)
        self.bias = bias.detach().float() if bias is not None else None
        if rows is not None and torch.equal(rows.cpu(), torch.arange(self.weight.shape[0])):
            rows = None  # every row, in order: the plain projection
        self.rows = rows.to(self.weight.device) if rows is not None else None
        self.top, self.chunk = top, chunk
        self.transform: Callable[[Tensor], Tensor] | None = None  # the target's own (``logit_transform``)
        if self.rows is not None and top != "logits":  # only these rows are ever projected
            self.part = self.weight[self.rows]  # (R, H)
            self.part_bias = self.bias[self.rows] if self.bias is not None else None
        # from_topk: each target id's column (``width``, a spare one, for ids outside ``rows``)
        self.width = width = self.weight.shape[0] if self.rows is None else self.rows.numel()
        self.column = torch.full((self.weight.shape[0],), width, dtype=torch.long, device=self.weight.device)  # (V,)
        self.column[self.rows if self.rows is not None else slice(None)] = torch.arange(width,
                                                                                         device=self.weight.device)

    def exact(self) -> "StoredLogits":
        """The same projection with the argmax from the logits, and from ``final`` where a batch has it
        (evaluation measures against the target)."""
        if self.top != "data" and self.soft == "lm_head":
            return self
        out = copy.copy(self)  # shares the weights
        out.top = "logits" if self.top == "data" else self.top
        out.soft = "lm_head"
        return out

    def reads_topk(self, feats: dict[str, Tensor]) -> bool:
        """Whether a batch's logits come from its stored top-k: asked for (or no ``final`` to project)."""
        return TOPK_VALUES in feats and (self.soft == "stored_topk" or "final" not in feats)

    def from_topk(self, values: Tensor, indices: Tensor, next_ids: Tensor | None = None
                  ) -> tuple[Tensor, Tensor | None]:
        """values (N, k) raw lm_head logits, largest first, and their token ids (N, k) -> (logits (N, V or
        R) float32: the k values (through the target's transform) at their columns, the float32 minimum
        at every other one, so a softmax is the target's distribution renormalised over the top k (and
        on ``rows``); the argmax (N,): the first index, or the data's next token for ``top="data"``)."""
        with torch.autocast(values.device.type, enabled=False), torch.no_grad():
            v = values.to(self.weight.device, torch.float32)  # (N, k)
            ids = indices.to(self.weight.device, torch.long)  # (N, k)
            if self.transform is not None:  # monotonic: the order stands
                v = self.transform(v)
            logits = v.new_full((v.shape[0], self.width + 1), torch.finfo(torch.float32).min)  # (N, V or R, + spare)
            logits.scatter_(1, self.column[ids], v)
            top = ids[:, 0] if self.top == "logits" else None
            if self.top == "data":
                if next_ids is None:
                    raise ValueError("top='data' needs the data's next tokens")
                top = next_ids.to(logits.device)
            return logits[:, :self.width], top

    def __call__(self, final: Tensor, next_ids: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """final (N, H), next_ids (N,) the data's token after each state -> (logits (N, V or R)
        float32, the target's argmax (N,) in target ids or None)."""
        with torch.autocast(final.device.type, enabled=False), torch.no_grad():
            x = final.to(self.weight.device, torch.float32)
            if self.rows is None:
                logits = nn.functional.linear(x, self.weight, self.bias)  # (N, V)
                top = logits.argmax(-1) if self.top == "logits" else None
            elif self.top == "logits":  # the argmax needs every row, the loss only `rows`
                parts, tops = [], []
                for c in x.split(self.chunk):
                    full = nn.functional.linear(c, self.weight, self.bias)  # (chunk, V)
                    tops.append(full.argmax(-1))
                    parts.append(full.index_select(-1, self.rows))
                logits = torch.cat(parts) if parts else x.new_zeros(0, self.rows.numel())
                top = torch.cat(tops) if tops else torch.zeros(0, dtype=torch.long, device=x.device)
            else:
                logits = nn.functional.linear(x, self.part, self.part_bias)  # (N, R)
                top = None
            if self.transform is not None:  # monotonic: the argmax above stands
                logits = self.transform(logits)
            if self.top == "data":
                if next_ids is None:
                    raise ValueError("top='data' needs the data's next tokens")
                top = next_ids.to(logits.device)
            return logits, top


def logit_transform(config: Any) -> Callable[[Tensor], Tensor] | None:
    """What the target's forward does to its lm_head output, as a function of the logits (None:
    nothing): Gemma 2/3's final soft-cap ``cap * tanh(x / cap)``, Cohere's ``logit_scale`` and
    Granite's ``logits_scaling``. Each is monotonic, so the argmax is the lm_head's either way; the
    soft labels are not. A config with more than one is refused: no known model applies two."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    cap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(config, "logit_scale", None)
    divide = getattr(config, "logits_scaling", None)
    given = [(n, v) for n, v in (("final_logit_softcapping", cap), ("logit_scale", scale), ("logits_scaling", divide))
             if v not in (None, 0, 1, 0.0, 1.0)]
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"the target's forward applies {' and '.join(f'{n}={v}' for n, v in given)} to its logits; "
                         "offline training reproduces one such transform, not several: train online (drop features=)")
    name, value = given[0]
    v = float(value)
    if name == "final_logit_softcapping":
        return lambda x: torch.tanh(x / v) * v
    if name == "logit_scale":
        return lambda x: x * v
    return lambda x: x / v


def lm_head_logits(lm_head: nn.Module) -> StoredLogits:
    """Every vocabulary row, no separate argmax: the online forward's logits."""
    return StoredLogits(lm_head)


def shift_mask(loss_mask: Tensor) -> Tensor:
    """(B, T) -> bool (B, T): position s is followed by an answer token (loss_mask[s+1] == 1)."""
    used = torch.zeros(loss_mask.shape, dtype=torch.bool, device=loss_mask.device)
    used[:, :-1] = loss_mask[:, 1:].bool()
    return used


def stored_batch(batch: dict[str, Any], layers: Sequence[int], logits_fn: StoredLogits | None,
                 device: torch.device, dtype: torch.dtype) -> TargetBatch:
    """A ``collate_features`` batch -> the ``TargetBatch`` ``target_batch`` gives online: hidden
    states in the target's dtype on ``device``, logits from ``logits_fn`` on ``final`` where they are
    read (zeros elsewhere: see the comment below), over its rows, with its argmax when it gives one."""
    feats = batch["features"]  # key -> (B, T, H), stored dtype
    hidden = {i: feats[feature_key(i)].to(device=device, dtype=dtype) for i in layers}  # each (B, T, H)
    logits = top = None
    if logits_fn is not None:
        # Every loss and metric reads the target's logits at s only where token s+1 is an answer
        # token (loss_mask 1): it predicts that token. Project just those positions (about half
        # of a padded chat batch) and leave zeros, which nothing reads, elsewhere.
        used = shift_mask(batch["loss_mask"]).to(device)  # (B, T) bool
        ids = batch["input_ids"].to(device)
        next_ids = torch.zeros_like(ids)
        next_ids[:, :-1] = ids[:, 1:]  # (B, T) x_{s+1}
        if logits_fn.reads_topk(feats):  # the stored top-k: no projection at all
            values, indices = (feats[k].to(device)[used] for k in (TOPK_VALUES, TOPK_INDICES))  # (N, k) each
            rows, row_top = logits_fn.from_topk(values, indices, next_ids[used])
        else:
            rows, row_top = logits_fn(feats["final"].to(device)[used], next_ids[used])  # (N, V or R), (N,) | None
        logits = rows.new_zeros(*used.shape, rows.shape[-1])  # (B, T, V or R)
        logits[used] = rows
        if row_top is not None:
            top = torch.zeros(used.shape, dtype=torch.long, device=rows.device)
            top[used] = row_top
    return TargetBatch(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                       loss_mask=batch["loss_mask"].to(device), hidden=hidden, logits=logits,
                       logit_rows=logits_fn.rows if logits_fn is not None else None, top=top)
