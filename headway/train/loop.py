"""The one training loop, on accelerate: parse -> build -> train -> save.

The frozen target is moved to the device and never trained; only the trainable module
(heads, plus the target's LoRA for Medusa-2), optimiser, scheduler and training dataloader
go through ``accelerator.prepare``. When accelerate shards (FSDP, DeepSpeed ZeRO-3) the frozen
target is sharded too (``sharding.py``). What differs per head kind is a ``Task`` (tasks.py).

Rows come from a distilled Arrow dataset (``data``: the target runs each step) or from a
``headway features`` folder (``features``: offline, the stored states are read memory-mapped
and padded in the DataLoader; only the target's lm_head runs, for logits). Both routes give
the task the same ``TargetBatch`` and hold out the same seeded rows.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from ..config import to_dict
from ..hardware import bf16_is_fast
from ..heads.files import is_heads_checkpoint
from ..optional import MissingDependency, need, skip_line
from ..progress import Progress
from ..publish import check_output_path
from .batch import (StoredLogits, TargetBatch, collate, collate_features, feature_key, lm_head_logits, logit_transform,
                    stored_batch, stored_keys, target_batch)
from .calibration import calibration_metadata
from .checkpoints import (clear_run, folder_run, publish_dirs, read_state, resolve_resume, run_difference,
                          save_checkpoint, write_run)
from .config import OptimConfig, TrainConfig
from .errors import NonFiniteError, TrainError
from .losses import IGNORE_INDEX, medusa_labels
from .metrics import json_safe
from .optim import MuonAdamW, muon_eligible
from .registry import TASKS
from .rows import FeatureRows, load_rows, row_lengths
from .sharding import env_true, full_state, is_sharded, local_part, shard_sizes, shard_target
from .tasks import ParamGroup, Task
from .warm_start import warm_start


# -- data ------------------------------------------------------------------------------------
class EpochView(Dataset):
    """Rows of ``epochs`` passes over ``rows``, each pass in its own seeded order.

    A flat, sequential index makes the data order a pure function of (seed, step): resuming
    skips batches, and 1 or N processes see the same global batches. With ``lengths`` and a
    ``window`` (rows), each pass is cut into windows of its seeded order and every window is
    sorted longest first, so consecutive batches hold rows of similar length and pad less."""

    def __init__(self, rows: Any, seed: int, epochs: int, lengths: Sequence[int] | None = None,
                 window: int = 0) -> None:
        self.rows, self.seed, self.epochs, self.n = rows, seed, epochs, len(rows)
        self.lengths, self.window = lengths, window
        self._perms: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return self.n * self.epochs

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = length_windows(torch.randperm(self.n, generator=g).tolist(), self.lengths,
                                                self.window)
        return self._perms[epoch]

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[self._perm(i // self.n)[i % self.n]]


def length_windows(order: list[int], lengths: Sequence[int] | None, window: int) -> list[int]:
    """``order`` cut into windows of ``window`` rows, each sorted by length, longest first (stable:
    ties keep the seeded order). Unchanged without lengths or with a window of 0 or 1."""
    if lengths is None or window <= 1:
        return order
    out: list[int] = []
    for a in range(0, len(order), window):
        out += sorted(order[a:a + window], key=lambda i: -lengths[i])
    return out


def check_data_paths(cfg: TrainConfig) -> None:
    """Fail before loading a (possibly large) target when the data is not there."""
    if not cfg.data and not cfg.features:
        raise TrainError("no training data: set data=PATH to a distilled dataset (headway distill makes one) "
                         "or features=DIR (headway features makes one)")
    for what, path in (("training data", cfg.data), ("eval data", cfg.eval_data)):
        if path and not Path(path).expanduser().exists():
            raise TrainError(f"{what} not found: {path}")
    check_output_path(cfg.output_dir, "output_dir", error=TrainError)  # output_dir=afile/sub: refused here
    if cfg.features or cfg.eval_features:
        check_features_config(cfg)


def split_indices(n: int, fraction: float, seed: int) -> tuple[list[int], list[int] | None]:
    """(train, held-out) row indices: ``round(fraction * n)`` rows (at least 1) held out by the
    seeded rule of datasets' ``train_test_split``, so Arrow rows and feature rows of the same
    data hold out the same rows. (0..n-1, None) when nothing is held out."""
    if fraction <= 0 or n < 2:
        return list(range(n)), None
    n_test = max(1, round(fraction * n))
    perm = np.random.default_rng(seed).permutation(n)  # (n,)
    return perm[n_test:].tolist(), perm[:n_test].tolist()


def split_data(cfg: TrainConfig, keys: Sequence[str] | None = None) -> tuple[Any, Any | None]:
    """Training and held-out rows: Arrow rows of ``data``, or (offline) ``FeatureRows`` of
    ``features`` reading ``keys``; held out: eval_features, eval_data, or an eval_fraction split."""
    from ..data.features import FeatureStore

    def feature_rows(path: str) -> FeatureRows:
        store = FeatureStore(path)
        return FeatureRows(store, store.keys if keys is None else keys, cfg.max_length)

    rows = feature_rows(cfg.features) if cfg.features else load_rows(cfg.data)
    if cfg.eval_features:
        return rows, feature_rows(cfg.eval_features)
    if cfg.eval_data:
        return rows, load_rows(cfg.eval_data)
    train_idx, eval_idx = split_indices(len(rows), cfg.eval_fraction, cfg.seed)
    if eval_idx is None:
        return rows, None
    return rows.select(train_idx), rows.select(eval_idx)


def collate_fn(rows: Any, pad_id: int, max_length: int | None) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
    """The DataLoader's collate for these rows: stored features are padded there too."""
    fn = collate_features if isinstance(rows, FeatureRows) else collate
    return functools.partial(fn, pad_id=pad_id, max_length=max_length)


# -- offline features: checks before training ------------------------------------------------


def check_features_config(cfg: TrainConfig) -> None:
    """Before the target loads: a kind that can train on features, finished folders, and ``data``
    (if given) being the features' dataset (EAGLE-3's draft vocabulary is counted on it)."""
    if cfg.kind == "medusa2":
        raise TrainError("kind medusa2 adapts the target while training, so its hidden states cannot come from "
                         "stored features; drop features= (or train kind=medusa on them)")
    if cfg.eval_features and not cfg.features:
        raise TrainError("eval_features is for offline training: set features=DIR too (or use eval_data)")
    for key in ("features", "eval_features"):
        if getattr(cfg, key):
            features_manifest(key, getattr(cfg, key), cfg.kind)
    settings = features_manifest("features", cfg.features)["settings"]
    dataset = settings["dataset"]
    if cfg.data and not same_dataset(cfg.data, settings):
        raise TrainError(f"data={cfg.data} but features {cfg.features} were made from {dataset}; leave data empty "
                         "(the features' dataset is used) or make features of this data")
    # a moved features folder records its old dataset path: data= names the copy the vocabulary is counted on
    counted = cfg.kind == "eagle3" and cfg.eagle.draft_vocab_size or cfg.kind == "dflash" and (
        cfg.dflash.draft_vocab_size or cfg.dflash.mask_token_id is None)
    if counted and not cfg.data and not Path(dataset).expanduser().exists():
        raise TrainError(f"the draft vocabulary (or DFlash's mask token) is counted on the features' dataset {dataset}, "
                         "which is not there; set data=PATH to a copy of it")


def features_manifest(key: str, path: str, kind: str = "") -> dict[str, Any]:
    """The manifest of a finished features folder, or a one-line error with the command that makes it."""
    from ..data.errors import DataError
    from ..data.features import SUFFIX, features_command, read_features_manifest
    from ..data.shards import complete_shards, shard_ranges

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise TrainError(f"{key} folder not found: {path}")
    if (folder / "state.json").is_file():
        layers = f"{kind} final" if kind in ("eagle3", "dflash") else "final"
        raise TrainError(f"{key}={path} is a dataset, not a features folder: use data={path}, or store its "
                         f"features with: headway features {path} --layers {layers} --output runs/features")
    try:
        manifest = read_features_manifest(folder)
    except DataError as e:
        raise TrainError(f"{key}: {e}") from None
    if not manifest.get("complete"):
        settings = manifest["settings"]
        n = len(shard_ranges(settings["rows"], settings["shard_size"]))
        raise TrainError(f"{key} folder {path} is unfinished ({len(complete_shards(folder, SUFFIX))} of {n} shards); "
                         f"finish it with: {features_command(settings, path)}")
    return manifest


def features_dataset(cfg: TrainConfig) -> str:
    """The distilled dataset ``features`` were made from (recorded in their manifest)."""
    return features_manifest("features", cfg.features)["settings"]["dataset"]


def same_dataset(data: str, settings: dict[str, Any]) -> bool:
    """``data`` is the dataset features were made from: the same folder, or a copy of it (same state.json)."""
    from ..data.shards import digest

    path = Path(data).expanduser()
    if path.resolve() == Path(settings["dataset"]).expanduser().resolve():
        return True
    state = path / "state.json"
    return state.is_file() and digest(state.read_text()) == settings.get("dataset_state")


def target_names(name: str) -> set[str]:
    """A target's spellings: as given, and as an absolute folder when it is one."""
    path = Path(name).expanduser()
    return {name, str(path.resolve())} if name and path.exists() else {name}


def check_features_target(key: str, path: str, target: nn.Module, cfg: TrainConfig) -> None:
    """Refuse features of another target: a shape field naming both values, or another model."""
    from ..data.features import features_command
    from ..target import TargetInfo

    manifest = features_manifest(key, path)
    stored, now = manifest["target"], TargetInfo.of(target, cfg.target)
    remake = features_command({**manifest["settings"], "target": cfg.target}, fresh_output(path, "retarget"),
                              wanted_layers(cfg, target))
    for name in ("hidden_size", "vocab_size", "num_hidden_layers"):
        if stored[name] != getattr(now, name):
            raise TrainError(f"{key} {path} are of a target with {name}={stored[name]}, but this run's target "
                             f"({cfg.target}) has {name}={getattr(now, name)}; make features of it with: {remake}")
    ours = target_names(cfg.target) | target_names(str(getattr(target.config, "_name_or_path", "") or ""))
    if not target_names(stored["name_or_path"]) & ours:
        raise TrainError(f"{key} {path} were made by target '{stored['name_or_path']}', but this run's target is "
                         f"'{cfg.target}'; set target={stored['name_or_path']} or make features with: {remake}")
    if manifest["settings"].get("adapter"):
        raise TrainError(f"{key} {path} were made with the adapter {manifest['settings']['adapter']} merged into the "
                         f"target, which training does not load; make features without it: {remake}")


def wanted_layers(cfg: TrainConfig, target: nn.Module) -> list[str]:
    """The ``--layers`` of ``headway features`` this kind trains on (the lm_head reads ``final``)."""
    L = int(target.config.num_hidden_layers)
    if cfg.kind == "eagle3":
        from ..heads import default_aux_layers

        return [*map(str, cfg.eagle.aux_layers or default_aux_layers(L)), "final"]
    if cfg.kind == "dflash":
        from ..heads import default_context_layers

        return [*map(str, cfg.dflash.aux_layers or default_context_layers(L)), "final"]
    return ["final"]


def check_features_keys(key: str, path: str, keys: Sequence[str], cfg: TrainConfig) -> None:
    """Refuse features that lack a layer the task reads, with the command that stores them all."""
    from ..data.features import features_command

    manifest = features_manifest(key, path)
    missing = [k for k in keys if k not in manifest["keys"]]
    if missing:
        layers = [k.removeprefix("hidden_states.") for k in keys]
        cmd = features_command({**manifest["settings"], "target": cfg.target}, fresh_output(path, cfg.kind), layers)
        why = " (the lm_head reads it for the soft labels)" if missing == ["final"] and cfg.kind != "medusa" else ""
        raise TrainError(f"{key} {path} lack {', '.join(missing)}{why} that kind {cfg.kind} reads (stored: "
                         f"{', '.join(manifest['keys'])}); make them with: {cmd}")


def check_plain_lm_head(target: nn.Module) -> None:
    """Offline logits are ``lm_head(final)`` then the target's own transform (``logit_transform``);
    refuse a target whose forward changes them in a way that cannot reproduce."""
    try:
        logit_transform(target.config)
    except ValueError as e:
        raise TrainError(str(e)) from None


def fresh_output(path: str, tag: str) -> str:
    return f"{str(path).rstrip('/')}-{tag}"


def features_folders(cfg: TrainConfig) -> list[tuple[str, str]]:
    """(config key, folder) of the features this run reads."""
    return [(key, getattr(cfg, key)) for key in ("features", "eval_features") if getattr(cfg, key)]


def check_features_layers(cfg: TrainConfig, target: nn.Module, keys: Sequence[str], need_logits: bool) -> None:
    """Once the heads say which layers they read: every folder stores them, and the lm_head alone
    gives the target's logits."""
    for key, path in features_folders(cfg):
        check_features_keys(key, path, keys, cfg)
    if need_logits:
        check_plain_lm_head(target)


# -- the trained module ----------------------------------------------------------------------
class TrainModule(nn.Module):
    """What accelerate prepares: the heads (and the adapted target, when it trains). Its forward
    runs the target and the task's loss, so DDP sees one forward per backward. A frozen target
    is held outside the module tree: never DDP-wrapped, never saved."""

    def __init__(self, task: Task, heads: nn.Module, target: nn.Module, adapted: bool, offline: bool = False) -> None:
        super().__init__()
        self.task, self.heads = task, heads
        if adapted:
            self.target = target
        else:
            object.__setattr__(self, "frozen_target", target)
        self.adapted = adapted
        self.layers = task.feature_layers(heads)
        self.stored_logits: StoredLogits | None = None
        if offline:  # stored states go where online ones live, in the target's dtype
            head = target.get_output_embeddings()
            self.stored_device, self.stored_dtype = head.weight.device, head.weight.dtype
            if task.needs_logits():  # the target's lm_head on the stored final state, in float32 (made once)
                reduced = getattr(task, "stored_logits", None)  # only the rows (and argmax) its loss reads
                self.stored_logits = reduced(heads, head) if reduced is not None else lm_head_logits(head)
                self.stored_logits.transform = logit_transform(target.config)  # Gemma 2's soft-cap, ...

    def run_target(self) -> nn.Module:
        return self.target if self.adapted else self.frozen_target

    def target_batch(self, batch: dict[str, Any], need_logits: bool, grad: bool = False,
                     evaluate: bool = False) -> TargetBatch:
        """Online: one target forward. Offline (a ``collate_features`` batch): the stored states,
        and the lm_head on ``final`` when logits are needed; the decoder never runs. Evaluation
        takes the target's argmax from its logits, whatever the training loss reads."""
        if "features" in batch:
            logits = self.stored_logits if need_logits else None
            if logits is not None and evaluate:
                logits = logits.exact()
            return stored_batch(batch, self.layers, logits, self.stored_device, self.stored_dtype)
        return target_batch(self.run_target(), batch, self.layers, need_logits, need_ref=self.adapted, grad=grad)

    def forward(self, batch: dict[str, Any], step: int, evaluate: bool = False) -> Any:
        """The step's (loss, metrics); with ``evaluate`` the held-out sums (``evaluate``). Evaluation
        goes through ``forward`` too: under FSDP the heads' weights are whole only inside it."""
        if evaluate:
            return self.evaluate(batch)
        tb = self.target_batch(batch, self.task.needs_logits(), grad=self.adapted)
        return self.task.loss(self.heads, tb, step)

    @torch.no_grad()
    def inspect(self, batch: dict[str, Any]) -> TargetBatch:
        """The target's side of a batch with logits, to find where a NaN came from (failure path only)."""
        if "features" not in batch:
            return target_batch(self.run_target(), batch, self.layers, need_logits=True)
        logits = self.stored_logits
        if logits is None and "final" in batch["features"]:
            logits = lm_head_logits(self.run_target().get_output_embeddings())
            logits.transform = logit_transform(self.run_target().config)
        return stored_batch(batch, self.layers, logits, self.stored_device, self.stored_dtype)

    @torch.no_grad()
    def evaluate(self, batch: dict[str, Any]) -> dict[str, Tensor]:
        tb = self.target_batch(batch, self.task.needs_logits() or self.adapted, evaluate=True)
        stats = self.task.eval_stats(self.heads, tb)
        if self.adapted:  # what adapting cost the target: its held-out LM loss with and without the adapter
            stats.update(target_lm_stats(tb.logits, tb.ref_logits, tb.input_ids, tb.loss_mask))
        return stats


def target_lm_stats(logits: Tensor, ref_logits: Tensor, input_ids: Tensor, loss_mask: Tensor) -> dict[str, Tensor]:
    """Summed next-token cross-entropy of the adapted and the base target on target-written tokens."""
    labels = medusa_labels(input_ids, loss_mask, 1, offset=1)[0]  # (B, T)
    flat = labels.flatten()
    ce = torch.nn.functional.cross_entropy
    return {"target_ce_sum": ce(logits.flatten(0, 1).float(), flat, ignore_index=IGNORE_INDEX, reduction="sum"),
            "base_ce_sum": ce(ref_logits.flatten(0, 1).float(), flat, ignore_index=IGNORE_INDEX, reduction="sum"),
            "target_ce_count": (flat != IGNORE_INDEX).sum()}


# -- optimiser and schedule ------------------------------------------------------------------
def lr_factor(step: int, total: int, o: OptimConfig) -> float:
    """Multiplier on the peak lr at optimiser step ``step`` (0-based): linear warm-up, then decay.

    Kept instead of ``transformers.get_scheduler``: its warm-up starts at lr 0 (step 0 trains
    nothing), "linear" has no floor (min_lr_ratio), "cosine_warmup_with_min_lr" decays one step
    ahead, and one schedule serves all param groups (Medusa-2's LoRA starts at ``start_step``).
    After the warm-up, cosine equals its "cosine_with_min_lr" (tests/test_train_losses.py)."""
    if step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - o.warmup_steps) / max(1, total - o.warmup_steps))
    if o.schedule == "linear":
        return 1.0 - (1.0 - o.min_lr_ratio) * progress
    return o.min_lr_ratio + (1.0 - o.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(groups: list[ParamGroup], o: OptimConfig, names: dict[int, str] | None = None
                   ) -> torch.optim.Optimizer:
    """Per ParamGroup: decayed matrices and undecayed biases / norms on AdamW; with ``optim.name: muon``
    the hidden matrices (``muon_eligible`` by ``names``: id(param) -> name) go to a third group, on Muon."""
    names, on_muon = names or {}, o.name == "muon"
    pgs = []
    for g in groups:
        muon = [p for p in g.params if on_muon and muon_eligible(names.get(id(p), ""), p)]
        taken = {id(p) for p in muon}
        decay = [p for p in g.params if p.ndim >= 2 and id(p) not in taken]
        no_decay = [p for p in g.params if p.ndim < 2]
        parts = [(decay, o.weight_decay, False), (no_decay, 0.0, False)] + ([(muon, o.muon_weight_decay, True)]
                                                                            if muon else [])
        for ps, wd, is_muon in parts:  # extra keys ride along in the groups; AdamW ignores "muon"
            pgs.append({"params": ps, "lr": o.lr * g.lr_mult, "weight_decay": wd, "name": g.name,
                        "start_step": g.start_step, "muon": is_muon})
    if on_muon:
        return MuonAdamW(pgs, lr=o.lr, betas=tuple(o.betas), eps=o.eps, momentum=o.muon_momentum)
    return torch.optim.AdamW(pgs, lr=o.lr, betas=tuple(o.betas), eps=o.eps)


def make_scheduler(optimizer: torch.optim.Optimizer, total: int, o: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(start: int) -> Callable[[int], float]:
        return lambda step: 0.0 if step < start else lr_factor(step, total, o)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, [factor(g["start_step"]) for g in optimizer.param_groups])


# -- accelerate plumbing ---------------------------------------------------------------------
def make_accelerator(cfg: TrainConfig) -> Any:
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import GradientAccumulationPlugin, ProjectConfiguration

    mp = cfg.mixed_precision
    on_cpu = cfg.device == "cpu" or not torch.cuda.is_available() or env_true("ACCELERATE_USE_CPU")
    if mp == "auto":  # bf16 where it is fast: a GPU that has it, a CPU measured faster in bf16 than fp32
        mp = "bf16" if bf16_is_fast("cpu" if on_cpu else "cuda") else "no"
    elif mp == "bf16" and on_cpu and not bf16_is_fast("cpu") and PartialState().is_main_process:
        print("warning: mixed_precision=bf16 on a CPU without fast bf16 matmul (emulated bf16 is many times "
              "slower than fp32 here); mixed_precision=auto picks what is fast", file=sys.stderr, flush=True)
    log_with = tracker(cfg.report_to)
    # AcceleratorState is a per-process singleton that refuses a second mixed_precision; reset it
    # (not the distributed PartialState) so several runs can share one process (tests, notebooks).
    AcceleratorState._reset_state()
    # sync_with_dataloader off: a step is always grad_accum micro-batches (the loader is longer
    # than the run, and a resumed run skips whole steps), counted by accelerate, never cut short
    accumulation = GradientAccumulationPlugin(num_steps=cfg.grad_accum, sync_with_dataloader=False)
    return Accelerator(mixed_precision=mp, log_with=log_with, step_scheduler_with_optimizer=False,
                       gradient_accumulation_plugin=accumulation,
                       project_config=ProjectConfiguration(project_dir=cfg.output_dir,
                                                           logging_dir=str(Path(cfg.output_dir) / "logs")),
                       dataloader_config=DataLoaderConfiguration(even_batches=True))


def trainable_only_hook(models: list[nn.Module], weights: list[dict[str, Tensor]], output_dir: str) -> None:
    """Save only what trains (+ head buffers): a Medusa-2 checkpoint must not copy the whole target."""
    for model, w in zip(models, weights):
        keep = {n for n, p in model.named_parameters() if p.requires_grad}
        keep |= {n for n, _ in model.named_buffers() if ".heads." in f".{n}" or n.startswith("heads.")}
        for k in [k for k in w if k not in keep]:
            del w[k]


RUN_KEYS = ("kind", "target", "data", "features", "seed", "max_steps", "epochs", "max_length", "optim", "medusa",
            "lora", "eagle", "group_by_length")


def run_fingerprint(cfg: TrainConfig) -> dict[str, Any]:
    """The settings a resumed run must share with the checkpoint (logging and saving may change)."""
    d = to_dict(cfg)
    return {k: d[k] for k in RUN_KEYS}


def check_resumable(state: dict[str, Any], cfg: TrainConfig, global_batch: int, where: Path) -> None:
    if state.get("global_batch", global_batch) != global_batch:
        raise TrainError(f"cannot resume from {where}: it was trained with a global batch of {state['global_batch']} "
                         f"rows, this run has {global_batch} (batch_size x processes x grad_accum)")
    diff = run_difference(state.get("run", {}), run_fingerprint(cfg))
    if diff:
        raise TrainError(f"cannot resume from {where}: {diff}; use the same settings or a new output_dir")


def check_run_folder(cfg: TrainConfig) -> None:
    """A run folder belongs to one run: refuse an output_dir holding a run of other settings
    (checkpoints, log and heads of two runs would mix), saying how to start fresh or resume."""
    saved = None if cfg.overwrite else folder_run(cfg.output_dir)
    diff = run_difference(saved, run_fingerprint(cfg)) if saved else None
    if diff:
        raise TrainError(f"output_dir {cfg.output_dir} holds another run ({diff}); start fresh with a new output_dir "
                         "or overwrite=true (deletes its checkpoints, log and final heads), or continue that run "
                         "with its own settings and resume_from=latest")


def claim_run_folder(cfg: TrainConfig, hold: contextlib.ExitStack) -> None:
    """Main process, before anything is written: lock output_dir for this process (a second
    writer fails at once), check it holds no other run, and clear it on overwrite."""
    from ..data.distill import output_lock

    out = Path(cfg.output_dir)
    hold.enter_context(output_lock(out, TrainError))
    check_run_folder(cfg)
    if cfg.overwrite:
        clear_run(out)


def total_steps(cfg: TrainConfig, n_rows: int, world: int) -> int:
    if cfg.max_steps is not None:
        return cfg.max_steps
    return max(1, math.ceil(cfg.epochs * n_rows / (cfg.batch_size * world * cfg.grad_accum)))


def task_options(cfg: TrainConfig) -> dict[str, Any]:
    """The option sections this kind reads, for the model card."""
    sections = {"medusa": ("medusa",), "medusa2": ("medusa", "lora"), "dflash": ("dflash",)}.get(cfg.kind, ("eagle",))
    return {name: asdict(getattr(cfg, name)) for name in sections}


def run_name(cfg: TrainConfig) -> str:
    return cfg.run_name or Path(cfg.output_dir).resolve().name


def tracker_config(cfg: TrainConfig) -> dict[str, Any]:
    """Flat scalars for trackers (tensorboard's hparams take no lists or dicts)."""
    flat: dict[str, Any] = {}

    def walk(d: dict[str, Any], prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                flat[prefix + k] = v if isinstance(v, (int, float, str, bool)) else str(v)

    walk(to_dict(cfg), "")
    return flat


def reduce_mean(accelerator: Any, values: dict[str, Tensor]) -> dict[str, float]:
    """One sync point: stack, average over processes, ``.tolist()``."""
    keys = sorted(values)
    stacked = torch.stack([values[k].float().reshape(()) for k in keys]).to(accelerator.device)
    stacked = accelerator.reduce(stacked, reduction="mean")
    return dict(zip(keys, stacked.tolist()))


# -- logging ---------------------------------------------------------------------------------
class RunLog:
    """``output_dir/log.jsonl`` (main process) + trackers + console."""

    def __init__(self, accelerator: Any, path: Path, console: Any) -> None:
        self.acc, self.path, self.console = accelerator, path, console

    def truncate_after(self, step: int) -> None:
        """On resume, drop records past the checkpoint (the interrupted run may have logged further)."""
        if not self.acc.is_main_process or not self.path.is_file():
            return
        keep = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= step]
        self.path.write_text("".join(line + "\n" for line in keep))

    def write(self, record: dict[str, Any], tracker: dict[str, float] | None = None, text: str | None = None) -> None:
        if tracker:
            self.acc.log(tracker, step=record.get("step"))
        if not self.acc.is_main_process:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(json_safe(record), allow_nan=False) + "\n")  # NaN -> null: strict JSON lines
        if text and self.console is not None:
            self.console.print(text)


def eval_loader(rows: Any, cfg: TrainConfig, accelerator: Any, pad_id: int) -> DataLoader:
    """This process's share of the held-out rows (row i goes to process i % world): exact sums, no padding."""
    if len(rows) < accelerator.num_processes:
        raise TrainError(f"the held-out set has {len(rows)} rows, fewer than the {accelerator.num_processes} "
                         "processes; raise eval_fraction or give eval_data")
    idx = list(range(accelerator.process_index, len(rows), accelerator.num_processes))
    return DataLoader(rows.select(idx), batch_size=cfg.batch_size, shuffle=False,
                      collate_fn=collate_fn(rows, pad_id, cfg.max_length))


def evaluate(module: TrainModule, loader: DataLoader, accelerator: Any, cfg: TrainConfig) -> dict[str, Any]:
    was_training = module.training
    module.eval()
    totals: dict[str, Tensor] = {}
    for i, batch in enumerate(loader):
        if cfg.eval_max_batches is not None and i >= cfg.eval_max_batches:
            break
        with accelerator.autocast():
            stats = module(batch, 0, evaluate=True)
        for k, v in stats.items():
            totals[k] = totals[k] + v.detach() if k in totals else v.detach().clone()
    totals = {k: accelerator.reduce(v.to(accelerator.device), reduction="sum").cpu() for k, v in sorted(totals.items())}
    module.train(was_training)
    out = module.task.summarize({k: v for k, v in totals.items() if not k.startswith(("target_ce", "base_ce"))})
    if "target_ce_sum" in totals:
        n = max(1, int(totals["target_ce_count"]))
        out["target_loss"] = round(float(totals["target_ce_sum"]) / n, 5)
        out["base_target_loss"] = round(float(totals["base_ce_sum"]) / n, 5)
        out["target_loss_cost"] = round(out["target_loss"] - out["base_target_loss"], 5)
    return out


def eval_text(ev: dict[str, Any]) -> str:
    top1 = " ".join(f"{x:.3f}" for x in ev["top1"])
    extra = f" | target loss {ev['target_loss']:.4f} (base {ev['base_target_loss']:.4f})" if "target_loss" in ev else ""
    decode = f" (decoder steps: {ev['tau_decode']:.3f})" if "tau_decode" in ev else ""
    return (f"eval: top1 per head [{top1}] | chain tau {ev['tau']:.3f} over {ev['positions']} positions{decode}"
            f"{extra}")


def eval_scalars(ev: dict[str, Any]) -> dict[str, float]:
    out = {"eval/tau": ev["tau"], **({"eval/tau_decode": ev["tau_decode"]} if "tau_decode" in ev else {})}
    for key, vals in ev.items():
        if isinstance(vals, list) and key.startswith("top"):
            out.update({f"eval/{key}_head{k}": v for k, v in enumerate(vals)})
    for key in ("target_loss", "base_target_loss", "target_loss_cost"):
        if key in ev:
            out[f"eval/{key}"] = ev[key]
    return out


# -- non-finite guards ----------------------------------------------------------------------
def step_is_finite(accelerator: Any, loss: Tensor, grad_norm: Tensor | None) -> bool:
    """One sync per step: the step's summed loss and its gradient norm are finite (on every process).
    Under fp16 the grad scaler skips overflowing steps itself, so only the loss is checked there."""
    ok = torch.isfinite(loss)
    if grad_norm is not None and accelerator.scaler is None:
        ok = ok & torch.isfinite(torch.as_tensor(grad_norm, device=ok.device))
    if accelerator.num_processes > 1:  # every process must stop, not only the one with the NaN row
        ok = accelerator.reduce(ok.float().reshape(1), reduction="sum") == accelerator.num_processes
    return bool(ok.all())


def non_finite_message(module: TrainModule, cfg: TrainConfig, step: int, batches: list[dict[str, Any]],
                       losses: list[Tensor], grad_norm: Tensor | None) -> str:
    """After a non-finite step: the first non-finite input, in the order the data flows (the
    target's hidden states or the stored features, the target's logits, the loss, the gradient
    norm), on the step's real tokens, as one line naming the step and what to do."""
    head = f"training stopped at step {step}"
    tail = "; nothing of this step was saved"
    for i, batch in enumerate(batches):
        where = f" (micro-batch {i + 1} of {len(batches)})" if len(batches) > 1 else ""
        tb = module.inspect(batch)
        real = tb.attention_mask.bool()  # (B, T): padding is never read
        for layer, hidden in sorted(tb.hidden.items()):
            if not bool(torch.isfinite(hidden[real]).all()):
                key = feature_key(layer)
                if "features" in batch:
                    return (f"{head}: the stored features '{key}' in {cfg.features} are NaN/inf{where}; make them "
                            f"again with headway features{tail}")
                return (f"{head}: the target's hidden states '{key}' are NaN/inf{where}; check the target's weights "
                        f"or its dtype (dtype={cfg.dtype}; float16 overflows){tail}")
        if tb.logits is not None and not bool(torch.isfinite(tb.logits[real]).all()):
            return (f"{head}: the target's logits are NaN/inf though its hidden states are finite{where}; check its "
                    f"lm_head weights or dtype={cfg.dtype}{tail}")
        if not bool(torch.isfinite(losses[i]).all()):
            return (f"{head}: the loss is {float(losses[i])} though the target's hidden states and logits are "
                    f"finite{where}: the heads diverged; lower optim.lr (now {cfg.optim.lr}) or set "
                    f"optim.max_grad_norm{tail}")
    norm = float(grad_norm) if grad_norm is not None else math.nan
    return (f"{head}: the gradient norm is {norm} though the loss is finite; lower optim.lr (now {cfg.optim.lr}) "
            f"or set optim.max_grad_norm{tail}")


def non_finite_weight(module: TrainModule, accelerator: Any = None) -> str | None:
    """The name of the first trainable weight that holds a NaN/inf (one sync), or None: heads with
    such weights are never written. Sharded weights (FSDP) are checked shard by shard on every
    process (a collective then: every process calls it)."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if not named:
        return None
    finite = torch.stack([torch.isfinite(local_part(p.detach())).all() for _, p in named])  # (P,) bool
    if accelerator is not None and accelerator.num_processes > 1 and any(is_sharded(p) for _, p in named):
        finite = accelerator.reduce(finite.float(), reduction="sum") == accelerator.num_processes
    if bool(finite.all()):
        return None
    return named[int((~finite).nonzero()[0])][0]


# -- the loop --------------------------------------------------------------------------------
def train(cfg: TrainConfig) -> Path:
    """Train heads as configured; returns the final heads folder (or the checkpoint, if stopped early)."""
    from ..target import resolve_target_path
    from ..target import load_target

    check_data_paths(cfg)
    check_run_folder(with_features_data(cfg))  # before a (possibly large) target loads; fit checks again, locked
    accelerator = make_accelerator(cfg)
    with accelerator.main_process_first():  # the demo target builds once, then everyone reads it
        target_path = resolve_target_path(cfg.target)
    target, tokenizer = load_target(target_path, dtype=cfg.dtype, device=cfg.device or accelerator.device,
                                    adapter=cfg.adapter, revision=cfg.revision)
    return fit(cfg, target, tokenizer, accelerator)


def with_features_data(cfg: TrainConfig) -> TrainConfig:
    """Offline with ``data`` empty: the features' dataset (EAGLE-3's draft vocabulary is counted on it)."""
    return replace(cfg, data=features_dataset(cfg)) if cfg.features and not cfg.data else cfg


def fit(cfg: TrainConfig, target: nn.Module, tokenizer: Any, accelerator: Any = None) -> Path:
    """``train`` on a target already loaded (frozen; on the accelerator's device, sharded when accelerate shards)."""
    with contextlib.ExitStack() as hold:  # hold: output_dir's lock, until training ends or fails
        run = setup(cfg, target, tokenizer, accelerator, hold)
        run_steps(run)
        return finish(run)


@dataclass
class TrainRun:
    """What ``setup`` builds and the loop runs (torchtune's recipe split: setup, then train)."""

    cfg: TrainConfig
    accelerator: Any
    task: Task
    module: nn.Module  # as prepared (DDP-wrapped under several processes)
    inner: TrainModule  # the same module unwrapped
    optimizer: Any
    scheduler: Any
    batches: Any  # the prepared training loader, past the batches of resumed steps
    ev_loader: DataLoader | None
    log: RunLog
    tokenizer: Any
    train_rows: int
    steps: int  # the run's total optimiser steps (the schedule's length)
    stop: int  # where this invocation stops (stop_after, or time_limit once it passes)
    global_batch: int
    step: int = 0
    started_at: int = 0  # the step this invocation resumed at
    tokens_seen: int = 0
    train_time: float = 0.0
    last_eval: dict[str, Any] | None = None
    last_loss: float | None = None
    pending_tokens: Tensor | None = None  # tokens of the steps since the last log line (on the device)
    sharding: dict[str, Any] | None = None  # how the frozen target is sharded (sharding_record)
    timed_out: bool = False  # time_limit passed: the final heads are saved where the loop stopped
    began: float = 0.0  # when this invocation's loop started (time_limit)

    @property
    def out(self) -> Path:
        return Path(self.cfg.output_dir)

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    def state(self) -> dict[str, Any]:
        """The resumable counters of a checkpoint. Every process calls this (a collective): the
        tokens not logged yet are counted too, or a resume from a save between two log steps
        would restart the count without them."""
        pending = 0 if self.pending_tokens is None else int(self.accelerator.reduce(self.pending_tokens,
                                                                                     reduction="sum"))
        return {"tokens": self.tokens_seen + pending, "train_time_s": self.train_time, "total_steps": self.steps,
                "world_size": self.world, "global_batch": self.global_batch, "run": run_fingerprint(self.cfg)}


def setup(cfg: TrainConfig, target: nn.Module, tokenizer: Any, accelerator: Any, hold: contextlib.ExitStack
          ) -> TrainRun:
    """Build everything a run needs: heads, data, optimiser, schedule, accelerate, the claimed
    run folder, the resumed state and the log. Every refusal comes before anything is written."""
    from accelerate.utils import set_seed

    accelerator = accelerator or make_accelerator(cfg)
    check_accumulation(accelerator, cfg)
    check_optimizer(accelerator, cfg)
    set_seed(cfg.seed)
    check_data_paths(cfg)
    cfg = with_features_data(cfg)
    target.to(accelerator.device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)

    task: Task = TASKS[cfg.kind](cfg)
    for key, path in features_folders(cfg):  # before heads are sized from the target
        check_features_target(key, path, target, cfg)
    heads = task.build(target)
    if cfg.init_from:  # a resumed run reads its checkpoint below instead
        warm_start(heads, cfg.init_from, target, tokenizer)
    model = task.adapt_target(target)
    adapted = model is not target
    keys = stored_keys(task.feature_layers(heads), task.needs_logits())
    if cfg.features:
        check_features_layers(cfg, target, keys, task.needs_logits())
    train_rows, eval_rows = split_data(cfg, keys)
    module = TrainModule(task, heads, model, adapted, offline=bool(cfg.features))
    module.train()
    if not adapted:
        target.eval()

    world = accelerator.num_processes
    steps = total_steps(cfg, len(train_rows), world)
    global_batch = cfg.batch_size * world * cfg.grad_accum
    loader = train_loader(train_rows, cfg, steps, global_batch, pad_id, accelerator)
    names = {id(p): n for n, p in heads.named_parameters()} | {id(p): n for n, p in model.named_parameters()}
    optimizer = make_optimizer(task.param_groups(heads, model), cfg.optim, names)
    scheduler = make_scheduler(optimizer, steps, cfg.optim)
    module, optimizer, loader, scheduler = accelerator.prepare(module, optimizer, loader, scheduler)
    inner = accelerator.unwrap_model(module)
    sharding = None
    if adapted:  # the adapted target is inside the prepared module: accelerate shards it with the heads
        accelerator.register_save_state_pre_hook(trainable_only_hook)
    else:
        frozen, backend = shard_target(target, heads, accelerator)
        object.__setattr__(inner, "frozen_target", frozen)
        sharding = sharding_record(frozen, backend, accelerator)
    ev_loader = eval_loader(eval_rows, cfg, accelerator, pad_id) if eval_rows is not None else None

    if accelerator.is_main_process:  # every refusal above wrote nothing; from here on the folder is ours
        claim_run_folder(cfg, hold)
    accelerator.wait_for_everyone()
    run = TrainRun(cfg, accelerator, task, module, inner, optimizer, scheduler, loader,
                   ev_loader, RunLog(accelerator, Path(cfg.output_dir) / "log.jsonl", main_console(accelerator)),
                   tokenizer, len(train_rows), steps, steps, global_batch, sharding=sharding)
    resume = resume_run(run, adapted)
    start_log(run, resume, len(eval_rows) if eval_rows is not None else 0)
    return run


def sharding_record(target: nn.Module, backend: str | None, accelerator: Any) -> dict[str, Any] | None:
    """How the frozen target is spread over the processes, for the log: the backend, its parameter
    count and how many each process holds (a collective). None when every process holds it whole."""
    if backend is None:
        return None
    held, whole = shard_sizes(target)
    per_rank = accelerator.gather(torch.tensor([held], device=accelerator.device)).tolist()
    return {"backend": backend, "params": whole, "params_per_rank": per_rank}


def check_accumulation(accelerator: Any, cfg: TrainConfig) -> None:
    """An accelerator made elsewhere must accumulate as configured: ``accumulate`` decides when to
    sync and ``backward`` divides the loss by its count."""
    if accelerator.gradient_accumulation_steps != cfg.grad_accum:
        raise TrainError(f"the accelerator accumulates {accelerator.gradient_accumulation_steps} micro-batches but "
                         f"grad_accum={cfg.grad_accum}; make it with make_accelerator(cfg)")


def check_optimizer(accelerator: Any, cfg: TrainConfig) -> None:
    """Muon orthogonalises whole matrices: refuse runs where accelerate shards the heads' parameters."""
    from accelerate.utils import DistributedType

    if cfg.optim.name == "muon" and accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise TrainError(f"optim.name=muon needs each head matrix whole in every process, but this run shards the "
                         f"heads or their optimiser state ({accelerator.distributed_type.value}); use "
                         "optim.name=adamw or plain DDP")


def train_loader(rows: Any, cfg: TrainConfig, steps: int, global_batch: int, pad_id: int, accelerator: Any
                 ) -> DataLoader:
    """Enough seeded epochs for every step (plus one batch per process), in a fixed order."""
    world = accelerator.num_processes
    epochs = max(1, math.ceil((steps * global_batch + cfg.batch_size * world) / len(rows)))
    lengths = row_lengths(rows, cfg.max_length) if cfg.group_by_length else None
    view = EpochView(rows, cfg.seed, epochs, lengths, cfg.group_by_length * global_batch)
    return DataLoader(view, batch_size=cfg.batch_size, shuffle=False,
                      collate_fn=collate_fn(rows, pad_id, cfg.max_length), num_workers=cfg.num_workers,
                      pin_memory=bool(cfg.features) and accelerator.device.type == "cuda")  # stored states: copy fast


def resume_run(run: TrainRun, adapted: bool) -> Path | None:
    """Load the checkpoint ``resume_from`` names (if any), record the run in its folder, and skip
    the batches already trained on. Returns the checkpoint resumed from."""
    cfg, acc = run.cfg, run.accelerator
    resume = resolve_resume(cfg.resume_from, run.out)
    if resume is not None:
        state = read_state(resume)
        check_resumable(state, cfg, run.global_batch, resume)
        acc.load_state(str(resume), **({"strict": False} if adapted else {}))
        run.step, run.tokens_seen, run.train_time = state["step"], state["tokens"], state["train_time_s"]
        run.started_at = run.step
    if acc.is_main_process:  # the folder now belongs to this run
        write_run(run.out, run_fingerprint(cfg))
    run.stop = min(run.steps, cfg.stop_after) if cfg.stop_after is not None else run.steps
    if run.step:
        run.batches = acc.skip_first_batches(run.batches, run.step * cfg.grad_accum)
    return resume


def tracker(report_to: str) -> list[str] | None:
    """accelerate's ``log_with`` for ``report_to``; a tracker whose package is not installed is left
    out with one line saying what to install (the run's own log.jsonl still has every record).
    ``PartialState`` is only asked then: made before the Accelerator on every run, it left both
    processes of a 2-process CPU run believing they were the main one."""
    if report_to == "none":
        return None
    try:
        need(report_to, f"report_to: {report_to}")
    except MissingDependency as e:
        from accelerate import PartialState

        if PartialState().is_main_process:
            print(f"headway train: {skip_line(e, f'report_to: {report_to}')}; the run's log.jsonl has every "
                  "record", file=sys.stderr, flush=True)
        return None
    return [report_to]


def main_console(accelerator: Any) -> Any:
    from rich.console import Console

    return Console() if accelerator.is_main_process else None


def start_log(run: TrainRun, resume: Path | None, eval_rows: int) -> None:
    """Trackers, and the run's first log record and line."""
    cfg, step = run.cfg, run.step
    run.log.truncate_after(step)
    if run.accelerator.log_with:
        run.accelerator.init_trackers(cfg.project, config=tracker_config(cfg),
                                      init_kwargs={"wandb": wandb_kwargs(cfg, run.out)})
    run.log.write({"event": "start", "step": step, "world_size": run.world, "total_steps": run.steps,
                   "global_batch": run.global_batch, "resumed_from": str(resume) if resume else None, "kind": cfg.kind,
                   "train_rows": run.train_rows, "eval_rows": eval_rows, "features": cfg.features,
                   "target_sharding": run.sharding},
                  text=f"training {cfg.kind} heads: {run.steps} steps, global batch {run.global_batch} on {run.world} "
                       "process(es)" + (f", from stored features {cfg.features}" if cfg.features else "")
                       + (f", resuming at step {step}" if step else "")
                       + (f"; target sharded ({run.sharding['backend']}): {run.sharding['params_per_rank']} of "
                          f"{run.sharding['params']} parameters per process" if run.sharding else ""))


def wandb_kwargs(cfg: TrainConfig, out: Path) -> dict[str, Any]:
    """wandb writes under the run folder, unless the user chose a place with ``WANDB_DIR``."""
    kwargs: dict[str, Any] = {"name": run_name(cfg)}
    if not os.environ.get("WANDB_DIR"):
        kwargs["dir"] = str(out)
    return kwargs


def run_steps(run: TrainRun) -> None:
    """The training loop: ``grad_accum`` micro-batches per optimiser step, a log line every
    ``log_every`` steps, eval every ``eval_every``, a checkpoint every ``save_every`` and at the stop."""
    cfg, acc, module = run.cfg, run.accelerator, run.module
    params = [p for p in module.parameters() if p.requires_grad]
    it = iter(run.batches)
    sums: dict[str, Tensor] = {}

    def zero() -> Tensor:  # token counts stay on the device: no sync until the log interval
        return torch.zeros((), dtype=torch.long, device=acc.device)

    run.pending_tokens, window_steps, window_start = zero(), 0, time.perf_counter()
    run.began = window_start
    with Progress("train", run.steps, unit="steps", enabled=cfg.progress and acc.is_main_process,
                  every=cfg.log_every, stream=sys.stdout, completed=run.step) as progress:
        while run.step < run.stop:
            t0 = time.perf_counter()
            step_batches, step_losses = [], []
            for _ in range(cfg.grad_accum):
                batch = next(it)
                # accumulate: no gradient sync until the last micro-batch (the plugin counts them,
                # see make_accelerator); backward divides the loss by grad_accum
                with acc.accumulate(module):
                    loss, metrics = module(batch, run.step)
                    acc.backward(loss)
                for k, v in {"loss": loss.detach(), **metrics}.items():
                    sums[k] = sums.get(k, 0) + v.detach().float() / cfg.grad_accum
                run.pending_tokens += batch["attention_mask"].sum()
                step_batches.append(batch)
                step_losses.append(loss.detach())
            # the norm is computed anyway (clipping, or clip at inf = no-op): it and the loss are
            # checked with the step's one sync, before a NaN can reach the weights
            grad_norm = acc.clip_grad_norm_(params, cfg.optim.max_grad_norm or math.inf)
            if not step_is_finite(acc, torch.stack(step_losses).float().sum(), grad_norm):
                stop_non_finite(run, run.step + 1, non_finite_message(run.inner, cfg, run.step + 1, step_batches,
                                                                      step_losses, grad_norm))
            if grad_norm is not None:  # the norm before clipping, averaged over the log window
                sums["grad_norm"] = sums.get("grad_norm", 0) + torch.as_tensor(grad_norm).detach().float()
            run.optimizer.step()
            run.scheduler.step()
            run.optimizer.zero_grad(set_to_none=True)
            run.step += 1
            window_steps += 1
            run.train_time += time.perf_counter() - t0

            if run.step % cfg.log_every == 0 or run.step == run.stop:
                log_window(run, sums, window_steps, window_start, progress)
                sums, run.pending_tokens, window_steps = {}, zero(), 0
                window_start = time.perf_counter()
                if run.step < run.stop and past_time_limit(run):
                    run.stop, run.timed_out = run.step, True
            if run.ev_loader is not None and cfg.eval_every and run.step % cfg.eval_every == 0 \
                    and run.step < run.steps:
                log_eval(run)
                window_start = time.perf_counter()
            if (cfg.save_every and run.step % cfg.save_every == 0) or run.step == run.stop:
                save_step(run)
                window_start = time.perf_counter()


def past_time_limit(run: TrainRun) -> bool:
    """Whether ``time_limit`` has passed, as the main process sees it (every process takes its answer)."""
    from accelerate.utils import broadcast_object_list

    if run.cfg.time_limit is None:
        return False
    late = [time.perf_counter() - run.began > run.cfg.time_limit * 60]
    broadcast_object_list(late)
    if late[0]:
        run.log.write({"event": "time_limit", "step": run.step, "minutes": run.cfg.time_limit},
                      text=f"time limit ({run.cfg.time_limit:g} min) reached at step {run.step} of {run.steps}: "
                           "saving the final heads now")
    return bool(late[0])


def log_window(run: TrainRun, sums: dict[str, Tensor], window_steps: int, window_start: float,
               progress: Progress) -> None:
    """One sync: the window's mean metrics and tokens over processes, to the log, trackers and progress."""
    acc = run.accelerator
    vals = reduce_mean(acc, {k: v / window_steps for k, v in sums.items()})
    n_tok = int(acc.reduce(run.pending_tokens, reduction="sum"))
    run.tokens_seen += n_tok
    tps = n_tok / max(1e-9, time.perf_counter() - window_start)
    lr = run.scheduler.get_last_lr()[0]
    run.last_loss = vals["loss"]
    run.log.write({"step": run.step, **vals, "lr": lr, "tokens_per_s": tps, "tokens": run.tokens_seen},
                  tracker={**{f"train/{k}": v for k, v in vals.items()}, "train/lr": lr, "train/tokens_per_s": tps})
    progress.update(run.step, tokens=n_tok, info=f"loss {vals['loss']:.4f} lr {lr:.2e}")


def log_eval(run: TrainRun) -> None:
    run.last_eval = evaluate(run.inner, run.ev_loader, run.accelerator, run.cfg)
    run.log.write({"step": run.step, "eval": run.last_eval}, tracker=eval_scalars(run.last_eval),
                  text=eval_text(run.last_eval))


def save_step(run: TrainRun) -> None:
    """A resumable checkpoint of this step; never one holding a NaN/inf weight."""
    bad = non_finite_weight(run.inner, run.accelerator)
    if bad:
        stop_non_finite(run, run.step, f"training stopped at step {run.step}: the weight {bad} is NaN/inf after the "
                                       "optimiser step; no checkpoint was saved. Lower optim.lr or set "
                                       "optim.max_grad_norm")
    save_checkpoint(run.accelerator, run.out, run.step, run.state(), run.cfg.keep_checkpoints)


def stop_non_finite(run: TrainRun, at: int, message: str) -> None:
    run.log.write({"event": "non_finite", "step": at, "error": message})
    raise NonFiniteError(message)


def finish(run: TrainRun) -> Path:
    """After the loop: the checkpoint of an early stop, or a last eval and the final heads."""
    cfg, acc, step = run.cfg, run.accelerator, run.step
    if step < run.steps and not run.timed_out:  # stopped early on purpose (stop_after): resumable, no final heads
        run.log.write({"event": "stopped", "step": step}, text=f"stopped after step {step}; resume with "
                                                               "resume_from=latest")
        end_run(run)
        return run.out / "checkpoints" / f"checkpoint-{step}"
    final = run.out / "final"
    if kept_final(run, final):
        run.log.write({"event": "complete", "step": step, "final": str(final)},
                      text=f"{run.out} is already complete ({step} steps); the heads at {final} are kept as they "
                           "are (a tuned tree stays); delete that folder to save them again")
        end_run(run)
        return final
    if run.ev_loader is not None:
        log_eval(run)
    bad = non_finite_weight(run.inner, acc)
    if bad:
        stop_non_finite(run, step, f"training stopped after step {step}: the weight {bad} is NaN/inf; the final "
                                   "heads were not saved. Lower optim.lr or set optim.max_grad_norm")
    heads = whole_heads(run)  # a collective when the heads are sharded
    if acc.is_main_process:
        save_final(run, final, heads)
    acc.wait_for_everyone()
    tps = run.tokens_seen / max(run.train_time, 1e-9)
    run.log.write({"event": "done", "step": step, "final": str(final), "train_time_s": run.train_time,
                   "tokens_per_s": tps},
                  text=f"done: {run.tokens_seen} tokens in {run.train_time:.1f}s ({tps:,.0f} tok/s); "
                       f"heads saved to {final}")
    end_run(run)
    return final


def kept_final(run: TrainRun, final: Path) -> bool:
    """A run resumed at its last step, whose final heads were saved: nothing to train or save.
    Saving again would drop what was stored with the heads since (``headway tune``'s tree)."""
    from accelerate.utils import broadcast_object_list

    done = [run.started_at == run.steps and is_heads_checkpoint(final)]
    broadcast_object_list(done)  # the main process's view: every process takes the same branch
    return bool(done[0])


def end_run(run: TrainRun) -> None:
    """accelerate's ``end_training`` (trackers finish, the process group is destroyed), once nothing
    holds the DDP wrapper any more. Its reducer owns a reference to the process group: freed after
    the group was destroyed, it is the group's last owner and tears gloo down with the GIL held, which
    can deadlock against a gloo thread still releasing the last barrier's work (a rare hang after
    "done", seen in two-process runs). Freed first, the group outlives it and goes down cleanly."""
    run.module = run.inner
    run.optimizer = run.scheduler = run.batches = None
    run.accelerator.free_memory()
    gc.collect()
    run.accelerator.end_training()


def whole_heads(run: TrainRun) -> Any:
    """The trained heads with whole weights: themselves, or (heads sharded by FSDP) an unsharded
    copy gathered from every process, on the main process (None elsewhere). Every process calls it."""
    heads = run.inner.heads
    # FSDP2 may hold the weights whole right now (its root keeps them after a forward), but its
    # state dict is always of shards: ask the state dict, not the parameters
    if not any(is_sharded(v) for v in heads.state_dict().values()):
        return heads
    state = full_state(heads)
    if not run.accelerator.is_main_process:
        return None
    plain = type(heads)(heads.config, heads.target_info)
    plain.load_state_dict(state)  # strict: every tensor, whole, on the CPU
    plain.metadata = heads.metadata
    for key in ("_target_embed", "_target_lm_head"):  # the borrowed target modules, as the trained heads have
        object.__setattr__(plain, key, heads.__dict__.get(key))
    return plain


def save_final(run: TrainRun, final: Path, heads: Any = None) -> None:
    """Main process: the heads with their training record, tokenizer, eval and calibration."""
    cfg = run.cfg
    heads = heads if heads is not None else run.inner.heads
    heads.metadata["training"] = {
        "kind": cfg.kind, "target": cfg.target, "data": str(cfg.data), "features": cfg.features,
        "train_rows": run.train_rows, "steps": run.steps, "global_batch": run.global_batch, "world_size": run.world,
        "tokens": run.tokens_seen, "train_time_s": round(run.train_time, 2),
        "tokens_per_s": round(run.tokens_seen / max(run.train_time, 1e-9), 1),
        "final_loss": run.last_loss, "optim": asdict(cfg.optim), "seed": cfg.seed, "options": task_options(cfg)}
    heads.record_tokenizer(run.tokenizer)  # the decoder refuses a tokenizer whose ids mean other tokens
    if run.last_eval is not None:
        heads.metadata["eval"] = run.last_eval
        if "calibration" in run.last_eval:  # the decoder ranks tree nodes with these temperatures
            heads.metadata["calibration"] = calibration_metadata(run.last_eval["calibration"])
    run.task.save(heads, run.inner.run_target(), final)
    publish_dirs(final)  # the heads are written to a private temp folder, then renamed


def train_cli(cfg: TrainConfig) -> int:
    train(cfg)
    return 0
