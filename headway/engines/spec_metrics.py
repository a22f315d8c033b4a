"""vLLM's speculative-decoding counters, read the same way for vLLM and for headway's decoder, and
the verdict on whether the two engines agree.

vLLM counts, per engine since it started (``LLM(..., disable_log_stats=False)``, then
``llm.get_metrics()``): ``vllm:spec_decode_num_drafts`` (verification steps that carried a draft),
``..._num_draft_tokens``, ``..._num_accepted_tokens`` and ``..._num_accepted_tokens_per_pos`` (how
often draft position k was accepted). The worker returns them after each request; the difference
between two readings is that request's share (``SpecCounters.minus``), which is how a category's
counts are read from one engine. headway's decoder gives the same four numbers: drafts = its
verification forwards, accepted per position = ``accepted_per_depth``.

τ here is vLLM's mean acceptance length, 1 + accepted / drafts (bonus token included, the
prefill's token left out): the figure EAGLE's and Medusa's papers report, which ``headway bench``
reports as ``acceptance_length``. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

PREFIX = "vllm:spec_decode"
DRAFTS = f"{PREFIX}_num_drafts"
DRAFT_TOKENS = f"{PREFIX}_num_draft_tokens"
ACCEPTED = f"{PREFIX}_num_accepted_tokens"
PER_POSITION = f"{PREFIX}_num_accepted_tokens_per_pos"


@dataclass(frozen=True)
class SpecCounters:
    drafts: int = 0  # verification steps with a draft
    draft_tokens: int = 0  # tokens drafted over those steps
    accepted: int = 0  # draft tokens accepted
    per_position: tuple[int, ...] = ()  # steps that accepted draft position k + 1

    @classmethod
    def from_metrics(cls, metrics: dict[str, Any]) -> "SpecCounters":
        """A worker's reading (``{name: number or [number per position]}``); absent counters are 0."""
        def count(name: str) -> int:
            value = metrics.get(name, 0)
            return int(sum(value) if isinstance(value, (list, tuple)) else value)

        per_pos = metrics.get(PER_POSITION) or []
        return cls(count(DRAFTS), count(DRAFT_TOKENS), count(ACCEPTED), tuple(int(v) for v in per_pos))

    @classmethod
    def from_steps(cls, drafts: int, per_position: Sequence[int], k: int) -> "SpecCounters":
        """headway's decoder: ``drafts`` verification forwards of a k-token chain, each position's acceptances."""
        per_pos = tuple(int(n) for n in per_position[:k]) + (0,) * max(0, k - len(per_position))
        return cls(drafts, drafts * k, sum(per_pos), per_pos)

    def minus(self, earlier: "SpecCounters") -> "SpecCounters":
        """The counts since the reading ``earlier`` (one request's share)."""
        n = max(len(self.per_position), len(earlier.per_position))
        pad = lambda v: v + (0,) * (n - len(v))  # noqa: E731
        return SpecCounters(self.drafts - earlier.drafts, self.draft_tokens - earlier.draft_tokens,
                            self.accepted - earlier.accepted,
                            tuple(a - b for a, b in zip(pad(self.per_position), pad(earlier.per_position))))

    @property
    def tau(self) -> float | None:
        """Mean acceptance length: 1 + accepted / drafts (None without drafts)."""
        return 1 + self.accepted / self.drafts if self.drafts else None

    def rates(self) -> list[float]:
        """Acceptance rate by draft position: the share of drafts whose position k + 1 was accepted."""
        return _rates(self.per_position, self.drafts)

    def as_dict(self) -> dict[str, Any]:
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted": self.accepted,
                "accepted_per_position": list(self.per_position), "tau": self.tau,
                "rate_per_position": [round(r, 4) for r in self.rates()]}


def parity_problems(category: str, headway: SpecCounters, vllm: SpecCounters, tolerance: float) -> list[str]:
    """Why the engines disagree on ``category`` ([] when they agree). ``tolerance`` 0: equal counts
    (drafts and acceptances per position: what every correct export has shown in float32 on CPU);
    above 0: each position's acceptance rate within ``tolerance`` of the other engine's."""
    n = max(len(headway.per_position), len(vllm.per_position))
    hw = headway.per_position + (0,) * (n - len(headway.per_position))
    vl = vllm.per_position + (0,) * (n - len(vllm.per_position))
    said = f"vLLM accepted {list(vl)} of {vllm.drafts} drafts, headway {list(hw)} of {headway.drafts}"
    if tolerance == 0:
        if hw != vl or headway.drafts != vllm.drafts:
            return [f"category '{category}': {said} (equal counts expected; tolerance=R allows a rate gap)"]
        return []
    gaps = [(k + 1, abs(a - b)) for k, (a, b) in enumerate(zip(_rates(hw, headway.drafts), _rates(vl, vllm.drafts)))]
    over = [(k, g) for k, g in gaps if g > tolerance]
    if over:
        where = ", ".join(f"position {k} by {g:.3f}" for k, g in over)
        return [f"category '{category}': acceptance rates differ beyond the tolerance {tolerance:g} at {where} ({said})"]
    return []


def _rates(counts: Sequence[int], drafts: int) -> list[float]:
    return [c / drafts if drafts else 0.0 for c in counts]
