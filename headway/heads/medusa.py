"""Medusa heads (Cai et al. 2024): K independent heads on the target's final hidden state.

Head k (0-based) at position t predicts token t + k + 2; the target's own lm_head predicts t + 1.
Tensor names follow vLLM's Medusa layout (``blocks.{h}.layers.{l}``, ``lm_heads.{h}``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import opt
from ..target import TargetInfo
from .base import HeadsBase


@dataclass
class MedusaConfig:
    hidden_size: int = opt(help="target hidden size")
    vocab_size: int = opt(help="target vocabulary size")
    num_heads: int = opt(4, "number of Medusa heads (draft depth)")
    num_layers: int = opt(1, "ResBlocks per head")
    own_lm_head: bool = opt(True, "each head has its own vocab projection (initialised from the target's "
                                  "lm_head); false shares the target's frozen lm_head")
    bias: bool = opt(True, "ResBlock linear layers have a bias")

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 0:
            raise ValueError("num_heads must be >= 1 and num_layers >= 0")


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


class MedusaHeads(HeadsBase):
    kind = "medusa"
    config_class = MedusaConfig

    def __init__(self, config: MedusaConfig, target_info: TargetInfo | None = None) -> None:
        super().__init__(config, target_info)
        H, V = config.hidden_size, config.vocab_size
        self.blocks = nn.ModuleList(ResBlock(H, config.num_layers, config.bias) for _ in range(config.num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(H, V, bias=False) for _ in range(config.num_heads)) \
            if config.own_lm_head else None

    @classmethod
    def for_target(cls, target: nn.Module, **kwargs) -> "MedusaHeads":
        """New heads sized for ``target``; own lm_heads start as copies of the target's."""
        cfg = MedusaConfig(hidden_size=int(target.config.hidden_size),
                           vocab_size=int(target.get_output_embeddings().weight.shape[0]), **kwargs)
        heads = cls(cfg, TargetInfo.of(target))
        heads.to(device=target.get_output_embeddings().weight.device)
        heads.attach(target)
        if heads.lm_heads is not None:
            with torch.no_grad():
                for lm in heads.lm_heads:
                    lm.weight.copy_(target.get_output_embeddings().weight.float())
        return heads

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (..., H) final post-norm target states -> logits (K, ..., V)."""
        out = []
        for k, block in enumerate(self.blocks):
            h = block(hidden)
            out.append(self.lm_heads[k](h) if self.lm_heads is not None else self.target_lm_head(h))
        return torch.stack(out)
