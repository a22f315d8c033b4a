"""Medusa heads (Cai et al. 2024): K independent heads on the target's final hidden state.

Head k (0-based) at position t predicts token t + k + 2; the target's own lm_head predicts t + 1.
Tensor names follow vLLM's Medusa layout (``blocks.{h}.layers.{l}``, ``lm_heads.{h}``).

With ``draft_vocab_size`` N each head's own lm_head has N rows: the heads predict over a reduced
draft vocabulary (buffers ``d2t`` / ``t2d``, EAGLE-3's format; draft id i is target id i + d2t[i]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import opt
from ..target import TargetInfo
from .base import DraftVocab, HeadsBase


@dataclass
class MedusaConfig:
    hidden_size: int = opt(help="target hidden size")
    vocab_size: int = opt(help="target vocabulary size")
    num_heads: int = opt(4, "number of Medusa heads (draft depth)")
    num_layers: int = opt(1, "ResBlocks per head")
    own_lm_head: bool = opt(True, "each head has its own vocab projection (initialised from the target's "
                                  "lm_head); false shares the target's frozen lm_head")
    bias: bool = opt(True, "ResBlock linear layers have a bias")
    draft_vocab_size: int | None = opt(None, "rows of each head's own lm_head: a reduced draft vocabulary (d2t / "
                                             "t2d say which target ids); None = the full target vocabulary")

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 0:
            raise ValueError("num_heads must be >= 1 and num_layers >= 0")
        if self.draft_vocab_size is not None:
            if not self.own_lm_head:
                raise ValueError("draft_vocab_size needs own_lm_head=true (a shared target lm_head covers the "
                                 "full vocabulary)")
            if not 0 < self.draft_vocab_size <= self.vocab_size:
                raise ValueError(f"draft_vocab_size must be in 1..{self.vocab_size}; got {self.draft_vocab_size}")


class ResBlock(nn.Module):
    """x + SiLU(W x + b) for each of ``num_layers`` distinct linears, zero-initialised so an
    untrained head starts as the identity on the target's hidden state."""

    def __init__(self, hidden_size: int, num_layers: int, bias: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers))
        for lin in self.layers:
            nn.init.zeros_(lin.weight)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.layers:
            x = x + F.silu(lin(x))
        return x


class MedusaHeads(DraftVocab, HeadsBase):
    kind = "medusa"
    config_class = MedusaConfig

    def __init__(self, config: MedusaConfig, target_info: TargetInfo | None = None) -> None:
        super().__init__(config, target_info)
        H = config.hidden_size
        self.feature_layers = [-1]  # the target's final post-norm state
        self.blocks = nn.ModuleList(ResBlock(H, config.num_layers, config.bias) for _ in range(config.num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(H, self.draft_vocab_size, bias=False)
                                      for _ in range(config.num_heads)) if config.own_lm_head else None
        if config.draft_vocab_size is not None:  # checkpoints without one keep exactly the old tensors
            self._init_draft_vocab(config.draft_vocab_size, config.vocab_size)

    @classmethod
    def for_target(cls, target: nn.Module, draft_vocab: torch.Tensor | None = None, **kwargs) -> "MedusaHeads":
        """New heads sized for ``target``; own lm_heads start as copies of the target's rows (of the
        ``draft_vocab`` target ids when given, else of every token)."""
        if draft_vocab is not None:
            kwargs["draft_vocab_size"] = int(torch.as_tensor(draft_vocab).numel())
        cfg = MedusaConfig(hidden_size=int(target.config.hidden_size),
                           vocab_size=int(target.get_output_embeddings().weight.shape[0]), **kwargs)
        heads = cls(cfg, TargetInfo.of(target))
        heads.to(device=target.get_output_embeddings().weight.device)
        heads.attach(target)
        if draft_vocab is not None:
            heads.set_draft_vocab(draft_vocab)
        heads.init_lm_heads(target)
        return heads

    def init_lm_heads(self, target: nn.Module) -> None:
        """Own lm_heads <- the target's output rows of the draft vocabulary (all rows without one)."""
        if self.lm_heads is None:
            return
        W = target.get_output_embeddings().weight  # (V, H)
        rows = W if not self.has_draft_vocab else W[self.draft_token_ids().to(W.device)]  # (Vd, H)
        with torch.no_grad():
            for lm in self.lm_heads:
                lm.weight.copy_(rows.float())

    @property
    def draft_vocab_size(self) -> int:
        return self.config.draft_vocab_size or self.config.vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (..., H) final post-norm target states -> logits (K, ..., Vd) over draft ids
        (Vd = V, draft id = target id, without a draft vocabulary)."""
        out = []
        for k, block in enumerate(self.blocks):
            h = block(hidden)
            if self.lm_heads is not None:
                out.append(self.lm_heads[k](h))
            else:  # the borrowed lm_head keeps the target's dtype (fp32 heads on a bf16 target)
                lm = self.target_lm_head
                out.append(lm(h.to(lm.weight.dtype)))
        return torch.stack(out)
