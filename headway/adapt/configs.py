"""What ``headway adapt`` takes: ``AdaptConfig`` and its sections.

Kept apart from the code that runs them so that ``headway adapt --help`` imports no torch. The
sections group the settings of each step a round runs: ``self_prompts`` (``--prompts self``: the
target writes the prompts, as ``headway prompts``), ``distill`` (the target's answers, as
``headway distill``), ``train`` (continued training from the served heads, as ``headway train``),
``gate`` (the held-out slice and the decoder measurement that decides) and ``traffic`` (request
logs: the window, and ``--watch``'s loop and generations).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config import ConfigError, check_numbers, opt
from ..data.plans import PROMPT_FORMATS
from ..data.source_spec import parse_sources
from ..target import DTYPE_CHOICES, TargetArgs

SELF = "self"  # --prompts self: the target writes its prompts (headway prompts)
TRAFFIC = "traffic:"  # --prompts traffic:PATH: OpenAI chat-completion request logs (a .jsonl file or a folder)
STAGES = ("prompts", "before", "distill", "train", "after")  # a round's steps, in order (stop_after names one)
PRECISIONS = ("no", "bf16", "fp16", "auto")
STORE_DTYPES = ("bfloat16", "float16", "float32")


@dataclass
class SelfPromptOptions:
    system: str | None = opt(None, "system message before the sampled user turn (default: none, or the template's)")
    temperature: float = opt(1.0, "sampling temperature of the user turns (> 0)")
    max_new_tokens: int = opt(128, "longest user turn (tokens); unfinished turns are dropped")
    batch_size: int = opt(64, "user turns sampled per batch (the unit of resumption)")
    min_chars: int = opt(15, "shorter prompts are dropped")
    max_chars: int = opt(800, "longer prompts are dropped")
    exclude: list[str] = opt(default_factory=list, help="prompt sources whose prompts are never written "
                                                        "(benchmark prompts)")

    def __post_init__(self) -> None:
        check_numbers(self, "self_prompts.", {"temperature": "> 0", "max_new_tokens": ">= 1", "batch_size": ">= 1",
                                              "min_chars": ">= 0", "max_chars": ">= 1"})


@dataclass
class DistillOptions:
    max_new_tokens: int = opt(256, "longest answer (tokens) per assistant turn")
    temperature: float = opt(0.0, "sampling temperature of the answers; 0 = greedy (what the gate decodes)")
    batch_size: int = opt(8, "prompts per generate() call")
    shard_size: int = opt(256, "prompts per shard (the unit of resumption)")
    max_prompt_tokens: int = opt(1024, "longer prompts are dropped")
    dtype: str = opt("auto", "dtype of the batched generation (auto: bf16 on a CPU measured faster in bf16)",
                     choices=DTYPE_CHOICES)
    features: bool = opt(True, "store the target's hidden states while it writes the answers and train from them "
                               "(offline, no target forward per step), for head kinds that can")
    feature_store_dtype: str = opt("bfloat16", "dtype of the stored features", choices=STORE_DTYPES)

    def __post_init__(self) -> None:
        check_numbers(self, "distill.", {"max_new_tokens": ">= 1", "temperature": ">= 0", "batch_size": ">= 1",
                                         "shard_size": ">= 1", "max_prompt_tokens": ">= 1"})


@dataclass
class TrainOptions:
    recipe: str | None = opt(None, "a `headway train` YAML whose kind and option sections replace those recorded "
                                   "with the served heads (needed for heads without a training record)")
    max_steps: int | None = opt(None, "optimiser steps (overrides epochs)")
    epochs: float = opt(1.0, "passes over the new answers when max_steps is not set")
    batch_size: int = opt(8, "rows per micro-batch")
    grad_accum: int = opt(1, "micro-batches per optimiser step")
    lr: float | None = opt(None, "peak learning rate; None = the one the served heads were trained with")
    warmup_steps: int = opt(0, "linear warm-up steps (the heads are trained already: none by default)")
    eval_fraction: float = opt(0.05, "fraction of the training prompts' answers held out for training's own "
                                     "evaluation and the draft calibration (the gate's slice is never seen)")
    max_length: int = opt(1024, "rows longer than this many tokens are truncated")
    group_by_length: int = opt(0, "sort rows by length inside windows of N batches (less padding; 0 = off)")
    mixed_precision: str = opt("no", "accelerate mixed precision (auto: bf16 where it is fast)", choices=PRECISIONS)
    save_every: int = opt(100, "a resumable checkpoint every N steps (and at the end)")
    log_every: int = opt(10, "a log line every N steps")
    stop_after: int | None = opt(None, "stop training after this step as if interrupted; rerun to resume")
    time_limit: float | None = opt(None, "minutes the training may take; then it ends as if at its last step")

    def __post_init__(self) -> None:
        check_numbers(self, "train.", {"max_steps": ">= 1", "epochs": "> 0", "batch_size": ">= 1",
                                       "grad_accum": ">= 1", "lr": "> 0", "warmup_steps": ">= 0",
                                       "eval_fraction": "in [0, 1)", "max_length": ">= 1", "group_by_length": ">= 0",
                                       "save_every": ">= 0", "log_every": ">= 1", "stop_after": ">= 1",
                                       "time_limit": "> 0"})


@dataclass
class GateOptions:
    heldout_fraction: float = opt(0.1, "share of the prompts held out (seeded) for the gate; never trained on")
    heldout_max: int = opt(64, "at most this many held-out prompts")
    max_new_tokens: int = opt(128, "tokens the decoder writes per held-out prompt, greedy, before and after")
    tree: str | None = opt(None, "tree both heads draft while measured (default: the decoder's for the kind: "
                                 "dynamic-4-5-16 for EAGLE, a chain over Medusa's heads and DFlash's block); a "
                                 "tree stored with the served heads is not used, so both run the same one")

    def __post_init__(self) -> None:
        check_numbers(self, "gate.", {"heldout_fraction": "in [0, 1)", "heldout_max": ">= 1",
                                      "max_new_tokens": ">= 1"})
        if self.heldout_fraction <= 0:
            raise ConfigError(f"'gate.heldout_fraction' must be > 0, got {self.heldout_fraction}")


@dataclass
class TrafficOptions:
    window_requests: int | None = opt(5000, "the window: the newest N requests of the logs (None = all)")
    window_days: float | None = opt(None, "the window: requests of the last D days, where rows carry a timestamp "
                                          "(rows without one are kept)")
    pattern: str = opt("*.jsonl", "log files read in a folder (sorted by name: oldest first)")
    min_new_prompts: int = opt(200, "--watch: start a round when the window holds this many unique prompts that "
                                    "no earlier round used")
    poll_seconds: float = opt(300.0, "--watch: seconds between looks at the log folder")
    keep_generations: int = opt(5, "published generations kept for rollback (the served one always stays)")

    def __post_init__(self) -> None:
        check_numbers(self, "traffic.", {"window_requests": ">= 1", "window_days": "> 0", "min_new_prompts": ">= 1",
                                         "poll_seconds": ">= 0", "keep_generations": ">= 1"})


@dataclass
class AdaptConfig(TargetArgs):
    heads: str | None = opt(None, "the served heads to start from (a headway heads folder); with --watch, the "
                                  "heads served before the first round (later rounds start from --out)")
    prompts: Any = opt(None, "the new prompts: any source `headway distill` reads (a file, a datasets folder, "
                             "chat:extra, a source spec), 'self' (the target writes them: headway prompts), or "
                             "'traffic:PATH' (OpenAI chat-completion request logs: a .jsonl file or a folder)")
    out: str | None = opt(None, "the served heads: written (atomically) only when the gate passes; untouched "
                                "otherwise. May be --heads itself")
    work: str | None = opt(None, "the adapt state folder: rounds (prompts, answers, training, measurements) and the "
                                 "generations of published heads (default: OUT.adapt beside --out)")
    num_prompts: int | None = opt(None, "prompts to use: the first N of a source, N self-written (default 512), the "
                                        "newest N unique ones of traffic")
    seed: int = opt(0, "seed of the held-out split, the data order and the self-written prompts")
    threshold: float = opt(0.03, "publish only when the new heads' tau beats the served heads' by this fraction "
                                 "(0.03: 3%)")
    chat_template: str | None = opt(None, "Jinja chat template file, for targets whose tokenizer has none")
    prompt_format: str = opt("auto", "auto: chat template when the tokenizer has one; chat: always; raw: plain "
                                     "prompts as they are", choices=PROMPT_FORMATS)
    stop_tokens: list[str] = opt(default_factory=list, help="extra tokens that end an answer")
    watch: str | None = opt(None, "a folder of request logs: repeat the round whenever enough new traffic has "
                                  "arrived (traffic.min_new_prompts), publishing to --out and keeping generations")
    once: bool = opt(False, "--watch: look at the logs once (a round if enough is new), then stop")
    rollback: int | None = opt(None, "republish generation K (headway adapt --rollback K --out SERVED) as the served "
                                     "heads, atomically, and stop")
    stop_after: str | None = opt(None, "stop after this step of the round as if interrupted; rerun to resume",
                                 choices=STAGES)
    overwrite: bool = opt(False, "drop an unfinished round made with other settings and start a new one")
    self_prompts: SelfPromptOptions = field(default_factory=SelfPromptOptions)
    distill: DistillOptions = field(default_factory=DistillOptions)
    train: TrainOptions = field(default_factory=TrainOptions)
    gate: GateOptions = field(default_factory=GateOptions)
    traffic: TrafficOptions = field(default_factory=TrafficOptions)

    def __post_init__(self) -> None:
        if not self.out:
            raise ConfigError("--out is required: the served heads (written only when the gate passes)")
        check_numbers(self, "", {"num_prompts": ">= 1", "threshold": ">= 0", "rollback": ">= 0"})
        if self.rollback is not None:
            if self.watch or self.prompts is not None:
                raise ConfigError("--rollback republishes a stored generation; it takes neither --prompts nor --watch")
            return  # no target: rollback copies a folder
        super().__post_init__()
        if self.watch:
            if self.prompts is not None:
                raise ConfigError("--watch reads its prompts from the log folder; drop --prompts")
        elif self.prompts is None:
            raise ConfigError("--prompts is required: a prompt source, 'self', or 'traffic:PATH' (or use --watch DIR)")
        elif self.once:
            raise ConfigError("--once belongs to --watch")
        if not self.watch and not self.heads:
            raise ConfigError("--heads is required: the served heads to start from")
        if isinstance(self.prompts, str) and self.prompts.startswith(TRAFFIC):
            if not self.prompts[len(TRAFFIC):].strip():
                raise ConfigError("--prompts traffic:PATH needs the path of a log file or folder")
        elif self.prompts is not None and self.prompts != SELF:
            parse_sources(self.prompts)  # a bad spec fails here, before any model loads

    def source_kind(self) -> str:
        """'self', 'traffic' or 'source': where a round's prompts come from."""
        if self.watch or (isinstance(self.prompts, str) and self.prompts.startswith(TRAFFIC)):
            return "traffic"
        return "self" if self.prompts == SELF else "source"

    def traffic_path(self) -> str:
        return self.watch or str(self.prompts)[len(TRAFFIC):]
