"""The standard-library corpus of the ``demo:`` prompt sources and of the demo target: the running
interpreter's stdlib ``*.py`` files, split into train / held-out by a hash of their path (stable
across machines), and code prefixes cut from them (``demo_prompts``). Distillation prompts come
from the train files and evaluation prompts from the held-out files; the demo target
(``headway.demo.builder``) trains on the train files.
"""

from __future__ import annotations

import functools
import hashlib
import random
import re
import sys
import sysconfig
from pathlib import Path
from typing import Any

from ..config import check_choice
from ..errors import HeadwayError

SPLITS = ("train", "heldout")
HELDOUT_FRACTION = 0.05

# Tests, vendored packages, generated tables and docs are not the code we want the target to model;
# `encodings/` codec tables are near-trivial tokens that make the model look better than it is.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings",
                            "__pycache__", "lib2to3", "pydoc_data"})


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(rel_path: str) -> str:
    """'heldout' for ~5% of files, chosen by a hash of the relative path (stable across machines)."""
    h = int(hashlib.sha1(rel_path.encode()).hexdigest()[:8], 16)
    return "heldout" if h < HELDOUT_FRACTION * 2**32 else "train"


@functools.lru_cache(maxsize=4)
def _corpus(root: Path) -> tuple[tuple[Path, str], ...]:
    files = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if _EXCLUDED_DIRS.isdisjoint(rel.parts[:-1]) and p.is_file():
            files.append((p, split_of(rel.as_posix())))
    return tuple(files)


def corpus_files(split: str) -> list[Path]:
    """The stdlib ``*.py`` files of one split ('train' or 'heldout'), sorted by path."""
    check_choice(split, SPLITS, "split")
    return [p for p, s in _corpus(stdlib_root()) if s == split]


@functools.lru_cache(maxsize=2048)
def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def corpus_identity() -> dict[str, Any]:
    """What the corpus depends on: the interpreter version and the file list (cheap to compute)."""
    files = [p for p, _ in _corpus(stdlib_root())]
    return {"python": ".".join(map(str, sys.version_info[:3])), "implementation": sys.implementation.name,
            "files": len(files), "bytes": sum(p.stat().st_size for p in files)}


def _prompt_spans(split: str, n: int, prompt_tokens: int, tokenizer: Any, seed: int) -> list[tuple[str, int, int]]:
    """(file text, start, end) of ``n`` code snippets of at most ``prompt_tokens`` tokens.

    Each starts at a random unindented line of a random file (never mid-block), ends at a line
    boundary, and has trailing whitespace removed (the BPE merges newline + indent into one token, so a prompt
    ending in '\\n    ' would end in a token the model rarely sees mid-line).
    """
    if n <= 0 or prompt_tokens <= 0:
        raise HeadwayError(f"demo_prompts needs n > 0 and prompt_tokens > 0 (got n={n}, prompt_tokens={prompt_tokens})")
    rng = random.Random(seed)
    files = corpus_files(split)
    spans: list[tuple[str, int, int]] = []
    seen: set[tuple[int, int]] = set()
    for _ in range(50 * n):
        if len(spans) == n:
            break
        fi = rng.randrange(len(files))
        text = _read(files[fi])
        span = _snippet(text, rng, prompt_tokens, tokenizer)
        if span is not None and (fi, span[0]) not in seen:
            seen.add((fi, span[0]))
            spans.append((text, *span))
    if len(spans) < n:
        raise HeadwayError(f"could only cut {len(spans)} of {n} prompts of {prompt_tokens} tokens from the "
                           f"{split} files")
    return spans


def _snippet(text: str, rng: random.Random, prompt_tokens: int, tokenizer: Any) -> tuple[int, int] | None:
    """(start, end) of a snippet from an unindented line to a line end, or None if none fits."""
    starts = [0] + [m.end() for m in re.finditer(r"\n(?=\S)", text)]
    start = rng.choice(starts)
    stop = start + 8 * prompt_tokens  # tokens average ~4 characters: ample room for the cut
    end = len(text) if stop >= len(text) else text.rfind("\n", start, stop)
    while end > start:
        body = text[start:end].rstrip()
        n_tok = len(tokenizer.encode(body, add_special_tokens=False))
        if n_tok <= prompt_tokens:
            return (start, start + len(body)) if n_tok >= max(1, prompt_tokens // 2) else None
        end = text.rfind("\n", start, start + len(body))  # drop the last line and try again
    return None


def demo_prompts(split: str, n: int, prompt_tokens: int, tokenizer: Any, seed: int = 0) -> list[str]:
    """``n`` code prefixes of at most ``prompt_tokens`` tokens (and at least half that) from the
    train or held-out files, cut at line boundaries with trailing whitespace stripped.

    Deterministic for a seed; distillation uses 'train', evaluation uses 'heldout'.
    """
    return [text[a:b] for text, a, b in _prompt_spans(split, n, prompt_tokens, tokenizer, seed)]


__all__ = ["HELDOUT_FRACTION", "SPLITS", "corpus_files", "corpus_identity", "demo_prompts", "split_of", "stdlib_root"]
