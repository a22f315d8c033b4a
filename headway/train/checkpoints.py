"""Resumable checkpoints: ``output_dir/checkpoints/checkpoint-N``, written as ``checkpoint-N.tmp``
then renamed, so a kill mid-write never leaves a corrupt "latest". ``output_dir/run.json`` records
which run the folder belongs to."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from ..errors import HeadwayError
from ..publish import publish, umask_mode, write_text
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


def run_difference(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """``'key' was X, now Y`` for the first setting of ``now`` that ``saved`` records otherwise, or None."""
    for key, value in now.items():
        if key in saved and saved[key] != value:
            return f"'{key}' was {saved[key]!r}, now {value!r}"
    return None


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
