"""Chat templates: rendering conversations into text pieces, and finding the assistant tokens.

Two jobs, both pure given a tokenizer:

- ``conversation_pieces`` splits a conversation's rendered text around its assistant turns,
  so distillation can tokenise the template text and append the target's own tokens in
  between (every answer is generated conditioned on exactly the tokens stored before it);
- ``assistant_mask`` marks the assistant tokens of a conversation that already has answers,
  via ``{% generation %}`` markers when the template has them, else by rendering prefixes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .errors import ChatTemplateError, DataError, one_line
from .samples import Message

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
_SENTINEL = "\ue000HEADWAY-ANSWER-{}\ue001"


def load_chat_template(tokenizer: Any, path: str | None) -> str | None:
    """Install the Jinja template at ``path`` (if given) on ``tokenizer``; return the template in effect."""
    if path:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ChatTemplateError(f"chat template file not found: {p}")
        tokenizer.chat_template = p.read_text(encoding="utf-8")
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: use the default one
        template = template.get("default") or next(iter(template.values()), None)
    return template or None


def require_template(template: str | None, target: str, where: str) -> str:
    if not template:
        raise ChatTemplateError(f"{where} holds chat messages but the tokenizer of '{target}' has no chat "
                                "template; pass --chat-template FILE.jinja (or use plain 'prompt' rows)")
    return template


def render(tokenizer: Any, messages: list[Message], template: str, add_generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja2 TemplateError, raise_exception() in the template, ...
        raise ChatTemplateError(f"the chat template failed to render a conversation: {one_line(e)}") from None


def conversation_pieces(tokenizer: Any, messages: list[Message], template: str) -> list[str]:
    """Template text around each assistant turn to generate.

    Every assistant turn (plus a final one when the conversation ends with another role) is
    replaced by a sentinel; the result is ``[before_1, between_1_2, ..., before_n]`` — n pieces for
    n answers — and the text after the last answer is dropped (the target's EOS ends the row).
    """
    msgs = [dict(m) for m in messages]
    if msgs[-1]["role"] != "assistant":
        msgs.append({"role": "assistant", "content": ""})
    n = 0
    for m in msgs:
        if m["role"] == "assistant":
            m["content"] = _SENTINEL.format(n)
            n += 1
    text = render(tokenizer, msgs, template)
    pieces = []
    for k in range(n):
        before, sep, text = text.partition(_SENTINEL.format(k))
        if not sep:
            raise ChatTemplateError("the chat template does not render assistant messages verbatim "
                                    f"(answer {k} went missing); it cannot be used for distillation")
        pieces.append(before)
    return pieces


def strip_stop_text(piece: str, stop_text: str | None) -> str:
    """Template text after an answer, minus the end-of-turn text the target already wrote."""
    if stop_text and piece.startswith(stop_text):
        return piece[len(stop_text):]
    return piece


def has_generation_markers(template: str) -> bool:
    return bool(GENERATION_MARKER.search(template))


def assistant_mask(tokenizer: Any, messages: list[Message], template: str) -> tuple[list[int], list[int]]:
    """(input_ids, mask) for a conversation with answers: mask 1 on assistant tokens only."""
    if has_generation_markers(template):
        try:
            out = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
        except Exception as e:
            raise ChatTemplateError(f"the chat template failed to render a conversation: {one_line(e)}") from None
        return list(out["input_ids"]), [int(b) for b in out["assistant_masks"]]
    full = render(tokenizer, messages, template)
    spans = assistant_char_spans(tokenizer, messages, template, full)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s < e_span and e > s_span for s_span, e_span in spans)) for s, e in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def assistant_char_spans(tokenizer: Any, messages: list[Message], template: str, full: str) -> list[tuple[int, int]]:
    """Character spans of each assistant answer in ``full``, found by rendering prefixes.

    A span covers the answer's (stripped) content plus the special token that closes the turn
    when one follows (e.g. ``<|im_end|>`` or ``</s>``): the target has to write it to stop.
    """
    special = sorted({t for t in tokenizer.all_special_tokens if t}, key=len, reverse=True)
    spans = []
    for j, m in enumerate(messages):
        if m["role"] != "assistant" or not m["content"].strip():
            continue
        before = render(tokenizer, messages[:j], template, add_generation_prompt=True) if j else ""
        through = render(tokenizer, messages[: j + 1], template)
        if not (full.startswith(through) and through.startswith(before)):
            raise DataError("the chat template renders earlier turns differently as the conversation grows; "
                            "add {% generation %} markers to it to mark assistant tokens")
        content = m["content"].strip()
        start = through.find(content, len(before))
        if start < 0:
            raise DataError(f"the chat template does not render assistant message {j} verbatim")
        end = start + len(content)
        rest = through[end:]
        gap = len(rest) - len(rest.lstrip(" "))
        closing = next((t for t in special if rest[gap:].startswith(t)), None)
        spans.append((start, end + gap + len(closing) if closing else end))
    return spans
