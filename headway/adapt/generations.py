"""Generations: every set of heads adapt has published, kept for rollback, and the served copy.

``WORK/generations/gen-NNNN/`` holds generation N's heads (generation 0: the heads served before
the first publication), ``WORK/generations/index.json`` one entry per generation kept (its round,
its tau before and after on that round's held-out prompts, when it was made) and which one is
served where. Publishing copies a generation onto the served folder atomically (``publish``: a
temp sibling, then a rename), so a reader sees the old heads or the new ones, never half; a
rollback is the same copy of an older generation. The newest ``keep`` generations stay, and the
served one always.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
from pathlib import Path
from typing import Any

from ..publish import publishing, write_text
from .errors import AdaptError

GENERATIONS = "generations"
INDEX = "index.json"


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def folder_of(work: Path, generation: int) -> Path:
    return work / GENERATIONS / f"gen-{generation:04d}"


def read_index(work: Path) -> dict[str, Any]:
    path = work / GENERATIONS / INDEX
    return json.loads(path.read_text()) if path.is_file() else {"generations": [], "served": None}


def write_index(work: Path, index: dict[str, Any]) -> None:
    write_text(work / GENERATIONS / INDEX, json.dumps(index, indent=2) + "\n")


def copy_heads(src: Path, dst: Path, lineage: dict[str, Any] | None = None) -> Path:
    """Publish a copy of the heads folder ``src`` as ``dst`` (replacing it whole); with ``lineage``,
    the copy records it as ``metadata["adapt"]`` and on its model card."""
    from ..heads.metadata import update_metadata, write_card

    with publishing(dst, folder=True) as tmp:
        shutil.copytree(src, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".lock", "*.tmp*"))
        if lineage is not None:
            update_metadata(tmp, {"adapt": lineage})
            write_card(tmp)
    return dst


def entry(index: dict[str, Any], generation: int) -> dict[str, Any] | None:
    return next((e for e in index["generations"] if e["generation"] == generation), None)


def add(work: Path, heads: Path, key: str, record: dict[str, Any], lineage: dict[str, Any] | None) -> dict[str, Any]:
    """Store ``heads`` as the next generation, once per ``key`` (a round resumed after this step finds
    its entry instead of storing the heads twice), and return the index entry."""
    index = read_index(work)
    mine = next((e for e in index["generations"] if e.get("key") == key), None)
    if mine is not None and folder_of(work, mine["generation"]).is_dir():
        return mine
    number = max((e["generation"] for e in index["generations"]), default=-1) + 1
    if lineage is not None:
        lineage = {**lineage, "generation": number}
    copy_heads(heads, folder_of(work, number), lineage)
    mine = {"generation": number, "folder": folder_of(work, number).name, "key": key, **record, "created": now_iso()}
    index["generations"].append(mine)
    write_index(work, index)
    return mine


def serve(work: Path, generation: int, out: Path) -> dict[str, Any]:
    """Publish generation ``generation`` as the served heads ``out`` (atomically) and say so in the index."""
    index = read_index(work)
    found = entry(index, generation)
    if found is None or not folder_of(work, generation).is_dir():
        kept = ", ".join(str(e["generation"]) for e in index["generations"]) or "none"
        raise AdaptError(f"no generation {generation} in {work / GENERATIONS} (kept: {kept})")
    copy_heads(folder_of(work, generation), out)
    index["served"] = {"generation": generation, "out": str(out), "at": now_iso()}
    write_index(work, index)
    return found


def prune(work: Path, keep: int) -> list[int]:
    """Drop all but the newest ``keep`` generations, never the served one; returns those dropped."""
    index = read_index(work)
    served = (index.get("served") or {}).get("generation")
    numbers = sorted(e["generation"] for e in index["generations"])
    drop = [n for n in numbers[:-keep] if n != served]
    for n in drop:
        shutil.rmtree(folder_of(work, n), ignore_errors=True)
    if drop:
        index["generations"] = [e for e in index["generations"] if e["generation"] not in drop]
        write_index(work, index)
    return drop


def served_generation(work: Path) -> int | None:
    return (read_index(work).get("served") or {}).get("generation")
