"""Batched greedy decoding: several prompts through one target forward per step, each row exact.

Every row keeps its own tree, acceptance and stopping; the target's forwards and the drafting are
batched: one ``BatchProposer`` (``decode/batch_proposers.py``) drafts every row's tree with one
drafter call per draft level (``decode/batch_trees.py``; an EAGLE drafter's cache follows the
scheme below too). ``Speculator.batched_drafting = False`` drafts row by row (the A/B baseline).
The batch's KV cache is one ``DynamicCache`` of B rows and one physical length ``S``; which of
its S slots belong to a row is a bool ``valid`` (B, S), and every slot carries the KV the row's
own unbatched decode would hold at that logical position (RoPE is applied with the row's own
``position_ids`` when the slot is written, so a slot's physical place does not matter):

* prefill: prompts left-padded; pad slots are invalid; position ids count a row's valid tokens.
* each step: row b's tree (drafted with all the others') (N_b nodes, any shape the single-prompt path drafts),
  padded to N = max N_b; pad nodes see only themselves and are never read. One forward with a
  float (B, 1, N, S + N) mask: node i of row b sees the row's valid slots and its own ancestors.
* commit: row b's accepted nodes (m_b of them, root first) move to the first m_b tree slots;
  the cache keeps max m_b tree slots; slots past m_b in row b become gaps (invalid).
* a row that stops (EOS, ``max_new_tokens``) leaves the batch (its cache row is dropped, and slot
  columns no remaining row uses are dropped with it).

Masked slots get weight exactly 0 (additive ``finfo.min``), so each row's logits equal its
unbatched ones up to float rounding, and greedy verification emits the same tokens.
Greedy only (temperature 0) for now.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch
from transformers import DynamicCache

from .args import DecodeError, check_decode_args
from .batch_proposers import BatchProposer
from .batch_trees import build_trees
from .kv import drop_last, new_cache
from .padding import additive, after_prefix, left_pad, pad_trees, prefill_mask, used_columns
from .shapes import DraftTree
from .stats import GenerationOutput, GenerationStats, _record_depths, _sync
from .verify import Verdict, verify_greedy

if TYPE_CHECKING:
    from .speculator import Speculator


@dataclass
class BatchOutput:
    """One ``GenerationOutput`` per prompt (in order; each with its own stats), plus the batch's totals."""

    rows: list[GenerationOutput]
    target_forwards: int = 0  # batched verification forwards (prefill not counted)
    time_total: float = 0.0

    @property
    def new_tokens(self) -> int:
        return sum(len(r.ids) for r in self.rows)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.time_total if self.time_total else 0.0


@dataclass
class _Row:
    """One prompt's decode state inside the batch."""

    index: int  # position in the caller's prompt list
    emitted: list[int]
    length: int  # logical tokens in the cache (prompt + accepted): the next tree root's position
    stats: GenerationStats
    tree: DraftTree | None = None


@dataclass
class _Batch:
    """The shared target state: cache rows follow ``rows``; ``valid`` (B, S) marks real slots."""

    cache: DynamicCache
    valid: torch.Tensor
    proposer: BatchProposer  # its rows follow ``rows``
    rows: list[_Row] = field(default_factory=list)


def keep_accepted_rows(batch: _Batch, tree_width: int, verdicts: Sequence[Verdict]) -> None:
    """The cache holds S slots + ``tree_width`` tree slots per row: move row b's accepted nodes to
    its first m_b tree slots, keep max m_b tree slots, and mark row b's slots past m_b as gaps."""
    S = batch.valid.shape[1]
    dev = batch.valid.device
    m = torch.tensor([v.nodes.numel() for v in verdicts], device=dev)  # (B,)
    M = int(m.max())
    idx = torch.zeros(len(verdicts), M, dtype=torch.long, device=dev)  # (B, M) tree slot to keep
    for b, v in enumerate(verdicts):
        idx[b, :v.nodes.numel()] = v.nodes
    for layer in batch.cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name)  # (B, H, S + N, D)
            src = idx[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]) + S
            t[:, :, S:S + M] = t.gather(2, src)  # gather copies first: overlapping slots are safe
    if tree_width > M:
        drop_last(batch.cache, tree_width - M)
    batch.valid = torch.cat([batch.valid, torch.arange(M, device=dev)[None] < m[:, None]], dim=1)


def drop_rows(batch: _Batch, keep: list[int]) -> None:
    """Keep only rows ``keep`` of the batch, then drop slot columns no remaining row uses."""
    if len(keep) == len(batch.rows):
        return
    sel = torch.tensor(keep, dtype=torch.long, device=batch.valid.device)
    batch.rows = [batch.rows[i] for i in keep]
    batch.proposer.select(keep)
    batch.cache.batch_select_indices(sel)
    batch.valid = batch.valid[sel]
    cols = used_columns(batch.valid)
    if cols is not None:
        for layer in batch.cache.layers:
            layer.keys = layer.keys.index_select(2, cols)
            layer.values = layer.values.index_select(2, cols)
        batch.valid = batch.valid[:, cols]


def encode_batch(spec: Speculator, prompts: Sequence[Any], max_new_tokens: int, temperature: float,
                 chat: bool | None) -> list[list[int]]:
    """Token ids per prompt, every argument and every prompt's length checked before any forward."""
    if isinstance(prompts, (str, torch.Tensor)) or not isinstance(prompts, Sequence) or not prompts:
        raise DecodeError("generate_batch takes a non-empty list of prompts (strings, token id lists or messages)")
    check_decode_args(max_new_tokens, temperature)
    if temperature > 0:
        raise DecodeError("batched decoding is greedy only for now (temperature 0); sample one prompt at a time "
                          "with Speculator.generate")
    ids = [spec.encode(p, chat)[0].tolist() for p in prompts]
    for row in ids:
        check_decode_args(max_new_tokens, temperature, prompt_tokens=len(row), max_positions=spec.max_positions)
    return ids


def generate_batch(spec: Speculator, prompts: Sequence[Any], max_new_tokens: int = 128, temperature: float = 0.0,
                   chat: bool | None = None) -> BatchOutput:
    """Greedy speculative decoding of several prompts at once; row i equals ``spec.generate(prompts[i])``."""
    ids = encode_batch(spec, prompts, max_new_tokens, temperature, chat)
    with spec.kernels():
        return _generate(spec, ids, max_new_tokens)


@torch.inference_mode()
def _generate(spec: Speculator, ids: list[list[int]], max_new_tokens: int) -> BatchOutput:
    dev, dtype = spec.device, spec.dtype
    pad = spec.tokenizer.pad_token_id if spec.tokenizer.pad_token_id is not None else 0
    eos = spec._eos_ids()
    t_start = time.perf_counter()
    # -- prefill: left-padded prompts, one forward --------------------------------------------
    tokens, valid, pos = left_pad(ids, pad, dev)  # (B, n) each
    batch = _Batch(new_cache(spec.target.config), valid, spec.new_batch_proposer(len(ids)))
    keep = {"logits_to_keep": 1} if spec._keeps_logits else {}  # left-padded: the last column is every row's last
    out = spec._forward(tokens, batch.cache, position_ids=pos, attention_mask=additive(prefill_mask(valid), dtype),
                        **keep)
    first = out.logits[:, -1].argmax(-1)  # (B,)
    batch.proposer.prefill(tokens, valid, pos, [out.hidden_states[i] for i in spec._layers], first)
    for b, row_ids in enumerate(ids):
        stats = GenerationStats(prompt_tokens=len(row_ids), new_tokens=1)
        batch.rows.append(_Row(b, [int(first[b])], len(row_ids), stats))
    _sync(dev)
    t_prefill = time.perf_counter() - t_start
    done: dict[int, _Row] = {}
    forwards = 0

    def finish(finished: list[_Row]) -> None:
        now = time.perf_counter() - t_start
        for r in finished:
            r.stats.time_prefill, r.stats.time_total = t_prefill, now
            done[r.index] = r
        drop_rows(batch, [i for i, r in enumerate(batch.rows) if r.index not in done])

    finish([r for r in batch.rows if spec._stopped(r.emitted, eos, max_new_tokens, r.stats)])
    # -- the loop: per-row trees, one batched verify forward, per-row acceptance ----------------
    while batch.rows:
        t0 = time.perf_counter()
        shapes = [spec._shape_for(spec.max_positions - 1 - r.length) for r in batch.rows]
        roots = torch.tensor([r.emitted[-1] for r in batch.rows], device=dev)
        for r, tree in zip(batch.rows, build_trees(shapes, batch.proposer, roots)):
            r.tree = tree
        batch.proposer.end_tree()
        tree_tokens, tree_pos, vis = pad_trees([r.tree for r in batch.rows], [r.length for r in batch.rows], pad)
        B, N = tree_tokens.shape
        seen = after_prefix(batch.valid, vis)  # (B, N, S + N)
        _sync(dev)
        t1 = time.perf_counter()
        out = spec._forward(tree_tokens, batch.cache, position_ids=tree_pos, attention_mask=additive(seen, dtype))
        _sync(dev)
        t2 = time.perf_counter()
        forwards += 1
        verdicts = [verify_greedy(r.tree.tokens, r.tree.buffers, out.logits[b, :r.tree.tokens.numel()])
                    for b, r in enumerate(batch.rows)]
        keep_accepted_rows(batch, N, verdicts)
        paths = [torch.cat([r.tree.tokens[v.nodes], v.bonus.view(1)]) for r, v in zip(batch.rows, verdicts)]
        batch.proposer.accept(paths, [[out.hidden_states[i][b, v.nodes] for i in spec._layers]
                                      for b, v in enumerate(verdicts)], [r.length for r in batch.rows])
        finished = []
        for r, v, path_tokens in zip(batch.rows, verdicts, paths):
            r.length += v.nodes.numel()
            before = len(r.emitted)
            r.emitted += path_tokens[1:].tolist()
            del r.emitted[max_new_tokens:]
            r.stats.target_forwards += 1
            r.stats.tree_nodes += r.tree.tokens.numel()
            r.stats.projected_rows += r.tree.tokens.numel()  # the batch's forward projects every node
            _record_depths(r.stats, v)
            r.stats.new_tokens = len(r.emitted)
            if spec._stopped(r.emitted, eos, max_new_tokens, r.stats, len(r.emitted) - before):
                finished.append(r)
        _sync(dev)
        t3 = time.perf_counter()
        for r in batch.rows:  # the batch's times, as each row lived through them
            r.stats.time_draft += t1 - t0
            r.stats.time_verify += t2 - t1
            r.stats.time_bookkeeping += t3 - t2
        if finished:
            finish(finished)
    rows = [done[i] for i in range(len(ids))]
    outputs = [GenerationOutput(r.emitted, spec.tokenizer.decode(r.emitted), r.stats) for r in rows]
    return BatchOutput(outputs, forwards, time.perf_counter() - t_start)
