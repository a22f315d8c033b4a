"""A round's prompts: gathered once from their source, split into training and held-out, written.

Three sources (``AdaptConfig.prompts``): any prompt source ``headway distill`` reads (the first
``num_prompts``), ``self`` (the target writes them: ``headway prompts`` into the round's
``self-prompts/``, resumable by batch), or ``traffic:PATH`` (``traffic``: the window's unique
conversations). Whatever the source, a round holds its prompts as rows ``headway distill`` reads,
``{"id", "prompt"}`` or ``{"id", "messages"}`` (a conversation cut after its last user turn; no
answer: the target writes it), in ``prompts.jsonl``; a seeded draw of them, never trained on, in
``heldout.jsonl`` and the rest in ``train.jsonl``. Each file is published whole, so a round that
has its split never gathers again.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..publish import write_text
from .configs import AdaptConfig
from .errors import AdaptError

PROMPTS, TRAIN, HELDOUT = "prompts.jsonl", "train.jsonl", "heldout.jsonl"
SELF_FOLDER = "self-prompts"
DEFAULT_SELF_PROMPTS = 512


def up_to_last_user(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The conversation up to (and with) its last user turn: what the target is asked."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=len(messages) - 1)
    return [{"role": m["role"], "content": m["content"]} for m in messages[: last + 1]]


def sample_row(sample: Any) -> dict[str, Any]:
    """A ``data.samples.Sample`` as a prompts row: its id and prompt (an existing answer dropped)."""
    if sample.messages is not None:
        return {"id": sample.id, "messages": up_to_last_user(sample.messages)}
    return {"id": sample.id, "prompt": sample.prompt}


def source_rows(cfg: AdaptConfig, tokenizer: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from ..data.sources import read_samples

    src = read_samples(cfg.prompts, limit=cfg.num_prompts, tokenizer=tokenizer, seed=cfg.seed)
    return [sample_row(s) for s in src.samples], {"source": src.name}


def traffic_rows(cfg: AdaptConfig, now: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from .traffic import traffic_prompts

    t = cfg.traffic
    requests, stats = traffic_prompts(cfg.traffic_path(), t.window_requests, t.window_days, now, cfg.num_prompts,
                                      t.pattern)
    return [r.row() for r in requests], {"source": f"traffic:{cfg.traffic_path()}", "traffic": stats.summary()}


def self_rows(cfg: AdaptConfig, folder: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The target writes ``num_prompts`` prompts into ``folder`` (``headway prompts``, resumable)."""
    from ..data.configs import PromptsConfig
    from ..data.self_prompts import read_written, write_prompts

    num = cfg.num_prompts or DEFAULT_SELF_PROMPTS
    o = cfg.self_prompts
    pc = PromptsConfig(target=cfg.target, revision=cfg.revision, dtype=cfg.distill.dtype, device=cfg.device,
                       adapter=cfg.adapter, num=num, output=str(folder), system=o.system,
                       chat_template=cfg.chat_template, temperature=o.temperature, max_new_tokens=o.max_new_tokens,
                       min_chars=o.min_chars, max_chars=o.max_chars, exclude=list(o.exclude),
                       batch_size=o.batch_size, seed=cfg.seed)
    rows, _ = read_written(write_prompts(pc))
    return rows[:num], {"source": "self", "self_prompts": {"written": len(rows), **asdict(o)}}


def split(rows: list[dict[str, Any]], fraction: float, maximum: int, seed: int
          ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, held-out): a seeded draw of ``fraction`` of the rows (at least 1, at most ``maximum``)
    held out, the rest for training, each in the rows' order."""
    if len(rows) < 2:
        raise AdaptError(f"a round needs at least 2 prompts (one to train on, one to measure on); got {len(rows)}")
    n = min(maximum, max(1, round(len(rows) * fraction)), len(rows) - 1)
    held = set(random.Random(f"headway-adapt:{seed}").sample(range(len(rows)), n))
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def rows_digest(rows: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(rows, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    return write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def write_split(folder: Path, rows: list[dict[str, Any]], cfg: AdaptConfig) -> dict[str, int]:
    """Write the prompts and their split (held-out last: its presence says the split is complete)."""
    train, heldout = split(rows, cfg.gate.heldout_fraction, cfg.gate.heldout_max, cfg.seed)
    write_rows(folder / PROMPTS, rows)
    write_rows(folder / TRAIN, train)
    write_rows(folder / HELDOUT, heldout)
    return {"total": len(rows), "train": len(train), "heldout": len(heldout)}


def has_split(folder: Path) -> bool:
    return all((folder / name).is_file() for name in (PROMPTS, TRAIN, HELDOUT))
