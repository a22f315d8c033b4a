"""``headway merge``: several distilled datasets, or several features folders, as one.

More data for the drafter should not mean redoing what is done: distil another set of prompts
into a new folder, store its features, then merge. Rows keep their order (the inputs' in turn).

- **Datasets** (``headway distill`` / ``headway tokenize`` folders): the Arrow rows are
  concatenated, the answer-token counts (``token_counts.safetensors``, EAGLE-3's draft vocabulary)
  summed, and the manifest records every input.
- **Features folders**: the shard files are hard-linked (copied across file systems) under new
  names, and their datasets are merged into ``OUTPUT/dataset``, which the manifest names, so
  ``headway train features=OUTPUT`` finds the data it counts the draft vocabulary on.

Inputs must be finished and come from the same target; features must also store the same layers
in the same dtype. A mismatch is refused with both values named; nothing is written then.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..config import opt
from .errors import DataError
from .shards import digest, link_or_copy, read_json, shard_name, write_json

# what must agree between datasets made by the same target (the name it was given may differ)
TARGET_KEYS = ("hidden_size", "vocab_size", "num_hidden_layers", "architecture")
# what must agree between features folders for a drafter to train on their union
FEATURE_KEYS = ("keys", "dtype", "hidden_size", "num_hidden_layers")
FEATURE_SETTINGS = ("dtype", "adapter", "topk_logits")  # the target's compute dtype and adapter; stored top-k


@dataclass
class MergeConfig:
    inputs: list[str] = opt(default_factory=list, help="two or more distilled datasets, or two or more features "
                                                       "folders (not a mix), merged in this order", positional=True)
    output: str = opt("runs/merged", "output folder")
    overwrite: bool = opt(False, "delete the output folder first")


def merge_cli(cfg: MergeConfig) -> int:
    merge(cfg.inputs, cfg.output, cfg.overwrite)
    return 0


def merge(inputs: Sequence[str | Path], output: str | Path, overwrite: bool = False) -> Path:
    """Merge ``inputs`` (all datasets or all features folders) into ``output``; returns it."""
    from ..locking import output_lock
    from .distill import MANIFEST as DATASET_MANIFEST, prepare_output
    from .features import MANIFEST as FEATURES_MANIFEST
    from .progress import console

    paths = [Path(p).expanduser().resolve() for p in inputs]
    if len(paths) < 2:
        raise DataError(f"merge needs two or more inputs, got {len(paths)}")
    out = Path(output).expanduser().resolve()
    for p in paths:
        if not p.is_dir():
            raise DataError(f"merge input not found: {p}")
        if p == out:
            raise DataError(f"{p} is both an input and the output; choose another output folder")
    kinds = {p: "features" if (p / FEATURES_MANIFEST).is_file() else "dataset" for p in paths}
    if len(set(kinds.values())) > 1:
        listed = ", ".join(f"{p} ({k})" for p, k in kinds.items())
        raise DataError(f"merge takes datasets or features folders, not a mix: {listed}")
    features = kinds[paths[0]] == "features"
    plan = check_features(paths) if features else check_datasets(paths)  # manifests only: a refusal writes nothing
    manifest = FEATURES_MANIFEST if features else DATASET_MANIFEST
    with contextlib.ExitStack() as hold:
        hold.enter_context(output_lock(out, DataError, inputs=paths))
        prepare_output(out, overwrite, manifest)
        if (out / manifest).is_file():
            raise DataError(f"{out} already holds a merge or another run; choose a new output folder or pass "
                            "--overwrite")
        summary = write_features(*plan, out) if features else write_dataset(plan, out)
    console().print(summary)
    return out


# ---------------------------------------------------------------- datasets

def dataset_manifest(path: Path) -> dict[str, Any]:
    """A finished dataset's manifest, normalised: target name, revision, target_info (or None), rows."""
    from .distill import MANIFEST as DISTILL_MANIFEST
    from .encode import MANIFEST as TOKENIZE_MANIFEST

    for name in (DISTILL_MANIFEST, TOKENIZE_MANIFEST):
        if (path / name).is_file():
            m = read_json(path / name)
            break
    else:
        raise DataError(f"{path} is not a headway dataset or features folder (no {DISTILL_MANIFEST}, "
                        f"{TOKENIZE_MANIFEST} or features.json)")
    if not m.get("complete"):
        raise DataError(f"{path} is an unfinished run; rerun the same command to complete it, then merge")
    settings = m.get("settings", {})
    return {"path": str(path), "target": settings.get("target", m.get("target")),
            "revision": settings.get("revision", m.get("revision")), "target_info": m.get("target_info"),
            "target_path": m.get("target_path"), "chat_template": settings.get("chat_template"),
            "rows": m.get("rows"), "generated_tokens": m.get("generated_tokens"),
            "settings": settings or {k: m.get(k) for k in ("source", "target", "revision")}}


def info_mismatch(ia: dict[str, Any], ib: dict[str, Any], a: str, b: str) -> str | None:
    """None when two targets' recorded fields (``TargetInfo``) agree, else what differs, both values."""
    for key in TARGET_KEYS:
        if ia.get(key) != ib.get(key):
            return f"{key} {ia.get(key)} in {a} but {ib.get(key)} in {b}"
    return None


def same_target(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """None when two dataset manifests come from the same target, else what differs (both values)."""
    if a["target_info"] and b["target_info"]:
        return info_mismatch(a["target_info"], b["target_info"], a["path"], b["path"])
    if a["target"] != b["target"] or a["revision"] != b["revision"]:
        return f"target {a['target']!r} in {a['path']} but {b['target']!r} in {b['path']}"
    return None


def check_datasets(paths: Sequence[Path]) -> list[dict[str, Any]]:
    metas = [dataset_manifest(p) for p in paths]
    for m in metas[1:]:
        why = same_target(metas[0], m)
        if why:
            raise DataError(f"cannot merge datasets of different targets: {why}")
        if metas[0]["chat_template"] and m["chat_template"] and metas[0]["chat_template"] != m["chat_template"]:
            raise DataError(f"cannot merge datasets made with different chat templates: {metas[0]['path']} "
                            f"(template {metas[0]['chat_template']}) and {m['path']} (template {m['chat_template']})")
    return metas


def write_dataset(metas: list[dict[str, Any]], out: Path) -> str:
    from datasets import concatenate_datasets, load_from_disk

    from .distill import MANIFEST as DISTILL_MANIFEST, save_merged
    from .vocab import load_token_counts, save_token_counts

    parts = [load_from_disk(m["path"]) for m in metas]
    columns = [c for c in parts[0].column_names if all(c in p.column_names for p in parts)]
    for need in ("input_ids", "loss_mask"):
        if need not in columns:
            raise DataError(f"every merged dataset needs a '{need}' column")
    parts = [p.select_columns(columns) for p in parts]
    try:
        merged = concatenate_datasets(parts)
    except ValueError as e:  # column types differ (e.g. int32 against int64 ids)
        raise DataError(f"the datasets' columns do not match: {e}") from None
    merged.info.description = parts[0].info.description
    save_merged(merged, out)
    counts = [load_token_counts(m["path"]) for m in metas]
    if len({c.numel() for c in counts}) > 1:
        raise DataError("the datasets' token counts cover different vocabulary sizes: "
                        + ", ".join(f"{c.numel()} in {m['path']}" for c, m in zip(counts, metas)))
    save_token_counts(out, sum(counts[1:], counts[0]))
    first = metas[0]
    write_json(out / DISTILL_MANIFEST, {
        "format": "headway-distilled", "target_path": first["target_path"], "target_info": first["target_info"],
        "settings": {"target": first["target"], "revision": first["revision"], "chat_template": first["chat_template"],
                     "merged_from": [{"path": m["path"], "rows": len(p), "settings": m["settings"]}
                                     for m, p in zip(metas, parts)]},
        "complete": True, "rows": len(merged),
        "generated_tokens": sum(m["generated_tokens"] or 0 for m in metas)})
    return f"merged {len(metas)} datasets into {out}: {len(merged)} rows (" + " + ".join(
        str(len(p)) for p in parts) + ")"


# ---------------------------------------------------------------- features

def check_features(paths: Sequence[Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the features manifests, their datasets' ``check_datasets`` entries), or a refusal."""
    from .features import read_features_manifest

    manifests = []
    for p in paths:
        m = read_features_manifest(p)
        if not m.get("complete"):
            raise DataError(f"{p} is an unfinished features run; rerun the same command to complete it, then merge")
        data = Path(m["settings"]["dataset"]).expanduser()
        state = data / "state.json"
        if not state.is_file():
            raise DataError(f"{p} was made from the dataset {data}, which is not there; the merge needs it (EAGLE-3 "
                            "counts its draft vocabulary on it)")
        if digest(state.read_text()) != m["settings"].get("dataset_state"):
            raise DataError(f"{p} was made from {data}, which has changed since; make its features again")
        manifests.append({**m, "path": str(p)})
    first = manifests[0]
    for m in manifests[1:]:
        for key in FEATURE_KEYS:
            if m.get(key) != first.get(key):
                raise DataError(f"cannot merge features with different {key}: {first.get(key)} in {first['path']} "
                                f"but {m.get(key)} in {m['path']}")
        for key in FEATURE_SETTINGS:
            if m["settings"].get(key) != first["settings"].get(key):
                raise DataError(f"cannot merge features made with different {key}: {first['settings'].get(key)} "
                                f"in {first['path']} but {m['settings'].get(key)} in {m['path']}")
        why = info_mismatch(first["target"], m["target"], first["path"], m["path"])
        if why:
            raise DataError(f"cannot merge features of different targets: {why}")
    datasets = check_datasets([Path(m["settings"]["dataset"]).expanduser() for m in manifests])
    for m, d in zip(manifests, datasets):  # features of a prefix (--limit) would not line up with the merged rows
        if d["rows"] is not None and d["rows"] != m["num_rows"]:
            raise DataError(f"{m['path']} holds {m['num_rows']} rows of its dataset's {d['rows']} (made with "
                            "--limit); make features of every row to merge it")
    return manifests, datasets


def write_features(manifests: list[dict[str, Any]], datasets: list[dict[str, Any]], out: Path) -> str:
    from .features import MANIFEST

    data_out = out / "dataset"
    write_dataset(datasets, data_out)
    shards: list[dict[str, Any]] = []
    for m in manifests:
        for s in m["shards"]:
            name = shard_name(len(shards), Path(s["file"]).suffix)
            link_or_copy(Path(m["path"]) / s["file"], out / name)
            shards.append({**s, "file": name})
    first = manifests[0]
    settings = {**first["settings"], "dataset": str(data_out),
                "dataset_state": digest((data_out / "state.json").read_text()),
                "rows": sum(m["num_rows"] for m in manifests),
                "merged_from": [{"path": m["path"], "rows": m["num_rows"], "dataset": m["settings"]["dataset"]}
                                for m in manifests]}
    tokens = sum(s["tokens"] for s in shards)
    manifest = {**{k: v for k, v in first.items() if k not in ("path", "tokens_per_s")},  # several runs: no one speed
                "settings": settings, "shards": shards, "num_rows": settings["rows"], "num_tokens": tokens}
    write_json(out / MANIFEST, manifest)
    return (f"merged {len(manifests)} features folders into {out}: {settings['rows']} rows, {tokens} tokens "
            f"({len(shards)} shards, linked); their dataset is {data_out}")


__all__ = ["MergeConfig", "merge", "merge_cli"]
