"""``headway train`` settings: one dataclass per concern, loaded from ``configs/*.yaml``.

The YAML recipes under ``configs/`` carry the reasoning behind their numbers as comments;
this file carries what each key means. Every key can be overridden on the command line
(``headway train --config configs/demo/medusa.yaml optim.lr=3e-4 max_steps=50``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import check_choice, check_numbers, opt
from ..target import TargetArgs
from .contracts import CONTRACTS, KINDS, DFlashOptions, EagleOptions, LoraOptions, MedusaOptions, PEagleOptions

SCHEDULES = ("cosine", "linear", "constant")
OPTIMIZERS = ("adamw", "muon")  # headway/train/optim.py
PRECISIONS = ("no", "bf16", "fp16", "auto")
TRACKERS = ("none", "wandb", "tensorboard")


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
class TrainConfig(TargetArgs):
    kind: str = opt("medusa", "what to train: " + "; ".join(f"{c.kind} ({c.summary})" for c in CONTRACTS.values()),
                    choices=KINDS)
    data: str = opt("", "distilled dataset folder (datasets Arrow with input_ids and loss_mask)")
    eval_data: str | None = opt(None, "held-out distilled dataset; None = split eval_fraction off `data`")
    eval_fraction: float = opt(0.05, "fraction of `data` (or of `features`' rows) held out for evaluation when "
                                     "eval_data / eval_features is not given; the same seeded rows either way")
    features: str | None = opt(None, "a `headway features` folder: train on its stored hidden states (offline "
                                     "mode) instead of running the target each step; only the target's lm_head "
                                     "runs, for EAGLE's soft labels. `data` may be left empty: the rows come from "
                                     "the features' dataset. Medusa / EAGLE-1 need layer 'final', EAGLE-3, "
                                     "P-EAGLE and DFlash their aux layers and 'final'; medusa2 cannot use features")
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
    peagle: PEagleOptions = field(default_factory=PEagleOptions)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice(self.kind, KINDS, "kind")
        check_choice(self.mixed_precision, PRECISIONS, "mixed_precision")
        check_choice(self.report_to, TRACKERS, "report_to")
        CONTRACTS[self.kind].check(self)
        check_numbers(self, "", {"eval_fraction": "in [0, 1)", "max_length": ">= 1", "max_steps": ">= 1",
                                 "epochs": "> 0", "stop_after": ">= 1", "batch_size": ">= 1", "grad_accum": ">= 1",
                                 "group_by_length": ">= 0",
                                 "save_every": ">= 0", "keep_checkpoints": ">= 0", "log_every": ">= 1",
                                 "eval_every": ">= 0", "eval_max_batches": ">= 1", "num_workers": ">= 0"})


__all__ = ["KINDS", "DFlashOptions", "EagleOptions", "LoraOptions", "MedusaOptions", "OptimConfig", "PEagleOptions",
           "TrainConfig"]
