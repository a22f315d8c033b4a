"""EAGLE drafters: feature-level drafting with one decoder layer of the target's geometry.

EAGLE-1 (Li et al. 2024): input at position t is ``fc(cat(embed(x_{t+1}), f_t))`` with f the
target's final post-norm hidden state; the layer's output predicts f_{t+1}; logits come from
the target's frozen lm_head. Predicted features are fed back through ``fc`` when drafting.
Optionally (``draft_vocab_size``) it drafts over a reduced vocabulary: in eval mode (decoding,
evaluation) logits cover only those rows of the target's lm_head, while training still fits the
full distribution (the paper's loss is unchanged).

EAGLE-3 (Li et al. 2025): target features are three layers' hidden states fused by
``fc: 3H -> H``; the layer reads ``cat(input_norm(embed), hidden_norm(hidden))``; its output
(pre-norm) is fed back as the next step's ``hidden``; logits come from its own ``norm`` and
``lm_head`` over a reduced draft vocabulary (draft id i is target id ``i + d2t[i]``). Three options
read speculators checkpoints as trained (``norm_before_fc``, ``norm_before_residual``, ``norm_output``).

Feature indices are HF ``output_hidden_states`` indices (0 = embeddings, L = last layer output
after the final norm in transformers v5); "final" means index -1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from ..config import opt
from ..feature_layers import eagle3_layers
from ..target import TargetInfo
from .base import DraftVocab, HeadsBase, HeadsError
from .layers import DraftCache, DraftDecoderLayer, LayerGeometry


def default_aux_layers(num_hidden_layers: int) -> list[int]:
    """EAGLE-3's low/middle/high layers as HF hidden-state indices (``feature_layers.eagle3_layers``)."""
    try:
        return eagle3_layers(num_hidden_layers)
    except ValueError as e:
        raise HeadsError(str(e)) from None


@dataclass
class Eagle1Config:
    hidden_size: int = opt(help="target hidden size")
    vocab_size: int = opt(help="target vocabulary size")
    layer: LayerGeometry = field(default_factory=lambda: LayerGeometry(0, 0, 1, 1, 1))
    fc_bias: bool = opt(False, "bias on fc (vLLM's EAGLE-1 has none)")
    draft_vocab_size: int | None = opt(None, "draft over only this many target tokens (d2t / t2d say which) "
                                             "when decoding; None = the full target vocabulary")

    def __post_init__(self) -> None:
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in 1..{self.vocab_size}; got {self.draft_vocab_size}")


@dataclass
class Eagle3Config:
    hidden_size: int = opt(help="target hidden size")
    vocab_size: int = opt(help="target vocabulary size")
    draft_vocab_size: int = opt(help="size of the reduced draft vocabulary")
    aux_layers: list[int] = opt(default_factory=list, help="HF hidden-state indices of the fused target layers")
    layer: LayerGeometry = field(default_factory=lambda: LayerGeometry(0, 0, 1, 1, 1))
    # speculators' EAGLE-3 options (its trainer turns the three on by default); headway trains with them off
    norm_before_fc: bool = opt(False, "RMSNorm (3H wide, 'input_norm') over the concatenated target states before fc")
    norm_before_residual: bool = opt(False, "the layer's residual is hidden_norm(hidden) instead of hidden")
    norm_output: bool = opt(False, "each step's output is norm(layer(...)): fed back normed, lm_head reads it as is")

    def __post_init__(self) -> None:
        if len(self.aux_layers) != 3:
            raise ValueError(f"EAGLE-3 fuses exactly 3 target layers; got aux_layers={self.aux_layers}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in 1..{self.vocab_size}; got {self.draft_vocab_size}")


def _version(t: torch.Tensor) -> int:
    """In-place write counter; inference tensors keep none (-1)."""
    return -1 if t.is_inference() else t._version


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


class Eagle1Drafter(DraftVocab, _EagleBase):
    kind = "eagle1"
    config_class = Eagle1Config

    def __init__(self, config: Eagle1Config, target_info: TargetInfo | None = None) -> None:
        super().__init__(config, target_info)
        H = config.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=config.fc_bias)
        self.layers = nn.ModuleList([DraftDecoderLayer(config.layer, fused_input=False)])
        if config.draft_vocab_size is not None:  # checkpoints without one keep exactly the old tensors
            self._init_draft_vocab(config.draft_vocab_size, config.vocab_size)
        self._init_rotary(config.layer)
        self.feature_layers = [-1]

    @classmethod
    def for_target(cls, target: nn.Module, fc_bias: bool = False,
                   draft_vocab: torch.Tensor | None = None) -> "Eagle1Drafter":
        """A fresh drafter for ``target``; ``draft_vocab`` (target ids) restricts decode-time drafting."""
        g = LayerGeometry.from_target(target.config)
        cfg = Eagle1Config(hidden_size=g.hidden_size, vocab_size=int(target.get_output_embeddings().weight.shape[0]),
                           layer=g, fc_bias=fc_bias, draft_vocab_size=None if draft_vocab is None else
                           int(torch.as_tensor(draft_vocab).numel()))
        heads = cls(cfg, TargetInfo.of(target))
        if draft_vocab is not None:
            heads.set_draft_vocab(draft_vocab)
        return heads.to(target.get_output_embeddings().weight.device).attach(target)

    @property
    def draft_vocab_size(self) -> int:
        return self.config.draft_vocab_size or self.config.vocab_size

    def fuse(self, target_features: list[torch.Tensor]) -> torch.Tensor:
        """Target features (one tensor, the final post-norm state) -> the drafter's hidden input."""
        return target_features[0]

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor | None, cache: DraftCache | None = None) -> torch.Tensor:
        """input_ids (B, T) = x_{t+1}; hidden (B, T, H) = f_t -> predicted f_{t+1} (B, T, H)."""
        x = self.fc(torch.cat([self.embed(input_ids), hidden.to(self.fc.weight.dtype)], dim=-1))
        cos, sin = self.rope(x, position_ids)
        return self.layers[0](x, cos, sin, mask, cache)

    def full_logits(self, h: torch.Tensor) -> torch.Tensor:
        """(B, T, H) -> (B, T, V) over the full target vocabulary: the target's own lm_head."""
        lm = self.target_lm_head
        return lm(h.to(lm.weight.dtype))

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """(B, T, H) -> (B, T, Vd): only the draft vocabulary's rows of the target's lm_head."""
        if not self.has_draft_vocab:
            return self.full_logits(h)
        w, b = self._draft_lm_rows()
        return F.linear(h.to(w.dtype), w, b)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Train mode: the full vocabulary (the training loss is the paper's); eval mode (decoding,
        evaluation): the draft vocabulary. ``to_target_ids`` follows the same mode."""
        return self.full_logits(h) if self.training else self.draft_logits(h)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Ids of ``logits`` (train mode: target ids already) -> target ids."""
        return draft_ids if self.training else self.draft_to_target_ids(draft_ids)

    def logit_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids -> indices into ``logits`` (train mode: the full vocabulary, so the ids themselves)."""
        return target_ids if self.training else DraftVocab.logit_ids(self, target_ids)

    def draft_to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Ids of ``draft_logits`` -> target ids, whatever the mode."""
        return DraftVocab.to_target_ids(self, draft_ids)

    def _draft_lm_rows(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft vocabulary's rows of the target's lm_head, (Vd, H) weight and (Vd,) bias or None.

        Sliced once and cached outside the state dict; rebuilt when the target's weight changes
        (moved, cast, edited in place: storage, device, dtype or version differ) or the draft
        vocabulary does, and dropped when the drafter is moved (``_apply``). The check reads
        tensor metadata only: no device sync."""
        lm = self.target_lm_head
        W, bias = lm.weight, getattr(lm, "bias", None)
        key = (W.data_ptr(), W.device, W.dtype, _version(W), self.d2t.data_ptr(), _version(self.d2t))
        cached = self.__dict__.get("_lm_rows")
        if cached is None or cached[0] != key:
            with torch.no_grad():
                ids = self.draft_token_ids().to(W.device)  # (Vd,)
                w = W.detach()[ids].contiguous()  # (Vd, H)
                b = None if bias is None else bias.detach()[ids].contiguous()  # (Vd,)
            cached = (key, w, b)
            object.__setattr__(self, "_lm_rows", cached)  # not a submodule / buffer: never saved
        return cached[1], cached[2]

    def _apply(self, fn, *args, **kwargs):  # .to() / .cuda() / .half(): the cached rows follow next call
        self.__dict__.pop("_lm_rows", None)
        return super()._apply(fn, *args, **kwargs)


class Eagle3Drafter(DraftVocab, _EagleBase):
    kind = "eagle3"
    config_class = Eagle3Config

    def __init__(self, config: Eagle3Config, target_info: TargetInfo | None = None) -> None:
        super().__init__(config, target_info)
        H, Vd = config.hidden_size, config.draft_vocab_size
        if config.norm_before_fc:
            self.input_norm = LlamaRMSNorm(3 * H, eps=config.layer.rms_norm_eps)
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.midlayer = DraftDecoderLayer(config.layer, fused_input=True,
                                          norm_before_residual=config.norm_before_residual)
        self.norm = LlamaRMSNorm(H, eps=config.layer.rms_norm_eps)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        self._init_draft_vocab(Vd, config.vocab_size)  # identity until set_draft_vocab: draft id i is target id i
        self._init_rotary(config.layer)
        self.feature_layers = list(config.aux_layers)

    @classmethod
    def for_target(cls, target: nn.Module, draft_vocab_size: int | None = None,
                   aux_layers: list[int] | None = None, norm_output: bool = False, norm_before_fc: bool = False,
                   norm_before_residual: bool = False) -> "Eagle3Drafter":
        g = LayerGeometry.from_target(target.config)
        V = int(target.get_output_embeddings().weight.shape[0])
        cfg = Eagle3Config(hidden_size=g.hidden_size, vocab_size=V, draft_vocab_size=draft_vocab_size or V,
                           aux_layers=aux_layers or default_aux_layers(int(target.config.num_hidden_layers)), layer=g,
                           norm_output=norm_output, norm_before_fc=norm_before_fc,
                           norm_before_residual=norm_before_residual)
        return cls(cfg, TargetInfo.of(target)).to(target.get_output_embeddings().weight.device).attach(target)

    def fuse(self, target_features: list[torch.Tensor]) -> torch.Tensor:
        """Three target layers' states (each (B, T, H)) -> fused hidden (B, T, H)."""
        x = torch.cat(target_features, dim=-1).to(self.fc.weight.dtype)  # (B, T, 3H)
        return self.fc(self.input_norm(x) if self.config.norm_before_fc else x)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor | None, cache: DraftCache | None = None) -> torch.Tensor:
        """input_ids (B, T) = x_{t+1}; hidden (B, T, H) fused or fed-back -> output (B, T, H), pre-norm."""
        hidden = hidden.to(self.fc.weight.dtype)
        cos, sin = self.rope(hidden, position_ids)
        h = self.midlayer(hidden, cos, sin, mask, cache, embeds=self.embed(input_ids))
        return self.norm(h) if self.config.norm_output else h

    @property
    def draft_vocab_size(self) -> int:
        return self.config.draft_vocab_size

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(B, T, H) -> (B, T, draft_vocab); with ``norm_output`` ``h`` is normed already."""
        return self.lm_head(h if self.config.norm_output else self.norm(h))

    draft_logits = logits  # the same in every mode
    draft_to_target_ids = DraftVocab.to_target_ids
