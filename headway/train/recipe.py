"""``headway train``: one recipe for every head kind, on accelerate (torchtune's recipe shape).

``TrainRecipe(cfg).run()`` is ``setup`` -> ``train`` -> ``save`` -> ``cleanup``:

- **setup** checks everything it can before the target loads (data and feature folders, the run
  folder's other run), loads the frozen target, checks the kind's target limits (its contract,
  ``contracts.py``), builds the heads (``Task.build``), the rows, the optimiser and schedule,
  prepares them with accelerate, and only then claims the run folder, restores a checkpoint and
  opens the log: every refusal comes before anything is written.
- **train** runs ``grad_accum`` micro-batches per optimiser step, one sync per step (the loss and
  gradient norm are finite on every process), a log line every ``log_every`` steps, evaluation
  every ``eval_every``, a checkpoint every ``save_every`` and at the stop (``stop_after``,
  ``time_limit``, or the last step).
- **save** writes the final heads with their training record, evaluation and calibration (or,
  after ``stop_after``, leaves the resumable checkpoint).
- **cleanup** ends trackers and the process group.

What differs per head kind is its ``Task`` (``tasks.py``; the loss and evaluation) and its
``Contract`` (``contracts.py``; options, features, limits, the run fingerprint). The frozen
target never trains and is never wrapped or saved; Medusa-2's adapted target trains inside the
prepared module. Raises ``TrainError`` (one line) for any setting the run cannot honour and
``NonFiniteError`` when a NaN/inf stops it.
"""

from __future__ import annotations

import contextlib
import gc
import math
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from ..config import ConfigError
from ..heads.files import is_heads_checkpoint
from ..progress import Progress
from ..publish import check_output_path
from .accel import (check_accumulation, check_optimizer, main_console, make_accelerator, reduce_mean, sharding_record,
                    trainable_only_hook)
from .calibration import calibration_metadata
from .checkpoints import (check_resumable, check_run_folder, claim_run_folder, publish_dirs, read_state,
                          resolve_resume, run_fingerprint, save_checkpoint, write_run)
from .config import TrainConfig
from .contracts import CONTRACTS, TargetShape
from .errors import NonFiniteError, TrainError
from .guards import non_finite_message, non_finite_weight, step_is_finite
from .loaders import eval_loader, split_data, train_loader
from .module import TrainModule, evaluate
from .offline import FeatureFolders
from .optim import make_optimizer, make_scheduler
from .registry import TASKS
from .runlog import RunLog, eval_scalars, eval_text, run_name, tracker_config, wandb_kwargs
from .sharding import full_state, is_sharded, shard_target
from .tasks import Task
from .warm_start import warm_start


def train(cfg: TrainConfig) -> Path:
    """Train heads as configured; returns the final heads folder (or the checkpoint, if stopped early)."""
    return TrainRecipe(cfg).run()


def fit(cfg: TrainConfig, target: nn.Module, tokenizer: Any, accelerator: Any = None) -> Path:
    """``train`` on a target already loaded (frozen; on the accelerator's device, sharded when accelerate shards)."""
    return TrainRecipe(cfg, target, tokenizer, accelerator).run()


class TrainRecipe:
    """One training run: the settings, what ``setup`` builds, and the counters the loop advances."""

    def __init__(self, cfg: TrainConfig, target: nn.Module | None = None, tokenizer: Any = None,
                 accelerator: Any = None) -> None:
        self.cfg, self.contract = cfg, CONTRACTS[cfg.kind]
        self.target, self.tokenizer, self.accelerator = target, tokenizer, accelerator
        self.step = 0
        self.started_at = 0  # the step this invocation resumed at
        self.tokens_seen = 0
        self.train_time = 0.0
        self.last_eval: dict[str, Any] | None = None
        self.last_loss: float | None = None
        self.pending_tokens: Tensor | None = None  # tokens of the steps since the last log line (on the device)
        self.timed_out = False  # time_limit passed: the final heads are saved where the loop stopped
        self.began = 0.0  # when this invocation's loop started (time_limit)

    def run(self) -> Path:
        with contextlib.ExitStack() as hold:  # hold: output_dir's lock, until training ends or fails
            self.setup(hold)
            self.train()
            return self.save()

    @property
    def out(self) -> Path:
        return Path(self.cfg.output_dir)

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    # -- setup ----------------------------------------------------------------------------------
    def check_inputs(self) -> None:
        """Before a (possibly large) target loads: the data is there, the feature folders fit the
        kind, and output_dir holds no other run. Offline with ``data`` empty, the features' dataset
        becomes ``data`` (a draft vocabulary is counted on it)."""
        cfg = self.cfg
        if not cfg.data and not cfg.features:
            raise TrainError("no training data: set data=PATH to a distilled dataset (headway distill makes one) "
                             "or features=DIR (headway features makes one)")
        for what, path in (("training data", cfg.data), ("eval data", cfg.eval_data)):
            if path and not Path(path).expanduser().exists():
                raise TrainError(f"{what} not found: {path}")
        check_output_path(cfg.output_dir, "output_dir", error=TrainError)  # output_dir=afile/sub: refused here
        features = FeatureFolders(cfg)
        features.check()
        if cfg.features and not cfg.data:
            self.cfg = cfg = replace(cfg, data=features.dataset())
        self.features = features
        check_run_folder(cfg.output_dir, run_fingerprint(cfg), cfg.overwrite)

    def load_target(self) -> None:
        from ..target import load_target, resolve_target_path

        cfg = self.cfg
        if self.accelerator is None:
            self.accelerator = make_accelerator(cfg)
        if self.target is None:
            with self.accelerator.main_process_first():  # the demo target builds once, then everyone reads it
                path = resolve_target_path(cfg.target)
            self.target, self.tokenizer = load_target(path, dtype=cfg.dtype, device=cfg.device or self.accelerator.device,
                                                      adapter=cfg.adapter, revision=cfg.revision)
        shape = TargetShape(int(self.target.config.num_hidden_layers),
                            int(self.target.get_output_embeddings().weight.shape[0]))
        try:
            self.contract.check_target(cfg, shape)
        except ConfigError as e:
            raise TrainError(f"{e} (target {cfg.target})") from None

    def setup(self, hold: contextlib.ExitStack) -> None:
        """Build everything a run needs: heads, data, optimiser, schedule, accelerate, the claimed
        run folder, the resumed state and the log. Every refusal comes before anything is written."""
        from accelerate.utils import set_seed

        self.check_inputs()
        self.load_target()
        cfg, acc, target, tokenizer = self.cfg, self.accelerator, self.target, self.tokenizer
        check_accumulation(acc, cfg.grad_accum)
        check_optimizer(acc, cfg.optim.name)
        set_seed(cfg.seed)
        target.to(acc.device)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)

        task: Task = TASKS[cfg.kind](cfg)
        self.features.check_target(target)  # before heads are sized from the target
        heads = self.build_heads(task)
        model = task.adapt_target(target)
        adapted = model is not target
        keys, eval_keys = self.features.keys(task.feature_layers(heads), task.needs_logits())
        self.features.check_layers(target, keys, task.needs_logits(), eval_keys)
        train_rows, eval_rows = split_data(cfg, keys, eval_keys)
        inner = TrainModule(task, heads, model, adapted, offline=bool(cfg.features))
        inner.train()
        if not adapted:
            target.eval()

        steps = cfg.max_steps if cfg.max_steps is not None else max(
            1, math.ceil(cfg.epochs * len(train_rows) / (cfg.batch_size * acc.num_processes * cfg.grad_accum)))
        self.global_batch = cfg.batch_size * acc.num_processes * cfg.grad_accum
        loader = train_loader(train_rows, cfg, steps, self.global_batch, pad_id, acc)
        names = {id(p): n for n, p in heads.named_parameters()} | {id(p): n for n, p in model.named_parameters()}
        optimizer = make_optimizer(task.param_groups(heads, model), cfg.optim, names)
        scheduler = make_scheduler(optimizer, steps, cfg.optim)
        module, optimizer, loader, scheduler = acc.prepare(inner, optimizer, loader, scheduler)
        inner = acc.unwrap_model(module)
        self.sharding = None
        if adapted:  # the adapted target is inside the prepared module: accelerate shards it with the heads
            acc.register_save_state_pre_hook(trainable_only_hook)
        else:
            frozen, backend = shard_target(target, heads, acc)
            object.__setattr__(inner, "frozen_target", frozen)
            self.sharding = sharding_record(frozen, backend, acc)
        self.ev_loader = eval_loader(eval_rows, cfg, acc, pad_id) if eval_rows is not None else None

        if acc.is_main_process:  # every refusal above wrote nothing; from here on the folder is ours
            claim_run_folder(cfg.output_dir, run_fingerprint(cfg), cfg.overwrite, hold)
        acc.wait_for_everyone()
        self.task, self.module, self.inner = task, module, inner
        self.optimizer, self.scheduler, self.batches = optimizer, scheduler, loader
        self.log = RunLog(acc, self.out / "log.jsonl", main_console(acc))
        self.train_rows, self.steps, self.stop = len(train_rows), steps, steps
        resume = self.resume(adapted)
        self.start_log(resume, len(eval_rows) if eval_rows is not None else 0)

    def build_heads(self, task: Task) -> nn.Module:
        """Fresh heads for the target, or copies of ``init_from``'s; a target layer the kind refuses to
        start from (``init_layer`` on a non-Llama layer) is one line, like every other refusal."""
        try:
            heads = task.build(self.target)
        except ValueError as e:
            raise TrainError(str(e)) from None
        if self.cfg.init_from:  # a resumed run reads its checkpoint in resume() instead
            warm_start(heads, self.cfg.init_from, self.target, self.tokenizer)
        return heads

    def resume(self, adapted: bool) -> Path | None:
        """Load the checkpoint ``resume_from`` names (if any), record the run in its folder, and skip
        the batches already trained on. Returns the checkpoint resumed from."""
        cfg, acc = self.cfg, self.accelerator
        resume = resolve_resume(cfg.resume_from, self.out)
        if resume is not None:
            state = read_state(resume)
            check_resumable(state, run_fingerprint(cfg), self.global_batch, resume)
            acc.load_state(str(resume), **({"strict": False} if adapted else {}))
            self.step, self.tokens_seen, self.train_time = state["step"], state["tokens"], state["train_time_s"]
            self.started_at = self.step
        if acc.is_main_process:  # the folder now belongs to this run
            write_run(self.out, run_fingerprint(cfg))
        self.stop = min(self.steps, cfg.stop_after) if cfg.stop_after is not None else self.steps
        if self.step:
            self.batches = acc.skip_first_batches(self.batches, self.step * cfg.grad_accum)
        return resume

    def start_log(self, resume: Path | None, eval_rows: int) -> None:
        """Trackers, and the run's first log record and line."""
        cfg, step, sharding = self.cfg, self.step, self.sharding
        self.log.truncate_after(step)
        if self.accelerator.log_with:
            self.accelerator.init_trackers(cfg.project, config=tracker_config(cfg),
                                           init_kwargs={"wandb": wandb_kwargs(run_name(cfg), self.out)})
        self.log.write({"event": "start", "step": step, "world_size": self.world, "total_steps": self.steps,
                        "global_batch": self.global_batch, "resumed_from": str(resume) if resume else None,
                        "kind": cfg.kind, "train_rows": self.train_rows, "eval_rows": eval_rows,
                        "features": cfg.features, "target_sharding": sharding},
                       text=f"training {cfg.kind} heads: {self.steps} steps, global batch {self.global_batch} on "
                            f"{self.world} process(es)" + (f", from stored features {cfg.features}" if cfg.features
                                                          else "")
                            + (f", resuming at step {step}" if step else "")
                            + (f"; target sharded ({sharding['backend']}): {sharding['params_per_rank']} of "
                               f"{sharding['params']} parameters per process" if sharding else ""))

    # -- train ----------------------------------------------------------------------------------
    def train(self) -> None:
        """The training loop: ``grad_accum`` micro-batches per optimiser step, a log line every
        ``log_every`` steps, eval every ``eval_every``, a checkpoint every ``save_every`` and at the stop."""
        cfg, acc, module = self.cfg, self.accelerator, self.module
        params = [p for p in module.parameters() if p.requires_grad]
        it = iter(self.batches)
        sums: dict[str, Tensor] = {}

        def zero() -> Tensor:  # token counts stay on the device: no sync until the log interval
            return torch.zeros((), dtype=torch.long, device=acc.device)

        self.pending_tokens, window_steps, window_start = zero(), 0, time.perf_counter()
        self.began = window_start
        with Progress("train", self.steps, unit="steps", enabled=cfg.progress and acc.is_main_process,
                      every=cfg.log_every, stream=sys.stdout, completed=self.step) as progress:
            while self.step < self.stop:
                t0 = time.perf_counter()
                step_batches, step_losses = [], []
                for _ in range(cfg.grad_accum):
                    batch = next(it)
                    # accumulate: no gradient sync until the last micro-batch (the plugin counts them,
                    # see make_accelerator); backward divides the loss by grad_accum
                    with acc.accumulate(module):
                        loss, metrics = module(batch, self.step)
                        acc.backward(loss)
                    for k, v in {"loss": loss.detach(), **metrics}.items():
                        sums[k] = sums.get(k, 0) + v.detach().float() / cfg.grad_accum
                    self.pending_tokens += batch["attention_mask"].sum()
                    step_batches.append(batch)
                    step_losses.append(loss.detach())
                # the norm is computed anyway (clipping, or clip at inf = no-op): it and the loss are
                # checked with the step's one sync, before a NaN can reach the weights
                grad_norm = acc.clip_grad_norm_(params, cfg.optim.max_grad_norm or math.inf)
                if not step_is_finite(acc, torch.stack(step_losses).float().sum(), grad_norm):
                    self.stop_non_finite(self.step + 1, non_finite_message(self.inner, cfg, self.step + 1,
                                                                           step_batches, step_losses, grad_norm))
                if grad_norm is not None:  # the norm before clipping, averaged over the log window
                    sums["grad_norm"] = sums.get("grad_norm", 0) + torch.as_tensor(grad_norm).detach().float()
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.step += 1
                window_steps += 1
                self.train_time += time.perf_counter() - t0

                if self.step % cfg.log_every == 0 or self.step == self.stop:
                    self.log_window(sums, window_steps, window_start, progress)
                    sums, self.pending_tokens, window_steps = {}, zero(), 0
                    window_start = time.perf_counter()
                    if self.step < self.stop and self.past_time_limit():
                        self.stop, self.timed_out = self.step, True
                if self.ev_loader is not None and cfg.eval_every and self.step % cfg.eval_every == 0 \
                        and self.step < self.steps:
                    self.log_eval()
                    window_start = time.perf_counter()
                if (cfg.save_every and self.step % cfg.save_every == 0) or self.step == self.stop:
                    self.save_step()
                    window_start = time.perf_counter()

    def past_time_limit(self) -> bool:
        """Whether ``time_limit`` has passed, as the main process sees it (every process takes its answer)."""
        from accelerate.utils import broadcast_object_list

        limit = self.cfg.time_limit
        if limit is None:
            return False
        late = [time.perf_counter() - self.began > limit * 60]
        broadcast_object_list(late)
        if late[0]:
            self.log.write({"event": "time_limit", "step": self.step, "minutes": limit},
                           text=f"time limit ({limit:g} min) reached at step {self.step} of {self.steps}: "
                                "saving the final heads now")
        return bool(late[0])

    def log_window(self, sums: dict[str, Tensor], window_steps: int, window_start: float,
                   progress: Progress) -> None:
        """One sync: the window's mean metrics and tokens over processes, to the log, trackers and progress."""
        acc = self.accelerator
        vals = reduce_mean(acc, {k: v / window_steps for k, v in sums.items()})
        n_tok = int(acc.reduce(self.pending_tokens, reduction="sum"))
        self.tokens_seen += n_tok
        tps = n_tok / max(1e-9, time.perf_counter() - window_start)
        lr = self.scheduler.get_last_lr()[0]
        self.last_loss = vals["loss"]
        self.log.write({"step": self.step, **vals, "lr": lr, "tokens_per_s": tps, "tokens": self.tokens_seen},
                       tracker={**{f"train/{k}": v for k, v in vals.items()}, "train/lr": lr,
                                "train/tokens_per_s": tps})
        progress.update(self.step, tokens=n_tok, info=f"loss {vals['loss']:.4f} lr {lr:.2e}")

    def log_eval(self) -> None:
        self.last_eval = evaluate(self.inner, self.ev_loader, self.accelerator, self.cfg.eval_max_batches)
        self.log.write({"step": self.step, "eval": self.last_eval}, tracker=eval_scalars(self.last_eval),
                       text=eval_text(self.last_eval))

    def state(self) -> dict[str, Any]:
        """The resumable counters of a checkpoint. Every process calls this (a collective): the
        tokens not logged yet are counted too, or a resume from a save between two log steps
        would restart the count without them."""
        pending = 0 if self.pending_tokens is None else int(self.accelerator.reduce(self.pending_tokens,
                                                                                     reduction="sum"))
        return {"tokens": self.tokens_seen + pending, "train_time_s": self.train_time, "total_steps": self.steps,
                "world_size": self.world, "global_batch": self.global_batch, "run": run_fingerprint(self.cfg)}

    def save_step(self) -> None:
        """A resumable checkpoint of this step; never one holding a NaN/inf weight."""
        bad = non_finite_weight(self.inner, self.accelerator)
        if bad:
            self.stop_non_finite(self.step, f"training stopped at step {self.step}: the weight {bad} is NaN/inf "
                                            "after the optimiser step; no checkpoint was saved. Lower optim.lr or "
                                            "set optim.max_grad_norm")
        save_checkpoint(self.accelerator, self.out, self.step, self.state(), self.cfg.keep_checkpoints)

    def stop_non_finite(self, at: int, message: str) -> None:
        self.log.write({"event": "non_finite", "step": at, "error": message})
        raise NonFiniteError(message)

    # -- save -----------------------------------------------------------------------------------
    def save(self) -> Path:
        """After the loop: the checkpoint of an early stop, or a last eval and the final heads."""
        acc, step = self.accelerator, self.step
        if step < self.steps and not self.timed_out:  # stopped early on purpose (stop_after): no final heads
            self.log.write({"event": "stopped", "step": step}, text=f"stopped after step {step}; resume with "
                                                                    "resume_from=latest")
            self.cleanup()
            return self.out / "checkpoints" / f"checkpoint-{step}"
        final = self.out / "final"
        if self.kept_final(final):
            self.log.write({"event": "complete", "step": step, "final": str(final)},
                           text=f"{self.out} is already complete ({step} steps); the heads at {final} are kept as "
                                "they are (a tuned tree stays); delete that folder to save them again")
            self.cleanup()
            return final
        if self.ev_loader is not None:
            self.log_eval()
        bad = non_finite_weight(self.inner, acc)
        if bad:
            self.stop_non_finite(step, f"training stopped after step {step}: the weight {bad} is NaN/inf; the "
                                       "final heads were not saved. Lower optim.lr or set optim.max_grad_norm")
        heads = self.whole_heads()  # a collective when the heads are sharded
        if acc.is_main_process:
            self.save_final(final, heads)
        acc.wait_for_everyone()
        tps = self.tokens_seen / max(self.train_time, 1e-9)
        self.log.write({"event": "done", "step": step, "final": str(final), "train_time_s": self.train_time,
                        "tokens_per_s": tps},
                       text=f"done: {self.tokens_seen} tokens in {self.train_time:.1f}s ({tps:,.0f} tok/s); "
                            f"heads saved to {final}")
        self.cleanup()
        return final

    def kept_final(self, final: Path) -> bool:
        """A run resumed at its last step, whose final heads were saved: nothing to train or save.
        Saving again would drop what was stored with the heads since (``headway tune``'s tree)."""
        from accelerate.utils import broadcast_object_list

        done = [self.started_at == self.steps and is_heads_checkpoint(final)]
        broadcast_object_list(done)  # the main process's view: every process takes the same branch
        return bool(done[0])

    def whole_heads(self) -> Any:
        """The trained heads with whole weights: themselves, or (heads sharded by FSDP) an unsharded
        copy gathered from every process, on the main process (None elsewhere). Every process calls it."""
        heads = self.inner.heads
        # FSDP2 may hold the weights whole right now (its root keeps them after a forward), but its
        # state dict is always of shards: ask the state dict, not the parameters
        if not any(is_sharded(v) for v in heads.state_dict().values()):
            return heads
        state = full_state(heads)
        if not self.accelerator.is_main_process:
            return None
        plain = type(heads)(heads.config, heads.target_info)
        plain.load_state_dict(state)  # strict: every tensor, whole, on the CPU
        plain.metadata = heads.metadata
        for key in ("_target_embed", "_target_lm_head"):  # the borrowed target modules, as the trained heads have
            object.__setattr__(plain, key, heads.__dict__.get(key))
        return plain

    def save_final(self, final: Path, heads: Any = None) -> None:
        """Main process: the heads with their training record, tokenizer, eval and calibration."""
        cfg = self.cfg
        heads = heads if heads is not None else self.inner.heads
        heads.metadata["training"] = {
            "kind": cfg.kind, "target": cfg.target, "data": str(cfg.data), "features": cfg.features,
            "train_rows": self.train_rows, "steps": self.steps, "global_batch": self.global_batch,
            "world_size": self.world, "tokens": self.tokens_seen, "train_time_s": round(self.train_time, 2),
            "tokens_per_s": round(self.tokens_seen / max(self.train_time, 1e-9), 1),
            "final_loss": self.last_loss, "optim": asdict(cfg.optim), "seed": cfg.seed,
            "options": {name: asdict(section) for name, section in self.contract.options(cfg).items()}}
        heads.record_tokenizer(self.tokenizer)  # the decoder refuses a tokenizer whose ids mean other tokens
        if self.last_eval is not None:
            heads.metadata["eval"] = self.last_eval
            if "calibration" in self.last_eval:  # the decoder ranks tree nodes with these temperatures
                heads.metadata["calibration"] = calibration_metadata(self.last_eval["calibration"])
        self.task.save(heads, self.inner.run_target(), final)
        publish_dirs(final)  # the heads are written to a private temp folder, then renamed

    # -- cleanup --------------------------------------------------------------------------------
    def cleanup(self) -> None:
        """accelerate's ``end_training`` (trackers finish, the process group is destroyed), once nothing
        holds the DDP wrapper any more. Its reducer owns a reference to the process group: freed after
        the group was destroyed, it is the group's last owner and tears gloo down with the GIL held, which
        can deadlock against a gloo thread still releasing the last barrier's work (a rare hang after
        "done", seen in two-process runs). Freed first, the group outlives it and goes down cleanly."""
        self.module = self.inner
        self.optimizer = self.scheduler = self.batches = None
        self.accelerator.free_memory()
        gc.collect()
        self.accelerator.end_training()
