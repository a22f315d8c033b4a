"""Shared helpers for the training tests: tiny targets and tiny distilled datasets on disk."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
               "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
REPO = Path(__file__).resolve().parents[1]


def distilled_rows(n: int, vocab: int, seed: int = 0, min_len: int = 12, max_len: int = 24,
                   prompt_len: int = 4, uniform: bool = False) -> list[dict[str, Any]]:
    """Rows in the distilled format: a short 'prompt' (loss_mask 0) then an 'answer' (loss_mask 1).
    Answers follow a learnable pattern (each token = previous + a row-specific stride) so heads
    can improve within a few steps."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        T = max_len if uniform else int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        start = int(torch.randint(3, vocab, (1,), generator=g))
        stride = int(torch.randint(1, 4, (1,), generator=g))
        ids = [3 + (start - 3 + i * stride) % (vocab - 3) for i in range(T)]
        mask = [0] * prompt_len + [1] * (T - prompt_len)
        if uniform:
            mask = [1] * T
        rows.append({"input_ids": ids, "loss_mask": mask})
    return rows


def save_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    from datasets import Dataset

    Dataset.from_list(rows).save_to_disk(str(path))
    return path


def run_cli(args: list[str], cwd: Path, timeout: int = 300, launcher: list[str] | None = None,
            extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **OFFLINE_ENV, **(extra_env or {})}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = (launcher or [sys.executable, "-m", "headway"]) + args
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    """A port nobody listens on: another DDP run on this machine may hold accelerate's default 29500."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def records(out: Path) -> list[dict]:
    """The run's log.jsonl records."""
    import json

    return [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]


def online_and_offline_losses(task_class: Any, cfg: Any, target_dir: Path, data: Path, features_dir: Path,
                              layers: list[str], steps: int = 3,
                              check_offline: Any = None) -> tuple[list[float], list[float]]:
    """A task's losses over ``steps`` optimiser steps of 4 rows, from the same initial heads, with the
    target running (online) and on the features ``headway features`` stores at ``layers`` (offline).
    Each loss runs after ``torch.manual_seed(100 + step)`` (the loop's RNG: EAGLE-1's input noise);
    ``check_offline(tb)`` sees every offline batch."""
    from datasets import load_from_disk

    from headway.data.features import FeatureStore, FeaturesConfig, features
    from headway.target import load_target
    from headway.train.batch import collate, target_batch
    from headway.train.eagle import feature_batch

    target, _ = load_target(str(target_dir), device="cpu")
    store = FeatureStore(features(FeaturesConfig(dataset=str(data), output=str(features_dir), layers=layers,
                                                 store_dtype="float32", target=str(target_dir), batch_size=4,
                                                 shard_size=16)))
    rows = load_from_disk(str(data)).to_list()

    def run(source: str) -> list[float]:
        torch.manual_seed(0)
        task = task_class(cfg)
        heads = task.build(target)
        opt = torch.optim.AdamW(heads.parameters(), lr=3e-3)
        out = []
        for step in range(steps):
            idx = list(range(4 * step, 4 * step + 4))
            if source == "online":
                tb = target_batch(target, collate([rows[i] for i in idx]), task.feature_layers(heads), True)
            else:
                tb = feature_batch([store[i] for i in idx], task.feature_layers(heads),
                                   task.stored_logits(heads, target.get_output_embeddings()))
                if check_offline is not None:
                    check_offline(tb)
            torch.manual_seed(100 + step)
            loss, _ = task.loss(heads, tb, step)
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    return run("online"), run("offline")
