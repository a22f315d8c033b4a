"""Errors of the data stage. Each is a ``HeadwayError``: the CLI prints its one-line message."""

from __future__ import annotations

from ..errors import HeadwayError


class DataError(HeadwayError, ValueError):
    """Prompts, datasets or output folders that cannot be used as given; the message says why."""


class BadRowError(DataError):
    """One input row is malformed; the message starts with ``file:line:`` (or ``source[row]:``)."""


class ChatTemplateError(DataError):
    """Chat messages meet a tokenizer without a usable chat template."""


class ResumeMismatchError(DataError):
    """An output folder holds shards made with different settings; the message names the setting."""


def one_line(text: object, limit: int = 300) -> str:
    """Collapse an exception message (often multi-line) to one short line."""
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."
