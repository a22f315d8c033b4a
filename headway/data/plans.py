"""What the target is asked, per sample: the prompt text before each answer, within a token budget.

A plan holds ``pieces``: the text before answer 1, between answers 1 and 2, ... A plain
completion prompt is one piece (tokenised with the tokenizer's special tokens, e.g. BOS); a
conversation is split by its chat template (``chat.conversation_pieces``).

``prompt_ids`` is the one place that decides what the target is conditioned on before its first
answer to a sample: ``headway distill`` (the first piece of the plan), ``headway bench``,
``headway tune`` and ``headway generate`` all go through ``make_plan``, so heads are measured and
used on the prompts they were trained on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .chat import conversation_pieces, require_template
from .errors import DataError
from .samples import Sample

PROMPT_FORMATS = ("auto", "chat", "raw")
OVERLONG = ("drop", "truncate")


@dataclass(frozen=True)
class Plan:
    index: int  # position in the prompt stream (global row order)
    sample: Sample
    pieces: list[str]  # template/prompt text before each answer
    piece_ids: list[list[int]]  # the same, tokenised
    raw: bool  # a plain completion prompt (no chat template)
    truncated: bool = False
    answer: int | None = None  # distill's samples_per_prompt > 1: which of the prompt's sampled answers this is

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.piece_ids)


def make_plan(index: int, sample: Sample, tokenizer: Any, template: str | None, prompt_format: str,
              target: str) -> Plan:
    """Pieces for one sample. Chat messages need a template; plain prompts use one unless ``raw``."""
    if prompt_format not in PROMPT_FORMATS:
        raise DataError(f"prompt_format must be one of {', '.join(PROMPT_FORMATS)}, got '{prompt_format}'")
    messages = sample.messages
    if messages is None and (prompt_format == "chat" or (prompt_format == "auto" and template)):
        messages = [{"role": "user", "content": sample.prompt or ""}]
    if messages is None:
        ids = tokenizer(sample.prompt, add_special_tokens=True)["input_ids"]
        return Plan(index, sample, [sample.prompt or ""], [list(ids)], raw=True)
    template = require_template(template, target, f"row '{sample.id}'")
    pieces = conversation_pieces(tokenizer, messages, template)
    piece_ids = [list(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in pieces]
    return Plan(index, sample, pieces, piece_ids, raw=False)


def prompt_ids(sample: Sample, tokenizer: Any, template: str | None, prompt_format: str = "auto",
               target: str = "the target") -> tuple[list[int], str]:
    """(token ids before the first answer, "chat" or "raw"): exactly ``make_plan``'s first piece,
    i.e. what ``headway distill`` conditions the target's first answer on."""
    plan = make_plan(0, sample, tokenizer, template, prompt_format, target)
    return plan.piece_ids[0], "raw" if plan.raw else "chat"


def turn_ids(plan: Plan, turn: int, tokenizer: Any, stop_text: str | None) -> list[int]:
    """The template's tokens between the target's answer ``turn - 1`` and answer ``turn`` (``turn`` >= 1),
    as ``headway distill`` conditions a later answer: the end-of-turn text the previous answer already
    wrote (``stop_text``: its stop token, decoded; None when it ran out of tokens) is not repeated."""
    piece = plan.pieces[turn]
    if stop_text and piece.startswith(stop_text):
        return list(tokenizer(piece[len(stop_text):], add_special_tokens=False)["input_ids"])
    return plan.piece_ids[turn]


def describe_format(formats: list[str], template_from: str | None = None) -> str:
    """How a run's prompts were formatted, for reports: "raw", "chat (template of the target)",
    "chat (template from FILE)", or "mixed: chat (...) for 3, raw for 5" (``formats``: one per prompt)."""
    chat = f"chat (template from {template_from})" if template_from else "chat (template of the target)"
    n_chat, n_raw = formats.count("chat"), formats.count("raw")
    if n_chat and n_raw:
        return f"mixed: {chat} for {n_chat}, raw for {n_raw}"
    return chat if n_chat else "raw"


def fit_budget(plan: Plan, max_prompt_tokens: int, overlong: str) -> Plan | None:
    """The plan if its prompt tokens fit; else None (``drop``) or a shortened plan (``truncate``).

    Truncation keeps the leading answers whose prompts fit; if the first prompt alone is too
    long, its last ``max_prompt_tokens`` tokens are kept (the end holds the question).
    """
    if overlong not in OVERLONG:
        raise DataError(f"overlong must be one of {', '.join(OVERLONG)}, got '{overlong}'")
    if plan.prompt_tokens <= max_prompt_tokens:
        return plan
    if overlong == "drop":
        return None
    total, keep = 0, 0
    for ids in plan.piece_ids:
        if total + len(ids) > max_prompt_tokens:
            break
        total, keep = total + len(ids), keep + 1
    if keep == 0:
        first = plan.piece_ids[0][-max_prompt_tokens:]
        return replace(plan, pieces=plan.pieces[:1], piece_ids=[first], truncated=True)
    return replace(plan, pieces=plan.pieces[:keep], piece_ids=plan.piece_ids[:keep], truncated=True)
