"""The gate's measurement: tau through headway's own decoder on the held-out prompts.

Both heads (the served ones before, the new ones after) run ``Speculator.generate`` on the same
held-out prompts, greedy, with the same ``max_new_tokens`` and the same tree (the gate's, never one
stored with either heads), on the same target in the same process. Greedy speculative output is
the target's own, so both write the same tokens (checked: ``output_digest``) and only the number
of target forwards differs: tau = tokens written after the prefill's / verify forwards, pooled over
the prompts. This is the number ``headway bench`` reports, on prompts of the new traffic; training's
teacher-forced ``tau_decode`` is computed on training's own split and is recorded beside it, not
gated on.

A held-out prompt is formatted as ``headway distill`` asks it (``data.plans``): a conversation with
earlier assistant turns keeps them as logged (the target is asked the last user turn).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from .errors import AdaptError


@dataclass
class Measured:
    tau: float
    new_tokens: int  # tokens written after the prefill's first one, over every prompt
    forwards: int  # verify forwards of the target
    prompts: int
    seconds: float
    accepted_per_depth: list[int] = field(default_factory=list)  # drafts accepted at depth d + 1
    output_digest: str = ""  # of every prompt's output ids: equal for any two heads on one target (greedy)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_ids(row: dict[str, Any], index: int, tokenizer: Any, template: str | None, prompt_format: str,
                target: str) -> list[int]:
    """The token ids a held-out prompts row conditions the target on before the answer it measures."""
    from ..data.plans import make_plan
    from ..data.samples import normalize_row

    sample = normalize_row(row, index, f"held-out prompt {index}")
    plan = make_plan(index, sample, tokenizer, template, prompt_format, target)
    if len(plan.pieces) == 1:
        return plan.piece_ids[0]
    answers = [m["content"] for m in sample.messages or [] if m["role"] == "assistant"]
    text = "".join(p + a for p, a in zip(plan.pieces, answers)) + plan.pieces[-1]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def heldout_ids(rows: list[dict[str, Any]], tokenizer: Any, template: str | None, prompt_format: str, target: str,
                room: int) -> list[list[int]]:
    """The held-out prompts as ids, those that leave ``room`` positions for the answer and the tree."""
    ids = [measure_ids(r, i, tokenizer, template, prompt_format, target) for i, r in enumerate(rows)]
    kept = [x for x in ids if 0 < len(x) <= room]
    if not kept:
        raise AdaptError(f"none of the {len(rows)} held-out prompts fits the target's context with the gate's "
                         "max_new_tokens; lower gate.max_new_tokens")
    return kept


def decoder_tau(target: nn.Module, tokenizer: Any, heads_dir: Path, prompts: list[list[int]], max_new_tokens: int,
                tree: str | None) -> Measured:
    """Greedy generation of every prompt with these heads; tau pooled over the prompts."""
    from ..decode import Speculator
    from ..heads import load_heads

    heads = load_heads(heads_dir, target=target, tokenizer=tokenizer)
    spec = Speculator(target, tokenizer, heads, tree=tree)
    start = time.perf_counter()
    new = forwards = 0
    depth: list[int] = []
    digest = hashlib.sha256()
    for ids in prompts:
        out = spec.generate(ids, max_new_tokens=max_new_tokens, temperature=0.0)
        new += out.stats.new_tokens - 1
        forwards += out.stats.target_forwards
        acc = out.stats.accepted_per_depth
        depth = [a + b for a, b in zip(depth + [0] * (len(acc) - len(depth)), acc + [0] * (len(depth) - len(acc)))]
        digest.update(json.dumps(out.ids).encode())
    return Measured(new / forwards if forwards else 1.0, new, forwards, len(prompts),
                    round(time.perf_counter() - start, 2), depth, digest.hexdigest()[:16])
