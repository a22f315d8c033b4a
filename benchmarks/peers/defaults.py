"""What each trainer is told in the two modes of the harness (standard library only: the runners import
it inside each peer's own venv).

- ``own``: each peer at its own defaults. A runner sets only what the comparison fixes for every tool:
  the data (rows, loss masks, the draft vocabulary's ids), the aux layers, what a CPU needs, and the
  epochs: the tool's own (``OWN``), or capped at ``prepare.py --own-epochs-cap`` (a peer whose default
  is fewer keeps its own). Everything else (learning rate, optimiser, schedule, warm-up, precision,
  batch, TTT length, norms, seed) is the tool's. ``OWN`` lists those values with the file and line of
  the installed release each comes from (docs/peers.md prints the table).
- ``shared``: the settings of the comparisons in docs/peers.md (one draft vocabulary size, one TTT
  length, the plan's epochs, fp32 where the runner used to force it, each tool's recommended LR unless
  one is given).

A mode's settings per peer are ``{"draft_vocab_size": N, "options": {...}}`` (+ ``draft_layer`` for
ModelOpt): ``options`` are the tool's own names (speculators: ``speculators train`` flags without the
dashes; ModelOpt: dotted keys of its recipe; SpecForge: dotted keys of its run config), so a runner
passes them through unchanged and ``--set KEY=VALUE`` overrides any of them.
"""

from __future__ import annotations

from typing import Any

PEERS = ("speculators", "modelopt", "specforge")
TOOLS = ("headway", *PEERS)
MODES = ("own", "shared")

# Each peer's own defaults, as the installed release ships them: (value, where it is set). The ``own``
# mode writes none of these (a runner passes only the data, the draft vocabulary and what a CPU needs),
# so these are what the peers train with; the table documents them (docs/peers.md) and sizes the plan.
#   speculators 0.9.0: speculators/train/config/schema.py
#   ModelOpt 0.47.0: modelopt_recipes/general/speculative_decoding/eagle3.yaml (HF TrainingArguments below it)
#   SpecForge 0.2.0: specforge/config/schema.py
OWN: dict[str, dict[str, tuple[Any, str]]] = {
    "speculators": {
        "lr": (1e-3, "schema.py:344 OptimizerArgs.lr"),
        "optimizer": ("muon", "schema.py:339 OptimizerArgs.optimizer"),
        "epochs": (20, "schema.py:391 TrainerArgs.epochs"),
        "ttt_steps": (3, "schema.py:316 ttt_steps"),
        "precision": ("bf16 (hidden states and autocast; fp32 master weights)", "schema.py:218 hidden_states_dtype"),
        "draft_vocab": (None, "schema.py:129 draft_vocab_size (None: the verifier's whole vocabulary)"),
        "batch": ("rows packed to 8,192 tokens", "schema.py:210 total_seq_len"),
        "seed": (42, "schema.py:728 seed"),
    },
    "modelopt": {
        "lr": (1e-4, "eagle3.yaml:31 training.learning_rate"),
        "optimizer": ("adamw_torch", "HF TrainingArguments.optim (the recipe sets none)"),
        "epochs": (1, "eagle3.yaml:29 training.num_train_epochs"),
        "ttt_steps": (3, "eagle3.yaml:56 eagle.eagle_ttt_steps"),
        "precision": ("bf16", "eagle3.yaml:48 training.bf16"),
        "draft_vocab": (None, "eagle3.yaml:21 data.draft_vocab_cache (unset: the whole vocabulary)"),
        "batch": ("1 row", "eagle3.yaml:30 training.per_device_train_batch_size"),
        "seed": (42, "HF TrainingArguments.seed (the recipe sets none)"),
    },
    "specforge": {
        "lr": (1e-4, "schema.py:523 TrainingConfig.learning_rate"),
        "optimizer": ("adamw", "optimizer.py:12 BF16Optimizer (AdamW over fp32 master copies)"),
        "epochs": (1, "schema.py:517 TrainingConfig.num_epochs"),
        "ttt_steps": (7, "schema.py:530 TrainingConfig.ttt_length"),
        "precision": ("bf16", "schema.py:73 model.torch_dtype"),
        "draft_vocab": (None, "the user's draft config (its examples: 32,000)"),
        "batch": ("1 row", "schema.py:520 TrainingConfig.batch_size"),
        "seed": (42, "schema.py:582 TrainingConfig.seed"),
    },
}
OWN_EPOCHS = {peer: OWN[peer]["epochs"][0] for peer in PEERS}

# The shipped defaults keep the target's whole vocabulary (speculators' --draft-vocab-size unset, ModelOpt's
# recipe without data.draft_vocab_cache, SpecForge's draft config is the user's); each tool's first EAGLE-3
# example writes 32,000 (speculators examples/train/eagle3_llama3_8b_ultrachat_offline_5k.sh:45, ModelOpt
# examples/speculative_decoding/README.md:302-310, SpecForge configs/llama3-8B-eagle3.json, the draft config of
# its offline example examples/configs/llama3.1-8b-eagle3-offline.yaml). On 1,536 SmolLM2 answers (9,182
# distinct answer tokens) 32,000 covers every token seen, as the whole vocabulary does.
OWN_DRAFT_VOCAB = 32000

# Each tool's documented learning rate (what the shared mode uses unless --lr is given).
RECOMMENDED_LR = {"headway": 2e-3, "speculators": 1e-3, "modelopt": 1e-4, "specforge": 1e-4}

# The neutral names the sweep and throughput drivers set -> each tool's own option name.
KEYS: dict[str, dict[str, str]] = {
    "headway": {"lr": "optim.lr", "seed": "seed", "epochs": "epochs", "max_steps": "max_steps"},
    "speculators": {"lr": "lr", "seed": "seed", "epochs": "epochs", "max_steps": "max_steps",
                    "ttt_steps": "ttt_steps"},
    "modelopt": {"lr": "training.learning_rate", "seed": "training.seed", "epochs": "training.num_train_epochs",
                 "max_steps": "training.max_steps", "ttt_steps": "eagle.eagle_ttt_steps"},
    "specforge": {"lr": "training.learning_rate", "seed": "training.seed", "epochs": "training.num_epochs",
                  "max_steps": "training.max_steps", "ttt_steps": "training.ttt_length"},
}


def option(tool: str, name: str) -> str:
    """The tool's own name for a neutral setting (``lr``, ``seed``, ``epochs``, ``max_steps``, ``ttt_steps``)."""
    try:
        return KEYS[tool][name]
    except KeyError:
        raise ValueError(f"no '{name}' setting for {tool} (known: {', '.join(KEYS.get(tool, {}))})") from None


def own(peer: str, epochs_cap: int | None = None) -> dict[str, Any]:
    """``peer`` at its defaults: only the draft vocabulary size and its epochs (capped at ``epochs_cap``
    when given: a deviation the plan and docs/peers.md name) are written."""
    epochs = OWN_EPOCHS[peer] if epochs_cap is None else min(OWN_EPOCHS[peer], epochs_cap)
    settings: dict[str, Any] = {"draft_vocab_size": OWN_DRAFT_VOCAB, "options": {option(peer, "epochs"): epochs}}
    if peer == "modelopt":
        settings["draft_layer"] = "preset"  # its eagle3_default_config (a Llama-3-8B-sized layer)
    return settings


def shared(peer: str, draft_vocab: int, epochs: int, ttt_steps: int, lr: float | None) -> dict[str, Any]:
    """The comparisons' settings (docs/peers.md): what the runners passed before the switch existed."""
    lr = lr or RECOMMENDED_LR[peer]
    common = {option(peer, "epochs"): epochs, option(peer, "lr"): lr, option(peer, "ttt_steps"): ttt_steps}
    if peer == "speculators":  # float32 states turn its CPU autocast off: the fp32 runs of docs/peers.md
        return {"draft_vocab_size": draft_vocab, "options": {**common, "hidden_states_dtype": "float32"}}
    if peer == "modelopt":  # fp32, the target's layer geometry, 8 rows a step, short warm-up, cosine, seed 0
        return {"draft_vocab_size": draft_vocab, "draft_layer": "target",
                "options": {**common, "training.bf16": False, "training.tf32": False,
                            "training.per_device_train_batch_size": 8, "training.lr_scheduler_type": "cosine",
                            "training.warmup_steps": 2, "training.weight_decay": 0.0, "training.seed": 0}}
    return {"draft_vocab_size": draft_vocab,  # specforge: 8 rows a step, rows up to 1,024 tokens, seed 0
            "options": {**common, "training.batch_size": 8, "data.max_length": 1024, "training.seed": 0}}


def settings_for(plan: dict[str, Any], mode: str, tool: str) -> dict[str, Any]:
    """A prepared plan's settings for ``tool`` in ``mode`` (an error line names what is missing)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode '{mode}' (one of {', '.join(MODES)})")
    try:
        return plan["settings"][mode][tool]
    except KeyError:
        raise ValueError(f"the plan has no {mode} settings for {tool}: prepare it again with prepare.py") from None


def parse_sets(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings -> {key: value}; values are JSON where they parse (numbers, true, lists), else text."""
    import json

    out: dict[str, Any] = {}
    for pair in pairs:
        key, eq, text = pair.partition("=")
        if not eq or not key:
            raise ValueError(f"--set wants KEY=VALUE, got '{pair}'")
        try:
            out[key] = json.loads(text)
        except json.JSONDecodeError:
            out[key] = text
    return out
