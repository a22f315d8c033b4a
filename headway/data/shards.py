"""Shard bookkeeping shared by ``distill`` and ``features``.

Work is cut into global shards of ``shard_size`` rows: shard j holds rows
``[j * shard_size, (j + 1) * shard_size)`` and is written by process ``j % world_size``. A shard
is written under a temporary name and renamed when complete, so after a crash (Ctrl-C,
kill -9) exactly the complete shards exist and a rerun does the rest. The shard plan does not
depend on the number of processes, so a run may resume with a different one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from ..publish import write_text
from .errors import ResumeMismatchError

SHARD_RE = re.compile(r"^shard-(\d{5})(\.[a-z]+)?$")


def shard_name(j: int, suffix: str = "") -> str:
    return f"shard-{j:05d}{suffix}"


def shard_ranges(n_rows: int, shard_size: int) -> list[range]:
    return [range(s, min(s + shard_size, n_rows)) for s in range(0, n_rows, shard_size)]


def owned_shards(n_shards: int, rank: int, world_size: int) -> list[int]:
    return [j for j in range(n_shards) if j % world_size == rank]


def complete_shards(folder: Path, suffix: str = "") -> dict[int, Path]:
    """{shard index: path} of the complete shards in ``folder`` (temporary names excluded)."""
    out = {}
    if folder.is_dir():
        for p in folder.iterdir():
            m = SHARD_RE.match(p.name)
            if m and (m.group(2) or "") == suffix:
                out[int(m.group(1))] = p
    return out


def remove_stale(folder: Path, shards: list[int]) -> None:
    """Delete half-written temporaries of ``shards`` (left by a killed run)."""
    if not folder.is_dir():
        return
    prefixes = tuple(shard_name(j) + "." for j in shards)
    for p in folder.iterdir():
        if p.name.startswith(prefixes) and ".tmp" in p.name:
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard link (no bytes copied, the inputs may be deleted later) or, across file systems, copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def write_json(path: Path, data: Any) -> None:
    write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def digest(text: str | bytes, n: int = 16) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()[:n]


def check_settings(manifest_path: Path, settings: dict[str, Any], extra: dict[str, Any] | None = None,
                   defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """Refuse to resume into a folder whose shards were made with other settings; else write the manifest.

    Returns the manifest now on disk. ``settings`` values must be JSON scalars or lists/dicts of them.
    ``defaults``: settings an older manifest may lack, with the value they had before they were recorded.
    """
    settings = json.loads(json.dumps(settings))  # normalise tuples etc. to what reading gives back
    if manifest_path.is_file():
        manifest = read_json(manifest_path)
        old = {**(defaults or {}), **manifest.get("settings", {})}
        for key in sorted(set(old) | set(settings)):
            if old.get(key) != settings.get(key):
                raise ResumeMismatchError(
                    f"{manifest_path.parent} holds shards made with {key}={_show(old.get(key))}, but this run has "
                    f"{key}={_show(settings.get(key))}; rerun with the same settings, choose a new output folder, "
                    "or pass --overwrite")
        return manifest
    manifest = {**(extra or {}), "settings": settings, "complete": False}
    manifest_path.parent.mkdir(parents=True, exist_ok=True)
    write_json(manifest_path, manifest)
    return manifest


def _show(value: Any) -> str:
    s = json.dumps(value)
    return s if len(s) <= 80 else s[:77] + "..."
