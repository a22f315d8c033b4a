"""Prompts the target writes itself: sample its *user* turn from an empty chat.

A chat model trained on instruction data has learnt what users ask. Rendering a conversation up to
the start of a user message (the system turn, ``<|im_start|>user\\n``) and sampling from there
makes it write instructions in the style and spread of its own training data; the user turn ends
at the template's end-of-turn token. This is the idea of Magpie (Xu et al., 2024). For drafter
training it gives prompts as varied as the target's instruction data, with no download and no
hand-written template families; ``headway distill`` then writes the answers.

``headway prompts --target smollm2 --num 3000 --output runs/smollm2-prompts`` writes
``prompts.jsonl`` (``{"id": "self:B:R", "prompt": ...}`` rows: batch B, row R) and
``settings.json``. Batch b is sampled from a generator seeded by (seed, b), so an interrupted run
resumes at the next batch and writes what one uninterrupted run would have.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

from .configs import PromptsConfig  # noqa: F401  (re-exported; light, for --help)
from .errors import ChatTemplateError, DataError, one_line
from .shards import check_settings, write_json

PROMPTS_FILE = "prompts.jsonl"
SETTINGS_FILE = "settings.json"
FORMAT = "headway-self-prompts/1"
_SENTINEL = "\ue000headway-user-turn\ue001"
MAX_EMPTY_BATCHES = 8  # batches in a row with no usable prompt: the target does not write user turns


def normalise(text: str) -> str:
    """What two prompts must share to count as the same: case and spacing aside."""
    return " ".join(text.lower().split())


@dataclass(frozen=True)
class UserTurn:
    """Where a user turn starts and what may end it, read off the chat template."""

    prefix: str  # rendered conversation up to the user's first character
    end_text: str  # what the template writes right after the user's text (e.g. "<|im_end|>\n")


def user_turn(tokenizer: Any, template: str, system: str | None) -> UserTurn:
    """Render [system?, user] with a sentinel as the user's text and cut there."""
    from .chat import render

    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": _SENTINEL}]
    text = render(tokenizer, messages, template)
    at = text.find(_SENTINEL)
    if at < 0:
        raise ChatTemplateError("the chat template does not write the user's message verbatim, so the start of a "
                                "user turn cannot be found; pass another --chat-template")
    return UserTurn(text[:at], text[at + len(_SENTINEL):])


def turn_stop_ids(tokenizer: Any, turn: UserTurn) -> list[int]:
    """The template's end-of-turn token, if the text after a user message starts with a special token."""
    ids = tokenizer(turn.end_text, add_special_tokens=False)["input_ids"] if turn.end_text else []
    special = set(getattr(tokenizer, "all_special_ids", [])) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    return [int(ids[0])] if ids and ids[0] in special else []


@dataclass
class Sieve:
    """Keeps a sampled user turn if it is usable and new; counts why the others were dropped."""

    min_chars: int
    max_chars: int
    markers: tuple[str, ...]  # special-token texts that must not appear inside a prompt
    seen: set[str] = field(default_factory=set)
    excluded: set[str] = field(default_factory=set)
    dropped: Counter = field(default_factory=Counter)

    def keep(self, text: str, stopped: bool) -> str | None:
        text = text.strip()
        key = normalise(text)
        reason = ("unfinished" if not stopped else
                  "too short" if len(text) < self.min_chars else
                  "too long" if len(text) > self.max_chars else
                  "special tokens" if any(m in text for m in self.markers) else
                  "broken characters" if "\ufffd" in text else
                  "excluded" if key in self.excluded else
                  "duplicate" if key in self.seen else None)
        if reason:
            self.dropped[reason] += 1
            return None
        self.seen.add(key)
        return text


def special_markers(tokenizer: Any) -> tuple[str, ...]:
    tokens = set(getattr(tokenizer, "all_special_tokens", []))
    tokens |= {str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    return tuple(sorted(t for t in tokens if t))


def batch_seed(seed: int, batch: int) -> int:
    digest = hashlib.sha256(f"headway-prompts:{seed}:{batch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


_ID = re.compile(r"^self:(\d+):(\d+)$")


def read_written(path: Path) -> tuple[list[dict[str, Any]], int]:
    """(rows, next batch) of a prompts file; a torn last line (an interrupted write) is cut off."""
    if not path.is_file():
        return [], 0
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
        path.write_bytes(data)
    rows, next_batch = [], 0
    for i, line in enumerate(data.decode("utf-8").splitlines(), 1):
        try:
            row = json.loads(line)
            m = _ID.match(row["id"]) if isinstance(row.get("id"), str) else None
        except (json.JSONDecodeError, AttributeError):
            m = None
        if m is None or not isinstance(row.get("prompt"), str):
            raise DataError(f"{path}:{i}: not a row this command wrote; choose a new output folder or pass "
                            "--overwrite")
        rows.append(row)
        next_batch = max(next_batch, int(m.group(1)) + 1)
    return rows, next_batch


def excluded_prompts(sources: Sequence[str], tokenizer: Any) -> set[str]:
    from .sources import read_samples

    keys: set[str] = set()
    for source in sources:
        for s in read_samples(source, tokenizer=tokenizer).samples:
            texts = [s.prompt] if s.prompt is not None else [m["content"] for m in s.messages or []
                                                              if m.get("role") == "user"]
            keys.update(normalise(t) for t in texts if t)
    return keys


def append_rows(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    with path.open("a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_prompts(cfg: PromptsConfig) -> Path:
    """Sample user turns, a batch at a time, until ``cfg.output`` holds at least ``cfg.num`` prompts;
    returns the prompts file."""
    from ..kernels import LinearKernels
    from ..target import TargetInfo, load_target, resolve_target_path
    from .chat import load_chat_template
    from ..locking import output_lock
    from .distill import generation_dtype, prepare_output
    from .generation import sample_batch, stop_token_ids
    from .progress import TokenProgress, console, quiet_datasets
    from .runtime import processes
    from .sources import source_paths

    out = Path(cfg.output).expanduser()
    procs = processes(cfg.device)
    if procs.world_size > 1:  # one file, appended batch by batch: one writer
        raise DataError("headway prompts runs in one process; start it without accelerate launch")
    device = procs.device
    cfg = replace(cfg, dtype=generation_dtype(cfg.dtype, device))
    say = console().print
    inputs = [*(path for source in cfg.exclude for path in source_paths(source)), cfg.target, cfg.chat_template,
              cfg.adapter]  # never emptied by --overwrite
    with quiet_datasets(), output_lock(out, DataError, inputs=inputs):
        prepare_output(out, cfg.overwrite, SETTINGS_FILE)
        target_path = resolve_target_path(cfg.target or "")
        model, tokenizer = load_target(target_path, cfg.dtype, None if cfg.device_map else device, cfg.adapter,
                                       cfg.revision, attn_implementation=cfg.attn_implementation,
                                       device_map=cfg.device_map)
        template = load_chat_template(tokenizer, cfg.chat_template)
        if not template:
            raise ChatTemplateError(f"headway prompts samples the target's user turn, which needs a chat template; "
                                    f"the tokenizer of '{cfg.target}' has none: pass --chat-template FILE.jinja")
        turn = user_turn(tokenizer, template, cfg.system)
        settings = {k: v for k, v in asdict(cfg).items() if k not in ("num", "output", "overwrite", "device",
                                                                      "device_map", "linear_kernel")}
        settings["template"] = hashlib.sha256(template.encode()).hexdigest()[:16]
        info = TargetInfo.of(model, cfg.target, cfg.revision)
        manifest = check_settings(out / SETTINGS_FILE, settings, {"format": FORMAT, "target_info": asdict(info)})
        path = out / PROMPTS_FILE
        rows, batch = read_written(path)
        sieve = Sieve(cfg.min_chars, cfg.max_chars, special_markers(tokenizer))
        sieve.seen.update(normalise(r["prompt"]) for r in rows)
        sieve.excluded = excluded_prompts(cfg.exclude, tokenizer)
        if len(rows) >= cfg.num:
            say(f"{path} already holds {len(rows)} prompts; nothing to do")
            return path
        if rows:
            say(f"resuming: {len(rows)} prompts written, from batch {batch}")
        prefix = list(tokenizer(turn.prefix, add_special_tokens=False)["input_ids"])
        stop_ids = list(dict.fromkeys(stop_token_ids(model, tokenizer, cfg.stop_tokens) +
                                      turn_stop_ids(tokenizer, turn)))
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
        kernels = LinearKernels(cfg.linear_kernel, model)
        written, empty, tokens = len(rows), 0, 0
        dropped = Counter(manifest.get("dropped", {}))  # earlier runs'; the sieve counts this one's
        with TokenProgress("prompts", cfg.num - written, unit="prompts") as bar:
            while written < cfg.num:
                with kernels():
                    answers = sample_batch(model, [prefix] * cfg.batch_size, cfg.sampling(), stop_ids, pad_id,
                                           batch_seed(cfg.seed, batch))
                new = []
                for r, a in enumerate(answers):
                    body = a.tokens[:-1] if a.stopped else a.tokens  # the stop token ends the turn, not the text
                    text = sieve.keep(tokenizer.decode(body, skip_special_tokens=False), a.stopped)
                    if text is not None:  # whole batches: an extended or resumed run writes what one run would
                        new.append({"id": f"self:{batch}:{r}", "prompt": text})
                        tokens += len(body)
                append_rows(path, new)
                counted = min(len(new), cfg.num - written)  # the last batch may pass num: the bar stops at it
                written, batch = written + len(new), batch + 1
                write_json(out / SETTINGS_FILE, {**manifest, "complete": written >= cfg.num, "rows": written,
                                                 "batches": batch, "dropped": dict(dropped + sieve.dropped)})
                bar.advance(counted, sum(len(a.tokens) for a in answers))
                empty = 0 if new else empty + 1
                if empty >= MAX_EMPTY_BATCHES:
                    raise DataError(f"the target wrote no usable user turn in {empty} batches in a row (dropped: "
                                    f"{_counts(sieve.dropped)}); is it a chat model, and does --max-new-tokens "
                                    "leave room for a whole turn?")
    kept_now = written - len(rows)
    say(f"wrote {kept_now} prompts to {path} ({written} in all; {tokens / max(kept_now, 1):.0f} tokens on average; "
        f"dropped: {_counts(sieve.dropped)})")
    return path


def _counts(c: Counter) -> str:
    return ", ".join(f"{n} {k}" for k, n in c.most_common()) or "none"


def prompts_cli(cfg: PromptsConfig) -> int:
    try:
        write_prompts(cfg)
    except OSError as e:
        raise DataError(one_line(e)) from None
    return 0


__all__ = ["PromptsConfig", "Sieve", "UserTurn", "normalise", "read_written", "turn_stop_ids", "user_turn",
           "write_prompts"]
