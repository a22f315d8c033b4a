"""EAGLE-1 / EAGLE-3 training tasks for the one loop (the ``Task`` interface of tasks.py).

The losses and the acceptance metric are the pure functions of ``ttt.py``; this file only
wires them to a ``TargetBatch``: which target layers to read, the draft vocabulary, the
EAGLE-1 input noise, and evaluation sums. Online and offline training feed the same
``TargetBatch`` fields (``hidden`` at ``feature_layers`` plus ``logits``), so a task never
knows which route its batch came by.
"""

from __future__ import annotations

from pathlib import Path
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..heads import Eagle1Drafter, Eagle3Drafter, HeadsBase
from .batch import StoredLogits, collate_features, lm_head_logits, stored_batch, stored_keys
from .calibration import eagle_calibration_sums, summarize_calibration, teacher_forced_sums
from .config import TrainConfig
from .draft_vocab import answer_draft_vocab, draft_vocab_counts
from .errors import TrainError
from .metrics import draft_vocab_stats
from .objectives import Terms
from .tasks import ParamGroup, TargetBatch
from .ttt import (acceptance_stats, chain_accepted, decoder_step_starts, eagle1_loss, eagle3_ttt_loss, noise_seed,
                  shift_left, summarize_acceptance)

EVAL_DEPTH = 5  # drafted tokens per simulated chain; the same depth as Medusa's default 5 heads


def eval_sums(drafter: nn.Module, tb: TargetBatch, hidden: Tensor, depth: int) -> dict[str, Tensor]:
    """Fixed-shape sums for the loop to add over batches and processes.

    ``accept_hist``: the simulated chain against the data's tokens (as Medusa's chain metric;
    on sampled data, acceptance at the distillation temperature); ``accept_hist_greedy``:
    against the target's argmax (greedy decoding); ``top1_hits[j]``: chain starts where step j,
    fed the data's tokens and the drafter's own features as in training, predicts the data's token;
    ``calib_*``: the same steps' calibration sums (``train/calibration.py``), depth j+1 = step j;
    ``accept_hist_decode``: the greedy chains where a decoder's steps start (``decoder_step_starts``)."""
    data_next = shift_left(tb.input_ids, 1)  # (B, T) x_{s+1}
    accepted, start = chain_accepted(drafter, tb.input_ids, hidden, data_next, tb.loss_mask, depth)
    top = tb.top if tb.top is not None else tb.logits.argmax(-1)  # (B, T) the target's argmax
    greedy, _ = chain_accepted(drafter, tb.input_ids, hidden, top, tb.loss_mask, depth)
    hits, calib = teacher_forced_sums(drafter, tb.input_ids, hidden, start, depth)
    steps = decoder_step_starts(greedy, start, tb.loss_mask)
    return {"accept_hist": acceptance_stats(accepted, start, depth)["accept_hist"],
            "accept_hist_greedy": acceptance_stats(greedy, start, depth)["accept_hist"],
            "accept_hist_decode": acceptance_stats(greedy, steps, depth)["accept_hist"],
            "top1_hits": hits, "starts": start.sum().float().reshape(1), **calib}


def summarize(stats: dict[str, Tensor]) -> dict[str, Any]:
    """Summed eval stats -> tau (1 + mean accepted, bonus token included) against the data and
    against the target's greedy choice, acceptance by depth, top-1 per step, and calibration
    by depth (``summarize_calibration``) when its sums are there."""
    out = summarize_acceptance(stats)
    greedy = summarize_acceptance({"accept_hist": stats["accept_hist_greedy"]})
    n = float(stats["starts"].sum().clamp(min=1))
    for k in ("tau", "mean_accepted"):
        if k in out:
            out[k] = round(out[k], 4)
    out["accept_rate_by_depth"] = [round(x, 4) for x in out["accept_rate_by_depth"]]
    out["tau_by_depth"] = [round(x, 4) for x in out.get("tau_by_depth", [])]
    out["accept_hist"] = [int(x) for x in stats["accept_hist"]]
    out["top1"] = [round(float(x) / n, 4) for x in stats["top1_hits"]]
    out["tau_greedy"] = round(greedy["tau"], 4)
    out["accept_rate_by_depth_greedy"] = [round(x, 4) for x in greedy["accept_rate_by_depth"]]
    if "accept_hist_decode" in stats:  # what a greedy chain decoder measures: only where its steps start
        decode = summarize_acceptance({"accept_hist": stats["accept_hist_decode"]})
        out["tau_decode"] = round(decode["tau"], 4)
        out["accept_rate_by_depth_decode"] = [round(x, 4) for x in decode.get("accept_rate_by_depth", [])]
        out["decode_steps"] = decode["positions"]
    if "calib_count" in stats:
        out["calibration"] = summarize_calibration(stats)
    return out


def init_lm_head(heads: Eagle3Drafter, target: nn.Module, train: bool = True) -> None:
    """Start the draft lm_head as the target's own output rows for the draft vocabulary; with
    ``train=False`` it stays there (``requires_grad`` off: no optimiser group holds it).

    A random head must learn the token geometry from the answers alone; on the demo data
    (59k answer tokens) this init raised simulated tau from 1.42 to 1.45 after the same
    145 steps (and 1.30 -> 1.35 after 58). Frozen, the drafter must write into the target's own
    output space: on SmolLM2 at 1,536 answers that raised held-out tau by ~0.05 (docs/training.md)."""
    W = target.get_output_embeddings().weight  # (V, H)
    ids = heads.to_target_ids(torch.arange(heads.config.draft_vocab_size, device=heads.d2t.device))
    with torch.no_grad():
        heads.lm_head.weight.copy_(W[ids.to(W.device)].to(heads.lm_head.weight))
    heads.lm_head.weight.requires_grad_(train)


def lm_head_note(train: bool) -> str:
    """The card's ``draft_vocab.lm_head_init``."""
    return "target lm_head rows" + ("" if train else " (frozen)")


def target_layer_modules(target: nn.Module, layer: int, names: Sequence[str],
                         option: str) -> tuple[dict[str, nn.Module], int]:
    """The submodules ``names`` (Llama-style: ``self_attn.q_proj``, ``mlp.gate_proj``, ...) of the
    target's decoder layer ``layer`` (0-based, negative from the end) and the layer's index; a layer
    out of range or other module names are refused naming ``option``."""
    layers = getattr(target.get_decoder(), "layers", None)
    if layers is None or not -len(layers) <= layer < len(layers):
        n = "no" if layers is None else len(layers)
        raise ValueError(f"{option}={layer}: the target has {n} decoder layers")
    src = layers[layer]
    try:
        return {n: src.get_submodule(n) for n in names}, layer % len(layers)
    except AttributeError as e:
        raise ValueError(f"{option}: the target's layer {layer} ({type(src).__name__}) lacks Llama-style "
                         f"modules: {e}") from None


def refuse_other_shapes(pairs: Iterable[tuple[Sequence[int], Sequence[int], str]], option: str) -> None:
    """(target shape, drafter shape, name) triples: every one must agree, checked before any copy so
    that a refusal leaves the drafter as it was."""
    for theirs, ours, n in pairs:
        if tuple(theirs) != tuple(ours):
            raise ValueError(f"{option}: {n} is {tuple(theirs)} in the target and {tuple(ours)} in the drafter")


def pass_deepest_feature_through(heads: nn.Module, target: nn.Module) -> None:
    """``fc`` picks the deepest fused feature (the last H columns) and ``norm`` is the target's
    final norm: with a copied target layer, the drafter starts where that layer's stream is."""
    H = heads.config.hidden_size
    heads.fc.weight.zero_()
    heads.fc.weight[:, -H:].copy_(torch.eye(H))
    norm = getattr(target.get_decoder(), "norm", None)
    if norm is not None and getattr(norm, "weight", None) is not None:
        heads.norm.weight.copy_(norm.weight)


def init_from_target_layer(heads: Eagle3Drafter, target: nn.Module, layer: int) -> dict[str, Any]:
    """Start EAGLE-3's decoder layer as a copy of the target's decoder layer ``layer`` (0-based),
    ``fc`` as the pick of the deepest fused feature, and ``norm`` as the target's final norm.

    The attention projections read ``cat(embed, hidden)``; both halves get the target layer's
    weights, so at the start the layer sees roughly ``embed + hidden`` as the target layer sees
    its residual stream. Needs Llama-style module names (``self_attn.q_proj``, ``mlp.gate_proj``,
    ``input_layernorm``, ...); anything else is refused by name. Biases (Qwen2's q/k/v) are not
    copied: the drafter's layer has none."""
    dst = heads.midlayer
    names = {"self_attn.o_proj": dst.self_attn.o_proj, "mlp.gate_proj": dst.mlp.gate_proj,
             "mlp.up_proj": dst.mlp.up_proj, "mlp.down_proj": dst.mlp.down_proj,
             "post_attention_layernorm": dst.post_attention_layernorm, "input_layernorm": dst.input_layernorm}
    qkv = ("q_proj", "k_proj", "v_proj")
    found, index = target_layer_modules(target, layer, [*names, *(f"self_attn.{n}" for n in qkv)], "eagle.init_layer")
    pairs = [(found[n].weight.shape, mod.weight.shape, n) for n, mod in names.items()]
    pairs += [((w.shape[0], 2 * w.shape[1]), getattr(dst.self_attn, n).weight.shape, f"self_attn.{n} (2 halves)")
              for n in qkv for w in [found[f"self_attn.{n}"].weight]]  # q/k/v: each half is the target's
    refuse_other_shapes(pairs, "eagle.init_layer")
    with torch.no_grad():
        for n, mod in names.items():
            mod.weight.copy_(found[n].weight)
        dst.hidden_norm.weight.copy_(found["input_layernorm"].weight)
        for n in qkv:
            w = found[f"self_attn.{n}"].weight  # (out, H)
            getattr(dst.self_attn, n).weight.copy_(torch.cat([w, w], dim=1))  # (out, 2H): embed | hidden halves
        pass_deepest_feature_through(heads, target)
    return {"layer": index, "fc": f"identity on aux layer {heads.feature_layers[-1]}"}


class _EagleTask:
    """What EAGLE-1 and EAGLE-3 share: frozen target, one param group, logits needed, chain eval."""

    kind: str
    eval_depth = EVAL_DEPTH

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.opts = cfg.eagle

    def adapt_target(self, target: nn.Module) -> nn.Module:
        return target

    def feature_layers(self, heads: HeadsBase) -> list[int]:
        return list(heads.feature_layers)

    def needs_logits(self) -> bool:
        return True

    def param_groups(self, heads: HeadsBase, target: nn.Module) -> list[ParamGroup]:
        return [ParamGroup("heads", [p for p in heads.parameters() if p.requires_grad], self.cfg.optim.head_lr_mult)]

    def hidden(self, heads: HeadsBase, tb: TargetBatch) -> Tensor:
        return heads.fuse([tb.hidden[i] for i in heads.feature_layers])  # (B, T, H)

    def eval_stats(self, heads: HeadsBase, tb: TargetBatch) -> dict[str, Tensor]:
        return eval_sums(heads, tb, self.hidden(heads, tb), self.eval_depth)

    @staticmethod
    def calibration_sums(heads: HeadsBase, tb: TargetBatch, depth: int) -> dict[str, Tensor]:
        """The ``calib_*`` sums of ``eval_stats`` alone (``calibrate.fit_calibration``)."""
        return eagle_calibration_sums(heads, tb, heads.fuse([tb.hidden[i] for i in heads.feature_layers]), depth)

    @staticmethod
    def with_vocab_stats(stats: dict[str, Tensor], heads: HeadsBase, tb: TargetBatch) -> dict[str, Tensor]:
        """``stats`` plus the held-out answer tokens a reduced draft vocabulary can express."""
        if getattr(heads, "has_draft_vocab", False):
            stats.update(draft_vocab_stats(heads.t2d, tb.input_ids, tb.loss_mask))
        return stats

    def summarize(self, stats: dict[str, Tensor]) -> dict[str, Any]:
        """The chain summary; with a reduced draft vocabulary, also the share of held-out answer
        tokens it can express (a ceiling on top-1)."""
        out = summarize({k: v for k, v in stats.items() if not k.startswith("vocab_")})
        if "vocab_in" in stats:
            share = stats["vocab_in"].sum() / stats["vocab_tokens"].sum().clamp(min=1)
            out["draft_vocab_coverage"] = round(float(share), 4)
        return out

    def save(self, heads: HeadsBase, target: nn.Module, out_dir: Path) -> None:
        heads.save_pretrained(out_dir)

    def check_data(self) -> None:
        if self.opts.argmax_from == "data":
            check_greedy_data(self.cfg.data)

    def logit_rows(self, heads: HeadsBase) -> Tensor | None:
        """The target ids the loss reads logits of: the draft vocabulary's, in draft order (None: all)."""
        return heads.draft_token_ids() if heads.has_draft_vocab else None

    def stored_logits(self, heads: HeadsBase, lm_head: nn.Module) -> StoredLogits:
        """Offline, project only the rows the loss reads, with the argmax as ``eagle.argmax_from`` says, or
        (``soft_labels: stored_topk``) spread the stored top-k logits over them."""
        return StoredLogits(lm_head, rows=self.logit_rows(heads), top=self.opts.argmax_from, soft=self.opts.soft_labels)

    def targets(self, heads: HeadsBase, tb: TargetBatch) -> tuple[Tensor, Tensor]:
        """(the target's logits over ``logit_rows`` (B, T, R), its argmax (B, T) in target ids), from
        either route: the reduced stored projection as it is, the online full logits cut down."""
        if tb.logit_rows is not None or tb.top is not None:
            assert tb.top is not None, "a reduced projection comes with its argmax (stored_logits)"
            return tb.logits, tb.top
        top = shift_left(tb.input_ids, 1) if self.opts.argmax_from == "data" else tb.logits.argmax(-1)
        rows = self.logit_rows(heads)
        return (tb.logits if rows is None else tb.logits[..., rows]), top


class Eagle1Task(_EagleTask):
    """EAGLE-1: SmoothL1 on the next feature + 0.1 soft CE, uniform noise on the input features."""

    kind = "eagle1"

    def build(self, target: nn.Module) -> HeadsBase:
        """With ``eagle.draft_vocab_size`` the checkpoint also carries d2t / t2d for the most frequent
        answer tokens: decoding then projects onto only those rows of the target's lm_head. The loss
        (full-vocabulary soft CE) does not change; evaluation measures the reduced drafter."""
        V = int(target.get_output_embeddings().weight.shape[0])
        ids, info = answer_draft_vocab(self.cfg, V, self.opts.draft_vocab_size)
        heads = Eagle1Drafter.for_target(target, fc_bias=self.opts.fc_bias, draft_vocab=ids)
        if ids is not None:
            heads.metadata["draft_vocab"] = info | {"lm_head": "rows of the target's lm_head (decoding only)"}
        self.check_data()
        return heads

    def loss(self, heads: HeadsBase, tb: TargetBatch, step: int) -> tuple[Tensor, dict[str, Tensor]]:
        f = tb.hidden[-1]  # (B, T, H) final post-norm state
        g = torch.Generator(device=f.device).manual_seed(noise_seed(self.cfg.seed, step, tb.input_ids))
        u = torch.rand(f.shape, generator=g, device=f.device, dtype=torch.float32)
        noise = (u - 0.5) * self.opts.noise  # U(-noise/2, noise/2); the paper's U(-0.1, 0.1) at noise=0.2
        logits, top = self.targets(heads, tb)
        return eagle1_loss(heads, tb.input_ids, f, logits, tb.loss_mask, noise=noise,
                           feature_weight=self.opts.feature_weight, ce_weight=self.opts.ce_weight, target_top=top)


class Eagle3Task(_EagleTask):
    """EAGLE-3: three fused target layers, reduced draft vocabulary, training-time test."""

    kind = "eagle3"

    def build(self, target: nn.Module) -> HeadsBase:
        V = int(target.get_output_embeddings().weight.shape[0])
        n = self.opts.draft_vocab_size or V
        heads = Eagle3Drafter.for_target(target, draft_vocab_size=n, aux_layers=list(self.opts.aux_layers) or None,
                                         norm_output=self.opts.norm_output, norm_before_fc=self.opts.norm_before_fc,
                                         norm_before_residual=self.opts.norm_before_residual)
        info: dict[str, Any] = {"size": n, "target_vocab_size": V}
        if n < V:
            from ..data.vocab import draft_vocab

            counts = draft_vocab_counts(self.cfg.data, V)
            ids, _, _ = draft_vocab(counts, n)
            heads.set_draft_vocab(ids.to(heads.d2t.device))
            info["answer_token_coverage"] = round(float(counts[ids].sum()) / max(1, int(counts.sum())), 4)
        init_lm_head(heads, target, train=self.opts.train_lm_head)
        info["lm_head_init"] = lm_head_note(self.opts.train_lm_head)
        heads.metadata["draft_vocab"] = info
        if self.opts.init_layer is not None:
            heads.metadata["init_from_target"] = init_from_target_layer(heads, target, self.opts.init_layer)
        self.check_data()
        return heads

    def eval_stats(self, heads: HeadsBase, tb: TargetBatch) -> dict[str, Tensor]:
        return self.with_vocab_stats(super().eval_stats(heads, tb), heads, tb)

    def loss(self, heads: HeadsBase, tb: TargetBatch, step: int) -> tuple[Tensor, dict[str, Tensor]]:
        logits, top = self.targets(heads, tb)
        return eagle3_ttt_loss(heads, tb.input_ids, self.hidden(heads, tb), logits, tb.loss_mask,
                               steps=self.opts.ttt_steps, decay=self.opts.step_decay,
                               hard_weight=self.opts.hard_weight, target_top=top, terms=Terms.of(self.opts))


def distill_runs(settings: dict[str, Any]) -> list[dict[str, Any]]:
    """The settings of every distill run behind a dataset: a merge lists its inputs' settings, and an
    input may itself be a merge."""
    inputs = settings.get("merged_from")
    return [r for m in inputs for r in distill_runs(m.get("settings", {}))] if inputs else [settings]


def check_greedy_data(data: str) -> None:
    """``eagle.argmax_from: data`` reads the target's argmax off the data's next token, which is
    right only where the target itself wrote the answers greedily: refuse anything else."""
    from ..data.distill import MANIFEST
    from ..data.shards import read_json

    path = Path(data).expanduser() / MANIFEST
    if not path.is_file():
        raise TrainError(f"eagle.argmax_from=data needs data the target distilled greedily, but {data} holds no "
                         f"{MANIFEST}; use argmax_from=logits")
    runs = distill_runs(read_json(path).get("settings", {}))
    hot = sorted({r.get("temperature") for r in runs if r.get("temperature") != 0.0}, key=str)
    if hot:
        raise TrainError(f"eagle.argmax_from=data needs greedy answers, but {data} was distilled at temperature "
                         f"{', '.join(map(str, hot))}; use argmax_from=logits")



def feature_batch(rows: list[dict[str, Tensor]], layers: list[int], lm_head: nn.Module | StoredLogits | None,
                  pad_id: int = 0) -> TargetBatch:
    """Offline route for a list of ``FeatureStore`` rows (``store[i]``) -> the ``TargetBatch``
    online training builds: ``collate_features`` + ``stored_batch``, as ``headway train
    features=DIR`` does. Layer -1 reads ``final``; the logits are the target's ``lm_head`` on
    ``final`` in float32 (so EAGLE-3 features need ``final`` besides the aux layers): every row for
    an ``nn.Module``, what a ``StoredLogits`` (a task's ``stored_logits``) reduces them to."""
    logits = lm_head if isinstance(lm_head, StoredLogits) or lm_head is None else lm_head_logits(lm_head)
    keys = stored_keys(layers, logits is not None)
    batch = collate_features([{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"],
                               "features": {k: r[k] for k in keys}} for r in rows], pad_id)
    ref = batch["features"][keys[0]]
    device, dtype = (logits.weight.device, logits.dtype) if logits is not None else (ref.device, ref.dtype)
    return stored_batch(batch, layers, logits, device, dtype)


__all__ = ["Eagle1Task", "Eagle3Task", "draft_vocab_counts", "eagle_calibration_sums", "eval_sums", "feature_batch",
           "summarize"]
