"""Tiny random targets of several decoder-only architectures, for tests and quick checks.

Each is built from a config (nothing is downloaded) with a locally trained byte-level BPE
tokenizer, saved as a normal HF folder so it goes through ``load_target`` like a real model.
"""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path
from typing import Any

import torch

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gpt_neox")
# Mixture-of-experts and Gemma-style targets (sliding-window layers, soft-capped logits): proven exact by
# their own test module (tests/test_decode_exact_archs.py), so every test over ARCHITECTURES stays as fast.
MORE_ARCHITECTURES = ("mixtral", "qwen3_moe", "gemma2", "gemma3")
SLIDING_WINDOW = 12  # shorter than the tests' prompt + generation: the window decides what a token sees

# hidden 64, 2 layers, GQA 4 query heads / 2 KV heads: small enough for ms forwards,
# big enough that attention geometry (GQA, head_dim) is exercised.
_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=512, tie_word_embeddings=False)


def tiny_config(arch: str, vocab_size: int, **overrides: Any) -> Any:
    from transformers import (Gemma2Config, Gemma3TextConfig, GPTNeoXConfig, LlamaConfig, MistralConfig,
                              MixtralConfig, Phi3Config, Qwen2Config, Qwen3Config, Qwen3MoeConfig)

    kv = dict(num_key_value_heads=2)
    if arch == "llama":
        cfg = LlamaConfig(**_COMMON, **kv, vocab_size=vocab_size)
    elif arch == "qwen2":
        cfg = Qwen2Config(**_COMMON, **kv, vocab_size=vocab_size)
    elif arch == "qwen3":
        cfg = Qwen3Config(**_COMMON, **kv, head_dim=16, vocab_size=vocab_size)
    elif arch == "mistral":
        cfg = MistralConfig(**_COMMON, **kv, vocab_size=vocab_size, sliding_window=None)
    elif arch == "phi3":
        cfg = Phi3Config(**_COMMON, **kv, vocab_size=vocab_size, pad_token_id=2)
    elif arch == "gpt_neox":
        cfg = GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            max_position_embeddings=512, vocab_size=vocab_size, tie_word_embeddings=False,
                            rotary_pct=0.5)
    elif arch == "mixtral":  # every layer sliding (Mistral-7B-v0.1's scheme): one mask for all layers
        cfg = MixtralConfig(**_COMMON, **kv, vocab_size=vocab_size, num_local_experts=4, num_experts_per_tok=2,
                            sliding_window=SLIDING_WINDOW)
    elif arch == "qwen3_moe":
        cfg = Qwen3MoeConfig(**_COMMON, **kv, head_dim=16, vocab_size=vocab_size, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1)
    elif arch == "gemma2":  # sliding and global layers alternate; attention and final logits soft-capped
        cfg = Gemma2Config(**_COMMON, **kv, head_dim=16, vocab_size=vocab_size, sliding_window=SLIDING_WINDOW,
                           query_pre_attn_scalar=16, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    elif arch == "gemma3":  # Gemma3ForCausalLM: sliding then global (5:1 in the real models), no soft-capping
        cfg = Gemma3TextConfig(**_COMMON, **kv, head_dim=16, vocab_size=vocab_size, sliding_window=SLIDING_WINDOW,
                               query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"])
    else:
        known = ARCHITECTURES + MORE_ARCHITECTURES
        raise ValueError(f"unknown fixture architecture '{arch}'; known: {', '.join(known)}")
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = 0, 1, 2
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def sample_texts(max_chars: int = 400_000) -> list[str]:
    """A slice of the standard library's source: real code, present on every Python install."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for name in ("textwrap.py", "json/decoder.py", "json/encoder.py", "string.py", "heapq.py", "bisect.py",
                 "functools.py", "collections/__init__.py", "dataclasses.py", "argparse.py"):
        p = root / name
        if p.is_file():
            t = p.read_text(encoding="utf-8", errors="replace")
            texts.append(t)
            total += len(t)
            if total > max_chars:
                break
    return texts


@functools.lru_cache(maxsize=4)
def tiny_tokenizer(vocab_size: int = 384) -> Any:
    from .tokenizer import train_bpe

    # transformers' Qwen2 tokenizer class adds <|endoftext|> when it is missing, which would give
    # the reloaded tokenizer one token more than the model's embedding; ship it from the start.
    return train_bpe(sample_texts(), vocab_size=vocab_size, extra_special=["<|endoftext|>"])


def tiny_target(arch: str = "llama", seed: int = 0, vocab_size: int = 384, **overrides: Any) -> tuple[Any, Any]:
    """(model, tokenizer): a random-weight tiny model in float32, eval mode, frozen."""
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer(vocab_size)
    cfg = tiny_config(arch, len(tok), **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config.bos_token_id, model.generation_config.eos_token_id = 0, 1
    model.generation_config.pad_token_id = 2
    # Random init with std 0.02 gives nearly flat logits; scale the output head up so greedy
    # choices are decided (no float near-ties) and drafts are sometimes right, sometimes not.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, tok


def save_tiny_target(path: str | Path, arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    model, tok = tiny_target(arch, seed, **overrides)
    path = Path(path)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
