"""The normalised form every prompt source is read into: one ``Sample`` per row.

A sample is either a plain completion prompt (``prompt``, optionally with an existing
``completion``; Alpaca's ``instruction`` + ``input`` become one, ``output`` its completion) or a
conversation (``messages`` with roles system / user / assistant).
``normalize_row`` turns one raw row (JSONL object, parquet row, ``datasets`` row) into a
sample or raises ``BadRowError`` with the row's location; it is a pure function.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import BadRowError

ROLES = ("system", "user", "assistant")
# ShareGPT ``from`` values -> OpenAI roles.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "system": "system"}
ID_KEYS = ("id", "conversation_id", "uuid", "prompt_id")

Message = dict[str, str]


@dataclass(frozen=True)
class Sample:
    """One prompt, normalised. Exactly one of ``messages`` / ``prompt`` is set."""

    id: str
    messages: list[Message] | None = None
    prompt: str | None = None
    completion: str | None = None  # an existing answer to a plain prompt (for ``headway tokenize``)
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    def has_answers(self) -> bool:
        if self.messages is not None:
            return any(m["role"] == "assistant" for m in self.messages)
        return self.completion is not None


def _text(content: Any, where: str, what: str) -> str:
    """Message content as a string; OpenAI content-part lists are joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type", "text") != "text" for p in content):
            raise BadRowError(f"{where}: {what} has non-text content parts; only text is supported")
        return "".join(str(p.get("text", "")) for p in content)
    raise BadRowError(f"{where}: {what} content must be a string, got {type(content).__name__}")


def _messages(items: Any, where: str, role_key: str, text_key: str, roles: dict[str, str]) -> list[Message]:
    if not isinstance(items, list):
        raise BadRowError(f"{where}: expected a list of messages, got {type(items).__name__}")
    out = []
    for i, m in enumerate(items):
        if not isinstance(m, dict) or role_key not in m:
            raise BadRowError(f"{where}: message {i} has no '{role_key}' field")
        role = roles.get(str(m[role_key]).strip().lower())
        if role is None:
            raise BadRowError(f"{where}: unknown role '{m[role_key]}' in message {i} "
                              f"(known: {', '.join(sorted(roles))})")
        out.append({"role": role, "content": _text(m.get(text_key), where, f"message {i}")})
    return out


def check_messages(messages: list[Message], where: str) -> list[Message]:
    """Refuse conversations nobody can answer: empty, no user turn, or empty non-assistant turns."""
    if not messages:
        raise BadRowError(f"{where}: empty conversation")
    if not any(m["role"] == "user" for m in messages):
        raise BadRowError(f"{where}: conversation has no user message")
    for i, m in enumerate(messages):
        if m["role"] != "assistant" and not m["content"].strip():
            raise BadRowError(f"{where}: empty {m['role']} message (message {i})")
    return messages


def row_id(row: dict[str, Any], index: int) -> str:
    for k in ID_KEYS:
        if row.get(k) not in (None, ""):
            return str(row[k])
    return str(index)


def normalize_row(row: Any, index: int, where: str) -> Sample:
    """One raw row -> ``Sample``. ``where`` locates the row in error messages (``file:line``)."""
    if not isinstance(row, dict):
        raise BadRowError(f"{where}: expected a JSON object, got {type(row).__name__}")
    sid = row_id(row, index)
    if "messages" in row and row["messages"] is not None:
        msgs = _messages(row["messages"], where, "role", "content", {r: r for r in ROLES})
        return Sample(sid, messages=check_messages(msgs, where))
    if "conversations" in row and row["conversations"] is not None:
        msgs = _messages(row["conversations"], where, "from", "value", SHAREGPT_ROLES)
        return Sample(sid, messages=check_messages(msgs, where))
    if "prompt" in row:
        prompt, completion = row["prompt"], row.get("completion", row.get("response"))
        if isinstance(prompt, list):  # TRL conversational prompt/completion
            roles = {r: r for r in ROLES}
            msgs = _messages(prompt, where, "role", "content", roles)
            if isinstance(completion, list):
                msgs += _messages(completion, where, "role", "content", roles)
            return Sample(sid, messages=check_messages(msgs, where))
        if not isinstance(prompt, str):
            raise BadRowError(f"{where}: 'prompt' must be a string or a list of messages, "
                              f"got {type(prompt).__name__}")
        if not prompt.strip():
            raise BadRowError(f"{where}: empty prompt")
        if completion is not None and not isinstance(completion, str):
            raise BadRowError(f"{where}: 'completion' must be a string, got {type(completion).__name__}")
        return Sample(sid, prompt=prompt, completion=completion)
    if "instruction" in row:  # Alpaca: the instruction, its input below it; output is the answer
        return _alpaca(row, sid, where)
    keys = ", ".join(sorted(map(str, row))) or "none"
    raise BadRowError(f"{where}: no 'prompt', 'messages', 'conversations' or 'instruction' field (fields: {keys}); "
                      "a source's columns option maps other names")


def _alpaca(row: dict[str, Any], sid: str, where: str) -> Sample:
    """``instruction`` + ``input`` (Alpaca's layout) as one plain prompt, ``output`` as its completion."""
    parts = []
    for key in ("instruction", "input"):
        value = row.get(key)
        if value is not None and not isinstance(value, str):
            raise BadRowError(f"{where}: '{key}' must be a string, got {type(value).__name__}")
        parts.append((value or "").strip())
    if not parts[0]:
        raise BadRowError(f"{where}: empty instruction")
    output = row.get("output")
    if output is not None and not isinstance(output, str):
        raise BadRowError(f"{where}: 'output' must be a string, got {type(output).__name__}")
    return Sample(sid, prompt="\n\n".join(p for p in parts if p), completion=output)
