"""Traffic as a prompt source: OpenAI chat-completion request logs -> deduplicated conversations.

A log is JSON lines (``*.jsonl`` files of a folder, read in name order, or one file). A row is a
request body with ``messages`` (what vLLM and most gateways log), or a wrapper holding one:
``{"request": {...}}``, ``{"body": {...}}`` (also a body logged as a JSON string),
``{"request": {"body": {...}}}`` and the like (``WRAPPERS``, a few levels deep).

Only the conversation leaves this module: each message's role and text. User ids, request ids,
model names, sampling settings, message ``name`` fields, tool calls, every other field: read to
find the messages and the timestamp, then dropped. A conversation is cut after its last user turn
(the target writes the assistant turn that follows), roles are system / user / assistant
(``developer`` reads as system); rows with tool messages, non-text content parts or no user turn
are counted and skipped. Two requests are the same prompt when their normalised conversations are
equal (Unicode NFC, whitespace runs collapsed, ends stripped); the newest wording is kept.

The window: with ``days``, rows whose timestamp is older than ``now - days`` are left out (rows
without a timestamp are kept: their age is unknown); then the newest ``newest`` requests, in
timestamp order where every row has one, else in log order. Pure functions over rows, plus one
reader of files; nothing here writes.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from .errors import AdaptError

WRAPPERS = ("request", "body", "payload", "params", "input", "data", "json", "req")  # where a body may sit
TIME_KEYS = ("timestamp", "created", "created_at", "time", "ts", "request_time", "start_time", "received_at")
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_DEPTH = 3  # wrappers inside wrappers, at most
EPOCH = dt.datetime(1970, 1, 1)
Message = tuple[str, str]  # (role, text)


@dataclass(frozen=True)
class Request:
    """One logged request: its conversation up to the last user turn, and when it came (if known)."""

    messages: tuple[Message, ...]
    time: float | None
    order: int  # position in the logs as read (files by name, lines in order)

    @property
    def key(self) -> str:
        return conversation_key(self.messages)

    def row(self) -> dict[str, Any]:
        """What a round's prompts file holds for it: an id from the conversation itself, and the messages."""
        return {"id": f"traffic:{self.key}", "messages": [{"role": r, "content": c} for r, c in self.messages]}


@dataclass
class TrafficStats:
    files: int = 0
    rows: int = 0  # non-blank lines read
    requests: int = 0  # rows holding a usable conversation
    skipped: Counter = field(default_factory=Counter)  # reason -> rows
    undated: int = 0  # usable rows without a timestamp
    in_window: int = 0
    unique: int = 0

    def summary(self) -> dict[str, Any]:
        return {"files": self.files, "rows": self.rows, "requests": self.requests, "skipped": dict(self.skipped),
                "undated": self.undated, "in_window": self.in_window, "unique": self.unique}


# -- one row ------------------------------------------------------------------------------------------
def find_body(row: Any, depth: int = 0) -> dict[str, Any] | None:
    """The request body holding ``messages``: the row itself or one inside its wrappers."""
    if isinstance(row, str) and row.lstrip().startswith("{") and depth:
        try:
            row = json.loads(row)
        except json.JSONDecodeError:
            return None
    if not isinstance(row, dict):
        return None
    if isinstance(row.get("messages"), list):
        return row
    if depth >= MAX_DEPTH:
        return None
    for key in WRAPPERS:
        if key in row:
            body = find_body(row[key], depth + 1)
            if body is not None:
                return body
    return None


def parse_time(value: Any) -> float | None:
    """A timestamp as seconds since the epoch: a number (seconds, or milliseconds past 1e12) or an
    ISO 8601 string (``Z`` or an offset; naive means UTC); None when it is neither."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) / 1000.0 if value > 1e12 else float(value)
    if isinstance(value, str) and value.strip():
        text = value.strip().replace("Z", "+00:00").replace("z", "+00:00")
        try:
            stamp = dt.datetime.fromisoformat(text)
        except ValueError:
            return None
        return stamp.timestamp() if stamp.tzinfo is not None else (stamp - EPOCH).total_seconds()  # naive: UTC
    return None


def row_time(row: Any, depth: int = 0) -> float | None:
    """The row's timestamp: the first of ``TIME_KEYS`` that parses, at the top or in a wrapper."""
    if not isinstance(row, dict):
        return None
    for key in TIME_KEYS:
        if key in row:
            t = parse_time(row[key])
            if t is not None:
                return t
    if depth < MAX_DEPTH:
        for key in WRAPPERS:
            t = row_time(row.get(key), depth + 1)
            if t is not None:
                return t
    return None


def message_text(content: Any) -> str | None:
    """A message's text: a string, or the text parts of a content list; None for anything else
    (images, audio: the target cannot be asked them as text)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type", "text") != "text" for p in content):
            return None
        return "".join(str(p.get("text", "")) for p in content)
    return None


def conversation(messages: Any) -> tuple[tuple[Message, ...] | None, str]:
    """(the conversation up to its last user turn, "") or (None, why it cannot be used)."""
    out: list[Message] = []
    for m in messages:
        if not isinstance(m, dict):
            return None, "malformed message"
        role = ROLES.get(str(m.get("role", "")).strip().lower())
        if role is None:
            return None, f"role {str(m.get('role'))[:20]!r}"
        text = message_text(m.get("content"))
        if text is None:
            return None, "non-text content"
        out.append((role, text))
    last_user = max((i for i, (r, _) in enumerate(out) if r == "user"), default=-1)
    if last_user < 0:
        return None, "no user turn"
    out = out[: last_user + 1]
    if any(not t.strip() for r, t in out if r != "assistant"):
        return None, "empty message"
    return tuple(out), ""


def normalise(text: str) -> str:
    return " ".join(unicodedata.normalize("NFC", text).split())


def conversation_key(messages: tuple[Message, ...]) -> str:
    """The deduplication key: a digest of the normalised conversation (roles and texts)."""
    canon = json.dumps([[r, normalise(t)] for r, t in messages], ensure_ascii=False)
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()[:24]


def parse_row(row: Any, order: int) -> tuple[Request | None, str]:
    body = find_body(row)
    if body is None:
        return None, "no messages"
    messages, why = conversation(body["messages"])
    if messages is None:
        return None, why
    return Request(messages, row_time(row), order), ""


# -- the logs -----------------------------------------------------------------------------------------
def log_files(path: Path, pattern: str) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise AdaptError(f"traffic logs not found: {path}")
    return sorted(p for p in path.glob(pattern) if p.is_file())


def _lines(files: list[Path]) -> Iterator[str]:
    for f in files:
        with f.open("rb") as fh:
            for raw in fh:
                line = raw.decode("utf-8", errors="replace").strip()
                if line:
                    yield line


def read_requests(path: str | Path, pattern: str = "*.jsonl") -> tuple[list[Request], TrafficStats]:
    """Every usable request of the logs at ``path``, in log order, and what was skipped and why."""
    files = log_files(Path(path).expanduser(), pattern)
    stats = TrafficStats(files=len(files))
    requests: list[Request] = []
    for line in _lines(files):
        stats.rows += 1
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            stats.skipped["invalid JSON"] += 1
            continue
        req, why = parse_row(row, stats.rows)
        if req is None:
            stats.skipped[why] += 1
            continue
        requests.append(req)
        stats.undated += req.time is None
    stats.requests = len(requests)
    return requests, stats


def window(requests: list[Request], newest: int | None, days: float | None, now: float) -> list[Request]:
    """The requests in the rolling window, oldest first (module docstring)."""
    if days is not None:
        start = now - days * 86400.0
        requests = [r for r in requests if r.time is None or r.time >= start]
    if requests and all(r.time is not None for r in requests):
        requests = sorted(requests, key=lambda r: (r.time, r.order))
    return requests[-newest:] if newest is not None else list(requests)


def unique(requests: list[Request]) -> list[Request]:
    """One request per normalised conversation, the newest wording of each, newest first."""
    seen: set[str] = set()
    out = []
    for r in reversed(requests):
        if r.key not in seen:
            seen.add(r.key)
            out.append(r)
    return out


def traffic_prompts(path: str | Path, newest: int | None, days: float | None, now: float, limit: int | None = None,
                    pattern: str = "*.jsonl") -> tuple[list[Request], TrafficStats]:
    """The window's unique conversations (newest first, at most ``limit``) and the counts."""
    requests, stats = read_requests(path, pattern)
    inside = window(requests, newest, days, now)
    kept = unique(inside)
    stats.in_window, stats.unique = len(inside), len(kept)
    return kept[:limit] if limit is not None else kept, stats

