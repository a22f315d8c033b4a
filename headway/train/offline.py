"""Offline training (``features=DIR``): the checks on the stored features a run reads.

A run on stored hidden states never runs the target's decoder, so everything the decoder would
have guaranteed is checked against the folders instead, before the target loads where it can
be: finished folders of this dataset, of this target, holding every layer the kind reads, and a
target whose logits the lm_head alone reproduces. Each refusal names the command that makes
the right features.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from torch import nn

from .batch import logit_transform, stored_keys
from .config import TrainConfig
from .contracts import CONTRACTS
from .errors import TrainError


class FeatureFolders:
    """The ``features`` (and ``eval_features``) folders of one run, and every check on them."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.contract = CONTRACTS[cfg.kind]
        self.folders = [(key, path) for key, path in (("features", cfg.features), ("eval_features", cfg.eval_features))
                        if path]

    def check(self) -> None:
        """Before the target loads: a kind that can train on features, finished folders, and ``data``
        (if given) being the features' dataset (a draft vocabulary is counted on it)."""
        cfg = self.cfg
        if not self.folders:
            return
        if not self.contract.offline:
            raise TrainError(f"kind {cfg.kind} adapts the target while training, so its hidden states cannot come "
                             "from stored features; drop features= (or train kind=medusa on them)")
        if cfg.eval_features and not cfg.features:
            raise TrainError("eval_features is for offline training: set features=DIR too (or use eval_data)")
        for key, path in self.folders:
            features_manifest(key, path, self.contract.preset)
        settings = features_manifest("features", cfg.features)["settings"]
        dataset = settings["dataset"]
        if cfg.data and not same_dataset(cfg.data, settings):
            raise TrainError(f"data={cfg.data} but features {cfg.features} were made from {dataset}; leave data "
                             "empty (the features' dataset is used) or make features of this data")
        # a moved features folder records its old dataset path: data= names the copy the vocabulary is counted on
        if self.contract.counts_answers(cfg) and not cfg.data and not Path(dataset).expanduser().exists():
            raise TrainError(f"kind {cfg.kind} counts tokens of the training answers (a draft vocabulary, DFlash's "
                             f"mask token) on the features' dataset {dataset}, which is not there; set data=PATH to "
                             "a copy of it")

    def dataset(self) -> str:
        """The distilled dataset ``features`` were made from (recorded in their manifest)."""
        return features_manifest("features", self.cfg.features)["settings"]["dataset"]

    def check_target(self, target: nn.Module) -> None:
        """Refuse features of another target: a shape field naming both values, or another model."""
        from ..data.features import features_command
        from ..target import TargetInfo

        cfg = self.cfg
        layers = self.contract.feature_spec(cfg, int(target.config.num_hidden_layers))
        for key, path in self.folders:
            manifest = features_manifest(key, path)
            stored, now = manifest["target"], TargetInfo.of(target, cfg.target)
            remake = features_command({**manifest["settings"], "target": cfg.target}, fresh_output(path, "retarget"),
                                      layers)
            for name in ("hidden_size", "vocab_size", "num_hidden_layers"):
                if stored[name] != getattr(now, name):
                    raise TrainError(f"{key} {path} are of a target with {name}={stored[name]}, but this run's target "
                                     f"({cfg.target}) has {name}={getattr(now, name)}; make features of it with: "
                                     f"{remake}")
            ours = target_names(cfg.target) | target_names(str(getattr(target.config, "_name_or_path", "") or ""))
            if not target_names(stored["name_or_path"]) & ours:
                raise TrainError(f"{key} {path} were made by target '{stored['name_or_path']}', but this run's target "
                                 f"is '{cfg.target}'; set target={stored['name_or_path']} or make features with: "
                                 f"{remake}")
            if manifest["settings"].get("adapter"):
                raise TrainError(f"{key} {path} were made with the adapter {manifest['settings']['adapter']} merged "
                                 f"into the target, which training does not load; make features without it: {remake}")

    def keys(self, layers: Sequence[int], need_logits: bool) -> tuple[list[str], list[str]]:
        """(the stored keys training rows read, those held-out rows read). With soft labels from the
        stored top-k logits, evaluation still reads ``final`` (the exact logits) where its folder has it."""
        topk = need_logits and self.contract.stored_topk(self.cfg)
        keys = stored_keys(layers, need_logits, topk)
        held = self.cfg.eval_features or self.cfg.features
        if not topk or not held or "final" not in features_manifest("eval_features", held)["keys"]:
            return keys, keys
        return keys, stored_keys(layers, need_logits)

    def check_layers(self, target: nn.Module, keys: Sequence[str], need_logits: bool,
                     eval_keys: Sequence[str] | None = None) -> None:
        """Once the heads say which layers they read: every folder stores them (the held-out folder
        ``eval_keys``), and the lm_head alone gives the target's logits."""
        from ..data.features import TOPK_KEYS, features_command

        cfg = self.cfg
        for key, path in self.folders:
            manifest = features_manifest(key, path)
            wanted = eval_keys if key == "eval_features" and eval_keys is not None else keys
            missing = [k for k in wanted if k not in manifest["keys"]]
            if missing:
                layers = [k.removeprefix("hidden_states.") for k in wanted if k not in TOPK_KEYS]
                topk = {"topk_logits": 64} if set(missing) & set(TOPK_KEYS) else {}
                cmd = features_command({**manifest["settings"], "target": cfg.target, **topk},
                                       fresh_output(path, cfg.kind), layers)
                why = " (the lm_head reads it for the soft labels)" if missing == ["final"] and cfg.kind != "medusa" \
                    else ""
                if topk:
                    why = " (the target's top-k logits the soft_labels=stored_topk option reads)"
                raise TrainError(f"{key} {path} lack {', '.join(missing)}{why} that kind {cfg.kind} reads (stored: "
                                 f"{', '.join(manifest['keys'])}); make them with: {cmd}")
        if need_logits and self.folders:
            check_plain_lm_head(target)


def features_manifest(key: str, path: str, layers: str = "final") -> dict[str, Any]:
    """The manifest of a finished features folder, or a one-line error with the command that makes it."""
    from ..data.errors import DataError
    from ..data.features import SUFFIX, features_command, read_features_manifest
    from ..data.shards import complete_shards, shard_ranges

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise TrainError(f"{key} folder not found: {path}")
    if (folder / "state.json").is_file():
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


def check_plain_lm_head(target: nn.Module) -> None:
    """Offline logits are ``lm_head(final)`` then the target's own transform (``logit_transform``);
    refuse a target whose forward changes them in a way that cannot reproduce."""
    try:
        logit_transform(target.config)
    except ValueError as e:
        raise TrainError(str(e)) from None


def fresh_output(path: str, tag: str) -> str:
    return f"{str(path).rstrip('/')}-{tag}"

