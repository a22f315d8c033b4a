"""The one decoder layer an EAGLE drafter owns, with the target's attention geometry.

Rotary embeddings and RMSNorm come from stock transformers (Llama); attention is SDPA over
an explicit float additive mask, so the same code serves training (training-time-test masks)
and tree drafting (tree masks over a ``DraftCache``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb


@dataclass
class LayerGeometry:
    """Attention/MLP shape of the drafter layer, read from the target's config."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    attention_bias: bool = False

    @classmethod
    def from_target(cls, cfg: Any) -> "LayerGeometry":
        heads = int(cfg.num_attention_heads)
        rope = dict(getattr(cfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
        rope.pop("partial_rotary_factor", None)  # the drafter rotates the full head dim
        eps = getattr(cfg, "rms_norm_eps", None) or getattr(cfg, "layer_norm_eps", None) or 1e-6
        return cls(
            hidden_size=int(cfg.hidden_size),
            intermediate_size=int(cfg.intermediate_size),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
            rms_norm_eps=float(eps),
            max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 4096)),
            rope_parameters=rope,
        )

    def llama_config(self) -> LlamaConfig:
        return LlamaConfig(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                           head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
                           max_position_embeddings=self.max_position_embeddings,
                           rope_parameters=dict(self.rope_parameters), num_hidden_layers=1)


class DraftCache:
    """Keys/values of the drafter's single layer: (B, kv_heads, T, head_dim) each."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = torch.cat([self.keys, k], dim=-2)
            self.values = torch.cat([self.values, v], dim=-2)
        return self.keys, self.values

    def crop(self, length: int) -> None:
        """Keep the first ``length`` entries (drop tree nodes after a draft)."""
        if self.keys is not None and length < len(self):
            self.keys = self.keys[..., :length, :]
            self.values = self.values[..., :length, :]


class DraftAttention(nn.Module):
    def __init__(self, g: LayerGeometry, input_size: int) -> None:
        super().__init__()
        self.g = g
        self.q_proj = nn.Linear(input_size, g.num_attention_heads * g.head_dim, bias=g.attention_bias)
        self.k_proj = nn.Linear(input_size, g.num_key_value_heads * g.head_dim, bias=g.attention_bias)
        self.v_proj = nn.Linear(input_size, g.num_key_value_heads * g.head_dim, bias=g.attention_bias)
        self.o_proj = nn.Linear(g.num_attention_heads * g.head_dim, g.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: DraftCache | None) -> torch.Tensor:
        """``mask`` None: every query sees every key (one query at the end of the cache)."""
        B, T, _ = x.shape  # (B, T, input_size)
        g = self.g
        q = self.q_proj(x).view(B, T, g.num_attention_heads, g.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, g.num_key_value_heads, g.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, g.num_key_value_heads, g.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if cache is not None:
            k, v = cache.append(k, v)  # (B, nkv, S, hd), S = cached + T
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask.to(q.dtype),
                                           enable_gqa=g.num_key_value_heads != g.num_attention_heads)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, H)


class DraftMLP(nn.Module):
    def __init__(self, g: LayerGeometry) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(g.hidden_size, g.intermediate_size, bias=False)
        self.up_proj = nn.Linear(g.hidden_size, g.intermediate_size, bias=False)
        self.down_proj = nn.Linear(g.intermediate_size, g.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftDecoderLayer(nn.Module):
    """Llama-style layer. ``fused_input=True`` is the EAGLE-3 variant: attention reads
    ``cat(input_layernorm(embed), hidden_norm(hidden))`` (2H wide) and the residual is ``hidden``
    (``hidden_norm(hidden)`` with ``norm_before_residual``, as speculators trains by default).
    Without it (EAGLE-1) there is no input norm: attention reads ``hidden`` directly."""

    def __init__(self, g: LayerGeometry, fused_input: bool = False, norm_before_residual: bool = False) -> None:
        super().__init__()
        self.fused_input = fused_input
        self.norm_before_residual = norm_before_residual  # speculators' option: the residual is hidden_norm(hidden)
        H = g.hidden_size
        if fused_input:
            self.input_layernorm = LlamaRMSNorm(H, eps=g.rms_norm_eps)
            self.hidden_norm = LlamaRMSNorm(H, eps=g.rms_norm_eps)
        self.self_attn = DraftAttention(g, 2 * H if fused_input else H)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=g.rms_norm_eps)
        self.mlp = DraftMLP(g)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: DraftCache | None = None, embeds: torch.Tensor | None = None) -> torch.Tensor:
        if self.fused_input:
            normed = self.hidden_norm(hidden)  # (B, T, H)
            x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # (B, T, 2H)
            if self.norm_before_residual:
                hidden = normed
        else:
            x = hidden
        h = hidden + self.self_attn(x, cos, sin, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class PreNormDecoderLayer(nn.Module):
    """A plain Llama decoder layer (input norm, attention over ``hidden`` alone, MLP): the layers a
    multi-layer P-EAGLE drafter stacks after its fused first layer (vLLM's ``llama_eagle3`` builds
    every layer past the first so)."""

    def __init__(self, g: LayerGeometry) -> None:
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(g.hidden_size, eps=g.rms_norm_eps)
        self.self_attn = DraftAttention(g, g.hidden_size)
        self.post_attention_layernorm = LlamaRMSNorm(g.hidden_size, eps=g.rms_norm_eps)
        self.mlp = DraftMLP(g)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: DraftCache | None = None) -> torch.Tensor:
        h = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class LayerCaches:
    """One ``DraftCache`` per drafter layer, cropped together (a multi-layer drafter's KV cache)."""

    def __init__(self, num_layers: int) -> None:
        self.layers = [DraftCache() for _ in range(num_layers)]

    def __len__(self) -> int:
        return len(self.layers[0])

    def __getitem__(self, i: int) -> DraftCache:
        return self.layers[i]

    def crop(self, length: int) -> None:
        """Keep the first ``length`` entries of every layer (drop the mask slots of a draft)."""
        for cache in self.layers:
            cache.crop(length)


def causal_mask(T: int, past: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Float additive causal mask (1, 1, T, past + T): query i sees keys 0..past+i."""
    q = torch.arange(T, device=device)[:, None] + past
    k = torch.arange(past + T, device=device)[None, :]
    return torch.zeros(T, past + T, dtype=dtype, device=device).masked_fill(k > q, torch.finfo(dtype).min)[None, None]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on one tensor (B, heads, T, hd) with cos/sin (B, T, hd) (keys alone: the block's context)."""
    return apply_rotary_pos_emb(x, x, cos, sin)[1]


class BlockAttention(nn.Module):
    """DFlash attention: the block's queries attend to the target's context (keys and values
    projected from the fused target features, cached across steps) and to the whole block.

    Qwen3-style per-head RMSNorm on queries and keys (``qk_norm``), as the DFlash layers vLLM and
    SGLang serve; keys are normed before RoPE."""

    def __init__(self, g: LayerGeometry, qk_norm: bool = True) -> None:
        super().__init__()
        self.g = g
        H, nh, nkv, hd = g.hidden_size, g.num_attention_heads, g.num_key_value_heads, g.head_dim
        self.q_proj = nn.Linear(H, nh * hd, bias=g.attention_bias)
        self.k_proj = nn.Linear(H, nkv * hd, bias=g.attention_bias)
        self.v_proj = nn.Linear(H, nkv * hd, bias=g.attention_bias)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)
        if qk_norm:
            self.q_norm = LlamaRMSNorm(hd, eps=g.rms_norm_eps)
            self.k_norm = LlamaRMSNorm(hd, eps=g.rms_norm_eps)

    def _heads(self, x: torch.Tensor, proj: nn.Linear, n: int, norm: str) -> torch.Tensor:
        """(B, T, H) -> (B, n, T, hd), per-head normed when the layer has ``norm``."""
        B, T, _ = x.shape
        y = proj(x).view(B, T, n, self.g.head_dim)
        if norm in self._modules:
            y = self._modules[norm](y)
        return y.transpose(1, 2)

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ctx (B, C, H) fused target features -> keys, values (B, nkv, C, hd), keys rotated."""
        nkv = self.g.num_key_value_heads
        k = rotate(self._heads(ctx, self.k_proj, nkv, "k_norm"), cos, sin)
        return k, self._heads(ctx, self.v_proj, nkv, "")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """x (B, Q, H) block tokens; ctx_k / ctx_v (B, nkv, C, hd); mask None: every query sees every
        key (decoding: one block after its context), else float additive (B|1, 1, Q, C + Q)."""
        g = self.g
        B, Q, _ = x.shape
        q = rotate(self._heads(x, self.q_proj, g.num_attention_heads, "q_norm"), cos, sin)  # (B, nh, Q, hd)
        k = rotate(self._heads(x, self.k_proj, g.num_key_value_heads, "k_norm"), cos, sin)  # (B, nkv, Q, hd)
        v = self._heads(x, self.v_proj, g.num_key_value_heads, "")
        k, v = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)  # (B, nkv, C + Q, hd)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask.to(q.dtype),
                                           enable_gqa=g.num_key_value_heads != g.num_attention_heads)
        return self.o_proj(y.transpose(1, 2).reshape(B, Q, -1))  # (B, Q, H)


class BlockDecoderLayer(nn.Module):
    """A DFlash draft layer: pre-norm attention over (context, block) and an MLP. The context
    (already ``hidden_norm``-ed by the drafter) goes straight into k_proj / v_proj."""

    def __init__(self, g: LayerGeometry, qk_norm: bool = True) -> None:
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(g.hidden_size, eps=g.rms_norm_eps)
        self.self_attn = BlockAttention(g, qk_norm)
        self.post_attention_layernorm = LlamaRMSNorm(g.hidden_size, eps=g.rms_norm_eps)
        self.mlp = DraftMLP(g)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))
