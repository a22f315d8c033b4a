"""``headway train`` settings: one dataclass per concern, loaded from ``configs/*.yaml``.

The YAML recipes under ``configs/`` carry the reasoning behind their numbers as comments;
this file carries what each key means. Every key can be overridden on the command line
(``headway train --config configs/demo/medusa.yaml optim.lr=3e-4 max_steps=50``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from ..config import ConfigError, check_choice, opt
from ..target import TargetArgs

KINDS = ("medusa", "medusa2", "eagle1", "eagle3", "dflash")
SCHEDULES = ("cosine", "linear", "constant")
OPTIMIZERS = ("adamw", "muon")  # headway/train/optim.py
PRECISIONS = ("no", "bf16", "fp16", "auto")
TRACKERS = ("none", "wandb", "tensorboard")

# rule text -> test; a value of None (an unset optional) passes every rule
RULES: dict[str, Callable[[float], bool]] = {
    "> 0": lambda x: x > 0, ">= 0": lambda x: x >= 0, ">= 1": lambda x: x >= 1,
    "in [0, 1)": lambda x: 0 <= x < 1, "in [0, 1]": lambda x: 0 <= x <= 1,
}


def check_numbers(section: Any, prefix: str, rules: dict[str, str]) -> None:
    """Refuse NaN, infinity and out-of-range numbers at config load, naming the key and its rule
    (a NaN lr would otherwise train silently to NaN heads). List values are checked item by item."""
    for name, rule in rules.items():
        value = getattr(section, name)
        for x in value if isinstance(value, (list, tuple)) else [value]:
            if x is not None and (isinstance(x, bool) or not math.isfinite(x) or not RULES[rule](x)):
                what = "a finite number " if isinstance(x, float) else ""
                raise ConfigError(f"'{prefix}{name}' must be {what}{rule}, got {value!r}")


@dataclass
class OptimConfig:
    name: str = opt("adamw", "adamw, or muon: Muon on the heads' hidden matrices (attention, MLP, fc), AdamW on "
                             "vectors and vocabulary matrices; one lr for both (Muon's step is scaled to AdamW's RMS)",
                    choices=OPTIMIZERS)
    lr: float = opt(1e-3, "peak learning rate (of the target's LoRA for medusa2; heads get lr * head_lr_mult)")
    head_lr_mult: float = opt(1.0, "learning-rate multiplier for the heads (Medusa-2 uses 4)")
    weight_decay: float = opt(0.0, "AdamW weight decay (not applied to biases and norm weights)")
    betas: list[float] = opt(default_factory=lambda: [0.9, 0.95], help="AdamW betas")
    eps: float = opt(1e-8, "AdamW epsilon")
    warmup_steps: int = opt(0, "linear learning-rate warm-up, in optimiser steps")
    schedule: str = opt("cosine", "learning-rate decay after warm-up", choices=SCHEDULES)
    min_lr_ratio: float = opt(0.0, "cosine/linear decay floor as a fraction of the peak lr")
    max_grad_norm: float = opt(1.0, "gradient clipping by global norm; 0 disables")
    muon_weight_decay: float = opt(0.1, "muon: decoupled weight decay of the Muon matrices (weight_decay is the "
                                        "AdamW part's)")
    muon_momentum: float = opt(0.95, "muon: momentum of the Muon matrices (Nesterov)")

    def __post_init__(self) -> None:
        check_choice(self.name, OPTIMIZERS, "optim.name")
        check_choice(self.schedule, SCHEDULES, "optim.schedule")
        if len(self.betas) != 2:
            raise ValueError(f"optim.betas needs two values, got {self.betas}")
        check_numbers(self, "optim.", {"lr": "> 0", "head_lr_mult": "> 0", "weight_decay": ">= 0",
                                       "betas": "in [0, 1)", "eps": "> 0", "warmup_steps": ">= 0",
                                       "min_lr_ratio": "in [0, 1]", "max_grad_norm": ">= 0",
                                       "muon_weight_decay": ">= 0", "muon_momentum": "in [0, 1)"})


@dataclass
class MedusaOptions:
    num_heads: int = opt(5, "number of Medusa heads; head k predicts token t+k+2")
    num_layers: int = opt(1, "ResBlocks per head")
    own_lm_head: bool = opt(True, "each head gets its own vocab projection initialised from the target's "
                                  "lm_head; false shares (and freezes) the target's lm_head")
    decay: float = opt(0.8, "head k's loss weight is decay**k")
    kl_weight: float = opt(0.0, "weight of KL(target's distribution at t+k+1 || head k) added to the hard-label "
                                "cross-entropy; 0 trains on hard labels only")
    topk: int = opt(5, "k of the top-k accuracy reported at evaluation")
    draft_vocab_size: int | None = opt(None, "reduced draft vocabulary: each head's own lm_head covers only the N "
                                             "most frequent answer tokens of the training data (labels outside "
                                             "it are ignored); needs own_lm_head; None = full target vocabulary")

    def __post_init__(self) -> None:
        check_numbers(self, "medusa.", {"num_heads": ">= 1", "num_layers": ">= 0", "decay": "> 0",
                                        "kl_weight": ">= 0", "topk": ">= 1"})
        if self.draft_vocab_size is not None and not self.own_lm_head:
            raise ValueError("medusa.draft_vocab_size needs medusa.own_lm_head=true (the shared target lm_head "
                             "covers the full vocabulary)")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"medusa.draft_vocab_size must be positive, got {self.draft_vocab_size}")


@dataclass
class LoraOptions:
    """Medusa-2: the target is adapted jointly with the heads through a LoRA adapter (peft)."""

    r: int = opt(16, "LoRA rank")
    alpha: int = opt(32, "LoRA alpha (scale = alpha / r)")
    dropout: float = opt(0.0, "LoRA dropout")
    target_modules: list[str] = opt(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"],
                                    help="module names to adapt ('all-linear' = every linear but the lm_head)")
    quality_loss: str = opt("kl", "what keeps the adapted target's quality: 'kl' to the frozen target's "
                                  "distribution, or 'lm' (next-token cross-entropy on the data)",
                            choices=("kl", "lm"))
    quality_weight: float = opt(1.0, "weight of the quality term relative to the heads' loss")
    heads_weight: float = opt(0.2, "weight of the heads' loss once warmed up (Medusa-2's lambda_0)")
    heads_only_steps: int = opt(0, "steps at the start where the quality term has weight 0 and the adapter does "
                                   "not move (lr 0): the heads warm up on the frozen target first")
    ramp_steps: int = opt(0, "steps over which the quality-term weight ramps linearly from 0 to quality_weight "
                             "after heads_only_steps")

    def __post_init__(self) -> None:
        check_choice(self.quality_loss, ("kl", "lm"), "lora.quality_loss")
        check_numbers(self, "lora.", {"r": ">= 1", "alpha": "> 0", "dropout": "in [0, 1)", "quality_weight": ">= 0",
                                      "heads_weight": ">= 0", "heads_only_steps": ">= 0", "ramp_steps": ">= 0"})


@dataclass
class EagleOptions:
    """EAGLE-1 / EAGLE-3 training options (owned by headway/train/eagle.py; see design.md §3)."""

    ttt_steps: int = opt(7, "EAGLE-3 training-time-test unroll depth")
    step_decay: float = opt(0.8, "EAGLE-3: unrolled step j's loss weight is step_decay**j")
    hard_weight: float = opt(0.0, "EAGLE-3: weight of an extra cross-entropy to the target's argmax (helps greedy "
                                  "acceptance when the target's distribution is flat)")
    draft_vocab_size: int | None = opt(None, "reduced draft vocabulary (most frequent answer tokens of the "
                                             "training data); None = full target vocabulary. EAGLE-3: the size of "
                                             "its own lm_head; EAGLE-1: decoding projects onto only these rows of "
                                             "the target's lm_head (training still fits the full vocabulary)")
    aux_layers: list[int] = opt(default_factory=list, help="EAGLE-3 fused target layers as HF hidden-state indices; "
                                                           "empty = (2, L//2, L-3)")
    init_layer: int | None = opt(None, "EAGLE-3: start the drafter's layer as a copy of this target decoder layer "
                                       "(0-based; -1 = last), fc as a pass-through of the deepest fused layer and "
                                       "norm as the target's final norm; None = random init")
    # speculators' three EAGLE-3 norm options (its trainer turns them all on); vLLM computes each of them
    # (checks/vllm_parity.py); SGLang and TensorRT-LLM exports refuse drafters trained with any
    norm_output: bool = opt(False, "EAGLE-3: feed each unrolled step the normed state (speculators' 'EAGLE 3.1' "
                                   "option): +0.06 held-out tau on SmolLM2 at 1,536 answers")
    norm_before_fc: bool = opt(False, "EAGLE-3: an RMSNorm over the concatenated target states before fc "
                                      "(speculators' option)")
    norm_before_residual: bool = opt(False, "EAGLE-3: the drafter layer's residual is the normed hidden state "
                                            "(speculators' option)")
    argmax_from: str = opt("logits", "EAGLE-3 (and EAGLE-1's accuracy metric): where training reads the target's "
                                     "argmax (the hard label, and which positions the draft vocabulary can "
                                     "express): logits = the target's full-"
                                     "vocabulary projection, exact; data = the data's next token, for data the target "
                                     "distilled greedily (checked; they agree at ~99.9% of positions): offline, only "
                                     "the draft vocabulary's rows of the lm_head are then projected (SmolLM2: ~1.4x faster "
                                     "steps). Evaluation always reads the logits",
                           choices=("logits", "data"))
    feature_weight: float = opt(1.0, "EAGLE-1 SmoothL1 feature-regression weight")
    ce_weight: float = opt(0.1, "EAGLE-1 soft cross-entropy weight")
    noise: float = opt(0.2, "EAGLE-1 uniform noise width on input features (U(-noise/2, noise/2))")
    fc_bias: bool = opt(False, "bias on fc (vLLM's EAGLE-1 has none)")

    def __post_init__(self) -> None:
        check_numbers(self, "eagle.", {"ttt_steps": ">= 1", "step_decay": "> 0", "hard_weight": ">= 0",
                                       "draft_vocab_size": ">= 1", "aux_layers": ">= 0", "feature_weight": ">= 0",
                                       "ce_weight": ">= 0", "noise": ">= 0"})


@dataclass
class DFlashOptions:
    """DFlash block-drafter training options (owned by headway/train/dflash.py)."""

    block_size: int = opt(8, "tokens per block: the anchor plus block_size - 1 drafts (the decoder's deepest draft)")
    num_layers: int = opt(1, "draft decoder layers")
    aux_layers: list[int] = opt(default_factory=list, help="fused target layers as HF hidden-state indices; empty = "
                                                           "5 spread over the depth (headway features --layers dflash)")
    mask_token_id: int | None = opt(None, "target token whose embedding fills the drafted slots; None = the least "
                                          "used token of the training answers")
    draft_vocab_size: int | None = opt(None, "own lm_head over the N most frequent answer tokens (initialised from "
                                             "the target's rows, trained); None = the target's lm_head, shared")
    anchors: int = opt(32, "blocks sampled per row per step (answer positions, seeded by step and batch)")
    eval_anchors: int = opt(64, "blocks per row at evaluation (the earliest whose slots are all answer tokens)")
    gamma: float = opt(4.0, "slot k's loss weight is exp(-(k-1)/gamma)")
    hard_weight: float = opt(0.0, "weight of an extra cross-entropy to the target's argmax")
    qk_norm: bool = opt(True, "per-head q/k RMSNorm (Qwen3-style, as vLLM's DFlash layers)")
    correction_rank: int = opt(0, "state size of a path correction trained with the block (after Domino): a GRU "
                                  "over the drafted tokens adds to each slot's logits, so a slot's draft depends "
                                  "on the tokens drafted before it; 0 = plain DFlash. Engines cannot serve it "
                                  "(export refuses); headway's decoder runs it exactly")
    init_layer: int | None = opt(None, "start every draft layer as a copy of this target decoder layer (0-based; "
                                       "-1 = last), fc as a pass-through of the deepest fused layer and norm as "
                                       "the target's final norm; None = random init")
    argmax_from: str = opt("logits", "where training reads the target's argmax: logits, or data (greedy-distilled "
                                     "data only; offline, only the draft vocabulary's lm_head rows are projected)",
                           choices=("logits", "data"))

    def __post_init__(self) -> None:
        check_choice(self.argmax_from, ("logits", "data"), "dflash.argmax_from")
        check_numbers(self, "dflash.", {"block_size": ">= 1", "num_layers": ">= 1", "aux_layers": ">= 0",
                                        "mask_token_id": ">= 0", "draft_vocab_size": ">= 1", "anchors": ">= 1",
                                        "eval_anchors": ">= 1", "gamma": "> 0", "hard_weight": ">= 0",
                                        "correction_rank": ">= 0"})
        if self.block_size < 2:
            raise ConfigError(f"'dflash.block_size' must be >= 2 (the anchor and a draft), got {self.block_size}")


@dataclass
class TrainConfig(TargetArgs):
    kind: str = opt("medusa", "what to train: medusa (Medusa-1, frozen target), medusa2 (heads + LoRA on the "
                              "target), eagle1, eagle3, dflash (block drafter)", choices=KINDS)
    data: str = opt("", "distilled dataset folder (datasets Arrow with input_ids and loss_mask)")
    eval_data: str | None = opt(None, "held-out distilled dataset; None = split eval_fraction off `data`")
    eval_fraction: float = opt(0.05, "fraction of `data` (or of `features`' rows) held out for evaluation when "
                                     "eval_data / eval_features is not given; the same seeded rows either way")
    features: str | None = opt(None, "a `headway features` folder: train on its stored hidden states (offline "
                                     "mode) instead of running the target each step; only the target's lm_head "
                                     "runs, for EAGLE's soft labels. `data` may be left empty: the rows come from "
                                     "the features' dataset. Medusa / EAGLE-1 need layer 'final', EAGLE-3 and "
                                     "DFlash their aux layers and 'final'; medusa2 cannot use features")
    eval_features: str | None = opt(None, "held-out `headway features` folder for offline mode; None = eval_data "
                                          "if given (the target runs on it), else split eval_fraction off `features`")
    max_length: int = opt(1024, "rows longer than this many tokens are truncated")
    init_from: str | None = opt(None, "start from these heads (a headway heads folder or Hub id of the same kind, "
                                      "trained for this target) instead of fresh ones: fine-tune earlier or "
                                      "published heads on new data; their settings (draft vocabulary, layers) must "
                                      "be this recipe's. A resumed run continues from its checkpoint instead")
    output_dir: str = opt("runs/headway", "checkpoints, logs and the final heads go here")
    seed: int = opt(0, "seed for initialisation, data order and the eval split")
    max_steps: int | None = opt(None, "stop after this many optimiser steps, at least 1 (overrides epochs)")
    epochs: float = opt(1.0, "passes over the training data when max_steps is not set")
    stop_after: int | None = opt(None, "stop after this optimiser step as if interrupted (checkpoint saved, no final "
                                       "heads); the schedule still plans for max_steps/epochs, so resume_from=latest "
                                       "continues the same run (for time-boxed sessions)")
    time_limit: float | None = opt(None, "minutes this invocation may train: at the first log step past it, training "
                                         "ends as if at its last step (a final eval and the final heads; the learning-"
                                         "rate schedule is cut, not stretched), for a machine lent for a fixed time")
    batch_size: int = opt(8, "rows per process per micro-batch")
    grad_accum: int = opt(1, "micro-batches per optimiser step (global batch = batch_size * processes * grad_accum)")
    group_by_length: int = opt(0, "sort rows by length inside windows of N global batches of the seeded order, so "
                                  "a batch pads to a length near its rows' own (less compute on padding; 0 = off)")
    mixed_precision: str = opt("no", "accelerate mixed precision: no, bf16, fp16, or auto (bf16 where it is fast: "
                                     "a GPU that supports it, a CPU measured faster in bf16 than fp32; else no)", choices=PRECISIONS)
    save_every: int = opt(500, "save a resumable checkpoint every N optimiser steps (and always at the end); 0 = end only")
    keep_checkpoints: int = opt(2, "keep the newest N checkpoints (0 keeps all)")
    resume_from: str | None = opt(None, "'latest' (the newest complete checkpoint in output_dir, or a fresh start "
                                        "if none) or a checkpoint folder")
    overwrite: bool = opt(False, "start fresh in an output_dir that holds another run (other settings): delete its "
                                 "checkpoints, log and final heads first (other files stay)")
    report_to: str = opt("none", "experiment tracker", choices=TRACKERS)
    project: str = opt("headway", "tracker project name")
    run_name: str | None = opt(None, "tracker run name; None = derived from output_dir")
    log_every: int = opt(10, "log loss / lr / tokens per second every N optimiser steps")
    eval_every: int = opt(0, "evaluate on held-out data every N optimiser steps (0 = only at the end)")
    eval_max_batches: int | None = opt(None, "cap on evaluation batches per evaluation")
    num_workers: int = opt(0, "dataloader worker processes")
    progress: bool = opt(True, "progress on the main process: a bar on a terminal, else a line every log_every steps")
    optim: OptimConfig = field(default_factory=OptimConfig)
    medusa: MedusaOptions = field(default_factory=MedusaOptions)
    lora: LoraOptions = field(default_factory=LoraOptions)
    eagle: EagleOptions = field(default_factory=EagleOptions)
    dflash: DFlashOptions = field(default_factory=DFlashOptions)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice(self.kind, KINDS, "kind")
        check_choice(self.mixed_precision, PRECISIONS, "mixed_precision")
        check_choice(self.report_to, TRACKERS, "report_to")
        if self.init_from and self.eagle.init_layer is not None and self.kind == "eagle3":
            raise ConfigError("init_from and eagle.init_layer both set the drafter's first weights; drop one")
        if self.init_from and self.dflash.init_layer is not None and self.kind == "dflash":
            raise ConfigError("init_from and dflash.init_layer both set the drafter's first weights; drop one")
        check_numbers(self, "", {"eval_fraction": "in [0, 1)", "max_length": ">= 1", "max_steps": ">= 1",
                                 "epochs": "> 0", "stop_after": ">= 1", "batch_size": ">= 1", "grad_accum": ">= 1",
                                 "group_by_length": ">= 0",
                                 "save_every": ">= 0", "keep_checkpoints": ">= 0", "log_every": ">= 1",
                                 "eval_every": ">= 0", "eval_max_batches": ">= 1", "num_workers": ">= 0"})
