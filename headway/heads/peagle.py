"""P-EAGLE drafter (Hui et al. 2026, arXiv 2602.01469): an EAGLE-3 drafter that drafts all K tokens
of a chain in one forward pass (docs/peagle.md).

The inputs are EAGLE-3's: at sequence index t the token x_{t+1} and the fused target feature f_t
(three target layers through ``fc``), at position id t; the output at t predicts x_{t+2}. One call
appends K - 1 *mask slots* after the last real index a: each holds the mask token's embedding and a
learned placeholder feature (``mask_hidden``, 3H wide, fused by the same ``fc``), at positions
a + 1 .. a + K - 1, and attention stays causal. Slot k then predicts x_{a+k+2}: the real slot and
the K - 1 mask slots give the K draft distributions of one chain, none of them reading a drafted
token. K (``num_depths``) is fixed at training time, as vLLM's ``num_speculative_tokens``.

The layout is vLLM 0.32's (``models/llama_eagle3.py`` with ``parallel_drafting``): layer 0 is the
EAGLE-3 layer (attention over ``cat(input_norm(embed), hidden_norm(hidden))``), layers 1.. are plain
Llama layers over the hidden state, then ``norm`` and an own ``lm_head`` over a draft vocabulary
(``d2t`` / ``t2d``). The target's embeddings are borrowed, or (``own_embeddings``, as speculators
trains P-EAGLE) the drafter owns a copy it trains.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from ..config import opt
from ..target import TargetInfo
from .base import DraftVocab, HeadsBase
from .eagle import default_aux_layers
from .layers import DraftDecoderLayer, LayerCaches, LayerGeometry, PreNormDecoderLayer, causal_mask


@dataclass
class PEagleConfig:
    hidden_size: int = opt(help="target hidden size")
    vocab_size: int = opt(help="target vocabulary size")
    draft_vocab_size: int = opt(help="size of the reduced draft vocabulary")
    aux_layers: list[int] = opt(default_factory=list, help="HF hidden-state indices of the fused target layers")
    num_depths: int = opt(4, "K: tokens one call drafts (the real slot and K - 1 mask slots), fixed at training")
    num_layers: int = opt(1, "decoder layers: the fused EAGLE-3 layer, then plain Llama layers")
    mask_token_id: int = opt(0, "target token whose embedding fills the mask slots")
    norm_before_fc: bool = opt(False, "RMSNorm (3H wide, 'input_norm') over the concatenated target states before fc")
    norm_before_residual: bool = opt(False, "layer 0's residual is hidden_norm(hidden) instead of hidden")
    own_embeddings: bool = opt(False, "an own token embedding (trained) instead of the target's (borrowed, frozen)")
    layer: LayerGeometry = field(default_factory=lambda: LayerGeometry(0, 0, 1, 1, 1))

    def __post_init__(self) -> None:
        if len(self.aux_layers) != 3:
            raise ValueError(f"P-EAGLE fuses exactly 3 target layers; got aux_layers={self.aux_layers}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in 1..{self.vocab_size}; got {self.draft_vocab_size}")
        if self.num_depths < 2:
            raise ValueError(f"num_depths must be >= 2 (one mask slot at least); got {self.num_depths}")
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1; got {self.num_layers}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id must be a target token id in 0..{self.vocab_size - 1}; "
                             f"got {self.mask_token_id}")


class PEagleDrafter(DraftVocab, HeadsBase):
    kind = "peagle"
    config_class = PEagleConfig

    def __init__(self, config: PEagleConfig, target_info: TargetInfo | None = None) -> None:
        super().__init__(config, target_info)
        H, g = config.hidden_size, config.layer
        if config.norm_before_fc:
            self.input_norm = LlamaRMSNorm(3 * H, eps=g.rms_norm_eps)
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.mask_hidden = nn.Parameter(torch.randn(3 * H) * 0.02)  # (3H,) the mask slots' target states
        self.layers = nn.ModuleList([DraftDecoderLayer(g, fused_input=True,
                                                       norm_before_residual=config.norm_before_residual)])
        self.layers.extend(PreNormDecoderLayer(g) for _ in range(config.num_layers - 1))
        self.norm = LlamaRMSNorm(H, eps=g.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        if config.own_embeddings:
            self.embed_tokens = nn.Embedding(config.vocab_size, H)
        self._init_draft_vocab(config.draft_vocab_size, config.vocab_size)
        self.rotary = LlamaRotaryEmbedding(g.llama_config())  # inv_freq is a non-persistent buffer
        self.feature_layers = list(config.aux_layers)

    @classmethod
    def for_target(cls, target: nn.Module, draft_vocab_size: int | None = None, aux_layers: list[int] | None = None,
                   num_depths: int = 4, num_layers: int = 1, mask_token_id: int = 0, norm_before_fc: bool = False,
                   norm_before_residual: bool = False, own_embeddings: bool = False) -> "PEagleDrafter":
        """A fresh drafter for ``target``; with ``own_embeddings`` its embedding starts as the target's."""
        g = LayerGeometry.from_target(target.config)
        V = int(target.get_output_embeddings().weight.shape[0])
        cfg = PEagleConfig(hidden_size=g.hidden_size, vocab_size=V, draft_vocab_size=draft_vocab_size or V,
                           aux_layers=aux_layers or default_aux_layers(int(target.config.num_hidden_layers)),
                           num_depths=num_depths, num_layers=num_layers, mask_token_id=int(mask_token_id),
                           norm_before_fc=norm_before_fc, norm_before_residual=norm_before_residual,
                           own_embeddings=own_embeddings, layer=g)
        heads = cls(cfg, TargetInfo.of(target)).to(target.get_output_embeddings().weight.device)
        if own_embeddings:
            with torch.no_grad():
                heads.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        return heads.attach(target)

    @property
    def num_depths(self) -> int:
        return self.config.num_depths

    @property
    def draft_vocab_size(self) -> int:
        return self.config.draft_vocab_size

    def new_cache(self) -> LayerCaches:
        return LayerCaches(self.config.num_layers)

    # -- the forward pieces ---------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        emb = self.embed_tokens if self.config.own_embeddings else self.target_embed
        return emb(input_ids).to(self.fc.weight.dtype)

    def _fc(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.fc.weight.dtype)
        return self.fc(self.input_norm(x) if self.config.norm_before_fc else x)

    def fuse(self, target_features: list[torch.Tensor]) -> torch.Tensor:
        """Three target layers' states, each (B, T, H) -> fused hidden (B, T, H)."""
        return self._fc(torch.cat(target_features, dim=-1))  # (B, T, 3H) -> (B, T, H)

    def mask_feature(self) -> torch.Tensor:
        """(H,) the fused hidden every mask slot reads: ``mask_hidden`` through the same input norm and fc."""
        return self._fc(self.mask_hidden)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor | None, cache: LayerCaches | None = None) -> torch.Tensor:
        """input_ids (B, T); hidden (B, T, H) fused (``fuse`` / ``mask_feature``) at positions (B|1, T); mask
        float additive (B|1, 1, T, cached + T) or None (every query sees every key) -> pre-norm output (B, T, H)."""
        h = hidden.to(self.fc.weight.dtype)
        cos, sin = self.rotary(h, position_ids)
        first, *rest = self.layers
        h = first(h, cos, sin, mask, None if cache is None else cache[0], embeds=self.embed(input_ids))
        for i, layer in enumerate(rest, start=1):
            h = layer(h, cos, sin, mask, None if cache is None else cache[i])
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., H) pre-norm outputs -> (..., draft_vocab) logits."""
        return self.lm_head(self.norm(h))

    draft_logits = logits  # the same in every mode
    draft_to_target_ids = DraftVocab.to_target_ids

    # -- one parallel draft (what a proposer calls) -------------------------------------------------
    def with_mask_slots(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append the K - 1 mask slots after the real slots of each row: input_ids (B, T), fused hidden
        (B, T, H), position_ids (B, T) -> the same three with T + K - 1 columns; mask slot k sits at the
        last real position + k."""
        B, n = input_ids.shape[0], self.num_depths - 1
        ids = input_ids.new_full((B, n), self.config.mask_token_id)
        hid = self.mask_feature().to(hidden.dtype).expand(B, n, -1)
        pos = position_ids[:, -1:] + torch.arange(1, n + 1, device=position_ids.device)
        return (torch.cat([input_ids, ids], 1), torch.cat([hidden, hid], 1), torch.cat([position_ids, pos], 1))

    def draft(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
              cache: LayerCaches) -> torch.Tensor:
        """One parallel draft for unpadded rows: the real slots not yet in ``cache`` (input_ids (B, T) =
        x_{t+1}, fused hidden (B, T, H) = f_t, position_ids (B, T) = t, continuing the cache) -> logits
        (B, K, Vd) of the K tokens after the last real slot. The real slots' keys stay in the cache (the
        next draft's prefix), the mask slots' are dropped."""
        past = len(cache)
        ids, hid, pos = self.with_mask_slots(input_ids, hidden, position_ids)
        mask = causal_mask(ids.shape[1], past, self.fc.weight.dtype, ids.device)
        out = self(ids, hid, pos, mask, cache)  # (B, T + K - 1, H)
        cache.crop(past + input_ids.shape[1])
        return self.logits(out[:, -self.num_depths:])  # (B, K, Vd)
