"""Resumable checkpoints: ``output_dir/checkpoints/checkpoint-N``, written as ``checkpoint-N.tmp``
then renamed, so a kill mid-write never leaves a corrupt "latest". ``output_dir/run.json`` records
which run the folder belongs to."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any

from ..config import to_dict
from ..errors import HeadwayError
from ..publish import publish, umask_mode, write_text
from .config import TrainConfig
from .contracts import CONTRACTS
from .errors import TrainError
from .metrics import json_safe

STATE = "trainer_state.json"  # written last, inside the .tmp folder, before the rename
RUN_FILE = "run.json"  # the fingerprint of the run output_dir belongs to
RUN_OUTPUTS = ("checkpoints", "final", "log.jsonl", RUN_FILE, "logs", "wandb")  # what training writes there
_NAME = re.compile(r"^checkpoint-(\d+)$")


class CheckpointError(HeadwayError):
    """A checkpoint to resume from is missing or incomplete."""


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint, oldest first."""
    root = checkpoint_dir(output_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and (p / STATE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def resolve_resume(resume_from: str | None, output_dir: str | Path) -> Path | None:
    """``None`` -> fresh start; ``latest`` -> the highest complete checkpoint (or a fresh start
    when there is none); anything else is a checkpoint folder that must be complete."""
    if resume_from is None:
        return None
    if resume_from == "latest":
        done = complete_checkpoints(output_dir)
        return done[-1][1] if done else None
    p = Path(resume_from).expanduser()
    if not (p / STATE).is_file():
        raise CheckpointError(f"cannot resume from {p}: not a complete checkpoint (no {STATE}); "
                              f"use resume_from=latest to pick the newest complete one in {checkpoint_dir(output_dir)}")
    return p


def read_state(folder: Path) -> dict[str, Any]:
    return json.loads((folder / STATE).read_text())


# Own naming and rotation, not ProjectConfiguration(automatic_checkpoint_naming, total_limit): that names
# folders by save count (checkpoint_<i>), not step, writes in place, and deletes the oldest before the new one is
# complete; here a checkpoint is named by its step, published by rename, and pruning only follows a finished one.
def save_checkpoint(accelerator: Any, output_dir: str | Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """``accelerator.save_state`` into ``checkpoint-{step}.tmp``, then the state file, then a rename.
    Every process must call this (each saves its RNG state)."""
    root = checkpoint_dir(output_dir)
    final, tmp = root / f"checkpoint-{step}", root / f"checkpoint-{step}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE).write_text(json.dumps(json_safe({**state, "step": step}), indent=2, allow_nan=False) + "\n")
        publish(tmp, final)  # a fixed temp name (not publishing()'s per-pid one): every process saved into it
        prune(output_dir, keep)
    accelerator.wait_for_everyone()
    return final


def prune(output_dir: str | Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints (0 keeps all); drop stale ``.tmp`` folders."""
    root = checkpoint_dir(output_dir)
    for p in root.glob("checkpoint-*.tmp"):
        shutil.rmtree(p, ignore_errors=True)
    done = complete_checkpoints(output_dir)
    if keep > 0:
        for _, p in done[:-keep]:
            shutil.rmtree(p, ignore_errors=True)


# -- which run a folder holds ----------------------------------------------------------------
def folder_run(output_dir: str | Path) -> dict[str, Any] | None:
    """The fingerprint of the run ``output_dir`` holds: its ``run.json``, else (folders written
    before run.json existed) the newest checkpoint's; None for a folder no run has started in."""
    path = Path(output_dir) / RUN_FILE
    if path.is_file():
        return json.loads(path.read_text())["run"]
    done = complete_checkpoints(output_dir)
    return read_state(done[-1][1]).get("run") if done else None


COMMON_RUN_KEYS = ("kind", "target", "data", "features", "seed", "max_steps", "epochs", "max_length", "optim",
                   "group_by_length")


def run_fingerprint(cfg: TrainConfig) -> dict[str, Any]:
    """The settings a resumed run must share with the checkpoint: what every kind trains on, and
    the option sections of this kind (its contract's); logging and saving may change."""
    d = to_dict(cfg)
    return {k: d[k] for k in (*COMMON_RUN_KEYS, *CONTRACTS[cfg.kind].sections)}


def run_difference(saved: dict[str, Any], now: dict[str, Any], defaults: dict[str, Any] | None = None,
                   prefix: str = "") -> str | None:
    """``'key' was X, now Y`` for the first setting of ``now`` that ``saved`` records otherwise, or None.

    Option sections are compared key by key. A section ``saved`` lacks is not compared (a run.json
    written before the section was fingerprinted); a key a saved section lacks (an option added
    since) must have its default, which is what that run trained with."""
    defaults = section_defaults() if defaults is None else defaults
    for key, value in now.items():
        if isinstance(value, dict) and isinstance(saved.get(key), dict):
            diff = run_difference(saved[key], value, defaults.get(key) or {}, f"{prefix}{key}.")
            if diff:
                return diff
            continue
        was = saved[key] if key in saved else (defaults.get(key, value) if prefix else value)
        if was != value:
            return f"'{prefix}{key}' was {was!r}, now {value!r}"
    return None


def section_defaults() -> dict[str, Any]:
    """Every option section of ``TrainConfig`` with its defaults (``{"optim": {...}, "eagle": {...}}``)."""
    return {f.name: to_dict(f.default_factory()) for f in dataclasses.fields(TrainConfig)
            if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)}


def check_resumable(state: dict[str, Any], fingerprint: dict[str, Any], global_batch: int, where: Path) -> None:
    if state.get("global_batch", global_batch) != global_batch:
        raise TrainError(f"cannot resume from {where}: it was trained with a global batch of {state['global_batch']} "
                         f"rows, this run has {global_batch} (batch_size x processes x grad_accum)")
    diff = run_difference(state.get("run", {}), fingerprint)
    if diff:
        raise TrainError(f"cannot resume from {where}: {diff}; use the same settings or a new output_dir")


def check_run_folder(output_dir: str | Path, fingerprint: dict[str, Any], overwrite: bool = False) -> None:
    """A run folder belongs to one run: refuse an output_dir holding a run of other settings
    (checkpoints, log and heads of two runs would mix), saying how to start fresh or resume."""
    saved = None if overwrite else folder_run(output_dir)
    diff = run_difference(saved, fingerprint) if saved else None
    if diff:
        raise TrainError(f"output_dir {output_dir} holds another run ({diff}); start fresh with a new output_dir "
                         "or overwrite=true (deletes its checkpoints, log and final heads), or continue that run "
                         "with its own settings and resume_from=latest")


def claim_run_folder(output_dir: str | Path, fingerprint: dict[str, Any], overwrite: bool,
                     hold: contextlib.ExitStack) -> None:
    """Main process, before anything is written: lock output_dir for this process (a second
    writer fails at once), check it holds no other run, and clear it on overwrite."""
    from ..locking import output_lock

    out = Path(output_dir)
    hold.enter_context(output_lock(out, TrainError))
    check_run_folder(out, fingerprint, overwrite)
    if overwrite:
        clear_run(out)


def write_run(output_dir: str | Path, run: dict[str, Any]) -> None:
    """Claim ``output_dir`` for this run (temp file + rename: never a half-written run.json)."""
    write_text(Path(output_dir) / RUN_FILE, json.dumps(json_safe({"run": run}), indent=2, allow_nan=False) + "\n")


def clear_run(output_dir: str | Path) -> None:
    """``overwrite=true``: delete what a previous run wrote in ``output_dir`` (only that: an
    output_dir given by mistake keeps its other files)."""
    for name in RUN_OUTPUTS:
        p = Path(output_dir) / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()


def publish_dirs(root: Path) -> None:
    """Give ``root`` and every folder under it the umask's mode: a folder made by
    ``tempfile.mkdtemp`` (written, then renamed into place) is private (0o700) otherwise."""
    mode = umask_mode(folder=True)
    for d in [root, *(p for p in root.rglob("*") if p.is_dir() and not p.is_symlink())]:
        d.chmod(mode)
