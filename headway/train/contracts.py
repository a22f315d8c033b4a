"""Head kinds as contracts: what each ``kind:`` of ``headway train`` needs, reads and promises.

A contract is data, written once per kind, and everything about a run that depends on the kind is
derived from it: the run fingerprint a resumed run must match (``checkpoints.run_fingerprint``),
the option sections recorded on the model card, which stored features an offline run needs and
whether it can run offline at all, and the limits the target sets on the options (checked before
anything is written). The option sections themselves are declared here too, beside the contract
that names them. This module imports no torch: ``headway train --help`` reads it.

A new head kind is:
  1. its option section (a dataclass here, a field of ``TrainConfig``) and its ``Contract`` below;
  2. its ``Task`` (the loss and evaluation, ``tasks.py`` describes the interface) in ``TASKS``
     (``registry.py``), and its heads in ``headway/heads``.
``tests/test_train_contracts.py`` checks that every kind has all of these and that every option
its task reads is part of the run fingerprint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..config import ConfigError, check_choice, check_numbers, opt
from ..feature_layers import dflash_layers, eagle3_layers

ARGMAX_FROM = ("logits", "data")
SOFT_LABELS = ("lm_head", "stored_topk")

# The objective terms EAGLE-3 and DFlash share (train/objectives.py): the same four fields in both sections.
_TOPK_WEIGHT = ("HASS's Top-K distillation (Zhang et al., ICLR 2025): add topk_weight * L_topK to each {depth}'s "
                "loss, L_topK = -sum over the K tokens x of the target's largest p(x) of p(x) * log q(x) (p: the "
                "target's distribution renormalised on the draft vocabulary, q: the drafter's), averaged over the "
                "scored positions; 0 = off (HASS: 1.0)")
_TOPK_K = "K of topk_weight: how many of the target's likeliest tokens the Top-K term weighs (HASS: 10)"
_ALIGN_TOPK = ("GRIFFIN's token alignment (Hu et al., 2025): {what} is scored only where, at every earlier {depth} "
               "of the same {start}, the data's token it predicts (the target's argmax on greedy data) was among "
               "that {depth}'s align_topk likeliest drafts: decoding never reaches the others; 0 = every labelled "
               "{depth} (GRIFFIN: 3)")
_CHAIN_WEIGHT = ("subtract chain_weight * the mean expected accepted length of the {chain}, sum_j prod_(i<=j) "
                 "q_i(the target's argmax at depth i) (0 past a depth without a label); 0 = off")


# -- option sections --------------------------------------------------------------------------------
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
                                        "kl_weight": ">= 0", "topk": ">= 1", "draft_vocab_size": ">= 1"})
        if self.draft_vocab_size is not None and not self.own_lm_head:
            raise ConfigError("medusa.draft_vocab_size needs medusa.own_lm_head=true (the shared target lm_head "
                              "covers the full vocabulary)")


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

TERM_RULES = {"topk_weight": ">= 0", "topk_k": ">= 1", "align_topk": ">= 0", "chain_weight": ">= 0"}


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
    aux_layers: list[int] = opt(default_factory=list, help="EAGLE-3 fused target layers as HF hidden-state indices, "
                                                           "strictly increasing; empty = (2, L//2, L-3)")
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
    train_lm_head: bool = opt(True, "EAGLE-3: train the draft lm_head (it starts as the target's rows for the draft "
                                    "vocabulary); false keeps it frozen at those rows, as speculators' trainer does")
    argmax_from: str = opt("logits", "EAGLE-3 (and EAGLE-1's accuracy metric): where training reads the target's "
                                     "argmax (the hard label, and which positions the draft vocabulary can "
                                     "express): logits = the target's full-"
                                     "vocabulary projection, exact; data = the data's next token, for data the target "
                                     "distilled greedily (checked; they agree at ~99.9% of positions): offline, only "
                                     "the draft vocabulary's rows of the lm_head are then projected (SmolLM2: ~1.4x faster "
                                     "steps). Evaluation always reads the logits",
                           choices=ARGMAX_FROM)
    soft_labels: str = opt("lm_head", "EAGLE-1 / EAGLE-3 offline (features=DIR): where the target's distribution "
                                      "comes from: lm_head = the target's lm_head on the stored final state "
                                      "(exact); stored_topk = the top-k logits headway features --topk_logits K "
                                      "stored, renormalised over those K tokens (their first index is the argmax): "
                                      "no lm_head projection per step. Evaluation reads the exact logits where the "
                                      "held-out rows store 'final'", choices=SOFT_LABELS)
    topk_weight: float = opt(0.0, "EAGLE-3: " + _TOPK_WEIGHT.format(depth="unrolled step"))
    topk_k: int = opt(10, "EAGLE-3: " + _TOPK_K)
    align_topk: int = opt(0, "EAGLE-3: " + _ALIGN_TOPK.format(what="unrolled step j at index t", depth="step",
                                                               start="index"))
    chain_weight: float = opt(0.0, "EAGLE-3: " + _CHAIN_WEIGHT.format(chain="unrolled chain from each index"))
    feature_weight: float = opt(1.0, "EAGLE-1 SmoothL1 feature-regression weight")
    ce_weight: float = opt(0.1, "EAGLE-1 soft cross-entropy weight")
    noise: float = opt(0.2, "EAGLE-1 uniform noise width on input features (U(-noise/2, noise/2))")
    fc_bias: bool = opt(False, "bias on fc (vLLM's EAGLE-1 has none)")

    def __post_init__(self) -> None:
        check_choice(self.argmax_from, ARGMAX_FROM, "eagle.argmax_from")
        check_choice(self.soft_labels, SOFT_LABELS, "eagle.soft_labels")
        check_numbers(self, "eagle.", {"ttt_steps": ">= 1", "step_decay": "> 0", "hard_weight": ">= 0",
                                       "draft_vocab_size": ">= 1", "aux_layers": ">= 0", "feature_weight": ">= 0",
                                       "ce_weight": ">= 0", "noise": ">= 0", **TERM_RULES})
        check_increasing(self.aux_layers, "eagle.aux_layers")


@dataclass
class DFlashOptions:
    """DFlash block-drafter training options (owned by headway/train/dflash.py)."""

    block_size: int = opt(8, "tokens per block: the anchor plus block_size - 1 drafts (the decoder's deepest draft)")
    num_layers: int = opt(1, "draft decoder layers")
    aux_layers: list[int] = opt(default_factory=list, help="fused target layers as HF hidden-state indices, strictly "
                                                           "increasing; empty = 5 spread over the depth (headway "
                                                           "features --layers dflash)")
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
                           choices=ARGMAX_FROM)
    # DSpark: two small heads on the block (docs/peagle.md); vLLM serves them as speculators' `dspark`
    markov_rank: int = opt(0, "DSpark: rank of a Markov head trained with the block (each slot's logits gain a "
                              "bias from the token before it, the anchor or the previous draft); 0 = none")
    confidence_head: bool = opt(False, "DSpark: train a confidence head (each slot's chance of acceptance), which "
                                       "a decoder reads to choose how many drafts to verify")
    confidence_with_markov: bool = opt(True, "DSpark: the confidence head also reads the Markov embedding of the "
                                             "token before the slot (needs markov_rank > 0)")
    confidence_weight: float = opt(1.0, "DSpark: weight of the confidence head's loss (a BCE to the overlap of the "
                                        "target's and the drafter's distributions at the slot)")
    soft_labels: str = opt("lm_head", "offline (features=DIR): where the target's distribution comes from: lm_head "
                                      "(the target's lm_head on the stored final state, exact) or stored_topk (the "
                                      "top-k logits of headway features --topk_logits K, renormalised over those K "
                                      "tokens; no lm_head projection per step; evaluation reads the exact logits "
                                      "where the held-out rows store 'final')", choices=SOFT_LABELS)
    topk_weight: float = opt(0.0, _TOPK_WEIGHT.format(depth="slot") + "; weighted by the slot's exp(-(k-1)/gamma)")
    topk_k: int = opt(10, _TOPK_K)
    align_topk: int = opt(0, _ALIGN_TOPK.format(what="slot k of a block", depth="slot", start="block"))
    chain_weight: float = opt(0.0, _CHAIN_WEIGHT.format(chain="slots of each block"))

    def __post_init__(self) -> None:
        check_choice(self.argmax_from, ARGMAX_FROM, "dflash.argmax_from")
        check_choice(self.soft_labels, SOFT_LABELS, "dflash.soft_labels")
        check_numbers(self, "dflash.", {"block_size": ">= 1", "num_layers": ">= 1", "aux_layers": ">= 0",
                                        "mask_token_id": ">= 0", "draft_vocab_size": ">= 1", "anchors": ">= 1",
                                        "eval_anchors": ">= 1", "gamma": "> 0", "hard_weight": ">= 0",
                                        "correction_rank": ">= 0", "markov_rank": ">= 0", "confidence_weight": ">= 0",
                                        **TERM_RULES})
        if self.block_size < 2:
            raise ConfigError(f"'dflash.block_size' must be >= 2 (the anchor and a draft), got {self.block_size}")
        check_increasing(self.aux_layers, "dflash.aux_layers")
        if self.markov_rank and self.correction_rank:
            raise ConfigError("'dflash.markov_rank' and 'dflash.correction_rank' both bias a slot by the tokens before "
                              "it; set one (markov_rank is DSpark's, which vLLM serves)")
        if self.confidence_head and self.confidence_with_markov and not self.markov_rank:
            raise ConfigError("'dflash.confidence_with_markov' needs a Markov head: set dflash.markov_rank (DSpark's "
                              "default is 256), or dflash.confidence_with_markov=false")


@dataclass
class PEagleOptions:
    """P-EAGLE training options (owned by headway/train/peagle.py; docs/peagle.md)."""

    num_depths: int = opt(5, "K: tokens one drafter call drafts (the real slot and K - 1 mask slots), fixed at "
                             "training: decoders and vLLM draft at most K per step")
    num_layers: int = opt(2, "drafter layers: the fused EAGLE-3 layer, then plain Llama layers")
    draft_vocab_size: int | None = opt(None, "own lm_head over the N most frequent answer tokens (initialised from "
                                             "the target's rows); None = the full target vocabulary")
    aux_layers: list[int] = opt(default_factory=list, help="fused target layers as HF hidden-state indices, strictly "
                                                           "increasing; empty = (2, L//2, L-3)")
    mask_token_id: int | None = opt(None, "target token whose embedding fills the mask slots; None = the least used "
                                          "token of the training answers")
    down_sample_ratio: float = opt(0.7, "depth d >= 1 trains about ratio**d of a row's chains (speculators' COD "
                                        "sampling): deeper depths cost less")
    down_sample_ratio_min: float = opt(0.2, "the least share of chains any depth trains")
    max_anchors: int | None = opt(None, "at most this many chains per row at each depth >= 1 (bounds a long row's "
                                        "cost); None = no cap")
    hard_weight: float = opt(0.0, "weight of an extra cross-entropy to the target's argmax")
    norm_before_fc: bool = opt(False, "an RMSNorm over the concatenated target states before fc (speculators' option)")
    norm_before_residual: bool = opt(False, "the first layer's residual is the normed hidden state (speculators' "
                                            "option)")
    own_embeddings: bool = opt(False, "train an own copy of the token embedding (speculators trains P-EAGLE's; the "
                                      "export then ships it) instead of borrowing the target's, frozen")
    train_lm_head: bool = opt(True, "train the draft lm_head (it starts as the target's rows for the draft "
                                    "vocabulary); false keeps it frozen there (as eagle.train_lm_head)")
    argmax_from: str = opt("logits", "where training reads the target's argmax: logits, or data (greedy-distilled "
                                     "data only; offline, only the draft vocabulary's lm_head rows are projected)",
                           choices=ARGMAX_FROM)

    def __post_init__(self) -> None:
        check_choice(self.argmax_from, ARGMAX_FROM, "peagle.argmax_from")
        check_numbers(self, "peagle.", {"num_depths": ">= 2", "num_layers": ">= 1", "draft_vocab_size": ">= 1",
                                        "aux_layers": ">= 0", "mask_token_id": ">= 0", "down_sample_ratio": "in (0, 1]",
                                        "down_sample_ratio_min": "in [0, 1]", "max_anchors": ">= 1",
                                        "hard_weight": ">= 0"})
        check_increasing(self.aux_layers, "peagle.aux_layers")
        if self.aux_layers and len(self.aux_layers) != 3:
            raise ConfigError(f"P-EAGLE fuses exactly 3 target layers: 'peagle.aux_layers' has {self.aux_layers}")


def check_increasing(layers: list[int], option: str) -> None:
    """Fused layers are stored and exported in the order given, and engines gather them in layer
    order: a repeated or unsorted list would make them compute something else."""
    if any(b <= a for a, b in zip(layers, layers[1:])):
        raise ConfigError(f"'{option}' must be strictly increasing (each layer once, in layer order), got {layers}"
                          + (f"; did you mean {sorted(set(layers))}?" if len(set(layers)) > 1 else ""))


# -- the contracts -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class TargetShape:
    """What the target's limits on the options are checked against (``TargetInfo``'s numbers)."""

    num_hidden_layers: int
    vocab_size: int


@dataclass(frozen=True)
class Contract:
    """What one head kind needs from a run. Every callable takes the run's ``TrainConfig``."""

    kind: str
    summary: str
    sections: tuple[str, ...]  # option sections the kind reads: in the run fingerprint and on the model card
    offline: bool  # trains on stored features (headway features) as well as with the target running
    layers: Callable[[Any, int], list[int]]  # (cfg, L) -> hidden-state indices the heads read; -1 = final
    counts_answers: Callable[[Any], bool]  # counts tokens of the training answers (a draft vocabulary, ...)
    preset: str = "final"  # `headway features --layers` words that store what it reads by default
    check: Callable[[Any], None] = lambda cfg: None  # rules across sections, at config load
    check_target: Callable[[Any, TargetShape], None] = lambda cfg, shape: None  # before anything is written
    stored_topk: Callable[[Any], bool] = lambda cfg: False  # offline soft labels from stored top-k logits

    def options(self, cfg: Any) -> dict[str, Any]:
        """The option sections this kind reads, as objects (``{"eagle": cfg.eagle}``)."""
        return {name: getattr(cfg, name) for name in self.sections}

    def feature_spec(self, cfg: Any, num_hidden_layers: int) -> list[str]:
        """The ``--layers`` of ``headway features`` this kind trains on ('final': the post-norm state)."""
        return ["final" if i == -1 else str(i) for i in self.layers(cfg, num_hidden_layers)]


def _vocab_within(option: str, size: int | None, shape: TargetShape) -> None:
    if size is not None and size > shape.vocab_size:
        raise ConfigError(f"'{option}' is {size}, more than the target's vocabulary ({shape.vocab_size} tokens)")


def _layers_within(option: str, layers: list[int], shape: TargetShape) -> None:
    """Hidden-state indices run 0 (embeddings) .. L (the last layer's output after the final norm)."""
    L = shape.num_hidden_layers
    if layers and layers[-1] > L:
        raise ConfigError(f"'{option}' = {layers} reads hidden state {layers[-1]}, but the target has {L} layers "
                          f"(hidden-state indices 0..{L})")


def _decoder_layer_within(option: str, layer: int | None, shape: TargetShape) -> None:
    L = shape.num_hidden_layers
    if layer is not None and not -L <= layer < L:
        raise ConfigError(f"'{option}' = {layer}, but the target has {L} decoder layers (0..{L - 1}, or -1..-{L} "
                          "from the end)")


def _eagle_soft_labels(cfg: Any) -> bool:
    return cfg.eagle.soft_labels == "stored_topk"


def _dflash_soft_labels(cfg: Any) -> bool:
    return cfg.dflash.soft_labels == "stored_topk"


def _stored_topk_offline(option: str, stored: Callable[[Any], bool]) -> Callable[[Any], None]:
    def check(cfg: Any) -> None:
        if stored(cfg) and not cfg.features:
            raise ConfigError(f"{option}=stored_topk reads the top-k logits a features folder stores (headway "
                              f"features --topk_logits K): set features=DIR, or {option}=lm_head (a run with the "
                              "target has its full logits)")
    return check


def _eagle1_check(cfg: Any) -> None:
    _stored_topk_offline("eagle.soft_labels", _eagle_soft_labels)(cfg)


def _dflash_check(cfg: Any) -> None:
    _one_init("dflash.init_layer")(cfg)
    _stored_topk_offline("dflash.soft_labels", _dflash_soft_labels)(cfg)


def _eagle3_check(cfg: Any) -> None:
    _one_init("eagle.init_layer")(cfg)
    _eagle1_check(cfg)
    if cfg.eagle.aux_layers and len(cfg.eagle.aux_layers) != 3:
        raise ConfigError(f"EAGLE-3 fuses exactly 3 target layers: 'eagle.aux_layers' has {cfg.eagle.aux_layers}")


def _one_init(option: str) -> Callable[[Any], None]:
    def check(cfg: Any) -> None:
        section, name = option.split(".")
        if cfg.init_from and getattr(getattr(cfg, section), name) is not None:
            raise ConfigError(f"init_from and {option} both set the drafter's first weights; drop one")
    return check


def _medusa_target(cfg: Any, shape: TargetShape) -> None:
    _vocab_within("medusa.draft_vocab_size", cfg.medusa.draft_vocab_size, shape)


def _eagle1_target(cfg: Any, shape: TargetShape) -> None:
    _vocab_within("eagle.draft_vocab_size", cfg.eagle.draft_vocab_size, shape)


def _eagle3_target(cfg: Any, shape: TargetShape) -> None:
    o = cfg.eagle
    _vocab_within("eagle.draft_vocab_size", o.draft_vocab_size, shape)
    _layers_within("eagle.aux_layers", o.aux_layers, shape)
    _decoder_layer_within("eagle.init_layer", o.init_layer, shape)


def _dflash_target(cfg: Any, shape: TargetShape) -> None:
    o = cfg.dflash
    _vocab_within("dflash.draft_vocab_size", o.draft_vocab_size, shape)
    _layers_within("dflash.aux_layers", o.aux_layers, shape)
    _decoder_layer_within("dflash.init_layer", o.init_layer, shape)
    if o.mask_token_id is not None and o.mask_token_id >= shape.vocab_size:
        raise ConfigError(f"'dflash.mask_token_id' is {o.mask_token_id}, but the target's vocabulary has "
                          f"{shape.vocab_size} tokens (ids 0..{shape.vocab_size - 1})")
    if o.block_size > cfg.max_length:  # no row holds a longer block: its slots would never be scored
        raise ConfigError(f"'dflash.block_size' is {o.block_size}, longer than max_length ({cfg.max_length}): no "
                          "training row can hold a block")


def _peagle_target(cfg: Any, shape: TargetShape) -> None:
    o = cfg.peagle
    _vocab_within("peagle.draft_vocab_size", o.draft_vocab_size, shape)
    _layers_within("peagle.aux_layers", o.aux_layers, shape)
    if o.mask_token_id is not None and o.mask_token_id >= shape.vocab_size:
        raise ConfigError(f"'peagle.mask_token_id' is {o.mask_token_id}, but the target's vocabulary has "
                          f"{shape.vocab_size} tokens (ids 0..{shape.vocab_size - 1})")


def _final_only(cfg: Any, L: int) -> list[int]:
    return [-1]


def _eagle3_layers(cfg: Any, L: int) -> list[int]:
    return [*(cfg.eagle.aux_layers or eagle3_layers(L)), -1]


def _dflash_layers(cfg: Any, L: int) -> list[int]:
    return [*(cfg.dflash.aux_layers or dflash_layers(L)), -1]


def _peagle_layers(cfg: Any, L: int) -> list[int]:
    return [*(cfg.peagle.aux_layers or eagle3_layers(L)), -1]


CONTRACTS: dict[str, Contract] = {c.kind: c for c in (
    Contract("medusa", "Medusa-1: K heads on the frozen target's final state", ("medusa",), offline=True,
             layers=_final_only, counts_answers=lambda cfg: cfg.medusa.draft_vocab_size is not None,
             check_target=_medusa_target),
    Contract("medusa2", "Medusa-2: heads + a LoRA adapter on the target, trained jointly", ("medusa", "lora"),
             offline=False,  # the adapted target's states change every step: nothing to store beforehand
             layers=_final_only, counts_answers=lambda cfg: cfg.medusa.draft_vocab_size is not None,
             check_target=_medusa_target),
    Contract("eagle1", "EAGLE-1: one decoder layer on the final state", ("eagle",), offline=True,
             layers=_final_only, counts_answers=lambda cfg: cfg.eagle.draft_vocab_size is not None,
             check=_eagle1_check, check_target=_eagle1_target, stored_topk=_eagle_soft_labels),
    Contract("eagle3", "EAGLE-3: three fused target layers, training-time test", ("eagle",), offline=True,
             layers=_eagle3_layers, counts_answers=lambda cfg: cfg.eagle.draft_vocab_size is not None,
             preset="eagle3 final", check=_eagle3_check, check_target=_eagle3_target, stored_topk=_eagle_soft_labels),
    Contract("dflash", "DFlash: a block drafted in one pass over fused target layers", ("dflash",), offline=True,
             layers=_dflash_layers,
             counts_answers=lambda cfg: cfg.dflash.draft_vocab_size is not None or cfg.dflash.mask_token_id is None,
             preset="dflash final", check=_dflash_check, check_target=_dflash_target, stored_topk=_dflash_soft_labels),
    Contract("peagle", "P-EAGLE: EAGLE-3 layers drafting K tokens in one pass (mask slots)", ("peagle",),
             offline=True, layers=_peagle_layers,
             counts_answers=lambda cfg: cfg.peagle.draft_vocab_size is not None or cfg.peagle.mask_token_id is None,
             preset="eagle3 final", check_target=_peagle_target),
)}
KINDS = tuple(CONTRACTS)
