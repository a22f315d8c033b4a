"""Resumable checkpoints: ``output_dir/checkpoints/checkpoint-N``, written as ``checkpoint-N.tmp``
then renamed, so a kill mid-write never leaves a corrupt "latest"."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from ..errors import HeadwayError

STATE = "trainer_state.json"  # written last, inside the .tmp folder, before the rename
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
        (tmp / STATE).write_text(json.dumps({**state, "step": step}, indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
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
