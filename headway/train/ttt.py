"""EAGLE losses and the drafter's simulated acceptance, as pure functions (design.md §3).

Conventions (shared with the tree decoder): the drafter's input at sequence index t is the
token x_{t+1} and the feature f_t, at position id t; its output at t predicts f_{t+1} and its
logits predict x_{t+2}, whose target distribution is the target's logits at t+1.

**Training-time test** (EAGLE-3) unrolls the drafter ``steps`` times over the whole sequence
at once. Step j at index t has position id t+j, reads token x_{t+j+1} and, for j > 0, the
step j-1 output at index t as its hidden state. It attends to the step-0 keys at indices
<= t (the true prefix) and to the step 1..j keys at index t only: exactly what a depth-j
tree node sees at inference (the drafter's cached prefix, its ancestors and itself). Keys of
all steps go through one ``DraftCache``, so step j's keys are ``(j+1) * T`` long and
``ttt_mask(T, j)`` is that visibility pattern.

The label of step j at index t is the target's distribution at position t+j+1, masked where
(a) t+j+2 is past the sequence end, (b) ``loss_mask`` is 0 at the predicted token x_{t+j+2},
or (c) the target's argmax there is outside the draft vocabulary.
"""

from __future__ import annotations

import zlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..heads.layers import DraftCache
from .objectives import Terms, expected_accepted, in_topk, topk_distill


def noise_seed(seed: int, step: int, input_ids: Tensor) -> int:
    """A seed that is a pure function of (seed, step, tokens): a resumed run draws exactly what the
    uninterrupted one did, whatever else consumed the global RNG (EAGLE-1's input noise, DFlash's anchors)."""
    data = zlib.crc32(input_ids.detach().to("cpu", torch.int64).numpy().tobytes())
    return (seed * 1_000_003 + step) * 4_294_967_311 + data & (2**63 - 1)


def ttt_mask(T: int, step: int, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """Float additive mask (1, 1, T, (step+1)*T) for unrolled step ``step`` (0-based).

    Columns are the keys of steps 0..step, T per step. Query t sees step-0 keys 0..t (causal)
    and, in each later step's block, only key t (the diagonal)."""
    idx = torch.arange(T, device=device)
    causal = idx[None, :] <= idx[:, None]  # (T, T) step-0 block
    diag = idx[None, :] == idx[:, None]  # (T, T) each later block
    visible = torch.cat([causal] + [diag] * step, dim=1)  # (T, (step+1)*T)
    mask = torch.zeros(visible.shape, dtype=dtype, device=device)
    return mask.masked_fill(~visible, torch.finfo(dtype).min)[None, None]


def shift_left(x: Tensor, n: int, fill: float | int | bool = 0) -> Tensor:
    """x (B, T, ...) -> y with y[:, t] = x[:, t+n], ``fill`` past the end."""
    if n == 0:
        return x
    pad = x.new_full((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], dim=1)


def unroll(drafter: nn.Module, input_ids: Tensor, hidden: Tensor, steps: int,
           own_tokens: bool = False, logits: bool = True) -> Iterator[tuple[Tensor, Tensor | None]]:
    """Run the drafter ``steps`` times over the whole sequence; yields (output (B, T, H), logits).

    ``hidden`` (B, T, H) is the step-0 hidden input (EAGLE-1: the target feature f_t; EAGLE-3:
    the fused features). Step j reads token x_{t+j+1} from the data, or with ``own_tokens`` the
    drafter's own greedy token from step j-1 (the autoregressive chain used for evaluation).
    ``logits=False`` yields None instead of the (B, T, V) logits: the loss projects only the
    positions it trains on."""
    B, T = input_ids.shape
    cache = DraftCache()
    pos = torch.arange(T, device=input_ids.device)[None].expand(B, T)  # (B, T)
    ids = shift_left(input_ids, 1)  # (B, T): x_{t+1}
    dtype = drafter.fc.weight.dtype
    for j in range(steps):
        mask = ttt_mask(T, j, dtype, input_ids.device)
        out = drafter(ids, hidden, pos + j, mask, cache)  # (B, T, H)
        step_logits = drafter.logits(out) if logits or own_tokens else None  # (B, T, V or Vd)
        yield out, step_logits
        hidden = out
        if j + 1 < steps:
            ids = drafter.to_target_ids(step_logits.argmax(-1)) if own_tokens else shift_left(input_ids, j + 2)


def label_rows(loss_mask: Tensor, steps: int) -> tuple[Tensor, Tensor]:
    """The indices unrolled steps 1.. must run at: (idx (B, N) long, ok (B, N) bool).

    Step j >= 1 at index t is needed only where some step j' >= j has a label there, i.e.
    token t+j'+2 is an answer token; nothing else reads it (later steps see step-j keys at
    their own index only). ``idx`` lists those t in order per row, padded to the batch's
    largest count N with indices ``ok`` marks False."""
    need = torch.zeros_like(loss_mask, dtype=torch.bool)
    for j in range(1, steps):
        need |= label_mask(loss_mask, j + 2)
    counts = need.sum(1)  # (B,)
    N = max(1, int(counts.max())) if need.numel() else 1
    idx = torch.argsort((~need).to(torch.int8), dim=1, stable=True)[:, :N]  # (B, N) needed indices first
    ok = torch.arange(idx.shape[1], device=idx.device)[None] < counts[:, None]
    return idx, ok


def rows_mask(idx: Tensor, T: int, step: int, dtype: torch.dtype) -> Tensor:
    """``ttt_mask`` for queries at indices ``idx`` (B, N) only: (B, 1, N, T + step * N). Query n
    sees step-0 keys 0..idx[n] and, in each later step's block of N keys, only its own."""
    N = idx.shape[1]
    causal = torch.arange(T, device=idx.device)[None, None, :] <= idx[:, :, None]  # (B, N, T)
    diag = torch.eye(N, dtype=torch.bool, device=idx.device).expand(idx.shape[0], N, N)  # (B, N, N)
    visible = torch.cat([causal] + [diag] * step, dim=2)
    mask = torch.zeros(visible.shape, dtype=dtype, device=idx.device)
    return mask.masked_fill(~visible, torch.finfo(dtype).min)[:, None]


def unroll_rows(drafter: nn.Module, input_ids: Tensor, hidden: Tensor, steps: int, idx: Tensor
                ) -> Iterator[Tensor]:
    """``unroll`` for training: step 0 over the whole sequence (its keys are every later step's
    prefix), steps 1.. only at the indices ``idx`` (B, N) (see ``label_rows``). Yields the step
    outputs: (B, T, H) for step 0, then (B, N, H) with row n at index idx[:, n]. Equal to
    ``unroll``'s outputs at those indices; the prompt positions of a chat batch are skipped."""
    B, T = input_ids.shape
    cache = DraftCache()
    dtype = drafter.fc.weight.dtype
    pos = torch.arange(T, device=input_ids.device)[None].expand(B, T)  # (B, T)
    out = drafter(shift_left(input_ids, 1), hidden, pos, ttt_mask(T, 0, dtype, input_ids.device), cache)
    yield out
    take = idx[..., None].expand(B, idx.shape[1], out.shape[-1])  # (B, N, H)
    h = out.gather(1, take)  # (B, N, H)
    for j in range(1, steps):
        ids = shift_left(input_ids, j + 1).gather(1, idx)  # (B, N): x_{t+j+1}
        h = drafter(ids, h, idx + j, rows_mask(idx, T, j, dtype), cache)
        yield h


def label_mask(loss_mask: Tensor, shift: int) -> Tensor:
    """(B, T) bool: index t is trained iff token t+shift exists and has loss_mask 1."""
    return shift_left(loss_mask.bool(), shift, False)


def eagle3_ttt_loss(drafter: nn.Module, input_ids: Tensor, fused: Tensor, target_logits: Tensor,
                    loss_mask: Tensor, steps: int = 7, decay: float = 0.8,
                    hard_weight: float = 0.0, target_top: Tensor | None = None,
                    terms: Terms = Terms()) -> tuple[Tensor, dict[str, Tensor]]:
    """EAGLE-3 training-time-test loss: sum_j decay^j * (CE_j + hard_weight * CE_j^hard) over the
    draft vocabulary, CE_j against the target's distribution and CE_j^hard against its argmax.

    The hard term matters for high-entropy targets: a soft CE against a flat distribution pulls
    little on the argmax, and greedy acceptance is decided by the argmax alone.

    ``terms`` (``objectives.py``, all off by default) add HASS's Top-K distillation to each step
    (+ topk_weight * L_topK_j), GRIFFIN's token alignment (step j at index t is scored only where
    every earlier step's next input token -- the data's x_{t+i+2} -- was among that step's top
    align_topk drafts at t), and -chain_weight * the mean expected accepted length of the chain
    from each index, Σ_j Π_{i<=j} q_i(the target's argmax at step i).

    input_ids (B, T); fused (B, T, H) = drafter.fuse(target features); target_logits (B, T, V)
    over the full target vocabulary, or with ``target_top`` (B, T) (the target's argmax in target
    ids) only over the draft vocabulary's rows, in draft order (``StoredLogits`` with rows: the
    full projection is then never kept); loss_mask (B, T). Returns (loss, metrics) where metrics
    hold per-step ``ce{j}`` and ``acc{j}`` (draft argmax == target argmax) as 0-d tensors, and with
    the terms ``topk{j}``, ``reached{j}`` (share of labelled positions still scored), ``chain``."""
    draft_ids = torch.arange(drafter.d2t.numel(), device=input_ids.device) + drafter.d2t  # (Vd,) target ids
    tl = target_logits.float()
    if target_top is None:
        target_top = tl.argmax(-1)  # (B, T) target ids
        tl = tl[..., draft_ids]
    elif tl.shape[-1] != draft_ids.numel():
        raise ValueError(f"with target_top, target_logits must hold the {draft_ids.numel()} draft-vocabulary rows, "
                         f"not {tl.shape[-1]}")
    B, T, Vd = tl.shape
    rows = tl.reshape(B * T, Vd)
    at_row = torch.arange(B * T, device=tl.device).view(B, T)  # (B, T): (b, t) -> its row of `rows`
    in_vocab = drafter.t2d[target_top]  # (B, T)
    to_draft = torch.zeros(drafter.t2d.numel(), dtype=torch.long, device=input_ids.device)
    to_draft[draft_ids] = torch.arange(draft_ids.numel(), device=input_ids.device)
    top_draft = to_draft[target_top]  # (B, T) draft ids (0 where outside the draft vocab: masked anyway)
    if terms.align_topk:  # (B, T) the data's tokens as draft ids, -1 outside the draft vocabulary
        data_draft = torch.where(drafter.t2d[input_ids], to_draft[input_ids], -1)
    loss = fused.new_zeros((), dtype=torch.float32)
    metrics: dict[str, Tensor] = {}
    alive: Tensor | None = None  # (B, T) GRIFFIN: every earlier step's next token was among its top-k drafts
    chain: list[Tensor] = []  # per step (B, T): q_j(the target's argmax), 0 where step j has no label
    idx, ok = label_rows(loss_mask, steps)  # steps 1.. run only where a label follows
    for j, out in enumerate(unroll_rows(drafter, input_ids, fused, steps, idx)):
        valid = label_mask(loss_mask, j + 2) & shift_left(in_vocab, j + 1, False)  # (B, T)
        # Project, normalise and score only the trained positions (about half of a padded chat
        # batch: prompts and padding carry no label); the loss is the masked mean either way.
        # Steps 1.. hold the rows idx (in index order, a superset of valid): the same positions.
        at = valid if j == 0 else valid.gather(1, idx) & ok  # (B, T) or (B, N)
        logits = drafter.logits(out[at])  # (n, Vd)
        logq = F.log_softmax(logits.float(), dim=-1)  # (N, Vd)
        # the target's distribution at t + j + 1, renormalised on the draft vocabulary, for just these
        # rows (a softmax over the whole (B, T, Vd) batch and its shifted copies cost ~1/5 of a step)
        target_p = F.softmax(rows[shift_left(at_row, j + 1)[valid]], dim=-1)  # (N, Vd)
        label = shift_left(top_draft, j + 1)[valid]  # (N,) the target's argmax as a draft id
        target = shift_left(target_top, j + 1)[valid]  # (N,) the same in target ids
        n = valid.sum()
        if j == 0:
            starts = valid  # (B, T) where a chain starts: step 0 has a label
        if terms.chain_weight:  # q_j(the target's argmax) at every labelled index, 0 elsewhere
            chain.append(logq.new_zeros(B, T).masked_scatter(valid, logq.gather(-1, label[:, None])[:, 0].exp()))
        if terms.align_topk:  # GRIFFIN: score only the indices decoding reaches, then update who does
            scored = torch.ones_like(label, dtype=torch.bool) if alive is None else alive[valid]  # (N,)
            hit = in_topk(logits, shift_left(data_draft, j + 2, -1)[valid], terms.align_topk)  # (N,)
            now = torch.zeros_like(valid).masked_scatter(valid, hit)  # (B, T)
            alive = now if alive is None else alive & now
            if j:  # step 0 is always scored
                metrics[f"reached{j}"] = scored.sum().float() / n.clamp(min=1)
            logits, logq, target_p, label, target = (x[scored] for x in (logits, logq, target_p, label, target))
            n = scored.sum()
        ce = -(target_p * logq).sum() / n.clamp(min=1)
        step_loss = ce
        if hard_weight:
            hard = F.nll_loss(logq, label, reduction="sum")
            step_loss = ce + hard_weight * hard / n.clamp(min=1)
        if terms.topk_weight:
            topk = topk_distill(target_p, logq, terms.topk_k).sum() / n.clamp(min=1)
            step_loss = step_loss + terms.topk_weight * topk
            metrics[f"topk{j}"] = topk.detach()
        loss = loss + decay ** j * step_loss
        hit = drafter.to_target_ids(logits.argmax(-1)) == target  # (N,)
        metrics[f"ce{j}"] = ce.detach()
        metrics[f"acc{j}"] = hit.sum().float() / n.clamp(min=1)
    if chain:
        value = expected_accepted(torch.stack(chain, -1))[starts].sum() / starts.sum().clamp(min=1)
        loss = loss - terms.chain_weight * value
        metrics["chain"] = value.detach()
    return loss, metrics


def eagle1_loss(drafter: nn.Module, input_ids: Tensor, features: Tensor, target_logits: Tensor,
                loss_mask: Tensor, noise: Tensor | None = None, feature_weight: float = 1.0,
                ce_weight: float = 0.1, target_top: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """EAGLE-1: SmoothL1(predicted f_{t+1}, f_{t+1}) + ce_weight * soft CE(target distribution at t+1).

    features (B, T, H) final post-norm target states; target_logits (B, T, V), or with
    ``target_top`` (B, T) (the target's argmax, which only the accuracy metric reads) over just
    the draft vocabulary's rows, in draft order, for a drafter that has one; ``noise``
    (B, T, H) is added to the input features only (the paper's U(-0.1, 0.1)); the caller draws
    it so its randomness is explicit. The CE runs on the trained positions only, and a drafter
    with a draft vocabulary scores it there (the target's distribution renormalised on it, as
    EAGLE-3 does): decoding drafts only from those rows, and the full 49k-row projection of a
    SmolLM2-sized vocabulary would cost more than the rest of the step."""
    inputs = features if noise is None else features + noise.to(features.dtype)
    B, T = input_ids.shape
    pos = torch.arange(T, device=input_ids.device)[None].expand(B, T)
    mask = ttt_mask(T, 0, drafter.fc.weight.dtype, input_ids.device)  # plain causal
    pred = drafter(shift_left(input_ids, 1), inputs, pos, mask)  # (B, T, H)
    valid = label_mask(loss_mask, 2)  # (B, T)
    n = valid.sum().clamp(min=1)
    target_feat = shift_left(features, 1).float()  # (B, T, H) f_{t+1}
    fl = F.smooth_l1_loss(pred.float(), target_feat, reduction="none").mean(-1)  # (B, T)
    feat_loss = (fl * valid).sum() / n
    tl = shift_left(target_logits, 1)[valid].float()  # (N, V), or (N, Vd) with target_top
    reduced = target_top is not None and getattr(drafter, "has_draft_vocab", False)
    target_top = (tl.argmax(-1) if target_top is None else shift_left(target_top, 1)[valid])  # (N,) target ids
    if getattr(drafter, "has_draft_vocab", False):
        tl = tl if reduced else tl[:, drafter.draft_token_ids()]  # (N, Vd)
        logits = drafter.draft_logits(pred[valid])  # (N, Vd)
        top = drafter.draft_to_target_ids(logits.detach().argmax(-1))  # (N,)
    else:
        logits = drafter.full_logits(pred[valid])  # (N, V)
        top = logits.detach().argmax(-1)
    logq = F.log_softmax(logits.float(), dim=-1)
    ce = -(F.softmax(tl, dim=-1) * logq).sum() / n
    acc = (top == target_top).sum().float() / n
    loss = feature_weight * feat_loss + ce_weight * ce
    return loss, {"feature": feat_loss.detach(), "ce0": ce.detach(), "acc0": acc}


@torch.no_grad()
def chain_accepted(drafter: nn.Module, input_ids: Tensor, hidden: Tensor, next_tokens: Tensor,
                   loss_mask: Tensor, depth: int) -> tuple[Tensor, Tensor]:
    """Simulated greedy-draft acceptance of the drafter's own chain from every position.

    ``next_tokens`` (B, T) is the verifier's token after position s: the data's x_{s+1}, or the
    target's argmax at s. From index t the drafter drafts ``depth`` tokens feeding back its own
    tokens and features (as the tree decoder does); step j's token is accepted while it equals
    next_tokens[t+j+1]. Returns (accepted (B, T) long in 0..depth, start (B, T) bool): chains
    start where all ``depth`` predicted tokens x_{t+2..t+depth+1} are answer tokens (loss_mask
    1), the positions Medusa's chain metric counts.

    Against the data's tokens this is exact: while the chain is accepted its tokens *are* the
    data, so every later step sees what the data gives it. Against the target's argmax it is
    exact on greedy-distilled data (the data is the argmax chain) and otherwise approximates
    the target's greedy token after a matched draft by its argmax on the data."""
    start = torch.ones_like(input_ids, dtype=torch.bool)
    for j in range(depth):
        start &= label_mask(loss_mask, j + 2)
    alive = start.clone()
    accepted = torch.zeros_like(input_ids)
    for j, (_, logits) in enumerate(unroll(drafter, input_ids, hidden, depth, own_tokens=True)):
        alive &= drafter.to_target_ids(logits.argmax(-1)) == shift_left(next_tokens, j + 1)
        accepted += alive.long()
    return accepted, start


def decoder_step_starts(accepted: Tensor, start: Tensor, loss_mask: Tensor) -> Tensor:
    """(B, T) bool: the indices where greedy chain decoding of each answer starts its steps.

    The prefill gives an answer's first token, so the first step drafts from the index before it
    (the drafter reads that token there); a step that accepts a drafts moves a + 1 tokens on. A walk
    ends where a full chain no longer fits in the answer (``start`` False). ``tau`` averages every
    answer position; a decoder meets only these, and they follow its rejections, where drafting is
    harder: acceptance here is what ``headway bench`` measures (SmolLM2: 1.41 against 1.46)."""
    T = accepted.shape[1]
    m = loss_mask.bool()
    before = ~m & shift_left(m, 1, False)  # (B, T) the index before an answer's first token (each turn)
    out = torch.zeros_like(start)
    acc, ok = accepted.tolist(), start.tolist()
    for r, t in before.nonzero().tolist():
        while t < T and ok[r][t]:
            out[r, t] = True
            t += acc[r][t] + 1
    return out


def acceptance_stats(accepted: Tensor, start: Tensor, depth: int) -> dict[str, Tensor]:
    """Fixed-shape sums for the loop to add over batches and processes."""
    hist = torch.bincount(accepted[start].flatten(), minlength=depth + 1)[: depth + 1]  # (depth+1,)
    return {"accept_hist": hist.float()}


def summarize_acceptance(stats: dict[str, Tensor]) -> dict[str, float | list[float]]:
    """accept_hist[k] = chains that accepted exactly k tokens -> tau, P(accepted >= k), and
    ``tau_by_depth[d-1]``: tau of the same chains cut at depth d (to compare with shallower drafts)."""
    hist = stats["accept_hist"].double()
    n = float(hist.sum())
    if n == 0:
        return {"tau": float("nan"), "accept_rate_by_depth": [], "positions": 0}
    depth = hist.numel() - 1
    at_least = [float(hist[k:].sum() / n) for k in range(1, depth + 1)]
    k = torch.arange(depth + 1, dtype=torch.float64)
    mean = float((hist * k).sum() / n)
    capped = [1.0 + float((hist * k.clamp(max=d)).sum() / n) for d in range(1, depth + 1)]
    return {"tau": 1.0 + mean, "mean_accepted": mean, "accept_rate_by_depth": at_least, "positions": int(n),
            "depth": depth, "tau_by_depth": capped}
