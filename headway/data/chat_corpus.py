"""The built-in chat prompt corpus (``chat:train`` / ``chat:extra`` / ``chat:heldout`` / ``chat:dev`` /
``chat:test``), read from the frozen files the package ships: ``corpora/chat.jsonl.gz`` and
``corpora/chat-test.jsonl.gz`` with their manifest ``corpora/chat.json`` (sha256, counts, the dev
tail). The same prompts in the same order on every install and Python version;
``tools/chat_corpus.py`` (outside the package) is what wrote them.

- **train** (3,108 prompts, 37 task families) and **extra** (2,814 more of the same families, none
  repeating a train prompt);
- **heldout** (330 prompts of 6 other families), for benchmarks;
- **dev**: the held-out split's last prompts (the manifest says how many), for evaluation and
  calibration, with the held-out ids; benchmarks take a shorter prefix of heldout. Choices (recipes,
  ``tune``, ablations) are made on dev;
- **test** (300 prompts of the six held-out families, none repeating a held-out prompt), in a file of
  its own that is read only when asked for: the split reported numbers come from, which no recipe
  choice, ``tune`` run or ablation reads (``headway tune`` refuses it).

Families are interleaved round-robin in each split, so any prefix (``limit=N``) is varied. A file
whose checksum is not the manifest's is refused with a ``DataError`` saying to reinstall.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..config import read_json_object
from .errors import DataError
from .samples import Sample

CORPORA = Path(__file__).with_name("corpora")
MANIFEST = CORPORA / "chat.json"
SPLITS = ("train", "extra", "heldout")  # chat.jsonl.gz
TEST = "test"  # a file of its own (the manifest's "test" entry)
VIEWS = (*SPLITS, "dev", TEST)  # dev: a view of heldout's tail


@dataclass(frozen=True)
class ChatPrompt:
    id: str  # chat:<split>:<family>:<index within the family>
    family: str
    text: str


def _damaged(path: Path, why: str) -> DataError:
    return DataError(f"{path}: the built-in chat corpus is damaged ({why}); reinstall headway "
                     "(pip install --force-reinstall headway)")


def _checked_bytes(path: Path, sha256: str) -> bytes:
    """The file's bytes, refused unless their sha256 is the manifest's."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise _damaged(path, e.strerror or type(e).__name__) from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise _damaged(path, f"sha256 {digest[:16]}..., expected {sha256[:16]}...")
    return data


@lru_cache(maxsize=None)
def _corpus(manifest_path: Path = MANIFEST) -> tuple[dict[str, tuple[ChatPrompt, ...]], int]:
    """({split: prompts}, dev size), checked against the manifest once per process."""
    manifest = read_json_object(manifest_path, DataError)
    if not {"file", "sha256", "splits", "dev"} <= manifest.keys():
        raise _damaged(manifest_path, "the manifest lacks file, sha256, splits or dev")
    path = manifest_path.with_name(manifest["file"])
    data = _checked_bytes(path, manifest["sha256"])
    splits: dict[str, list[ChatPrompt]] = {s: [] for s in SPLITS}
    try:
        for line in gzip.decompress(data).decode("utf-8").splitlines():
            row = json.loads(line)
            splits[row["split"]].append(ChatPrompt(row["id"], row["family"], row["prompt"]))
    except (OSError, EOFError, ValueError, KeyError) as e:  # cannot happen past the checksum, but say so if it does
        raise _damaged(path, f"{type(e).__name__}: {e}") from None
    counts = {s: len(p) for s, p in splits.items()}
    if counts != manifest["splits"]:
        raise _damaged(path, f"{counts} prompts, the manifest says {manifest['splits']}")
    return {s: tuple(p) for s, p in splits.items()}, int(manifest["dev"]["last"])


@lru_cache(maxsize=None)
def _test_split(manifest_path: Path = MANIFEST) -> tuple[ChatPrompt, ...]:
    """The test split's prompts, checked against the manifest's ``test`` entry once per process."""
    entry = read_json_object(manifest_path, DataError).get(TEST)
    if not isinstance(entry, dict) or not {"file", "sha256", "count"} <= entry.keys():
        raise _damaged(manifest_path, "the manifest lacks the test split's file, sha256 or count")
    path = manifest_path.with_name(entry["file"])
    data = _checked_bytes(path, entry["sha256"])
    rows = [json.loads(line) for line in gzip.decompress(data).decode("utf-8").splitlines()]
    prompts = tuple(ChatPrompt(r["id"], r["family"], r["prompt"]) for r in rows if r["split"] == TEST)
    if len(prompts) != entry["count"]:
        raise _damaged(path, f"{len(prompts)} prompts, the manifest says {entry['count']}")
    return prompts


def chat_prompts(split: str) -> tuple[ChatPrompt, ...]:
    """Every prompt of ``split`` (train, extra, heldout, dev or test) in the corpus order."""
    if split not in VIEWS:
        raise DataError(f"unknown chat corpus split '{split}' (splits: {', '.join(VIEWS)})")
    if split == TEST:
        return _test_split()
    splits, dev = _corpus()
    return splits["heldout"][-dev:] if split == "dev" else splits[split]


def dev_size() -> int:
    return _corpus()[1]


def family_counts(split: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in chat_prompts(split):
        counts[p.family] = counts.get(p.family, 0) + 1
    return counts


def chat_samples(split: str, limit: int | None = None) -> list[Sample]:
    """``Sample``s with plain ``prompt`` text, the corpus ids (``chat:<split>:<family>:<i>``; dev keeps
    the held-out ids) and ``meta["family"]``; ``limit`` is a prefix."""
    prompts = chat_prompts(split)
    prompts = prompts[:limit] if limit is not None else prompts
    return [Sample(p.id, prompt=p.text, meta={"family": p.family}) for p in prompts]
