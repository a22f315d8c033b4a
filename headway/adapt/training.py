"""The training a round runs: ``headway train`` continued from the served heads (``init_from``).

The kind and its option sections come from the heads themselves. Their architecture (draft
vocabulary size, fused layers, head count, norms, mask token: every option whose name is a field of
the heads' ``config.json``) is read from the config, so the rebuilt heads take every tensor of the
served ones; the loss settings from the training record they carry (``metadata["training"]``:
``options``, ``optim``, ``seed``), section defaults where there is none (imported heads).
``train.recipe`` (a ``headway train`` YAML) replaces both where given. ``init_layer`` is dropped:
the weights come from the served heads. The round's own settings (``AdaptConfig.train``: steps,
batch, learning rate, ...) go on top, with the data, the run folder, and resumption from the run's
latest checkpoint.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

from ..config import ConfigError, from_dict, read_config_file
from ..train.config import TrainConfig
from ..train.contracts import CONTRACTS
from .configs import AdaptConfig
from .errors import AdaptError

ROUND_OWNED = ("target", "revision", "adapter", "data", "features", "eval_data", "eval_features", "output_dir",
               "init_from", "resume_from", "overwrite")  # a recipe's values for these are the round's, not its own


def heads_record(base: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the heads' config.json, their metadata) through the heads room's reader."""
    from ..heads.files import read_config

    config = read_config(base)
    return config, dict(config.get("metadata") or {})


def base_settings(config: dict[str, Any], metadata: dict[str, Any], recipe: str | None) -> dict[str, Any]:
    """The kind, option sections, optimiser and seed the round's training starts from (module docstring)."""
    if metadata.get("adapter"):
        raise AdaptError("these heads were trained with a LoRA adapter on the target (Medusa-2); adapt trains heads "
                         "on a frozen target, so the adapted target's output would change: adapt Medusa-1 heads instead")
    if recipe:
        data = {k: v for k, v in read_config_file(Path(recipe).expanduser()).items() if k not in ROUND_OWNED}
        kind = data.get("kind", "medusa")
    else:
        record = metadata.get("training") or {}
        kind = record.get("kind") or config["kind"]
        data = {"kind": kind, **{k: dict(v) for k, v in (record.get("options") or {}).items()}}
        if record.get("optim"):
            data["optim"] = dict(record["optim"])
        if "seed" in record:
            data["seed"] = record["seed"]
    if kind not in CONTRACTS or kind == "medusa2":
        raise AdaptError(f"cannot adapt '{kind}' heads: adapt continues {', '.join(k for k in CONTRACTS if k != 'medusa2')} "
                         "heads on a frozen target")
    if kind != config["kind"]:
        raise AdaptError(f"the training settings say kind '{kind}', but the heads are '{config['kind']}' heads")
    for section in CONTRACTS[kind].sections:
        data[section] = {**data.get(section, {}), **architecture(config, section)}
    return data


def architecture(config: dict[str, Any], section: str) -> dict[str, Any]:
    """The option values the heads' config fixes: fields of both the section and the config, and no
    ``init_layer`` (the weights are the heads')."""
    fields = {f.name for f in dataclasses.fields(typing.get_type_hints(TrainConfig)[section])}
    out = {k: config[k] for k in fields if k in config}
    if "init_layer" in fields:
        out["init_layer"] = None
    return out


def train_config(cfg: AdaptConfig, base: Path, data: Path, features: Path | None, output_dir: Path) -> TrainConfig:
    """The ``TrainConfig`` of a round: the heads' settings, then the round's (module docstring)."""
    config, metadata = heads_record(base)
    settings = base_settings(config, metadata, cfg.train.recipe)
    t = cfg.train
    settings.update({"target": cfg.target, "revision": cfg.revision, "adapter": cfg.adapter, "dtype": cfg.dtype,
                     "device": cfg.device, "data": str(data), "features": str(features) if features else None,
                     "output_dir": str(output_dir), "init_from": str(base), "resume_from": "latest",
                     "max_steps": t.max_steps, "epochs": t.epochs, "batch_size": t.batch_size,
                     "grad_accum": t.grad_accum, "eval_fraction": t.eval_fraction, "max_length": t.max_length,
                     "group_by_length": t.group_by_length, "mixed_precision": t.mixed_precision,
                     "save_every": t.save_every, "keep_checkpoints": 1, "log_every": t.log_every,
                     "stop_after": t.stop_after, "time_limit": t.time_limit, "report_to": "none"})
    optim = settings.setdefault("optim", {})
    optim["warmup_steps"] = t.warmup_steps
    if t.lr is not None:
        optim["lr"] = t.lr
    try:
        return from_dict(TrainConfig, settings)
    except ConfigError as e:
        raise AdaptError(f"the served heads' training settings cannot be continued: {e}") from None


def feature_layers(tc: TrainConfig, num_hidden_layers: int) -> list[str] | None:
    """What ``distill --features`` stores for this kind to train offline; None when it cannot."""
    contract = CONTRACTS[tc.kind]
    return contract.feature_spec(tc, num_hidden_layers) if contract.offline else None
