"""Draft calibration: how confident a drafter is against how often it is right, per depth.

Tree decoders rank candidate nodes by the drafter's cumulative log-probability (EAGLE-2). A
drafter that is right more often than it is confident (EAGLE-1, whose features go through the
target's full lm_head) then spends every budget on width. Per depth we measure a reliability
histogram of the top-1 probability and the label's NLL under ``log_softmax(logits / T)`` for a
fixed grid of temperatures; the temperature with the least NLL is stored with the heads
(``metadata["calibration"]``) and the decoder ranks tree nodes with it (``decode/shapes.py``).

Stats are *sums* with fixed shapes (depth x bins, depth x grid), so they add over batches and
processes like the other eval stats; ``summarize_calibration`` turns the totals into numbers.
``calibrate.fit_calibration`` computes the same sums for existing heads on a distilled dataset or
a features folder (``headway tune calibration_data=...``), each kind's through its task.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor, nn

NUM_BINS = 10  # reliability histogram over the top-1 probability: [0, .1), ..., [.9, 1]
# 2 ** (k / 4) for k = -8 .. 8: 0.25 .. 4, log-spaced, holding 0.5, 1 and 2 exactly
TEMPERATURES: tuple[float, ...] = tuple(2.0 ** (k / 4) for k in range(-8, 9))
FITTED_ON_EVAL = "held-out eval data"


def depth_sums(logits: Tensor, labels: Tensor, temperatures: Sequence[float] = TEMPERATURES,
               bins: int = NUM_BINS) -> dict[str, Tensor]:
    """One depth: logits (N, V) of N drafted positions, labels (N,) indices into V, -1 where the
    label is outside the drafter's vocabulary (a miss: counted in the histogram, not in the NLL).

    Returns ``count`` / ``conf`` / ``hits`` (bins,): positions, summed top-1 probability and
    top-1 == label, by top-1 probability bin; ``nll`` (G,): summed -log softmax(logits / T)[label]
    per grid temperature over in-vocabulary labels, ``nll_n`` (1,): how many."""
    z = logits.detach().float()
    labels = labels.to(z.device)
    conf, top = z.softmax(-1).max(-1)  # (N,)
    b = (conf * bins).long().clamp(max=bins - 1)  # (N,)
    hit = (top == labels).float()
    known = labels >= 0
    zk, lk = z[known], labels[known]  # (M, V), (M,)
    picked = zk.gather(-1, lk[:, None])[:, 0]  # (M,)
    nll = torch.stack([(torch.logsumexp(zk / t, -1) - picked / t).sum() for t in temperatures])  # (G,)
    return {"count": torch.bincount(b, minlength=bins).float(),
            "conf": torch.zeros(bins, device=z.device).index_add_(0, b, conf),
            "hits": torch.zeros(bins, device=z.device).index_add_(0, b, hit),
            "nll": nll, "nll_n": known.sum().float().reshape(1)}


def calibration_sums(logits: Sequence[Tensor], labels: Sequence[Tensor],
                     temperatures: Sequence[float] = TEMPERATURES, bins: int = NUM_BINS) -> dict[str, Tensor]:
    """Per depth d (``logits[d]`` (N_d, V), ``labels[d]`` (N_d,)) -> ``calib_*`` sums stacked to
    (D, bins) / (D, G) / (D, 1): the eval-stat keys ``summarize_calibration`` reads."""
    return stack_depths([depth_sums(z, y, temperatures, bins) for z, y in zip(logits, labels)])


def stack_depths(per: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """``depth_sums`` of depths 1..D -> the ``calib_*`` eval stats, (D, ...) each."""
    return {f"calib_{k}": torch.stack([p[k] for p in per]) for k in per[0]}


def expected_calibration_error(count: Tensor, conf: Tensor, hits: Tensor) -> float:
    """ECE from one depth's histogram: sum over bins of |hits - confidence| / positions."""
    n = float(count.sum())
    return float((hits - conf).abs().sum()) / n if n else float("nan")


def fitted_temperature(nll: Tensor, n: float, temperatures: Sequence[float] = TEMPERATURES) -> float:
    """The grid temperature with the least summed NLL (1.0 without data)."""
    return float(temperatures[int(nll.argmin())]) if n > 0 else 1.0


def summarize_calibration(stats: dict[str, Tensor], temperatures: Sequence[float] = TEMPERATURES) -> dict[str, Any]:
    """Summed ``calib_*`` stats -> per depth: mean top-1 confidence, top-1 accuracy, ECE, the
    fitted temperature and the label's mean NLL before (T=1) and after it."""
    count, conf, hits = stats["calib_count"].double(), stats["calib_conf"].double(), stats["calib_hits"].double()
    nll, nll_n = stats["calib_nll"].double(), stats["calib_nll_n"].double()
    one = min(range(len(temperatures)), key=lambda i: abs(temperatures[i] - 1.0))
    out: dict[str, list[Any]] = {k: [] for k in ("confidence", "accuracy", "ece", "temperature", "nll",
                                                  "nll_calibrated", "positions")}
    for d in range(count.shape[0]):
        n, m = float(count[d].sum()), float(nll_n[d].sum())
        t = fitted_temperature(nll[d], m, temperatures)
        out["confidence"].append(round(float(conf[d].sum()) / n, 4) if n else None)
        out["accuracy"].append(round(float(hits[d].sum()) / n, 4) if n else None)
        out["ece"].append(round(expected_calibration_error(count[d], conf[d], hits[d]), 4) if n else None)
        out["temperature"].append(round(t, 4))
        out["nll"].append(round(float(nll[d, one]) / m, 4) if m else None)
        out["nll_calibrated"].append(round(float(nll[d].min()) / m, 4) if m else None)
        out["positions"].append(int(n))
    return out


def calibration_metadata(summary: dict[str, Any], fitted_on: str = FITTED_ON_EVAL) -> dict[str, Any]:
    """What the heads store (``metadata["calibration"]``) and the decoder reads: the fitted
    temperature per draft depth (depth 1 first), with how it was measured."""
    return {"temperature_by_depth": list(summary["temperature"]), "fitted_on": fitted_on,
            "grid": [min(TEMPERATURES), max(TEMPERATURES), len(TEMPERATURES)],
            "ece_by_depth": list(summary["ece"]), "positions_by_depth": list(summary["positions"])}


# -- per head kind: which logits predict which label ------------------------------------------
def medusa_calibration_sums(head_logits: Tensor, labels: Tensor, ignore_index: int) -> dict[str, Tensor]:
    """head_logits (K, B, T, Vd), labels (K, B, T) draft ids (-1 outside the draft vocabulary,
    ``ignore_index`` where none): head k is depth k + 1, every labelled position counts."""
    valid = labels != ignore_index  # (K, B, T)
    return calibration_sums([z[v] for z, v in zip(head_logits, valid)], [y[v] for y, v in zip(labels, valid)])


@torch.no_grad()
def teacher_forced_sums(drafter: nn.Module, input_ids: Tensor, hidden: Tensor, start: Tensor,
                        depth: int) -> tuple[Tensor, dict[str, Tensor]]:
    """Step j (depth j+1) fed the data's tokens and the drafter's own features, at chain starts:
    (top-1 hits on the data's token (depth,), the ``calib_*`` calibration sums against it)."""
    from .ttt import shift_left, unroll

    data_next = shift_left(input_ids, 1)  # (B, T) x_{s+1}
    hits, per_depth = [], []
    for j, (_, logits) in enumerate(unroll(drafter, input_ids, hidden, depth)):
        label = shift_left(data_next, j + 1)  # (B, T) the token step j predicts
        ok = drafter.to_target_ids(logits.argmax(-1)) == label
        hits.append((ok & start).sum())
        per_depth.append(depth_sums(logits[start], drafter.logit_ids(label[start])))  # one depth at a time
    return torch.stack(hits).float(), stack_depths(per_depth)


def eagle_calibration_sums(drafter: nn.Module, tb: Any, hidden: Tensor, depth: int) -> dict[str, Tensor]:
    """The calibration sums of ``eval_sums`` alone (``calibrate.fit_calibration``): chain starts as there."""
    from .ttt import label_mask

    start = torch.ones_like(tb.input_ids, dtype=torch.bool)
    for j in range(depth):
        start &= label_mask(tb.loss_mask, j + 2)
    return teacher_forced_sums(drafter, tb.input_ids, hidden, start, depth)[1]
