"""A suite's questions as the token ids the target is conditioned on, turn by turn.

A one-turn question is tokenised as ``headway bench`` and ``headway distill`` tokenise a prompt
(``data.plans.prompt_ids``: the chat template, or raw text where the target has none). A two-turn
question (MT-bench's) is one conversation, ``[user q1, assistant a1, user q2]`` in the target's chat
template, where ``a1`` is the target's **own** first answer (its greedy answer, token for token: the
answer every lossless method writes at T=0). The second turn's ids are the first turn's, then ``a1``,
then the template's text up to the second answer (``data.plans.turn_ids``, as distill conditions a
later answer). Both turns are timed, each in its question's category; every engine is given the
same ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..data.plans import Plan, describe_format, make_plan, turn_ids
from ..data.samples import Sample
from .suites import SuiteError, SuiteItem

Answer = Callable[[list[int]], list[int]]  # prompt ids -> the target's greedy answer ids (stop token included)


@dataclass(frozen=True)
class SuitePrompt:
    item: SuiteItem
    turn: int  # 1, or 2 for a two-turn question's second
    ids: list[int]

    @property
    def category(self) -> str:
        return self.item.category

    @property
    def name(self) -> str:
        return f"{self.item.id}" + (f"#turn{self.turn}" if len(self.item.turns) > 1 else "")


def question_sample(item: SuiteItem) -> Sample:
    """One question as a prompt source row: a plain prompt, or the conversation of a two-turn one (the
    assistant turn is a placeholder: the plan replaces it by the target's own answer)."""
    if len(item.turns) == 1:
        return Sample(item.id, prompt=item.turns[0])
    messages = []
    for i, text in enumerate(item.turns):
        messages += ([{"role": "assistant", "content": ""}] if i else []) + [{"role": "user", "content": text}]
    return Sample(item.id, messages=messages)


def question_plan(item: SuiteItem, tokenizer: Any, template: str | None, prompt_format: str, target: str) -> Plan:
    if len(item.turns) > 1 and not template:
        raise SuiteError(f"question {item.id} ({item.category}) has {len(item.turns)} turns, each asked after the "
                         f"target's previous answer in its chat template, and the tokenizer of '{target}' has "
                         "none: pass chat_template=FILE.jinja, or leave its category out with categories=...")
    return make_plan(0, question_sample(item), tokenizer, template, prompt_format, target)


def stop_text(answer: Sequence[int], stop_ids: Sequence[int], tokenizer: Any) -> str | None:
    """The end-of-turn text an answer wrote (its stop token, decoded); None when it ran out of tokens."""
    return tokenizer.decode(list(answer[-1:])) if answer and answer[-1] in stop_ids else None


@dataclass
class Built:
    prompts: list[SuitePrompt]  # every turn that fits the context, in question order
    answers: dict[int, list[int]]  # prompt index -> the target's greedy answer, where a later turn needed it
    format: str  # how the prompts were formatted, for the report
    too_long: list[str]  # the turns left out: no room for a new token in the target's context


def suite_prompts(items: Sequence[SuiteItem], tokenizer: Any, template: str | None, prompt_format: str,
                  target: str, answer: Answer, stop_ids: Sequence[int], room: int,
                  template_from: str | None = None) -> Built:
    """Every question's turns as token ids. ``answer`` is called once per turn that another turn
    follows; a turn whose ids fill the target's context (``room`` positions) is left out, with the
    turns after it."""
    plans = [question_plan(item, tokenizer, template, prompt_format, target) for item in items]  # all checked first
    built = Built([], {}, describe_format(["raw" if p.raw else "chat" for p in plans], template_from), [])
    for item, plan in zip(items, plans):
        ids = list(plan.piece_ids[0])
        for turn in range(1, len(plan.pieces) + 1):
            prompt = SuitePrompt(item, turn, ids)
            if len(ids) >= room:
                built.too_long += [SuitePrompt(item, t, []).name for t in range(turn, len(plan.pieces) + 1)]
                break
            built.prompts.append(prompt)
            if turn < len(plan.pieces):
                reply = answer(ids)
                built.answers[len(built.prompts) - 1] = reply
                ids = ids + list(reply) + turn_ids(plan, turn, tokenizer, stop_text(reply, stop_ids, tokenizer))
    return built
