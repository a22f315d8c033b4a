"""What a run tells: ``output_dir/log.jsonl`` (strict JSON lines), the trackers and the console.

Metrics stay on the device between log steps; the loop reduces them once per ``log_every``
(``accel.reduce_mean``) and hands the floats here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..config import to_dict
from .config import TrainConfig
from .metrics import json_safe


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


def run_name(cfg: TrainConfig) -> str:
    return cfg.run_name or Path(cfg.output_dir).resolve().name


def wandb_kwargs(name: str, out: Path) -> dict[str, Any]:
    """wandb writes under the run folder, unless the user chose a place with ``WANDB_DIR``."""
    kwargs: dict[str, Any] = {"name": name}
    if not os.environ.get("WANDB_DIR"):
        kwargs["dir"] = str(out)
    return kwargs

