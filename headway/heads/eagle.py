"""EAGLE drafters: feature-level drafting with one decoder layer of the target's geometry.

EAGLE-1 (Li et al. 2024): input at position t is ``fc(cat(embed(x_{t+1}), f_t))`` with f the
target's final post-norm hidden state; the layer's output predicts f_{t+1}; logits come from
the target's frozen lm_head. Predicted features are fed back through ``fc`` when drafting.

EAGLE-3 (Li et al. 2025): target features are three layers' hidden states fused by
``fc: 3H -> H``; the layer reads ``cat(input_norm(embed), hidden_norm(hidden))``; its output
(pre-norm) is fed back as the next step's ``hidden``; logits come from its own ``norm`` and
``lm_head`` over a reduced draft vocabulary (draft id i is target id ``i + d2t[i]``).

Feature indices are HF ``output_hidden_states`` indices (0 = embeddings, L = last layer output
after the final norm in transformers v5); "final" means index -1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from ..config import opt
from ..target import TargetInfo
from .base import HeadsBase, HeadsError
from .layers import DraftCache, DraftDecoderLayer, LayerGeometry


def default_aux_layers(num_hidden_layers: int) -> list[int]:
    """EAGLE-3's low/middle/high layers as HF hidden-state indices: (2, L//2, L-3) when those are
    distinct; shallower targets get three distinct indices spread as evenly as they allow."""
    L = num_hidden_layers
    if L < 2:
        raise HeadsError(f"EAGLE-3 needs a target with at least 2 layers; this one has {L}")
    for want in ([2, L // 2, L - 3], [1, L // 2, L - 1], [L - 2, L - 1, L]):
        if 0 <= want[0] < want[1] < want[2] <= L:
            return want
    raise AssertionError("unreachable")  # [L-2, L-1, L] always qualifies


@dataclass
class Eagle1Config:
    hidden_size: int = opt(help="target hidden size")
    vocab_size: int = opt(help="target vocabulary size")
    layer: LayerGeometry = field(default_factory=lambda: LayerGeometry(0, 0, 1, 1, 1))
    fc_bias: bool = opt(False, "bias on fc (vLLM's EAGLE-1 has none)")


@dataclass
class Eagle3Config:
    hidden_size: int = opt(help="target hidden size")
    vocab_size: int = opt(help="target vocabulary size")
    draft_vocab_size: int = opt(help="size of the reduced draft vocabulary")
    aux_layers: list[int] = opt(default_factory=list, help="HF hidden-state indices of the fused target layers")
    layer: LayerGeometry = field(default_factory=lambda: LayerGeometry(0, 0, 1, 1, 1))

    def __post_init__(self) -> None:
        if len(self.aux_layers) != 3:
            raise ValueError(f"EAGLE-3 fuses exactly 3 target layers; got aux_layers={self.aux_layers}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in 1..{self.vocab_size}; got {self.draft_vocab_size}")


class _EagleBase(HeadsBase):
    """Shared plumbing: rotary embedding, target embedding, the one-layer step."""

    feature_layers: list[int]

    def _init_rotary(self, g: LayerGeometry) -> None:
        self.rotary = LlamaRotaryEmbedding(g.llama_config())  # inv_freq is a non-persistent buffer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.target_embed(input_ids).to(self.fc.weight.dtype)

    def rope(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(x, position_ids)

    def new_cache(self) -> DraftCache:
        return DraftCache()


class Eagle1Drafter(_EagleBase):
    kind = "eagle1"
    config_class = Eagle1Config

    def __init__(self, config: Eagle1Config, target_info: TargetInfo | None = None) -> None:
        super().__init__(config, target_info)
        H = config.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=config.fc_bias)
        self.layers = nn.ModuleList([DraftDecoderLayer(config.layer, fused_input=False)])
        self._init_rotary(config.layer)
        self.feature_layers = [-1]

    @classmethod
    def for_target(cls, target: nn.Module, fc_bias: bool = False) -> "Eagle1Drafter":
        g = LayerGeometry.from_target(target.config)
        cfg = Eagle1Config(hidden_size=g.hidden_size, vocab_size=int(target.get_output_embeddings().weight.shape[0]),
                           layer=g, fc_bias=fc_bias)
        return cls(cfg, TargetInfo.of(target)).to(target.get_output_embeddings().weight.device).attach(target)

    def fuse(self, target_features: list[torch.Tensor]) -> torch.Tensor:
        """Target features (one tensor, the final post-norm state) -> the drafter's hidden input."""
        return target_features[0]

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor | None, cache: DraftCache | None = None) -> torch.Tensor:
        """input_ids (B, T) = x_{t+1}; hidden (B, T, H) = f_t -> predicted f_{t+1} (B, T, H)."""
        x = self.fc(torch.cat([self.embed(input_ids), hidden.to(self.fc.weight.dtype)], dim=-1))
        cos, sin = self.rope(x, position_ids)
        return self.layers[0](x, cos, sin, mask, cache)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(B, T, H) -> (B, T, V) over the full target vocabulary."""
        lm = self.target_lm_head
        return lm(h.to(lm.weight.dtype))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids


class Eagle3Drafter(_EagleBase):
    kind = "eagle3"
    config_class = Eagle3Config

    def __init__(self, config: Eagle3Config, target_info: TargetInfo | None = None) -> None:
        super().__init__(config, target_info)
        H, Vd = config.hidden_size, config.draft_vocab_size
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.midlayer = DraftDecoderLayer(config.layer, fused_input=True)
        self.norm = LlamaRMSNorm(H, eps=config.layer.rms_norm_eps)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        # identity draft vocabulary until set_draft_vocab: draft id i is target id i
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[:Vd] = True
        self.register_buffer("t2d", t2d)
        self._init_rotary(config.layer)
        self.feature_layers = list(config.aux_layers)

    @classmethod
    def for_target(cls, target: nn.Module, draft_vocab_size: int | None = None,
                   aux_layers: list[int] | None = None) -> "Eagle3Drafter":
        g = LayerGeometry.from_target(target.config)
        V = int(target.get_output_embeddings().weight.shape[0])
        cfg = Eagle3Config(hidden_size=g.hidden_size, vocab_size=V, draft_vocab_size=draft_vocab_size or V,
                           aux_layers=aux_layers or default_aux_layers(int(target.config.num_hidden_layers)), layer=g)
        return cls(cfg, TargetInfo.of(target)).to(target.get_output_embeddings().weight.device).attach(target)

    def set_draft_vocab(self, draft_to_target: torch.Tensor) -> None:
        """Use the given target ids (ascending) as the draft vocabulary; fills d2t / t2d."""
        ids = torch.as_tensor(draft_to_target, dtype=torch.long).sort().values
        if ids.numel() != self.config.draft_vocab_size:
            raise HeadsError(f"draft vocabulary has {ids.numel()} ids, config says {self.config.draft_vocab_size}")
        if ids.unique().numel() != ids.numel() or ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise HeadsError("draft vocabulary ids must be distinct target ids")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    def fuse(self, target_features: list[torch.Tensor]) -> torch.Tensor:
        """Three target layers' states (each (B, T, H)) -> fused hidden (B, T, H)."""
        return self.fc(torch.cat(target_features, dim=-1).to(self.fc.weight.dtype))

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor | None, cache: DraftCache | None = None) -> torch.Tensor:
        """input_ids (B, T) = x_{t+1}; hidden (B, T, H) fused or fed-back -> output (B, T, H), pre-norm."""
        hidden = hidden.to(self.fc.weight.dtype)
        cos, sin = self.rope(hidden, position_ids)
        return self.midlayer(hidden, cos, sin, mask, cache, embeds=self.embed(input_ids))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(B, T, H) -> (B, T, draft_vocab)."""
        return self.lm_head(self.norm(h))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]
