"""A round's state file (``adapt.json``) and the rounds of a work folder.

The state ties a round's steps together: the settings it was started with (a resumed round must
have the same ones), and each finished step's result (prompt counts, tau before, the answers'
counts and seconds, the training's record, tau after, where it was published). A step's own
output (distill's shards, training's checkpoints) resumes by itself; the state says which steps
are over, so a killed round redoes only the one it was in. Written atomically after every step.

Work folder layout (``AdaptConfig.work``)::

    rounds/round-NNNN/   one round each: adapt.json, base/ (the served heads it started from),
                         prompts.jsonl, train.jsonl, heldout.jsonl, self-prompts/, distill/,
                         features/, train/ (train/final: the new heads)
    generations/         the published heads, gen-NNNN/ each, and index.json
    watch.json           --watch: the conversations earlier rounds used (digests only)
    .lock                held by the process working here
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from ..config import to_dict
from ..publish import write_text
from .configs import AdaptConfig
from .errors import AdaptError

STATE = "adapt.json"
ROUNDS = "rounds"
FORMAT = "headway-adapt-round"
# settings that do not decide a round's result: where it is published, how it is driven, the gate's bar
NOT_SETTINGS = ("out", "work", "watch", "once", "rollback", "stop_after", "overwrite", "threshold", "heads", "device",
                "device_map", "progress")
NOT_TRAIN_SETTINGS = ("stop_after", "time_limit", "log_every", "save_every")
NOT_TRAFFIC_SETTINGS = ("min_new_prompts", "poll_seconds", "keep_generations")


def work_folder(cfg: AdaptConfig) -> Path:
    return Path(cfg.work).expanduser() if cfg.work else Path(str(Path(cfg.out).expanduser()) + ".adapt")


def round_settings(cfg: AdaptConfig, base: Path) -> dict[str, Any]:
    """What decides a round's result (a resumed round must match): the target, the prompts, every
    step's settings and the heads it starts from."""
    data = {k: v for k, v in to_dict(cfg).items() if k not in NOT_SETTINGS}
    data["train"] = {k: v for k, v in data["train"].items() if k not in NOT_TRAIN_SETTINGS}
    data["traffic"] = {k: v for k, v in data["traffic"].items() if k not in NOT_TRAFFIC_SETTINGS}
    data["base"] = str(base.expanduser().resolve())
    return json.loads(json.dumps(data, default=str))


class RoundState:
    """``adapt.json`` of one round: its settings and the results of its finished steps."""

    def __init__(self, folder: Path, data: dict[str, Any]) -> None:
        self.folder, self.data = folder, data

    @classmethod
    def read(cls, folder: Path) -> "RoundState":
        return cls(folder, json.loads((folder / STATE).read_text()))

    @classmethod
    def start(cls, folder: Path, settings: dict[str, Any]) -> "RoundState":
        state = cls(folder, {"format": FORMAT, "version": 1, "settings": settings, "steps": {}})
        state.save()
        return state

    def save(self) -> None:
        write_text(self.folder / STATE, json.dumps(self.data, indent=2) + "\n")

    @property
    def name(self) -> str:
        return self.folder.name

    @property
    def steps(self) -> dict[str, Any]:
        return self.data["steps"]

    def done(self, step: str) -> bool:
        return step in self.steps

    def record(self, step: str, result: dict[str, Any]) -> dict[str, Any]:
        self.steps[step] = result
        self.save()
        return result

    @property
    def measured(self) -> bool:
        """Every step ran: what is left is the gate's decision (taken again on every run until published)."""
        return self.done("after")

    def check_settings(self, settings: dict[str, Any]) -> list[str]:
        """The settings that differ from this round's, as ``key: then -> now``."""
        old = self.data["settings"]
        return [f"{k}: {json.dumps(old.get(k))} -> {json.dumps(settings.get(k))}"
                for k in sorted(set(old) | set(settings)) if old.get(k) != settings.get(k)]


def round_folders(work: Path) -> list[Path]:
    folder = work / ROUNDS
    return sorted(p for p in folder.glob("round-*") if (p / STATE).is_file()) if folder.is_dir() else []


def latest_round(work: Path) -> RoundState | None:
    folders = round_folders(work)
    return RoundState.read(folders[-1]) if folders else None


def next_round_folder(work: Path) -> Path:
    folders = round_folders(work)
    n = int(folders[-1].name.split("-")[1]) + 1 if folders else 1
    return work / ROUNDS / f"round-{n:04d}"


def resumable(last: RoundState, settings: dict[str, Any], overwrite: bool) -> RoundState | None:
    """The unfinished round ``last`` if these settings may resume it; None once it is dropped (other
    settings, and ``overwrite`` or no step finished); an error naming the differences otherwise."""
    diff = last.check_settings(settings)
    if not diff:
        return last
    if overwrite or not last.steps:  # a round that finished no step has nothing to lose (a typo fixed)
        shutil.rmtree(last.folder)
        return None
    raise AdaptError(f"{last.folder} is an unfinished round made with other settings ({'; '.join(diff[:3])}); rerun "
                     "with its settings to finish it, or pass --overwrite to drop it and start a new round")
