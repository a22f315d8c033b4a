"""DFlash block drafter (Chen et al. 2026, arXiv 2602.06036): one call drafts a whole block.

The target's hidden states at K layers are fused (``fc: K*H -> H``, then ``hidden_norm``) into a
context that every draft layer reads as extra keys and values. A block is the last known token
(the anchor, at position P) followed by B-1 copies of a mask token (positions P+1 .. P+B-1); one
bidirectional pass over it, attending to the context of positions < P, gives at block slot k the
drafter's distribution over the token at position P+k. Drafting cost is one call whatever the depth.

Layers are Qwen3-style (per-head q/k norms, RoPE on the target's geometry) built from stock
transformers parts, like the EAGLE drafters: ``heads/layers.py``. The target's embeddings are
borrowed (frozen, never saved). Logits come from the drafter's ``norm`` then either the target's
own lm_head (borrowed) or, with ``draft_vocab_size``, an own lm_head over a reduced draft
vocabulary (``d2t`` / ``t2d``, EAGLE-3's format), initialised from the target's rows and trained.

Context features are indexed as HF ``output_hidden_states`` (0 = embeddings, i = output of layer
i-1); the reference implementation names the same layers by decoder-layer index (ours minus one).

A block's slots see each other only as mask tokens, so slot k's distribution cannot depend on which
token was drafted at slot k-1. With ``correction_rank`` > 0 a small recurrent head adds that
dependence (the idea of Domino, a successor of DFlash): a GRU cell walks the draft path, reading at
each slot the parent token's embedding and the slot's normed output, and a linear map of its state
is added to the slot's logits. One block call still drafts every depth; the tree pays one GRU step
and one rank-r projection per node. The map starts at zero: an untrained correction changes nothing.

**DSpark** (Cheng et al. 2026, arXiv 2607.05147; vLLM's ``qwen3_dspark.py``, speculators' ``dspark``) adds
two small heads to the same block, laid out as vLLM loads them (docs/peagle.md):
- a low-rank **Markov head** (``markov_rank`` r): slot k's logits gain ``markov_w2(markov_w1[x])``, x the
  token before the slot (the anchor for slot 1, then the drafted token at slot k-1): the first-order
  dependence a plain block lacks, one embedding row and one (Vd, r) product per slot. ``markov_w2``
  starts at zero: an untrained head changes nothing.
- a **confidence head**: ``sigmoid(proj(cat(norm(h_k), markov_w1[x])))``, the chance that slot k's draft
  is accepted (trained against the overlap sum_v min(p_v, q_v) of the target's and the drafter's
  distributions). Its running product over a block (``survival``) is what a decoder reads to choose
  how many drafts to verify in each step; it never changes which tokens are emitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from ..config import opt
from ..feature_layers import dflash_layers
from ..target import TargetInfo
from .base import DraftVocab, HeadsBase, HeadsError
from .layers import BlockDecoderLayer, LayerGeometry

ContextKV = list[tuple[torch.Tensor, torch.Tensor]]  # per draft layer: keys, values (B, nkv, C, hd)


def default_context_layers(num_hidden_layers: int) -> list[int]:
    """The fused layers of a drafter built without ``aux_layers`` (``feature_layers.dflash_layers``)."""
    try:
        return dflash_layers(num_hidden_layers)
    except ValueError as e:
        raise HeadsError(str(e)) from None


@dataclass
class DFlashConfig:
    hidden_size: int = opt(help="target hidden size")
    vocab_size: int = opt(help="target vocabulary size")
    block_size: int = opt(8, "tokens per block: the anchor plus block_size - 1 drafted tokens")
    num_layers: int = opt(1, "draft decoder layers")
    aux_layers: list[int] = opt(default_factory=list, help="HF hidden-state indices of the fused target layers")
    mask_token_id: int = opt(0, "target token whose embedding fills the block's drafted slots")
    draft_vocab_size: int | None = opt(None, "own lm_head over this many target tokens (d2t / t2d say which); "
                                             "None = the target's own lm_head, shared and frozen")
    qk_norm: bool = opt(True, "per-head RMSNorm on queries and keys (Qwen3-style, as vLLM's DFlash layers)")
    correction_rank: int = opt(0, "state size of the path correction (a GRU over the drafted tokens whose state "
                                  "adds to each slot's logits); 0 = none, the plain DFlash block")
    markov_rank: int = opt(0, "DSpark: rank of the Markov head (a logit bias from the token before each slot); "
                              "0 = none")
    confidence_head: bool = opt(False, "DSpark: a head estimating each slot's chance of acceptance")
    confidence_with_markov: bool = opt(True, "DSpark: the confidence head also reads the Markov embedding of "
                                             "the token before the slot (needs markov_rank > 0)")
    layer: LayerGeometry = field(default_factory=lambda: LayerGeometry(0, 0, 1, 1, 1))

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (the anchor and at least one draft); got {self.block_size}")
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1; got {self.num_layers}")
        if not self.aux_layers:
            raise ValueError("DFlash fuses at least one target layer; aux_layers is empty")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id must be a target token id in 0..{self.vocab_size - 1}; "
                             f"got {self.mask_token_id}")
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in 1..{self.vocab_size}; got {self.draft_vocab_size}")
        if self.correction_rank < 0 or self.markov_rank < 0:
            raise ValueError(f"correction_rank and markov_rank must be >= 0; got {self.correction_rank}, "
                             f"{self.markov_rank}")
        if self.correction_rank and self.markov_rank:
            raise ValueError("a path correction and a Markov head both bias a slot by the tokens before it; "
                             "use one (correction_rank or markov_rank)")
        if self.confidence_head and self.confidence_with_markov and not self.markov_rank:
            raise ValueError("confidence_with_markov needs a Markov head (markov_rank > 0)")


class PathCorrection(nn.Module):
    """slot k's logits += out(s_k), s_k = GRU([embed(token at k-1); norm(slot k's output)], s_{k-1}), s_0 = 0."""

    def __init__(self, hidden_size: int, rank: int, vocab: int) -> None:
        super().__init__()
        self.cell = nn.GRUCell(2 * hidden_size, rank)
        self.out = nn.Linear(rank, vocab, bias=False)
        nn.init.zeros_(self.out.weight)  # starts as the plain block

    def step(self, state: torch.Tensor | None, parent_embeds: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """state (n, r) or None (the root: zeros), parent_embeds (n, H), slot (n, H) normed -> (n, r)."""
        x = torch.cat([parent_embeds, slot], dim=-1).to(self.cell.weight_ih.dtype)
        return self.cell(x, state)


class MarkovHead(nn.Module):
    """DSpark's first-order logit bias: ``markov_w2(markov_w1[x])``, x the target id before the slot."""

    def __init__(self, vocab: int, draft_vocab: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)  # (V, r): every target id, as the tokens before a slot are
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)  # (Vd, r)
        nn.init.zeros_(self.markov_w2.weight)  # starts as the plain block

    def embed(self, parents: torch.Tensor) -> torch.Tensor:
        """(...,) target ids -> (..., r)."""
        return self.markov_w1(parents)


class ConfidenceHead(nn.Module):
    """DSpark's acceptance estimate: one linear unit over the slot's normed output (and Markov embedding)."""

    def __init__(self, input_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., input_size) -> (...,) logits."""
        return self.proj(x)[..., 0]


def survival(confidence: torch.Tensor) -> torch.Tensor:
    """(..., K) per-slot acceptance estimates -> (..., K): the chance that slots 1..k are all accepted (the
    running product), the gain of verifying k drafts: ``decode/cost.best_size`` reads it per row."""
    return confidence.cumprod(dim=-1)


class DFlashDrafter(DraftVocab, HeadsBase):
    kind = "dflash"
    config_class = DFlashConfig

    def __init__(self, config: DFlashConfig, target_info: TargetInfo | None = None) -> None:
        super().__init__(config, target_info)
        H, g = config.hidden_size, config.layer
        self.fc = nn.Linear(len(config.aux_layers) * H, H, bias=False)
        self.hidden_norm = LlamaRMSNorm(H, eps=g.rms_norm_eps)
        self.layers = nn.ModuleList(BlockDecoderLayer(g, config.qk_norm) for _ in range(config.num_layers))
        self.norm = LlamaRMSNorm(H, eps=g.rms_norm_eps)
        if config.draft_vocab_size is not None:
            self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
            self._init_draft_vocab(config.draft_vocab_size, config.vocab_size)
        if config.correction_rank:
            self.correction = PathCorrection(H, config.correction_rank, config.draft_vocab_size or config.vocab_size)
        if config.markov_rank:
            self.markov_head = MarkovHead(config.vocab_size, config.draft_vocab_size or config.vocab_size,
                                          config.markov_rank)
        if config.confidence_head:
            self.confidence_head = ConfidenceHead(H + (config.markov_rank if config.confidence_with_markov else 0))
        self.rotary = LlamaRotaryEmbedding(g.llama_config())  # inv_freq is a non-persistent buffer
        self.feature_layers = list(config.aux_layers)

    @classmethod
    def for_target(cls, target: nn.Module, mask_token_id: int, block_size: int = 8, num_layers: int = 1,
                   aux_layers: list[int] | None = None, draft_vocab: torch.Tensor | None = None,
                   qk_norm: bool = True, correction_rank: int = 0, markov_rank: int = 0,
                   confidence_head: bool = False, confidence_with_markov: bool = True) -> "DFlashDrafter":
        """A fresh drafter for ``target``; ``draft_vocab`` (target ids) gives it an own lm_head over
        those tokens, initialised from the target's rows."""
        g = LayerGeometry.from_target(target.config)
        V = int(target.get_output_embeddings().weight.shape[0])
        layers = aux_layers or default_context_layers(int(target.config.num_hidden_layers))
        cfg = DFlashConfig(hidden_size=g.hidden_size, vocab_size=V, block_size=block_size, num_layers=num_layers,
                           aux_layers=list(layers), mask_token_id=int(mask_token_id), qk_norm=qk_norm, layer=g,
                           correction_rank=correction_rank, markov_rank=markov_rank,
                           confidence_head=confidence_head, confidence_with_markov=confidence_with_markov,
                           draft_vocab_size=None if draft_vocab is None else int(torch.as_tensor(draft_vocab).numel()))
        heads = cls(cfg, TargetInfo.of(target)).to(target.get_output_embeddings().weight.device)
        if draft_vocab is not None:
            heads.set_draft_vocab(draft_vocab)
            W = target.get_output_embeddings().weight  # (V, H)
            with torch.no_grad():
                heads.lm_head.weight.copy_(W[heads.draft_token_ids().to(W.device)].to(heads.lm_head.weight))
        return heads.attach(target)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def draft_vocab_size(self) -> int:
        return self.config.draft_vocab_size or self.config.vocab_size

    @property
    def has_correction(self) -> bool:
        return self.config.correction_rank > 0

    @property
    def has_markov(self) -> bool:
        return self.config.markov_rank > 0

    @property
    def has_confidence(self) -> bool:
        return self.config.confidence_head

    # -- the forward pieces -------------------------------------------------------------------
    def fuse(self, target_features: list[torch.Tensor]) -> torch.Tensor:
        """K target layers' states, each (B, C, H) -> the normed context (B, C, H)."""
        return self.hidden_norm(self.fc(torch.cat(target_features, dim=-1).to(self.fc.weight.dtype)))

    def context_kv(self, context: torch.Tensor, position_ids: torch.Tensor) -> ContextKV:
        """context (B, C, H) from ``fuse`` at positions (B|1, C) -> every layer's keys and values."""
        cos, sin = self.rotary(context, position_ids)
        return [layer.self_attn.context_kv(context, cos, sin) for layer in self.layers]

    def block_embeddings(self, anchors: torch.Tensor) -> torch.Tensor:
        """anchors (B, n) token ids -> (B, n * block_size, H): each anchor's embedding then
        block_size - 1 mask-token embeddings."""
        B, n = anchors.shape
        ids = torch.full((B, n, self.block_size), self.config.mask_token_id, dtype=torch.long, device=anchors.device)
        ids[:, :, 0] = anchors
        return self.target_embed(ids.view(B, -1)).to(self.fc.weight.dtype)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, context: ContextKV,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, Q, H) block embeddings at positions (B|1, Q); context from ``context_kv``; mask None
        (every query sees every context entry and the whole block) or float additive (B|1, 1, Q, C + Q)
        -> pre-norm outputs (B, Q, H)."""
        cos, sin = self.rotary(x, position_ids)
        for layer, (k, v) in zip(self.layers, context):
            x = layer(x, cos, sin, k, v, mask)
        return x

    def logits(self, h: torch.Tensor, state: torch.Tensor | None = None,
               parents: torch.Tensor | None = None) -> torch.Tensor:
        """(..., H) pre-norm slot outputs -> (..., Vd): the final norm, then the own draft-vocabulary lm_head
        or the target's; plus the path correction of ``state`` (..., r) when given; plus, for a drafter
        with a Markov head, its bias from ``parents`` (...,), the target id before each slot (required)."""
        h = self.norm(h)
        if self.has_draft_vocab:
            logits = self.lm_head(h)
        else:
            lm = self.target_lm_head
            logits = lm(h.to(lm.weight.dtype))
        if state is not None:
            logits = logits + self.correction.out(state).to(logits.dtype)
        if self.has_markov:
            if parents is None:
                raise HeadsError("a DFlash drafter with a Markov head (DSpark) needs the token before each slot "
                                 "(parents) for its logits")
            logits = logits + self.markov_head.markov_w2(self.markov_head.embed(parents)).to(logits.dtype)
        return logits

    def confidence_logit(self, h: torch.Tensor, parents: torch.Tensor | None = None) -> torch.Tensor:
        """(..., H) pre-norm slot outputs, parents (...,) target ids -> (...,) the confidence head's logit."""
        x = self.norm(h)
        if self.config.confidence_with_markov:
            x = torch.cat([x, self.markov_head.embed(parents).to(x.dtype)], dim=-1)
        return self.confidence_head(x.to(self.confidence_head.proj.weight.dtype))

    def confidence(self, h: torch.Tensor, parents: torch.Tensor | None = None) -> torch.Tensor:
        """The chance each slot's draft is accepted, (...,) in [0, 1] (``survival`` chains them)."""
        return torch.sigmoid(self.confidence_logit(h, parents).float())

    draft_logits = logits  # the same in every mode
    draft_to_target_ids = DraftVocab.to_target_ids

    def correction_step(self, state: torch.Tensor | None, parents: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """One step of the path correction: parents (n,) target ids, slot (n, H) the pre-norm output of
        the slot after them, state (n, r) of the parents (None at the root) -> the slot's state (n, r)."""
        return self.correction.step(state, self.target_embed(parents).to(slot.dtype), self.norm(slot))

    def path_states(self, out: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """Teacher-forced correction states: out (..., S, H) pre-norm outputs of slots 1..S, parents
        (..., S) the target ids before each slot (the anchor first) -> (..., S, r)."""
        lead, S = out.shape[:-2], out.shape[-2]
        flat_out, flat_par = out.reshape(-1, S, out.shape[-1]), parents.reshape(-1, S)
        state, states = None, []
        for k in range(S):
            state = self.correction_step(state, flat_par[:, k], flat_out[:, k])
            states.append(state)
        return torch.stack(states, dim=1).view(*lead, S, -1)

    def block_outputs(self, anchor: torch.Tensor, position: torch.Tensor, context: ContextKV) -> torch.Tensor:
        """One block per row: anchor (B,) tokens at positions (B,), context entries of every earlier
        position -> pre-norm outputs (B, block_size - 1, H) of the slots after the anchor."""
        x = self.block_embeddings(anchor[:, None])  # (B, bs, H)
        pos = position[:, None] + torch.arange(self.block_size, device=anchor.device)  # (B, bs)
        return self(x, pos, context)[:, 1:]


def extend_context(context: ContextKV | None, new: ContextKV) -> ContextKV:
    """Append the keys and values of new positions to each layer's (a new list; tensors are never
    written in place, so a copy of the list is an independent context)."""
    if context is None:
        return new
    return [(torch.cat([k, k2], dim=2), torch.cat([v, v2], dim=2)) for (k, v), (k2, v2) in zip(context, new)]
